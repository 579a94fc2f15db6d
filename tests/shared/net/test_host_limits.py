"""Host resource limits: incoming-connection cap, idle reaping, use before run()."""

from __future__ import annotations

import socket

import pytest
import trio

from protocols.dht import PingRequest, PingResponse
from shared.auth.keys import Identity
from shared.errors import PeerUnavailable
from shared.net.host import Host, HostConfig
from shared.net.rpc import RequestContext

from .conftest import StartHost, address_of


async def _pong(ctx: RequestContext, request: PingRequest) -> PingResponse:
    return PingResponse()


async def test_host_refuses_connections_beyond_max_incoming_and_recovers(start_host: StartHost) -> None:
    server = await start_host(HostConfig(max_incoming=1, dial_deadline=2))
    server.registry.add(PingRequest, _pong)
    first, second = await start_host(), await start_host()
    await first.call(address_of(server), PingRequest())
    with pytest.raises(PeerUnavailable):
        await second.call(address_of(server), PingRequest())
    first.disconnect(server.peer_id)
    with trio.fail_after(10):
        while True:  # the server notices the closed connection and frees its slot
            try:
                await second.call(address_of(server), PingRequest())
                break
            except PeerUnavailable:
                await trio.sleep(0.05)


async def test_host_closes_idle_connections_and_redials_on_demand(start_host: StartHost) -> None:
    server = await start_host(HostConfig(idle_timeout=0.2))
    server.registry.add(PingRequest, _pong)
    client = await start_host()
    await client.call(address_of(server), PingRequest())
    assert client.connected_peers() == [server.peer_id]
    with trio.fail_after(10):
        while client.connected_peers():
            await trio.sleep(0.05)
    await client.call(address_of(server), PingRequest())  # a fresh dial works
    assert client.connected_peers() == [server.peer_id]


async def test_host_call_before_run_is_a_programming_error(start_host: StartHost) -> None:
    server = await start_host()
    idle = Host(Identity.generate(), "test-run")
    with pytest.raises(RuntimeError, match="not been started"):
        await idle.call(address_of(server), PingRequest())


async def test_host_aborted_while_a_connection_waits_to_be_accepted_stops_cleanly() -> None:
    """abort() run in the scheduling batch that also wakes the accept loop (a connection just arrived)
    closes the listener under a task already told it is readable: the loop must end quietly, not crash
    the host with EBADF. The batch's order is random, so the race is tried many times."""
    for _ in range(40):
        host = Host(Identity.generate(), "test-run")
        async with trio.open_nursery() as nursery:
            await nursery.start(host.run)
            port = int(host.listen_addrs[0].split("/")[4])
            with socket.create_connection(("127.0.0.1", port)) as client:
                # the accept loop becomes runnable in the same batch as this task
                await trio.lowlevel.checkpoint()
                host.abort()
                await trio.sleep(0.01)
                client.close()
            nursery.cancel_scope.cancel()
