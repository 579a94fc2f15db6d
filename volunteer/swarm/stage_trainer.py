"""What a stage server computes (plain torch, no trio): forward without a graph, backward by recomputing,
gradient sums accumulated toward the stage's next step (issue 17 item 2; the wire is :mod:`protocols.swarm`).

A :class:`StageWorker` owns one :class:`~volunteer.tasks.stages.Stage` of the run's model.

* :meth:`StageWorker.forward` runs the stage under ``torch.no_grad``: nothing is kept, so a server's
  memory does not grow with the micro-batches in flight.
* :meth:`StageWorker.backward` runs the stage again with autograd (activation checkpointing, as SWARM's
  servers do: §3.2) and takes the gradients with ``torch.autograd.grad`` into fresh tensors. Only when
  every one of them is finite are they added into the parameters' ``.grad`` and the micro-batch's samples
  counted: a request that would poison the accumulators (a non-finite input or gradient) is refused whole,
  and the accumulators stay what they were. The last stage back-propagates ``loss * samples``, so the
  accumulators hold per-sample *sums* over the step's micro-batches, as the batch mode's do
  (:class:`volunteer.collab.trainer.LocalTrainer`); dividing by the counted samples gives the mean.
* :meth:`StageWorker.take_gradients` hands the sums out and clears them (the stage's averaging then
  averages ``sum / samples`` among the stage's servers, weighted by samples).

Every method may be called from any thread; a lock serialises them. What the stage cannot run on (a wrong
width, a token id outside the vocabulary, a field missing) raises :class:`StageInputError`, which the
server answers as the request's fault.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from volunteer.tasks.stages import Stage

__all__ = ["StageInputError", "StageWorker", "TakenGradients"]

#: What a stage raises on inputs it cannot run on (torch checks some shapes with ``assert``).
_RUN_FAILURES = (RuntimeError, IndexError, ValueError, TypeError, AssertionError)


class StageInputError(ValueError):
    """The stage cannot run on this request's inputs (the request's fault, not the server's)."""


@dataclass(frozen=True)
class TakenGradients:
    """A stage's accumulated gradient sums (flat, in parameter order) and the samples they are over."""

    gradient_sum: np.ndarray
    samples: int


class StageWorker:
    """One stage's computation (module docstring)."""

    def __init__(self, stage: Stage, device: str = "cpu") -> None:
        self.stage = stage
        self.device = torch.device(device)
        self.stage.to(self.device)
        self.params = [p for p in stage.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.last = stage.index == stage.count - 1
        self.samples = 0  # counted toward the next step
        self.step = 0
        #: seconds per sample of the recent backward passes (an EMA; 0 until measured)
        self.seconds_per_sample = 0.0
        self._lock = threading.Lock()

    @property
    def first(self) -> bool:
        return self.stage.index == 0

    def forward(self, hidden: torch.Tensor | None, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The stage's output for the next stage (not the last stage's loss: see the module docstring)."""
        if self.last:
            raise StageInputError("the last stage runs forward only as part of a backward request")
        with self._lock, torch.no_grad():
            self.stage.train()
            out = self._run(hidden, batch)
            if not bool(torch.isfinite(out).all()):
                raise StageInputError(f"stage {self.stage.index}'s output is not finite")
            return out.detach().float().cpu()

    def backward(
        self,
        hidden: torch.Tensor | None,
        batch: Mapping[str, torch.Tensor],
        grad: torch.Tensor | None,
        samples: int,
    ) -> tuple[torch.Tensor | None, float | None]:
        """Recompute, back-propagate ``grad`` (the loss times ``samples`` for the last stage) and accumulate;
        returns the gradient of ``hidden`` (``None`` for the first stage) and the loss (last stage only).

        Raises:
            StageInputError: the inputs do not fit the stage, or a gradient came out non-finite (nothing
                was accumulated then).
        """
        if (grad is None) != self.last:
            raise StageInputError("every stage but the last needs the gradient of its output")
        with self._lock:
            started = time.perf_counter()
            self.stage.train()
            leaf = None if hidden is None else hidden.to(self.device).detach().requires_grad_(True)
            with torch.enable_grad():
                out = self._run(leaf, batch)
                if self.last:
                    if out.dim() != 0:
                        raise StageInputError(f"the last stage returned shape {tuple(out.shape)}, not a loss")
                    target, grad_outputs = out.float() * samples, None
                else:
                    assert grad is not None
                    if tuple(grad.shape) != tuple(out.shape):
                        shapes = f"{tuple(grad.shape)} for an output of shape {tuple(out.shape)}"
                        raise StageInputError(f"a gradient of shape {shapes}")
                    target, grad_outputs = out, grad.to(self.device, out.dtype)
                inputs = [*self.params, *([leaf] if leaf is not None else [])]
                grads: tuple[torch.Tensor | None, ...] = torch.autograd.grad(
                    target, inputs, grad_outputs=grad_outputs, allow_unused=True
                )
            loss = float(out.detach()) if self.last else None
            if loss is not None and not np.isfinite(loss):
                raise StageInputError("the micro-batch's loss is not finite")
            for g in grads:
                if g is not None and not bool(torch.isfinite(g).all()):
                    raise StageInputError("a gradient came out non-finite; nothing was accumulated")
            for p, g in zip(self.params, grads, strict=False):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.detach().clone()
                else:
                    p.grad.add_(g)
            self.samples += samples
            elapsed = (time.perf_counter() - started) / samples
            self.seconds_per_sample = (
                elapsed if self.seconds_per_sample == 0.0 else 0.9 * self.seconds_per_sample + 0.1 * elapsed
            )
            grad_in = None if leaf is None else grads[-1]
            return (None if grad_in is None else grad_in.detach().float().cpu()), loss

    def take_gradients(self) -> TakenGradients:
        """Hand out and clear the accumulated gradient sums and their samples."""
        with self._lock:
            flat = np.zeros(self.numel, dtype=np.float32)
            offset = 0
            for p in self.params:
                size = p.numel()
                if p.grad is not None:
                    flat[offset : offset + size] = p.grad.detach().reshape(-1).float().cpu().numpy()
                    p.grad = None
                offset += size
            taken = TakenGradients(flat, self.samples)
            self.samples = 0
            return taken

    def _run(self, hidden: torch.Tensor | None, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if hidden is not None and not bool(torch.isfinite(hidden).all()):
            raise StageInputError("the stage's input holds non-finite values")
        fields = {name: batch[name].to(self.device) for name in self.stage.needs if name in batch}
        try:
            out: torch.Tensor = self.stage(hidden, fields)
        except _RUN_FAILURES as exc:
            raise StageInputError(f"stage {self.stage.index} cannot run on this input: {exc}") from exc
        return out
