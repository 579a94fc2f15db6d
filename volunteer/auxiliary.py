"""``volunteer join --aux``: this machine aggregates for the run without computing (seed 000 §3.2's
auxiliary peers; issue 14 item 4; the service itself is :mod:`shared.averaging.auxiliary`).

A reachable CPU server with a good link can take slices of every step's gradient averaging, so that
volunteers behind NAT (client mode) average through it, like a backbone does by default. It loads no
model and needs no accelerator: it does not train, download the state or report samples.

Like every volunteer, it joined the DHT after a backbone checked that it can dial it back
(:mod:`shared.net.reachability`; it advertises only the addresses the backbone reached). An auxiliary
peer that nobody can dial could aggregate nothing, so one in client mode exits at once, saying so (exit
code 1), rather than idle. Before it joins any round it measures its upload and download bandwidth
against that backbone (:mod:`shared.net.probe`): its tickets state them, and the LP gives aggregators
slices in proportion to them.
"""

from __future__ import annotations

import logging

import trio
from rich.console import Console

from protocols.training import TrainingSpec
from shared.averaging.auxiliary import AuxiliaryAggregator, AuxiliaryConfig
from shared.errors import ProjectError
from shared.lifecycle import Shutdown
from shared.net.addresses import parse_multiaddr
from shared.net.probe import measure_bandwidth
from shared.node import Node

__all__ = ["NotReachable", "serve_auxiliary"]

logger = logging.getLogger("volunteer")
#: Bytes moved each way by the bandwidth probe (the volunteer's own default, volunteer.capabilities).
PROBE_BYTES = 8 * 1024 * 1024
LOG_PERIOD = 30.0
REFRESH = 1.0
#: The longest vector an auxiliary volunteer aggregates a slice of: 2**31 float32 elements (8 GiB).
MAX_NUMEL = 2**31


class NotReachable(ProjectError):
    """``--aux`` on a machine the run cannot dial (client mode): it could aggregate nothing."""


async def serve_auxiliary(node: Node, training: TrainingSpec, shutdown: Shutdown, console: Console) -> None:
    """Check that the run can dial us (the node's reachability check), measure our link against the
    backbone that checked it, then aggregate until ``shutdown``.

    Raises:
        NotReachable: no backbone could dial us back (client mode), or none could check.
        PeerUnavailable, HandshakeError, RemoteError, ProtocolError: the backbone could not be probed.
    """
    reach = node.reachability
    reachable = node.host.advertised_addrs
    if reach is None or reach.client_mode or not reach.checked_with or not reachable:
        why = "no reachability check" if reach is None else reach.describe()
        raise NotReachable(
            f"--aux: the run cannot dial this machine ({why}); an auxiliary peer behind NAT or a firewall "
            "could aggregate nothing: run it on a reachable server, or forward its --listen port"
        )
    upload, download = await measure_bandwidth(node.host, parse_multiaddr(reach.checked_with), PROBE_BYTES)
    aggregator = AuxiliaryAggregator(
        node.dht,
        training,
        AuxiliaryConfig(upload_bps=min(upload, 1e13), download_bps=min(download, 1e13), max_numel=MAX_NUMEL),
    )
    logger.info(
        "aggregating (auxiliary, no training): reachable at %s, ↑ %.0f MB/s ↓ %.0f MB/s as measured",
        reachable[0],
        upload / 1e6,
        download / 1e6,
    )
    console.print(f"aggregating for run {node.host.run_id} at {reachable[0]}", highlight=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(aggregator.serve_forever)
        nursery.start_soon(_log_forever, aggregator)
        shutdown.ready()
        await shutdown.requested.wait()
        nursery.cancel_scope.cancel()


async def _log_forever(aggregator: AuxiliaryAggregator) -> None:
    while True:
        await trio.sleep(LOG_PERIOD)
        logger.info(aggregator.status())
