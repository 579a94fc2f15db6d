"""The local half of collaborative training: a model, its optimizer, and accumulated gradients (torch).

Everything here is synchronous and runs in worker threads; one lock serializes the methods, so a
micro-batch and an optimizer step never touch the parameters at the same time (with delayed parameter
updates the two are requested concurrently).

**Accumulation.** ``accumulate(batch)`` runs forward/backward on the task's *mean* loss scaled by the
batch's sample count, so ``param.grad`` holds the *sum* of per-sample gradients. ``take_gradients()`` hands
that sum out as one flat float32 vector (and clears the accumulators); the averaging sends
``sum / samples`` (the local mean) with weight ``samples``, and the group's weighted mean is exactly the
mean gradient of the whole global batch — what one process would compute with the same samples.

**Stepping.** ``apply(mean_gradient)`` writes the averaged vector into ``param.grad`` (keeping any
gradients accumulated meanwhile aside), clips if the spec says so, sets the learning rate from the schedule
at the current global step, takes one optimizer step and increments ``step``.

**State.** ``state_blob()`` is the safetensors encoding of ``model/<name>`` (parameters and buffers) and
``optim/<param index>/<key>`` (the optimizer's per-parameter tensors) with the step, run id and task in
the metadata (see :mod:`shared.state.blob`); ``load_state_blob`` restores all of it and drops accumulated
gradients. ``fingerprint()`` is a short hash of a fixed sample of the parameters, cheap enough for every
step, that peers compare to detect divergence; ``lineage`` holds the fingerprints of the last states and
travels in the state's metadata (:mod:`shared.state.lineage`), so a peer that loads a state can tell which
of its own steps the collaboration did not take.

**Precision** (:mod:`volunteer.precision`). The task's forward pass and loss run under autocast to the
trainer's ``precision``; with fp16 the loss is multiplied by the collaboration's loss scale S before
``backward()`` and ``take_gradients()`` divides the sum by the S it was accumulated with (a power of two:
exact). The S of an accumulation is fixed at its first micro-batch, so micro-batches computed while a step
changes S (delayed parameter updates) are unscaled by the S they used. ``apply(mean_gradient, overflow=...)``
follows the collective rule (:func:`volunteer.precision.after_round`): a skipped step advances ``step`` with
the parameters and optimizer state unchanged. The scale is part of the state (``loss_scale`` metadata) and of
the fingerprint, so a peer whose scale differs is seen to diverge.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from protocols.training import OptimizerSpec, TrainingSpec
from shared.errors import ConfigError, StateError
from shared.state.blob import STATE_FORMAT, decode_state, encode_state
from shared.state.lineage import decode_lineage, encode_lineage, extend_lineage

from ..precision import LossScale, Precision, after_round, autocast
from .lamb import Lamb

if TYPE_CHECKING:
    from ..tasks import Task

__all__ = ["Accumulated", "LocalTrainer", "make_optimizer"]

FINGERPRINT_SAMPLE = 65_536
Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Accumulated:
    """Gradients taken out of the model: their sum over ``samples`` samples, and the mean loss."""

    gradient_sum: Float32Array
    samples: int
    loss: float | None
    compute_seconds: float

    def mean(self) -> Float32Array:
        mean: Float32Array = self.gradient_sum / np.float32(max(1, self.samples))
        return mean


def make_optimizer(spec: OptimizerSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if spec.name == "adam":
        return torch.optim.Adam(
            params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
        )
    if spec.name == "lamb":
        return Lamb(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(
        params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
    )


class LocalTrainer:
    def __init__(
        self,
        task: Task,
        spec: TrainingSpec,
        run_id: str,
        device: str = "cpu",
        precision: Precision = "fp32",
        growth_interval: int = 0,  # clean steps before the loss scale doubles; 0: precision.GROWTH_INTERVAL
    ) -> None:
        self.task = task
        self.spec = spec
        self.run_id = run_id
        self.device = torch.device(device)
        self.precision: Precision = precision
        self.model = task.build_model().to(self.device)
        if spec.gradient_checkpointing:  # the task raises ConfigError if its model cannot
            enable = getattr(task, "gradient_checkpointing", None)
            if not callable(enable):
                raise ConfigError(
                    f"{task.name} has no activation checkpointing; remove gradient_checkpointing"
                )
            enable(self.model, True)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.optimizer = make_optimizer(spec.optimizer, self.params)
        self.step = 0
        self.samples = 0  # accumulated toward step + 1
        self._loss_sum = 0.0
        self._compute_seconds = 0.0
        self._lock = threading.Lock()
        self._stride = max(1, self.numel // FINGERPRINT_SAMPLE)
        #: fingerprints of the last states, step -> fingerprint (:mod:`shared.state.lineage`)
        self.lineage: dict[int, bytes] = {}
        #: the collaboration's loss scale (part of the state; followed by every member, see .precision)
        self.loss_scale = LossScale()
        self._growth = growth_interval
        self._grad_scale: float | None = None  # the S the gradients now accumulated were computed with
        #: samples per forward/backward (spec.local_batch unless fitted to the device or set by the user)
        self.micro_batch = spec.local_batch

    @property
    def scales_loss(self) -> bool:
        """This trainer multiplies the loss by the loss scale (fp16); it then claims its overflows."""
        return self.precision == "fp16"

    # ------------------------------------------------------------------ accumulation

    def accumulate(self, batch: Mapping[str, torch.Tensor]) -> tuple[int, float]:
        """One forward/backward pass; returns (samples, mean loss of this batch)."""
        with self._lock:
            started = time.perf_counter()
            batch = {k: v.to(self.device) for k, v in batch.items()}
            n = self.task.batch_size(batch)
            self.model.train()
            with autocast(self.device.type, self.precision):
                loss = self.task.loss(self.model, batch)
            scale = self._accumulation_scale()
            (loss.float() * (n * scale if scale != 1.0 else n)).backward()  # type: ignore[no-untyped-call]
            value = float(loss.detach())
            self.samples += n
            self._loss_sum += value * n
            self._compute_seconds += time.perf_counter() - started
            return n, value

    def take_gradients(self) -> Accumulated:
        """Hand out (and clear) the accumulated gradient sum; see the module docstring."""
        with self._lock:
            flat = np.empty(self.numel, dtype=np.float32)
            offset = 0
            for p in self.params:
                size = p.numel()
                if p.grad is not None:
                    flat[offset : offset + size] = p.grad.detach().reshape(-1).cpu().numpy()
                    p.grad = None
                else:
                    flat[offset : offset + size] = 0.0
                offset += size
            if self._grad_scale is not None and self._grad_scale != 1.0:
                flat *= np.float32(1.0 / self._grad_scale)  # a power of two: exact
            self._grad_scale = None
            return Accumulated(flat, *self._hand_out_counts())

    def restore_gradients(self, taken: Accumulated) -> None:
        """Put gradients taken for a round that failed back into the accumulators."""
        with self._lock:
            scale = self._accumulation_scale()
            self._add_into_grads(
                taken.gradient_sum * np.float32(scale) if scale != 1.0 else taken.gradient_sum
            )
            self._take_back_counts(taken)

    def sent(self, slice_sizes: tuple[int, ...] | None, part_numel: int, me: int) -> None:
        """The round that carried the last taken vector completed (``slice_sizes`` None: a lone step).
        Nothing to keep in the batch mode (a synchronization mode with error feedback keeps its residual)."""

    def discard_gradients(self) -> None:
        with self._lock:
            self._clear()

    # ---------------------------------------------------------------------- stepping

    def apply(self, mean_gradient: Float32Array | None, overflow: bool = False) -> int:
        """One optimizer step with ``mean_gradient`` (the collaboration's average); returns the new step.

        ``overflow``: a member of the round claimed an fp16 overflow; ``mean_gradient`` None: there is no
        finite vector to apply. The loss scale's rule (:func:`volunteer.precision.after_round`) decides
        whether the step is skipped: then ``step`` advances with the parameters and optimizer state
        unchanged."""
        if mean_gradient is not None and mean_gradient.shape != (self.numel,):
            raise ValueError(f"gradient has shape {mean_gradient.shape}, expected ({self.numel},)")
        with self._lock:
            growth = {"growth_interval": self._growth} if self._growth else {}
            self.loss_scale, skip = after_round(
                self.loss_scale, overflow, mean_gradient is not None, **growth
            )
            if skip or mean_gradient is None:
                self.step += 1
                self.lineage = extend_lineage(self.lineage, self.step, self._fingerprint())
                return self.step
            pending = [p.grad for p in self.params]
            source = torch.from_numpy(np.ascontiguousarray(mean_gradient))
            offset = 0
            for p in self.params:
                size = p.numel()
                p.grad = source[offset : offset + size].view_as(p).to(p.device, copy=True)
                offset += size
            if self.spec.optimizer.clip_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.spec.optimizer.clip_grad_norm)
            lr = self.spec.optimizer.lr * self.spec.schedule.factor(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            for p, grad in zip(self.params, pending, strict=True):
                p.grad = grad
            self.step += 1
            self.lineage = extend_lineage(self.lineage, self.step, self._fingerprint())
            return self.step

    def fingerprint(self) -> bytes:
        """8 bytes identifying the parameters and the step (a fixed strided sample of the parameters)."""
        with self._lock:
            return self._fingerprint()

    def _fingerprint(self) -> bytes:
        # the strided sample is taken on the device: only it is copied to the CPU (every step)
        return self._digest(p.detach().reshape(-1)[:: self._stride].cpu().numpy() for p in self.params)

    def _digest(self, samples: Iterable[np.ndarray]) -> bytes:
        """The fingerprint of the step, the loss scale and each parameter's strided sample (``[::stride]``
        of the flat parameter)."""
        digest = hashlib.blake2b(digest_size=8)
        digest.update(self.step.to_bytes(8, "little"))
        if self.loss_scale != LossScale():  # the initial scale adds nothing: fingerprints of old states hold
            digest.update(self.loss_scale.encode().encode())
        for sample in samples:
            digest.update(sample.tobytes())
        return digest.digest()

    def copy_state_into(self, model: torch.nn.Module) -> tuple[int, bytes]:
        """Copy the parameters and buffers into ``model`` (the same task's architecture) under the lock,
        so they are exactly those of one step; returns that step and its fingerprint (held-out
        evaluation, volunteer.evaluation)."""
        with self._lock:
            model.load_state_dict(self.model.state_dict(), strict=True)
            return self.step, self.lineage.get(self.step) or self._fingerprint()

    def parameter_vector(self) -> Float32Array:
        with self._lock:
            return torch.cat([p.detach().reshape(-1).cpu() for p in self.params]).numpy()

    # ------------------------------------------------------------------------- state

    def state_blob(self) -> bytes:
        """The full training state as a safetensors blob (see the module docstring)."""
        with self._lock:
            tensors = self._model_tensors()
            index = {id(p): i for i, p in enumerate(self.params)}
            for p, state in self.optimizer.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"optim/{index[id(p)]}/{key}"] = value.detach().cpu().numpy()
            return encode_state(tensors, self._metadata())

    def load_state_blob(self, blob: bytes) -> int:
        """Restore parameters, optimizer state and step from a state blob; returns the step.

        Raises:
            StateError: the blob is not a state of this run's task (format, names or shapes differ).
        """
        tensors, metadata = decode_state(blob)
        if metadata.get("format") != STATE_FORMAT or metadata.get("task") != self.task.name:
            raise StateError(f"not a {self.task.name} state: metadata {dict(metadata)}")
        try:
            step = int(metadata["step"])
        except (KeyError, ValueError) as exc:
            raise StateError("state without a valid step") from exc
        try:
            loss_scale = LossScale.decode(metadata.get("loss_scale"))
        except ValueError as exc:
            raise StateError(f"state with an invalid loss scale: {exc}") from exc
        model_state = {
            k[len("model/") :]: torch.from_numpy(v.copy())
            for k, v in tensors.items()
            if k.startswith("model/")
        }
        optim: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("optim/"):
                _, index, name = key.split("/", 2)
                optim.setdefault(int(index), {})[name] = torch.from_numpy(value.copy())
        with self._lock:
            try:
                self.model.load_state_dict(model_state, strict=True)
            except RuntimeError as exc:
                raise StateError(f"state does not fit the model: {exc}") from exc
            if any(i >= len(self.params) for i in optim):
                raise StateError("state has optimizer entries for parameters the model does not have")
            self.optimizer.state.clear()
            for i, entry in optim.items():
                param = self.params[i]
                self.optimizer.state[param] = {
                    k: v.to(param.device) if v.dim() > 0 else v for k, v in entry.items()
                }
            self.step = step
            self.loss_scale = loss_scale
            self._loaded(tensors)
            lineage = decode_lineage(metadata.get("lineage", ""))  # absent or malformed: {}
            self.lineage = extend_lineage(lineage, step, self._fingerprint())
            self._clear()
            return step

    # ---------------------------------------------------------------------- helpers

    def _model_tensors(self) -> dict[str, np.ndarray]:
        """``model/<name>`` for every parameter and buffer (views of them: encode under the lock)."""
        return {
            f"model/{name}": value.detach().cpu().numpy() for name, value in self.model.state_dict().items()
        }

    def _metadata(self) -> dict[str, str]:
        return {
            "format": STATE_FORMAT,
            "step": str(self.step),
            "run_id": self.run_id,
            "task": self.task.name,
            "lineage": encode_lineage(self.lineage),
            "loss_scale": self.loss_scale.encode(),
        }

    def _hand_out_counts(self) -> tuple[int, float | None, float]:
        """(samples, mean loss, compute seconds) of what was accumulated; the counts start over."""
        counts = (
            self.samples,
            self._loss_sum / self.samples if self.samples else None,
            self._compute_seconds,
        )
        self.samples, self._loss_sum, self._compute_seconds = 0, 0.0, 0.0
        return counts

    def _take_back_counts(self, taken: Accumulated) -> None:
        """A failed round's samples, loss and compute count toward the next one again."""
        self.samples += taken.samples
        if taken.loss is not None:
            self._loss_sum += taken.loss * taken.samples
        self._compute_seconds += taken.compute_seconds

    def _loaded(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Called under the lock once a state's model and optimizer are loaded (before its fingerprint):
        a synchronization mode restores state of its own from the blob's other tensors."""

    def _accumulation_scale(self) -> float:
        """The S of the accumulation under way (fixed at its first micro-batch); 1 without fp16."""
        if not self.scales_loss:
            return 1.0
        if self._grad_scale is None:
            self._grad_scale = self.loss_scale.scale
        return self._grad_scale

    def _clear(self) -> None:
        self._grad_scale = None
        for p in self.params:
            p.grad = None
        self.samples, self._loss_sum, self._compute_seconds = 0, 0.0, 0.0

    def _add_into_grads(self, flat: Float32Array) -> None:
        source = torch.from_numpy(np.ascontiguousarray(flat))
        offset = 0
        for p in self.params:
            size = p.numel()
            chunk = source[offset : offset + size].view_as(p).to(p.device)
            p.grad = chunk.clone() if p.grad is None else p.grad + chunk
            offset += size
