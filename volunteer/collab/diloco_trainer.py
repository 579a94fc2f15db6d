"""The local half of the DiLoCo mode: inner steps at our own pace, the pseudo-gradient out, the outer step in
(torch, no trio; ``[sync] mode = "diloco"``).

The algorithm and how it sits on the batch mode's machinery are in :mod:`.diloco` ("The algorithm", "The
running mode"). This class is a :class:`~.trainer.LocalTrainer` whose methods mean, one round being one
global step:

==================== =========================================================================================
``accumulate``        forward/backward; an inner step (the run's optimizer, lr from the schedule at the round)
                      whenever ``local_batch`` samples have accumulated
``take_gradients``    flush a partial inner batch, hand out ``Δ + e`` (:class:`PseudoGradient`) with our
                      samples as its weight; the parameters stay where the inner steps left them
``restore_gradients`` the round failed: our samples count again, inner training goes on from where it is
``sent``              the round completed: the error-feedback residual of what the wire carried
``apply``             the outer step on ``θ_t`` with the group's ``Δ̄``; the model is set to ``θ_{t+1}``
``discard_gradients`` drop the inner phase: the model back to ``θ_t``, a fresh inner optimizer, ``e = 0``
``state_blob``        ``model/*`` = ``θ_t`` and ``outer/<param index>/momentum_buffer``; no inner state
==================== =========================================================================================

**Overlap** (``[sync] overlap = true``; the rule and its reasons are in :mod:`.diloco`, "Overlap"). The
trainer keeps the phase's start ``s`` beside ``θ``: without overlap ``s = θ_t`` always (``apply`` loads
``θ_{t+1}`` into the model). With it, ``take_gradients`` hands out ``Δ = s - x`` and re-bases at once --
``s := OuterStep(θ_t, b_t, Δ)`` (the eager rule; ``θ_t - Δ`` with ``overlap = "shift"``) and the model is
set to ``s`` -- so inner training goes on while the round averages; ``apply`` then only advances ``θ`` and
``b`` (the model is not touched: the new ``θ`` enters at the next re-base). A round that fails gives its
``Δ`` back (``s := s + Δ``), so the next round's ``Δ`` holds it: nothing is lost (the phase under way still
started from the eager guess, which the next re-base replaces).

Precision: the inner steps run in fp32 or under bf16 autocast; fp16 needs a loss scale per inner step,
which the collective rule of :mod:`volunteer.precision` does not give, so it is refused here (the session
picks fp32 for ``--precision auto`` on a GPU without bf16).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from protocols.training import TrainingSpec
from shared.averaging.compression import codec_by_name
from shared.errors import ConfigError, StateError
from shared.state.blob import encode_state
from shared.state.lineage import extend_lineage

from ..precision import Precision, autocast
from .diloco import ErrorFeedback, OuterOptimizer, OverlapRule, flatten, load_flat, overlap_start, wire_layout
from .trainer import Accumulated, Float32Array, LocalTrainer

if TYPE_CHECKING:
    from ..tasks import Task

__all__ = ["DilocoTrainer", "PseudoGradient", "make_trainer", "overlap_rule"]

OUTER_PREFIX = "outer/"


@dataclass(frozen=True)
class PseudoGradient(Accumulated):
    """``gradient_sum`` holds the vector to send itself, ``Δ + e`` (not a sum over samples): its
    :meth:`mean` is a copy of that vector (the averaging overwrites what it is given), averaged with
    weight ``samples``."""

    def mean(self) -> Float32Array:
        vector: Float32Array = self.gradient_sum.copy()
        return vector


def overlap_rule(spec: TrainingSpec) -> OverlapRule | None:
    """The run's overlap rule (``[sync] overlap``: ``true`` is ``"eager"``), None without overlap."""
    overlap = spec.sync.overlap
    if overlap is False:
        return None
    return "eager" if overlap is True else overlap


class DilocoTrainer(LocalTrainer):
    """See the module docstring. ``base`` is ``θ_t``, the global parameters of the current step."""

    def __init__(
        self,
        task: Task,
        spec: TrainingSpec,
        run_id: str,
        device: str = "cpu",
        precision: Precision = "fp32",
        growth_interval: int = 0,
    ) -> None:
        if precision == "fp16":
            raise ConfigError(
                "the diloco mode trains in fp32 or bf16: fp16 inner steps would need a loss scale of their "
                "own; use --precision fp32 (or bf16 where the GPU has it)"
            )
        super().__init__(task, spec, run_id, device, precision, growth_interval)
        self.base = flatten(self.params)
        self.overlap = overlap_rule(spec)
        self._start = self.base.clone()  # where the inner phase started (``s``; ``θ_t`` without overlap)
        self._in_flight: torch.Tensor | None = None  # the ``Δ`` of the round under way (overlap)
        self.outer = OuterOptimizer(self.numel, spec.sync.outer_lr, spec.sync.outer_momentum)
        self.feedback = ErrorFeedback(codec_by_name(spec.codec), self.numel) if spec.codec != "none" else None
        self.inner_steps = 0  # taken since the start (the panel's and tests' count)
        self._pending = 0  # samples in the gradients not yet stepped
        self._sending: Float32Array | None = None  # the ``Δ + e`` of the round under way

    # ------------------------------------------------------------------ the inner phase

    def accumulate(self, batch: Mapping[str, torch.Tensor]) -> tuple[int, float]:
        with self._lock:
            started = time.perf_counter()
            batch = {k: v.to(self.device) for k, v in batch.items()}
            n = self.task.batch_size(batch)
            self.model.train()
            with autocast(self.device.type, self.precision):
                loss = self.task.loss(self.model, batch)
            (loss.float() * n).backward()  # type: ignore[no-untyped-call]
            value = float(loss.detach())
            self._pending += n
            self.samples += n
            self._loss_sum += value * n
            if self._pending >= self.spec.local_batch:
                self._inner_step()
            self._compute_seconds += time.perf_counter() - started
            return n, value

    def _inner_step(self) -> None:
        """One step of the inner optimizer on the mean gradient of the pending samples."""
        scale = 1.0 / self._pending
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        if self.spec.optimizer.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.spec.optimizer.clip_grad_norm)
        lr = self.spec.optimizer.lr * self.spec.schedule.factor(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        self._pending = 0
        self.inner_steps += 1

    def take_gradients(self) -> PseudoGradient:
        """``Δ + e`` with our samples of this round (module docstring). Without overlap the parameters are
        not changed; with it they are re-based (module docstring, "Overlap"), or, if ``Δ`` is not finite
        (the inner phase diverged), set back to ``θ_t`` with the inner work dropped."""
        with self._lock:
            if self._pending:
                self._inner_step()
            local = flatten(self.params)
            delta = self._start - local
            vector = delta.numpy()
            finite = bool(np.isfinite(vector).all())  # not: the step receives only; no residual from it
            if self.overlap and finite:  # re-base: s := OuterStep(θ_t, b_t, Δ) (eager) or θ_t - Δ (shift)
                start = overlap_start(
                    self.overlap, self.base, self.outer.buffer, delta, self.outer.lr, self.outer.momentum
                )
                # shift: the model moves by θ_t - s (exactly where it is when s = θ_t), as it always did
                load_flat(
                    self.params, local + (self.base - self._start) if self.overlap == "shift" else start
                )
                self._start = start
                self._in_flight = delta
            elif self.overlap:  # nothing of this phase can be sent or kept
                load_flat(self.params, self.base)
                self._start = self.base.clone()
                self.optimizer.state.clear()
            if self.feedback is not None and finite:
                vector = self.feedback.corrected(delta)
            self._sending = vector.copy() if finite else None
            return PseudoGradient(vector, *self._hand_out_counts())

    def restore_gradients(self, taken: Accumulated) -> None:
        """The round failed: the samples are ours again; the parameters still hold the inner work."""
        with self._lock:
            self._take_back_counts(taken)
            self._sending = None
            if self._in_flight is not None:  # overlap: the next round's Δ holds this one's again
                self._start = self._start + self._in_flight
                self._in_flight = None

    def sent(self, slice_sizes: tuple[int, ...] | None, part_numel: int, me: int) -> None:
        """The round that carried the last :meth:`take_gradients` vector completed (``slice_sizes`` None: a
        lone step, nothing went over the wire): keep the error-feedback residual of what was sent."""
        with self._lock:
            if self.feedback is None or self._sending is None:
                return
            layout = (
                [(self.numel, False)] if slice_sizes is None else wire_layout(slice_sizes, part_numel, me)
            )
            self.feedback.commit(self._sending, layout)
            self._sending = None

    def discard_gradients(self) -> None:
        with self._lock:
            self._reset_to_base()

    # ------------------------------------------------------------------ the outer step

    def apply(self, mean_gradient: Float32Array | None, overflow: bool = False) -> int:
        """The outer step with the group's averaged pseudo-gradient; None (nothing finite to apply): the
        step advances with ``θ`` unchanged and our inner phase is dropped. Returns the new step."""
        if mean_gradient is not None and mean_gradient.shape != (self.numel,):
            raise ValueError(f"pseudo-gradient has shape {mean_gradient.shape}, expected ({self.numel},)")
        with self._lock:
            if mean_gradient is not None:
                self.base = self.outer.step(self.base, torch.from_numpy(np.ascontiguousarray(mean_gradient)))
            self._sending = None
            self._in_flight = None
            # With overlap the inner phase under way goes on (θ_{t+1} enters at its re-base), unless there
            # was nothing finite to apply: then, as without overlap, the inner work starts over from θ.
            if not (self.overlap and mean_gradient is not None):
                load_flat(self.params, self.base)
                self._start = self.base.clone()
                for p in self.params:
                    p.grad = None
                self._pending = 0
            self.step += 1
            self.lineage = extend_lineage(self.lineage, self.step, self._fingerprint())
            return self.step

    # ------------------------------------------------------------------ the global state

    def _fingerprint(self) -> bytes:
        """As the batch mode's, of ``θ_t`` (the same bytes when the model holds ``θ_t``)."""
        return self._digest(part[:: self._stride] for part in self._per_param(self.base.numpy()))

    def _per_param(self, flat: np.ndarray) -> list[np.ndarray]:
        """``flat`` cut into the parameters' sizes, in order (views)."""
        parts, offset = [], 0
        for p in self.params:
            parts.append(flat[offset : offset + p.numel()])
            offset += p.numel()
        return parts

    @contextlib.contextmanager
    def _theta_in_model(self) -> Iterator[None]:
        """The model holds ``θ_t`` inside (under the lock), its inner-phase parameters again after."""
        local = flatten(self.params)
        load_flat(self.params, self.base)
        try:
            yield
        finally:
            load_flat(self.params, local)

    def parameter_vector(self) -> Float32Array:
        with self._lock:
            vector: Float32Array = self.base.numpy().copy()
            return vector

    def copy_state_into(self, model: torch.nn.Module) -> tuple[int, bytes]:
        with self._lock:
            with self._theta_in_model():
                model.load_state_dict(self.model.state_dict(), strict=True)
            return self.step, self.lineage.get(self.step) or self._fingerprint()

    def state_blob(self) -> bytes:
        with self._lock:
            with self._theta_in_model():  # copies: the model gets its inner-phase parameters back
                tensors = {name: value.copy() for name, value in self._model_tensors().items()}
            buffer = self.outer.state_dict()["momentum_buffer"].numpy()
            for i, (p, part) in enumerate(zip(self.params, self._per_param(buffer), strict=True)):
                tensors[f"{OUTER_PREFIX}{i}/momentum_buffer"] = part.reshape(p.shape)
            return encode_state(tensors, {**self._metadata(), "sync": "diloco"})

    def _loaded(self, tensors: Mapping[str, np.ndarray]) -> None:
        """A downloaded state: ``θ_t`` is what the model now holds; the outer momentum from ``outer/*``
        (every parameter's, or none: a state of step 0); a fresh inner phase."""
        outer = {k: v for k, v in tensors.items() if k.startswith(OUTER_PREFIX)}
        parts = []
        for i, p in enumerate(self.params):
            value = outer.pop(f"{OUTER_PREFIX}{i}/momentum_buffer", None)
            if value is None:
                break
            if value.size != p.numel() or value.dtype != np.float32:
                raise StateError(f"outer momentum of parameter {i} does not fit it")
            parts.append(value.reshape(-1))
        if outer or (parts and len(parts) != len(self.params)):
            raise StateError("the state's outer momentum does not fit the model's parameters")
        buffer = np.concatenate(parts) if parts else np.zeros(self.numel, dtype=np.float32)
        state = self.outer.state_dict()
        try:
            self.outer.load_state_dict({**state, "momentum_buffer": torch.from_numpy(buffer.copy())})
        except ValueError as exc:
            raise StateError(f"the state's outer momentum is unusable: {exc}") from exc
        self.outer.rounds = self.step
        self.base = flatten(self.params)
        self._reset_to_base()

    def _reset_to_base(self) -> None:
        load_flat(self.params, self.base)
        self._start = self.base.clone()
        self._in_flight = None
        self.optimizer.state.clear()
        if self.feedback is not None:
            self.feedback.reset()
        self._pending = 0
        self._sending = None
        self._clear()


def make_trainer(
    task: Task,
    spec: TrainingSpec,
    run_id: str,
    device: str = "cpu",
    precision: Precision = "fp32",
    growth_interval: int = 0,
) -> LocalTrainer:
    """The trainer of the run's synchronization mode (``spec.sync.mode``)."""
    kind = DilocoTrainer if spec.sync.mode == "diloco" else LocalTrainer
    return kind(task, spec, run_id, device, precision, growth_interval)
