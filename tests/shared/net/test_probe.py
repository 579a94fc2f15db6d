"""Bandwidth and reachability probes between real Hosts on loopback (shared.net.probe)."""

from __future__ import annotations

import socket

import msgspec
import pytest
import trio

from protocols.codes import ErrorCode
from protocols.probe import (
    MAX_PROBE_BYTES,
    PROBE_DOWN,
    PROBE_UP,
    DownloadProbe,
    ReachReply,
    ReachRequest,
    encode_probe_meta,
)
from shared.auth.keys import Identity
from shared.errors import Overloaded, RemoteError
from shared.net.addresses import format_multiaddr
from shared.net.host import Host, HostConfig
from shared.net.probe import ProbeService, check_reachable, measure_bandwidth

from .conftest import RUN_ID, StartHost, address_of

HANG_GUARD_S = 15  # only a guard against hangs; no test depends on how long anything takes
MiB = 1 << 20


def _closed_port() -> int:
    """A loopback port nobody listens on (bound, then released without listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _server(start_host: StartHost, **kwargs: int) -> tuple[Host, ProbeService]:
    host = await start_host()
    return host, ProbeService(host, **kwargs)


async def test_measure_bandwidth_moves_the_bytes_and_returns_positive_rates(start_host: StartHost) -> None:
    server, probes = await _server(start_host)
    client = await start_host()

    with trio.fail_after(HANG_GUARD_S):
        up, down = await measure_bandwidth(client, address_of(server), 4 * MiB)

    assert up > 0 and down > 0
    stats = probes.statistics()
    # two empty warm-up uploads, one timed upload, one download: exactly the probe bytes moved
    assert (stats.uploads, stats.downloads) == (3, 1)
    assert (stats.bytes_received, stats.bytes_sent) == (4 * MiB, 4 * MiB)
    assert stats.refused == 0


async def test_measure_bandwidth_works_from_a_client_mode_host(
    nursery: trio.Nursery, start_host: StartHost
) -> None:
    server, probes = await _server(start_host)
    client = Host(Identity.generate(), RUN_ID, HostConfig(dial_deadline=5))
    await nursery.start(client.run, ())  # listens nowhere: every byte comes back on a connection it opened

    with trio.fail_after(HANG_GUARD_S):
        up, down = await measure_bandwidth(client, address_of(server), MiB)

    assert up > 0 and down > 0
    assert probes.statistics().bytes_sent == MiB


async def test_probe_server_refuses_oversize_transfers_with_too_large(start_host: StartHost) -> None:
    server, probes = await _server(start_host, max_bytes=MiB)
    client = await start_host()
    to = address_of(server)

    too_many = encode_probe_meta(DownloadProbe(nbytes=MiB + 1))
    beyond_cap = msgspec.msgpack.encode({"nbytes": MAX_PROBE_BYTES + 1})  # the wire type itself caps probes

    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(RemoteError) as upload:
            await client.send_bulk(to, PROBE_UP, bytes(MiB + 1))
        with pytest.raises(RemoteError) as download:
            await client.send_bulk(to, PROBE_DOWN, b"", too_many, lambda m, n: memoryview(bytearray(n)))
        with pytest.raises(RemoteError) as beyond_protocol:
            await client.send_bulk(to, PROBE_DOWN, b"", beyond_cap)

    assert upload.value.code == ErrorCode.TOO_LARGE
    assert download.value.code == ErrorCode.TOO_LARGE
    assert beyond_protocol.value.code == ErrorCode.BAD_REQUEST
    stats = probes.statistics()
    assert (stats.bytes_received, stats.bytes_sent, stats.refused) == (0, 0, 2)


async def test_measure_bandwidth_rejects_sizes_outside_the_protocol_cap(start_host: StartHost) -> None:
    client = await start_host()
    for nbytes in (0, MAX_PROBE_BYTES + 1):
        with pytest.raises(ValueError, match="nbytes"):
            await measure_bandwidth(client, "/ip4/127.0.0.1/tcp/1", nbytes)


async def test_probe_server_refuses_probes_beyond_its_capacity_with_overloaded(
    nursery: trio.Nursery, start_host: StartHost
) -> None:
    server, probes = await _server(start_host, max_concurrent=1)
    slow, eager = await start_host(), await start_host()
    # A port that completes TCP handshakes but never speaks TLS (a listener that never accepts): the
    # dial-back to it hangs until the reach deadline, holding the server's only probe slot meanwhile.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent_addr = format_multiaddr("127.0.0.1", silent.getsockname()[1], slow.peer_id)
    replies: list[ReachReply] = []

    async def hold_the_slot() -> None:
        reply = await slow.call(address_of(server), ReachRequest(addrs=[silent_addr]))
        assert isinstance(reply, ReachReply)
        replies.append(reply)

    try:
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as inner:
                inner.start_soon(hold_the_slot)
                while probes.limiter.borrowed_tokens == 0:
                    await trio.sleep(0.01)
                with pytest.raises(Overloaded):
                    await eager.call(address_of(server), ReachRequest(addrs=eager.listen_addrs))
            # the slot is free again: a probe now succeeds
            assert await check_reachable(eager, address_of(server)) == eager.listen_addrs
    finally:
        silent.close()
    assert replies == [ReachReply(reachable=[], observed="127.0.0.1")]
    assert probes.statistics().refused == 1


async def test_check_reachable_reports_a_listening_peer_reachable(start_host: StartHost) -> None:
    server, probes = await _server(start_host)
    client = await start_host()

    with trio.fail_after(HANG_GUARD_S):
        reached = await check_reachable(client, address_of(server))

    assert reached == client.listen_addrs
    assert probes.statistics().reach_checks == 1


async def test_check_reachable_finds_nothing_when_the_advertised_port_is_closed(
    start_host: StartHost,
) -> None:
    server, probes = await _server(start_host)
    client = await start_host()
    client.listen_addrs[:] = [format_multiaddr("127.0.0.1", _closed_port(), client.peer_id)]

    with trio.fail_after(HANG_GUARD_S):
        await client.connect(address_of(server))  # a live connection between the two proves nothing
        assert await check_reachable(client, address_of(server)) == []
    assert server.channel_for(client.peer_id) is not None
    assert probes.statistics().reach_checks == 1  # the observed IP is the advertised one: no second ask
    assert probes.statistics().tolerated == {"reach dial-back": 1}  # the failed dial is counted


async def test_check_reachable_is_empty_for_a_client_mode_host(
    nursery: trio.Nursery, start_host: StartHost
) -> None:
    server, probes = await _server(start_host)
    client = Host(Identity.generate(), RUN_ID)
    await nursery.start(client.run, ())

    with trio.fail_after(HANG_GUARD_S):
        assert await check_reachable(client, address_of(server)) == []
    assert probes.statistics().reach_checks == 0  # nothing to ask about


async def test_reach_probe_reports_only_addresses_where_the_requester_itself_answers(
    start_host: StartHost,
) -> None:
    server, _ = await _server(start_host)
    client, other = await start_host(), await start_host()
    own = client.listen_addrs[0]
    other_plain = format_multiaddr("127.0.0.1", address_of(other).port)  # another peer listens there
    other_named = other.listen_addrs[0]  # names another peer id
    closed = format_multiaddr("127.0.0.1", _closed_port())
    with trio.fail_after(HANG_GUARD_S):
        reply = await client.call(
            address_of(server),
            ReachRequest(addrs=[closed, other_plain, other_named, own, "/not/a/multiaddr"]),
        )

    assert isinstance(reply, ReachReply)
    assert reply.reachable == [own]
    assert reply.observed == "127.0.0.1"


async def test_reach_probe_never_dials_an_ip_other_than_the_one_the_request_came_from(
    nursery: trio.Nursery, start_host: StartHost
) -> None:
    server, _ = await _server(start_host)
    client = Host(Identity.generate(), RUN_ID)
    await nursery.start(client.run, ["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.2/tcp/0"])
    on_1, on_2 = client.listen_addrs

    with trio.fail_after(HANG_GUARD_S):
        reply = await client.call(address_of(server), ReachRequest(addrs=[on_2, on_1]))

    assert isinstance(reply, ReachReply)
    assert reply.reachable == [on_1]  # 127.0.0.2 is really listening, but it is not where we came from
