"""Connection reversal (protocols.reversal): a reachable host runs bulk transfers to a client-mode host over
lanes the client-mode host dials back, and refuses everything the rules refuse."""

from __future__ import annotations

import hashlib
import random

import pytest
import trio

from protocols.bulk import BulkHeader
from shared.auth.keys import Identity
from shared.errors import PeerUnavailable
from shared.net.addresses import PeerAddress
from shared.net.bulk import BulkReader
from shared.net.host import Host, HostConfig
from shared.net.rpc import RequestContext

from .conftest import RUN_ID, StartHost, address_of


async def _digest(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
    buffer = bytearray(header.nbytes)
    await reader.read_into(memoryview(buffer))
    return hashlib.sha256(buffer).digest()


async def _client_mode(nursery: trio.Nursery) -> Host:
    """A host with no listener at all: nobody can dial it."""
    host = Host(Identity.generate(), RUN_ID, HostConfig(dial_deadline=5))
    await nursery.start(host.run, ())
    assert host.listen_addrs == [] and host.advertised_addrs == []
    return host


async def test_bulk_transfers_reach_a_client_mode_peer_over_a_lane_it_dials_back(
    start_host: StartHost, nursery: trio.Nursery
) -> None:
    public = await start_host()
    hidden = await _client_mode(nursery)
    hidden.bulk_handlers["digest"] = _digest
    await hidden.connect(address_of(public))  # the client-mode peer's own connection (its DHT traffic)
    data = random.Random(3).randbytes(3 << 20)
    target = PeerAddress.dial_back(hidden.peer_id)
    with trio.fail_after(20):
        assert await public.send_bulk(target, "digest", data) == hashlib.sha256(data).digest()
        assert await public.send_bulk(target, "digest", data[:10]) == hashlib.sha256(data[:10]).digest()
    # the second transfer reused the pooled lane: one dial-back in all
    assert hidden.statistics().dial_backs == 1
    assert public.statistics().reverse_lanes == 1
    assert public.statistics().reverse_refused == 0


async def test_concurrent_transfers_each_get_their_own_lane(
    start_host: StartHost, nursery: trio.Nursery
) -> None:
    public = await start_host()
    hidden = await _client_mode(nursery)
    hidden.bulk_handlers["digest"] = _digest
    await hidden.connect(address_of(public))
    payloads = [bytes([i]) * (100_000 + i) for i in range(3)]
    results: dict[int, bytes] = {}

    async def send(i: int) -> None:
        results[i] = await public.send_bulk(PeerAddress.dial_back(hidden.peer_id), "digest", payloads[i])

    with trio.fail_after(20):
        async with trio.open_nursery() as inner:
            for i in range(3):
                inner.start_soon(send, i)
    assert results == {i: hashlib.sha256(p).digest() for i, p in enumerate(payloads)}
    assert hidden.statistics().dial_backs == 3


async def test_no_connection_from_the_peer_means_no_dial_back(
    start_host: StartHost, nursery: trio.Nursery
) -> None:
    public = await start_host()
    hidden = await _client_mode(nursery)
    with trio.fail_after(5), pytest.raises(PeerUnavailable, match="accepts no connections and has none open"):
        await public.send_bulk(PeerAddress.dial_back(hidden.peer_id), "digest", b"x")


async def test_a_peer_we_dialed_is_not_asked_to_dial_back(start_host: StartHost) -> None:
    """Dial-backs go only over connections the client-mode side opened: a reachable peer refuses (FORBIDDEN),
    so nobody can make it dial addresses of the requester's choosing."""
    a, b = await start_host(), await start_host()
    b.bulk_handlers["digest"] = _digest
    await a.connect(address_of(b))  # a opened the connection: b is reachable, a should dial it
    with trio.fail_after(10), pytest.raises(PeerUnavailable, match="FORBIDDEN"):
        await a.send_bulk(PeerAddress.dial_back(b.peer_id), "digest", b"x")
    assert b.statistics().reverse_refused == 1
    assert b.statistics().dial_backs == 0


async def test_an_unsolicited_reverse_lane_is_closed_and_counted(start_host: StartHost) -> None:
    public, other = await start_host(), await start_host()
    conn = await other._dial(address_of(public), "reverse")  # nobody asked for it
    with trio.fail_after(5):
        while public.statistics().reverse_refused == 0:
            await trio.sleep(0.01)
    conn.close()
    assert public.statistics().reverse_lanes == 0


async def test_advertise_replaces_what_the_handshake_tells_others(start_host: StartHost) -> None:
    a, b, c = await start_host(), await start_host(), await start_host()
    assert a.advertised_addrs == a.listen_addrs
    a.advertise([])  # client mode: the peers it dials learn no address of it
    await a.connect(address_of(b))
    channel = b.channel_for(a.peer_id)
    assert channel is not None and channel.conn.remote_addrs == ()
    a.advertise(a.listen_addrs[:1])
    await a.connect(address_of(c))
    channel = c.channel_for(a.peer_id)
    assert channel is not None and channel.conn.remote_addrs == tuple(a.listen_addrs[:1])


async def test_rpc_to_a_dial_back_address_uses_its_own_connection_or_fails_cleanly(
    start_host: StartHost, nursery: trio.Nursery
) -> None:
    from protocols.dht import PingRequest

    public = await start_host()
    hidden = await _client_mode(nursery)
    with trio.fail_after(5), pytest.raises(PeerUnavailable, match="no RPC connection open to us"):
        await public.call(PeerAddress.dial_back(hidden.peer_id), PingRequest())
    await hidden.connect(address_of(public))
    channel = await public.channel_to(PeerAddress.dial_back(hidden.peer_id))
    assert channel.peer_id == hidden.peer_id  # the connection the client-mode peer opened
