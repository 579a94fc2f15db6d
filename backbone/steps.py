"""The backbone records the global steps it saw the collaboration take in the ledger (time, loss,
samples, peers).

Every ``period`` seconds it reads the peers' progress records and summarizes them as a newcomer would
(:func:`shared.progress.summarize`, not anchored: absurd or unsupported claims are ignored). While the
collaboration is at step ``s`` it remembers the largest sample count and number of peers seen there and
the samples-weighted loss they report (the loss of the batch that takes ``s`` to ``s + 1``). When the
collaboration's step moves past ``s``, step ``s + 1`` is recorded with those numbers, if the tracker saw
anyone working toward it (samples or peers at ``s``) -- except its samples: the members of the round
that took it publish its exact global batch with their progress, and the value most users claim is
recorded (:func:`shared.progress.claimed_batch`); the largest estimate seen at ``s`` only when nobody
claims one or the view moved more than one step (the claims then are a later step's: a lone volunteer
taking several steps per period gets estimates for the steps it is seen at; the estimate extrapolates
records read while the peers computed: a lone volunteer whose every
step held exactly the target was recorded at 15 % to 377 % of it).

**Only steps really taken.** Steps jumped over (the backbone was down, or several steps passed within
one period) get *no* row here: the tracker did not see them, and a placeholder row would make a claimed
step look taken (version 2 wrote 351 such rows in one soak). The ledger records such a step when a
report brings a receipt of it signed by a peer of another user than its sender, for a step at or below
the highest step the tracker recorded (``source = 'receipts'``; see
:meth:`backbone.ledger.LedgerStore.assess_and_record`): two users averaged for it, and the collaboration
went past it. ``record_step`` keeps the first record of a step (a receipt-evidenced row takes the
tracker's numbers when it comes), so several backbones on one database agree.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import trio

from protocols.training import Progress, TrainingSpec
from shared.node import Node
from shared.progress import claimed_batch, summarize
from shared.progress_records import read_progress_with_users
from shared.tolerated import Tolerated

from .api import DB_WRITE
from .ledger import LedgerStore

__all__ = ["StepTracker", "record_steps_forever"]

logger = logging.getLogger(__name__)


@dataclass
class StepTracker:
    """Pure bookkeeping of the module docstring: feed views, get the steps to record."""

    step: int | None = None
    samples: float = 0.0
    peers: int = 0
    loss: float | None = None

    def observe(
        self, step: int, samples: float, peers: int, loss: float | None, batch: int | None = None
    ) -> list[tuple[int, float | None, int, int]]:
        """Returns ``(global_step, loss, samples, peers)`` of the step seen taken since the last view
        (at most one: the one the tracker saw worked toward; steps jumped over are not its to record).
        ``batch`` is the global batch the peers at ``step`` claim for it
        (:func:`shared.progress.claimed_batch`): the samples recorded when it is the step finished, the
        largest estimate seen while it was worked toward otherwise."""
        finished: list[tuple[int, float | None, int, int]] = []
        if self.step is not None and step > self.step and (self.samples > 0 or self.peers > 0):
            exact = batch if batch is not None and step == self.step + 1 else None
            finished.append(
                (self.step + 1, self.loss, round(self.samples) if exact is None else exact, self.peers)
            )
        if self.step is None or step != self.step:
            self.step, self.samples, self.peers, self.loss = step, 0.0, 0, None
        self.samples = max(self.samples, samples)
        self.peers = max(self.peers, peers)
        if loss is not None:
            self.loss = loss
        return finished


async def record_steps_forever(
    node: Node,
    store: LedgerStore,
    spec: TrainingSpec,
    period: float = 1.0,
    tolerated: Tolerated | None = None,
) -> None:
    """Feed the tracker every ``period`` seconds; a failed read is counted in ``tolerated`` (the
    backbone's status shows it) and retried at the next period."""
    tracker = StepTracker()
    tolerated = tolerated if tolerated is not None else Tolerated(logger)
    nobody = Progress(step=0, samples=0, samples_per_second=0.0, time=time.time())
    while True:
        with tolerated.around("steps.read"):
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
                batch = claimed_batch(records, view.step, spec.target_batch, users)
                observed = tracker.observe(view.step, view.samples, peers, view.loss, batch)
                for step, loss, samples, count in observed:
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
