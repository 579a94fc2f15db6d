"""The volunteer's training loop and its contribution reports.

:func:`train_until_stopped` alternates, forever or until the run's step limit or a stop request:

* behind or diverged → download the collaboration's state (:meth:`CollaborativeOptimizer.sync_state`);
* the collaboration reached the target batch → average and step (in the background with delayed
  parameter updates, so the next micro-batches overlap the averaging);
* our share of the step is done (:meth:`CollaborativeOptimizer.budget` is 0) → wait for the round, adding
  nothing (shared.progress, "Batch accounting");
* otherwise → one micro-batch from the prefetcher (the data pipeline runs in its own thread; the trio
  loop never waits on it except through a worker thread), cut to the budget: the examples cut off open
  the next micro-batch.

**One hop per micro-batch.** A batch the prefetcher has ready (``ready_batch``, which never blocks) is
taken, cut and computed in one call on the torch thread (:meth:`CollaborativeOptimizer.accumulate_from`),
as a plain loop takes it right before its forward pass; only when none is ready does the loop wait for one
(``next_batch``) in a worker thread. Why: taking a batch wakes the prefetch thread, which then holds the
GIL for the Python part of producing the next one (reading examples, collating: about 1 ms for tiny-mlm).
Taken in a worker thread, every hand-over after it (worker → trio loop → torch thread) waited for that,
on the critical path: 14 to 19 ms per step of 16 micro-batches (``scripts/bench_overhead.py``). Taken on the
torch thread, the producer's work overlaps the forward and backward passes, which release the GIL.

A stop request (Ctrl+C / SIGTERM) lets whatever is in flight (a round, a download, a matchmaking wait)
go on for at most :data:`STOP_GRACE` seconds, then cancels it; the loop returns and the daemon reports and
leaves, so a stop takes a few seconds whatever the volunteer was waiting for (issue 14: a peer waiting
for a round that could not form took 22 s). A round cut short fails for its group as any departure does.

:class:`Reporter` (:mod:`volunteer.reporting`, re-exported here) reports what the loop contributed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import trio

from shared.errors import StateUnavailable

from .collab.optimizer import CollaborativeOptimizer
from .reporting import Reporter as Reporter

__all__ = ["Reporter", "split_batch", "train_until_stopped"]

logger = logging.getLogger(__name__)

#: Seconds a stop request leaves the work in flight before cancelling it.
STOP_GRACE = 1.0


async def train_until_stopped(
    collab: CollaborativeOptimizer,
    next_batch: Callable[[], dict[str, Any] | None],
    stop: trio.Event,
    ready_batch: Callable[[], dict[str, Any] | None] | None = None,
) -> str:
    """Run the loop of the module docstring; returns why it stopped. ``next_batch`` waits (a bounded
    time) for the next micro-batch, None if none came; ``ready_batch`` returns one without waiting, None
    if none is ready (``Prefetcher.get(timeout=0)``; without it every batch comes from ``next_batch``)."""
    async with trio.open_nursery() as watch:
        with trio.CancelScope() as work:

            async def stop_soon() -> None:
                await stop.wait()
                await trio.sleep(STOP_GRACE)
                work.cancel()

            watch.start_soon(stop_soon)
            reason = await _train(collab, next_batch, stop, ready_batch)
        watch.cancel_scope.cancel()
    if work.cancelled_caught:
        logger.info("stopped: cancelled what was still in flight after %.1f s", STOP_GRACE)
        return "stopped"
    return reason


async def _train(
    collab: CollaborativeOptimizer,
    next_batch: Callable[[], dict[str, Any] | None],
    stop: trio.Event,
    ready_batch: Callable[[], dict[str, Any] | None] | None,
) -> str:
    await collab.resume_if_behind()
    held_over: dict[str, Any] | None = None  # the examples a cut micro-batch left for the next one
    async with trio.open_nursery() as background:
        while not stop.is_set():
            if collab.finished():
                collab.stats.waiting = "the run is finished: handing the final state to a backbone"
                await collab.hand_over_final_state(stop)
                return f"run finished: the run reached its step limit ({collab.spec.max_steps})"
            if collab.averaging:
                if not collab.overlaps:
                    await trio.sleep(0.01)
                    continue
            elif collab.behind():
                try:
                    await collab.sync_state()
                except StateUnavailable as exc:
                    collab.stats.waiting = f"waiting for a state to download: {exc}"
                    logger.warning("%s", exc)
                    await trio.sleep(2.0)
                continue
            elif collab.ready():
                if collab.overlaps:
                    await collab.start_step(background)
                else:
                    await collab.average_and_step()
                continue
            elif collab.trainer.samples >= collab.target and collab.holding():
                await trio.sleep(0.05)  # our share is done; more would exceed what peers find plausible
                continue
            budget = collab.budget()
            if budget <= 0:
                await trio.sleep(0.02)  # our share is done: the next samples would only overshoot the batch
                continue
            if held_over is not None or ready_batch is not None:

                def take(budget: int = budget) -> dict[str, Any] | None:  # on the torch thread
                    nonlocal held_over  # the trio task awaits this call: one thread at a time
                    batch, held_over = held_over, None
                    if batch is None and ready_batch is not None:
                        batch = ready_batch()
                    if batch is None:
                        return None
                    batch, held_over = split_batch(batch, budget)
                    return batch

                if await collab.accumulate_from(take) is not None:
                    collab.stats.waiting = None
                    continue
            # nothing ready: wait in a worker thread, never the torch thread (a step in flight needs it)
            held_over = await trio.to_thread.run_sync(next_batch, abandon_on_cancel=True)
            if held_over is None:
                collab.stats.waiting = "waiting for the first examples"
                await trio.sleep(0.05)
    return "stopped"


def split_batch(batch: dict[str, Any], size: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The first ``size`` samples of a collated micro-batch and the rest (None if nothing is left).
    Tensors are batch-first; a value that is not (a scalar, a tensor of another length) goes to both."""
    lengths = {len(v) for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(lengths) != 1 or size >= (n := lengths.pop()):
        return batch, None

    def part(value: Any, piece: slice) -> Any:
        sliced = isinstance(value, torch.Tensor) and value.dim() > 0 and len(value) == n
        return value[piece] if sliced else value

    return {k: part(v, slice(0, size)) for k, v in batch.items()}, {
        k: part(v, slice(size, None)) for k, v in batch.items()
    }


def batches(
    task_collate: Callable[[list[Any]], dict[str, Any]], examples: Iterator[Any], size: int
) -> Iterator[dict[str, Any]]:
    """Group a stream of examples into collated micro-batches of ``size``."""
    while True:
        chunk = [example for _, example in zip(range(size), examples, strict=False)]
        if len(chunk) < size:
            return
        yield task_collate(chunk)
