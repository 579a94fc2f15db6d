"""The backbone as an auxiliary aggregator: its defaults and what its status says (issue 14 item 4; the
rounds themselves: tests/shared/averaging/test_auxiliary.py and tests/system/test_aux_aggregation.py)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import trio

from backbone import cli
from backbone.aggregator import (
    DEFAULT_AGGREGATE_MBPS,
    MAX_NUMEL,
    backbone_aggregator,
    status_document,
    write_status,
)
from backbone.checkpointer import DEFAULT_MAX_STATE_BYTES
from backbone.service import BackboneOptions
from protocols.training import TrainingSpec
from shared.auth.keys import Identity
from shared.node import open_node


def test_a_backbone_aggregates_by_default_and_states_the_volunteers_default_bandwidth() -> None:
    parameters = inspect.signature(cli.start).parameters
    assert parameters["aggregate"].default is True
    assert parameters["aggregate_bandwidth"].default == DEFAULT_AGGREGATE_MBPS  # the CLI loads no numpy
    options = BackboneOptions("r", Path("d"), [], [])
    assert options.aggregate and options.aggregate_mbps == DEFAULT_AGGREGATE_MBPS
    assert MAX_NUMEL * 4 == DEFAULT_MAX_STATE_BYTES  # the parameters of the largest state it stores


async def test_status_json_says_whether_and_what_the_backbone_aggregates(tmp_path: Path) -> None:
    listen = ["/ip4/127.0.0.1/tcp/0"]
    async with open_node(Identity.generate(), "agg-status", "backbone", listen=listen) as node:
        aggregator = backbone_aggregator(node, TrainingSpec(), mbps=250.0)
        ticket = aggregator.ticket()
        assert ticket is not None and ticket.aux and ticket.upload_bps == ticket.download_bps == 250e6
        assert ticket.addr == node.host.advertised_addrs[0]
        assert ticket.weight == ticket.samples_per_second == 0.0
        assert status_document(node, None)["aggregator"] is None
        aggregator.stats.rounds_aggregated = 3
        await trio.to_thread.run_sync(write_status, node, aggregator, tmp_path)
        written = json.loads((tmp_path / "status.json").read_text())
        assert written["aggregator"]["rounds_aggregated"] == 3
        assert written["peer_id"] == node.peer_id and written["role"] == "backbone"  # the node's, as before
        assert "3 round(s) aggregated" in aggregator.status()
