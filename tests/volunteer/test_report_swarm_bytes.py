"""Swarm bytes in the volunteer's reports (volunteer.reporting, "Swarm bytes"; issue 17 item 6): what the
``swarm_traffic`` source returns (our bytes sent, the answer bytes received from each stage server) goes
into exactly one report, survives a restart through the journal, comes back when a report is given up
(the evidence only when the backbone did not refuse it); and the session's source
(volunteer.swarm.traffic.TrafficReader) reads each counter once, also across a server replaced by a move."""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.ledger import MAX_RECEIVED_PER_REPORT, ContributionReport
from shared.auth.keys import Identity
from volunteer.reporting import Reporter
from volunteer.swarm.session import CarriedBatch
from volunteer.swarm.traffic import TrafficReader

ALICE = Identity.generate()
SERVERS = [Identity.generate().peer_id for _ in range(MAX_RECEIVED_PER_REPORT + 2)]


class Source:
    """A delta-readable swarm traffic counter, as TrafficReader gives it."""

    def __init__(self) -> None:
        self.sent = 0
        self.received: Counter[str] = Counter()
        self.produced_sent = 0
        self.produced_received: Counter[str] = Counter()

    def add(self, server: str, received: int, sent: int) -> None:
        self.received[server] += received
        self.produced_received[server] += received
        self.sent += sent
        self.produced_sent += sent

    def __call__(self) -> tuple[int, dict[str, int]]:
        taken = (self.sent, dict(self.received))
        self.sent, self.received = 0, Counter()
        return taken


def reporter(data_dir: Path, source: Source) -> Reporter:
    return Reporter("r@x", ALICE, None, data_dir, interval=1e9, swarm_traffic=source)


def queued(rep: Reporter) -> list[ContributionReport]:
    return [msgspec.msgpack.decode(s.report, type=ContributionReport) for s, _ in rep._pending]


def totals(reports: list[ContributionReport]) -> tuple[int, Counter[str]]:
    received: Counter[str] = Counter()
    for report in reports:
        for record in report.received_from:
            received[record.server] += record.nbytes
    return sum(r.bytes_sent for r in reports), received


def test_swarm_bytes_go_into_one_report_and_survive_a_restart(tmp_path: Path) -> None:
    source = Source()
    first = reporter(tmp_path, source)
    source.add(SERVERS[0], 1000, 5000)
    first.record(CarriedBatch(0, 8, time.time()))  # read and journaled with the micro-batch
    source.add(SERVERS[1], 200, 0)
    first.close_interval()
    [report] = queued(first)
    assert report.bytes_sent == 5000
    assert {r.server: r.nbytes for r in report.received_from} == {SERVERS[0]: 1000, SERVERS[1]: 200}
    source.add(SERVERS[0], 7, 70)
    first.record(CarriedBatch(0, 8, time.time()))  # read, journaled, then the process dies
    second = reporter(tmp_path, Source())
    assert [r.seq for r in queued(second)] == [0, 1]
    assert totals(queued(second)) == (5070, Counter({SERVERS[0]: 1007, SERVERS[1]: 200}))
    third = reporter(tmp_path, Source())  # nothing new: nothing counted twice
    assert totals(queued(third)) == (5070, Counter({SERVERS[0]: 1007, SERVERS[1]: 200}))


def test_a_server_without_steps_still_reports_and_the_busiest_servers_go_first(tmp_path: Path) -> None:
    source = Source()
    rep = reporter(tmp_path, source)
    for i, server in enumerate(SERVERS):
        source.add(server, 100 + i, 1)
    rep.close_interval()
    rep.close_interval()
    first, second = queued(rep)
    assert first.samples == 0 and len(first.received_from) == MAX_RECEIVED_PER_REPORT
    assert min(r.nbytes for r in first.received_from) > max(r.nbytes for r in second.received_from)
    assert totals([first, second]) == (len(SERVERS), source.produced_received)


def test_a_refused_report_puts_back_its_claim_but_not_its_evidence(tmp_path: Path) -> None:
    source = Source()
    rep = reporter(tmp_path, source)
    source.add(SERVERS[0], 300, 900)
    rep.close_interval()
    _, report = rep._pending.popleft()
    rep._give_up(report, refused=True)
    rep.close_interval()
    [again] = queued(rep)
    assert again.bytes_sent == 900 and again.received_from == []
    assert totals(queued(reporter(tmp_path, Source()))) == (900, Counter())


_op = st.one_of(
    st.tuples(st.just("bytes"), st.integers(0, 3), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("batch")),
    st.tuples(st.just("close")),
    st.tuples(st.just("restart")),
    st.tuples(st.just("overflow")),
    st.tuples(st.just("refuse")),
)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(_op, max_size=25))
def test_no_swarm_byte_is_lost_or_counted_twice_across_restarts_and_given_up_reports(
    ops: list[tuple[object, ...]],
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        data_dir = Path(directory)
        source = Source()
        rep = reporter(data_dir, source)
        lost: Counter[str] = Counter()  # evidence of refused reports: dropped on purpose
        unread: Counter[str] = Counter()  # counted by a process that died before reading it
        unread_sent = 0
        for op in ops:
            if op[0] == "bytes":
                _, which, received, sent = op
                source.add(SERVERS[int(which)], int(received), int(sent))
            elif op[0] == "batch":
                rep.record(CarriedBatch(0, 8, time.time()))
            elif op[0] == "close":
                rep.close_interval()
            elif op[0] == "restart":
                unread.update(source.received)
                unread_sent += source.sent
                source.received, source.sent = Counter(), 0
                rep = reporter(data_dir, source)
            elif rep._pending:
                _, report = rep._pending.pop()
                if op[0] == "refuse":
                    lost.update({r.server: r.nbytes for r in report.received_from})
                rep._give_up(report, refused=op[0] == "refuse")
        rep.close_all()
        sent, received = totals(queued(rep))
        assert sent == source.produced_sent - unread_sent
        assert received + lost + unread == +source.produced_received
        assert totals(queued(reporter(data_dir, Source()))) == (sent, received)


@dataclass
class _ServerStats:
    bytes_sent: int = 0


@dataclass
class _ClientStats:
    bytes_sent: int = 0
    received: dict[str, int] = field(default_factory=dict)


@dataclass
class _Client:
    stats: _ClientStats = field(default_factory=_ClientStats)


def test_the_traffic_reader_reads_each_counter_once_also_across_a_move() -> None:
    first, second = _ServerStats(), _ServerStats()
    current: list[_ServerStats | None] = [first]
    clients = [_Client()]
    read = TrafficReader(lambda: current[0], clients)
    first.bytes_sent = 100
    clients[0].stats.bytes_sent = 10
    clients[0].stats.received = {"s1": 5}
    assert read() == (110, {"s1": 5})
    assert read() == (0, {})
    first.bytes_sent = 130  # the last answers of the old server, then it is replaced by a move
    current[0] = second
    second.bytes_sent = 40
    clients.append(_Client(_ClientStats(7, {"s1": 1, "s2": 2})))  # a trainer started later
    clients[0].stats.received = {"s1": 9}
    assert read() == (30 + 40 + 7, {"s1": 4 + 1, "s2": 2})
    first.bytes_sent = 1000  # the old server is forgotten once read
    current[0] = None
    second.bytes_sent = 50
    assert read() == (10, {})
    assert read() == (0, {})
