"""The reporter's journal (volunteer.journal): replay never fails on damaged bytes, compaction keeps the
state it replays to, the file stays bounded, and discarded steps survive a restart until reported."""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.ledger import ContributionReport
from shared.auth.keys import Identity
from tests.backbone.ledger.reports import part_receipt
from volunteer import journal
from volunteer.journal import JOURNAL_FILE, JournaledStep, decode_lines, encode_line
from volunteer.receipts import ReceiptBook
from volunteer.reporting import Reporter

ALICE, BOB = Identity.generate(), Identity.generate()
RUN = "r@x"


def step(number: int, at: float) -> JournaledStep:
    return JournaledStep(number, 32, 0.5, 0, at)


def fill(reporter: Reporter, first: int, last: int, start: float) -> None:
    for number in range(first, last + 1):
        signed = part_receipt(BOB, ALICE.peer_id, number, 32.0, RUN, 10, start)
        reporter.book.add(number, [(BOB.peer_id, signed)])
        reporter.record(step(number, start + number))


def decoded(reporter: Reporter) -> list[ContributionReport]:
    return [msgspec.msgpack.decode(s.report, type=ContributionReport) for s, _ in reporter._pending]


@settings(max_examples=60, deadline=None)
@given(
    cut=st.integers(0, 10_000),
    garbage=st.binary(max_size=200),
    where=st.integers(0, 10_000),
)
def test_replay_of_a_damaged_journal_never_raises_and_keeps_whole_lines(
    cut: int, garbage: bytes, where: int
) -> None:
    lines = [encode_line(step(n, 1.0 + n)) for n in range(1, 30)]
    data = b"".join(lines)
    data = data[: cut % (len(data) + 1)]  # a torn tail
    at = where % (len(data) + 1)
    damaged = data[:at] + garbage + data[at:]
    entries, _ = decode_lines(damaged)
    assert all(isinstance(e, JournaledStep) for e in entries)
    intact = decode_lines(data)[0]
    assert len(entries) >= len(intact) - 2  # garbage spoils at most the line it lands in, and the torn one
    assert set(entries) <= set(intact) | set(decode_lines(garbage + b"\n")[0])


def test_a_restart_keeps_queued_and_open_steps_and_the_compacted_journal_replays_the_same(
    tmp_path: Path,
) -> None:
    start = time.time()
    first = Reporter(RUN, ALICE, None, tmp_path, interval=2.5)
    fill(first, 1, 5, start)
    queued, open_steps = len(first._pending), len(first._open)
    assert (queued, open_steps) == (1, 2)
    second = Reporter(RUN, ALICE, None, tmp_path, interval=2.5)  # "restarted": the same state, reported
    assert second.recovered == (1, 2)
    assert [r.samples for r in decoded(second)] == [3 * 32, 2 * 32]
    assert [len(r.receipts) for r in decoded(second)] == [3, 2]
    assert [r.seq for r in decoded(second)] == [0, 1]
    third = Reporter(RUN, ALICE, None, tmp_path)  # nothing was acknowledged: all of it again, no new seq
    assert [r.seq for r in decoded(third)] == [0, 1] and third._seq == 2


def test_the_journal_stays_bounded_while_no_backbone_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal, "COMPACT_BYTES", 4096)
    monkeypatch.setattr(journal, "MAX_JOURNAL_BYTES", 64 * 1024)
    reporter = Reporter(RUN, ALICE, None, tmp_path, interval=0.0)
    reporter.client = None
    start = time.time()
    sizes = []
    for chunk in range(40):
        fill(reporter, 10 * chunk + 1, 10 * chunk + 10, start)
        sizes.append((tmp_path / JOURNAL_FILE).stat().st_size)
    assert max(sizes) <= 2 * 64 * 1024 + 8192
    again = Reporter(RUN, ALICE, None, tmp_path)
    assert again._seq == reporter._seq  # the seq survives compaction, whatever was dropped
    assert decoded(again)[-1].global_step == 400


def test_discarded_steps_survive_a_restart_and_go_out_in_the_next_report(tmp_path: Path) -> None:
    start = time.time()
    reporter = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)
    fill(reporter, 1, 4, start)
    reporter.discard(3, 4)  # the state we loaded replaced our steps 3 and 4
    reporter.discard(6, 6)
    reporter.discard(5, 5)
    restarted = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)
    [report] = decoded(restarted)
    assert [(r.first, r.last) for r in report.discarded] == [(3, 6)]
    assert report.samples == 2 * 32  # steps 3 and 4 are not claimed
    assert Reporter(RUN, ALICE, None, tmp_path)._discarded == []


def test_an_open_run_has_nothing_to_resend_after_a_restart(tmp_path: Path) -> None:
    reporter = Reporter(RUN, ALICE, None, tmp_path, interval=0.0)
    fill(reporter, 1, 3, time.time())
    trio.run(reporter.flush)  # no client: nothing to send, the reports are done with
    assert Reporter(RUN, ALICE, None, tmp_path).pending == 0


def test_a_receipt_book_replays_as_it_was(tmp_path: Path) -> None:
    book = ReceiptBook(ALICE.peer_id)
    entries = []
    for number in range(1, 6):
        signed = part_receipt(BOB, ALICE.peer_id, number, 1.0, RUN, 10, 1.0)
        entries.append(journal.booked(number, [(BOB.peer_id, signed)], []))
        book.add(number, [(BOB.peer_id, signed)])
    state = journal.replay_into(entries, ReceiptBook(ALICE.peer_id))
    assert state.book.held() == book.held()


def fingerprinted(reporter: Reporter, first: int, last: int, history: str, start: float) -> None:
    for number in range(first, last + 1):
        reporter.record(step(number, start + number), fingerprint=fp(history, number))


def fp(history: str, number: int) -> bytes:
    return f"{history[:4]:<4}{number:04d}".encode()


def test_the_lineage_of_reported_steps_survives_a_restart_and_compaction_less_its_discards(
    tmp_path: Path,
) -> None:
    start = time.time()
    first = Reporter(RUN, ALICE, None, tmp_path, interval=2.5)
    fingerprinted(first, 1, 6, "old", start)
    assert first.lineage == {n: fp("old", n) for n in range(1, 7)}
    first.discard(5, 6)  # a state we loaded replaced steps 5, 6: reported once, never compared again
    fingerprinted(first, 5, 5, "new", start + 10)  # step 5 taken again, open while the discard is pending
    expected = {**{n: fp("old", n) for n in range(1, 5)}, 5: fp("new", 5)}
    assert first.lineage == expected
    restarted = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)  # replays, compacts, closes a report
    assert restarted.lineage == expected
    assert Reporter(RUN, ALICE, None, tmp_path).lineage == expected  # from the compacted journal
    [*_, last] = decoded(restarted)
    assert [(r.first, r.last) for r in last.discarded] == [(5, 6)] and last.samples == 32  # the new 5


def test_a_retaken_open_step_survives_compaction_of_a_pending_discard(tmp_path: Path) -> None:
    start = time.time()
    reporter = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)
    fingerprinted(reporter, 1, 4, "old", start)
    reporter.discard(3, 4)
    fingerprinted(reporter, 3, 3, "new", start + 10)  # taken again, then the journal is compacted
    reporter._compact()
    replayed = reporter.journal.replay(ReceiptBook(ALICE.peer_id))
    assert [s.step for s in replayed.open_steps] == [1, 2, 3] and replayed.discarded == [(3, 4)]
    assert replayed.lineage == {1: fp("old", 1), 2: fp("old", 2), 3: fp("new", 3)}


def test_a_journal_of_an_older_version_without_fingerprints_loads_with_no_lineage(tmp_path: Path) -> None:
    start = time.time()
    old_step = (
        b'{"k":"stepped","step":7,"samples":32,"compute_seconds":0.5,"bytes_aggregated":0,"finished_at":%f}'
    )
    lines = [
        b'{"k":"state","seq":3,"last_end":%f,"last_step":6}' % start,
        old_step % (start + 1),
    ]
    (tmp_path / JOURNAL_FILE).write_bytes(b"".join(b"%08x %s\n" % (zlib.crc32(body), body) for body in lines))
    reporter = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)
    assert reporter.lineage == {} and reporter.last_step == 7 and reporter._seq == 4
    assert [r.samples for r in decoded(reporter)] == [32]  # the open step was reported
    reporter.record(step(8, start + 2), fingerprint=fp("run", 8))
    assert Reporter(RUN, ALICE, None, tmp_path).lineage == {8: fp("run", 8)}


def test_receipts_a_given_up_report_put_back_survive_compaction_every_one() -> None:
    """A given-up report's receipts go back under one step, more than a round books for a step; compaction
    must restore them as held, not book them again (booking keeps 2 per step: the rest were lost)."""
    book = ReceiptBook(ALICE.peer_id)
    book.add(11, [(BOB.peer_id, part_receipt(BOB, ALICE.peer_id, 11, 1.0, RUN, 10, 1.0))])
    back = [part_receipt(BOB, ALICE.peer_id, n, 1.0, RUN, 10, 1.0) for n in range(1, 11)]
    book.put_back(10, back, [])
    assert len(book) == 11
    entries = journal.compacted(3, 1.0, 11, book, [], [], [])
    replayed = journal.replay_into(entries, ReceiptBook(ALICE.peer_id)).book
    assert replayed.held() == book.held()
    assert len(replayed) == 11
    assert replayed.take()[0] == book.take()[0]  # the same receipts go out, in the same order
