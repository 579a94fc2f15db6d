"""The batch mode's step: accumulate at our own pace, average when the collaboration reaches the target
batch, take exactly one optimizer step together (DESIGN §1; seed 000 §3.1, Fig. 1).

This is the seam between *how a step is taken* and everything else (publishing progress, state sync):
the collaborative optimizer asks its :class:`StepMode` whether to step (:meth:`~StepMode.ready`) and
lets it take the step (:meth:`~StepMode.average_and_step`, or :meth:`~StepMode.start_step` with delayed
parameter updates). Other synchronization modes (low-communication rounds, a pipeline) implement the same
protocol beside :class:`BatchStep`; they read the view from the progress board and change the shared
:class:`~.phase.PeerState`, nothing else.

**A step** (:meth:`BatchStep.average_and_step`), entered when :meth:`BatchStep.ready`:

1. take the accumulated gradient sum out of the model (our weight = our samples; 0 is fine: a peer that
   loaded the state for this round still receives the average and steps with everyone);
2. matchmaking for round = our step (:class:`~shared.averaging.matchmaking.Matchmaker`; the group's leader
   solves the LP for the members' measured capabilities) and the all-reduce of ``sum / samples``;
3. if every slice was averaged, apply the group's mean gradient: one optimizer step, identical on every
   member (the all-reduce's results are bit-identical and so are the optimizer states);
4. if the round failed (a member died, a slice's aggregator vanished), the gradients go back into the
   accumulators and the survivors retry the round: no accumulated sample is lost. A peer left out of the
   round while others stepped re-downloads the state. Each attempt matchmakes under the member's next key
   of the step, which only moves forward, also across calls, and stays put only while the member finds
   no other computing member's ticket there (:mod:`shared.averaging.attempts`: keys reused by a fixed
   cycle of attempts left members out of phase failing one round for ever).
5. Alone in the run (no other credible peer), we step with our own gradient at once, without
   matchmaking; alone at our step after a matchmaking that found nobody, likewise -- but only with
   evidence that we *are* alone (``lone``: :func:`shared.alone.lone_step`, fed by
   :class:`~.evidence.Evidence`): reads through our DHT and through every known backbone show nobody,
   and our state is not older than the collaboration last showed us. Without it we wait and retry: a
   volunteer that joined through half of a split DHT never forks the run.

**Our share** (:meth:`BatchStep.budget`, :meth:`BatchStep.ready`; the rule and its reasons are in
:mod:`shared.progress`, "Batch accounting"). A step's batch is the target batch, not more: after a round,
each member knows its share of the next step (:func:`shared.progress.quotas` of the plan's members'
ticket throughputs -- the same numbers on every member, summing to the target); it computes exactly that
(the last micro-batch cut to fit), then adds nothing more and waits until the collaboration's estimate
reaches the target or another peer entered the round. A peer whose share is not done when another
enters follows at once unless the rest takes less than half a matchmaking window. Without a share (the
first step, a newcomer, alone) the collaboration's estimate rules as before; one who holds longer than
``hold_patience`` (a member died) goes back to it.

**Loss scaling** (:mod:`volunteer.precision`): a member whose fp16 gradient overflowed joins to receive
only and says so in its ticket; when the plan shows a believed claim, every member skips the step without
averaging (the trainer advances the step, parameters unchanged, and halves the scale). A non-finite
gradient that no claim can make use of is dropped rather than put back for the next attempt.

**The diloco mode** (:mod:`.diloco`, "The running mode") runs on this class unchanged: its trainer
(:class:`~.diloco_trainer.DilocoTrainer`) hands out pseudo-gradients and applies the outer step, a step
is a round, and :meth:`BatchStep.target` is the round's samples -- the target batch, or, with
``[sync] min_round``, the round planned from the last round's plan (:mod:`shared.averaging.round_length`,
"In the running system"). After a completed round the trainer keeps what its error feedback needs
(``trainer.sent``).

**Holding a round** (:meth:`BatchStep.holding`): peers at the collaboration's step hold their round for
a peer downloading the state of that step (:func:`shared.progress.held_for`, per user, bounded).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import trio

from protocols.averaging import MAX_NORM, JoinTicket
from protocols.receipts import PulledSlice
from protocols.training import AVERAGING_PREFIX, TrainingSpec
from shared import faults
from shared.alone import LoneStep
from shared.averaging.allreduce import Averager, GroupPlan
from shared.averaging.attempts import AttemptKeys, attempt_key
from shared.averaging.matchmaking import Matchmaker, MatchmakingConfig
from shared.averaging.round_length import round_length
from shared.errors import ProjectError
from shared.net.host import CALL_FAILURES
from shared.node import Node
from shared.progress import MAX_EXTRAPOLATION, CollabView, held_for, micro_batch_budget, quotas
from shared.tolerated import Tolerated

from ..precision import believed
from ..receipts import ReceiptBook
from .phase import PeerState, Phase
from .progress_board import ProgressBoard
from .torch_thread import run_torch
from .trainer import Accumulated, LocalTrainer

__all__ = ["BatchStep", "StepMode", "StepRecord", "StepStats"]

logger = logging.getLogger(__name__)
LONE_RETRY = 1.0  # seconds before looking again when a lone step is not allowed
#: matchmaking windows a member alone under its key waits there for another (shared.averaging.attempts)
LINGER_WINDOWS = 3.0


@dataclass(frozen=True)
class StepRecord:
    """What we contributed to one global step (for the ledger)."""

    step: int  # the step taken: parameters went from step - 1 to step
    samples: int
    compute_seconds: float
    bytes_aggregated: int
    peers: int
    loss: float | None
    seconds: float  # averaging time
    finished_at: float
    fingerprint: bytes  # of the parameters after the step (identical on every peer of the round)
    batch: int = 0  # the step's global batch: the group's total weight (ours alone for a lone step)
    skipped: bool = False  # a collective loss-scale overflow: the step advanced, the parameters did not
    target: int = 0  # the samples the step aimed at: the target batch, or the planned round (diloco)


@dataclass
class StepStats:
    rounds: int = 0
    failed_rounds: int = 0
    last_round_seconds: float | None = None
    role: str = "compute"


class StepMode(Protocol):
    """How a synchronization mode takes steps (see the module docstring)."""

    stats: StepStats

    def ready(self) -> bool:
        """Step now (the collaboration reached its trigger at our step)."""

    def holding(self) -> bool:
        """Our share is done but we hold back for peers catching up."""

    def budget(self) -> int:
        """How many samples our next micro-batch may hold (0: add nothing to this step, wait)."""

    def target(self) -> int:
        """The samples the step toward ``trainer.step + 1`` aims at."""

    def planned(self) -> int:
        """The round we planned for our step (published in our progress record); 0: none."""

    async def average_and_step(self, taken: Accumulated | None = None) -> bool:
        """Take one step with the others; False if none was taken (the samples stay ours)."""

    async def start_step(self, nursery: trio.Nursery) -> None:
        """Delayed parameter updates: take the gradients now, step in ``nursery``."""


@dataclass
class BatchStep:
    node: Node
    trainer: LocalTrainer
    spec: TrainingSpec
    board: ProgressBoard
    peer: PeerState
    tolerated: Tolerated
    local_sps: Callable[[], float]  # our measured samples/s (training rate; falls back to the warm-up's)
    matchmaking_window: float = 1.0
    max_attempts: int = 3  # averaging attempts of one step before giving the samples back
    hold_patience: float = 3.0  # seconds we hold at our share before going back to the estimate
    poll_period: float = 0.3
    sync_grace: float = 10.0  # hold our round at most this long per user downloading the state ...
    sync_grace_window: float = 60.0  # ... in any window this long (shared.progress.held_for)
    samples_per_second: float = 0.0  # measured on the run's model; fed to the LP
    upload_bps: float = 1e8  # used until capabilities are measured
    download_bps: float = 1e8
    client_mode: bool = False
    on_step: Callable[[StepRecord], None] | None = None
    #: called when we are about to step from the state we hold: before a round's all-reduce and before a
    #: step is applied (a restarted volunteer settles its earlier life: volunteer.collab.sync)
    before_stepping: Callable[[], None] | None = None
    #: called after a step with the new step; the state sync announces the state at checkpoints
    after_step: Callable[[int], Awaitable[None]] | None = None
    #: may we step alone at this step? (shared.alone; None: always, e.g. in tests of the step alone)
    lone: Callable[[int], Awaitable[LoneStep]] | None = None
    receipts: ReceiptBook | None = None  # where each finished round's receipts and pull records go
    averaging_prefix: str = AVERAGING_PREFIX  # the rounds' matchmaking keys (TrainingKeys.averaging)
    #: a swarm run's pipeline stage this collaboration is (None: data-parallel): signed into receipts
    stage: int | None = None
    stats: StepStats = field(default_factory=StepStats)
    waiting: Callable[[str | None], None] = lambda _: None

    def __post_init__(self) -> None:
        self.averager = Averager(self.node.host, stage=self.stage)
        self.matchmaker = Matchmaker(
            self.node.dht,
            prefix=self.averaging_prefix,
            config=MatchmakingConfig(
                window=self.matchmaking_window,
                linger=LINGER_WINDOWS * self.matchmaking_window,
                codec=self.spec.codec,
                # nobody accumulates more than the target batch plus the micro-batch that crossed it
                max_weight=float(self.spec.target_batch + self.spec.local_batch),
                averaging=self.spec.averaging,
            ),
        )
        self._held_since: dict[str, float] = {}  # users we held a round for (shared.progress.held_for)
        self._quota: tuple[int, int] | None = None  # (step, our share of the samples toward step + 1)
        self._planned: tuple[int, int] | None = None  # (step, the round's samples toward step + 1)
        self._done_at: float | None = None  # when our share of this step was done (time.monotonic())
        self.attempts = AttemptKeys()  # which key the step's next attempt matchmakes under

    # ------------------------------------------------------------------ when

    @property
    def plans_rounds(self) -> bool:
        """The round length is planned (diloco with ``min_round``), not fixed at the target batch."""
        return self.spec.sync.mode == "diloco" and self.spec.sync.min_round > 0

    def target(self) -> int:
        """The samples of the step toward ``trainer.step + 1``: the target batch, or the planned round
        (:mod:`shared.averaging.round_length`, "In the running system": ours if we were in the round
        that planned it, else what most users at our step publish, else the shortest round)."""
        if not self.plans_rounds:
            return self.spec.target_batch
        step = self.trainer.step
        if self._planned is not None and self._planned[0] == step:
            return self._planned[1]
        view = self.board.view
        if view is not None and view.step == step and view.target is not None:
            return view.target
        return self.spec.sync.min_round

    def planned(self) -> int:
        planned = self._planned
        return planned[1] if planned is not None and planned[0] == self.trainer.step else 0

    def _plan_next_round(self, plan: GroupPlan, rates: dict[str, float]) -> int:
        """``N`` for the round after this one, from what every member of ``plan`` holds alike."""
        computing = [rate for rate in rates.values() if rate > 0]
        if not computing:
            return self.target()
        chosen = round_length(
            computing,
            plan.predicted_seconds + self.matchmaking_window,
            fraction=self.spec.sync.round_fraction,
            min_samples=self.spec.sync.min_round,
            max_samples=self.spec.target_batch,
        )
        return chosen.target_samples

    def holding(self) -> bool:
        """We hold our round for peers that are downloading the state of our step (they join it next)."""
        view = self.board.view
        if view is None or view.step != self.trainer.step or view.entered or not view.syncing:
            return False
        # Per user, not per peer id: one user's many machines get one grace between them.
        users = self.board.users
        held = held_for(
            tuple(sorted({users.get(peer, peer) for peer in view.syncing})),
            self._held_since,
            time.monotonic(),
            grace=self.sync_grace,
            window=self.sync_grace_window,
        )
        if held:
            self.waiting(f"holding the round for {len(held)} user(s) downloading the state")
        return bool(held)

    def ready(self) -> bool:
        """Enter the round now: our share of the step is done and the collaboration reached the target
        batch at our step, or its other peers started averaging (module docstring, "Our share")."""
        self.averager.release_expired()  # polled while we wait: past rounds' relay parts are not kept idle
        if self.peer.phase is not Phase.TRAINING or self.holding():
            return False
        target = self.target()
        if self.trainer.samples >= target:
            return True
        view = self.board.view
        if view is None or view.step != self.trainer.step:
            return False
        quota = self._quota_now(view)
        if quota is not None:
            return self._quota_ready(view, quota)
        if view.ready:
            return True
        return self._estimate() >= target

    def budget(self) -> int:
        """How many samples our next micro-batch may hold (0: our share is done, wait for the round)."""
        quota = self._quota_now(self.board.view)
        limit = self.target() if quota is None or self.peer.averaging else quota
        return micro_batch_budget(self.trainer.samples, limit, self.trainer.micro_batch)

    def _estimate(self) -> float:
        """The collaboration's samples at our step now: the last view, our samples since, and the others'
        throughput since the view was read (they keep computing between two reads of the DHT)."""
        view = self.board.view
        assert view is not None
        elapsed = min(MAX_EXTRAPOLATION, max(0.0, time.time() - self.board.view_at))
        others_rate = max(0.0, view.samples_per_second - self.local_sps())
        ours = self.trainer.samples - self.board.view_own_samples
        return view.samples + ours + 0.8 * others_rate * elapsed

    def _quota_now(self, view: CollabView | None) -> int | None:
        """Our share of this step, if the last round's plan gave us one, unless the view shows nobody else
        (the others left: the estimate rules again). Right after a round the others' records may still
        show the step before ours: they count, the share is what we go by."""
        if self._quota is None or self._quota[0] != self.trainer.step:
            return None
        if view is not None and view.peers <= 1:
            return None
        return self._quota[1]

    def _quota_ready(self, view: CollabView, quota: int) -> bool:
        now = time.monotonic()
        if self.trainer.samples < quota:
            self._done_at = None
            if not view.entered:
                return False
            # Another peer entered the round: finish our share if that takes less than half the window
            # (our ticket still makes its group), else enter with what we have (the round never splits).
            left = (quota - self.trainer.samples) / max(self.local_sps(), 1e-9)
            return left > self.matchmaking_window / 2
        if self._done_at is None:
            self._done_at = now
            self.board.publish_soon()  # the others see our share done (and stop extrapolating us) sooner
            self.waiting("our share of the step is done: waiting for the others")
        if view.ready or self._estimate() >= self.target():
            return True
        if now - self._done_at > self.hold_patience:  # a member died or stalls: back to the estimate
            held = now - self._done_at
            logger.info("step %d: held %.1f s at our share; going on", self.trainer.step + 1, held)
            self._quota = self._done_at = None
        return False

    # ------------------------------------------------------------------ the step

    async def start_step(self, nursery: trio.Nursery) -> None:
        self._enter_round()
        taken = await run_torch(self.trainer.take_gradients)
        nursery.start_soon(self.average_and_step, taken)

    def _enter_round(self) -> None:
        self._done_at = None
        self.waiting(None)
        self.peer.enter(Phase.AVERAGING)
        self.peer.round_step = self.trainer.step

    async def average_and_step(self, taken: Accumulated | None = None) -> bool:
        """Steps 1 to 5 of the module docstring (with ``taken``: gradients already taken out for step 1).
        Returns True if we took a step."""
        step = self.trainer.step
        started = trio.current_time()
        self._enter_round()
        try:
            for attempt in range(self.max_attempts):
                if taken is None:
                    taken = await run_torch(self.trainer.take_gradients)
                self.peer.round_samples = taken.samples
                self.board.publish_soon()
                outcome = await self._average(step, attempt, taken)
                if outcome is not None:
                    seconds = trio.current_time() - started
                    await self._apply(step, taken, outcome, seconds)
                    return True
                if self._usable(taken):
                    await run_torch(self.trainer.restore_gradients, taken)
                else:  # non-finite and no claim can use it: these samples are lost, not retried forever
                    logger.warning("step %d: dropping our non-finite gradient", step + 1)
                taken = None
                self.peer.round_samples = 0
                self.stats.failed_rounds += 1
                view = await self.board.try_refresh()
                if view is not None and (view.step > self.trainer.step or view.diverged):
                    return False  # the others moved on: the state sync takes over
            return False
        finally:
            if not self.peer.left:
                self.peer.enter(Phase.TRAINING)
            self.board.publish_soon()

    def _usable(self, taken: Accumulated) -> bool:
        """Worth putting back for the next attempt: finite, or an overflow claim that would be believed."""
        if _norm(taken.mean()) <= MAX_NORM:
            return True
        return self.trainer.scales_loss and believed(self.trainer.loss_scale, True)

    async def _average(self, step: int, attempt: int, taken: Accumulated) -> _Outcome | None:
        """One averaging attempt, or None if it failed."""
        view = await self.board.try_refresh()
        if (view is None or view.peers <= 1) and taken.samples > 0:
            # nobody else in the run: no group to find, no window to wait -- if we have evidence of it
            return await self._alone(step, taken)
        alone = view is None or view.peers_at_step <= 1
        vector = taken.mean()
        weight, norm = float(taken.samples), _norm(vector)
        overflow = False
        if not norm <= MAX_NORM:  # NaN/Inf or absurd: averaging it would only get us banned
            overflow = self.trainer.scales_loss  # an fp16 overflow: claimed (module docstring)
            logger.warning(
                "step %d: our gradient is not finite%s; joining to receive only",
                step + 1,
                f" (fp16 overflow at loss scale {self.trainer.loss_scale.scale:g})" if overflow else "",
            )
            weight, norm = 0.0, 0.0
        # only what a backbone dialed back, or our relayed address (none: client mode); read at every
        # round, since a relay slot can come and go
        advertised = self.node.host.advertised_addrs
        client_mode = self.client_mode or not advertised
        ticket = JoinTicket(
            addr=None if client_mode else advertised[0],
            weight=weight,
            norm=norm,
            samples_per_second=self.samples_per_second,
            upload_bps=self.upload_bps,
            download_bps=self.download_bps,
            client_mode=client_mode,
            overflow=overflow,
            numel=self.trainer.numel,  # auxiliary aggregators adopt the length computing members agree on
        )
        index = self.attempts.next(step)  # shared.averaging.attempts
        try:
            with self.averager.joining(step):  # a member that started before us gets PENDING, not NOT_FOUND
                plan = await self.matchmaker.assemble(
                    step, ticket, self.trainer.numel, group_key=attempt_key(index)
                )
        except (*CALL_FAILURES, ValueError, ProjectError) as exc:
            self.attempts.done(step, index, alone=False, now=trio.current_time())
            logger.warning("step %d: matchmaking failed: %s", step + 1, exc)
            self.waiting(_round_failure(str(exc)))
            return None
        # whatever comes of the round, we leave this key, unless no other computing member was there
        self.attempts.done(step, index, alone=plan is None and self.matchmaker.alone, now=trio.current_time())
        if plan is None:
            if alone and taken.samples > 0:
                return await self._alone(step, taken)
            logger.info(
                "step %d: no group this time (attempt %d, key %s)", step + 1, attempt + 1, attempt_key(index)
            )
            return None
        claimed = any(m.overflow for m in plan.members)
        if believed(self.trainer.loss_scale, claimed):  # every member of the plan skips: no averaging
            claimants = sum(1 for m in plan.members if m.overflow)
            logger.info("step %d: %d member(s) overflowed; skipping the step together", step + 1, claimants)
            return _Outcome(None, len(plan.members), 0, 0, overflow=True)
        if not any(m.weight > 0 for m in plan.members):
            logger.info("step %d: nobody in the group has samples yet; not averaging", step + 1)
            await trio.sleep(self.poll_period)
            return None
        me = next(i for i, m in enumerate(plan.members) if m.peer_id == self.node.peer_id)
        rates = self.matchmaker.last_rates
        target = self.spec.target_batch
        if self.plans_rounds:  # the next round's length, the same on every member (round_length)
            target = self._plan_next_round(plan, rates)
            self._planned = (step + 1, target)
        if self.node.peer_id in rates and len(rates) > 1:  # our share of the next step, if this one is taken
            self._quota = (step + 1, quotas(rates, target)[self.node.peer_id])
        if self.before_stepping is not None:
            self.before_stepping()
        result = await self.averager.all_reduce(plan, vector, me, step=step + 1)
        if self.receipts is not None:
            # a stage's pull records are not reported: a PulledSlice has no stage (backbone.ledger
            # .accounting, "Swarm runs")
            pulled = [] if self.stage is not None else result.pulled
            self.receipts.add(
                step + 1,
                list(result.receipts),
                [PulledSlice(aggregator, step + 1, nbytes) for aggregator, nbytes in pulled],
                stage=self.stage,
            )
        for j, why in result.refused.items():
            logger.warning("step %d: refused the average of %s: %s", step + 1, plan.members[j].peer_id, why)
        self.stats.rounds += 1
        self.stats.last_round_seconds = result.seconds
        share = plan.slice_sizes[me]
        self.stats.role = _role(taken.samples > 0, share > 0)
        if not result.outcome.complete:
            # A member that died is named from its closed connections or its stall (shared.averaging
            # .deadlines): the survivors retry at once under the next attempt's key, without it.
            logger.warning(
                "step %d: round incomplete (%d ranges not averaged%s); retrying with the survivors",
                step + 1,
                len(result.outcome.unaveraged()),
                "; left: " + ", ".join(f"{p} ({why})" for p, why in result.departed.items())
                if result.departed
                else "",
            )
            return None
        await run_torch(self.trainer.sent, plan.slice_sizes, plan.part_numel, me)  # error feedback
        # the LP's predicted time against what the round took: the next rounds' deadlines adapt
        self.matchmaker.record_round(plan.predicted_seconds, result.seconds)
        senders = sum(1 for m in plan.members if m.weight > 0)
        batch = round(sum(m.weight for m in plan.members))  # the weights averaged: the step's batch
        others = frozenset(str(m.peer_id) for m in plan.members if m.peer_id != self.node.peer_id)
        aggregated = share * 4 * senders
        return _Outcome(vector, len(plan.members), aggregated, batch, overflow=claimed, others=others)

    async def _alone(self, step: int, taken: Accumulated) -> _Outcome | None:
        """Our own mean gradient as the step's, when the evidence says we are alone (no lone forks:
        :mod:`shared.alone`); otherwise None after a short wait (the round is retried)."""
        if self.lone is not None:
            verdict = await self.lone(step)
            if not verdict.allowed:
                self.waiting(f"not stepping alone: {verdict.why}")
                logger.info("step %d: not stepping alone: %s", step + 1, verdict.why)
                await trio.sleep(LONE_RETRY)
                return None
        vector = taken.mean()
        if _norm(vector) <= MAX_NORM:
            await run_torch(self.trainer.sent, None, 1, 0)
            return _Outcome(vector, 1, 0, taken.samples)
        logger.warning("step %d: our gradient is not finite; it cannot be applied", step + 1)
        return _Outcome(None, 1, 0, taken.samples, overflow=self.trainer.scales_loss)

    async def _apply(self, step: int, taken: Accumulated, outcome: _Outcome, seconds: float) -> None:
        if self.before_stepping is not None:  # a lone step, or one skipped together, has no all-reduce
            self.before_stepping()
        peers, aggregated, batch = outcome.peers, outcome.aggregated, outcome.batch
        aimed = self.target()  # before the step moves on
        self.peer.batch = (step + 1, batch)  # published with step + 1, not before (optimizer.progress)
        new_step = await run_torch(self.trainer.apply, outcome.vector, outcome.overflow)
        skipped = outcome.vector is None  # a believed claim never brings a vector (_average)
        await faults.point("step.after_apply")  # stepped, nothing reported or published yet
        self.peer.fingerprint = self.trainer.lineage[new_step]  # apply fingerprinted it (no second pass)
        self.peer.anchored = True
        self.peer.loss = None
        if peers > 1:  # stepped with a group: our state is theirs (a lone step is ours alone)
            self.peer.agreed_step = new_step
            self.peer.stepped_with = (new_step, outcome.others)
        logger.info(
            "step %d %s: %d peers, %d local samples, loss %s, averaging %.2f s, params %s",
            new_step,
            "skipped (loss scale overflow; parameters unchanged)" if skipped else "done",
            peers,
            taken.samples,
            "—" if taken.loss is None else f"{taken.loss:.4f}",
            seconds,
            self.peer.fingerprint.hex()[:16],
        )
        if self.on_step is not None:
            self.on_step(
                StepRecord(
                    new_step,
                    taken.samples,
                    taken.compute_seconds,
                    aggregated,
                    peers,
                    taken.loss,
                    seconds,
                    time.time(),
                    self.peer.fingerprint,
                    batch,
                    skipped,
                    aimed,
                )
            )
        if self.after_step is not None:
            await self.after_step(new_step)
        self.board.publish_soon()
        assert new_step == step + 1


@dataclass(frozen=True)
class _Outcome:
    """A round's result: the vector to apply (None: nothing finite to apply), the members, the bytes we
    aggregated, the step's global batch, whether a member claimed overflow (identical on all), and who
    the other members were."""

    vector: np.ndarray | None
    peers: int
    aggregated: int
    batch: int
    overflow: bool = False
    others: frozenset[str] = frozenset()  # the group's other members (peer ids)


def _norm(vector: np.ndarray) -> float:
    """L2 norm in float64, as aggregators measure it (NaN for a vector holding NaN or Inf)."""
    return math.sqrt(float(np.einsum("i,i->", vector, vector, dtype=np.float64)))


def _role(computes: bool, aggregates: bool) -> str:
    if computes and aggregates:
        return "compute + aggregate"
    return "compute" if computes else ("aggregate" if aggregates else "receive")


def _round_failure(reason: str) -> str:
    """What the status line says when a round cannot form: why, and what would fix it."""
    if "client mode" in reason:
        return (
            f"no round can form: {reason} (every peer is behind NAT or a firewall); it needs a backbone that "
            "aggregates, a volunteer with a reachable address (--listen on a forwarded port), or `volunteer "
            "join --aux` on a reachable server"
        )
    return f"the last round could not form: {reason}"
