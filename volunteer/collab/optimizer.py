"""The collaborative optimizer: accumulate at our own pace, average when the collaboration reaches the
target batch, take exactly one optimizer step together (DESIGN §1; seed 000 §3.1, Fig. 1).

**Publishing.** Our :class:`~protocols.training.Progress` goes to the DHT after every change worth telling
(at most every ``publish_period``, at once when we enter averaging or start a download); the others' are
read every ``poll_period`` and summarized by :func:`shared.progress.summarize`.

**A step** (:meth:`CollaborativeOptimizer.average_and_step`), entered when the view says ``ready``:

1. take the accumulated gradient sum out of the model (our weight = our samples; 0 is fine: a peer that
   just joined still receives the average and steps with everyone);
2. matchmaking for round = our step (:class:`~shared.averaging.matchmaking.Matchmaker`; the group's leader
   solves the LP for the members' measured capabilities) and the all-reduce of ``sum / samples``;
3. if every slice was averaged, apply the group's mean gradient: one optimizer step, identical on every
   member (the all-reduce's results are bit-identical and so are the optimizer states);
4. if the round failed (a member died, a slice's aggregator vanished), the gradients go back into the
   accumulators and the survivors retry the round (a new matchmaking key per attempt): no accumulated
   sample is lost. A peer left out of the round while others stepped re-downloads the state.
5. Alone in the run (no other credible peer), we step with our own gradient at once, without
   matchmaking; alone at our step after a matchmaking that found nobody, likewise. Two peers that each
   believed themselves alone diverge for a step at most: the fingerprints disagree and the minority
   re-downloads the state.

With **delayed parameter updates** (``spec.dpu``), the daemon runs steps 1 to 4 in the background while the
next micro-batches are computed on the current parameters; the update lands between two micro-batches
(one step of staleness, seed 000 §3.1).

**Catching up** (:meth:`sync_state`): when the view says we are behind (a credible peer is at a later
step) or diverged, we flag ``syncing`` in our progress; peers at the collaboration's step see the flag and
announce their state (:data:`~protocols.training.CHECKPOINT_KEY`); we pick the state the most peers vouch
for (:func:`shared.state.transfer.trusted_state`), download it chunk by chunk from those peers (resuming
with another when one fails, refusing anything whose SHA-256 differs) and load it. Peers also announce
every ``checkpoint_every`` steps, which is when backbones store checkpoints; a run whose peers all left
resumes from the newest backbone checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import torch
import trio

from protocols.averaging import MAX_NORM, JoinTicket
from protocols.receipts import PulledSlice
from protocols.training import (
    PROGRESS_KEY,
    PROGRESS_TTL,
    Progress,
    StateAnnouncement,
    TrainingSpec,
)
from shared.averaging.allreduce import Averager
from shared.averaging.matchmaking import Matchmaker, MatchmakingConfig
from shared.errors import ProjectError, StateError, StateUnavailable
from shared.net.addresses import PeerAddress
from shared.net.host import CALL_FAILURES
from shared.node import Node
from shared.progress import MAX_EXTRAPOLATION, CollabView, held_for, summarize
from shared.progress_records import read_progress_with_users
from shared.state.blob import read_metadata, state_digest, state_step
from shared.state.limits import SourceBook, state_size_bound
from shared.state.transfer import (
    StateServer,
    announce_state,
    fetch_state,
    presence_addresses,
    read_announcements,
    trusted_state,
)
from shared.state.trust import BACKBONE_USER, Announced

from ..receipts import ReceiptBook
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
    announce_ttl: float = 60.0
    upload_bps: float = 1e8  # used until capabilities are measured
    download_bps: float = 1e8


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


@dataclass
class _Stats:
    local_sps: float = 0.0
    rounds: int = 0
    failed_rounds: int = 0
    last_round_seconds: float | None = None
    role: str = "compute"
    download: tuple[int, int] | None = None  # bytes done, total (state download in progress)
    waiting: str | None = None  # why we are not training right now
    samples_total: int = 0


@dataclass
class CollaborativeOptimizer:
    node: Node
    trainer: LocalTrainer
    spec: TrainingSpec
    data_dir: Path | None = None
    config: CollabConfig = field(default_factory=CollabConfig)
    samples_per_second: float = 0.0  # measured on the run's model; fed to the LP
    client_mode: bool = False
    on_step: Callable[[StepRecord], None] | None = None
    view: CollabView | None = None
    stats: _Stats = field(default_factory=_Stats)
    anchored: bool = False  # our state is real (we stepped with the others, or downloaded it)
    averaging: bool = False
    syncing: bool = False
    #: where each finished round's receipts and pull records go, for the contribution reports
    receipts: ReceiptBook | None = None

    def __post_init__(self) -> None:
        self.averager = Averager(self.node.host)
        self.server = StateServer(self.node.host)
        self.matchmaker = Matchmaker(
            self.node.dht,
            prefix="train.avg",
            config=MatchmakingConfig(
                window=self.config.matchmaking_window,
                codec=self.spec.codec,
                # nobody accumulates more than the target batch plus the micro-batch that crossed it
                max_weight=float(self.spec.target_batch + self.spec.local_batch),
                averaging=self.spec.averaging,
            ),
        )
        self._progress_changed = trio.Event()
        self._announced_step = -1
        self._last_fingerprint = b""
        self._loss: float | None = None
        self._left = False
        self._view_at, self._view_own = 0.0, 0  # when the view was taken, and our samples then
        self._round_step = -1  # the step whose round we are in (while ``averaging``)
        self._round_samples = 0  # our weight in it
        self._held_since: dict[str, float] = {}  # users we held a round for (shared.progress.held_for)
        self._users: dict[str, str] = {}  # peer id -> user, from the last read of the progress records
        self.state_sources = SourceBook()  # failed state sources, refused announcements (issue 9)
        self._max_state_bytes: int | None = None  # the largest state of this run's model

    # ------------------------------------------------------------------ background

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish our progress, read everyone's, announce our state when asked. Runs until cancelled."""
        self._last_fingerprint = await run_torch(self.trainer.fingerprint)
        await self.refresh_view()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._publish_forever)
            nursery.start_soon(self._poll_forever)
            task_status.started()

    def progress(self) -> Progress:
        # "ready" means: averaging toward step + 1 with these samples; never a round already finished
        in_round = self.averaging and self._round_step == self.trainer.step
        return Progress(
            step=self.trainer.step,
            samples=self.trainer.samples + (self._round_samples if in_round else 0),
            samples_per_second=self.stats.local_sps or self.samples_per_second,
            time=time.time(),
            loss=self._loss,
            params=self._last_fingerprint if self.anchored else b"",
            ready=in_round,
            syncing=self.syncing,
            client_mode=self.client_mode,
        )

    async def leave(self) -> None:
        """Tell the others we left (best effort, bounded): they stop waiting for our samples at once."""
        self._left = True  # our publisher stays quiet from now on
        final = msgspec.structs.replace(self.progress(), left=True, ready=False)
        with trio.move_on_after(3.0), contextlib.suppress(*CALL_FAILURES):
            await self.node.dht.store(
                PROGRESS_KEY,
                msgspec.msgpack.encode(final),
                time.time() + PROGRESS_TTL,
                subkey=self.node.peer_id.encode(),
            )

    def publish_soon(self) -> None:
        self._progress_changed.set()

    async def _publish_forever(self) -> None:
        while not self._left:
            with contextlib.suppress(*CALL_FAILURES):
                value = msgspec.msgpack.encode(self.progress())
                await self.node.dht.store(
                    PROGRESS_KEY, value, time.time() + PROGRESS_TTL, subkey=self.node.peer_id.encode()
                )
            with trio.move_on_after(self.config.publish_period):
                await self._progress_changed.wait()
            self._progress_changed = trio.Event()

    async def _poll_forever(self) -> None:
        while True:
            # Read more often as the target nears, so peers enter the round together, close to the target.
            eta = self.view.eta(self.spec.target_batch) if self.view is not None else None
            await trio.sleep(
                self.config.poll_period if eta is None else min(self.config.poll_period, max(0.05, eta / 2))
            )
            with contextlib.suppress(*CALL_FAILURES):
                await self.refresh_view()
            await self._announce_if_asked()

    async def refresh_view(self) -> CollabView:
        records, users = await read_progress_with_users(self.node.dht)
        self._users = users
        self._view_at, self._view_own = time.time(), self.trainer.samples
        self.view = summarize(
            records,
            self.node.peer_id,
            self.progress(),
            now=time.time(),
            target_batch=self.spec.target_batch,
            anchored=self.anchored or self.trainer.step > 0,
            users=users,
        )
        return self.view

    # ------------------------------------------------------------------ training

    async def accumulate(self, batch: Mapping[str, torch.Tensor]) -> int:
        """One micro-batch in a worker thread; returns the samples it added."""
        started = trio.current_time()
        samples, loss = await run_torch(self.trainer.accumulate, batch)
        elapsed = trio.current_time() - started
        if elapsed > 0:
            rate = samples / elapsed
            self.stats.local_sps = (
                rate if not self.stats.local_sps else 0.9 * self.stats.local_sps + 0.1 * rate
            )
        self._loss = loss if self._loss is None else 0.8 * self._loss + 0.2 * loss
        self.stats.samples_total += samples
        self.anchored = True
        return samples

    def holding(self) -> bool:
        """We hold our round for peers that are downloading the state of our step (they join it next)."""
        view = self.view
        if view is None or view.step != self.trainer.step or view.entered or not view.syncing:
            return False
        # Per user, not per peer id: one user's many machines get one grace between them.
        held = held_for(
            tuple(sorted({self._users.get(peer, peer) for peer in view.syncing})),
            self._held_since,
            time.monotonic(),
            grace=self.config.sync_grace,
            window=self.config.sync_grace_window,
        )
        if held:
            self.stats.waiting = f"holding the round for {len(held)} user(s) downloading the state"
        return bool(held)

    def ready(self) -> bool:
        """The collaboration reached the target batch at our step (or its other peers started averaging)."""
        if self.holding():
            return False
        if self.trainer.samples >= self.spec.target_batch:
            return True
        view = self.view
        if view is None or view.step != self.trainer.step:
            return False
        if view.ready:
            return True
        # Between two reads of the DHT the others keep computing: extrapolate from the last view.
        elapsed = min(MAX_EXTRAPOLATION, max(0.0, time.time() - self._view_at))
        others_rate = max(0.0, view.samples_per_second - (self.stats.local_sps or self.samples_per_second))
        estimate = view.samples + (self.trainer.samples - self._view_own) + 0.8 * others_rate * elapsed
        return estimate >= self.spec.target_batch

    def behind(self) -> bool:
        view = self.view
        return view is not None and (view.step > self.trainer.step or view.diverged)

    def finished(self) -> bool:
        return 0 < self.spec.max_steps <= self.trainer.step

    async def start_step(self, nursery: trio.Nursery) -> None:
        """Delayed parameter updates: take the gradients now, then average and step in ``nursery`` while
        the caller goes on computing micro-batches (which count toward the step after)."""
        self.averaging = True
        self._round_step = self.trainer.step
        taken = await run_torch(self.trainer.take_gradients)
        nursery.start_soon(self.average_and_step, taken)

    async def average_and_step(self, taken: Accumulated | None = None) -> bool:
        """Steps 1 to 5 of the module docstring (with ``taken``: gradients already taken out for step 1).
        Returns True if we took a step."""
        step = self.trainer.step
        started = trio.current_time()
        self.averaging = True
        self._round_step = step
        try:
            for attempt in range(self.config.max_attempts):
                if taken is None:
                    taken = await run_torch(self.trainer.take_gradients)
                self._round_samples = taken.samples
                self.publish_soon()
                outcome = await self._average(step, attempt, taken)
                if outcome is not None:
                    vector, peers, aggregated = outcome
                    await self._apply(step, taken, vector, peers, aggregated, trio.current_time() - started)
                    return True
                await run_torch(self.trainer.restore_gradients, taken)
                taken = None
                self._round_samples = 0
                self.stats.failed_rounds += 1
                with contextlib.suppress(*CALL_FAILURES):
                    await self.refresh_view()
                if self.behind():
                    return False
            return False
        finally:
            self.averaging = False
            self._round_step, self._round_samples = -1, 0
            self.publish_soon()

    async def _average(
        self, step: int, attempt: int, taken: Accumulated
    ) -> tuple[np.ndarray, int, int] | None:
        """One averaging attempt: (mean gradient, members, bytes we aggregated), or None if it failed."""
        with contextlib.suppress(*CALL_FAILURES):
            await self.refresh_view()
        view = self.view
        if (view is None or view.peers <= 1) and taken.samples > 0:
            return taken.mean(), 1, 0  # nobody else in the run: no group to find, no window to wait
        alone = view is None or view.peers_at_step <= 1
        vector = taken.mean()
        weight, norm = float(taken.samples), _norm(vector)
        if not norm <= MAX_NORM:  # NaN/Inf or absurd: averaging it would only get us banned
            logger.warning("step %d: our gradient is not finite; joining to receive only", step + 1)
            weight, norm = 0.0, 0.0
        ticket = JoinTicket(
            addr=self.node.host.listen_addrs[0]
            if self.node.host.listen_addrs and not self.client_mode
            else None,
            weight=weight,
            norm=norm,
            samples_per_second=self.samples_per_second,
            upload_bps=self.config.upload_bps,
            download_bps=self.config.download_bps,
            client_mode=self.client_mode,
        )
        try:
            plan = await self.matchmaker.assemble(step, ticket, self.trainer.numel, group_key=f"a{attempt}")
        except (*CALL_FAILURES, ValueError, ProjectError) as exc:
            logger.warning("step %d: matchmaking failed: %s", step + 1, exc)
            return None
        if plan is None:
            if alone and taken.samples > 0:
                return taken.mean(), 1, 0
            logger.info("step %d: no group this time (attempt %d)", step + 1, attempt + 1)
            return None
        if not any(m.weight > 0 for m in plan.members):
            logger.info("step %d: nobody in the group has samples yet; not averaging", step + 1)
            await trio.sleep(self.config.poll_period)
            return None
        me = next(i for i, m in enumerate(plan.members) if m.peer_id == self.node.peer_id)
        result = await self.averager.all_reduce(plan, vector, me, step=step + 1)
        if self.receipts is not None:
            self.receipts.add(
                step + 1,
                list(result.receipts),
                [PulledSlice(aggregator, step + 1, nbytes) for aggregator, nbytes in result.pulled],
            )
        for j, why in result.refused.items():
            logger.warning("step %d: refused the average of %s: %s", step + 1, plan.members[j].peer_id, why)
        self.matchmaker.record_round(plan.deadline / 2, result.seconds)
        self.stats.rounds += 1
        self.stats.last_round_seconds = result.seconds
        share = plan.slice_sizes[me]
        self.stats.role = _role(taken.samples > 0, share > 0)
        if not result.outcome.complete:
            logger.warning(
                "step %d: round incomplete (%d ranges not averaged); retrying with the survivors",
                step + 1,
                len(result.outcome.unaveraged()),
            )
            return None
        senders = sum(1 for m in plan.members if m.weight > 0)
        return vector, len(plan.members), share * 4 * senders

    async def _apply(
        self, step: int, taken: Accumulated, vector: np.ndarray, peers: int, aggregated: int, seconds: float
    ) -> None:
        new_step = await run_torch(self.trainer.apply, vector)
        self._last_fingerprint = await run_torch(self.trainer.fingerprint)
        self.anchored = True
        self._loss = None
        logger.info(
            "step %d done: %d peers, %d local samples, loss %s, averaging %.2f s, params %s",
            new_step,
            peers,
            taken.samples,
            "—" if taken.loss is None else f"{taken.loss:.4f}",
            seconds,
            self._last_fingerprint.hex()[:16],
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
                    self._last_fingerprint,
                )
            )
        if new_step % self.spec.checkpoint_every == 0 or self.finished():
            await self.announce_state()
        self.publish_soon()
        assert new_step == step + 1

    # ------------------------------------------------------------------ state

    async def announce_state(self) -> StateAnnouncement:
        """Offer our current state for download and announce it in the DHT."""

        def snapshot() -> tuple[int, bytes, bytes]:
            blob = self.trainer.state_blob()
            return self.trainer.step, blob, state_digest(blob)

        step, blob, digest = await run_torch(snapshot)
        announcement = self.server.offer(step, blob, digest=digest)
        with contextlib.suppress(*CALL_FAILURES):
            await announce_state(self.node.dht, announcement)
        self._announced_step = step
        return announcement

    async def _announce_if_asked(self) -> None:
        view = self.view
        if (
            view is not None
            and view.syncing
            and self.anchored
            and not self.syncing
            and not view.diverged
            and view.step == self.trainer.step
            and self._announced_step != self.trainer.step
        ):
            await self.announce_state()

    async def sync_state(self, on_progress: Callable[[int, int], None] | None = None) -> int:
        """Download and load the state the collaboration vouches for; returns the step we are at now.

        Raises:
            StateUnavailable: no trustworthy state could be downloaded within ``sync_patience``.
        """
        self.syncing = True
        self.stats.waiting = "re-syncing: downloading the collaboration's state"
        self.publish_soon()
        started = trio.current_time()
        errors: list[str] = []
        try:
            while True:
                with contextlib.suppress(*CALL_FAILURES):
                    await self.refresh_view()
                target = self.view.step if self.view is not None else 0
                candidates = trusted_state(await self._announcements(), min_step=0)
                patient = trio.current_time() - started < self.config.sync_patience
                # Wait for a state at the collaboration's step; past our patience take the newest there is.
                # A state beyond the collaboration's credible step is a lone claim: refused while peers
                # train (nobody vouches for it); with nobody training it is how a run resumes.
                alone = self.view is None or self.view.peers <= 1
                usable = [
                    c
                    for c in candidates
                    if (c[0].step >= target or not patient) and (alone or c[0].step <= target)
                ]
                for announcement, writers in usable:
                    # a state refused outright (too large, not loadable) is not retried until it changes;
                    # each source's failure is counted and logged once in ``state_sources``
                    writers = [
                        w
                        for w in writers
                        if not self.state_sources.refused(w, announcement) and self.state_sources.usable(w)
                    ]
                    sources = await self._sources(writers, announcement)
                    if not sources:
                        continue
                    try:
                        return await self._download(sources, on_progress)
                    except StateUnavailable as exc:
                        errors.append(str(exc))
                        logger.info("state of step %d: %s", announcement.step, exc)
                    except StateError as exc:
                        errors.append(str(exc))
                        for writer in writers:
                            self.state_sources.refuse(writer, announcement, str(exc))
                if not patient:
                    raise StateUnavailable(
                        f"no trustworthy state of step {target} could be downloaded"
                        + (f": {'; '.join(errors[-3:])}" if errors else " (nobody announced one)")
                    )
                await trio.sleep(0.5)
        finally:
            self.syncing = False
            self.stats.download = None
            self.stats.waiting = None
            self.publish_soon()

    async def _download(
        self,
        sources: list[tuple[PeerAddress, StateAnnouncement]],
        on_progress: Callable[[int, int], None] | None,
    ) -> int:
        def progress(done: int, total: int) -> None:
            self.stats.download = (done, total)
            if on_progress is not None:
                on_progress(done, total)

        partial = self.data_dir / "partial-state" if self.data_dir is not None else None
        if partial is not None:
            partial.mkdir(exist_ok=True)
        if self._max_state_bytes is None:
            self._max_state_bytes = await run_torch(_state_bound, self.trainer)
        blob = await fetch_state(
            self.node.host,
            sources,
            max_bytes=self._max_state_bytes,
            partial_dir=partial,
            on_progress=progress,
            book=self.state_sources,
        )
        announced = sources[0][1].step
        if (header_step := await run_torch(lambda: state_step(read_metadata(blob)))) != announced:
            raise StateError(f"state announced as step {announced} says step {header_step}")
        try:
            step = await run_torch(self.trainer.load_state_blob, blob)
        except (ValueError, KeyError, IndexError, TypeError, RuntimeError, MemoryError) as exc:
            raise StateError(f"the state does not load: {exc!r}") from exc  # a decoder's failure
        self._last_fingerprint = await run_torch(self.trainer.fingerprint)
        self.anchored = True
        self.server.offer(step, blob)
        logger.info("loaded the state of step %d (%d bytes) from %s", step, len(blob), sources[0][0].peer_id)
        return step

    async def _announcements(self) -> dict[str, Announced]:
        found = await read_announcements(self.node.dht)
        found.pop(self.node.peer_id, None)
        return found

    async def _sources(
        self, writers: list[str], announcement: StateAnnouncement
    ) -> list[tuple[PeerAddress, StateAnnouncement]]:
        addresses = await presence_addresses(self.node.dht)
        return [(addresses[w][0], announcement) for w in writers if addresses.get(w)]

    async def hand_over_final_state(self, stop: trio.Event, within: float = 60.0) -> bool:
        """At the run's step limit: keep serving our final state until a backbone announces that it stored
        it (the run's result must not leave with its last volunteers), ``within`` seconds at most."""
        announcement = await self.announce_state()
        with trio.move_on_after(within):
            while not stop.is_set():
                with contextlib.suppress(*CALL_FAILURES):
                    found = await self._announcements()
                    if any(
                        e.announcement.backbone
                        and e.announcement.digest == announcement.digest
                        and e.user in (BACKBONE_USER, w)  # a credible backbone (shared.state.trust)
                        for w, e in found.items()
                    ):
                        return True
                with trio.move_on_after(1.0):
                    await stop.wait()
        logger.warning("no backbone confirmed storing the final state of step %d", announcement.step)
        return False

    async def resume_if_behind(self) -> None:
        """A newcomer's first look: if peers or backbones announce a state beyond ours (a run resumed
        from a checkpoint, with nobody training right now), download it before training."""
        if self.anchored:
            return
        with contextlib.suppress(*CALL_FAILURES):
            view = await self.refresh_view()
            if view.peers > 1:
                return  # peers are training: behind() decides, from their credible progress
            candidates = trusted_state(await self._announcements())
            if candidates and candidates[0][0].step > self.trainer.step:
                try:
                    await self.sync_state()
                except StateUnavailable as exc:
                    logger.warning("starting from the initial parameters: %s", exc)


def _norm(vector: np.ndarray) -> float:
    """L2 norm in float64, as aggregators measure it (NaN for a vector holding NaN or Inf)."""
    return math.sqrt(float(np.einsum("i,i->", vector, vector, dtype=np.float64)))


def _role(computes: bool, aggregates: bool) -> str:
    if computes and aggregates:
        return "compute + aggregate"
    return "compute" if computes else ("aggregate" if aggregates else "receive")


def eta_text(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "—"
    return f"{seconds:.0f} s" if seconds >= 1 else "< 1 s"


def _state_bound(trainer: LocalTrainer) -> int:
    """The largest state blob of this run (issue 9, finding 2; :mod:`shared.state.limits`): every tensor of
    the model, and per trainable parameter :data:`_OPTIMIZER_SLOTS` slots of its size (Adam/AdamW's two
    moments, SGD's momentum) plus a step scalar. Every peer builds the same model, so this bounds any honest
    peer's state at any step -- our own optimizer state, empty at step 0, is no guide."""
    tensors = [
        (f"model/{name}", value.numel() * value.element_size(), value.dim())
        for name, value in trainer.model.state_dict().items()
    ]
    for i, param in enumerate(trainer.params):
        slot = (f"optim/{i}/momentum_buffer", param.numel() * param.element_size(), param.dim())
        tensors += [slot] * _OPTIMIZER_SLOTS + [(f"optim/{i}/momentum_buffer", 8, 0)]
    return state_size_bound(tensors, (trainer.run_id, trainer.task.name))


_OPTIMIZER_SLOTS = 2
