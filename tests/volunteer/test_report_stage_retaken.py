"""Stage steps taken again after a stage discard are credited, and the fork's trainer's receipts still go
out before the discard (volunteer.receipts, "Stage discards"; volunteer.reporting, "Stage discards"): the
report listing a stage discard has the ledger mark discarded the sender's stage and trainer's receipts of
those stage steps in its reports up to it, so the receipts of the stage steps taken again before that
report went out must go out in a later one, the fork's stage receipts still unsent never, and the fork's
trainer's receipts still unsent in that report or before (their bytes stay evidence of our trainer's
sending).

Alice serves stage 1 and trains. On a fork she took stage steps 1-5 with bob (his aggregator signed her
stage receipts, his server her trainer's receipts), reported 1-4, re-synced to the survivors' stage state
at step 0 (discarding 1-5) and took 1-3 again with carol's aggregator, her trainer's backwards again
served by bob, whose tally of those steps restarted below the fork's, before her next report. It used to
send the receipts of 1-3 with the discard (never credited), the fork's stage receipt of 5 as well, and a
trainer's receipt of a step taken again smaller than the fork's unsent one was not even booked."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backbone.ledger import LedgerStore
from protocols.ledger import ContributionReport
from protocols.receipts import (
    MAX_RECEIPTS_PER_REPORT,
    PartReceipt,
    SignedReceipt,
    decode_receipt,
    sign_receipt,
)
from shared.auth.keys import Identity
from tests.backbone.ledger.reports import admit_users, identity
from volunteer import reporting
from volunteer.journal import JOURNAL_FILE, JournaledStep, ReportJournal
from volunteer.receipts import ReceiptBook
from volunteer.reporting import Reporter

ALICE, BOB, CAROL = identity(61), identity(62), identity(63)
SERVERS = [identity(64 + n) for n in range(5)]
RUN = "stage-retaken@x"
STAGE = 1
SAMPLES = 32  # stage-samples a stage step of ours accumulated
PART = 8.0  # a stage receipt's weight
FORK, AGAIN = 4.0, 2.0  # the trainer's receipts of bob's server: the fork's, and after his tally restarted
NBYTES = 1000  # the request bytes each trainer's receipt states
TRAINED = 10_000  # the stage-samples our trainer claims: never what bounds the credit here


def receipt(signer: Identity, step: int, weight: float, *, carried: bool) -> SignedReceipt:
    body = PartReceipt(
        run_id=RUN, aggregator=signer.peer_id, sender=ALICE.peer_id, step=step, group_id=b"s", round=0,
        weight=weight, nbytes=NBYTES if carried else 100, issued_at=1.0, stage=STAGE, carried=carried,
    )  # fmt: skip
    return sign_receipt(body, signer.sign)


def served(
    reporter: Reporter, aggregator: Identity, first: int, last: int, trainer_weight: float, at: float
) -> None:
    """Stage steps ``first..last`` taken with ``aggregator``, our trainer's backwards of each served by bob:
    both receipts booked, then the stage step recorded."""
    for number in range(first, last + 1):
        reporter.book.add(
            number, [(aggregator.peer_id, receipt(aggregator, number, PART, carried=False))], stage=STAGE
        )
        reporter.book.add(
            number, [(BOB.peer_id, receipt(BOB, number, trainer_weight, carried=True))], stage=STAGE
        )
        reporter.record(JournaledStep(number, SAMPLES, 0.5, 0, at + number / 10), stage=STAGE)


def forked_then_retaken(data_dir: Path, start: float) -> Reporter:
    """The scenario of the module docstring, up to (not including) the report after the discard."""
    reporter = Reporter(RUN, ALICE, None, data_dir, interval=1e9)
    reporter.record(JournaledStep(0, TRAINED, 0.0, 0, start))  # our trainer's micro-batches (no stage)
    served(reporter, BOB, 1, 4, FORK, start)
    reporter.close_interval()  # report 0: the fork's stage steps 1-4 and their receipts
    served(reporter, BOB, 5, 5, FORK, start + 1)  # its receipts still in the book at the discard
    reporter.discard_stage(STAGE, 1, 5)
    served(reporter, CAROL, 1, 3, AGAIN, start + 2)  # taken again before the discard's report went out
    return reporter


def reports(reporter: Reporter) -> list[ContributionReport]:
    return [report for _, report in reporter._pending]


def carried(reporter: Reporter) -> dict[int, set[tuple[str, int, float]]]:
    """Per report seq: (``stage`` or ``trainer``'s signer, step, weight) of each receipt it carries."""
    names = {
        BOB.peer_id: "bob",
        CAROL.peer_id: "carol",
        **{s.peer_id: f"s{n}" for n, s in enumerate(SERVERS)},
    }
    decoded = {r.seq: [decode_receipt(s.receipt) for s in r.receipts] for r in reports(reporter)}
    return {
        seq: {
            (("trainer " if r.carried else "stage ") + names[r.aggregator], r.step, r.weight)
            for r in receipts
        }
        for seq, receipts in decoded.items()
    }


FORKS_STAGE = {("stage bob", n, PART) for n in range(1, 5)} | {("trainer bob", n, FORK) for n in range(1, 5)}
TAKEN_AGAIN = {("stage carol", n, PART) for n in (1, 2, 3)} | {("trainer bob", n, AGAIN) for n in (1, 2, 3)}


def test_stage_steps_taken_again_go_out_after_the_discard_and_the_forks_trainers_with_it(
    tmp_path: Path,
) -> None:
    reporter = forked_then_retaken(tmp_path, time.time())
    reporter.close_all()
    [fork, discard, *later] = reports(reporter)
    assert [(r.stage, r.first, r.last) for r in discard.stage_discarded] == [(STAGE, 1, 5)]
    assert discard.samples == 3 * SAMPLES  # the stage steps taken again are claimed with the discard
    by_seq = carried(reporter)
    assert by_seq[fork.seq] == FORKS_STAGE
    assert by_seq[discard.seq] == {("trainer bob", 5, FORK)}  # sealed at the discard: its bytes count
    assert set().union(*(by_seq[r.seq] for r in later)) == TAKEN_AGAIN
    assert all(r.seq > discard.seq and not r.stage_discarded for r in later)
    assert reporter.fork_receipts == 1  # bob's stage receipt of step 5: unsent at the discard, dropped


@pytest.mark.parametrize("compacted", [False, True])
def test_a_crash_between_the_stage_discard_and_its_report_loses_no_receipt(
    tmp_path: Path, compacted: bool
) -> None:
    """Killed before the discard's report was built (the journal as it was written, or compacted): the
    next process sends the discard with the fork's trainer's receipt, and the stage steps taken again
    after it."""
    reporter = forked_then_retaken(tmp_path, time.time())
    if compacted:
        reporter._compact()
    reporter.journal.close()  # a SIGKILL: nothing more is written
    restarted = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)  # closes the discard's report
    [_, discard] = reports(restarted)
    assert [(r.stage, r.first, r.last) for r in discard.stage_discarded] == [(STAGE, 1, 5)]
    assert carried(restarted)[discard.seq] == {("trainer bob", 5, FORK)}
    assert len(restarted.book) == 6 and not restarted.book.sealed  # taken again: held for the next report
    restarted.journal.close()
    again = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)  # killed once more: still held
    assert len(again.book) == 6 and len(reports(again)) == 2
    again.close_all()
    by_seq = carried(again)
    assert by_seq[discard.seq] == {("trainer bob", 5, FORK)}
    assert by_seq[discard.seq + 1] == TAKEN_AGAIN


def test_no_stage_discard_goes_out_before_every_sealed_receipt_did(tmp_path: Path) -> None:
    """More of the fork's trainer's receipts than one report carries: the discard waits for the report that
    carries the last of them, and the stage step taken again goes out after it."""
    start = time.time()
    reporter = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)
    for number in range(1, 9):  # 5 servers x 8 stage steps: 40 > MAX_RECEIPTS_PER_REPORT
        for server in SERVERS:
            reporter.book.add(
                number, [(server.peer_id, receipt(server, number, FORK, carried=True))], stage=STAGE
            )
    assert len(reporter.book) > MAX_RECEIPTS_PER_REPORT
    reporter.discard_stage(STAGE, 1, 8)
    served(reporter, CAROL, 1, 1, AGAIN, start)  # the book is full: this closes a report
    reporter.close_all()
    [first, discard, *later] = reports(reporter)
    assert not first.stage_discarded and len(first.receipts) == MAX_RECEIPTS_PER_REPORT
    assert [(r.stage, r.first, r.last) for r in discard.stage_discarded] == [(STAGE, 1, 8)]
    by_seq = carried(reporter)
    sealed = {(f"trainer s{n}", step, FORK) for n in range(len(SERVERS)) for step in range(1, 9)}
    assert by_seq[first.seq] | by_seq[discard.seq] == sealed
    assert set().union(*(by_seq[r.seq] for r in later)) == {
        ("stage carol", 1, PART),
        ("trainer bob", 1, AGAIN),
    }
    restarted = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)  # the journal agrees
    assert carried(restarted) == by_seq and len(restarted.book) == 0


def test_a_report_given_up_after_the_discard_puts_back_none_of_the_forks_receipts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue overflows (no backbone for hours) after the discard's report: report 0, the fork's receipts
    of stage steps 1-4, is given up. Put back and sent after the discard they would be credited as stage
    steps taken again; the discard's report went out, so not even the trainer's can go before it."""
    monkeypatch.setattr(reporting, "MAX_PENDING_REPORTS", 2)
    reporter = forked_then_retaken(tmp_path, time.time())
    reporter.close_interval()  # the discard's report: the queue holds 2
    served(reporter, CAROL, 4, 4, AGAIN, time.time() + 3)
    reporter.close_interval()  # the receipts of 1-4 taken again: report 0 is given up
    assert [r.seq for r in reports(reporter)] == [1, 2]
    assert reporter.fork_receipts == 1 + 8 and len(reporter.book) == 0
    reporter.journal.close()
    assert len(Reporter(RUN, ALICE, None, tmp_path, interval=1e9).book) == 0  # the journal agrees


def test_a_report_given_up_before_the_discard_goes_out_seals_its_trainers_receipts(tmp_path: Path) -> None:
    """Report 0 is refused while the stage discard waits for a report: its trainer's receipts of the
    discarded stage steps go out with that discard's report (sealed again), its stage receipts never."""
    reporter = forked_then_retaken(tmp_path, time.time())
    _, report = reporter._pending.popleft()
    reporter._give_up(report, refused=True)  # as flush does when the backbone refuses it
    assert reporter.fork_receipts == 1 + 4 and len(reporter.book.sealed) == 5
    reporter.journal.close()
    restarted = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)  # the journal agrees; closes the discard's
    [discard] = reports(restarted)
    assert [(r.stage, r.first, r.last) for r in discard.stage_discarded] == [(STAGE, 1, 5)]
    assert carried(restarted)[discard.seq] == {("trainer bob", n, FORK) for n in range(1, 6)}
    restarted.close_all()
    assert carried(restarted)[discard.seq + 1] == TAKEN_AGAIN


def test_the_ledger_credits_the_stage_steps_taken_again_and_the_forks_trainer_bytes(tmp_path: Path) -> None:
    """End to end: the reporter's signed reports into a real SQLite ledger."""
    start = time.time()
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        admit_users(store, {"alice": ALICE, "bob": BOB, "carol": CAROL}, now=start - 3600)
        for number in range(1, 6):  # the stage's steps (its own 1-5: the survivors')
            assert store.record_stage_step(
                STAGE, number, finished_at=start, loss=None, samples=64, peers=2, target_batch=64
            )
        (tmp_path / "alice").mkdir()
        reporter = forked_then_retaken(tmp_path / "alice", start)
        traffic = iter([(100 * NBYTES, {})])  # the bytes our trainer sent, read once: never what bounds it
        reporter.swarm_traffic = lambda: next(traffic, (0, {}))
        reporter.close_all()
        for signed, report in reporter._pending:
            assert store.assess_and_record(signed, report, now=time.time() + 60) is not None
        [alice] = [row for row in store.leaderboard() if row.username == "alice"]
        # carol's stage receipts and bob's trainer's receipts of 1-3 count (each replaced the fork's
        # discarded one of its key); the fork's of step 4 stay discarded, bob's trainer's receipt of
        # step 5 too (his stage receipt of 5 was never sent)
        assert (alice.samples, alice.discarded_samples) == (3 * (PART + AGAIN), PART + 2 * FORK)
        # every trainer's receipt's bytes were evidence when it arrived: 1-4 with report 0, 5 with the
        # discard (dropped, it would not be)
        assert alice.bytes_sent == 5 * NBYTES
        assert store.stage_discards(ALICE.peer_id) == [(STAGE, 1, 5)]
        notes = [stored.notes for stored in store.peer_reports(ALICE.peer_id)]
        assert any(
            "stage_receipt_retaken: 3" in (n or "") and "trainer_receipt_retaken: 3" in (n or "")
            for n in notes
        )


_op = st.one_of(
    st.tuples(
        st.just("serve"), st.sampled_from([BOB, CAROL]), st.integers(1, 6), st.sampled_from([FORK, AGAIN])
    ),
    st.tuples(st.just("discard"), st.integers(1, 6), st.integers(0, 2)),
    st.tuples(st.just("close")),
    st.tuples(st.just("overflow")),
    st.tuples(st.just("refuse")),
)


def book_state(book: ReceiptBook) -> tuple[object, ...]:
    return book.held_by_stage(), book.sealed, len(book)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(_op, max_size=20))
def test_the_journal_replays_what_stage_discards_did_to_the_book(ops: list[tuple[object, ...]]) -> None:
    """After any sequence of serving, stage discards, reports and given-up reports, replaying the journal
    gives the book (sealed receipts included), the pending stage discards and the queue the live reporter
    has (a process killed at any point resumes exactly there)."""
    with tempfile.TemporaryDirectory() as directory:
        data_dir = Path(directory)
        reporter = Reporter(RUN, ALICE, None, data_dir, interval=1e9)
        start = time.time()
        for i, op in enumerate(ops):
            if op[0] == "serve":
                _, who, number, weight = op
                assert isinstance(who, Identity) and isinstance(number, int) and isinstance(weight, float)
                served(reporter, who, number, number, weight, start + i)
            elif op[0] == "discard":
                _, first, width = op
                assert isinstance(first, int) and isinstance(width, int)
                reporter.discard_stage(STAGE, first, first + width)
            elif op[0] == "close":
                reporter.close_interval()
            elif reporter._pending:  # given up: the queue overflowed (the oldest), or the backbone refused
                _, report = reporter._pending.popleft()
                reporter._give_up(report, refused=op[0] == "refuse")
            replayed = ReportJournal(data_dir / JOURNAL_FILE).replay(ReceiptBook(ALICE.peer_id))
            assert book_state(replayed.book) == book_state(reporter.book)
            assert replayed.stage_discarded == reporter._stage_discarded
            assert [r.seq for _, r in replayed.unsent] == [r.seq for r in reports(reporter)]
        reporter.journal.close()
