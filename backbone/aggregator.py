"""The backbone as an auxiliary aggregator (issue 14; :mod:`shared.averaging.auxiliary`).

A reachable backbone takes aggregation slices of every step's averaging round by default, so a run whose
volunteers are all behind NAT (client mode: the LP can give them no slice) still averages. It computes
nothing and loads no model (no torch): the averaging core is numpy, the vector's length comes from the
volunteers' tickets, the codec and averaging rule from the run's manifest the backbone serves.

``backbone start --no-aggregate`` opts out (then such a run's rounds fail with "all N peers are in client
mode: nobody can aggregate", as before). ``--aggregate-bandwidth MBPS`` is the link the backbone states in
its tickets (configured, not measured: a backbone has no probe to measure itself against; the default is
the volunteers' own default before they measure). The backbone's ``status.json`` carries the aggregator's
statistics under ``aggregator`` (``null`` when it does not aggregate), and its periodic log line says
what it aggregated.

The largest vector it aggregates a slice of is the parameters of the largest state it would store
(:data:`~backbone.checkpointer.DEFAULT_MAX_STATE_BYTES` / 4 bytes per float32 parameter).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec

from protocols.training import TrainingSpec
from shared.averaging.auxiliary import DEFAULT_BPS, AuxiliaryAggregator, AuxiliaryConfig
from shared.node import Node

from .checkpointer import DEFAULT_MAX_STATE_BYTES

__all__ = ["DEFAULT_AGGREGATE_MBPS", "backbone_aggregator", "status_document", "write_status"]

#: ``--aggregate-bandwidth`` default, MB/s (10**6 bytes/s).
DEFAULT_AGGREGATE_MBPS = DEFAULT_BPS / 1e6
#: The longest vector a backbone aggregates: the float32 parameters of the largest state it stores.
MAX_NUMEL = DEFAULT_MAX_STATE_BYTES // 4


def backbone_aggregator(
    node: Node, spec: TrainingSpec, mbps: float = DEFAULT_AGGREGATE_MBPS
) -> AuxiliaryAggregator:
    """The backbone's auxiliary aggregator (not started: run its ``serve_forever``).

    Raises:
        ValueError: ``mbps`` is not a positive bandwidth.
    """
    bps = mbps * 1e6
    config = AuxiliaryConfig(upload_bps=bps, download_bps=bps, max_numel=MAX_NUMEL)
    return AuxiliaryAggregator(node.dht, spec, config)


def status_document(node: Node, aggregator: AuxiliaryAggregator | None) -> dict[str, Any]:
    """The node's status plus the aggregator's statistics (``None`` when it does not aggregate)."""
    document: dict[str, Any] = msgspec.to_builtins(node.status())
    document["aggregator"] = None if aggregator is None else dataclasses.asdict(aggregator.statistics())
    return document


def write_status(node: Node, aggregator: AuxiliaryAggregator | None, data_dir: Path) -> None:
    """Atomically write ``status.json`` (as :meth:`shared.node.Node.write_status`, with the aggregator)."""
    path = data_dir / "status.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(status_document(node, aggregator)))
    tmp.replace(path)
