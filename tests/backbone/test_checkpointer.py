"""The backbone collects, stores, serves and announces checkpoints through a real DHT and bulk lane."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import trio

from backbone.checkpointer import Checkpointer, CheckpointLimits, keep_checkpoints
from backbone.checkpoints import DISCARDED_DIR, CheckpointStore
from protocols.presence import PRESENCE_KEY, PRESENCE_TTL, Presence
from protocols.training import PROGRESS_KEY, PROGRESS_TTL, Progress, StateAnnouncement, TrainingSpec
from shared.auth.keys import Identity
from shared.net.addresses import parse_multiaddr
from shared.node import Node, open_node
from shared.state.blob import encode_state, read_metadata, state_digest, state_step
from shared.state.limits import STATE_GROWTH
from shared.state.transfer import (
    StateServer,
    announce_state,
    fetch_state,
    presence_addresses,
    read_announcements,
    trusted_state,
)

#: The largest state the tests expect.
LIMIT = 1 << 24
RUN = "ckpt-test"


def blob_of(step: int) -> bytes:
    tensors = {"model/w": np.full(5000, step, dtype=np.float32), "optim/m": np.zeros(100, np.float32)}
    return encode_state(tensors, {"step": str(step), "run_id": RUN, "task": "tiny-mlm"})


async def start_node(
    nursery: trio.Nursery, role: str, initial: Node | None = None, *, client_mode: bool = False
) -> Node:
    async def run(task_status: trio.TaskStatus[Node]) -> None:
        async with open_node(
            Identity.generate(),
            RUN,
            role,  # type: ignore[arg-type]
            listen=[] if client_mode else ["/ip4/127.0.0.1/tcp/0"],
            initial_peers=[initial.host.listen_addrs[0]] if initial else [],
        ) as node:
            task_status.started(node)
            await trio.sleep_forever()

    node: Node = await nursery.start(run)
    presence = Presence(role=role, addrs=node.host.listen_addrs[:8])  # type: ignore[arg-type]
    await node.dht.store(
        PRESENCE_KEY,
        msgspec.msgpack.encode(presence),
        time.time() + PRESENCE_TTL,
        subkey=node.peer_id.encode(),
    )
    return node


async def volunteer_offering(nursery: trio.Nursery, backbone: Node, blob: bytes, step: int) -> StateServer:
    node = await start_node(nursery, "volunteer", backbone)
    server = StateServer(node.host)
    await announce_state(node.dht, server.offer(step, blob))
    return server


async def test_checkpointer_stores_the_trusted_state_once_due(nursery: trio.Nursery, tmp_path: Path) -> None:
    backbone = await start_node(nursery, "backbone")
    store = CheckpointStore(tmp_path / "checkpoints", keep=2)
    checkpointer = Checkpointer(backbone, StateServer(backbone.host, backbone=True), store, TrainingSpec())
    assert await checkpointer.poll_once() is None  # nobody announces anything

    honest = blob_of(10)
    servers = [await volunteer_offering(nursery, backbone, honest, 10) for _ in range(2)]
    liar = blob_of(11)
    liar_node = await start_node(nursery, "volunteer", backbone)
    await announce_state(liar_node.dht, StateServer(liar_node.host).offer(10, liar))  # same step, other state

    entry = await checkpointer.poll_once()

    assert entry is not None
    assert (entry.step, entry.digest) == (10, state_digest(honest))
    assert store.path(entry.digest).read_bytes() == honest
    assert sum(s.statistics().bytes_served for s in servers) == len(honest)

    # step 15 is not checkpoint_every (10) steps past 10: not fetched; step 20 is
    servers = [await volunteer_offering(nursery, backbone, blob_of(15), 15)]
    assert await checkpointer.poll_once() is None
    assert servers[0].statistics().bytes_served == 0
    await volunteer_offering(nursery, backbone, blob_of(20), 20)
    entry = await checkpointer.poll_once()
    assert entry is not None and entry.step == 20
    assert [e.step for e in store.entries()] == [10, 20]


async def test_a_state_only_client_mode_peers_hold_is_fetched_over_lanes_they_dial_back(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Issue 14: peers behind NAT advertise no address; the backbone still stores their state, over lanes
    they open to it on request, and never dials them."""
    backbone = await start_node(nursery, "backbone")
    store = CheckpointStore(tmp_path / "checkpoints", keep=2)
    checkpointer = Checkpointer(backbone, StateServer(backbone.host, backbone=True), store, TrainingSpec())
    blob = blob_of(12)
    hidden = [await start_node(nursery, "volunteer", backbone, client_mode=True) for _ in range(2)]
    servers = []
    for node in hidden:
        assert node.host.advertised_addrs == []
        servers.append(StateServer(node.host))
        await announce_state(node.dht, servers[-1].offer(12, blob))
    assert await presence_addresses(backbone.dht) == {
        backbone.peer_id: [*map(parse_multiaddr, backbone.host.listen_addrs)]
    }

    entry = await checkpointer.poll_once()

    assert entry is not None and (entry.step, entry.digest) == (12, state_digest(blob))
    assert store.path(entry.digest).read_bytes() == blob
    assert sum(s.statistics().bytes_served for s in servers) == len(blob)
    assert sum(n.host.statistics().dial_backs for n in hidden) >= 1
    assert backbone.host.statistics().reverse_lanes >= 1


async def test_keep_checkpoints_serves_and_announces_the_stored_checkpoint_after_a_restart(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    blob = blob_of(30)
    CheckpointStore(tmp_path, keep=3).save(blob, 30)  # stored by an earlier run of the backbone
    backbone = await start_node(nursery, "backbone")
    store = CheckpointStore(tmp_path, keep=3)
    await nursery.start(
        keep_checkpoints, backbone, StateServer(backbone.host, backbone=True), store, TrainingSpec()
    )
    newcomer = await start_node(nursery, "volunteer", backbone)

    with trio.fail_after(10):
        while backbone.peer_id not in (found := await read_announcements(newcomer.dht)):
            await trio.sleep(0.05)
    announcement = found[backbone.peer_id].announcement
    assert isinstance(announcement, StateAnnouncement)
    assert (announcement.step, announcement.digest, announcement.backbone) == (30, state_digest(blob), True)
    addresses = await presence_addresses(newcomer.dht)
    sources = [(a, announcement) for a in addresses[backbone.peer_id]]
    assert await fetch_state(newcomer.host, sources, max_bytes=LIMIT) == blob


async def test_keep_checkpoints_fetches_a_new_state_and_announces_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    backbone = await start_node(nursery, "backbone")
    store = CheckpointStore(tmp_path, keep=3)
    blob = blob_of(10)
    await volunteer_offering(nursery, backbone, blob, 10)
    await nursery.start(
        keep_checkpoints, backbone, StateServer(backbone.host, backbone=True), store, TrainingSpec()
    )

    with trio.fail_after(10):
        while store.newest() is None:
            await trio.sleep(0.05)
        while not (mine := (await read_announcements(backbone.dht)).get(backbone.peer_id)):
            await trio.sleep(0.05)
    own = mine.announcement
    assert (own.step, own.digest, own.backbone) == (10, state_digest(blob), True)


# ------------------------------------------------------------------ strangers' claims (issue 9, finding 2)


async def liar_announcing(
    nursery: trio.Nursery, backbone: Node, step: int, nbytes: int
) -> tuple[Node, StateServer]:
    """An admitted peer announcing a state of ``nbytes`` it does not have (its server counts requests)."""
    node = await start_node(nursery, "volunteer", backbone)
    server = StateServer(node.host)
    claim = StateAnnouncement(step=step, digest=bytes([step]) * 32, nbytes=nbytes, time=time.time())
    await announce_state(node.dht, claim)
    return node, server


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refusing the state announced by" in r.getMessage()]


async def test_keep_checkpoints_survives_a_2_to_the_40_announcement_and_stores_the_honest_state(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backbone = await start_node(nursery, "backbone")
    honest = blob_of(10)
    await volunteer_offering(nursery, backbone, honest, 10)
    # ranked first (a newer step): it once made the backbone allocate bytearray(2**40) and exit
    liar, liar_server = await liar_announcing(nursery, backbone, 20, 1 << 40)
    store = CheckpointStore(tmp_path, keep=3)

    with caplog.at_level(logging.INFO):
        await nursery.start(
            keep_checkpoints, backbone, StateServer(backbone.host, backbone=True), store, TrainingSpec()
        )
        with trio.fail_after(20):
            while store.newest() is None:
                await trio.sleep(0.05)

    newest = store.newest()
    assert newest is not None and (newest.step, newest.digest) == (10, state_digest(honest))
    assert liar_server.statistics().refused == 0  # refused before a single request
    assert len(refusals(caplog)) == 1 and liar.peer_id in refusals(caplog)[0]


async def test_checkpointer_refuses_bad_claims_once_and_goes_on_to_the_honest_state(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backbone = await start_node(nursery, "backbone")
    store = CheckpointStore(tmp_path, keep=3)
    limits = CheckpointLimits(max_state_bytes=1 << 30, disk_reserve=0)
    checkpointer = Checkpointer(
        backbone, StateServer(backbone.host, backbone=True), store, TrainingSpec(), limits
    )
    await volunteer_offering(nursery, backbone, blob_of(10), 10)
    first = await checkpointer.poll_once()
    assert first is not None and first.step == 10

    # newer than the honest state, so tried first: far above what the kept checkpoint allows to grow to
    # (within the configured maximum), and a blob that hashes right but is not a state
    _, liar_server = await liar_announcing(nursery, backbone, 30, STATE_GROWTH * first.nbytes + 1)
    garbage = await volunteer_offering(nursery, backbone, b"not a state " * 100, 30)
    honest = await volunteer_offering(nursery, backbone, blob_of(20), 20)
    with caplog.at_level(logging.WARNING):
        entry = await checkpointer.poll_once()
        assert entry is not None and entry.step == 20
        assert honest.statistics().bytes_served == entry.nbytes
        assert len(refusals(caplog)) == 2
        # the next polls see the same (long-lived) records and try neither again
        assert await checkpointer.poll_once() is None
        assert await checkpointer.poll_once() is None
    assert len(refusals(caplog)) == 2
    assert checkpointer.book.statistics().refused == 2
    assert liar_server.statistics().refused == 0
    assert garbage.statistics().chunks_served == 1  # fetched once, refused, never again
    assert [e.step for e in store.entries()] == [10, 20]

    # the growth rule binds lone claims only: a larger state that two users vouch for is stored (old
    # checkpoints of a smaller model, or a poisoned small first one, cannot block the run for good)
    large = encode_state(
        {"model/w": np.ones(5 * STATE_GROWTH * 5000, np.float32)}, {"step": "40", "run_id": RUN, "task": "t"}
    )
    assert len(large) > STATE_GROWTH * max(e.nbytes for e in store.entries())
    lone = await volunteer_offering(nursery, backbone, large, 40)
    assert await checkpointer.poll_once() is None
    assert lone.statistics().bytes_served == 0
    await volunteer_offering(nursery, backbone, large, 40)
    entry = await checkpointer.poll_once()
    assert entry is not None and (entry.step, entry.nbytes) == (40, len(large))

    # a disk that cannot take a state: refused without a download, and the checkpointer goes on
    tight = Checkpointer(
        backbone,
        StateServer(backbone.host, backbone=True),
        CheckpointStore(tmp_path / "other"),
        TrainingSpec(),
        CheckpointLimits(disk_reserve=1 << 62),
    )
    assert await tight.poll_once() is None
    assert honest.statistics().bytes_served == len(blob_of(20))


async def publish_progress(node: Node, step: int) -> None:
    progress = Progress(step=step, samples=1, samples_per_second=10.0, time=time.time())
    value = msgspec.msgpack.encode(progress)
    await node.dht.store(PROGRESS_KEY, value, time.time() + PROGRESS_TTL, subkey=node.peer_id.encode())


async def test_checkpointer_does_not_store_a_lone_state_far_ahead_of_the_training_peers(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # finding 8 without made-up identities: a newer step ranks first, so one admitted peer announcing a
    # well-formed state of step 500 (and progress to match) was stored as the run's newest checkpoint
    backbone = await start_node(nursery, "backbone")
    store = CheckpointStore(tmp_path, keep=3)
    checkpointer = Checkpointer(backbone, StateServer(backbone.host, backbone=True), store, TrainingSpec())
    honest = [await start_node(nursery, "volunteer", backbone) for _ in range(2)]
    liar = await start_node(nursery, "volunteer", backbone)
    for node, step in [(honest[0], 10), (honest[1], 10), (liar, 500)]:
        await announce_state(node.dht, StateServer(node.host).offer(step, blob_of(step)))
        await publish_progress(node, step)

    entry = await checkpointer.poll_once()

    assert entry is not None and entry.step == 10
    assert await checkpointer.poll_once() is None  # and not later either, while the others are at 10
    assert [e.step for e in store.entries()] == [10]


async def test_read_announcements_counts_the_users_behind_the_writers(nursery: trio.Nursery) -> None:
    # finding 8: three identities of one user announce another state of the step two users agree on
    backbone = await start_node(nursery, "backbone")
    honest, forged = blob_of(10), blob_of(11)
    nodes = [await start_node(nursery, "volunteer", backbone) for _ in range(5)]
    for node, blob in zip(nodes, [honest, honest, forged, forged, forged], strict=True):
        await announce_state(node.dht, StateServer(node.host).offer(10, blob))
    users = {nodes[0].peer_id: "alice", nodes[1].peer_id: "bob"} | {n.peer_id: "mallory" for n in nodes[2:]}

    by_writer = trusted_state(await read_announcements(backbone.dht))  # an open run: writers stand alone
    by_user = trusted_state(await read_announcements(backbone.dht, users=users))

    assert by_writer[0][0].digest == state_digest(forged)
    assert by_user[0][0].digest == state_digest(honest)
    assert sorted(by_user[0][1]) == sorted(n.peer_id for n in nodes[:2])


# ------------------------------------------------------------------ forks (issue 10: no lone forks)


async def training_peer(nursery: trio.Nursery, backbone: Node, step: int, blob: bytes | None = None) -> Node:
    """A volunteer at ``step`` that announces ``blob`` (the state of ``step`` unless given) as its state."""
    node = await start_node(nursery, "volunteer", backbone)
    announced = blob if blob is not None else blob_of(step)
    await announce_state(node.dht, StateServer(node.host).offer(state_step_of(announced), announced))
    progress = Progress(step=step, samples=1, samples_per_second=10.0, time=time.time(), params=b"f")
    value = msgspec.msgpack.encode(progress)
    await node.dht.store(PROGRESS_KEY, value, time.time() + PROGRESS_TTL, subkey=node.peer_id.encode())
    return node


def state_step_of(blob: bytes) -> int:
    return state_step(read_metadata(blob))


async def test_checkpointer_stores_the_survivors_state_not_a_newer_fork_of_fewer_users(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Two collaborations, both credible on their own: 3 users at step 20 and a fork of 2 users at step 60
    (each pair backs the other up). The newer step once ranked first and was stored as the run's."""
    backbone = await start_node(nursery, "backbone")
    store = CheckpointStore(tmp_path, keep=3)
    checkpointer = Checkpointer(backbone, StateServer(backbone.host, backbone=True), store, TrainingSpec())
    for _ in range(3):
        await training_peer(nursery, backbone, 20)
    for _ in range(2):
        await training_peer(nursery, backbone, 60)

    entry = await checkpointer.poll_once()

    assert entry is not None and entry.step == 20
    assert await checkpointer.poll_once() is None
    assert [e.step for e in store.entries()] == [20]


async def test_checkpointer_discards_a_forks_checkpoints_once_the_survivor_is_seen_twice(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The backbone sat in the fork's half of a split DHT and stored the fork's states; once the halves
    meet, the survivor's states must be kept and announced, not pruned below the fork's higher steps."""
    store = CheckpointStore(tmp_path, keep=2)
    fork = [store.save(blob_of(step), step) for step in (500, 510)]
    backbone = await start_node(nursery, "backbone")
    checkpointer = Checkpointer(backbone, StateServer(backbone.host, backbone=True), store, TrainingSpec())
    for _ in range(2):
        await training_peer(nursery, backbone, 250)

    assert await checkpointer.poll_once() is None  # one poll is a moment's reading: nothing discarded yet
    assert [e.step for e in store.entries()] == [500, 510]
    entry = await checkpointer.poll_once()

    assert entry is not None and entry.step == 250
    assert [e.step for e in store.entries()] == [250]
    assert not any(store.path(e.digest).exists() for e in fork)
    aside = sorted(p.name for p in (tmp_path / DISCARDED_DIR).iterdir())  # set aside, not destroyed
    assert aside == sorted(store.path(e.digest).name for e in fork)
    assert [e.step for e in CheckpointStore(tmp_path, keep=2).entries()] == [250]  # and so after a restart
    assert checkpointer.sync_offers() is not None and checkpointer.sync_offers().step == 250  # type: ignore[union-attr]


async def test_checkpointer_keeps_its_checkpoints_when_only_one_user_is_behind_them(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(blob_of(500), 500)
    backbone = await start_node(nursery, "backbone")
    checkpointer = Checkpointer(backbone, StateServer(backbone.host, backbone=True), store, TrainingSpec())
    await training_peer(nursery, backbone, 20)
    for _ in range(3):
        await checkpointer.poll_once()
    assert [e.step for e in store.entries()] == [500]


async def test_checkpointer_does_not_store_a_losing_partitions_state_even_when_it_is_older(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # the survivor (3 users at 250) has announced nothing yet; a losing partition of 2 users at 60 has
    store = CheckpointStore(tmp_path, keep=3)
    backbone = await start_node(nursery, "backbone")
    checkpointer = Checkpointer(backbone, StateServer(backbone.host, backbone=True), store, TrainingSpec())
    survivors = [await start_node(nursery, "volunteer", backbone) for _ in range(3)]
    for node in survivors:
        await publish_progress(node, 250)
    for _ in range(2):
        await training_peer(nursery, backbone, 60)

    assert await checkpointer.poll_once() is None
    assert store.entries() == []
