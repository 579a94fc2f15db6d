"""A node opened with ``verify_reachability`` advertises only what a backbone dialed back (issue 14), before
it joins the DHT; otherwise it is in client mode and says why. (Across real NAT: tests/system.)"""

from __future__ import annotations

import trio

from shared.auth.keys import Identity
from shared.net.probe import ProbeService
from shared.node import Node, open_node

RUN_ID = "reach-test"


async def _start(nursery: trio.Nursery, listen: list[str], initial: list[str], verify: bool = False) -> Node:
    async def run(task_status: trio.TaskStatus[Node]) -> None:
        async with open_node(
            Identity.generate(),
            RUN_ID,
            "volunteer",
            listen=listen,
            initial_peers=initial,
            verify_reachability=verify,
        ) as node:
            task_status.started(node)
            await trio.sleep_forever()

    node: Node = await nursery.start(run)
    return node


async def _backbone(nursery: trio.Nursery, probes: bool = True) -> Node:
    node = await _start(nursery, ["/ip4/127.0.0.1/tcp/0"], [])
    if probes:
        ProbeService(node.host)
    return node


async def test_a_reachable_node_advertises_exactly_what_was_dialed_back(nursery: trio.Nursery) -> None:
    backbone = await _backbone(nursery)
    with trio.fail_after(20):
        node = await _start(nursery, ["/ip4/127.0.0.1/tcp/0"], [backbone.host.listen_addrs[0]], verify=True)
    assert node.reachability is not None and node.reachability.mode == "direct"
    assert node.host.advertised_addrs == node.host.listen_addrs
    status = node.status()
    assert (status.reachability, status.advertised_addrs) == ("direct", node.host.listen_addrs)
    assert "reachable at /ip4/127.0.0.1/tcp/" in status.reachability_note
    assert status.links == {"direct": len(node.host.connected_peers())} and status.links["direct"] >= 1
    # the backbone learned our address from the connection the DHT opened after the check
    channel = backbone.host.channel_for(node.host.peer_id)
    assert channel is not None and channel.conn.remote_addrs == tuple(node.host.listen_addrs)


async def test_a_node_nobody_can_dial_advertises_nothing_and_says_why(nursery: trio.Nursery) -> None:
    """Listening on 127.0.0.2 but connecting from 127.0.0.1: the backbone only dials back the IP a request
    came from (no amplification), and nothing listens on 127.0.0.1 at our port -- a NAT in miniature."""
    backbone = await _backbone(nursery)
    with trio.fail_after(30):
        node = await _start(nursery, ["/ip4/127.0.0.2/tcp/0"], [backbone.host.listen_addrs[0]], verify=True)
    reach = node.reachability
    assert reach is not None and reach.mode == "client" and reach.observed == "127.0.0.1"
    assert node.host.advertised_addrs == [] and node.host.listen_addrs  # bound, but not advertised
    assert "client mode" in reach.describe() and "seen as 127.0.0.1" in reach.describe()
    channel = backbone.host.channel_for(node.host.peer_id)
    assert channel is not None and channel.conn.remote_addrs == ()  # the backbone learned no address


async def test_no_checker_means_client_mode_not_a_pass(nursery: trio.Nursery) -> None:
    """A failed check is not a pass (issue 14: a suppressed probe failure left peers marked reachable)."""
    plain = await _backbone(nursery, probes=False)  # answers no reachability checks
    with trio.fail_after(30):
        node = await _start(nursery, ["/ip4/127.0.0.1/tcp/0"], [plain.host.listen_addrs[0]], verify=True)
    reach = node.reachability
    assert reach is not None and reach.mode == "unchecked" and reach.client_mode
    assert node.host.advertised_addrs == []
    assert "reachability unknown" in reach.describe()
    assert node.status().reachability == "unchecked"


async def test_without_verification_loopback_is_advertised_only_when_nothing_else_is(
    nursery: trio.Nursery,
) -> None:
    node = await _start(nursery, ["/ip4/0.0.0.0/tcp/0"], [])
    loopback = [a for a in node.host.listen_addrs if a.startswith("/ip4/127.")]
    others = [a for a in node.host.listen_addrs if not a.startswith("/ip4/127.")]
    assert node.host.advertised_addrs == (others or loopback)
    assert node.reachability is None and node.status().reachability == ""
