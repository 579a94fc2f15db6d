"""Credit of a swarm run's trainers from the stage servers' carried receipts (accounting's docstring,
"Swarm trainers"), on SQLite and PostgreSQL (``store``): held until the stage step is recorded, the
largest cumulative weight per (trainer, server, stage, step), capped per (trainer, stage, step) across
servers, never from the same user or an unknown server, and never confused with a stage server's parts."""

from __future__ import annotations

import pytest
import sqlalchemy
from hypothesis import given, settings
from hypothesis import strategies as st

from backbone.ledger import LedgerStore
from backbone.ledger.accounting import split_receipts
from backbone.ledger.schema import SCHEMA_VERSION
from protocols.receipts import PartReceipt, SignedReceipt, sign_receipt
from shared.auth.keys import Identity

from .reports import RUN_ID, T0, identity, make_report
from .test_stage_credit import join, record, samples, stage_receipt, stage_steps

ALICE, BOB, CAROL, DAVE, BOB2 = identity(41), identity(42), identity(43), identity(44), identity(45)


def carried(
    server: Identity, trainer: Identity, stage: int, step: int, weight: float, *, run_id: str = RUN_ID
) -> SignedReceipt:
    body = PartReceipt(
        run_id=run_id,
        aggregator=server.peer_id,
        sender=trainer.peer_id,
        step=step,
        group_id=b"",
        round=0,
        weight=weight,
        nbytes=1000,
        issued_at=T0,
        stage=stage,
        carried=True,
    )
    return sign_receipt(body, server.sign)


def test_schema_10_has_the_trainer_receipts_table(store: LedgerStore, ledger_url: str) -> None:
    assert SCHEMA_VERSION >= 10
    engine = sqlalchemy.create_engine(ledger_url)
    try:
        with engine.connect() as conn:
            names = set(sqlalchemy.inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert "trainer_receipts" in names


def test_carried_receipts_are_sorted_apart_from_stage_and_data_parallel_ones() -> None:
    report = make_report(
        ALICE,
        0,
        receipts=[
            carried(BOB, ALICE, 0, 1, 4),
            stage_receipt(BOB, ALICE, 0, 1, 4),
            carried(BOB, CAROL, 0, 1, 4),
        ],
    )
    split = split_receipts(report, RUN_ID)
    assert list(split.carried) == [(0, 1)] and list(split.stages) == [(0, 1)] and not split.steps
    assert split.carried[(0, 1)][0].carried and not split.stages[(0, 1)][0].carried
    assert split.rejected == {"receipt_wrong_sender": 1}  # another trainer's receipt


def test_held_until_recorded_then_credited_and_settled_without_a_report(store: LedgerStore) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 0, 1)
    first = record(
        store, ALICE, 0, samples=10, receipts=[carried(BOB, ALICE, 0, 1, 4), carried(BOB, ALICE, 1, 1, 4)]
    )
    assert first.samples == 4 and first.notes == "trainer_receipt_held: 1"
    stage_steps(store, 1, 1)  # stage 1's step recorded later: the trainer is settled at once
    assert samples(store)["alice"] == 8
    assert record(store, ALICE, 1, samples=0).samples == 0  # not twice


def test_cumulative_receipts_count_their_largest_and_replays_add_nothing(store: LedgerStore) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 0, 1, batch=64, target=64)
    one = record(
        store, ALICE, 0, samples=100, receipts=[carried(BOB, ALICE, 0, 1, 4), carried(BOB, ALICE, 0, 1, 8)]
    )
    assert one.samples == 8 and one.notes == "trainer_receipt_duplicate: 1"
    replay = record(store, ALICE, 1, samples=0, receipts=[carried(BOB, ALICE, 0, 1, 4)])
    assert replay.samples == 0 and replay.notes == "trainer_receipt_duplicate: 1"
    grown = record(store, ALICE, 2, samples=0, receipts=[carried(BOB, ALICE, 0, 1, 12)])
    assert grown.samples == 4 and grown.notes is None
    assert samples(store)["alice"] == 12


def test_all_servers_of_a_stage_step_together_are_capped_by_its_batch(store: LedgerStore) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    join(store, "carol", CAROL)
    stage_steps(store, 0, 1, batch=8, target=8)
    stage_steps(store, 1, 1, batch=12, target=8)  # the larger of batch and target
    verdict = record(
        store,
        ALICE,
        0,
        samples=10**6,
        receipts=[
            carried(BOB, ALICE, 0, 1, 6),
            carried(CAROL, ALICE, 0, 1, 6),  # two colluding servers of one stage step: still one batch
            carried(BOB, ALICE, 1, 1, 10**6),
        ],
    )
    assert verdict.samples == 8 + 12


def test_the_same_user_or_an_unknown_server_credits_nothing(store: LedgerStore) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB, BOB2)
    stage_steps(store, 0, 1)
    verdict = record(
        store,
        BOB,
        0,
        samples=10,
        receipts=[
            carried(BOB2, BOB, 0, 1, 4),  # bob's other machine
            carried(BOB, BOB, 0, 1, 4),  # itself
            carried(DAVE, BOB, 0, 1, 4),  # not admitted
        ],
    )
    assert verdict.samples == 0
    assert verdict.notes is not None
    assert set(verdict.notes.split("; ")) == {
        "receipt_own: 1",
        "trainer_receipt_same_user: 1",
        "trainer_receipt_unknown_server: 1",
    }


def test_claims_bound_the_credit_and_units_add_with_a_servers_stage_samples(store: LedgerStore) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 0, 1, 2, batch=16, target=16)
    # alice both served stage 0 (bob aggregated her parts of step 1) and carried micro-batches (bob served)
    verdict = record(
        store,
        ALICE,
        0,
        samples=10,
        receipts=[stage_receipt(BOB, ALICE, 0, 1, 6), carried(BOB, ALICE, 0, 2, 6)],
    )
    assert verdict.samples == 10  # min(claimed 10, evidence 12)
    assert record(store, ALICE, 1, samples=5).samples == 2  # the rest of the evidence, no more


def test_a_trainers_receipt_of_another_run_is_refused(store: LedgerStore) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 0, 1)
    verdict = record(store, ALICE, 0, samples=4, receipts=[carried(BOB, ALICE, 0, 1, 4, run_id="other-run")])
    assert verdict.samples == 0 and verdict.notes == "receipt_wrong_run: 1"


def evidence(best: dict[tuple[int, int, int], int], recorded: set[tuple[int, int]] | None = None) -> int:
    """Per (stage, step) (recorded ones only, unless ``recorded`` is None): the sum over servers of each
    one's largest weight, capped at the step's batch (8); summed."""
    per_step: dict[tuple[int, int], int] = {}
    for (_, k, s), w in best.items():
        if recorded is None or (k, s) in recorded:
            per_step[k, s] = per_step.get((k, s), 0) + w
    return sum(min(w, 8) for w in per_step.values())


_event = st.one_of(
    st.tuples(st.just("step"), st.integers(0, 1), st.integers(0, 3)),
    st.tuples(
        st.just("report"),
        st.integers(0, 30),
        st.lists(
            st.tuples(st.integers(0, 1), st.integers(0, 1), st.integers(0, 3), st.integers(0, 12)), max_size=5
        ),
    ),
)


@settings(max_examples=15, deadline=None)
@given(st.lists(_event, max_size=12))
def test_trainer_credit_is_min_of_claims_and_capped_largest_weights_whatever_the_order(
    tmp_path_factory: pytest.TempPathFactory,
    events: list[tuple],  # type: ignore[type-arg]
) -> None:
    """Any interleaving of stage step records and reports of cumulative receipts from two servers: the
    trainer is never credited more than it claimed nor than, per recorded (stage, step), the sum over
    servers of each one's largest weight, capped at the step's batch (8); once every step is recorded,
    exactly ``min(claims, that sum)``."""
    url = f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.sqlite3'}"
    with LedgerStore.open(url) as store:
        join(store, "alice", ALICE)
        join(store, "bob", BOB)
        join(store, "carol", CAROL)
        servers = (BOB, CAROL)
        claims, seq = 0, 0
        best: dict[tuple[int, int, int], int] = {}
        recorded: set[tuple[int, int]] = set()
        for event in events:
            if event[0] == "step":
                _, stage, step = event
                stage_steps(store, stage, step)
                recorded.add((stage, step))
            else:
                _, claim, weights = event
                receipts = [carried(servers[v], ALICE, k, s, w) for v, k, s, w in weights]
                record(store, ALICE, seq, samples=claim, receipts=receipts)
                seq += 1
                claims += claim
                for v, k, s, w in weights:
                    best[v, k, s] = max(best.get((v, k, s), 0), w)

            assert samples(store)["alice"] <= min(claims, evidence(best))
            assert samples(store)["alice"] >= min(
                claims, evidence(best, recorded)
            )  # late evidence settled at once
        for stage in range(2):
            stage_steps(store, stage, *range(4))
        assert samples(store)["alice"] == min(claims, evidence(best))
