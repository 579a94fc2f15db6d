"""Limits before work (issue 9, findings 3 and 12b): budgets before the identity proof, per source address,
idle reaping of every kind of connection, and which addresses a host believes and dials."""

from __future__ import annotations

import socket
from collections.abc import Awaitable

import msgspec
import pytest
import trio
import trio.testing

from protocols.bulk import BulkHeader
from protocols.dht import PingRequest, PingResponse, SignedRecord, StoreRequest, StoreResponse
from protocols.envelope import (
    FRAME_HEADER,
    HANDSHAKE_FRAME_BYTES,
    INLINE_DECODE_BYTES,
    PROTOCOL_VERSION,
    Envelope,
    encode_payload,
)
from protocols.handshake import ServerHello
from protocols.peer_id import PeerId
from shared.auth.keys import Identity
from shared.errors import Overloaded, PeerIdMismatch, PeerUnavailable
from shared.net.addresses import PeerAddress
from shared.net.bulk import BulkReader
from shared.net.connection import DECODE_THREADS, LocalEndpoint, SecureConnection, parse_frame
from shared.net.host import Host, HostConfig, _budget_key
from shared.net.rpc import RequestContext
from shared.net.tls_socket import BufferedReceiver, TlsSocket, connect_tcp

from .conftest import RUN_ID, StartHost, address_of

HANG_GUARD_S = 10  # only a guard against hangs; no test depends on how long anything takes
PATIENT = 120.0  # a deadline the tests never reach: what is refused is refused by a budget, not a timer


async def _pong(ctx: RequestContext, request: PingRequest) -> PingResponse:
    return PingResponse()


async def _until(condition: object) -> None:
    while not condition():  # type: ignore[operator]
        await trio.sleep(0.01)


async def _pre_auth_connection(address: PeerAddress) -> SecureConnection:
    """TLS done, ServerHello read, no identity proof sent."""
    raw = await connect_tcp(address.host, address.port)
    tls = await TlsSocket.handshake(
        raw, LocalEndpoint(Identity.generate(), RUN_ID).client_ctx, server_side=False, peer="server"
    )
    conn = SecureConnection(tls, BufferedReceiver(tls), PeerId(""), (), "rpc", True, HANDSHAKE_FRAME_BYTES)
    await conn.receive_message(ServerHello)
    return conn


async def test_host_refuses_a_large_frame_before_the_identity_proof(start_host: StartHost) -> None:
    server = await start_host(HostConfig(accept_deadline=PATIENT))
    server.registry.add(PingRequest, _pong)
    with trio.fail_after(HANG_GUARD_S):
        conn = await _pre_auth_connection(address_of(server))
        try:
            await conn.send_frame(FRAME_HEADER.pack(HANDSHAKE_FRAME_BYTES + 1))  # far below the 4 MiB limit
            with pytest.raises((EOFError, PeerUnavailable)):
                await conn.receive_frame()  # closed at once, not after the handshake deadline
        finally:
            conn.close()
        await _until(lambda: server.statistics().handshakes_failed == 1)
        client = await start_host()
        assert await client.call(address_of(server), PingRequest()) == PingResponse()


async def _silent_tcp_from(source_ip: str, address: PeerAddress) -> trio.socket.SocketType:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    await sock.bind((source_ip, 0))
    await sock.connect((address.host, address.port))
    return sock


async def test_host_limits_pending_connections_per_address_so_others_still_get_in(
    start_host: StartHost,
) -> None:
    server = await start_host(
        HostConfig(max_incoming=4, max_pending_per_address=2, accept_deadline=PATIENT, dial_deadline=5)
    )
    server.registry.add(PingRequest, _pong)
    with trio.fail_after(HANG_GUARD_S):
        squatters = [await _silent_tcp_from("127.0.0.2", address_of(server)) for _ in range(4)]
        try:
            await _until(lambda: server.statistics().connections_refused == 2)
            assert server.statistics().pending_connections == 2
            client = await start_host()  # from 127.0.0.1: another address, with budget left
            assert await client.call(address_of(server), PingRequest()) == PingResponse()
        finally:
            for sock in squatters:
                sock.close()


async def test_host_limits_incoming_connections_per_address(start_host: StartHost) -> None:
    server = await start_host(HostConfig(max_incoming_per_address=2))
    server.registry.add(PingRequest, _pong)
    first, second, third = await start_host(), await start_host(), await start_host()
    with trio.fail_after(HANG_GUARD_S):
        await first.call(address_of(server), PingRequest())
        await second.call(address_of(server), PingRequest())
        with pytest.raises(PeerUnavailable):
            await third.call(address_of(server), PingRequest())
        assert server.statistics().connections_refused >= 1
        assert server.statistics().incoming_connections == 2


async def _sink(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
    await reader.discard()
    return b""


@pytest.mark.parametrize("side", ["receiver", "sender"])
async def test_host_reaps_idle_bulk_connections(start_host: StartHost, side: str) -> None:
    short, long_ = HostConfig(idle_timeout=0.2), HostConfig(idle_timeout=PATIENT)
    server = await start_host(short if side == "receiver" else long_)
    server.bulk_handlers["sink"] = _sink
    client = await start_host(short if side == "sender" else long_)
    with trio.fail_after(HANG_GUARD_S):
        await client.send_bulk(address_of(server), "sink", b"x" * 1000)
        if side == "receiver":  # the receiver closes the lane; the sender notices before reusing it
            await _until(lambda: server.statistics().incoming_connections == 0)
        else:  # the sender closes its pooled lane; the receiver sees the close
            await _until(lambda: client.statistics().idle_bulk_connections == 0)
            await _until(lambda: server.statistics().incoming_connections == 0)
        await client.send_bulk(address_of(server), "sink", b"y" * 1000)  # a fresh lane works


async def test_host_keeps_only_advertised_addresses_its_connection_vouches_for(start_host: StartHost) -> None:
    server = await start_host()
    seen: list[tuple[str, ...]] = []

    async def record(ctx: RequestContext, request: PingRequest) -> PingResponse:
        seen.append(ctx.listen_addrs)
        return PingResponse()

    server.registry.add(PingRequest, record)
    client = await start_host()
    honest = list(client.endpoint.listen_addrs)
    client.endpoint.listen_addrs += ["/ip4/203.0.113.9/tcp/22", "/dns4/victim.example/tcp/443"]
    with trio.fail_after(HANG_GUARD_S):
        await client.call(address_of(server), PingRequest())
    assert seen == [tuple(honest)]


async def test_host_does_not_redial_an_address_that_failed_the_identity_check(start_host: StartHost) -> None:
    server = await start_host()
    server.registry.add(PingRequest, _pong)
    client = await start_host()
    real = address_of(server)
    lie = real.with_peer(Identity.generate().peer_id)  # e.g. a DHT contact naming another peer id there
    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(PeerIdMismatch):
            await client.call(lie, PingRequest())
        with pytest.raises(PeerUnavailable, match="identity check"):
            await client.call(lie, PingRequest())
        assert client.statistics().dials_refused == 1
        assert await client.call(real, PingRequest()) == PingResponse()  # the peer really there is fine


async def test_host_backs_off_redialing_an_unreachable_target(start_host: StartHost) -> None:
    client = await start_host(HostConfig(redial_after_failure=PATIENT, dial_deadline=5))
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    nobody = PeerAddress("127.0.0.1", port)
    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(PeerUnavailable, match="cannot connect"):
            await client.call(nobody, PingRequest())
        with pytest.raises(PeerUnavailable, match="in a row"):
            await client.call(nobody, PingRequest())
    assert client.statistics().dials_refused == 1


async def test_a_bulk_dial_of_a_peer_back_from_a_restart_waits_out_a_short_backoff(
    nursery: trio.Nursery, start_host: StartHost
) -> None:
    """The churn test's fork: members that had dialed a restarting backbone in vain failed its round at once
    in their own back-off, although it was back. A bulk dial of a known peer waits out a back-off of at most
    ``bulk_backoff_wait``; an RPC, and a longer back-off, are refused at once as before."""
    client = await start_host(HostConfig(redial_after_failure=0.5, bulk_backoff_wait=1.0, dial_deadline=5))
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    server = Host(Identity.generate(), RUN_ID, HostConfig(dial_deadline=5))
    server.bulk_handlers["sink"] = _sink
    back = PeerAddress("127.0.0.1", port, server.peer_id)
    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(PeerUnavailable, match="cannot connect"):  # it is down (restarting)
            await client.send_bulk(back, "sink", b"x" * 10)
        with pytest.raises(PeerUnavailable, match="in a row"):  # an RPC is refused at once, as before
            await client.call(back, PingRequest())
        await nursery.start(server.run, [f"/ip4/127.0.0.1/tcp/{port}"])  # it is back on its address
        await client.send_bulk(back, "sink", b"x" * 10)  # within the back-off: waited, then dialed
        assert client._dial_guard.backoff_left("127.0.0.1", port, trio.current_time()) == 0


async def test_a_long_backoff_still_refuses_a_bulk_dial_at_once(start_host: StartHost) -> None:
    client = await start_host(
        HostConfig(redial_after_failure=PATIENT, bulk_backoff_wait=1.0, dial_deadline=5)
    )
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    nobody = PeerAddress("127.0.0.1", port, PeerId(Identity.generate().peer_id))
    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(PeerUnavailable, match="cannot connect"):
            await client.send_bulk(nobody, "sink", b"x")
        with pytest.raises(PeerUnavailable, match="in a row"):
            await client.send_bulk(nobody, "sink", b"x")


def test_host_config_budgets_have_sane_defaults() -> None:
    config = HostConfig()
    assert config.max_pending_per_address < config.max_pending < config.max_incoming
    assert config.max_incoming_per_address < config.max_incoming


async def test_host_statistics_count_nothing_on_a_quiet_host(start_host: StartHost) -> None:
    host: Host = await start_host()
    stats = host.statistics()
    assert (stats.incoming_connections, stats.pending_connections, stats.connections_refused) == (0, 0, 0)


async def test_large_frames_are_decoded_in_a_worker_thread_and_small_ones_inline() -> None:
    """How decoding stays off the loop: a frame above INLINE_DECODE_BYTES waits for a decode thread
    (here: while every token of the limiter is held, it cannot proceed); a small one never does."""
    small = _ping_body()
    large = _ping_body(pad=INLINE_DECODE_BYTES)
    tokens = [(object(), i) for i in range(int(DECODE_THREADS.total_tokens))]
    for token in tokens:
        DECODE_THREADS.acquire_on_behalf_of_nowait(token)
    decoded: list[Envelope] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_append, decoded, parse_frame(large))
            assert (await parse_frame(small)).kind == PingRequest.kind  # inline, no thread needed
            await trio.testing.wait_all_tasks_blocked()
            assert decoded == []  # the large frame waits for a decode thread
            while tokens:
                DECODE_THREADS.release_on_behalf_of(tokens.pop())
    finally:
        for token in tokens:  # only if the test failed before giving them back
            DECODE_THREADS.release_on_behalf_of(token)
    assert [envelope.kind for envelope in decoded] == [PingRequest.kind]


def _ping_body(pad: int = 0) -> bytes:
    payload = msgspec.msgpack.encode({"pad": b"x" * pad}) if pad else encode_payload(PingRequest())
    return msgspec.msgpack.encode(Envelope(PROTOCOL_VERSION, PingRequest.kind, 1, 0, msgspec.Raw(payload)))


async def _append(into: list[Envelope], pending: Awaitable[Envelope]) -> None:
    into.append(await pending)


@pytest.mark.parametrize(
    ("source", "key"),
    [
        ("198.51.100.7", "198.51.100.7"),
        ("::ffff:198.51.100.7", "198.51.100.7"),  # a dual-stack listener sees IPv4 peers like this
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),  # the same subscriber's /64 shares one budget
    ],
)
def test_per_address_budgets_count_ipv4_addresses_and_ipv6_prefixes(source: str, key: str) -> None:
    assert _budget_key(source) == key


async def test_host_answers_overloaded_beyond_the_bytes_in_flight_per_connection(
    start_host: StartHost,
) -> None:
    server = await start_host(HostConfig(max_inflight_bytes=3000))
    release = trio.Event()
    entered: list[int] = []

    async def slow_store(ctx: RequestContext, request: StoreRequest) -> StoreResponse:
        entered.append(1)
        await release.wait()
        return StoreResponse(accepted=[True])

    server.registry.add(StoreRequest, slow_store)
    client = await start_host()
    record = SignedRecord(
        key=b"k" * 20,
        subkey=None,
        value=b"v" * 1000,
        expiration=1e9,
        writer=client.peer_id,
        signature=b"s" * 64,
    )
    outcomes: list[object] = []

    async def store() -> None:
        try:
            outcomes.append(await client.call(address_of(server), StoreRequest(records=[record])))
        except Overloaded as exc:
            outcomes.append(exc)
            if len(outcomes) == 2:
                release.set()

    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            for _ in range(4):  # ~1.2 kB frames: two fit in 3000 bytes, the other two do not
                nursery.start_soon(store)
        assert sum(isinstance(o, Overloaded) for o in outcomes) == 2
        assert len(entered) == 2
        assert await client.call(address_of(server), StoreRequest(records=[record])) == StoreResponse(
            accepted=[True]
        )  # the budget was given back
