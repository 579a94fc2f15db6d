"""Fitting the micro-batch to the device's memory: the search's rule, and a simulated memory limit (a task
that raises torch's out-of-memory error above a size) on the CPU."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import ConfigError
from volunteer.collab.trainer import LocalTrainer
from volunteer.fitting import fit_micro_batch, largest_fitting, repeat_batch

from .test_collab import LinearTask, examples
from .test_precision import spec


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(0, 5000), start=st.integers(-3, 5000), cap=st.integers(0, 4096))
def test_the_search_finds_the_largest_size_that_fits_without_probing_beyond_the_cap(
    limit: int, start: int, cap: int
) -> None:
    probed: list[int] = []

    def fits(n: int) -> bool:
        probed.append(n)
        return n <= limit

    assert largest_fitting(fits, start, cap) == (min(limit, cap) if cap >= 1 else 0)
    assert all(1 <= n <= cap for n in probed)
    assert len(probed) <= 2 * max(1, cap).bit_length() + 2


class MemoryLimitedTask(LinearTask):
    """A device that holds at most ``limit`` samples per forward/backward."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sizes: list[int] = []

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        self.sizes.append(self.batch_size(batch))
        if self.batch_size(batch) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().loss(model, batch)


def test_a_simulated_memory_limit_picks_the_largest_micro_batch_that_fits_and_leaves_no_gradients() -> None:
    task = MemoryLimitedTask(limit=37)
    trainer = LocalTrainer(task, spec(target=256), "r")  # type: ignore[arg-type]
    trainer.micro_batch = 16
    before = trainer.parameter_vector().copy()
    sample = task.collate(examples(1, 16))
    assert fit_micro_batch(trainer, sample, cap=256) == 37
    assert task.sizes[:3] == [16, 32, 64]  # doubled up from the spec's size, then bisected
    assert trainer.samples == 0 and all(p.grad is None for p in trainer.params)
    assert (trainer.parameter_vector() == before).all() and trainer.step == 0


def test_a_spec_size_that_does_not_fit_is_halved_and_the_cap_binds() -> None:
    task = MemoryLimitedTask(limit=5)
    trainer = LocalTrainer(task, spec(target=64), "r")  # type: ignore[arg-type]
    trainer.micro_batch = 64
    assert fit_micro_batch(trainer, task.collate(examples(1, 8)), cap=64) == 5
    roomy = MemoryLimitedTask(limit=10_000)
    trainer = LocalTrainer(roomy, spec(target=64), "r")  # type: ignore[arg-type]
    assert fit_micro_batch(trainer, roomy.collate(examples(1, 8)), cap=64) == 64
    assert max(roomy.sizes) == 64


def test_nothing_fits_gives_zero() -> None:
    task = MemoryLimitedTask(limit=0)
    trainer = LocalTrainer(task, spec(), "r")  # type: ignore[arg-type]
    assert fit_micro_batch(trainer, task.collate(examples(1, 4)), cap=16) == 0


def test_a_repeated_batch_has_the_shapes_of_the_original_per_sample() -> None:
    batch = {"x": torch.arange(6).reshape(3, 2), "y": torch.arange(3), "scale": torch.tensor(2.0)}
    grown = repeat_batch(batch, 7)
    assert grown["x"].shape == (7, 2) and grown["y"].tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert grown["scale"] is batch["scale"]


class CheckpointingTask(LinearTask):
    def __init__(self) -> None:
        self.calls: list[bool] = []

    def gradient_checkpointing(self, model: torch.nn.Module, enabled: bool) -> None:
        assert isinstance(model, torch.nn.Linear)
        self.calls.append(enabled)


def test_the_manifest_turns_on_a_tasks_activation_checkpointing_and_a_task_without_it_is_refused() -> None:
    task = CheckpointingTask()
    LocalTrainer(task, spec(), "r")  # type: ignore[arg-type]
    assert task.calls == []
    LocalTrainer(task, msgspec.structs.replace(spec(), gradient_checkpointing=True), "r")  # type: ignore[arg-type]
    assert task.calls == [True]
    with pytest.raises(ConfigError, match="linear-test has no activation checkpointing"):
        LocalTrainer(LinearTask(), msgspec.structs.replace(spec(), gradient_checkpointing=True), "r")  # type: ignore[arg-type]
