"""The backbone's root nursery: one node of the run, advertised on the LAN, until a signal stops it."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from shared.auth.keys import Identity
from shared.discovery import advertise_run
from shared.errors import DiscoveryError
from shared.lifecycle import Shutdown
from shared.net.addresses import parse_multiaddr
from shared.node import Node, open_node
from shared.panel import status_line

__all__ = ["BackboneOptions", "serve_backbone"]

logger = logging.getLogger("backbone")
STATUS_PERIOD = 1.0
LOG_PERIOD = 30.0


@dataclass(frozen=True)
class BackboneOptions:
    run_id: str
    data_dir: Path
    listen: Sequence[str]
    initial_peers: Sequence[str]
    mdns: bool = True


@contextlib.asynccontextmanager
async def _advertised(node: Node, run_id: str) -> AsyncIterator[None]:
    """Advertise every non-loopback listener over mDNS; loopback-only backbones are not advertised."""
    by_port: dict[int, list[str]] = defaultdict(list)
    for text in node.host.listen_addrs:
        address = parse_multiaddr(text)
        if not ipaddress.ip_address(address.host).is_loopback:
            by_port[address.port].append(address.host)
    async with contextlib.AsyncExitStack() as stack:
        for port, hosts in by_port.items():
            try:
                await stack.enter_async_context(advertise_run(run_id, node.peer_id, port, hosts))
                logger.info("advertising run %s on the LAN (mDNS) at port %d", run_id, port)
            except DiscoveryError as exc:
                logger.warning("not advertised on the LAN: %s", exc)
        if not by_port:
            logger.info("listening on loopback only: not advertising over mDNS")
        yield


async def serve_backbone(options: BackboneOptions, shutdown: Shutdown) -> None:
    identity = Identity.load_or_create(options.data_dir)
    async with open_node(
        identity, options.run_id, "backbone", listen=options.listen, initial_peers=options.initial_peers
    ) as node:
        for address in node.host.listen_addrs:
            print(f"listening on {address}", flush=True)
        mdns = _advertised(node, options.run_id) if options.mdns else contextlib.nullcontext()
        async with mdns, trio.open_nursery() as nursery:
            nursery.start_soon(node.publish_presence_forever)
            nursery.start_soon(node.measure_latency_forever)
            nursery.start_soon(_report_forever, node, options.data_dir)
            shutdown.ready()
            await shutdown.requested.wait()
            logger.info("leaving the run")
            nursery.cancel_scope.cancel()


async def _report_forever(node: Node, data_dir: Path) -> None:
    last_log = trio.current_time()
    while True:
        await trio.to_thread.run_sync(node.write_status, data_dir)
        if trio.current_time() - last_log >= LOG_PERIOD:
            logger.info(status_line(node.status()))
            last_log = trio.current_time()
        await trio.sleep(STATUS_PERIOD)
