"""``volunteer join --relay`` (volunteer.daemon._start_relaying): a volunteer serves relay slots only when a
backbone proved it directly reachable, and says plainly why not otherwise."""

from __future__ import annotations

import logging

import pytest
import trio

from shared.auth.keys import Identity
from shared.net.reachability import Reachability
from shared.node import Node, open_node
from shared.relays import VOLUNTEER_RELAY_LIMITS
from volunteer.daemon import _start_relaying


async def _node(nursery: trio.Nursery) -> Node:
    async def run(task_status: trio.TaskStatus[Node]) -> None:
        async with open_node(
            Identity.generate(), "relay-option", "volunteer", listen=["/ip4/127.0.0.1/tcp/0"]
        ) as node:
            task_status.started(node)
            await trio.sleep_forever()

    node: Node = await nursery.start(run)
    return node


@pytest.mark.parametrize(
    ("reach", "why"),
    [
        (None, "no reachability check"),
        (Reachability(observed="203.0.113.9", checked_with="/ip4/198.51.100.1/tcp/4001"), "client mode"),
        (Reachability(error="no backbone answered"), "reachability unknown"),
    ],
)
async def test_a_volunteer_not_directly_reachable_does_not_relay_and_says_why(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, reach: Reachability | None, why: str
) -> None:
    node = await _node(nursery)
    node.reachability = reach
    with caplog.at_level(logging.WARNING, logger="volunteer"):
        _start_relaying(node, nursery)
    assert node.relay is None and node.host.preamble_handler is None
    assert node.status().relay_slots == 0
    assert "not relaying" in caplog.text and why in caplog.text


async def test_a_directly_reachable_volunteer_relays_within_the_volunteer_limits(
    nursery: trio.Nursery,
) -> None:
    node = await _node(nursery)
    node.reachability = Reachability(reachable=tuple(node.host.listen_addrs), checked_with="x")
    _start_relaying(node, nursery)
    assert node.relay is not None and node.relay.limits == VOLUNTEER_RELAY_LIMITS
    assert node.host.preamble_handler is not None  # raw circuit connections are taken
    assert node.status().relay_slots == VOLUNTEER_RELAY_LIMITS.max_reservations
