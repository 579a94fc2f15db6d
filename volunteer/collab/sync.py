"""State sync: serving our state, catching up, handing over the final state, resuming a run.

**Serving** (:meth:`StateSync.announce_state`): our current state is offered for download by the node's
:class:`~shared.state.transfer.StateServer` and announced in the DHT
(:data:`~protocols.training.CHECKPOINT_KEY`) every ``checkpoint_every`` steps (when backbones store
checkpoints) and when a peer at our step flags ``syncing`` (:meth:`StateSync.announce_if_asked`).

**Catching up** (:meth:`StateSync.sync_state`): when the view says we are behind (a credible peer is at a
later step) or diverged, the phase becomes ``SYNCING`` (published: peers at the collaboration's step hold
their round for us and announce their state); we pick the state the most users vouch for
(:func:`shared.state.transfer.trusted_state`), download it chunk by chunk from those peers (resuming with
another when one fails, refusing anything whose SHA-256 differs, never more than the largest state of
this run's model) and load it. A state beyond the collaboration's credible step is a lone claim: refused
while peers train; with nobody training it is how a run resumes (:meth:`StateSync.resume_if_behind`).

*Nobody holds a state* (the view has no surviving collaboration: every peer we see is a newcomer or is
downloading, e.g. the restarted volunteers whose source just died): the view's step is then nobody's
(with everyone downloading it is our own step 0), so it is no target. We are then as good as alone: the
high-water mark, if it binds, is the target (:mod:`shared.alone`, rule (b)), else the newest announced
state is (a run resuming from a checkpoint). A peer that fails us in a download is left out of the view
until it publishes again (:meth:`~.progress_board.ProgressBoard.gone`), and when the mark's state died
with its holders (rule (d): they failed us or restarted, nobody we see holds it, another peer is with
us) the mark is forgotten -- after :data:`~shared.alone.LOSS_CONFIRM` seconds when that makes us load an
older state -- and the survivors resume together from the newest state still announced (a backbone's
checkpoint).

*A restarted volunteer* (``previous_life``, ``previous_lineage``: the report journal's highest step and
the fingerprints of its last reported steps) reports its earlier process's steps that the first state it
trains on did not keep as discarded, once, through ``on_discard`` (the ledger then stops crediting them):
those above that state's step, and those from the first step whose fingerprint differs from its lineage
(:func:`shared.state.lineage.earlier_life_replaced`). E.g. it held step 9 and was killed, the survivors
resumed from a checkpoint of step 1 and took steps 2 and 3 again: loading that step 3, its own steps
2..9 are discarded, not only 4..9. A journal without fingerprints (an older version) gives the steps
above the loaded one only. That first state is the first one it loads (:meth:`StateSync.sync_state`,
even after it computed micro-batches on its initial state), or, when it steps before loading any, its
own initial state (:meth:`StateSync.settle_earlier_life`, called as its first round or step begins):
the two-backbone soak's lone volunteer took steps 1..5 alone, was killed with the only copy of step 5,
and the survivors and its next process all went on from step 0 -- nothing was loaded, and without this
its lone steps 1..5 would have stayed credited and counted as a fork. It is settled as that first step
begins (before its round's all-reduce, or before a lone step is applied), so that the discard precedes
the new step in the report journal (a discard drops the not yet reported steps of its range).

**Handing over** (:meth:`StateSync.hand_over_final_state`): at the run's step limit the last volunteers
keep serving the final state until a backbone confirms storing it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import trio

from protocols.training import CHECKPOINT_KEY, StateAnnouncement, TrainingSpec
from shared import faults
from shared.alone import LOSS_CONFIRM, state_lost
from shared.errors import StateError, StateUnavailable
from shared.net.addresses import PeerAddress
from shared.node import Node
from shared.state.blob import read_metadata, state_digest, state_step
from shared.state.limits import SourceBook, state_size_bound
from shared.state.lineage import MAX_TEXT as LINEAGE_MAX_TEXT
from shared.state.lineage import comparable, earlier_life_replaced, fork_start_known, replaced_steps
from shared.state.transfer import (
    StateServer,
    announce_state,
    fetch_state,
    presence_addresses,
    read_announcements,
    trusted_state,
)
from shared.state.trust import BACKBONE_USER, Announced, usable_states
from shared.tolerated import Tolerated

from .evidence import Evidence
from .phase import PeerState, Phase
from .progress_board import ProgressBoard
from .torch_thread import run_torch
from .trainer import LocalTrainer

__all__ = ["StateSync"]

logger = logging.getLogger(__name__)
RETRY_PERIOD = 0.5  # seconds between looks for a state to download


@dataclass
class StateSync:
    node: Node
    trainer: LocalTrainer
    spec: TrainingSpec
    board: ProgressBoard
    peer: PeerState
    tolerated: Tolerated
    data_dir: Path | None = None
    patience: float = 15.0  # seconds to wait for a state at the collaboration's step
    #: (bytes done, total) while a download is under way; the panel shows it
    download: tuple[int, int] | None = None
    waiting: Callable[[str | None], None] = lambda _: None
    sources: SourceBook = field(default_factory=SourceBook)  # failed sources, refused announcements
    #: the step this data dir reached before a restart (from the report journal): a fresh peer that then
    #: loads an older state lost the steps in between with its earlier process, and reports them discarded
    previous_life: int | None = None
    #: the fingerprints of the steps the earlier process reported (the journal's, bounded): which of them
    #: the loaded state's lineage shows were taken differently (module docstring)
    previous_lineage: Mapping[int, bytes] = field(default_factory=dict)
    evidence: Evidence | None = None  # the high-water mark: no older state is loaded while it binds
    #: called with (first, last) when a loaded state replaced steps only we took (a fork that lost)
    on_discard: Callable[[int, int], None] | None = None
    key: str = CHECKPOINT_KEY  # where this collaboration's state announcements live (TrainingKeys.state)
    _announced_step: int = -1
    _max_state_bytes: int | None = None  # the largest state of this run's model
    _loss_since: float | None = None  # trio time since which the mark's state looks lost (rule (d))

    def __post_init__(self) -> None:
        self.server = StateServer(self.node.host)

    # ------------------------------------------------------------------ serving

    async def announce_state(self) -> StateAnnouncement:
        """Offer our current state for download and announce it in the DHT."""

        def snapshot() -> tuple[int, bytes, bytes]:
            blob = self.trainer.state_blob()
            return self.trainer.step, blob, state_digest(blob)

        step, blob, digest = await run_torch(snapshot)
        announcement = self.server.offer(step, blob, digest=digest)
        with self.tolerated.around("state.announce"):
            await announce_state(self.node.dht, announcement, self.key)
        self._announced_step = step
        return announcement

    async def announce_if_asked(self) -> None:
        view = self.board.view
        if (
            view is not None
            and view.syncing
            and self.peer.anchored
            and not self.peer.syncing
            and not view.diverged
            and not view.minority
            and view.step == self.trainer.step
            and self._announced_step != self.trainer.step
            and not (self.evidence is not None and self.evidence.holds_back(self.trainer.step))
        ):
            await self.announce_state()

    # ------------------------------------------------------------------ catching up

    async def sync_state(self, on_progress: Callable[[int, int], None] | None = None) -> int:
        """Download and load the state the collaboration vouches for; returns the step we are at now.

        Raises:
            StateUnavailable: no trustworthy state could be downloaded within ``patience``.
        """
        ours = self.trainer.step if self.peer.anchored else None  # the state a load replaces
        our_lineage = self.trainer.lineage  # replaced (never mutated) by each step and load
        minority_seen = False  # the survivor was another collaboration (sticky across retries)
        came_from = self.peer.enter(Phase.SYNCING)
        self.waiting("re-syncing: downloading the collaboration's state")
        self.board.publish_soon()
        started = trio.current_time()
        errors: list[str] = []
        loaded = False
        self._loss_since = None
        try:
            while True:
                view = await self.board.try_refresh()
                minority_seen = minority_seen or (view is not None and (view.minority or view.diverged))
                target = view.step if view is not None else 0
                alone = view is None or view.peers <= 1
                # nobody we see holds a state (newcomers, downloads): the view's step is nobody's
                unheld = view is None or view.survivor is None
                candidates = trusted_state(await self._announcements(), min_step=0)
                mark = self.evidence.above(target) if self.evidence is not None else None
                if mark is None:
                    self._loss_since = None
                elif await self._mark_lost(mark, candidates, alone=alone, unheld=unheld):
                    mark = None
                # The mark guards a peer that sees nobody holding a state (it may be in half of a split
                # DHT). With a surviving collaboration in view, its view decides: when every holder of the
                # mark's state died, the peers left resume together from the newest state there is.
                binding = (alone or unheld) and self.evidence is not None and self.evidence.holds_back(target)
                if binding and mark is not None:
                    target = mark  # the collaboration showed us this step: nothing older will do
                patient = trio.current_time() - started < self.patience
                # Wait for a state at the collaboration's step; past our patience take the newest there is.
                # A state beyond the collaboration's credible step is a lone claim: refused while peers
                # train (nobody vouches for it); with nobody training it is how a run resumes. A peer
                # outside the surviving collaboration takes the survivor's state, even a lower step, and
                # never one only the losing side announced (shared.state.trust.usable_states).
                usable = usable_states(
                    candidates,
                    target=target,
                    alone=alone or unheld,  # nobody trains: as a run resumes
                    patient=patient or binding,
                    survivor=view.survivor.peers if view is not None and view.survivor is not None else None,
                )
                for announcement, writers in usable:
                    # a state refused outright (too large, not loadable) is not retried until it changes;
                    # each source's failure is counted and logged once in ``sources``
                    writers = [
                        w
                        for w in writers
                        if not self.sources.refused(w, announcement) and self.sources.usable(w)
                    ]
                    sources = await self._sources(writers, announcement)
                    if not sources:
                        continue
                    try:
                        step = await self._download(sources, on_progress)
                    except StateUnavailable as exc:
                        errors.append(str(exc))
                        logger.info("state of step %d: %s", announcement.step, exc)
                        for writer in writers:
                            if self.sources.failing(writer):
                                self.board.gone(writer)  # out of the view until it publishes again
                    except StateError as exc:
                        errors.append(str(exc))
                        for writer in writers:
                            self.sources.refuse(writer, announcement, str(exc))
                    else:
                        loaded = True
                        discarded = _replaced(ours, self.peer.agreed_before_load, step, minority_seen)
                        if ours is not None and comparable(our_lineage, self.trainer.lineage):
                            # the histories say which of our steps the collaboration did not take; where
                            # ours forked before the loaded lineage begins, the older rule may reach further
                            exact = replaced_steps(our_lineage, ours, self.trainer.lineage, step)
                            if fork_start_known(our_lineage, self.trainer.lineage) or discarded is None:
                                discarded = exact
                            elif exact is not None:
                                discarded = (min(exact[0], discarded[0]), ours)
                        if self.previous_life is not None:  # our earlier process's (we have not stepped)
                            discarded = self._earlier_life_replaced()
                        self.previous_life, self.previous_lineage = None, {}  # reported once
                        if discarded is not None and self.on_discard is not None:
                            self.on_discard(*discarded)
                        if self._announced_step != -1:  # we announced another state: that is over
                            await self.announce_state()
                        return step
                if not patient:
                    if self.evidence is not None and not binding:
                        self.evidence.give_up_mark()  # expired and nothing of its step: go on from what is
                    raise StateUnavailable(
                        f"no trustworthy state of step {target} could be downloaded"
                        + (f": {'; '.join(errors[-3:])}" if errors else " (nobody announced one)")
                    )
                await trio.sleep(RETRY_PERIOD)
        finally:
            if not self.peer.left:
                self.peer.enter(Phase.TRAINING if loaded or came_from is not Phase.FRESH else Phase.FRESH)
            self.download = None
            self.waiting(None)
            self.board.publish_soon()

    def settle_earlier_life(self) -> None:
        """We are about to step from the state we hold without having loaded one (our initial state): the
        earlier process's steps it does not keep are reported discarded now (module docstring, "A
        restarted volunteer"); nothing once they were settled by a load or an earlier call."""
        if self.previous_life is None:
            return
        discarded = self._earlier_life_replaced()
        self.previous_life, self.previous_lineage = None, {}  # reported once
        if discarded is not None and self.on_discard is not None:
            self.on_discard(*discarded)

    def _earlier_life_replaced(self) -> tuple[int, int] | None:
        assert self.previous_life is not None
        return earlier_life_replaced(
            self.previous_lineage, self.previous_life, self.trainer.lineage, self.trainer.step
        )

    async def _mark_lost(
        self,
        mark: int,
        candidates: list[tuple[StateAnnouncement, list[str]]],
        *,
        alone: bool,
        unheld: bool,
    ) -> bool:
        """Rule (d) of :mod:`shared.alone` for a mark above everyone we see: forget it when its state died
        with its holders. Where that makes us load an older state (nobody we see holds one), the verdict
        must first hold for :data:`~shared.alone.LOSS_CONFIRM` seconds; with a surviving collaboration in
        view, whose state we load anyway, the mark is forgotten at once (it would otherwise keep us from
        answering the peers that ask for our state, and from a lone step after the others leave)."""
        assert self.evidence is not None
        announced = [(a.step, writers) for a, writers in candidates]
        me, records = self.node.peer_id, self.board.records

        def gone(peer: str) -> bool:  # restarted (holds an older state), left, or us (behind the mark)
            if peer == me:
                return self.trainer.step < mark
            record = records.get(peer)
            return record is not None and (record.left or record.step < mark)

        evidence = self.evidence
        if not state_lost(
            mark, announced, self.sources.failing, company=not alone, holders=evidence.holders, gone=gone
        ):
            self._loss_since = None
            return False
        now = trio.current_time()
        if self._loss_since is None:
            self._loss_since = now
        if unheld and now - self._loss_since < LOSS_CONFIRM:
            return False
        self._loss_since = None
        await evidence.lose_mark()
        return True

    async def _download(
        self,
        sources: list[tuple[PeerAddress, StateAnnouncement]],
        on_progress: Callable[[int, int], None] | None,
    ) -> int:
        def progress(done: int, total: int) -> None:
            self.download = (done, total)
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
            book=self.sources,
        )
        announced = sources[0][1].step
        if (header_step := await run_torch(lambda: state_step(read_metadata(blob)))) != announced:
            raise StateError(f"state announced as step {announced} says step {header_step}")
        await faults.point("state.before_load")
        try:
            step = await run_torch(self.trainer.load_state_blob, blob)
        except (ValueError, KeyError, IndexError, TypeError, RuntimeError, MemoryError) as exc:
            raise StateError(f"the state does not load: {exc!r}") from exc  # a decoder's failure
        self.peer.fingerprint = self.trainer.lineage[step]  # the load fingerprinted it (no second pass)
        self.peer.anchored = True
        self.peer.agreed_before_load, self.peer.agreed_step = self.peer.agreed_step, step
        self.server.offer(step, blob)
        logger.info("loaded the state of step %d (%d bytes) from %s", step, len(blob), sources[0][0].peer_id)
        return step

    async def _announcements(self) -> dict[str, Announced]:
        found = await read_announcements(self.node.dht, key=self.key)
        found.pop(self.node.peer_id, None)
        return found

    async def _sources(
        self, writers: list[str], announcement: StateAnnouncement
    ) -> list[tuple[PeerAddress, StateAnnouncement]]:
        addresses = await presence_addresses(self.node.dht)
        return [(addresses[w][0], announcement) for w in writers if addresses.get(w)]

    # ------------------------------------------------------------------ run boundaries

    async def hand_over_final_state(self, stop: trio.Event, within: float = 60.0) -> bool:
        """At the run's step limit: keep serving our final state until a backbone announces that it stored
        it (the run's result must not leave with its last volunteers), ``within`` seconds at most."""
        announcement = await self.announce_state()
        with trio.move_on_after(within):
            while not stop.is_set():
                with self.tolerated.around("state.hand_over"):
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
        if self.peer.anchored:
            return
        with self.tolerated.around("state.resume"):
            # Even with other peers in view: two newcomers at step 0 see each other as the run (each
            # doubts a lone veteran's claim) and would train from scratch beside a run announced further.
            await self.board.refresh()
            candidates = trusted_state(await self._announcements())
            if candidates and candidates[0][0].step > self.trainer.step:
                try:
                    await self.sync_state()
                except StateUnavailable as exc:
                    logger.warning("starting from the initial parameters: %s", exc)


def _replaced(ours: int | None, agreed: int, loaded: int, minority_seen: bool) -> tuple[int, int] | None:
    """Our steps a loaded state replaced that were not the collaboration's (reported as discarded), or None.

    ``ours``: our step before the load (None: our state was not the run's); ``agreed``: the last step at
    which our state was known to be the collaboration's (downloaded, or stepped in a group); ``loaded``:
    the loaded state's step. At or above the loaded step (a fork ahead, or diverged at the same step), or
    when the survivor was another collaboration, everything after ``min(agreed, loaded - 1)`` was ours
    alone; merely behind, only the steps after ``agreed`` (a lone fork that fell behind); an honest
    laggard, whose last step was with a group, loses nothing."""
    if ours is None:
        return None
    first = max(1, min(agreed, loaded - 1) + 1 if minority_seen or ours >= loaded else agreed + 1)
    return (first, ours) if ours >= first else None


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
    # the metadata: run id, task, and the longest lineage (shared.state.lineage: ASCII, no escapes)
    return state_size_bound(tensors, (trainer.run_id, trainer.task.name, "0" * LINEAGE_MAX_TEXT))


_OPTIMIZER_SLOTS = 2
