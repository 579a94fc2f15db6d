"""Mixed precision and the collective loss scale, without a network: the pure rule (its bound on liars),
the choice of precision, and the trainer's autocast, scaling, skipping and state."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.training import OptimizerSpec, ScheduleSpec, TrainingSpec
from shared.averaging.groups import leader_of
from shared.averaging.matchmaking import Matchmaker, PlanRefused, ticket_digest
from shared.errors import ConfigError
from volunteer.collab.trainer import LocalTrainer
from volunteer.precision import (
    CEILING_EXPONENT,
    FLOOR_EXPONENT,
    INITIAL_EXPONENT,
    LossScale,
    after_round,
    resolve_precision,
)

from ..shared.averaging.test_strangers import tickets_for
from .test_collab import LinearTask, examples


@settings(max_examples=200, deadline=None)
@given(claims=st.lists(st.booleans(), max_size=400), growth=st.integers(1, 8))
def test_no_sequence_of_claims_skips_more_than_the_floor_and_one_step_per_growth_interval(
    claims: list[bool], growth: int
) -> None:
    state, skipped, run, longest = LossScale(), 0, 0, 0
    for claimed in claims:
        state, skip = after_round(state, claimed, growth_interval=growth)
        skipped += skip
        run = run + 1 if skip else 0
        longest = max(longest, run)
        assert FLOOR_EXPONENT <= state.exponent <= CEILING_EXPONENT
        assert 0 <= state.clean < growth
    assert skipped <= INITIAL_EXPONENT - FLOOR_EXPONENT + len(claims) / (growth + 1)
    assert longest <= CEILING_EXPONENT - FLOOR_EXPONENT == 16


@settings(max_examples=100, deadline=None)
@given(exponent=st.integers(FLOOR_EXPONENT, CEILING_EXPONENT), clean=st.integers(0, 5), usable=st.booleans())
def test_a_claim_is_believed_above_the_floor_only_and_an_unusable_vector_is_never_applied(
    exponent: int, clean: int, usable: bool
) -> None:
    state = LossScale(exponent, clean)
    after, skip = after_round(state, True, usable, growth_interval=8)
    if exponent > FLOOR_EXPONENT:
        assert (after, skip) == (LossScale(exponent - 1, 0), True)
    else:  # at the floor a claim changes nothing: the step is taken (or skipped only if unusable)
        assert skip is not usable
        assert after.exponent == FLOOR_EXPONENT
    after, skip = after_round(state, False, usable, growth_interval=8)
    assert skip is not usable


def test_clean_steps_double_the_scale_after_the_growth_interval_up_to_the_ceiling() -> None:
    assert CEILING_EXPONENT == INITIAL_EXPONENT
    state = LossScale(3, 0)
    for _ in range(2):
        state, _ = after_round(state, False, growth_interval=3)
    assert state == LossScale(3, 2)
    state, skip = after_round(state, False, growth_interval=3)
    assert (state, skip) == (LossScale(4, 0), False)
    top, _ = after_round(LossScale(CEILING_EXPONENT, 2), False, growth_interval=3)
    assert top == LossScale(CEILING_EXPONENT, 0)


@pytest.mark.parametrize("text", ["", "16", "x/1", "99/0", "-1/0", "16/-1", "16/999999", "1" * 40 + "/0"])
def test_a_malformed_loss_scale_in_a_state_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="loss scale"):
        LossScale.decode(text)


def test_loss_scale_round_trips_and_an_old_state_gets_the_initial_scale() -> None:
    assert LossScale.decode(LossScale(7, 3).encode()) == LossScale(7, 3)
    assert LossScale.decode(None) == LossScale()


@pytest.mark.parametrize(
    ("choice", "device", "bf16", "expected"),
    [
        ("auto", "cuda:0", True, "bf16"),
        ("auto", "cuda:1", False, "fp16"),  # a T4
        ("auto", "cpu", False, "fp32"),
        ("auto", "mps", False, "fp32"),
        ("bf16", "cpu", False, "bf16"),  # CPU autocast does bf16
        ("fp16", "cuda:0", True, "fp16"),
        ("FP32", "cuda:0", True, "fp32"),
    ],
)
def test_precision_choice(choice: str, device: str, bf16: bool, expected: str) -> None:
    assert resolve_precision(choice, device, bf16) == expected


@pytest.mark.parametrize(("choice", "device"), [("bf16", "cuda:0"), ("int8", "cpu"), ("bf16", "mps")])
def test_an_impossible_precision_is_refused_in_one_line(choice: str, device: str) -> None:
    with pytest.raises(ConfigError, match="--precision"):
        resolve_precision(choice, device, False)


# ---------------------------------------------------------------- the trainer


#: The tests' data overflows fp16 at torch's initial 2**16 (natural overflow: see the collective test)
TEST_SCALE = LossScale(8)


def spec(target: int = 16) -> TrainingSpec:
    return TrainingSpec(
        task="linear-test",
        target_batch=target,
        local_batch=target,
        optimizer=OptimizerSpec(name="adamw", lr=0.05),
        schedule=ScheduleSpec(kind="constant"),
        checkpoint_every=1000,
    )


class DtypeTask(LinearTask):
    """Records the dtype the model computed in."""

    def __init__(self) -> None:
        self.seen: list[torch.dtype] = []

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        out = model(batch["x"]).squeeze(-1)
        self.seen.append(out.dtype)
        return ((out - batch["y"]) ** 2).mean()


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_runs_the_forward_in_low_precision_and_keeps_parameters_and_gradients_float32(
    precision: str, dtype: torch.dtype
) -> None:
    task = DtypeTask()
    trainer = LocalTrainer(task, spec(), "r", precision=precision)  # type: ignore[arg-type]
    trainer.loss_scale = TEST_SCALE
    trainer.accumulate(task.collate(examples(1, 16)))
    taken = trainer.take_gradients()
    assert task.seen == [dtype]
    assert taken.gradient_sum.dtype == np.float32 and np.isfinite(taken.gradient_sum).all()
    assert all(p.dtype == torch.float32 for p in trainer.params)
    reference = LocalTrainer(LinearTask(), spec(), "r")  # type: ignore[arg-type]
    reference.accumulate(task.collate(examples(1, 16)))
    # unscaled: the fp16 sum is the fp32 sum to low-precision tolerance (not 256 times it)
    np.testing.assert_allclose(
        taken.gradient_sum, reference.take_gradients().gradient_sum, rtol=0.05, atol=0.5
    )


def test_a_believed_overflow_skips_the_step_advances_it_and_halves_the_scale_in_the_state() -> None:
    trainer = LocalTrainer(LinearTask(), spec(), "r", precision="fp16")  # type: ignore[arg-type]
    before = trainer.parameter_vector().copy()
    fingerprint = trainer.fingerprint()
    assert trainer.apply(None, overflow=True) == 1
    assert np.array_equal(trainer.parameter_vector(), before)
    assert trainer.loss_scale == LossScale(INITIAL_EXPONENT - 1, 0)
    assert not trainer.optimizer.state  # no optimizer step was taken
    assert trainer.fingerprint() != fingerprint  # the step and the scale are in it
    other = LocalTrainer(LinearTask(), spec(), "r", precision="bf16")  # type: ignore[arg-type]
    other.load_state_blob(trainer.state_blob())
    assert (other.step, other.loss_scale) == (1, trainer.loss_scale)
    assert other.fingerprint() == trainer.fingerprint()


def test_micro_batches_computed_while_a_step_halves_the_scale_are_unscaled_by_the_scale_they_used() -> None:
    """Delayed parameter updates: a micro-batch accumulated at S = 2**8 whose step then lands with
    S = 2**7 must be divided by 2**8, not by the new scale (it would come out twice too large). The
    scales are powers of two and this data neither overflows nor underflows: the sums are equal."""
    task = LinearTask()
    trainer = LocalTrainer(task, spec(), "r", precision="fp16")  # type: ignore[arg-type]
    reference = LocalTrainer(task, spec(), "r", precision="fp16")  # type: ignore[arg-type]
    trainer.loss_scale = TEST_SCALE
    reference.loss_scale = LossScale(TEST_SCALE.exponent - 1)
    batch = task.collate(examples(2, 16))
    trainer.accumulate(batch)  # accumulated at 2**8; the round's step (skipped) lands meanwhile
    trainer.apply(None, overflow=True)
    reference.accumulate(batch)
    np.testing.assert_array_equal(
        trainer.take_gradients().gradient_sum, reference.take_gradients().gradient_sum
    )


def test_a_leader_can_neither_forge_nor_hide_a_members_overflow_claim() -> None:
    ids, tickets = tickets_for(3, [16.0, 16.0, 0.0])
    liar = ids[2]
    tickets[liar] = msgspec.structs.replace(tickets[liar], norm=0.0, overflow=True)
    mm = Matchmaker(None)  # type: ignore[arg-type]  # check_plan and _solve touch no DHT
    key, numel = "avg.7.x", 1000
    leader = leader_of(key, ids)
    honest = mm._solve(7, key, ids, tickets, numel, [ticket_digest(p.encode()) for p in ids])
    assert [m.overflow for m in honest.members] == [False, False, True]
    mm.check_plan(7, key, leader, honest, set(ids), tickets, numel)
    for flipped in range(3):
        members = [
            msgspec.structs.replace(m, overflow=not m.overflow) if i == flipped else m
            for i, m in enumerate(honest.members)
        ]
        with pytest.raises(PlanRefused, match="overflow"):
            mm.check_plan(
                7, key, leader, msgspec.structs.replace(honest, members=members), set(ids), tickets, numel
            )
