"""Credit of a swarm run's stage servers from stage receipts (accounting's docstring, "Swarm runs"), on
SQLite and PostgreSQL (``store``): held until the stage step is recorded, once per (sender, stage, step),
capped per stage step, never from the same user, an unknown aggregator, another run or another stage."""

from __future__ import annotations

import msgspec
import pytest
import sqlalchemy
from hypothesis import given, settings
from hypothesis import strategies as st

from backbone.ledger import LedgerStore, Verdict
from backbone.ledger.accounting import sorted_receipts
from backbone.ledger.schema import SCHEMA_VERSION
from protocols.receipts import PartReceipt, SignedReceipt, receipt_payload, sign_receipt
from shared.auth.keys import Identity

from .reports import CAPS, RUN_ID, T0, identity, make_report, receipt, sign

ALICE, ALICE2, BOB, CAROL, STRANGER = identity(31), identity(32), identity(33), identity(34), identity(35)


def join(store: LedgerStore, username: str, *machines: Identity) -> None:
    store.add_user(username, now=T0)
    secret = store.create_invite(username, now=T0)
    for machine in machines:
        store.redeem_invite(secret, machine.peer_id, machine.public_key_bytes, now=T0)
        store.update_capabilities(machine.peer_id, CAPS, now=T0)


def stage_receipt(
    aggregator: Identity,
    sender: Identity,
    stage: int,
    step: int,
    weight: float,
    *,
    run_id: str = RUN_ID,
) -> SignedReceipt:
    body = PartReceipt(
        run_id=run_id,
        aggregator=aggregator.peer_id,
        sender=sender.peer_id,
        step=step,
        group_id=b"s",
        round=0,
        weight=weight,
        nbytes=100,
        issued_at=T0,
        stage=stage,
    )
    return sign_receipt(body, aggregator.sign)


def stage_steps(store: LedgerStore, stage: int, *numbers: int, batch: int = 8, target: int = 8) -> None:
    for step in numbers:
        store.record_stage_step(
            stage, step, finished_at=T0 + step, loss=None, samples=batch, peers=2, target_batch=target
        )


def record(store: LedgerStore, who: Identity, seq: int, **fields: object) -> Verdict:
    report = make_report(who, seq, **fields)  # type: ignore[arg-type]
    verdict = store.assess_and_record(sign(who, report), report, now=T0 + 3600)
    assert verdict is not None
    return verdict


def samples(store: LedgerStore) -> dict[str, int]:
    return {row.username: row.samples for row in store.leaderboard()}


def test_schema_has_the_stage_tables(store: LedgerStore, ledger_url: str) -> None:
    assert SCHEMA_VERSION >= 9
    engine = sqlalchemy.create_engine(ledger_url)
    try:
        with engine.connect() as conn:
            names = set(sqlalchemy.inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert {"stage_steps", "stage_receipts"} <= names


def test_stage_receipts_are_held_until_their_stage_step_is_recorded_then_credited(store: LedgerStore) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 1, 1)
    first = record(
        store,
        ALICE,
        0,
        samples=16,
        receipts=[stage_receipt(BOB, ALICE, 1, 1, 8), stage_receipt(BOB, ALICE, 1, 2, 8)],
    )
    assert first.samples == 8 and first.notes == "stage_receipt_held: 1"
    # step 2 of stage 0 (another stage), or global step 2 of a data-parallel run, does not release it
    stage_steps(store, 0, 2)
    store.record_step(2, finished_at=T0, loss=None, samples=8, peers=2, target_batch=8)
    assert samples(store)["alice"] == 8
    stage_steps(store, 1, 2)  # late evidence: credited at once, with no new report
    assert samples(store)["alice"] == 16
    assert record(store, ALICE, 1, samples=0).samples == 0  # not twice


def test_each_sender_stage_step_is_credited_once_and_at_most_the_stage_steps_batch(
    store: LedgerStore,
) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    join(store, "carol", CAROL)
    stage_steps(store, 0, 1, 2, batch=8, target=8)
    stage_steps(store, 2, 1, batch=12, target=8)
    verdict = record(
        store,
        ALICE,
        0,
        samples=1000,
        receipts=[
            stage_receipt(BOB, ALICE, 0, 1, 6),
            stage_receipt(CAROL, ALICE, 0, 1, 7),  # the same (stage, step): the larger weight, once
            stage_receipt(BOB, ALICE, 0, 2, 10**6),  # over the cap: the step's batch (8)
            stage_receipt(BOB, ALICE, 2, 1, 10**6),  # stage 2's step 1 had 12 > target 8
        ],
    )
    assert verdict.samples == 7 + 8 + 12
    assert verdict.notes == "stage_receipt_duplicate: 1"
    again = record(store, ALICE, 1, samples=1000, receipts=[stage_receipt(CAROL, ALICE, 0, 2, 8)])
    assert again.samples == 0 and again.notes == "stage_receipt_duplicate: 1"
    assert samples(store)["alice"] == 27


def test_claims_bound_the_credit_of_stage_receipts(store: LedgerStore) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 0, 1, 2)
    verdict = record(
        store,
        ALICE,
        0,
        samples=5,
        receipts=[stage_receipt(BOB, ALICE, 0, 1, 8), stage_receipt(BOB, ALICE, 0, 2, 8)],
    )
    assert verdict.samples == 5  # S = min(claims, receipt weights)


def test_stage_receipts_of_the_same_user_unknown_forged_or_another_run_credit_nothing(
    store: LedgerStore,
) -> None:
    join(store, "alice", ALICE, ALICE2)
    join(store, "bob", BOB)
    stage_steps(store, 0, 1, 2, 3, 4, 5)
    forged = stage_receipt(BOB, ALICE, 0, 3, 8)
    verdict = record(
        store,
        ALICE,
        0,
        samples=1000,
        receipts=[
            stage_receipt(ALICE2, ALICE, 0, 1, 8),  # alice's other machine
            stage_receipt(ALICE, ALICE, 0, 2, 8),  # herself
            SignedReceipt(forged.receipt, ALICE.sign(receipt_payload(forged.receipt))),  # bob never signed
            stage_receipt(STRANGER, ALICE, 0, 4, 8),  # unknown aggregator
            stage_receipt(BOB, ALICE, 0, 5, 8, run_id="another-run"),
            stage_receipt(BOB, ALICE2, 0, 5, 8),  # about alice's other machine
        ],
    )
    assert verdict.credited and verdict.samples == 0
    assert verdict.notes == (
        "receipt_bad_signature: 1; receipt_own: 1; receipt_wrong_run: 1; receipt_wrong_sender: 1; "
        "stage_receipt_same_user: 1; stage_receipt_unknown_aggregator: 1"
    )


def test_a_receipt_cannot_be_replayed_under_another_stage_nor_as_a_data_parallel_one(
    store: LedgerStore,
) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 0, 1)
    stage_steps(store, 1, 1)
    store.record_step(1, finished_at=T0, loss=None, samples=8, peers=2, target_batch=8)
    signed = stage_receipt(BOB, ALICE, 0, 1, 8)
    as_stage_1 = msgspec.structs.replace(msgspec.msgpack.decode(signed.receipt, type=PartReceipt), stage=1)
    as_parallel = msgspec.structs.replace(as_stage_1, stage=None)
    dp = receipt(BOB, ALICE, 1, 8)
    dp_as_stage = msgspec.structs.replace(msgspec.msgpack.decode(dp.receipt, type=PartReceipt), stage=0)
    replays = [
        SignedReceipt(msgspec.msgpack.encode(body), signed.signature) for body in (as_stage_1, as_parallel)
    ] + [SignedReceipt(msgspec.msgpack.encode(dp_as_stage), dp.signature)]
    verdict = record(store, ALICE, 0, samples=1000, receipts=[signed, *replays])
    assert verdict.samples == 8 and verdict.notes == "receipt_bad_signature: 3"


def test_a_stage_out_of_range_is_a_malformed_receipt(store: LedgerStore) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    fields = msgspec.structs.asdict(
        msgspec.msgpack.decode(stage_receipt(BOB, ALICE, 0, 1, 8).receipt, type=PartReceipt)
    )
    fields["stage"] = 64
    body = msgspec.msgpack.encode(fields)
    bad = SignedReceipt(body, BOB.sign(receipt_payload(body)))
    verdict = record(store, ALICE, 0, samples=1000, receipts=[bad])
    assert verdict.samples == 0 and verdict.notes == "receipt_malformed: 1"


def test_the_frontier_is_per_stage_and_a_jumped_over_stage_step_is_recorded_from_receipts(
    store: LedgerStore,
) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    stage_steps(store, 0, 1, 5, batch=8)  # the tracker jumped over stage 0's steps 2..4
    verdict = record(
        store,
        ALICE,
        0,
        samples=1000,
        receipts=[stage_receipt(BOB, ALICE, 0, 3, 100), stage_receipt(BOB, ALICE, 1, 3, 8)],
    )
    assert verdict.samples == 8  # stage 0's step 3: at/below its frontier, capped by its largest batch
    assert verdict.notes == "stage_receipt_held: 1"  # stage 1 has no frontier yet: held
    assert (0, 3, 8, None, "receipts") in store.stage_steps(0)
    store.record_stage_step(1, 4, finished_at=T0, loss=None, samples=8, peers=2, target_batch=8)
    assert samples(store)["alice"] == 16  # stage 1 went past step 3: recorded from the receipt, credited
    assert [row[1] for row in store.stage_steps(1)] == [3, 4]
    store.record_stage_step(1, 3, finished_at=T0, loss=None, samples=6, peers=2, target_batch=8)
    assert (1, 3, 6, 8, "tracker") in store.stage_steps(1)  # the tracker's numbers replace the receipts'


def test_record_stage_step_is_idempotent_and_checks_its_arguments(store: LedgerStore) -> None:
    assert store.record_stage_step(
        0, 1, finished_at=T0, loss=float("nan"), samples=4, peers=1, target_batch=8
    )
    assert not store.record_stage_step(0, 1, finished_at=T0, loss=None, samples=9, peers=1, target_batch=8)
    assert store.stage_steps() == [(0, 1, 4, 8, "tracker")]
    for bad in ({"stage": 64}, {"stage": -1}, {"step": -1}, {"target_batch": 0}):
        args = {"stage": 0, "step": 2, "target_batch": 8} | bad
        with pytest.raises(ValueError, match=r"stage|negative"):
            store.record_stage_step(
                args["stage"],
                args["step"],
                finished_at=T0,
                loss=None,
                samples=1,
                peers=1,
                target_batch=args["target_batch"],
            )


def test_data_parallel_and_stage_receipts_both_count_in_the_evidence(store: LedgerStore) -> None:
    join(store, "alice", ALICE)
    join(store, "bob", BOB)
    store.record_step(1, finished_at=T0, loss=None, samples=8, peers=2, target_batch=8)
    stage_steps(store, 0, 1)
    verdict = record(
        store, ALICE, 0, samples=100, receipts=[receipt(BOB, ALICE, 1, 8), stage_receipt(BOB, ALICE, 0, 1, 8)]
    )
    assert verdict.samples == 16


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 3)), st.integers(0, 5)), max_size=12))
def test_sorted_receipts_splits_by_kind_and_loses_none(keys: list[tuple[int | None, int]]) -> None:
    signed = [
        sign_receipt(
            PartReceipt(
                run_id=RUN_ID,
                aggregator=BOB.peer_id,
                sender=ALICE.peer_id,
                step=step,
                group_id=b"",
                round=0,
                weight=1.0,
                nbytes=0,
                issued_at=T0,
                stage=stage,
            ),
            BOB.sign,
        )
        for stage, step in keys
    ]
    report = make_report(ALICE, 0, receipts=signed)
    steps, stages, rejected = sorted_receipts(report, RUN_ID)
    assert not rejected
    assert sum(map(len, steps.values())) == sum(1 for s, _ in keys if s is None)
    assert sorted(stages) == sorted({(s, t) for s, t in keys if s is not None})
    assert all(r.stage is None and r.step == k for k, rs in steps.items() for r in rs)
    assert all((r.stage, r.step) == k for k, rs in stages.items() for r in rs)


_event = st.one_of(
    st.tuples(st.just("step"), st.integers(0, 2), st.integers(0, 6)),
    st.tuples(
        st.just("report"),
        st.integers(0, 40),
        st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(0, 20)), max_size=6),
    ),
)


@settings(max_examples=15, deadline=None)
@given(st.lists(_event, max_size=12))
def test_stage_credit_is_min_of_claims_and_first_capped_weights_whatever_the_order(
    tmp_path_factory: pytest.TempPathFactory,
    events: list[tuple],  # type: ignore[type-arg]
) -> None:
    """Any interleaving of stage step records and reports: alice is never credited more than she
    claimed nor than the once-counted, capped weights of recorded stage steps; once every stage step is
    recorded, exactly ``min(claims, sum over (stage, step) of min(first weight, batch))``."""
    url = f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.sqlite3'}"
    with LedgerStore.open(url) as store:
        join(store, "alice", ALICE)
        join(store, "bob", BOB)
        claims, first, recorded, seq = 0, {}, set(), 0
        for event in events:
            if event[0] == "step":
                _, stage, step = event
                stage_steps(store, stage, step)
                recorded.add((stage, step))
            else:
                _, claim, weights = event
                receipts = [stage_receipt(BOB, ALICE, k, s, w) for k, s, w in weights]
                record(store, ALICE, seq, samples=claim, receipts=receipts)
                seq += 1
                claims += claim
                best: dict[tuple[int, int], int] = {}
                for k, s, w in weights:
                    best[k, s] = max(best.get((k, s), 0), w)
                for key, w in best.items():
                    first.setdefault(key, w)
            counted = sum(min(w, 8) for key, w in first.items() if key in recorded)
            assert samples(store)["alice"] <= min(claims, sum(min(w, 8) for w in first.values()))
            assert samples(store)["alice"] >= min(claims, counted)  # late evidence settled at once
        for stage in range(3):
            stage_steps(store, stage, *range(7))
        assert samples(store)["alice"] == min(claims, sum(min(w, 8) for w in first.values()))
