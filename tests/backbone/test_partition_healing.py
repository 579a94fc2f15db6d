"""Partition healing (issue 10): two groups that each kept training while the DHT was split meet again and
become one collaboration -- in one process, with the real parts: DHT nodes on loopback, signed progress
records and state announcements, the merge rule in every peer's view (shared.progress / shared.merge), the
state-sync filter (shared.state.trust.usable_states), state transfer over the bulk lane, and a checkpointer
on each side's backbone.

The volunteers' training is stood in for by what it publishes (a step, a parameter fingerprint, a state
blob per step): the optimizer's wiring of these rules is exercised by the system soak once it is in place.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import trio

from backbone.checkpointer import Checkpointer
from backbone.checkpoints import CheckpointStore
from protocols.presence import PRESENCE_KEY, PRESENCE_TTL, Presence
from protocols.training import PROGRESS_KEY, PROGRESS_TTL, Progress, TrainingSpec
from shared.auth.keys import Identity
from shared.node import Node, open_node
from shared.progress import CollabView, summarize
from shared.progress_records import read_progress_with_users
from shared.state.blob import encode_state, state_digest
from shared.state.transfer import (
    StateServer,
    announce_state,
    fetch_state,
    presence_addresses,
    read_announcements,
    trusted_state,
)
from shared.state.trust import usable_states

RUN = "heal-test"
SPEC = TrainingSpec(target_batch=100)


def state(step: int, lineage: str) -> bytes:
    value = int.from_bytes(hashlib.sha256(f"{lineage}/{step}".encode()).digest()[:2], "little")
    tensors = {"model/w": np.full(2000, value, dtype=np.float32)}
    return encode_state(tensors, {"step": str(step), "run_id": RUN, "task": "tiny-mlm"})


async def start_node(nursery: trio.Nursery, role: str, initial: Node | None = None) -> Node:
    async def run(task_status: trio.TaskStatus[Node]) -> None:
        async with open_node(
            Identity.generate(),
            RUN,
            role,  # type: ignore[arg-type]
            listen=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=[initial.host.listen_addrs[0]] if initial is not None else [],
        ) as node:
            task_status.started(node)
            await trio.sleep_forever()

    node: Node = await nursery.start(run)
    return node


@dataclass
class Peer:
    """A volunteer's published face: its step, fingerprint and state, as its optimizer would publish."""

    node: Node
    server: StateServer
    step: int = 0
    blob: bytes = b""
    syncing: bool = False
    users: dict[str, str] = field(default_factory=dict)

    @property
    def fingerprint(self) -> bytes:
        return hashlib.blake2b(self.blob, digest_size=8).digest()

    async def hold(self, step: int, blob: bytes) -> None:
        self.step, self.blob = step, blob
        await announce_state(self.node.dht, self.server.offer(step, blob))
        await self.publish()

    async def publish(self) -> None:
        now = time.time()
        progress = Progress(
            step=self.step,
            samples=0,
            samples_per_second=10.0,
            time=now,
            params=self.fingerprint,
            syncing=self.syncing,
        )
        dht = self.node.dht
        await dht.store(PROGRESS_KEY, msgspec.msgpack.encode(progress), now + PROGRESS_TTL, subkey=self.key)
        presence = Presence(role="volunteer", addrs=self.node.host.listen_addrs[:8])
        await dht.store(PRESENCE_KEY, msgspec.msgpack.encode(presence), now + PRESENCE_TTL, subkey=self.key)

    @property
    def key(self) -> bytes:
        return self.node.peer_id.encode()

    async def view(self) -> CollabView:
        records, users = await read_progress_with_users(self.node.dht)
        mine = records.get(self.node.peer_id) or Progress(step=0, samples=0, samples_per_second=0, time=0)
        return summarize(
            records, self.node.peer_id, mine, now=time.time(), target_batch=SPEC.target_batch, users=users
        )

    async def resync(self, view: CollabView) -> None:
        """What the optimizer's state sync does for a peer in the minority (see the report to the lead)."""
        assert view.survivor is not None
        self.syncing = True
        await self.publish()
        announced = await read_announcements(self.node.dht)
        announced.pop(self.node.peer_id, None)
        usable = usable_states(
            trusted_state(announced),
            target=view.step,
            alone=view.peers <= 1,
            patient=True,
            survivor=view.survivor.peers,
        )
        assert usable, "the survivor's state is announced"
        announcement, writers = usable[0]
        addresses = await presence_addresses(self.node.dht)
        sources = [(a, announcement) for w in writers for a in addresses.get(w, [])]
        blob = await fetch_state(self.node.host, sources, max_bytes=1 << 24)
        self.syncing = False
        await self.hold(announcement.step, blob)


async def group(nursery: trio.Nursery, backbone: Node, size: int) -> list[Peer]:
    peers = []
    for _ in range(size):
        node = await start_node(nursery, "volunteer", backbone)
        peers.append(Peer(node, StateServer(node.host)))
    return peers


async def train(peers: list[Peer], lineage: str, stop: int) -> None:
    """The group has stepped together up to ``stop`` (each step's state is its lineage's; only the last one
    is published: nothing reads the ones between)."""
    blob = state(stop, lineage)
    for peer in peers:
        await peer.hold(stop, blob)


async def views_until(peers: list[Peer], done: object) -> dict[str, CollabView]:
    """Every peer's view, re-read (and re-published, as the publishers do every second) until ``done``."""
    with trio.fail_after(30):
        while True:
            views = {p.node.peer_id: await p.view() for p in peers}
            if done(views):  # type: ignore[operator]
                return views
            for peer in peers:
                await peer.publish()
            await trio.sleep(0.1)


async def test_two_partitions_that_trained_apart_meet_and_become_one_collaboration(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # ---- the split: two halves of the DHT, each with a backbone, that never met
    west_bb = await start_node(nursery, "backbone")
    east_bb = await start_node(nursery, "backbone")
    stores = {
        "west": CheckpointStore(tmp_path / "west", keep=3),
        "east": CheckpointStore(tmp_path / "east", keep=3),
    }
    checkpointers = {
        side: Checkpointer(bb, StateServer(bb.host, backbone=True), stores[side], SPEC)
        for side, bb in (("west", west_bb), ("east", east_bb))
    }
    west = await group(nursery, west_bb, 3)  # three users
    east = await group(nursery, east_bb, 2)  # two users, who went much further on their own
    await train(west, "west", 20)
    await train(east, "east", 60)
    assert (await checkpointers["west"].poll_once()).step == 20  # type: ignore[union-attr]
    assert (await checkpointers["east"].poll_once()).step == 60  # type: ignore[union-attr]
    for side in (west, east):  # each half sees one collaboration: itself
        views = await views_until(side, lambda v: all(x.collaborations == 1 for x in v.values()))
        assert not any(v.minority for v in views.values())

    # ---- the halves meet (the east backbone learns a west contact: what issue 10's DHT healing does)
    await east_bb.dht.bootstrap([west_bb.host.listen_addrs[0]])
    everyone = west + east

    def agreed(views: dict[str, CollabView]) -> bool:
        return all(v.collaborations == 2 for v in views.values())

    views = await views_until(everyone, agreed)
    # one rule, every reader: the west (three users) survives although the east is 40 steps ahead
    assert {v.step for v in views.values()} == {20}
    assert {p.node.peer_id for p in everyone if views[p.node.peer_id].minority} == {
        p.node.peer_id for p in east
    }

    # ---- the east's backbone drops the fork's checkpoint and keeps the survivor's
    with trio.fail_after(30):
        while (newest := stores["east"].newest()) is None or newest.step != 20:
            await checkpointers["east"].poll_once()
            for peer in everyone:
                await peer.publish()
    assert [e.step for e in stores["east"].entries()] == [20]
    assert newest.digest == state_digest(state(20, "west"))

    # ---- the minority re-syncs, down to step 20, to the west's state
    for peer in east:
        await peer.resync(views[peer.node.peer_id])
        assert peer.blob == state(20, "west")

    views = await views_until(everyone, lambda v: all(x.collaborations == 1 for x in v.values()))
    assert {v.step for v in views.values()} == {20}
    assert not any(v.minority or v.diverged for v in views.values())
    assert len({p.fingerprint for p in everyone}) == 1

    # ---- and they go on as one: the next step is taken by all five, and both backbones store it
    await train(everyone, "one", 30)
    views = await views_until(
        everyone, lambda v: all(x.step == 30 and x.peers_at_step == 5 for x in v.values())
    )
    for side in ("west", "east"):
        with trio.fail_after(30):
            while (newest := stores[side].newest()) is None or newest.step != 30:
                await checkpointers[side].poll_once()
        assert newest.digest == state_digest(state(30, "one"))
