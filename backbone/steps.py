"""The backbone records every global step of the run in the ledger (time, loss, samples, peers).

Every ``period`` seconds it reads the peers' progress records and summarizes them as a newcomer would
(:func:`shared.progress.summarize`, not anchored: absurd or unsupported claims are ignored). While the
collaboration is at step ``s`` it remembers the largest sample count and number of peers seen there and
the samples-weighted loss they report (the loss of the batch that takes ``s`` to ``s + 1``). When the
collaboration's step moves past ``s``, step ``s + 1`` is recorded with those numbers; steps jumped over
(the backbone was down, or a step took less than a period) are recorded without loss or samples.
``record_step`` keeps the first record of a step, so several backbones on one database agree.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass

import trio

from protocols.training import Progress, TrainingSpec
from shared.net.host import CALL_FAILURES
from shared.node import Node
from shared.progress import summarize
from shared.progress_records import read_progress_with_users

from .api import DB_WRITE
from .ledger import LedgerStore

__all__ = ["StepTracker", "record_steps_forever"]

logger = logging.getLogger(__name__)
#: Rows recorded for steps the backbone jumped over in one view (0 samples, 0 peers: it did not see them).
#: A claim of step 2**40 must not become 2**40 rows: only the last ones are kept.
MAX_SKIPPED_ROWS = 64


@dataclass
class StepTracker:
    """Pure bookkeeping of the module docstring: feed views, get the steps to record."""

    step: int | None = None
    samples: float = 0.0
    peers: int = 0
    loss: float | None = None

    def observe(
        self, step: int, samples: float, peers: int, loss: float | None
    ) -> list[tuple[int, float | None, int, int]]:
        """Returns ``(global_step, loss, samples, peers)`` for each step finished since the last view."""
        finished: list[tuple[int, float | None, int, int]] = []
        if self.step is not None and step > self.step:
            finished.append((self.step + 1, self.loss, round(self.samples), self.peers))
            first = max(self.step + 2, step + 1 - MAX_SKIPPED_ROWS)
            finished.extend((s, None, 0, 0) for s in range(first, step + 1))
        if self.step is None or step != self.step:
            self.step, self.samples, self.peers, self.loss = step, 0.0, 0, None
        self.samples = max(self.samples, samples)
        self.peers = max(self.peers, peers)
        if loss is not None:
            self.loss = loss
        return finished


async def record_steps_forever(
    node: Node, store: LedgerStore, spec: TrainingSpec, period: float = 1.0
) -> None:
    tracker = StepTracker()
    nobody = Progress(step=0, samples=0, samples_per_second=0.0, time=time.time())
    while True:
        with contextlib.suppress(*CALL_FAILURES):
            records, users = await read_progress_with_users(node.dht)
            if records:
                view = summarize(
                    records,
                    node.peer_id,
                    nobody,
                    now=time.time(),
                    target_batch=spec.target_batch,
                    anchored=False,
                    users=users,
                )
                peers = view.peers_at_step - (view.step == 0)  # not ourselves (a "peer" at step 0)
                for step, loss, samples, count in tracker.observe(view.step, view.samples, peers, view.loss):
                    record = functools.partial(
                        store.record_step,
                        step,
                        finished_at=time.time(),
                        loss=loss,
                        samples=samples,
                        peers=count,
                    )
                    recorded = await trio.to_thread.run_sync(record, limiter=DB_WRITE)
                    if recorded:
                        logger.info(
                            "global step %d: loss %s, %d samples, %d peers",
                            step,
                            "—" if loss is None else f"{loss:.4f}",
                            samples,
                            count,
                        )
        await trio.sleep(period)
