"""Stage steps a swarm peer reports discarded (accounting's docstring, "Swarm runs", *discards*), on SQLite
and PostgreSQL (``store``): its stage and trainer's receipts of those stage steps carried by its reports up
to the discarding one are taken back and shown apart, later ones (the stage step taken again) count, other
stages, data-parallel steps and other peers are untouched, and a lying range costs only its sender."""

from __future__ import annotations

import msgspec
import pytest
import sqlalchemy

from backbone.ledger import LedgerStore
from backbone.ledger.schema import SCHEMA_VERSION
from protocols.ledger import MAX_COUNT, MAX_STAGE_DISCARDED_PER_REPORT, ContributionReport, StageStepRange
from protocols.receipts import MAX_STAGES

from .reports import T0, identity, make_report, receipt
from .test_stage_credit import join, record, samples, stage_receipt, stage_steps
from .test_trainer_credit import carried

ALICE, BOB, CAROL = identity(61), identity(62), identity(63)


def discarded_samples(store: LedgerStore) -> dict[str, int]:
    return {row.username: row.discarded_samples for row in store.leaderboard()}


def test_schema_12_has_the_stage_discards_table(store: LedgerStore, ledger_url: str) -> None:
    assert SCHEMA_VERSION >= 12
    engine = sqlalchemy.create_engine(ledger_url)
    try:
        with engine.connect() as conn:
            inspector = sqlalchemy.inspect(conn)
            assert "stage_discards" in inspector.get_table_names()
            assert "discarded" in {c["name"] for c in inspector.get_columns("trainer_receipts")}
    finally:
        engine.dispose()


def test_stage_steps_a_server_reports_discarded_are_taken_back_and_taken_again(store: LedgerStore) -> None:
    """Alice served stage 1 on the losing side of a partition (steps 2-4 only her side took), re-synced
    and reported them discarded: their credit is taken back, a receipt of one carried by a report sent
    before the discard but delivered after it counts nothing, the step taken again counts, and the
    leaderboard shows the fork's work apart."""
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 1, 1, 2, 3, 4)
    forked = [stage_receipt(BOB, ALICE, 1, s, 8) for s in (1, 2, 3)]
    assert record(store, ALICE, 0, samples=1000, receipts=forked).samples == 3 * 8
    discard = record(store, ALICE, 2, samples=0, stage_discarded=[(1, 2, 4)])
    assert discard.samples == -2 * 8
    late = record(store, ALICE, 1, samples=0, receipts=[stage_receipt(BOB, ALICE, 1, 4, 8)])
    assert late.samples == 0 and late.notes is None  # stored, as discarded
    assert (samples(store)["alice"], discarded_samples(store)["alice"]) == (8, 3 * 8)
    again = record(store, ALICE, 3, samples=0, receipts=[stage_receipt(CAROL, ALICE, 1, 3, 5)])
    assert again.notes == "stage_receipt_unknown_aggregator: 1"  # carol is nobody yet
    join(store, "carol", CAROL)
    again = record(store, ALICE, 4, samples=0, receipts=[stage_receipt(CAROL, ALICE, 1, 3, 5)])
    assert again.samples == 5 and again.notes == "stage_receipt_retaken: 1"
    stale = record(store, ALICE, 5, samples=0, receipts=[stage_receipt(BOB, ALICE, 1, 3, 8)])
    assert stale.samples == 0 and stale.notes == "stage_receipt_duplicate: 1"
    assert (samples(store)["alice"], discarded_samples(store)["alice"]) == (8 + 5, 2 * 8)
    assert store.stage_discards(ALICE.peer_id) == [(1, 2, 4)]
    assert store.discards(ALICE.peer_id) == []


def test_a_stage_discard_covers_only_its_stage_and_a_step_discard_no_stage(store: LedgerStore) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 0, 1, 2)
    stage_steps(store, 1, 1, 2)
    for step in (1, 2):
        store.record_step(step, finished_at=T0 + step, loss=None, samples=8, peers=2, target_batch=8)
    evidence = [stage_receipt(BOB, ALICE, k, s, 8) for k in (0, 1) for s in (1, 2)] + [
        receipt(BOB, ALICE, s, 8) for s in (1, 2)
    ]
    assert record(store, ALICE, 0, samples=1000, receipts=evidence).samples == 6 * 8
    assert record(store, ALICE, 1, samples=0, discarded=[(1, 2)]).samples == -2 * 8  # data-parallel only
    assert record(store, ALICE, 2, samples=0, stage_discarded=[(1, 1, 2)]).samples == -2 * 8  # stage 1 only
    assert samples(store)["alice"] == 2 * 8  # stage 0's steps 1-2


def test_a_lying_range_costs_only_its_sender(store: LedgerStore) -> None:
    """A range over every step of every stage (the largest the wire allows, at most as many as a report
    lists) is two numbers to the ledger: it discards its sender's own receipts, no one else's."""
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 0, 1, 2)
    record(store, BOB, 0, samples=1000, receipts=[stage_receipt(ALICE, BOB, 0, s, 8) for s in (1, 2)])
    record(store, ALICE, 0, samples=1000, receipts=[stage_receipt(BOB, ALICE, 0, s, 8) for s in (1, 2)])
    assert samples(store) == {"alice": 16, "bob": 16}
    lies = [(k, 0, MAX_COUNT) for k in range(MAX_STAGE_DISCARDED_PER_REPORT)]
    assert record(store, ALICE, 1, samples=0, stage_discarded=lies).samples == -16
    assert samples(store) == {"alice": 0, "bob": 16}
    assert discarded_samples(store) == {"alice": 16, "bob": 0}
    assert len(store.stage_discards(ALICE.peer_id)) == MAX_STAGE_DISCARDED_PER_REPORT
    # a report listing more ranges, a stage out of range or a reversed range never decodes
    fields = msgspec.structs.asdict(make_report(ALICE, 2))
    for bad in (
        [[0, 1, 2]] * (MAX_STAGE_DISCARDED_PER_REPORT + 1),
        [[MAX_STAGES, 1, 2]],
        [[0, 3, 2]],
        [[0, -1, 2]],
        [[0, 1, MAX_COUNT + 1]],
        [[0, 1]],
    ):
        data = msgspec.msgpack.encode({**fields, "stage_discarded": bad})
        with pytest.raises(msgspec.ValidationError, match="stage_discarded"):
            msgspec.msgpack.decode(data, type=ContributionReport)
    with pytest.raises(ValueError, match="at most"):
        make_report(ALICE, 2, stage_discarded=[(0, 1, 2)] * (MAX_STAGE_DISCARDED_PER_REPORT + 1))
    with pytest.raises(ValueError, match="stage"):
        StageStepRange(MAX_STAGES, 1, 2)


def test_a_trainers_receipts_of_discarded_stage_steps_are_taken_back_and_taken_again(
    store: LedgerStore,
) -> None:
    """A volunteer that serves and trains discards its stage steps: its trainers' receipts of those stage
    steps (the micro-batches went into the fork) are taken back too, also one a report sent before the
    discard brings later; the step taken again counts, even with a smaller cumulative weight than the
    fork's receipt. (A fork's receipt re-sent after the discard looks like the step taken again, as for
    data-parallel receipts: accounting's docstring, "discarded steps".)"""
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 0, 1, 2, batch=64, target=64)
    record(store, ALICE, 0, samples=1000, receipts=[carried(BOB, ALICE, 0, s, 12) for s in (1, 2)])
    assert samples(store)["alice"] == 24
    assert record(store, ALICE, 2, samples=0, stage_discarded=[(0, 2, 2)]).samples == -12
    assert (samples(store)["alice"], discarded_samples(store)["alice"]) == (12, 12)
    late = record(store, ALICE, 1, samples=0, receipts=[carried(BOB, ALICE, 0, 2, 14)])  # the fork's, grown
    assert late.samples == 0 and late.notes is None
    assert (samples(store)["alice"], discarded_samples(store)["alice"]) == (12, 14)
    again = record(store, ALICE, 3, samples=0, receipts=[carried(BOB, ALICE, 0, 2, 4)])
    assert again.samples == 4 and again.notes == "trainer_receipt_retaken: 1"
    assert (samples(store)["alice"], discarded_samples(store)["alice"]) == (16, 0)
    replay = record(store, ALICE, 4, samples=0, receipts=[carried(BOB, ALICE, 0, 2, 4)])
    assert replay.samples == 0 and replay.notes == "trainer_receipt_duplicate: 1"


def test_a_version_11_ledger_gains_stage_discards_keeping_its_rows(ledger_url: str) -> None:
    with LedgerStore.open(ledger_url) as store:
        join(store, "alice", ALICE)
        join(store, "bob", BOB)
        stage_steps(store, 0, 1, 2, batch=64, target=64)
        receipts = [carried(BOB, ALICE, 0, 1, 8), stage_receipt(BOB, ALICE, 0, 2, 8)]
        assert record(store, ALICE, 0, samples=1000, receipts=receipts).samples == 16
    engine = sqlalchemy.create_engine(ledger_url)
    try:
        with engine.begin() as conn:  # what schema version 11 had: no stage discards
            conn.execute(sqlalchemy.text("DROP TABLE stage_discards"))
            conn.execute(sqlalchemy.text("ALTER TABLE trainer_receipts DROP COLUMN discarded"))
            conn.execute(sqlalchemy.text("UPDATE schema_version SET version = 11"))
        with LedgerStore.open(ledger_url) as store:
            assert samples(store)["alice"] == 16  # every old receipt still counts
            assert record(store, ALICE, 1, samples=0, stage_discarded=[(0, 1, 2)]).samples == -16
            assert discarded_samples(store)["alice"] == 16
        with engine.connect() as conn:
            version = conn.execute(sqlalchemy.text("SELECT version FROM schema_version")).scalar()
            assert version == SCHEMA_VERSION
    finally:
        engine.dispose()
