"""Steps taken again after a discard are credited (volunteer.reporting, "Discards"; volunteer.receipts,
"Discards"): the report listing a discard has the ledger mark discarded every receipt of those steps in
the sender's reports up to it, so the receipts of the steps taken again before that report went out must
go out in a later one, and the fork's receipts still unsent must never go out after it.

The volunteer here took steps 1-5 on a fork (an aggregator of bob's signed its receipts), reported 1-4,
re-synced to the survivors' state at step 0 (discarding 1-5) and took steps 1-3 again with carol's
aggregator before its next report. It used to send the receipts of 1-3 (and the fork's of 5) with the
discard: the genuine steps 1-3 were never credited."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from backbone.ledger import LedgerStore
from protocols.ledger import ContributionReport, StageStepRange, StepRange
from protocols.receipts import decode_receipt
from shared.auth.keys import Identity
from tests.backbone.ledger.reports import admit_users, identity, part_receipt
from volunteer import journal, reporting
from volunteer.journal import JournaledStep
from volunteer.reporting import Reporter

ALICE, BOB, CAROL = identity(71), identity(72), identity(73)
RUN = "retaken@x"
SAMPLES = 32


def took(reporter: Reporter, aggregator: Identity, first: int, last: int, at: float) -> None:
    """Steps ``first..last`` taken with ``aggregator``: its receipt booked, then the step recorded."""
    for number in range(first, last + 1):
        signed = part_receipt(aggregator, ALICE.peer_id, number, SAMPLES, RUN, 100, at)
        reporter.book.add(number, [(aggregator.peer_id, signed)])
        reporter.record(JournaledStep(number, SAMPLES, 0.5, 0, at + number / 10))


def forked_then_retaken(data_dir: Path, start: float) -> Reporter:
    """The scenario of the module docstring, up to (not including) the report after the discard."""
    reporter = Reporter(RUN, ALICE, None, data_dir, interval=1e9)
    took(reporter, BOB, 1, 4, start)
    reporter.close_interval()  # report 0: the fork's steps 1-4 and their receipts
    took(reporter, BOB, 5, 5, start + 1)  # its receipt still in the book at the discard
    reporter.discard(1, 5)
    took(reporter, CAROL, 1, 3, start + 2)  # taken again before the discard's report went out
    return reporter


def reports(reporter: Reporter) -> list[ContributionReport]:
    return [report for _, report in reporter._pending]


def receipts_by_report(reporter: Reporter) -> dict[int, set[tuple[str, int]]]:
    """Per report seq: (signer, step) of each receipt it carries."""
    signer: dict[str, str] = {BOB.peer_id: "bob", CAROL.peer_id: "carol"}
    decoded = {r.seq: [decode_receipt(s.receipt) for s in r.receipts] for r in reports(reporter)}
    return {seq: {(signer[r.aggregator], r.step) for r in receipts} for seq, receipts in decoded.items()}


def test_receipts_of_steps_taken_again_go_out_after_the_discard_and_the_forks_never(tmp_path: Path) -> None:
    reporter = forked_then_retaken(tmp_path, time.time())
    reporter.close_all()
    [fork, discard, *later] = reports(reporter)
    assert [(r.first, r.last) for r in discard.discarded] == [(1, 5)]
    assert discard.samples == 3 * SAMPLES  # the steps taken again are claimed with the discard
    by_seq = receipts_by_report(reporter)
    assert by_seq[fork.seq] == {("bob", n) for n in range(1, 5)}
    assert by_seq[discard.seq] == set()
    assert set().union(*(by_seq[r.seq] for r in later)) == {("carol", n) for n in (1, 2, 3)}
    assert all(r.seq > discard.seq and not r.discarded for r in later)
    assert reporter.fork_receipts == 1  # bob's receipt of step 5: unsent at the discard, dropped


@pytest.mark.parametrize("compacted", [False, True])
def test_a_crash_between_the_discard_and_its_report_loses_no_receipt_taken_again(
    tmp_path: Path, compacted: bool
) -> None:
    """Killed before the discard's report was built (the journal as it was written, or compacted): the
    next process sends the discard first and the receipts of the steps taken again after it."""
    reporter = forked_then_retaken(tmp_path, time.time())
    if compacted:
        reporter._compact()
    reporter.journal.close()  # a SIGKILL: nothing more is written
    restarted = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)  # closes the discard's report
    [_, discard] = reports(restarted)
    assert [(r.first, r.last) for r in discard.discarded] == [(1, 5)] and not discard.receipts
    assert len(restarted.book) == 3  # carol's receipts, held for the next report
    restarted.journal.close()
    again = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)  # killed once more: still held
    assert len(again.book) == 3 and len(reports(again)) == 2
    again.close_all()
    by_seq = receipts_by_report(again)
    assert by_seq[discard.seq] == set()
    assert by_seq[discard.seq + 1] == {("carol", n) for n in (1, 2, 3)}
    assert ("bob", 5) not in set().union(*by_seq.values())


def test_the_ledger_credits_the_steps_taken_again_and_not_the_forks(tmp_path: Path) -> None:
    """End to end: the reporter's signed reports into a real SQLite ledger."""
    start = time.time()
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        admit_users(store, {"alice": ALICE, "bob": BOB, "carol": CAROL}, now=start - 3600)
        for number in range(1, 6):  # the run's steps (its own 1-5: the survivors')
            assert store.record_step(number, finished_at=start, loss=None, samples=0, peers=2)
        (tmp_path / "alice").mkdir()
        reporter = forked_then_retaken(tmp_path / "alice", start)
        reporter.close_all()
        for signed, report in reporter._pending:
            assert store.assess_and_record(signed, report, now=time.time() + 60) is not None
        [alice] = [row for row in store.leaderboard() if row.username == "alice"]
        # carol's three receipts count (each replaced bob's discarded one of its step); bob's of step 4
        # stays discarded, and his of step 5 was never sent
        assert (alice.samples, alice.discarded_samples) == (3 * SAMPLES, SAMPLES)
        assert store.discards(ALICE.peer_id) == [(1, 5)]
        notes = [store_report.notes for store_report in store.peer_reports(ALICE.peer_id)]
        assert "receipt_retaken: 3" in notes


def test_a_report_given_up_after_the_discard_puts_back_none_of_the_forks_receipts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue overflows (no backbone for hours) right after the discard's report: the oldest report,
    bob's receipts of the fork's steps 1-4, is given up. Put back and sent after the discard they would be
    credited as steps taken again (step 4 was not); carol's of the steps taken again stay."""
    monkeypatch.setattr(reporting, "MAX_PENDING_REPORTS", 2)
    reporter = forked_then_retaken(tmp_path, time.time())
    reporter.close_interval()  # the discard's report: the queue holds 2
    took(reporter, CAROL, 4, 4, time.time() + 3)
    reporter.close_interval()  # carol's receipts of 1-4: report 0 is given up
    assert [r.seq for r in reports(reporter)] == [1, 2]
    assert reporter.fork_receipts == 1 + 4 and len(reporter.book) == 0
    reporter.journal.close()
    assert len(Reporter(RUN, ALICE, None, tmp_path, interval=1e9).book) == 0  # the journal agrees


def test_an_overflowing_queue_gives_up_a_report_without_a_discard_before_one_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork's report went out (the ledger credited bob's receipts of steps 1-4); then no backbone
    answers for hours and the queue overflows with the discard's report oldest. Given up, the discard
    was lost and the fork's steps stayed credited for ever; the report given up is now a later one
    without a discard (its receipts go back into the book and out again), and the ledger hears of the
    discard."""
    monkeypatch.setattr(reporting, "MAX_PENDING_REPORTS", 2)
    start = time.time()
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        admit_users(store, {"alice": ALICE, "bob": BOB, "carol": CAROL}, now=start - 3600)
        for number in range(1, 6):
            assert store.record_step(number, finished_at=start, loss=None, samples=0, peers=2)
        (tmp_path / "alice").mkdir()
        reporter = forked_then_retaken(tmp_path / "alice", start)
        signed, fork = reporter._pending.popleft()  # report 0 delivered, as flush() does
        reporter.journal.append(journal.done(fork.seq))
        assert store.assess_and_record(signed, fork, now=time.time() + 60) is not None
        reporter.close_interval()  # report 1: the discard (carol's receipts held for the next)
        reporter.close_interval()  # report 2: carol's receipts of 1-3
        took(reporter, CAROL, 4, 4, start + 3)
        reporter.close_interval()  # report 3: the queue overflows
        assert [r.seq for r in reports(reporter)] == [1, 3]
        assert [(r.first, r.last) for r in reports(reporter)[0].discarded] == [(1, 5)]
        reporter.journal.close()
        restarted = Reporter(RUN, ALICE, None, tmp_path / "alice", interval=1e9)  # the journal agrees
        assert [r.seq for r in reports(restarted)] == [1, 3]
        monkeypatch.setattr(reporting, "MAX_PENDING_REPORTS", 100)  # a backbone answers again
        restarted.close_all()  # report 2's receipts, put back, go out again
        for signed, report in restarted._pending:
            assert store.assess_and_record(signed, report, now=time.time() + 60) is not None
        [alice] = [row for row in store.leaderboard() if row.username == "alice"]
        assert store.discards(ALICE.peer_id) == [(1, 5)]
        # carol's receipts of the steps taken again count (1-4), each replacing bob's discarded one
        assert (alice.samples, alice.discarded_samples) == (4 * SAMPLES, 0)


def test_the_overflow_victim_is_the_oldest_report_without_a_discard() -> None:
    def report(seq: int, discarded: bool = False, stage: bool = False) -> ContributionReport:
        return ContributionReport(
            run_id=RUN, peer_id=ALICE.peer_id, seq=seq, global_step=seq, samples=0, compute_seconds=0.0,
            bytes_aggregated=0, bytes_relayed=0, interval_start=0.0, interval_end=1.0,
            discarded=[StepRange(1, 2)] if discarded else [],
            stage_discarded=[StageStepRange(0, 1, 2)] if stage else [],
        )  # fmt: skip

    assert journal.overflow_victim([report(0), report(1, True)]) == 0
    assert journal.overflow_victim([report(0, True), report(1, stage=True), report(2)]) == 2
    assert journal.overflow_victim([report(0, True), report(1, stage=True)]) == 0
    with pytest.raises(ValueError, match="no queued report"):
        journal.overflow_victim([])
