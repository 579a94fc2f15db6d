"""A swarm server's receipts (issue 17 item 6): its book keeps them per (stage, step), the journal replays
them so, and a stage's averager signs its stage into the receipts it issues and refuses those of another
stage; the backbone runs one step tracker per stage."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backbone.steps import watchers
from protocols.errors import ProtocolError
from protocols.receipts import RECEIPTS_PER_STEP, PartReceipt, PulledSlice, SignedReceipt, sign_receipt
from protocols.swarm import stage_training_keys
from protocols.training import PROGRESS_KEY, SyncSpec, TrainingSpec
from shared.averaging.allreduce import Averager
from tests.backbone.ledger.reports import identity, part_receipt
from volunteer import journal
from volunteer.receipts import ReceiptBook
from volunteer.training import Reporter

ALICE, BOB, CAROL = identity(41), identity(42), identity(43)
RUN = "stage-receipts-test"


def signed(aggregator=BOB, step=1):  # type: ignore[no-untyped-def]
    return part_receipt(aggregator, ALICE.peer_id, step, 8.0, RUN, 10, 1.0)


def test_the_book_does_not_mix_stages_of_one_step_number() -> None:
    book = ReceiptBook(ALICE.peer_id)
    book.add(5, [(BOB.peer_id, signed(BOB, 5)), (CAROL.peer_id, signed(CAROL, 5))], stage=0)
    book.add(5, [(BOB.peer_id, signed(BOB, 6)), (CAROL.peer_id, signed(CAROL, 6))], stage=1)
    book.add(5, [(BOB.peer_id, signed(BOB, 7))])  # a data-parallel step 5
    assert [(k, s, len(r)) for k, s, r, _ in book.held_by_stage()] == [(0, 5, 2), (1, 5, 2), (None, 5, 1)]
    receipts, _ = book.take()
    assert len(receipts) == 5 and len(book) == 0


@given(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 3)), st.integers(0, 6)), max_size=40))
def test_the_book_keeps_its_bounds_per_stage_step(adds: list[tuple[int | None, int]]) -> None:
    book = ReceiptBook(ALICE.peer_id, max_steps=8)
    for stage, step in adds:
        book.add(step, [(BOB.peer_id, signed(BOB, step)), (CAROL.peer_id, signed(CAROL, step))], stage=stage)
    held = book.held_by_stage()
    keys = [(stage, step) for stage, step, _, _ in held]
    assert len(held) <= 8 and len(set(keys)) == len(keys) and set(keys) <= set(adds)
    assert not adds or adds[-1] in keys  # the newest is kept, the oldest go first
    assert all(len(receipts) <= RECEIPTS_PER_STEP for _, _, receipts, _ in held)


def test_the_journal_replays_the_stages_of_the_book(tmp_path: Path) -> None:
    reporter = Reporter(RUN, ALICE, None, tmp_path, interval=3600.0)
    reporter.book.add(3, [(BOB.peer_id, signed(BOB, 3))], stage=2)
    reporter.book.add(3, [(CAROL.peer_id, signed(CAROL, 3))], [PulledSlice(CAROL.peer_id, 3, 9)])
    before = reporter.book.held_by_stage()
    again = Reporter(RUN, ALICE, None, tmp_path, interval=3600.0)  # a new process in the same data dir
    assert again.book.held_by_stage() == before
    # and after compaction (the journal rewritten from the book)
    again._compact()
    assert Reporter(RUN, ALICE, None, tmp_path, interval=3600.0).book.held_by_stage() == before


def test_a_data_parallel_journal_entry_keeps_its_shape() -> None:
    entry = journal.booked(1, [], [])
    assert b"stage" not in journal.encode_line(entry)  # old journals and new ones read alike
    assert journal.booked(1, [], [], 4) != entry


def test_a_swarm_backbone_tracks_every_stage_and_a_data_parallel_one_the_run() -> None:
    class Store:
        def record_step(self, *args: object, **kwargs: object) -> bool:
            return True

        def record_stage_step(self, *args: object, **kwargs: object) -> bool:
            return True

    swarm = TrainingSpec(target_batch=16, local_batch=4, sync=SyncSpec(mode="swarm", stages=3))
    tracked = watchers(Store(), swarm)  # type: ignore[arg-type]
    assert [w.key for w in tracked] == [stage_training_keys(k).progress for k in range(3)]
    assert [w.log.name for w in tracked] == ["stage 0", "stage 1", "stage 2"]
    assert [w.record.args for w in tracked] == [(0,), (1,), (2,)]  # type: ignore[attr-defined]
    [run] = watchers(Store(), TrainingSpec(target_batch=16, local_batch=4))  # type: ignore[arg-type]
    assert run.key == PROGRESS_KEY and run.log.name == "global"


def test_a_stage_averager_keeps_only_receipts_of_its_own_stage() -> None:
    """The member side of a round (shared.averaging.allreduce): a receipt must name the averager's stage."""
    plan = SimpleNamespace(
        members=[
            SimpleNamespace(peer_id=ALICE.peer_id, weight=8.0),
            SimpleNamespace(peer_id=BOB.peer_id, weight=8.0),
        ],
        group_id=b"g",
        round=0,
    )

    def averager(stage: int | None) -> SimpleNamespace:
        return SimpleNamespace(host=SimpleNamespace(run_id=RUN, peer_id=ALICE.peer_id), stage=stage)

    def issued(stage: int | None) -> SignedReceipt:
        body = PartReceipt(
            run_id=RUN, aggregator=BOB.peer_id, sender=ALICE.peer_id, step=4, group_id=b"g", round=0,
            weight=8.0, nbytes=1, issued_at=1.0, stage=stage,
        )  # fmt: skip
        return sign_receipt(body, BOB.sign)

    check = Averager._verify_receipt
    assert check(averager(1), plan, 0, 1, 4, issued(1)) == issued(1)  # type: ignore[arg-type]
    assert check(averager(None), plan, 0, 1, 4, issued(None)) == issued(None)  # type: ignore[arg-type]
    for mine, theirs in ((1, 2), (1, None), (None, 0)):
        with pytest.raises(ProtocolError, match="receipt is for"):
            check(averager(mine), plan, 0, 1, 4, issued(theirs))  # type: ignore[arg-type]
