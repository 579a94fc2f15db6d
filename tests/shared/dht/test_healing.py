"""The DHT heals after a restart (issue 10, item 1): saved contacts, rejoining, learning from every
authenticated message, and re-announcing to contacts that come back.

The end-to-end tests run real nodes on loopback in one trio run: a "backbone" is crashed (connections
reset, no LEAVE, no hand-off, nothing saved at exit: as SIGKILL) and started again with the same identity,
port and data dir. They wait on conditions under generous deadlines and only *log* how long healing took.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from protocols.dht import PingRequest
from protocols.probe import ReachRequest
from protocols.training import PROGRESS_KEY
from shared.auth.authority import Authority, pin_run_id
from shared.auth.guard import RunAuthenticator
from shared.auth.keys import Identity
from shared.dht.contacts import (
    CONTACTS_FILE,
    MAX_SAVED_CONTACTS,
    decode_contacts,
    encode_contacts,
    load_contacts,
    save_contacts,
)
from shared.dht.healing import ComebackDetector, ReannounceLimiter, is_replica_for
from shared.dht.keys import key_id, node_id_of
from shared.dht.node import DHTConfig, DHTNode
from shared.dht.routing import Contact
from shared.errors import AuthError, RemoteError
from shared.net.addresses import parse_multiaddr
from shared.net.host import Host, HostConfig
from shared.net.probe import ProbeService
from shared.node import open_node

logger = logging.getLogger(__name__)
RUN = "dht-heal"
FAST = HostConfig(dial_deadline=2.0, accept_deadline=2.0)
CONFIG = DHTConfig(rpc_deadline=2.0, leave_deadline=1.0, contacts_save_interval=0.2, rejoin_interval=0.5)
DEADLINE = 30.0  # generous: healing takes about a second on an idle machine


def contact(i: int) -> Contact:
    identity = Identity.generate()
    return Contact.of(identity.peer_id, (f"/ip4/127.0.0.{1 + i % 200}/tcp/{4000 + i}",))


# ---------------------------------------------------------------- contacts file


def test_contacts_file_round_trips_and_keeps_the_first_ones(tmp_path: Path) -> None:
    contacts = [contact(i) for i in range(MAX_SAVED_CONTACTS + 5)]
    path = tmp_path / CONTACTS_FILE
    save_contacts(path, contacts)
    assert load_contacts(path) == contacts[:MAX_SAVED_CONTACTS]
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [CONTACTS_FILE]  # no temporary file left behind


@given(st.binary(max_size=2048))
def test_contacts_decode_of_garbage_raises_value_error_only(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        decode_contacts(data)


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xff garbage",
        b"",
        b'{"version": 1, "contacts": ',  # truncated by a crash of some other writer
        b'{"version": 7, "contacts": []}',
        b"[" * 100_000,
        b" " * (2 * 1024 * 1024),
    ],
)
def test_contacts_load_ignores_a_corrupt_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / CONTACTS_FILE
    path.write_bytes(content)
    assert load_contacts(path) == []
    assert load_contacts(tmp_path / "missing.json") == []


def test_contacts_decode_skips_unusable_entries() -> None:
    good = contact(1)
    data = encode_contacts([good]).replace(
        b'"contacts":[', b'"contacts":[{"peer_id":"nonsense","addrs":["/ip4/1.2.3.4/tcp/1"]},7,'
    )
    assert decode_contacts(data) == [good]


# ---------------------------------------------------------------- pure healing rules


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.floats(0, 100)), max_size=60), st.floats(0.1, 30))
def test_reannounce_limiter_allows_one_per_peer_per_interval(
    events: list[tuple[str, float]], interval: float
) -> None:
    limiter = ReannounceLimiter(interval, max_peers=8)
    allowed: dict[str, list[float]] = {}
    for peer, now in sorted(events, key=lambda e: e[1]):
        if limiter.allow(peer, now):
            allowed.setdefault(peer, []).append(now)
    for times in allowed.values():
        assert all(b - a >= interval for a, b in itertools.pairwise(times))
    for peer, _ in events:
        assert peer in allowed  # the first request of every peer goes through


def test_reannounce_limiter_memory_is_bounded() -> None:
    limiter = ReannounceLimiter(60.0, max_peers=3)
    for i in range(100):
        assert limiter.allow(f"peer-{i}", 0.0)
    assert len(limiter) == 3
    assert not limiter.allow("peer-99", 1.0)


def test_comeback_only_on_a_new_connection_of_a_peer_heard_from_before() -> None:
    detector = ComebackDetector(max_peers=16)
    detector.connection_opened("a")
    assert not detector.authenticated("a")  # first contact ever: a newcomer, not a comeback
    assert not detector.authenticated("a")  # more messages on the same connection
    detector.connection_opened("a")  # it restarted and dialed us again
    assert detector.authenticated("a")
    assert not detector.authenticated("a")
    detector.connection_opened("b")
    assert detector.authenticated("b", known=True)  # in the routing table (e.g. saved contacts)
    detector.connection_opened("c")  # a stranger that never authenticates is never "heard from"
    detector.connection_opened("c")
    assert not detector.authenticated("c")


@given(st.integers(0, 2**20), st.lists(st.integers(0, 2**20), unique=True, max_size=30), st.integers(1, 8))
def test_is_replica_for_matches_sorting_by_distance(key: int, ids: list[int], replicas: int) -> None:
    if len(ids) < 2:
        return
    own, peer, known = ids[0], ids[1], ids[2:]
    ranked = sorted({own, peer, *known}, key=lambda n: n ^ key)
    assert is_replica_for(key, peer, own, known, replicas) == (peer in ranked[:replicas])


# ---------------------------------------------------------------- nodes on loopback


@dataclass
class Running:
    dht: DHTNode
    scope: trio.CancelScope

    def crash(self) -> None:
        self.dht.host.abort()
        self.scope.cancel()


async def run_node(
    nursery: trio.Nursery,
    identity: Identity,
    *,
    listen: str = "/ip4/127.0.0.1/tcp/0",
    initial: Sequence[str] = (),
    data_dir: Path | None = None,
) -> Running:
    async def run(task_status: trio.TaskStatus[Running]) -> None:
        with trio.CancelScope() as scope:
            async with open_node(
                identity,
                RUN,
                "volunteer",
                listen=[listen],
                initial_peers=initial,
                host_config=FAST,
                dht_config=CONFIG,
                data_dir=data_dir,
            ) as node:
                task_status.started(Running(node.dht, scope))
                await trio.sleep_forever()

    running: Running = await nursery.start(run)
    return running


async def until(condition: object, what: str) -> float:
    """Wait for ``condition()`` (polled); return the seconds it took."""
    assert callable(condition)
    started = trio.current_time()
    with trio.fail_after(DEADLINE):
        while not await condition():
            await trio.sleep(0.05)
    took = trio.current_time() - started
    logger.info("%s after %.2f s", what, took)
    return took


async def heal_after_backbone_restart(tmp_path: Path, *, keep_contacts: bool) -> None:
    """With ``keep_contacts`` the backbone joined through a volunteer and is restarted with no initial
    peers, so only its saved contacts can lead it back; without, its contacts file is garbage and only
    the volunteers, which joined through it, can find it again."""
    async with trio.open_nursery() as nursery:
        identity = Identity.generate()
        volunteers: list[Running] = []
        if keep_contacts:
            volunteers.append(await run_node(nursery, Identity.generate()))
        first = [volunteers[0].dht.host.listen_addrs[0]] if volunteers else []
        backbone = await run_node(nursery, identity, initial=first, data_dir=tmp_path)
        address = parse_multiaddr(backbone.dht.host.listen_addrs[0])
        through = first or [str(address)]
        while len(volunteers) < 3:
            volunteers.append(await run_node(nursery, Identity.generate(), initial=through))
        expiration = time.time() + 600
        for v in volunteers:
            await v.dht.store(PROGRESS_KEY, b"step 7", expiration, subkey=v.dht.host.peer_id.encode())
        writers = {v.dht.host.peer_id.encode() for v in volunteers}
        path = tmp_path / CONTACTS_FILE

        async def saved() -> bool:
            return {c.peer_id for c in load_contacts(path)} >= {v.dht.host.peer_id for v in volunteers}

        await until(saved, "the backbone saved its contacts")

        backbone.crash()
        if not keep_contacts:
            path.write_bytes(b"\x00garbage")
        restarted_at = trio.current_time()
        with trio.fail_after(DEADLINE):
            while True:  # the port is free again once the old listener is closed
                try:
                    restarted = await run_node(
                        nursery, identity, listen=f"/ip4/127.0.0.1/tcp/{address.port}", data_dir=tmp_path
                    )
                    break
                except OSError:
                    await trio.sleep(0.05)
        dht = restarted.dht

        async def knows_everyone() -> bool:
            return all(v.dht.node_id in dht.routing for v in volunteers)

        async def reads_progress() -> bool:
            with trio.move_on_after(5):
                found = await dht.get(PROGRESS_KEY, latest=True)
                return found is not None and set(found.entries) >= writers
            return False

        async def holds_progress() -> bool:  # the volunteers re-announced their records to it
            return {r.subkey for r in dht.storage.get(key_id(PROGRESS_KEY), time.time())} >= writers

        await until(knows_everyone, "the restarted backbone knows every live peer")
        await until(reads_progress, "a pre-restart record reads through it")
        await until(holds_progress, "it holds the re-announced records again")
        logger.warning(
            "healed %.2f s after the restart began (contacts kept: %s)",
            trio.current_time() - restarted_at,
            keep_contacts,
        )
        nursery.cancel_scope.cancel()


async def test_dht_heals_after_backbone_crash_and_restart_on_its_data_dir(tmp_path: Path) -> None:
    await heal_after_backbone_restart(tmp_path, keep_contacts=True)


async def test_dht_heals_after_backbone_restart_with_a_corrupt_contacts_file(tmp_path: Path) -> None:
    """The volunteers dial their initial peer again when it is missing from (or disconnected in) their
    small tables."""
    await heal_after_backbone_restart(tmp_path, keep_contacts=False)


async def test_dht_learns_sender_of_any_authenticated_request() -> None:
    async with trio.open_nursery() as nursery:
        server = await run_node(nursery, Identity.generate())
        ProbeService(server.dht.host)
        client = Host(Identity.generate(), RUN, FAST)
        await nursery.start(client.run, ["/ip4/127.0.0.1/tcp/0"])
        await client.call(parse_multiaddr(server.dht.host.listen_addrs[0]), ReachRequest(addrs=[]))
        assert node_id_of(client.peer_id) in server.dht.routing  # a probe, not a DHT request
        nursery.cancel_scope.cancel()


AUTHORITY = Authority(Identity.generate())
PINNED = pin_run_id("dht-heal-pinned", AUTHORITY)


async def test_dht_never_learns_from_requests_that_fail_authentication() -> None:
    def auth(identity: Identity, authority: Authority) -> RunAuthenticator:
        token = authority.issue_token(
            PINNED, "user", identity.peer_id, identity.public_key_bytes, time.time(), 3600
        )
        return RunAuthenticator(PINNED, AUTHORITY.key, identity, token)

    async with trio.open_nursery() as nursery:
        server_id = Identity.generate()
        host = Host(server_id, PINNED, FAST, auth(server_id, AUTHORITY))
        dht = DHTNode(host, CONFIG)
        await nursery.start(host.run, ["/ip4/127.0.0.1/tcp/0"])
        await nursery.start(dht.run)
        stranger_id = Identity.generate()
        stranger = Host(stranger_id, PINNED, FAST, auth(stranger_id, Authority(Identity.generate())))
        await nursery.start(stranger.run, ["/ip4/127.0.0.1/tcp/0"])
        with pytest.raises((AuthError, RemoteError)):
            await stranger.call(parse_multiaddr(host.listen_addrs[0]), PingRequest())
        assert node_id_of(stranger_id.peer_id) not in dht.routing
        nursery.cancel_scope.cancel()


async def test_dht_reannounces_to_a_contact_that_keeps_reconnecting_once_per_interval() -> None:
    async with trio.open_nursery() as nursery:
        holder = await run_node(nursery, Identity.generate())
        flapper = await run_node(nursery, Identity.generate(), initial=[holder.dht.host.listen_addrs[0]])
        await holder.dht.store("k", b"v", time.time() + 600)
        holder_address = parse_multiaddr(holder.dht.host.listen_addrs[0])
        for i in range(5):  # the flapper drops its connection and comes back, again and again
            holder.dht.host.disconnect(flapper.dht.host.peer_id)
            with trio.fail_after(DEADLINE):
                while holder.dht.host.channel_for(flapper.dht.host.peer_id) is not None:
                    await trio.sleep(0.01)
            await flapper.dht.host.call(holder_address, PingRequest())
            with trio.fail_after(DEADLINE):
                while i == 0 and holder.dht.statistics().reannounced_records < 1:
                    await trio.sleep(0.01)
        stats = holder.dht.statistics()
        assert stats.comebacks == 5
        assert stats.reannounces == 1  # CONFIG.reannounce_interval is 30 s
        nursery.cancel_scope.cancel()


async def test_dht_keeps_its_saved_contacts_while_none_of_them_answers(tmp_path: Path) -> None:
    """A node restarted while the others are down must not overwrite what it knew with an empty table."""
    path = tmp_path / CONTACTS_FILE
    dead = [contact(i) for i in range(3)]  # 127.0.0.x on ports nobody listens on
    save_contacts(path, dead)
    async with trio.open_nursery() as nursery:
        node = await run_node(nursery, Identity.generate(), data_dir=tmp_path)
        with trio.fail_after(DEADLINE):  # a few save intervals and rejoin attempts
            while node.dht.statistics().rpc_failures < 2 * len(dead):
                await trio.sleep(0.05)
        assert len(node.dht.routing) == 0
        assert load_contacts(path) == dead
        nursery.cancel_scope.cancel()


async def test_node_status_counts_the_failures_its_tasks_survive() -> None:
    async with (
        trio.open_nursery() as nursery,
        open_node(
            Identity.generate(),
            RUN,
            "volunteer",
            listen=["/ip4/127.0.0.1/tcp/0"],
            host_config=FAST,
            dht_config=CONFIG,
        ) as node,
    ):
        node.dht.routing.add_or_update(contact(1), time.time())  # nobody listens there
        nursery.start_soon(node.measure_latency_forever, 0.05)
        with trio.fail_after(DEADLINE):
            while node.status().tolerated.get("latency ping", 0) < 2:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
