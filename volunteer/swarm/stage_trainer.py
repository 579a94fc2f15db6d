"""What a stage server computes (plain torch, no trio): forward without a graph, backward by recomputing,
gradient sums accumulated toward the stage's next step (issue 17 item 2; the wire is :mod:`protocols.swarm`).

A :class:`StageTrainer` is the batch mode's :class:`~volunteer.collab.trainer.LocalTrainer` for one
:class:`~volunteer.tasks.stages.Stage` of the run's model (its optimizer, step, fingerprints, state blobs
and gradient hand-out), fed by trainers' requests instead of batches:

* :meth:`StageTrainer.forward` runs the stage under ``torch.no_grad``: nothing is kept, so a server's
  memory does not grow with the micro-batches in flight.
* :meth:`StageTrainer.backward` runs the stage again with autograd (activation checkpointing, as SWARM's
  servers do: §3.2) and takes the gradients with ``torch.autograd.grad`` into fresh tensors. Only when
  every one of them is finite are they added into the parameters' ``.grad`` and the micro-batch's samples
  counted: a request that would poison the accumulators (a non-finite input or gradient) is refused whole,
  and the accumulators stay what they were. The last stage back-propagates ``loss * samples``, so the
  accumulators hold per-sample *sums* over the step's micro-batches, as the batch mode's do; the stage's
  collaboration hands them out (:meth:`~volunteer.collab.trainer.LocalTrainer.take_gradients`) and
  averages ``sum / samples`` among the stage's servers, weighted by samples.

**Tied weights are untied in a swarm run.** The built-in models tie the output layer to the token
embedding; split into stages, the last stage holds a copy (:mod:`volunteer.tasks.stages`, "Tied weights").
Summing the two copies' gradients every step would make the first and the last stage step together, over
the network, with the embedding's gradient (the largest tensor of a small model). A swarm run instead
trains the copy as a parameter of its own, from equal starting values, as a model configured with
``tie_word_embeddings = False`` does: the model a swarm run trains *is* its stages.

Every method may be called from any thread; the trainer's lock serialises them. What the stage cannot run
on (a wrong width, a token id outside the vocabulary, a field missing) raises :class:`StageInputError`,
which the server answers as the request's fault.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import torch

from protocols.swarm import stage_tag
from protocols.training import TrainingSpec
from shared.errors import ConfigError, StateError
from shared.state.blob import decode_state

from ..collab.trainer import FINGERPRINT_SAMPLE, LocalTrainer, make_optimizer
from ..tasks.base import Task
from ..tasks.stages import split_model

__all__ = ["StageInputError", "StageTrainer"]

#: What a stage raises on inputs it cannot run on (torch checks some shapes with ``assert``).
_RUN_FAILURES = (RuntimeError, IndexError, ValueError, TypeError, AssertionError)


class StageInputError(ValueError):
    """The stage cannot run on this request's inputs (the request's fault, not the server's)."""


class StageTrainer(LocalTrainer):
    """One stage's computation and its share of the collaboration's bookkeeping (module docstring).

    A :class:`~volunteer.collab.trainer.LocalTrainer` whose model is stage ``index`` of ``stages`` of the
    task's model: its optimizer, step, fingerprints, state blobs (tagged with the stage, and a state of
    another stage refused) and gradient hand-out are the batch mode's, so a stage's servers run the batch
    mode's collaborative optimizer unchanged under the stage's keys (:func:`protocols.swarm
    .stage_training_keys`). Gradients come from :meth:`backward` (trainers' requests), not from
    :meth:`accumulate`.

    Raises:
        ConfigError: the task cannot be split so (:func:`~volunteer.tasks.stages.split_model`), or a
            precision other than fp32 (loss scaling across stages is not built).
    """

    def __init__(
        self, task: Task, spec: TrainingSpec, run_id: str, index: int, stages: int, device: str = "cpu"
    ) -> None:
        super().__init__(task, spec, run_id, device)
        if self.precision != "fp32":
            raise ConfigError("pipeline stages train in fp32 only")
        staged = split_model(task, self.model, stages)
        if not 0 <= index < stages:
            raise ConfigError(f"stage {index} of {stages} stages")
        self.stage = staged.stages[index].to(self.device)
        self.model = self.stage
        self.params = [p for p in self.stage.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.optimizer = make_optimizer(spec.optimizer, self.params)
        self._stride = max(1, self.numel // FINGERPRINT_SAMPLE)
        self.last = index == stages - 1
        #: seconds per sample of the recent forward and backward passes (EMAs; 0 until measured)
        self.forward_seconds = 0.0
        self.backward_seconds = 0.0

    @property
    def seconds_per_sample(self) -> float:
        """The stage's busy time per sample: one forward and one backward (every sample passes every stage
        but the last both ways), the unmeasured one estimated from the other (a backward recomputes the
        forward, so it takes about twice as long); the last stage's backward alone (it serves no forwards:
        its backward runs its forward); 0 until measured."""
        forward, backward = self.forward_seconds, self.backward_seconds
        if self.last:
            return backward
        if forward and backward:
            return forward + backward
        return 1.5 * backward if backward else 3.0 * forward

    @property
    def first(self) -> bool:
        return self.stage.index == 0

    def accumulate(self, batch: Mapping[str, torch.Tensor]) -> tuple[int, float]:
        raise TypeError("a stage's gradients come from backward requests, not from batches")

    def load_state_blob(self, blob: bytes) -> int:
        """:meth:`LocalTrainer.load_state_blob`, refusing another stage's state (two middle stages of the
        same size have the same parameter names and shapes).

        Raises:
            StateError: not a state of this stage (or as the base class).
        """
        _, metadata = decode_state(blob)
        if metadata.get("stage") != self._stage_tag():
            raise StateError(f"a state of stage {metadata.get('stage')!r}, not {self._stage_tag()}")
        return super().load_state_blob(blob)

    def _hand_out_counts(self) -> tuple[int, float | None, float]:
        samples, loss, seconds = super()._hand_out_counts()
        return samples, (loss if self.last else None), seconds  # only the last stage sees the loss

    def _metadata(self) -> dict[str, str]:
        return {**super()._metadata(), "stage": self._stage_tag()}

    def _stage_tag(self) -> str:
        return stage_tag(self.stage.index, self.stage.count)

    def forward(self, hidden: torch.Tensor | None, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The stage's output for the next stage (not the last stage's loss: see the module docstring)."""
        if self.last:
            raise StageInputError("the last stage runs forward only as part of a backward request")
        with self._lock, torch.no_grad():
            started = time.perf_counter()
            self.stage.train()
            out = self._run(hidden, batch)
            if not bool(torch.isfinite(out).all()):
                raise StageInputError(f"stage {self.stage.index}'s output is not finite")
            self.forward_seconds = _ema(self.forward_seconds, (time.perf_counter() - started) / len(out))
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
            if loss is not None:
                self._loss_sum += loss * samples
            seconds = time.perf_counter() - started
            self._compute_seconds += seconds
            self.backward_seconds = _ema(self.backward_seconds, seconds / samples)
            grad_in = None if leaf is None else grads[-1]
            return (None if grad_in is None else grad_in.detach().float().cpu()), loss

    def _run(self, hidden: torch.Tensor | None, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if hidden is not None and not bool(torch.isfinite(hidden).all()):
            raise StageInputError("the stage's input holds non-finite values")
        fields = {name: batch[name].to(self.device) for name in self.stage.needs if name in batch}
        try:
            out: torch.Tensor = self.stage(hidden, fields)
        except _RUN_FAILURES as exc:
            raise StageInputError(f"stage {self.stage.index} cannot run on this input: {exc}") from exc
        return out


def _ema(average: float, value: float) -> float:
    return value if average == 0.0 else 0.9 * average + 0.1 * value
