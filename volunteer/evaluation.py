"""Held-out evaluation during a run: ``volunteer join --evaluate`` (issue 12 item 7; the rules, the
held-out set and the record are :mod:`protocols.evaluation`'s).

**When.** The session calls :meth:`Evaluator.step_done` after each step this peer takes; a step that is a
multiple of ``every`` (``--evaluate-every N``, default the manifest's ``dataset.eval_every``) is *due*.
One evaluation runs at a time: a step that falls due while one is running is skipped (the next due step
comes), so evaluating never queues up behind a fast run.

**Which parameters.** The evaluation is of the parameters at the due step *exactly*, named by that step
and the fingerprint the trainer recorded for it (the ``params`` of the ``step N done`` log line): they are
copied into a second model of the task under the trainer's lock (one memory copy of the parameters, the
only moment training waits for evaluation) by :meth:`LocalTrainer.copy_state_into`. If the trainer has
already moved past the due step when the copy runs, that step is skipped: two evaluators must evaluate the
same parameters for the backbone to cross-check them.

**How.** The held-out samples are loaded once (fetched, checked against the listing's SHA-256, cached in
the data dir), preprocessed and collated into micro-batches of the run's ``local_batch``. The loss is the
task's own :meth:`~volunteer.tasks.base.Task.loss` with the copy in evaluation mode under
``torch.no_grad()``, weighted by each micro-batch's sample count: the mean over the held-out samples. Each
micro-batch is a separate call on the torch thread (:mod:`volunteer.collab.torch_thread`), so training
micro-batches interleave with evaluation ones and a training step waits at most one evaluation micro-batch.

The cost: memory for a second copy of the parameters (no optimizer state, no gradients), and one forward
pass over ``eval_examples`` samples every ``every`` steps (with the defaults, 256 samples per 50 steps).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
import trio

from protocols.api import ShardInfo
from protocols.evaluation import Evaluation, EvaluationReceipt, SignedEvaluation, evaluation_payload
from protocols.training import DatasetSpec, TrainingSpec
from shared.auth.keys import Identity
from shared.data.heldout import heldout_digest, read_heldout
from shared.errors import ConfigError, ProjectError
from shared.tolerated import Tolerated

from .api_client import ApiClient
from .collab.torch_thread import run_torch
from .collab.trainer import LocalTrainer
from .tasks import Task

__all__ = ["Evaluator", "HeldoutSet", "heldout_files", "load_heldout"]

logger = logging.getLogger(__name__)
#: what one evaluation may fail with without ending the volunteer: the backbone's refusal or absence, and
#: torch's errors (out of memory on the device, a held-out batch the model rejects); counted and logged
EVALUATION_FAILURES = (ProjectError, RuntimeError, ValueError, IndexError, KeyError, OSError)
Publish = Callable[[SignedEvaluation], Awaitable[EvaluationReceipt]]


@dataclass(frozen=True)
class HeldoutSet:
    """The run's held-out samples as collated micro-batches, how many examples they came from, and the
    examples' digest (``protocols.evaluation``'s ``eval_set``)."""

    batches: list[dict[str, torch.Tensor]]
    examples: int
    digest: str


async def heldout_files(spec: DatasetSpec, client: ApiClient | None, cache_dir: Path) -> list[Path]:
    """The held-out files in their fixed order: fetched from a backbone (``backbone`` source) into
    ``cache_dir``, or the local ``eval_files``.

    Raises:
        ConfigError: there are none, or the ``backbone`` source has no API to fetch them from.
        PeerUnavailable, ProtocolError: (``backbone``) no backbone served them, or they do not match.
    """
    if spec.source != "backbone":
        files = await trio.to_thread.run_sync(_local_files, spec.eval_files)
        if not files:
            raise ConfigError("the run names no held-out files (dataset.eval_files) on this machine")
        return files
    if client is None:
        raise ConfigError("the run's held-out shards are served by its backbones: join with an invite")
    listed = sorted((await client.list_heldout()).shards, key=lambda info: info.name)
    if not listed:
        raise ConfigError("the run's backbones serve no held-out shards (their shards/heldout/ is empty)")
    await trio.to_thread.run_sync(lambda: cache_dir.mkdir(parents=True, exist_ok=True))
    return [await _cached(client, info, cache_dir) for info in listed]


async def _cached(client: ApiClient, info: ShardInfo, cache_dir: Path) -> Path:
    path = cache_dir / f"{info.sha256[:16]}-{info.name}"

    def valid() -> bool:
        if not path.is_file() or path.stat().st_size != info.nbytes:
            return False
        return hashlib.sha256(path.read_bytes()).hexdigest() == info.sha256

    if not await trio.to_thread.run_sync(valid):
        data = await client.fetch_heldout(info)

        def write() -> None:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)

        await trio.to_thread.run_sync(write)
    return path


def _local_files(patterns: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        if glob.has_magic(pattern):
            files += sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        elif path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".txt"))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"held-out file {pattern!r} matches no file")
    return files


async def load_heldout(task: Task, spec: TrainingSpec, files: Sequence[Path]) -> HeldoutSet:
    """Read the first ``dataset.eval_examples`` examples of ``files``, preprocess and collate them.

    Raises:
        ConfigError: the files hold fewer examples than the run evaluates, or yield no sample.
    """
    dataset = spec.dataset

    def prepare() -> tuple[list[Mapping[str, Any]], str]:
        examples = read_heldout(files, dataset.eval_examples, dataset.text_field)
        if len(examples) < dataset.eval_examples:
            raise ConfigError(
                f"the held-out files hold {len(examples)} examples; the run evaluates {dataset.eval_examples}"
            )
        return list(task.preprocess(iter(examples))), heldout_digest(examples)

    samples, digest = await trio.to_thread.run_sync(prepare)
    if not samples:
        raise ConfigError("the held-out examples yield no sample for the run's task")
    size = spec.local_batch

    def collate() -> list[dict[str, torch.Tensor]]:
        return [dict(task.collate(samples[i : i + size])) for i in range(0, len(samples), size)]

    return HeldoutSet(await run_torch(collate), dataset.eval_examples, digest)


@dataclass
class Evaluator:
    """Evaluates the parameters of every ``every``-th step on the held-out set (module docstring)."""

    task: Task
    trainer: LocalTrainer
    run_id: str
    identity: Identity
    every: int
    #: sends a signed evaluation to the run's backbones (None: evaluate and log only)
    publish: Publish | None = None
    evaluated: list[Evaluation] = field(default_factory=list)
    skipped: int = 0
    failures: Tolerated = field(default_factory=lambda: Tolerated(logger))
    _model: torch.nn.Module | None = None
    _due: tuple[trio.MemorySendChannel[int], trio.MemoryReceiveChannel[int]] = field(
        default_factory=lambda: trio.open_memory_channel[int](1)
    )

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError(f"--evaluate-every must be at least 1, got {self.every}")

    def step_done(self, step: int) -> None:
        """The trainer has reached ``step`` (called on the trio thread after each step)."""
        if step % self.every:
            return
        try:
            self._due[0].send_nowait(step)
        except trio.WouldBlock:
            self.skipped += 1
            logger.info("not evaluating step %d: the evaluation of an earlier step is still running", step)

    async def run(self, load: Callable[[], Awaitable[HeldoutSet]]) -> None:
        """Load the held-out set, then evaluate each due step until cancelled. A held-out set that
        cannot be had ends evaluation (one log line), never training; an evaluation that fails is counted
        in :attr:`failures` (and logged), and the next due step is evaluated."""
        try:
            heldout = await load()
        except ProjectError as exc:
            logger.warning("held-out evaluation is off: %s", exc)
            return
        logger.info(
            "held-out evaluation: %d examples (%d micro-batches, set %s) every %d steps",
            heldout.examples,
            len(heldout.batches),
            heldout.digest[:16],
            self.every,
        )
        async for step in self._due[1]:
            with self.failures.around("held-out evaluation", *EVALUATION_FAILURES):
                await self.evaluate(step, heldout)

    async def evaluate(self, step: int, heldout: HeldoutSet) -> Evaluation | None:
        """Evaluate the parameters of ``step`` and publish the result; None if the trainer is past it."""
        if self._model is None:
            self._model = await run_torch(self._build_model)
        model = self._model
        at, params = await run_torch(self.trainer.copy_state_into, model)
        if at != step:
            self.skipped += 1
            logger.info("not evaluating step %d: the parameters moved on to step %d first", step, at)
            return None
        total = count = 0.0
        for batch in heldout.batches:
            loss_sum, samples = await run_torch(self._batch_loss, model, batch)
            total, count = total + loss_sum, count + samples
        loss = total / count
        if not math.isfinite(loss):
            logger.warning("the held-out loss of step %d is not finite (%r): not published", step, loss)
            return None
        evaluation = Evaluation(
            run_id=self.run_id,
            peer_id=self.identity.peer_id,
            step=step,
            params=params,
            loss=loss,
            examples=heldout.examples,
            eval_set=heldout.digest,
            timestamp=time.time(),
        )
        self.evaluated.append(evaluation)
        line = (
            f"evaluated step {step}: held-out loss {loss:.4f} over {heldout.examples} examples "
            f"(params {params.hex()})"
        )
        if self.publish is None:
            logger.info("%s", line)
            return evaluation
        data = msgspec.msgpack.encode(evaluation)
        signed = SignedEvaluation(evaluation=data, signature=self.identity.sign(evaluation_payload(data)))
        try:
            receipt = await self.publish(signed)
        except ProjectError as exc:
            logger.warning("%s; not published: %s", line, exc)
            return evaluation
        agree = "" if receipt.agrees else " (ours disagrees with the others')"
        logger.info("%s; the run's: %.4f from %d users%s", line, receipt.loss, receipt.users, agree)
        return evaluation

    def _build_model(self) -> torch.nn.Module:
        model = self.task.build_model().to(self.trainer.device)
        model.eval()
        model.requires_grad_(False)
        return model

    def _batch_loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[float, int]:
        with torch.no_grad():
            moved = {k: v.to(self.trainer.device) for k, v in batch.items()}
            samples = self.task.batch_size(moved)
            return float(self.task.loss(model, moved)) * samples, samples
