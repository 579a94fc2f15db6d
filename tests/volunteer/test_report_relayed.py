"""Relayed bytes in the volunteer's reports (volunteer.reporting, issue 14): what the relay sources return
goes into exactly one report, survives a restart through the journal, comes back when a report is given
up (the evidence only when the backbone did not refuse it), and the ledger credits the relay."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import msgspec
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.bulk import BulkHeader
from protocols.ledger import MAX_RELAYED_PER_REPORT, ContributionReport
from shared.auth.keys import Identity
from shared.net.addresses import parse_multiaddr, relayed
from shared.net.bulk import BulkReader
from shared.net.host import Host, HostConfig
from shared.net.relay import RelayClient, RelayService
from shared.net.relaytraffic import relayed_since
from shared.net.rpc import RequestContext
from tests.backbone.pinned_api import member_client, serve_pinned_api
from volunteer.collab.optimizer import StepRecord
from volunteer.reporting import Reporter

ALICE = Identity.generate()
RELAYS = [Identity.generate().peer_id for _ in range(MAX_RELAYED_PER_REPORT + 2)]


def step(number: int) -> StepRecord:
    return StepRecord(
        step=number,
        samples=8,
        compute_seconds=0.1,
        bytes_aggregated=0,
        peers=2,
        loss=None,
        seconds=0.1,
        finished_at=time.time(),
        fingerprint=b"f",
    )


class Sources:
    """Delta-readable relay counters, as the host's RelayTraffic and relayed_since give them."""

    def __init__(self) -> None:
        self.through: Counter[str] = Counter()
        self.claim = 0
        self.produced_through: Counter[str] = Counter()
        self.produced_claim = 0

    def add(self, relay: str, received: int, spliced: int) -> None:
        self.through[relay] += received
        self.produced_through[relay] += received
        self.claim += spliced
        self.produced_claim += spliced

    def take_through(self) -> dict[str, int]:
        taken, self.through = dict(self.through), Counter()
        return taken

    def take_claim(self) -> int:
        taken, self.claim = self.claim, 0
        return taken


def reporter(data_dir: Path, sources: Sources) -> Reporter:
    return Reporter(
        "r@x",
        ALICE,
        None,
        data_dir,
        interval=1e9,
        relay_traffic=sources.take_through,
        relayed=sources.take_claim,
    )


def queued(reporter: Reporter) -> list[ContributionReport]:
    return [msgspec.msgpack.decode(s.report, type=ContributionReport) for s, _ in reporter._pending]


def totals(reports: list[ContributionReport]) -> tuple[int, Counter[str]]:
    through: Counter[str] = Counter()
    for report in reports:
        for record in report.relayed_through:
            through[record.relay] += record.nbytes
    return sum(r.bytes_relayed for r in reports), through


def test_relayed_bytes_go_into_one_report_and_survive_a_restart(tmp_path: Path) -> None:
    sources = Sources()
    first = reporter(tmp_path, sources)
    sources.add(RELAYS[0], 1000, 5000)
    first.record(step(1))  # read and journaled with the step
    sources.add(RELAYS[1], 200, 0)
    first.close_interval()
    [report] = queued(first)
    assert report.bytes_relayed == 5000
    assert {r.relay: r.nbytes for r in report.relayed_through} == {RELAYS[0]: 1000, RELAYS[1]: 200}
    sources.add(RELAYS[0], 7, 70)
    first.record(step(2))  # read, journaled, then the process dies (no close, no flush)
    second = reporter(tmp_path, Sources())  # its own sources start from nothing
    assert [r.seq for r in queued(second)] == [0, 1]  # the same report 0, and one for what was open
    assert totals(queued(second)) == (5070, Counter({RELAYS[0]: 1007, RELAYS[1]: 200}))
    third = reporter(tmp_path, Sources())  # nothing new: nothing counted twice
    assert totals(queued(third)) == (5070, Counter({RELAYS[0]: 1007, RELAYS[1]: 200}))


def test_a_relay_without_steps_still_reports_and_busiest_relays_go_first(tmp_path: Path) -> None:
    sources = Sources()
    rep = reporter(tmp_path, sources)
    for i, relay in enumerate(RELAYS):
        sources.add(relay, 100 + i, 1)
    rep.close_interval()
    rep.close_interval()
    first, second = queued(rep)
    assert first.samples == 0 and len(first.relayed_through) == MAX_RELAYED_PER_REPORT
    assert min(r.nbytes for r in first.relayed_through) > max(r.nbytes for r in second.relayed_through)
    assert totals([first, second])[1] == sources.produced_through and second.bytes_relayed == 0


def test_a_refused_report_puts_back_its_claim_but_not_its_evidence(tmp_path: Path) -> None:
    sources = Sources()
    rep = reporter(tmp_path, sources)
    sources.add(RELAYS[0], 300, 900)
    rep.close_interval()
    _, report = rep._pending.popleft()
    rep._give_up(report, refused=True)
    rep.close_interval()
    [again] = queued(rep)
    assert again.bytes_relayed == 900 and again.relayed_through == []
    replayed = reporter(tmp_path, Sources())
    assert totals(queued(replayed)) == (900, Counter())


_op = st.one_of(
    st.tuples(st.just("bytes"), st.integers(0, 3), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("step")),
    st.tuples(st.just("close")),
    st.tuples(st.just("restart")),
    st.tuples(st.just("overflow")),
    st.tuples(st.just("refuse")),
)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(_op, max_size=25))
def test_no_relayed_byte_is_lost_or_counted_twice_across_restarts_and_given_up_reports(
    ops: list[tuple[object, ...]],
) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        data_dir = Path(directory)
        sources = Sources()
        rep = reporter(data_dir, sources)
        lost: Counter[str] = Counter()  # evidence of refused reports: dropped on purpose
        unread: Counter[str] = Counter()  # counted by a process that died before reading it
        unread_claim = 0
        number = 0
        for op in ops:
            if op[0] == "bytes":
                _, which, received, spliced = op
                sources.add(RELAYS[int(which)], int(received), int(spliced))
            elif op[0] == "step":
                number += 1
                rep.record(step(number))
            elif op[0] == "close":
                rep.close_interval()
            elif op[0] == "restart":  # killed: a new process, fresh counters, the same data dir
                unread.update(sources.through)
                unread_claim += sources.claim
                sources.through, sources.claim = Counter(), 0
                rep = reporter(data_dir, sources)
            elif rep._pending:  # a report given up: the queue overflowed, or the backbone refused it
                _, report = rep._pending.pop()
                if op[0] == "refuse":
                    lost.update({r.relay: r.nbytes for r in report.relayed_through})
                rep._give_up(report, refused=op[0] == "refuse")
        rep.close_all()
        claim, through = totals(queued(rep))
        # everything read arrives exactly once (what a killed process never read is gone with it)
        assert claim == sources.produced_claim - unread_claim
        assert through + lost + unread == +sources.produced_through
        replayed = reporter(data_dir, Sources())
        assert totals(queued(replayed)) == (claim, through)  # the journal holds exactly the same


async def test_the_ledger_credits_the_relay_what_its_client_received_through_it(tmp_path: Path) -> None:
    async with serve_pinned_api(tmp_path / "bb") as api:
        carl, rita = member_client(api, "carl"), member_client(api, "rita")
        assert carl.identity is not None and rita.identity is not None
        (tmp_path / "carl").mkdir()
        (tmp_path / "rita").mkdir()
        through = Sources()
        through.add(rita.identity.peer_id, 4000, 0)
        client = Reporter(
            api.run_id, carl.identity, carl, tmp_path / "carl", relay_traffic=through.take_through
        )
        claim = Sources()
        claim.add(RELAYS[0], 0, 6000)
        relay = Reporter(api.run_id, rita.identity, rita, tmp_path / "rita", relayed=claim.take_claim)
        relay.close_interval()
        await relay.flush()
        client.close_interval()
        await client.flush()  # late evidence: credited to rita at once
        assert (relay.sent, client.sent) == (1, 1)
        assert {r.username: r.bytes_relayed for r in api.store.leaderboard()} == {"carl": 0, "rita": 4000}


async def test_end_to_end_a_real_relay_is_credited_what_its_two_ends_received_through_it(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Three admitted volunteers of three users: tess behind a relay of rita's, carl sending her 1 MiB
    through it. Each reports what its host counted; the ledger credits rita the bytes carl and tess
    received through her relay (a little below what she spliced: TLS's overhead)."""
    async with serve_pinned_api(tmp_path / "bb") as api:
        clients = {name: member_client(api, name) for name in ("rita", "tess", "carl")}
        hosts = {}
        for name, client in clients.items():
            assert client.identity is not None
            hosts[name] = Host(client.identity, api.run_id, HostConfig(dial_deadline=5))
            await nursery.start(hosts[name].run)
        relay_at = parse_multiaddr(hosts["rita"].listen_addrs[0])
        service = RelayService(hosts["rita"])
        spliced = relayed_since(service)
        await RelayClient(hosts["tess"]).reserve(relay_at)

        async def sink(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
            buffer = bytearray(header.nbytes)
            await reader.read_into(memoryview(buffer))
            return b"ok"

        hosts["tess"].bulk_handlers["sink"] = sink
        with trio.fail_after(20):
            ack = await hosts["carl"].send_bulk(
                relayed(relay_at, hosts["tess"].peer_id), "sink", b"x" * (1 << 20)
            )
        assert ack == b"ok"
        reporters = {}
        for name, client in clients.items():
            assert client.identity is not None
            (tmp_path / name).mkdir()
            reporters[name] = Reporter(
                api.run_id,
                client.identity,
                client,
                tmp_path / name,
                relay_traffic=hosts[name].relay_traffic.take,
                relayed=spliced if name == "rita" else None,
            )
        received = claim = 0
        for name in ("carl", "rita", "tess"):  # the relay's report between its clients': late evidence too
            reporters[name].close_interval()
            [report] = queued(reporters[name])
            assert [r.relay for r in report.relayed_through] == (
                [] if name == "rita" else [hosts["rita"].peer_id]
            )
            received += sum(r.nbytes for r in report.relayed_through)
            claim += report.bytes_relayed
            await reporters[name].flush()
            assert reporters[name].sent == 1
        assert 0.97 * claim <= received <= claim  # TLS's framing and handshakes: a few percent
        board = {r.username: r.bytes_relayed for r in api.store.leaderboard()}
        assert board["carl"] == board["tess"] == 0
        assert board["rita"] == received >= 1 << 20  # what both ends received, the 1 MiB among it
