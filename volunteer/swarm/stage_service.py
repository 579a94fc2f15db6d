"""A volunteer serving one pipeline stage: the stage server and the stage's collaboration, wired together
(issue 17 item 2: "when its stage's swarm reaches the target batch, averages with the other servers of
that stage (the existing averaging, LP roles included) and steps").

**Each stage is a data-parallel collaboration of its own.** :func:`serve_stage` runs, on one node:

* a :class:`~.stage_trainer.StageTrainer` (the batch mode's trainer for one stage),
* a :class:`~volunteer.collab.optimizer.CollaborativeOptimizer` over it, under the stage's keys
  (:func:`protocols.swarm.stage_training_keys`): progress records, the target batch, matchmaking and the
  LP's roles, failed rounds retried with no sample lost, state announcements and downloads, the lone-step
  evidence -- all the batch mode's, among the servers of this stage only;
* the :class:`~.server.StageServer` answering trainers, whose counted backwards are the collaboration's
  accumulated samples;
* :func:`~.server.announce_forever` (the stage record trainers route by);
* :func:`step_forever`, the stage's loop: download the stage's state when behind, average and step when
  the stage's servers together counted the target batch, otherwise wait for trainers. It ends at the
  run's step limit, or when the server is closed to hand the stage over (:func:`~.member.hand_over`):
  the collaboration then only publishes our progress and serves our state, and takes no step and loads
  nobody's state. A server at the
  stage's step is a member of its rounds from the start, whether or not trainers sent it a backward yet
  (a member with no samples receives the average and steps with the others; stochastic wiring may well
  send one server of a stage every forward and the other every backward).

**What a server accepts** (``accepting``): no backward is counted while the stage's state is being
downloaded (the load would drop it) or once our share of the step is done (the batch mode's budget: the
step's batch is the target batch, not more); such backwards are answered ``busy`` and go to another
server of the stage or wait. Forwards are always served. Backwards that arrive while the stage averages
count toward the next step (the trainer keeps what accumulates during a round), up to the target batch:
unbounded, a round of a few seconds under a fast swarm of trainers gathered many target batches, and a
progress record claiming more than ``MAX_SAMPLES_FACTOR`` target batches is not plausible to the stage's
other servers (:func:`shared.progress.plausible`), which then believed themselves alone.

**Credit** (:mod:`backbone.ledger.accounting`, "Swarm runs"). The stage's aggregators sign each
member's receipt with the stage's index (``PartReceipt.stage``), and each member keeps the receipts of
its parts in ``receipts`` (the session's reporter's book), keyed by ``(stage, step)``; the session claims
the samples each stage step accumulated here (stage-samples) in its contribution reports. The backbone
records each stage's steps, so those receipts count. The stage's pull records are not reported (the
accounting docstring).

**Discards** (accounting, "Swarm runs", *discards*). The stage's collaboration decides which of our stage
steps a stage state it loads replaced, by the batch mode's rules (:mod:`volunteer.collab.sync`): a fork's
steps (only our side of a partition took them: we re-sync to the survivor's state), and, for a server
whose earlier process served this stage (``previous_life``: the highest step of the stage the report
journal holds, :meth:`volunteer.reporting.Reporter.stage_last_step`), the steps above the first state of
the stage it loads (the stage lost them, e.g. with its last server's death; stage steps are journaled
without fingerprints, so a stage that lost them and took as many steps again while we were gone is not
noticed, as for a data-parallel journal of an older version). It calls ``on_discard(first, last)`` at a
load that replaced some, and the session reports them as this stage's
(:meth:`volunteer.reporting.Reporter.discard_stage`). A server that is merely behind, or moves to another
stage and downloads its state, discards nothing: its steps are the stage's history, or another stage's.

**Rates.** Samples reach a server at the trainers' pace, not at a rate of the server's own: a server
publishes no samples-per-second (``counted(..., seconds=None)``), so the stage's estimate of its batch is
the counted samples, never an extrapolation. The stage steps once its servers' records show the target
(each server publishes soon after counting).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from protocols.swarm import stage_training_keys
from protocols.training import TrainingSpec
from shared.errors import StateUnavailable
from shared.node import Node

from ..collab.optimizer import CollabConfig, CollaborativeOptimizer, StepRecord
from ..collab.phase import Phase
from ..collab.torch_thread import run_torch
from ..receipts import ReceiptBook
from ..tasks.base import Task
from .server import StageServer, StageServerConfig, announce_forever
from .stage_trainer import StageTrainer

__all__ = ["StageService", "serve_stage", "step_forever"]

logger = logging.getLogger(__name__)


@dataclass
class StageService:
    """What :func:`serve_stage` runs, for the panel and tests to look at."""

    trainer: StageTrainer
    collab: CollaborativeOptimizer
    server: StageServer


def _accepting(collab: CollaborativeOptimizer) -> bool:
    if collab.syncing or collab.behind():
        return False
    if collab.averaging:  # toward the next step, at most its batch (module docstring)
        return collab.trainer.samples < collab.target
    return collab.budget() > 0


async def step_forever(
    collab: CollaborativeOptimizer, poll: float = 0.02, until: Callable[[], bool] = lambda: False
) -> None:
    """The stage's loop (module docstring); returns when the run reached its step limit, or ``until()``."""
    await collab.resume_if_behind()
    while not collab.finished() and not until():
        if collab.averaging:
            await trio.sleep(poll)
        elif collab.behind():
            try:
                await collab.sync_state()
            except StateUnavailable as exc:
                collab.stats.waiting = f"waiting for the stage's state to download: {exc}"
                logger.warning("%s", exc)
                await trio.sleep(2.0)
        elif collab.peer.phase is Phase.FRESH:
            collab.counted(0, None, None)  # at the stage's step: a member, with or without samples
        elif collab.ready():
            await collab.average_and_step()
        else:
            await trio.sleep(poll)


async def serve_stage(
    node: Node,
    task: Task,
    spec: TrainingSpec,
    run_id: str,
    index: int,
    stages: int,
    *,
    data_dir: Path | None = None,
    backbones: Sequence[str] = (),
    collab_config: CollabConfig | None = None,
    server_config: StageServerConfig | None = None,
    device: str = "cpu",
    on_step: Callable[[StepRecord], None] | None = None,
    receipts: ReceiptBook | None = None,
    on_discard: Callable[[int, int], None] | None = None,
    previous_life: int | None = None,
    task_status: trio.TaskStatus[StageService] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve stage ``index`` of ``stages`` on ``node`` until cancelled or the run's step limit (module
    docstring); ``task_status.started`` gets the :class:`StageService`. ``on_step`` is called after each
    step the stage takes here (the collaboration's :class:`~volunteer.collab.optimizer.StepRecord`).
    ``receipts``: where the stage's rounds leave the receipts signed for our parts (module docstring,
    "Credit"). ``on_discard``: called with ``(first, last)`` when a stage state we load replaced steps of
    ours; ``previous_life``: the highest step of this stage our data dir took part in before (module
    docstring, "Discards").

    Raises:
        ConfigError: the task cannot be split so.
    """
    trainer = await run_torch(StageTrainer, task, spec, run_id, index, stages, device)
    if data_dir is not None:  # what a collaboration keeps on disk (its high-water mark) is per stage
        data_dir = data_dir / "swarm" / f"stage-{index}"
        data_dir.mkdir(parents=True, exist_ok=True)
    collab = CollaborativeOptimizer(
        node,
        trainer,
        spec,
        data_dir=data_dir,
        config=collab_config or CollabConfig(),
        backbones=backbones,
        keys=stage_training_keys(index),
        on_step=on_step,
        receipts=receipts,
        stage=index,
        on_discard=on_discard,
        previous_life=previous_life,
    )

    def counted(samples: int, loss: float | None) -> None:
        collab.counted(samples, loss, None)
        collab.publish_soon()

    server = StageServer(
        node, trainer, server_config, accepting=lambda: _accepting(collab), on_counted=counted
    )
    service = StageService(trainer, collab, server)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(collab.run)
            nursery.start_soon(announce_forever, node, server)
            task_status.started(service)
            await step_forever(collab, until=lambda: server.closed)
            if not collab.finished():  # handing the stage over (member.hand_over): its state stays served
                await trio.sleep_forever()
            nursery.cancel_scope.cancel()
    finally:
        server.close()
