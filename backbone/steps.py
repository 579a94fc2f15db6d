"""The backbone records the global steps it saw the collaboration take in the ledger (time, loss,
samples, peers).

Every ``period`` seconds it reads the peers' progress records and summarizes them as a newcomer would
(:func:`shared.progress.summarize`, not anchored: absurd or unsupported claims are ignored). While the
collaboration is at step ``s`` it remembers the largest sample count and number of peers seen there and
the samples-weighted loss they report (the loss of the batch that takes ``s`` to ``s + 1``). When the
collaboration's step moves past ``s``, step ``s + 1`` is recorded with those numbers, if the tracker saw
samples accumulated toward it.

**Samples: the batch its members claim, else what the records say.** The members of the round that
took a step publish its exact global batch with their progress, and the value most users claim is
recorded (:func:`shared.progress.claimed_batch`). When nobody claims one, or the view moved more than one
step (the claims then are a later step's: a lone volunteer taking several steps per period), the
tracker records the largest sample count the records themselves say (:func:`observed_samples`), never
their extrapolation: a newcomer's view adds each record's throughput times its age (up to 3 s) to guess
when the batch is full, and for the ledger that guess is not the step's batch (issue 11: steps of one
volunteer at a target of 48 were recorded with 192 samples, the 4x ceiling, and with no loss). A step
seen only with 0 samples and claimed by nobody gets no row: the tracker did not see it worked on
(receipts may still evidence it, below).

**Swarm runs** (``[sync] mode = "swarm"``; :mod:`backbone.ledger.accounting`, "Swarm runs"). Each
pipeline stage is a collaboration of its own, publishing its progress under its own key
(:func:`protocols.swarm.stage_training_keys`), with its own step counter; the run has no global step. The
backbone then runs one tracker per stage over that stage's records, by the same rules, and records the
steps it saw each stage take with :meth:`~backbone.ledger.LedgerStore.record_stage_step` (their batches
in stage-samples), so that stage servers' receipts count. The log lines name the stage.

**Logs.** Each recorded step is logged at DEBUG; at INFO a progress line every
:data:`PROGRESS_EVERY_STEPS` steps or :data:`PROGRESS_EVERY_S` seconds (steps, loss, median batch
against the target, peers), and once "run finished" when a step reaches the run's ``max_steps``.

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
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import trio

from protocols.swarm import stage_training_keys
from protocols.training import PROGRESS_KEY, Progress, TrainingSpec
from shared.node import Node
from shared.progress import MAX_SAMPLES_FACTOR, claimed_batch, plausible, summarize
from shared.progress_records import read_progress_with_users
from shared.tolerated import Tolerated

from .api import DB_WRITE
from .ledger import LedgerStore

__all__ = [
    "PROGRESS_EVERY_S",
    "PROGRESS_EVERY_STEPS",
    "StepLog",
    "StepTracker",
    "StepWatcher",
    "watchers",
    "observed_samples",
    "record_steps_forever",
]

logger = logging.getLogger(__name__)

#: An INFO progress line after this many recorded steps or this many seconds, whichever comes first.
PROGRESS_EVERY_STEPS = 100
PROGRESS_EVERY_S = 60.0


def observed_samples(records: Mapping[str, Progress], step: int, now: float, target_batch: int) -> float:
    """The samples the plausible records at ``step`` say were accumulated toward ``step + 1``, without
    the throughput extrapolation of :func:`shared.progress.summarize` (module docstring); capped, as
    there, at ``MAX_SAMPLES_FACTOR`` target batches."""
    total = sum(
        p.samples
        for p in records.values()
        if p.step == step and not p.syncing and not p.left and plausible(p, now, target_batch)
    )
    return float(min(total, MAX_SAMPLES_FACTOR * target_batch))


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
        largest sample count the records said while it was worked toward otherwise."""
        finished: list[tuple[int, float | None, int, int]] = []
        if self.step is not None and step > self.step:
            exact = batch if batch is not None and batch > 0 and step == self.step + 1 else None
            if exact is not None or round(self.samples) > 0:
                taken = round(self.samples) if exact is None else exact
                finished.append((self.step + 1, self.loss, taken, max(1, self.peers)))
        if self.step is None or step != self.step:
            self.step, self.samples, self.peers, self.loss = step, 0.0, 0, None
        self.samples = max(self.samples, samples)
        self.peers = max(self.peers, peers)
        if loss is not None:
            self.loss = loss
        return finished


@dataclass
class PlannedRounds:
    """The target of each step as its peers planned it (diloco rounds with ``min_round``): what most users
    at step ``s`` publish is the target of step ``s + 1``. Only the last :attr:`KEEP` steps are kept."""

    KEEP = 64
    _targets: dict[int, int] = field(default_factory=dict)

    def see(self, step: int, target: int | None) -> None:
        """The view at ``step`` showed ``target`` (None: nobody plans)."""
        if target is None:
            return
        self._targets[step + 1] = target
        for old in [s for s in self._targets if s <= step + 1 - self.KEEP]:
            del self._targets[old]

    def of(self, step: int, default: int) -> int:
        """The target ``step`` aimed at: the planned round, or ``default`` (the manifest's target batch)."""
        return self._targets.get(step, default)


@dataclass
class StepLog:
    """The log lines of the module docstring: every step at DEBUG, a progress line at INFO every
    ``every_steps`` steps or ``every_s`` seconds, and "run finished" once at ``max_steps``."""

    target_batch: int
    max_steps: int = 0
    every_steps: int = PROGRESS_EVERY_STEPS
    every_s: float = PROGRESS_EVERY_S
    #: whose steps: "global" (a data-parallel run) or "stage k" (a swarm run's stage)
    name: str = "global"
    _batches: list[int] = field(default_factory=list)
    _losses: list[float] = field(default_factory=list)
    _peers: int = 0
    _first: int | None = None
    _last: int = 0
    _since: float | None = None
    _finished: bool = False

    def step(self, step: int, loss: float | None, samples: int, peers: int, now: float) -> None:
        loss_text = "—" if loss is None else f"{loss:.4f}"
        logger.debug("%s step %d: loss %s, %d samples, %d peers", self.name, step, loss_text, samples, peers)
        if self._since is None:
            self._since = now
        self._first = step if self._first is None else self._first
        self._last = step
        self._batches.append(samples)
        if loss is not None:
            self._losses.append(loss)
        self._peers = max(self._peers, peers)
        if len(self._batches) >= self.every_steps or now - self._since >= self.every_s:
            self.flush(now)
        self.reached(step, now)

    def reached(self, step: int, now: float) -> None:
        """The collaboration is at ``step`` (recorded or not: the last step may pass unseen): says "run
        finished" once when it reaches ``max_steps``."""
        if 0 < self.max_steps <= step and not self._finished:
            self._finished = True
            self.flush(now)
            logger.info(
                "run finished: %s step %d reached the run's max_steps (%d)", self.name, step, self.max_steps
            )

    def flush(self, now: float) -> None:
        """Log the progress line of the steps since the last one (nothing if there were none)."""
        if not self._batches or self._first is None:
            return
        loss = f"loss {statistics.fmean(self._losses):.4f}" if self._losses else "loss —"
        logger.info(
            "%s steps %d-%d recorded: %s, median batch %d / target %d, up to %d peers",
            self.name,
            self._first,
            self._last,
            loss,
            round(statistics.median(self._batches)),
            self.target_batch,
            self._peers,
        )
        self._batches, self._losses, self._peers, self._first, self._since = [], [], 0, None, now


RecordStep = Callable[..., bool]


@dataclass
class StepWatcher:
    """One collaboration's tracker (the run's, or one stage's): reads the progress records under ``key``
    and records the steps it saw taken with ``record`` (:meth:`LedgerStore.record_step`, or
    ``record_stage_step`` bound to a stage)."""

    spec: TrainingSpec
    key: str
    record: RecordStep
    log: StepLog
    tracker: StepTracker = field(default_factory=StepTracker)
    planned: PlannedRounds = field(default_factory=PlannedRounds)

    async def poll(self, node: Node) -> None:
        """One read of the records and the steps it shows taken (raises what the DHT read raises)."""
        spec = self.spec
        records, users = await read_progress_with_users(node.dht, self.key)
        if not records:
            return
        now = time.time()
        nobody = Progress(step=0, samples=0, samples_per_second=0.0, time=now)
        view = summarize(
            records,
            node.peer_id,
            nobody,
            now=now,
            target_batch=spec.target_batch,
            anchored=False,
            users=users,
            min_target=spec.sync.min_round,
        )
        peers = view.peers_at_step - (view.step == 0)  # not ourselves (a "peer" at step 0)
        samples_seen = observed_samples(records, view.step, now, spec.target_batch)
        batch = claimed_batch(records, view.step, spec.target_batch, users, now)
        self.planned.see(view.step, view.target)
        observed = self.tracker.observe(view.step, samples_seen, peers, view.loss, batch)
        for step, loss, samples, count in observed:
            record = functools.partial(
                self.record,
                step,
                finished_at=time.time(),
                loss=loss,
                samples=samples,
                peers=count,
                target_batch=self.planned.of(step, spec.target_batch),
            )
            recorded = await trio.to_thread.run_sync(record, limiter=DB_WRITE)
            if recorded:
                self.log.step(step, loss, samples, count, time.time())
        self.log.reached(view.step, time.time())


def watchers(store: LedgerStore, spec: TrainingSpec) -> list[StepWatcher]:
    """The trackers a run needs (module docstring): one per stage in a swarm run, else the run's."""
    if spec.sync.mode == "swarm" and spec.sync.stages > 0:
        return [
            StepWatcher(
                spec,
                stage_training_keys(k).progress,
                functools.partial(store.record_stage_step, k),
                StepLog(spec.target_batch, spec.max_steps, name=f"stage {k}"),
            )
            for k in range(spec.sync.stages)
        ]
    return [StepWatcher(spec, PROGRESS_KEY, store.record_step, StepLog(spec.target_batch, spec.max_steps))]


async def record_steps_forever(
    node: Node,
    store: LedgerStore,
    spec: TrainingSpec,
    period: float = 1.0,
    tolerated: Tolerated | None = None,
) -> None:
    """Feed the trackers every ``period`` seconds; a failed read is counted in ``tolerated`` (the
    backbone's status shows it) and retried at the next period."""
    tolerated = tolerated if tolerated is not None else Tolerated(logger)
    tracked = watchers(store, spec)
    while True:
        for watcher in tracked:
            with tolerated.around("steps.read"):
                await watcher.poll(node)
        await trio.sleep(period)
