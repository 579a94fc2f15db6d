"""The collaborative optimizer: one volunteer's part in the run, made of three parts with narrow seams.

* :mod:`.progress_board` publishes our progress and reads everyone's into a view of the collaboration;
* :mod:`.step` takes steps -- :class:`~.step.BatchStep`, the fixed-global-batch mode of DeDLOC, behind the
  :class:`~.step.StepMode` protocol so other synchronization modes can plug in beside it;
* :mod:`.sync` serves our state, downloads the collaboration's when we are behind, hands the final state
  over and resumes a run from a checkpoint.

They share one :class:`~.phase.PeerState` (an explicit phase -- fresh, training, averaging, syncing, left --
plus whether our state is the run's, its fingerprint and our recent loss). This class wires them
together and is what the training loop (:func:`volunteer.training.train_until_stopped`), the session and
the panel use. Failures its background tasks survive are counted in :attr:`CollaborativeOptimizer.tolerated`.

With **delayed parameter updates** (``spec.dpu``), the step runs in the background while the next
micro-batches are computed on the current parameters; the update lands between two micro-batches (one
step of staleness, seed 000 §3.1).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
import trio

from protocols.training import TRAINING_KEYS, Progress, TrainingKeys, TrainingSpec
from shared import faults
from shared.alone import JOINING_GRACE
from shared.averaging.matchmaking import Matchmaker
from shared.node import Node
from shared.progress import CollabView
from shared.state.limits import SourceBook
from shared.tolerated import Tolerated

from ..receipts import ReceiptBook
from .evidence import Evidence
from .phase import PeerState, Phase
from .progress_board import ProgressBoard
from .progress_board import periods as board_periods
from .step import BatchStep, StepMode, StepRecord
from .sync import StateSync
from .torch_thread import run_torch
from .trainer import Accumulated, LocalTrainer

__all__ = ["CollabConfig", "CollaborativeOptimizer", "StepRecord"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CollabConfig:
    poll_period: float = 0.3
    publish_period: float = 1.0
    matchmaking_window: float = 1.0
    max_attempts: int = 3  # averaging attempts of one step before giving the samples back
    sync_patience: float = 15.0  # seconds to wait for a state at the collaboration's step
    sync_grace: float = 10.0  # hold our round at most this long per peer downloading the state ...
    sync_grace_window: float = 60.0  # ... in any window this long (shared.progress.held_for)


@dataclass
class Stats:
    """What the panel shows about us (the step's own numbers are in ``step.stats``)."""

    local_sps: float = 0.0
    waiting: str | None = None  # why we are not training right now
    samples_total: int = 0


@dataclass
class CollaborativeOptimizer:
    node: Node
    trainer: LocalTrainer
    spec: TrainingSpec
    data_dir: Path | None = None
    config: CollabConfig = field(default_factory=CollabConfig)
    on_step: Callable[[StepRecord], None] | None = None
    #: where each finished round's receipts and pull records go, for the contribution reports
    receipts: ReceiptBook | None = None
    #: the backbones we were given (multiaddrs): lone-step evidence reads the records through each
    backbones: Sequence[str] = ()
    #: called with (first, last) when a loaded state replaced steps only we took (for the ledger)
    on_discard: Callable[[int, int], None] | None = None
    #: the highest step this data dir took part in before a restart (the report journal's), if any
    previous_life: int | None = None
    #: the fingerprints of the steps it reported then (the journal's; volunteer.collab.sync)
    previous_lineage: Mapping[int, bytes] = field(default_factory=dict)
    #: the DHT keys of this collaboration (a swarm run's stage: protocols.swarm.stage_training_keys)
    keys: TrainingKeys = TRAINING_KEYS
    #: the swarm run's pipeline stage this collaboration is (None: data-parallel): its receipts say so
    stage: int | None = None
    stats: Stats = field(default_factory=Stats)

    def __post_init__(self) -> None:
        self.peer = PeerState()
        self.tolerated = Tolerated(logger)
        timing = board_periods(self.spec, self.config.poll_period, self.config.publish_period)
        self.board = ProgressBoard(
            self.node,
            self.spec,
            own=self.progress,
            anchored=lambda: self.peer.anchored or self.trainer.step > 0,
            tolerated=self.tolerated,
            poll_period=self.config.poll_period,
            publish_period=timing.publish_period,
            longest_poll=timing.longest_poll,
            shortest_poll=timing.shortest_poll,
            key=self.keys.progress,
        )
        self.evidence = Evidence(
            self.node,
            self.trainer.run_id,
            self.spec.target_batch,
            self.tolerated,
            backbones=self.backbones,
            data_dir=self.data_dir,
            key=self.keys.progress,
        )
        self.sync = StateSync(
            self.node,
            self.trainer,
            self.spec,
            self.board,
            self.peer,
            self.tolerated,
            data_dir=self.data_dir,
            patience=self.config.sync_patience,
            waiting=self._waiting,
            evidence=self.evidence,
            on_discard=self._discard,
            previous_life=self.previous_life,
            previous_lineage=self.previous_lineage,
            key=self.keys.state,
        )
        self.evidence.joining = lambda: self.sync.server.recent_downloader(JOINING_GRACE)
        self.mode: StepMode = self._batch_step()

    def _batch_step(self) -> BatchStep:
        return BatchStep(
            self.node,
            self.trainer,
            self.spec,
            self.board,
            self.peer,
            self.tolerated,
            local_sps=lambda: self.stats.local_sps or self.batch.samples_per_second,
            matchmaking_window=self.config.matchmaking_window,
            max_attempts=self.config.max_attempts,
            poll_period=self.config.poll_period,
            sync_grace=self.config.sync_grace,
            sync_grace_window=self.config.sync_grace_window,
            on_step=self._record_step,
            before_stepping=self.sync.settle_earlier_life,
            after_step=self._after_step,
            receipts=self.receipts,
            stage=self.stage,
            waiting=self._waiting,
            lone=self.evidence.verdict,
            averaging_prefix=self.keys.averaging,
        )

    @property
    def batch(self) -> BatchStep:
        assert isinstance(self.mode, BatchStep)
        return self.mode

    # ------------------------------------------------------------------ what we measured

    @property
    def samples_per_second(self) -> float:
        """Measured on the run's model during the warm-up; fed to the LP."""
        return self.batch.samples_per_second

    @samples_per_second.setter
    def samples_per_second(self, value: float) -> None:
        self.batch.samples_per_second = value

    @property
    def client_mode(self) -> bool:
        return self.batch.client_mode

    @client_mode.setter
    def client_mode(self, value: bool) -> None:
        self.batch.client_mode = value

    def measured_bandwidth(self, upload_bps: float, download_bps: float) -> None:
        """What the capability probe measured; the next rounds' tickets carry it to the LP."""
        self.batch.upload_bps, self.batch.download_bps = upload_bps, download_bps

    @property
    def matchmaker(self) -> Matchmaker:
        return self.batch.matchmaker

    # ------------------------------------------------------------------ the view

    @property
    def view(self) -> CollabView | None:
        return self.board.view

    @property
    def anchored(self) -> bool:
        return self.peer.anchored

    @property
    def averaging(self) -> bool:
        return self.peer.averaging

    @property
    def syncing(self) -> bool:
        return self.peer.syncing

    @property
    def state_sources(self) -> SourceBook:
        return self.sync.sources

    def progress(self) -> Progress:
        # "ready" means: averaging toward step + 1 with these samples; never a round already finished
        peer = self.peer
        in_round = peer.averaging and peer.round_step == self.trainer.step
        # before our first training micro-batch the trainer holds only the warm-up's, which are dropped
        # (volunteer.session, 3): published, they would count toward the others' target batch
        samples = self.trainer.samples if peer.anchored else 0
        return Progress(
            step=self.trainer.step,
            samples=samples + (peer.round_samples if in_round else 0),
            samples_per_second=self.stats.local_sps or self.samples_per_second,
            time=time.time(),
            loss=peer.loss,
            params=peer.fingerprint if peer.anchored else b"",
            ready=in_round,
            syncing=peer.syncing,
            client_mode=self.client_mode,
            left=peer.left,
            batch=peer.batch[1] if peer.batch[0] == self.trainer.step else 0,
            target=self.mode.planned(),
        )

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish our progress, read everyone's, announce our state when asked. Runs until cancelled."""
        self.peer.fingerprint = await run_torch(self.trainer.fingerprint)
        await self.board.try_refresh()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.evidence.refresh_forever, lambda: self.board.view)
            await nursery.start(self.board.run, self._after_read)
            task_status.started()

    async def _after_read(self) -> None:
        view = self.board.view
        if view is None:
            return
        await self.evidence.observe(view)
        peer = self.peer
        if (
            peer.anchored
            and not peer.syncing
            and not view.diverged
            and view.step == self.trainer.step
            and view.shown is not None  # another user stands behind the survivor's state ...
            and view.peers_at_step > 1  # ... at our step, with our fingerprint (not diverged)
        ):
            peer.agreed_step = self.trainer.step
        await self.sync.announce_if_asked()

    async def refresh_view(self) -> CollabView:
        return await self.board.refresh()

    def publish_soon(self) -> None:
        self.board.publish_soon()

    async def leave(self) -> None:
        """Tell the others we left (best effort, bounded): they stop waiting for our samples at once."""
        self.peer.enter(Phase.LEFT)
        await self.board.leave(msgspec.structs.replace(self.progress(), ready=False))

    # ------------------------------------------------------------------ training

    async def accumulate(self, batch: Mapping[str, torch.Tensor]) -> int:
        """One micro-batch on the torch thread; returns the samples it added."""
        samples = await self.accumulate_from(lambda: batch)
        assert samples is not None
        return samples

    async def accumulate_from(self, take: Callable[[], Mapping[str, torch.Tensor] | None]) -> int | None:
        """``take()`` a micro-batch and accumulate it, both in one call on the torch thread; returns the
        samples it added, or None if ``take`` had no batch (nothing was computed). ``take`` must not block:
        the torch thread also serves a step in flight (delayed parameter updates). The training loop hands
        over batches the prefetcher has ready this way (:mod:`volunteer.training`, "One hop")."""
        started = trio.current_time()
        computed = await run_torch(self._take_and_accumulate, take)
        if computed is None:
            return None
        await faults.point("train.after_micro_batch")  # mid-way through a step's (or a round's) compute
        samples, loss = computed
        self.counted(samples, loss, trio.current_time() - started)
        return samples

    def counted(self, samples: int, loss: float | None, seconds: float | None) -> None:
        """``samples`` were accumulated into the trainer (by :meth:`accumulate_from`, or by a swarm stage's
        backward requests) in ``seconds`` (None: not a measure of our rate, e.g. samples that arrive from
        trainers at their pace, so the collaboration's estimate does not extrapolate them): we are
        training, anchored in the run, with this loss."""
        if seconds is not None and seconds > 0:
            rate = samples / seconds
            self.stats.local_sps = (
                rate if not self.stats.local_sps else 0.9 * self.stats.local_sps + 0.1 * rate
            )
        peer = self.peer
        if loss is not None:
            peer.loss = loss if peer.loss is None else 0.8 * peer.loss + 0.2 * loss
        self.stats.samples_total += samples
        peer.anchored = True
        if peer.phase is Phase.FRESH:
            peer.enter(Phase.TRAINING)

    def _take_and_accumulate(
        self, take: Callable[[], Mapping[str, torch.Tensor] | None]
    ) -> tuple[int, float] | None:
        batch = take()
        return None if batch is None else self.trainer.accumulate(batch)

    def holding(self) -> bool:
        return self.mode.holding()

    def ready(self) -> bool:
        return self.mode.ready()

    def budget(self) -> int:
        """Samples our next micro-batch may hold; 0: our share of the step is done (the step mode's rule)."""
        return self.mode.budget()

    @property
    def overlaps(self) -> bool:
        """The step runs in the background while we compute on (``dpu``, or diloco's ``overlap``)."""
        return self.spec.dpu or (self.spec.sync.mode == "diloco" and self.spec.sync.overlap is not False)

    @property
    def target(self) -> int:
        """The samples the next step aims at: the target batch, or the planned round (diloco)."""
        return self.mode.target()

    def behind(self) -> bool:
        """Our state is not the collaboration's: a credible peer is ahead, we diverged or are outside
        the surviving collaboration, we see nobody and our state is older than the collaboration last
        showed us (the high-water mark binds), or we are fresh and know the run got further than our step."""
        view = self.view
        if view is None:
            return False
        step = self.trainer.step
        return (
            view.step > step
            or view.diverged
            or view.minority
            or (self.evidence.holds_back(step) and view.peers <= 1)
            or (self.peer.phase is Phase.FRESH and self.evidence.above(step) is not None)
        )

    def finished(self) -> bool:
        return 0 < self.spec.max_steps <= self.trainer.step

    async def start_step(self, nursery: trio.Nursery) -> None:
        await self.mode.start_step(nursery)

    async def average_and_step(self, taken: Accumulated | None = None) -> bool:
        return await self.mode.average_and_step(taken)

    async def _after_step(self, new_step: int) -> None:
        if new_step % self.spec.checkpoint_every == 0 or self.finished():
            await self.sync.announce_state()

    # ------------------------------------------------------------------ state

    async def announce_state(self) -> object:
        return await self.sync.announce_state()

    async def sync_state(self, on_progress: Callable[[int, int], None] | None = None) -> int:
        return await self.sync.sync_state(on_progress)

    async def hand_over_final_state(self, stop: trio.Event, within: float = 60.0) -> bool:
        return await self.sync.hand_over_final_state(stop, within)

    async def resume_if_behind(self) -> None:
        await self.sync.resume_if_behind()

    def _record_step(self, record: StepRecord) -> None:
        if self.on_step is not None:  # read at each step: callers may set it after construction
            self.on_step(record)

    def _discard(self, first: int, last: int) -> None:
        logger.warning(
            "steps %d-%d were a fork that did not survive: replaced by the collaboration's", first, last
        )
        if self.on_discard is not None:
            self.on_discard(first, last)

    def _waiting(self, why: str | None) -> None:
        self.stats.waiting = why
