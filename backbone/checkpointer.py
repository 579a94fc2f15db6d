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
"""

from __future__ import annotations

import contextlib
import logging

import trio

from protocols.training import StateAnnouncement, TrainingSpec
from shared.errors import ConfigError, StateError, StateUnavailable
from shared.net.addresses import PeerAddress
from shared.net.host import CALL_FAILURES
from shared.node import Node
from shared.state.blob import read_metadata, state_step
from shared.state.transfer import (
    ANNOUNCE_PERIOD,
    STATE_IO,
    StateServer,
    announce_state,
    fetch_state,
    presence_addresses,
    read_announcements,
    trusted_state,
)

from .checkpoints import CheckpointEntry, CheckpointStore

__all__ = ["POLL_PERIOD", "Checkpointer", "keep_checkpoints"]

logger = logging.getLogger("backbone.checkpoints")

#: Seconds between looks at the peers' state announcements.
POLL_PERIOD = 5.0


class Checkpointer:
    """Decides which announced state to store and keeps the server and the DHT in line with the store."""

    def __init__(self, node: Node, server: StateServer, store: CheckpointStore, spec: TrainingSpec) -> None:
        self.node = node
        self.server = server
        self.store = store
        self.spec = spec
        self.changed = trio.Event()  # set when the newest checkpoint changes (announce it at once)
        self._offered: set[bytes] = set()

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
                with contextlib.suppress(*CALL_FAILURES):
                    await announce_state(self.node.dht, newest)
            with trio.move_on_after(ANNOUNCE_PERIOD):
                await self.changed.wait()
            self.changed = trio.Event()

    async def poll_once(self) -> CheckpointEntry | None:
        """Store the most trusted announced state if it is due; return the new checkpoint, if any."""
        newest = self.store.newest()
        min_step = 0 if newest is None else newest.step + self.spec.checkpoint_every
        if newest is not None and 0 < self.spec.max_steps <= min_step and newest.step < self.spec.max_steps:
            min_step = self.spec.max_steps  # the run's final state is always kept
        announcements = await read_announcements(self.node.dht)
        announcements.pop(self.node.peer_id, None)
        candidates = trusted_state(announcements, min_step=min_step)
        if not candidates:
            return None
        addresses = await presence_addresses(self.node.dht)
        for announcement, writers in candidates:
            if any(e.digest == announcement.digest for e in self.store.entries()):
                continue
            sources = [(a, announcement) for w in writers for a in addresses.get(w, [])]
            if not sources:
                logger.debug("no reachable source for the state of step %d", announcement.step)
                continue
            entry = await self._fetch_and_store(announcement, sources)
            if entry is not None:
                return entry
        return None

    async def _fetch_and_store(
        self, announcement: StateAnnouncement, sources: list[tuple[PeerAddress, StateAnnouncement]]
    ) -> CheckpointEntry | None:
        prefix = announcement.digest.hex()[:12]
        try:
            blob = await fetch_state(self.node.host, sources, partial_dir=self.store.directory / "partial")
        except StateUnavailable as exc:
            logger.warning("could not download the state of step %d: %s", announcement.step, exc)
            return None
        except ConfigError as exc:  # the partial-download file cannot be written
            logger.error("cannot download checkpoints: %s", exc)
            return None
        try:
            step = state_step(read_metadata(blob))
        except StateError as exc:
            logger.warning("refusing the state of step %d (%s): %s", announcement.step, prefix, exc)
            return None
        if step != announcement.step:
            logger.warning(
                "refusing state %s: announced as step %d, its header says %d", prefix, announcement.step, step
            )
            return None
        try:
            entry = await trio.to_thread.run_sync(
                lambda: self.store.save(blob, step, digest=announcement.digest), limiter=STATE_IO
            )
        except OSError as exc:
            logger.error("could not store the checkpoint of step %d: %s", step, exc)
            return None
        logger.info("stored checkpoint of step %d (%.1f MB, %s…)", step, entry.nbytes / 1e6, prefix)
        self.changed.set()
        return entry


async def keep_checkpoints(
    node: Node,
    server: StateServer,
    store: CheckpointStore,
    spec: TrainingSpec,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve, announce and collect checkpoints until cancelled (see the module docstring)."""
    checkpointer = Checkpointer(node, server, store, spec)
    newest = store.newest()
    if newest is not None:
        logger.info(
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
            with contextlib.suppress(*CALL_FAILURES):
                await checkpointer.poll_once()
            await trio.sleep(POLL_PERIOD)
