"""Admission everywhere, on real pinned nodes (issue 9, findings 4 and 8): a storing node accepts records
only from admitted, unrevoked writers under their own subkeys, whoever relays them, and holds each writer
to its quota so that a flood cannot push out presence, progress or revocation records."""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import trio

from protocols.auth import REVOCATIONS_KEY, SignedToken
from protocols.dht import SignedRecord, StoreRequest, StoreResponse
from protocols.presence import PRESENCE_KEY
from protocols.training import PROGRESS_KEY
from shared.auth.authority import Authority, pin_run_id
from shared.auth.guard import RunAuthenticator
from shared.auth.keys import Identity
from shared.dht.keys import key_id
from shared.dht.node import DHTConfig
from shared.dht.records import sign_record
from shared.dht.storage import StoreLimits
from shared.net.addresses import parse_multiaddr
from shared.node import Node, open_node

AUTHORITY = Authority(Identity.generate())
RUN = pin_run_id("dht-admission", AUTHORITY)
SMALL = DHTConfig(rpc_deadline=5.0, leave_deadline=1.0, store=StoreLimits(max_records=24, owner_records=16))


def token_for(identity: Identity, user: str, authority: Authority = AUTHORITY) -> SignedToken:
    return authority.issue_token(RUN, user, identity.peer_id, identity.public_key_bytes, time.time(), 3600)


async def start(nursery: trio.Nursery, users: Sequence[str], config: DHTConfig = SMALL) -> list[Node]:
    """Admitted DHT nodes of RUN, one per user, each joining through the first."""
    nodes: list[Node] = []
    for user in users:

        async def run(task_status: trio.TaskStatus[Node], user: str = user) -> None:
            identity = Identity.generate()
            auth = RunAuthenticator(RUN, AUTHORITY.key, identity, token_for(identity, user))
            initial = [nodes[0].host.listen_addrs[0]] if nodes else []
            async with open_node(
                identity,
                RUN,
                "volunteer",
                listen=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=initial,
                dht_config=config,
                authenticator=auth,
            ) as node:
                task_status.started(node)
                await trio.sleep_forever()

        nodes.append(await nursery.start(run))
    return nodes


async def relay(via: Node, to: Node, records: list[SignedRecord]) -> list[bool]:
    """Have ``via`` (an admitted peer) hand ``records`` to ``to``, as a hand-off or re-publish would."""
    reply = await via.host.call(parse_multiaddr(to.host.listen_addrs[0]), StoreRequest(records=records))
    assert isinstance(reply, StoreResponse)
    return reply.accepted


def held_by(node: Node, writer: str) -> list[SignedRecord]:
    return [r for r in node.dht.storage.records() if r.writer == writer]


async def test_dht_pinned_node_stores_only_admitted_unrevoked_writers_under_their_own_subkeys() -> None:
    async with trio.open_nursery() as nursery:
        backbone, alice, bob = await start(nursery, ["backbone", "alice", "bob"])
        expiry = time.time() + 60
        stranger = Identity.generate()
        mine = alice.peer_id.encode()

        # an identity never admitted: no token, a token of another authority, or alice's token lent to it
        unadmitted = [
            sign_record(stranger, key_id("k"), b"v", expiry),
            sign_record(
                stranger,
                key_id("k"),
                b"v",
                expiry,
                token=token_for(stranger, "x", Authority(Identity.generate())),
            ),
            sign_record(stranger, key_id("k"), b"v", expiry, token=alice.host.authenticator.token),  # type: ignore[attr-defined]
        ]
        # an admitted writer, but under another peer's subkey (presence, progress, and a matchmaking key)
        alice_token = alice.host.authenticator.token  # type: ignore[attr-defined]
        foreign = [
            sign_record(
                alice.host.endpoint.identity, key_id(k), b"v", expiry, bob.peer_id.encode(), alice_token
            )
            for k in (PRESENCE_KEY, PROGRESS_KEY, "avg.1.")
        ]
        honest = sign_record(
            alice.host.endpoint.identity, key_id(PRESENCE_KEY), b"v", expiry, mine, alice_token
        )
        assert await relay(bob, backbone, [*unadmitted, *foreign, honest]) == [False] * 6 + [True]
        assert not held_by(backbone, stranger.peer_id)
        assert [r.subkey for r in held_by(backbone, alice.peer_id)] == [mine]
        assert backbone.dht.statistics().rejected_records == 6
        found = await bob.dht.get(PRESENCE_KEY, latest=True)
        assert found is not None and found.users == {mine: "alice"}  # majorities count users

        # once alice is revoked, her stored records are dropped and new ones refused, whoever relays them
        assert await bob.dht.store(PROGRESS_KEY, b"p", expiry, subkey=bob.peer_id.encode()) >= 1
        await alice.dht.store(PROGRESS_KEY, b"p", expiry, subkey=mine)
        with trio.fail_after(30):
            while len(held_by(backbone, alice.peer_id)) < 2:
                await trio.sleep(0.05)
        await backbone.publish_revocation("alice", AUTHORITY.revoke(RUN, "alice", time.time()))
        with trio.fail_after(30):
            while "alice" not in backbone.host.authenticator.revoked:  # type: ignore[attr-defined]
                await trio.sleep(0.05)
        assert not held_by(backbone, alice.peer_id)
        again = sign_record(
            alice.host.endpoint.identity, key_id(PROGRESS_KEY), b"q", expiry + 1, mine, alice_token
        )
        assert await relay(bob, backbone, [again]) == [False]
        assert held_by(backbone, bob.peer_id)  # bob's records are untouched
        with trio.fail_after(30):  # every node polls the revocations: bob forgets alice's records too
            while "alice" not in bob.host.authenticator.revoked:  # type: ignore[attr-defined]
                await trio.sleep(0.05)
        found = await bob.dht.get(PROGRESS_KEY, latest=True)
        assert found is not None and mine not in found.entries
        nursery.cancel_scope.cancel()


async def test_dht_flooding_writer_cannot_displace_presence_progress_or_revocations() -> None:
    async with trio.open_nursery() as nursery:
        backbone, alice, mallory, mallet = await start(nursery, ["backbone", "alice", "mallory", "mallet"])
        now = time.time()
        for node in (alice, mallory, mallet):
            mine = node.peer_id.encode()
            await node.dht.store(PRESENCE_KEY, b"here", now + 60, subkey=mine)
            await node.dht.store(PROGRESS_KEY, b"step", now + 30, subkey=mine)
        with trio.fail_after(30):
            while len(held_by(backbone, alice.peer_id)) < 2:
                await trio.sleep(0.05)
        honest = sorted((r.key, r.subkey) for r in held_by(backbone, alice.peer_id))

        # two admitted users each send 200 long-lived records: far more than a writer's quota (16) and,
        # together, more than the whole store (24): they end up sharing what the honest writer leaves
        accepted = 0
        for flooder in (mallory, mallet):
            identity, tok = flooder.host.endpoint.identity, flooder.host.authenticator.token  # type: ignore[attr-defined]
            for start_at in range(0, 200, 100):
                batch = [
                    sign_record(
                        identity, key_id(f"flood-{flooder.peer_id}-{i}"), b"x" * 100, now + 3600, token=tok
                    )
                    for i in range(start_at, start_at + 100)
                ]
                accepted += sum(await relay(flooder, backbone, batch))
        assert accepted <= 2 * 16
        assert backbone.dht.statistics().refused_records >= 400 - 2 * 16
        assert sorted((r.key, r.subkey) for r in held_by(backbone, alice.peer_id)) == honest
        assert backbone.dht.storage.charged[0] <= 24
        assert len(held_by(backbone, mallet.peer_id)) >= 8  # the second flooder got its fair share

        # the honest writer can still write, and the authority's revocation is stored whatever the load
        assert await alice.dht.store(PROGRESS_KEY, b"step 2", time.time() + 30, subkey=alice.peer_id.encode())
        assert await backbone.publish_revocation("mallory", AUTHORITY.revoke(RUN, "mallory", time.time()))
        assert backbone.dht.storage.get(key_id(REVOCATIONS_KEY), time.time())
        progress = backbone.dht.storage.get(key_id(PROGRESS_KEY), time.time())
        assert b"step 2" in [r.value for r in progress]

        # a user revoked by another path than the DHT (a backbone's ledger) loses its records too
        assert held_by(backbone, mallet.peer_id)
        backbone.host.authenticator.revoked.add("mallet")  # type: ignore[attr-defined]
        with trio.fail_after(30):
            while held_by(backbone, mallet.peer_id):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


def test_record_token_is_bounded_on_the_wire() -> None:
    identity = Identity.generate()
    record = sign_record(identity, key_id("k"), b"", time.time() + 60, token=token_for(identity, "u" * 64))
    assert len(msgspec.msgpack.encode(record)) < 1024
