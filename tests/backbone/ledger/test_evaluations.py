"""Held-out evaluations in the ledger (issue 12 item 7): the cross-check of a step's claims (pure,
backbone.ledger.evaluations), the bounds an evaluation must keep, storing them once per (peer, step), the
step view's held-out loss, and the schema 6 -> 7 migration."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest
import sqlalchemy
from hypothesis import given
from hypothesis import strategies as st

from backbone.ledger import LedgerStore
from backbone.ledger.evaluations import (
    Claim,
    EvaluationRejected,
    check_evaluation,
    open_evaluation,
    summarize,
)
from backbone.ledger.schema import SCHEMA_VERSION
from protocols.evaluation import MAX_STEPS_AHEAD, Evaluation, SignedEvaluation, evaluation_payload
from shared.auth.keys import Identity

from ..test_ledger_cli import ledger
from .reports import RUN_ID, T0, identity
from .test_store import join

EVAL_SET = "ab" * 32
PARAMS = b"\x01" * 8
ALICE, ALICE2, BOB, CAROL = identity(31), identity(32), identity(33), identity(34)


def evaluation(who: Identity, step: int = 10, loss: float = 2.5, **fields: object) -> Evaluation:
    values: dict[str, object] = {
        "run_id": RUN_ID,
        "peer_id": who.peer_id,
        "step": step,
        "params": PARAMS,
        "loss": loss,
        "examples": 256,
        "eval_set": EVAL_SET,
        "timestamp": T0,
    }
    values.update(fields)
    return Evaluation(**values)  # type: ignore[arg-type]


def signed(who: Identity, value: Evaluation) -> SignedEvaluation:
    data = msgspec.msgpack.encode(value)
    return SignedEvaluation(evaluation=data, signature=who.sign(evaluation_payload(data)))


def claim(peer: str, user: str, loss: float, params: bytes = PARAMS, eval_set: str = EVAL_SET) -> Claim:
    return Claim(peer, user, loss, params, eval_set)


# ------------------------------------------------------------------------------------------ pure: summarize


def test_a_single_claim_is_recorded_as_single_sourced() -> None:
    summary = summarize(7, [claim("p1", "alice", 3.25)])
    assert summary is not None
    assert (summary.step, summary.loss, summary.users, summary.outliers) == (7, 3.25, 1, ())
    assert summary.single_sourced
    assert summarize(7, []) is None


def test_honest_evaluators_agree_and_a_liar_is_an_outlier_that_moves_nothing() -> None:
    claims = [claim("p1", "alice", 2.0), claim("p2", "bob", 2.0000001), claim("p3", "carol", 0.1)]
    summary = summarize(3, claims)
    assert summary is not None
    assert summary.loss == pytest.approx(2.0, abs=1e-6)
    assert (summary.users, summary.agreeing, summary.outliers) == (2, 2, ("p3",))
    assert not summary.single_sourced


def test_claims_of_other_parameters_are_outliers_even_when_they_are_many_peers_of_one_user() -> None:
    forked = b"\x02" * 8
    claims = [claim("a", "alice", 2.0), claim("b", "bob", 2.0)]
    claims += [claim(f"m{i}", "mallory", 9.0, params=forked) for i in range(5)]
    summary = summarize(3, claims)
    assert summary is not None
    assert summary.loss == 2.0 and summary.users == 2
    assert summary.outliers == tuple(sorted(f"m{i}" for i in range(5)))


def test_a_user_with_many_machines_is_one_voice() -> None:
    claims = [claim(f"m{i}", "mallory", 0.5) for i in range(9)]
    claims += [claim("a", "alice", 2.0), claim("b", "bob", 2.0)]
    summary = summarize(1, claims)
    assert summary is not None and summary.loss == 2.0  # median of (0.5, 2.0, 2.0), not of 11 claims


honest_losses = st.floats(min_value=0.5, max_value=10.0, allow_nan=False)
any_losses = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(
    honest=st.lists(honest_losses, min_size=1, max_size=9),
    liars=st.lists(any_losses, max_size=9),
    order=st.randoms(),
)
def test_a_minority_of_lying_users_cannot_move_the_loss_outside_the_honest_range(
    honest: list[float], liars: list[float], order: object
) -> None:
    liars = liars[: len(honest) - 1]  # strictly fewer lying users than honest ones
    claims = [claim(f"h{i}", f"honest{i}", v) for i, v in enumerate(honest)]
    claims += [claim(f"l{i}", f"liar{i}", v) for i, v in enumerate(liars)]
    order.shuffle(claims)  # type: ignore[attr-defined]
    summary = summarize(1, claims)
    assert summary is not None
    assert min(honest) <= summary.loss <= max(honest)
    assert summary == summarize(1, list(reversed(claims)))  # the order of the claims does not matter


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=6))
def test_summaries_are_finite_or_absent(losses: list[float]) -> None:
    summary = summarize(1, [claim(f"p{i}", f"u{i}", v) for i, v in enumerate(losses)])
    assert summary is None or math.isfinite(summary.loss)


# -------------------------------------------------------------------------------------------- pure: bounds


def check(value: Evaluation, **known: object) -> Evaluation:
    context: dict[str, object] = {
        "run_id": RUN_ID,
        "now": T0 + 5,
        "examples": 256,
        "eval_set": EVAL_SET,
        "newest_step": 10,
    }
    context.update(known)
    return check_evaluation(value, **context)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "known", "code"),
    [
        (evaluation(ALICE, run_id="other-run"), {}, "unknown_run"),
        (evaluation(ALICE, timestamp=T0 - 3600), {}, "clock_skew"),
        (evaluation(ALICE, examples=255), {}, "wrong_examples"),
        (evaluation(ALICE, eval_set="cd" * 32), {}, "wrong_eval_set"),
        (evaluation(ALICE, step=10 + MAX_STEPS_AHEAD + 1), {}, "future_step"),
        (evaluation(ALICE, step=MAX_STEPS_AHEAD + 1), {"newest_step": None}, "future_step"),
    ],
)
def test_an_evaluation_out_of_bounds_is_rejected(
    value: Evaluation, known: dict[str, object], code: str
) -> None:
    with pytest.raises(EvaluationRejected) as caught:
        check(value, **known)
    assert caught.value.code == code


def test_an_evaluation_within_bounds_is_accepted() -> None:
    value = evaluation(ALICE, step=10 + MAX_STEPS_AHEAD)
    assert check(value) == value
    assert check(value, eval_set=None) == value  # a backbone that serves no held-out set checks no digest
    assert open_evaluation(signed(ALICE, value)) == value


def test_a_forged_or_malformed_evaluation_is_rejected() -> None:
    forged = SignedEvaluation(
        signed(BOB, evaluation(ALICE)).evaluation, signed(BOB, evaluation(BOB)).signature
    )
    with pytest.raises(EvaluationRejected, match="not signed"):
        open_evaluation(forged)
    with pytest.raises(EvaluationRejected) as caught:
        open_evaluation(SignedEvaluation(b"\x93garbage", b"\0" * 64))
    assert caught.value.code == "invalid"
    encoded, nan = msgspec.msgpack.encode(evaluation(ALICE)), msgspec.msgpack.encode(math.nan)
    nan = encoded.replace(msgspec.msgpack.encode(2.5), nan)
    with pytest.raises(EvaluationRejected, match="loss"):
        open_evaluation(SignedEvaluation(nan, ALICE.sign(evaluation_payload(nan))))
    with pytest.raises(ValueError, match="finite"):
        evaluation(ALICE, loss=math.inf)


# ------------------------------------------------------------------------------------------------ the store


def test_evaluations_are_stored_once_per_peer_and_step_and_shown_beside_the_steps(tmp_path: Path) -> None:
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        join(store, "alice", ALICE, ALICE2)
        join(store, "bob", BOB)
        for step in (9, 10, 11):
            store.record_step(step, finished_at=T0 + step, loss=3.0, samples=64, peers=2)
        assert store.newest_step() == 11
        first = evaluation(ALICE, loss=2.5)
        assert store.record_evaluation(signed(ALICE, first), first, now=T0)
        assert not store.record_evaluation(signed(ALICE, first), first, now=T0 + 1)  # a replay: nothing new
        rows = {r.global_step: (r.eval_loss, r.eval_users) for r in store.recent_steps()}
        assert rows == {11: (None, 0), 10: (2.5, 1), 9: (None, 0)}
        for who, loss in ((ALICE2, 2.5), (BOB, 2.5001)):
            value = evaluation(who, loss=loss)
            assert store.record_evaluation(signed(who, value), value, now=T0)
        summary = store.step_evaluation(10)
        assert summary is not None and summary.users == 2 and summary.outliers == ()
        assert {r.global_step: r.eval_users for r in store.recent_steps()}[10] == 2
        stranger = evaluation(CAROL)
        with pytest.raises(Exception, match="unknown peer"):
            store.record_evaluation(signed(CAROL, stranger), stranger, now=T0)


def test_a_version_6_ledger_gains_the_evaluations_table_keeping_its_rows(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    with LedgerStore.open(url) as store:
        join(store, "alice", ALICE)
        store.record_step(1, finished_at=T0, loss=3.0, samples=64, peers=1)
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:  # what schema version 6 had: no evaluations table
        conn.execute(sqlalchemy.text("DROP TABLE evaluations"))
        conn.execute(sqlalchemy.text("UPDATE schema_version SET version = 6"))
    with LedgerStore.open(url) as store:
        assert [(r.global_step, r.loss) for r in store.recent_steps()] == [(1, 3.0)]
        value = evaluation(ALICE, step=1)
        assert store.record_evaluation(signed(ALICE, value), value, now=T0)
    with engine.connect() as conn:
        assert (
            conn.execute(sqlalchemy.text("SELECT version FROM schema_version")).scalar()
            == SCHEMA_VERSION
            >= 7
        )
        assert "evaluations" in sqlalchemy.inspect(conn).get_table_names()
    engine.dispose()


def test_ledger_steps_shows_the_held_out_loss_beside_the_training_loss(tmp_path: Path) -> None:
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        join(store, "alice", ALICE)
        join(store, "bob", BOB)
        for step in (10, 11, 12):
            store.record_step(step, finished_at=T0 + step, loss=4.0, samples=64, peers=2)
        for who, step, loss in ((ALICE, 10, 2.345), (BOB, 10, 2.345), (ALICE, 11, 2.2)):
            value = evaluation(who, step=step, loss=loss)
            store.record_evaluation(signed(who, value), value, now=T0)

    code, output = ledger(tmp_path, "--steps")
    assert code == 0, output
    assert "eval loss" in output and "2.3450 " in output and "2.2000*" in output
    assert "* computed by one user's" in output
    code, output = ledger(tmp_path, "--steps", "--json")
    shown = {s["global_step"]: (s["eval_loss"], s["eval_users"]) for s in json.loads(output)["steps"]}
    assert shown == {10: (2.345, 2), 11: (2.2, 1), 12: (None, 0)}
