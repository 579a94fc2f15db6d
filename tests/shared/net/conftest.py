"""Shared helpers for the network-engine tests: Hosts on 127.0.0.1 with OS-chosen ports."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio

from shared.auth.keys import Identity
from shared.net.addresses import PeerAddress, parse_multiaddr
from shared.net.host import Host, HostConfig

RUN_ID = "test-run"

StartHost = Callable[..., Awaitable[Host]]


def address_of(host: Host) -> PeerAddress:
    """Where to dial ``host``, with its peer id."""
    return parse_multiaddr(host.listen_addrs[0])


@pytest.fixture
def start_host(nursery: trio.Nursery) -> StartHost:
    """Start a Host in the test's nursery (cancelled when the test ends); returns it once listening."""

    async def start(config: HostConfig | None = None, run_id: str = RUN_ID) -> Host:
        host = Host(Identity.generate(), run_id, config or HostConfig(dial_deadline=5))
        await nursery.start(host.run)
        return host

    return start
