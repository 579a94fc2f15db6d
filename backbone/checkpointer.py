"""The backbone keeps the run's recent training states (DESIGN §1 "stores checkpoints", §6).

:func:`keep_checkpoints` runs beside the backbone's other services:

* it serves every stored checkpoint through the node's :class:`~shared.state.StateServer` and announces
  the newest under :data:`~protocols.training.CHECKPOINT_KEY` (``backbone=True``), re-published every
  :data:`~shared.state.transfer.ANNOUNCE_PERIOD` seconds, so newcomers and laggards can download it even
  when no volunteer is up;
* every :data:`POLL_PERIOD` seconds it reads the peers' state announcements and, once the most trusted
  state (:func:`~shared.state.trusted_state`) is at least ``spec.checkpoint_every`` steps past the newest
  stored one (or nothing is stored yet, or it is the run's final step ``spec.max_steps``), downloads it
  from the peers that announced it, checks it, and stores it; the store keeps the last
  ``spec.keep_checkpoints``.

The blobs stay opaque: the backbone checks their digest and their header's format and step, never loads
tensors, and needs no torch.

**Strangers' announcements** (DESIGN D10; issue 9, findings 2 and 8). Which state to believe is decided by
distinct admitted users, not writers (:mod:`shared.state.trust`). Since a newer step ranks first, a state
is stored only up to the collaboration's *credible* step (:func:`shared.progress.summarize` of the
peers' progress: one peer claiming a step far ahead of the others is not credible); with nobody training,
the lone peer's state is taken (a run with one volunteer, its final hand-over).

**Only the surviving collaboration's state** (issue 10: no lone forks). With several collaborations in
the peers' progress records, :mod:`shared.merge` names the survivor (most users, then most steps), and a
state is stored only if at least one of its announcers is a member of the survivor, and only up to the
survivor's step -- never a lone fork's, never a losing partition's, however new. **Forks** stored before
the two sides met (the backbone sat in the fork's half of a split DHT) are discarded: a stored checkpoint
ahead of a surviving collaboration of two or more users, seen there in two polls in a row (a verdict that
holds for :data:`POLL_PERIOD` seconds, not a moment's reading), is a state the run did not keep -- it is
set aside (:meth:`CheckpointStore.discard`: moved to ``discarded/``, not deleted), so that the survivor's
checkpoints are kept (the store keeps the highest steps) and the newest one announced is the survivor's.
A survivor of a single user discards nothing: one user behind the stored checkpoints is more likely a
volunteer that did not resume than the run.

**State behind NAT** (issue 14). A peer in client mode advertises no address, so nobody can dial it for
its state; but it holds an RPC connection to its backbones (the DHT's traffic), so a backbone asks it to
dial back a lane for each chunk request (:mod:`protocols.reversal`): checkpoints never depend on dialing a
NATed peer, and a run whose state only NATed peers hold still gets it onto a backbone, where newcomers
download it.

**Swarm runs** (``[sync] mode = "swarm"``; issue 17, "a departure may cost seconds, never a lost step").
Each pipeline stage is a collaboration of its own, under its own keys
(:func:`protocols.swarm.stage_training_keys`): its servers publish progress and announce states there,
and the run has no data-parallel state at all. The backbone then keeps, instead of the run's
checkpoints, one :class:`Checkpointer` per stage (:func:`checkpoint_scopes`), each by exactly the rules
above applied to its stage alone: it reads the stage's progress records (credible step, survivor, forks)
and state announcements, stores the stage's verified states in a directory of its own,
``<checkpoints>/stage-<k>`` (:func:`scope_directory`; keep-last-``spec.keep_checkpoints`` and the disk
checks per stage), and announces the newest under the stage's state key, ``backbone=True``, so that a
server refilling a stage whose last server died downloads the stage's state at its last stored step,
as a newcomer of a data-parallel run whose volunteers all left resumes from the run's
(:meth:`volunteer.collab.sync.StateSync.resume_if_behind`). All of them serve through the node's one
:class:`~shared.state.StateServer` (a host has one handler for the state topic), each offering and
forgetting only its own stored digests.

*A stage's checkpoint is never another stage's* (DESIGN D10). The keys are disjoint by construction
(``swarm.s<k>.state``), but an announcement under stage ``k``'s key is a stranger's claim, so the state
itself must say it: a stage's state blob carries ``stage = "<k>/<S>"`` in its metadata
(:func:`protocols.swarm.stage_tag`, written by the stage's trainer), and a downloaded state is stored
under a scope only if its ``stage`` entry is that scope's (:func:`check_scope`; the run's data-parallel
checkpoints must carry none). A mismatch is the state's fault: its announcers are refused, as for a
state of another step. So no stage's directory holds, and no stage's key announces, another stage's
state; the digest that names a stored blob then names one stage's state only, and the shared server
cannot serve one scope's checkpoint as another's.

An announced size is checked before anything is allocated or requested: against
:class:`CheckpointLimits` ``max_state_bytes``; against :data:`~shared.state.limits.STATE_GROWTH` times
the largest kept checkpoint when only one user vouches for it (a state is the model plus optimizer slots
proportional to it, so it grows at most ~3x, from step 0 without Adam's moments to any later step; a
state two users announce is exempt, so old checkpoints of another model cannot block the run for good);
and against the free disk beyond ``disk_reserve``. The download goes to a file under ``partial/``, is
verified and moved into place; nothing is sized by the claim. Every failure of one candidate -- a
refused size, unreachable or lying sources, a blob that is not a state of the announced step, a full
disk, any decoding error -- ends that candidate only: it is counted and logged once, its sources are
skipped for a while (:class:`~shared.state.limits.SourceBook`), and an announcement refused outright is
not tried again until its writer announces something else (a DHT record may live a day).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from protocols.errors import ProtocolError
from protocols.peer_id import PeerId
from protocols.swarm import stage_tag, stage_training_keys
from protocols.training import TRAINING_KEYS, Progress, StateAnnouncement, TrainingKeys, TrainingSpec
from shared.errors import ConfigError, StateError, StateUnavailable
from shared.merge import Collaboration
from shared.net.addresses import PeerAddress
from shared.net.host import CALL_FAILURES
from shared.node import Node
from shared.portable import free_bytes
from shared.progress import CollabView, summarize
from shared.progress_records import read_progress_with_users
from shared.state.blob import read_metadata, state_step
from shared.state.limits import DISK_RESERVE, SourceBook, checkpoint_size_limit
from shared.state.transfer import (
    ANNOUNCE_PERIOD,
    STATE_IO,
    StateServer,
    announce_state,
    fetch_state_file,
    presence_addresses,
    read_announcements,
    trusted_state,
)
from shared.state.trust import Announced, support_of

from .checkpoints import CheckpointEntry, CheckpointStore

__all__ = [
    "DEFAULT_MAX_STATE_BYTES",
    "POLL_PERIOD",
    "CheckpointLimits",
    "CheckpointScope",
    "Checkpointer",
    "check_scope",
    "checkpoint_scopes",
    "keep_checkpoints",
    "keep_scoped_checkpoints",
    "open_stores",
    "scope_directory",
]

logger = logging.getLogger("backbone.checkpoints")

#: Seconds between looks at the peers' state announcements.
POLL_PERIOD = 5.0
#: The largest state a backbone stores unless its organizer says otherwise: a model of ~2.5 billion
#: float32 parameters with Adam's two moments (raise it for larger models).
DEFAULT_MAX_STATE_BYTES = 32 * 1024**3
#: Digests remembered for "logged once" (bounded: announcements are strangers' to choose).
_MAX_REMEMBERED = 1024
#: What one candidate state's download and storage may fail with; each is that candidate's failure (its
#: sources are recorded in the SourceBook), never the checkpointer's.
_CANDIDATE_FAILURES = (
    *CALL_FAILURES,
    StateError,
    StateUnavailable,
    ConfigError,
    ProtocolError,
    OSError,
    MemoryError,
    ValueError,
)


@dataclass(frozen=True)
class CheckpointLimits:
    """How large a state the backbone accepts (see :mod:`shared.state.limits`).

    Attributes:
        max_state_bytes: the organizer's maximum.
        disk_reserve: bytes of disk left free under the checkpoint directory.
    """

    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES
    disk_reserve: int = DISK_RESERVE


@dataclass(frozen=True)
class CheckpointScope:
    """Whose states a :class:`Checkpointer` keeps (module docstring, "Swarm runs").

    Attributes:
        keys: the collaboration's DHT keys (progress records and state announcements are read there, and
            the newest checkpoint is announced there).
        stage: the index of the pipeline stage, or None for the run's data-parallel collaboration.
        stages: the run's stage count (0 for a data-parallel run).
    """

    keys: TrainingKeys = TRAINING_KEYS
    stage: int | None = None
    stages: int = 0

    @property
    def tag(self) -> str | None:
        """The ``stage`` metadata entry this scope's states carry (None: they carry none)."""
        return None if self.stage is None else stage_tag(self.stage, self.stages)

    @property
    def name(self) -> str:
        """For logs: ``"run"`` or ``"stage k"``."""
        return "run" if self.stage is None else f"stage {self.stage}"


def checkpoint_scopes(spec: TrainingSpec) -> list[CheckpointScope]:
    """The collaborations whose states a backbone keeps: one per stage in a swarm run, else the run's."""
    if spec.sync.mode == "swarm" and spec.sync.stages > 0:
        stages = spec.sync.stages
        return [CheckpointScope(stage_training_keys(k), k, stages) for k in range(stages)]
    return [CheckpointScope()]


def scope_directory(root: Path, scope: CheckpointScope) -> Path:
    """Where ``scope``'s checkpoints live under the backbone's checkpoint directory ``root``: ``root``
    itself for the run's, ``root/stage-<k>`` for stage ``k``'s (the run's store ignores directories)."""
    return Path(root) if scope.stage is None else Path(root) / f"stage-{scope.stage}"


def check_scope(metadata: Mapping[str, str], scope: CheckpointScope) -> None:
    """Raise :class:`~shared.errors.StateError` unless a state with ``metadata`` is ``scope``'s: its
    ``stage`` entry is the scope's stage tag (none for the run's)."""
    found = metadata.get("stage")
    if found != scope.tag:
        what = "the run's data-parallel state" if scope.tag is None else f"stage {scope.tag}"
        claim = "no stage" if found is None else f"stage {found[:16]!r}"
        raise StateError(f"a state of {claim}, not {what}")


def open_stores(root: Path, spec: TrainingSpec) -> list[tuple[CheckpointScope, CheckpointStore]]:
    """Open (create) the store of every scope of the run (:func:`checkpoint_scopes`) under ``root``,
    each keeping the last ``spec.keep_checkpoints``. Blocking: call it in a worker thread.

    Raises:
        ConfigError: a directory cannot be created or read.
    """
    return [
        (scope, CheckpointStore(scope_directory(root, scope), spec.keep_checkpoints))
        for scope in checkpoint_scopes(spec)
    ]


class _Prefixed(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Log lines naming the stage (nothing is added for the run's own checkpoints)."""

    def process(
        self, msg: object, kwargs: MutableMapping[str, Any]
    ) -> tuple[object, MutableMapping[str, Any]]:
        prefix = (self.extra or {}).get("prefix", "")
        return f"{prefix}{msg}", kwargs


class Checkpointer:
    """Decides which announced state to store and keeps the server and the DHT in line with the store."""

    def __init__(
        self,
        node: Node,
        server: StateServer,
        store: CheckpointStore,
        spec: TrainingSpec,
        limits: CheckpointLimits | None = None,
        scope: CheckpointScope | None = None,
    ) -> None:
        self.node = node
        self.server = server
        self.store = store
        self.spec = spec
        self.limits = limits or CheckpointLimits()
        self.scope = scope or CheckpointScope()
        self.log = _Prefixed(logger, {"prefix": "" if self.scope.stage is None else f"{self.scope.name}: "})
        self.book = SourceBook()  # failed sources, refused announcements
        self.changed = trio.Event()  # set when the newest checkpoint changes (announce it at once)
        self._offered: set[bytes] = set()
        self._short_of_disk: set[bytes] = set()  # digests already reported as not fitting on disk
        self._ahead: set[bytes] = set()  # digests already reported as beyond the credible step
        self._foreign: set[bytes] = set()  # digests already reported as not the survivor's
        self._fork_suspects: set[bytes] = set()  # stored digests ahead of the survivor at the last poll

    def sync_offers(self) -> StateAnnouncement | None:
        """Serve exactly the stored checkpoints; return the announcement of the newest."""
        stored = {e.digest: e for e in self.store.entries()}
        for digest in self._offered - stored.keys():
            self.server.forget(digest)
        announcements = {
            digest: self.server.offer_file(entry.step, self.store.path(digest), digest, entry.nbytes)
            for digest, entry in stored.items()
        }
        self._offered = set(stored)
        newest = self.store.newest()
        return announcements[newest.digest] if newest is not None else None

    async def announce_forever(self) -> None:
        """Keep our announcement of the newest checkpoint fresh in the DHT."""
        while True:
            newest = self.sync_offers()
            if newest is not None:
                with self.node.tolerated.around("checkpoint.announce"):
                    await announce_state(self.node.dht, newest, self.scope.keys.state)
            with trio.move_on_after(ANNOUNCE_PERIOD):
                await self.changed.wait()
            self.changed = trio.Event()

    async def poll_once(self) -> CheckpointEntry | None:
        """Store the most trusted announced state if it is due; return the new checkpoint, if any.

        Every candidate's failure (a refused announcement, unreachable or lying sources, a blob that is
        not a state, a full disk) is that candidate's: counted, logged once, and the next one is tried.

        Raises:
            whatever reading the DHT raises (:data:`~shared.net.host.CALL_FAILURES`).
        """
        view = await self._view()
        survivor = view.survivor if view.peers > 1 else None
        credible = view.step if view.peers > 1 else None
        await self._discard_forks(survivor)
        newest = self.store.newest()
        min_step = 0 if newest is None else newest.step + self.spec.checkpoint_every
        if newest is not None and 0 < self.spec.max_steps <= min_step and newest.step < self.spec.max_steps:
            min_step = self.spec.max_steps  # the run's final state is always kept
        announced = await read_announcements(self.node.dht, key=self.scope.keys.state)
        announced.pop(self.node.peer_id, None)
        candidates = trusted_state(announced, min_step=min_step)
        if not candidates:
            return None
        addresses = await presence_addresses(self.node.dht)
        stored = {e.digest for e in self.store.entries()}
        for announcement, writers in candidates:
            limit = self.size_limit(lone=support_of(announced, writers) < 2)
            writers = [w for w in writers if not self.book.refused(w, announced[w].announcement)]
            if announcement.digest in stored or not writers:
                continue
            if credible is not None and announcement.step > credible:
                # not refused: the progress we read may merely lag behind a fresh step
                if _first_time(self._ahead, announcement.digest):
                    self.log.info(
                        "not (yet) storing the state of step %d: the training peers are at step %d",
                        announcement.step,
                        credible,
                    )
                continue
            if survivor is not None and not survivor.peers & set(writers):
                # nobody of the surviving collaboration vouches for it: a losing fork's, or a state whose
                # holders left it (not refused: the same writers may join the survivor and announce again)
                if _first_time(self._foreign, announcement.digest):
                    self.log.info(
                        "not storing the state of step %d: none of its %d announcer(s) is in the surviving "
                        "collaboration (step %d, %d users)",
                        announcement.step,
                        len(writers),
                        survivor.top,
                        survivor.support,
                    )
                continue
            if announcement.nbytes > limit:
                for writer in writers:
                    self.book.refuse(
                        writer, announcement, f"{announcement.nbytes} bytes, above the limit of {limit}"
                    )
                continue
            # sources cooling down after failures are skipped here, quietly: their failure was logged
            usable = [w for w in writers if self.book.usable(w)]
            sources = [(a, announcement) for w in usable for a in self._addresses(w, addresses)]
            if not sources:
                self.log.debug("no usable source for the state of step %d", announcement.step)
                continue
            entry = await self._fetch_and_store(announcement, sources, writers, announced, limit)
            if entry is not None:
                return entry
        return None

    def _addresses(self, writer: str, present: dict[str, list[PeerAddress]]) -> list[PeerAddress]:
        """Where to fetch ``writer``'s state: the addresses it advertises, or for a client-mode peer (none
        advertised) a lane it dials back over its own connection to us (:mod:`protocols.reversal`)."""
        if present.get(writer):
            return present[writer]
        peer = PeerId(writer)
        return [PeerAddress.dial_back(peer)] if self.node.host.channel_for(peer) is not None else []

    async def _view(self) -> CollabView:
        """The collaboration as a newcomer sees it (:func:`shared.progress.summarize`: a lone claim far
        ahead of the others is not credible; with several collaborations, the survivor's step and peers).
        ``peers <= 1`` means nobody is training (then the lone peer's state is the run's, as in
        :mod:`shared.state.trust`)."""
        records, users = await read_progress_with_users(self.node.dht, self.scope.keys.progress)
        nobody = Progress(step=0, samples=0, samples_per_second=0.0, time=time.time())
        return summarize(
            records,
            self.node.peer_id,
            nobody,
            now=time.time(),
            target_batch=self.spec.target_batch,
            anchored=False,
            users=users,
        )

    async def _discard_forks(self, survivor: Collaboration | None) -> None:
        """Forget stored checkpoints ahead of a surviving collaboration of two or more users, once two
        polls in a row saw them there (see "Forks" in the module docstring)."""
        ahead = (
            {e.digest for e in self.store.entries() if e.step > survivor.top}
            if survivor is not None and survivor.support >= 2
            else set()
        )
        confirmed, self._fork_suspects = ahead & self._fork_suspects, ahead
        for entry in [e for e in self.store.entries() if e.digest in confirmed]:
            assert survivor is not None
            try:
                await trio.to_thread.run_sync(self.store.discard, entry.digest, limiter=STATE_IO)
            except OSError as exc:
                self.log.error("could not discard the checkpoint of step %d: %r", entry.step, exc)
                continue
            self.log.warning(
                "discarded the checkpoint of step %d (%s…): the surviving collaboration (%d users) is at "
                "step %d, so it was a fork's",
                entry.step,
                entry.digest.hex()[:12],
                survivor.support,
                survivor.top,
            )
            self.changed.set()

    def size_limit(self, *, lone: bool = True) -> int:
        """The largest state accepted now, free disk aside (:func:`~shared.state.checkpoint_size_limit`).

        Args:
            lone: the state has the support of one user only. The growth rule binds such states; a state
                two or more users vouch for is bounded by the configured maximum alone, so that kept
                checkpoints of another model (a reused data dir) or a poisoned small first checkpoint
                cannot block the run's checkpoints for good.
        """
        kept = [e.nbytes for e in self.store.entries()] if lone else []
        return checkpoint_size_limit(self.limits.max_state_bytes, kept, free_disk=1 << 62, reserve=0)

    async def _fetch_and_store(
        self,
        announcement: StateAnnouncement,
        sources: list[tuple[PeerAddress, StateAnnouncement]],
        writers: list[str],
        announced: dict[str, Announced],
        limit: int,
    ) -> CheckpointEntry | None:
        prefix = announcement.digest.hex()[:12]
        free = await trio.to_thread.run_sync(_free_bytes, self.store.directory, limiter=STATE_IO)
        if announcement.nbytes > free - self.limits.disk_reserve:
            if _first_time(self._short_of_disk, announcement.digest):
                self.log.error(
                    "no disk for the state of step %d (%d bytes; %d free, %d kept in reserve)",
                    announcement.step,
                    announcement.nbytes,
                    free,
                    self.limits.disk_reserve,
                )
            return None
        path: Path | None = None
        try:
            path = await fetch_state_file(
                self.node.host,
                sources,
                max_bytes=limit,
                directory=self.store.directory / "partial",
                book=self.book,
            )
            metadata = await trio.to_thread.run_sync(read_metadata, path, limiter=STATE_IO)
            step = state_step(metadata)
            if step != announcement.step:
                raise StateError(f"announced as step {announcement.step}, its header says {step}")
            check_scope(metadata, self.scope)  # never another stage's state (module docstring)
            entry = await trio.to_thread.run_sync(
                self.store.save_file, path, announcement.digest, step, limiter=STATE_IO
            )
        except StateError as exc:  # the state itself is bad: whoever announces it is not believed again
            for writer in writers:
                self.book.refuse(writer, announced[writer].announcement, f"state {prefix}: {exc}")
            return None
        except StateUnavailable as exc:  # each source's failure is in the book
            self.log.info("could not download the state of step %d: %s", announcement.step, exc)
            return None
        except _CANDIDATE_FAILURES as exc:
            self.log.error("could not store the state of step %d (%s): %r", announcement.step, prefix, exc)
            return None
        finally:
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # still there unless it was moved into the store
        self.log.info("stored checkpoint of step %d (%.1f MB, %s…)", step, entry.nbytes / 1e6, prefix)
        self.changed.set()
        return entry


def _first_time(seen: set[bytes], digest: bytes) -> bool:
    """Whether ``digest`` is new to ``seen`` (then remembered; bounded: strangers choose digests)."""
    if digest in seen:
        return False
    if len(seen) >= _MAX_REMEMBERED:
        seen.clear()
    seen.add(digest)
    return True


def _free_bytes(directory: Path) -> int:
    return free_bytes(directory)


async def keep_checkpoints(
    node: Node,
    server: StateServer,
    store: CheckpointStore,
    spec: TrainingSpec,
    *,
    limits: CheckpointLimits | None = None,
    scope: CheckpointScope | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve, announce and collect ``scope``'s checkpoints (default: the run's) until cancelled (see the
    module docstring)."""
    checkpointer = Checkpointer(node, server, store, spec, limits, scope)
    newest = store.newest()
    if newest is not None:
        checkpointer.log.info(
            "serving checkpoint of step %d (%.1f MB, %s…)",
            newest.step,
            newest.nbytes / 1e6,
            newest.digest.hex()[:12],
        )
    async with trio.open_nursery() as nursery:
        checkpointer.sync_offers()
        nursery.start_soon(checkpointer.announce_forever)
        task_status.started()
        while True:
            try:
                await checkpointer.poll_once()
            except CALL_FAILURES as exc:
                checkpointer.node.tolerated.note("checkpoint.poll", exc)  # counted in the node's status
            await trio.sleep(POLL_PERIOD)


async def keep_scoped_checkpoints(
    node: Node,
    server: StateServer,
    stores: Sequence[tuple[CheckpointScope, CheckpointStore]],
    spec: TrainingSpec,
    *,
    limits: CheckpointLimits | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """:func:`keep_checkpoints` for each ``(scope, store)`` of :func:`open_stores` (a swarm run: one per
    stage), all through ``server``; started once every one serves its stored checkpoints."""
    async with trio.open_nursery() as nursery:
        for scope, store in stores:
            await nursery.start(
                functools.partial(keep_checkpoints, limits=limits, scope=scope), node, server, store, spec
            )
        task_status.started()
