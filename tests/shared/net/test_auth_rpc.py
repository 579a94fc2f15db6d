"""Every RPC of a pinned run is authenticated: each rejection case of protocols.auth, on a generic RPC,
on the bulk lane and on DHT RPCs; each with its own code and log line, and the node keeps serving."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import pytest
import trio

from protocols.auth import SignedToken
from protocols.codes import ErrorCode
from protocols.dht import FindValueRequest, PingRequest, PingResponse
from shared.auth.authority import Authority, pin_run_id
from shared.auth.guard import Authenticator, OpenAuthenticator, RunAuthenticator, Verified
from shared.auth.keys import Identity
from shared.dht.keys import key_id
from shared.errors import AccessDenied, AuthError, PeerUnavailable, RecordRejected
from shared.net.host import Host, HostConfig
from shared.net.rpc import RequestContext
from shared.node import Node, open_node

from .conftest import address_of

AUTHORITY = Authority(Identity.generate())
RUN = pin_run_id("authtest", AUTHORITY)


def token_for(
    identity: Identity,
    username: str = "alice",
    *,
    run: str = RUN,
    authority: Authority = AUTHORITY,
    lifetime: float = 3600,
    peer: str | None = None,
) -> SignedToken:
    return authority.issue_token(
        run, username, peer or identity.peer_id, identity.public_key_bytes, time.time(), lifetime
    )


def admitted(identity: Identity, username: str = "alice", **kw: object) -> RunAuthenticator:
    return RunAuthenticator(RUN, AUTHORITY.key, identity, token_for(identity, username), **kw)  # type: ignore[arg-type]


class Forged(RunAuthenticator):
    """An authenticator whose requests carry a deliberately broken part."""

    def __init__(
        self,
        identity: Identity,
        token: SignedToken,
        mutate: Callable[[bytes], bytes] | None = None,
        **kw: object,
    ) -> None:
        super().__init__(RUN, AUTHORITY.key, identity, None, **kw)  # type: ignore[arg-type]
        self._token = token  # bypass set_token's own-peer check: that is the point
        self._mutate = mutate

    def sign_request(self, receiver: str, kind: str, request_id: int, payload: bytes) -> tuple[bytes, bytes]:
        auth, nonce = super().sign_request(receiver, kind, request_id, payload)
        return (self._mutate(auth) if self._mutate else auth), nonce


def flip_signature(auth: bytes) -> bytes:
    from protocols.auth import RequestAuth

    decoded = msgspec.msgpack.decode(auth, type=RequestAuth)
    bad = bytes([decoded.signature[0] ^ 1]) + decoded.signature[1:]
    return msgspec.msgpack.encode(msgspec.structs.replace(decoded, signature=bad))


async def _pong(ctx: RequestContext, request: PingRequest) -> PingResponse:
    assert ctx.username == "alice"
    return PingResponse()


async def start(nursery: trio.Nursery, identity: Identity, auth: Authenticator) -> Host:
    host = Host(identity, RUN, HostConfig(dial_deadline=5), auth)
    host.registry.add(PingRequest, _pong)
    await nursery.start(host.run)
    return host


def case_other_authority(me: Identity) -> Authenticator:
    return Forged(me, token_for(me, authority=Authority(Identity.generate())))


def case_other_run(me: Identity) -> Authenticator:
    return Forged(me, token_for(me, run=pin_run_id("another-run", AUTHORITY)))


def case_expired(me: Identity) -> Authenticator:
    return Forged(me, token_for(me, lifetime=-1))


def case_someone_elses_token(me: Identity) -> Authenticator:
    return Forged(me, token_for(Identity.generate()))


def case_skewed_clock(me: Identity) -> Authenticator:
    return Forged(me, token_for(me), clock=lambda: time.time() + 3600)


def case_bad_signature(me: Identity) -> Authenticator:
    return Forged(me, token_for(me), flip_signature)


def case_no_credentials(me: Identity) -> Authenticator:
    return OpenAuthenticator()


@pytest.mark.parametrize(
    ("make_client", "code", "logged"),
    [
        (case_other_authority, ErrorCode.BAD_TOKEN, "not signed by this run's authority"),
        (case_other_run, ErrorCode.WRONG_RUN_TOKEN, "token of run another-run"),
        (case_expired, ErrorCode.TOKEN_EXPIRED, "expired"),
        (case_someone_elses_token, ErrorCode.TOKEN_PEER, "presented by"),
        (case_skewed_clock, ErrorCode.CLOCK_SKEW, "clock is"),
        (case_bad_signature, ErrorCode.BAD_SIGNATURE, "signature does not verify"),
        (case_no_credentials, ErrorCode.UNAUTHENTICATED, "carries no credentials"),
    ],
)
async def test_auth_rpc_rejects_each_bad_credential_with_its_own_code(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    make_client: Callable[[Identity], Authenticator],
    code: ErrorCode,
    logged: str,
) -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    server = await start(nursery, server_id, admitted(server_id, "server"))
    bad = await start(nursery, client_id, make_client(client_id))
    with caplog.at_level(logging.WARNING), pytest.raises(AccessDenied) as info:
        await bad.call(address_of(server), PingRequest())
    assert info.value.code == code
    assert logged in caplog.text
    good_id = Identity.generate()
    good = await start(nursery, good_id, admitted(good_id))
    assert isinstance(await good.call(address_of(server), PingRequest()), PingResponse)


async def test_auth_rpc_rejects_a_replayed_nonce(nursery: trio.Nursery) -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    server = await start(nursery, server_id, admitted(server_id, "server"))
    client = await start(nursery, client_id, admitted(client_id, nonce=lambda n: b"r" * n))
    await client.call(address_of(server), PingRequest())
    with pytest.raises(AccessDenied) as info:
        await client.call(address_of(server), PingRequest())
    assert info.value.code == ErrorCode.REPLAYED


async def test_auth_rpc_revocation_cuts_a_user_off_immediately(nursery: trio.Nursery) -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    server_auth = admitted(server_id, "server")
    server = await start(nursery, server_id, server_auth)
    client = await start(nursery, client_id, admitted(client_id))
    await client.call(address_of(server), PingRequest())
    server_auth.revoked.add("alice")
    with pytest.raises(AccessDenied) as info:
        await client.call(address_of(server), PingRequest())
    assert info.value.code == ErrorCode.REVOKED
    assert "alice" not in str(info.value)  # refusals are logged: who was removed is not every node's news


class AcceptAll(Forged):
    """An impostor: answers anyone, signing with a token that is not its own."""

    def check_request(self, sender: str, kind: str, request_id: int, payload: bytes, auth: bytes) -> Verified:
        from protocols.auth import RequestAuth

        return Verified("anyone", msgspec.msgpack.decode(auth, type=RequestAuth).nonce)


async def test_auth_rpc_client_refuses_an_answer_from_an_impostor(nursery: trio.Nursery) -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    impostor = Host(
        server_id, RUN, HostConfig(dial_deadline=5), AcceptAll(server_id, token_for(Identity.generate()))
    )

    async def answer(ctx: RequestContext, request: PingRequest) -> PingResponse:
        return PingResponse()

    impostor.registry.add(PingRequest, answer)
    await nursery.start(impostor.run)
    client = await start(nursery, client_id, admitted(client_id))
    with pytest.raises(AuthError) as info:
        await client.call(address_of(impostor), PingRequest())
    assert info.value.code == ErrorCode.TOKEN_PEER


async def test_auth_bulk_lane_refuses_unadmitted_senders(nursery: trio.Nursery) -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    server = await start(nursery, server_id, admitted(server_id, "server"))
    received: list[int] = []

    async def sink(ctx: RequestContext, header: object, reader: object) -> bytes:
        received.append(1)
        return b""

    server.bulk_handlers["sink"] = sink  # type: ignore[assignment]
    stranger = await start(nursery, client_id, OpenAuthenticator())
    with pytest.raises((AccessDenied, PeerUnavailable)):
        await stranger.send_bulk(address_of(server), "sink", b"x" * 1000)
    good_id = Identity.generate()
    good = await start(nursery, good_id, admitted(good_id))
    await good.send_bulk(address_of(server), "sink", b"y" * 1000)
    assert received == [1]


async def start_admitted(nursery: trio.Nursery, identities: list[Identity], users: list[str]) -> list[Node]:
    """Admitted DHT nodes of RUN, each joining through the first."""
    nodes: list[Node] = []
    for identity, user in zip(identities, users, strict=True):

        async def run(
            task_status: trio.TaskStatus[Node], identity: Identity = identity, user: str = user
        ) -> None:
            initial = [nodes[0].host.listen_addrs[0]] if nodes else []
            async with open_node(
                identity,
                RUN,
                "volunteer",
                listen=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=initial,
                authenticator=admitted(identity, user),
            ) as node:
                task_status.started(node)
                await trio.sleep_forever()

        nodes.append(await nursery.start(run))
    return nodes


async def test_auth_dht_admitted_nodes_work_together_and_a_stranger_can_do_nothing() -> None:
    ids = [Identity.generate() for _ in range(3)]
    async with trio.open_nursery() as nursery:
        nodes = await start_admitted(nursery, ids[:2], ["user0", "user1"])
        await nodes[0].dht.store("secret", b"v", time.time() + 60)
        found = await nodes[1].dht.get("secret")
        assert found is not None and found.value == b"v"

        stranger = Host(ids[2], RUN, HostConfig(dial_deadline=5), OpenAuthenticator())
        await nursery.start(stranger.run)
        target = address_of(nodes[0].host)
        for request in (FindValueRequest(key=key_id("secret")), PingRequest()):
            with pytest.raises(AccessDenied) as info:
                await stranger.call(target, request)
            assert info.value.code == ErrorCode.UNAUTHENTICATED
        with pytest.RaisesGroup(
            pytest.RaisesExc(PeerUnavailable, match="UNAUTHENTICATED"), flatten_subgroups=True
        ):
            async with open_node(
                ids[2],
                RUN,
                "volunteer",
                listen=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=[nodes[0].host.listen_addrs[0]],
            ):
                pass
        nursery.cancel_scope.cancel()


async def test_auth_revocation_spreads_through_the_dht_and_cuts_the_user_off() -> None:
    async with trio.open_nursery() as nursery:
        nodes = await start_admitted(
            nursery, [Identity.generate() for _ in range(3)], ["backbone", "alice", "bob"]
        )
        backbone, alice, bob = nodes
        await bob.host.call(address_of(alice.host), PingRequest())

        # a volunteer cannot forge a revocation: it is not the authority's
        forged = Authority(Identity.generate()).revoke(RUN, "alice", time.time())
        with pytest.raises(RecordRejected, match="not signed by this run's authority"):
            await bob.publish_revocation("alice", forged)

        await backbone.publish_revocation("bob", AUTHORITY.revoke(RUN, "bob", time.time()))
        with trio.fail_after(15):
            while "bob" not in alice.host.authenticator.revoked:  # type: ignore[attr-defined]
                await trio.sleep(0.1)
        with pytest.raises(AccessDenied) as info:
            await bob.host.call(address_of(alice.host), PingRequest())
        assert info.value.code == ErrorCode.REVOKED
        assert "alice" not in alice.host.authenticator.revoked  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()
