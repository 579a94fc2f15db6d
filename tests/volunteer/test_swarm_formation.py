"""A swarm run forming (volunteer.swarm.formation): servers that start together measure their links,
publish them, and serve the stages the heterogeneous scheduler gives them; a lying link record is
bounded or ignored.

Links are emulated: each measured round trip is a real authenticated ping plus a per-site-pair delay
(three sites; A-B and B-C near, A-C far), since loopback has no netem here (DESIGN D6). The cost model
then predicts each stage served by one site (data-parallel traffic stays inside a site) and site B in the
middle of the pipeline (the A-C link is never used); the place_newcomer rule, blind to links, mixes sites.
"""

from __future__ import annotations

import functools
import time

import msgspec
import pytest
import trio

from protocols.peer_id import PeerId
from protocols.swarm import LINK_RECORD_TTL, LINKS_KEY, LinkRecord, LinkSample
from protocols.training import TrainingSpec
from shared.errors import RecordRejected
from shared.net.addresses import PeerAddress
from shared.node import Node
from shared.swarm.directory import find_stage_servers
from shared.swarm.placement_cost import Workload
from tests.swarmkit import start_node
from volunteer.collab.optimizer import CollabConfig
from volunteer.swarm.formation import (
    FormationConfig,
    estimate_workload,
    keep_links,
    measure_rtt,
    read_link_records,
)
from volunteer.swarm.member import SwarmMember, serve_swarm
from volunteer.tasks import make_task

RUN_ID = "swarm-formation-test"
STAGES = 3
SPEC = TrainingSpec(
    task_options={"layers": 3, "d_model": 32, "heads": 2, "ffn": 64, "seq_len": 24},
    target_batch=1 << 20,
    local_batch=4,
)
SITES = "AABBCC"
EXTRA = {"AA": 0.0, "BB": 0.0, "CC": 0.0, "AB": 1.0, "BC": 1.0, "AC": 5.0}  # round trip, seconds
LIAR_EXTRA = 0.5
WORK = Workload(STAGES, stage_bytes=1e6, activation_bytes=1e4)


async def _record(node: Node, value: bytes, subkey: str | None = None) -> None:
    await node.dht.store(
        LINKS_KEY, value, time.time() + LINK_RECORD_TTL, subkey=(subkey or node.peer_id).encode()
    )


async def test_servers_that_start_together_are_placed_by_the_scheduler(nursery: trio.Nursery) -> None:
    task = make_task(SPEC)
    seed, _ = await start_node(nursery, RUN_ID, [])
    initial = [seed.host.listen_addrs[0]]
    nodes = [(await start_node(nursery, RUN_ID, initial))[0] for _ in SITES]
    liar, _ = await start_node(nursery, RUN_ID, initial)
    site = {str(n.peer_id): s for n, s in zip(nodes, SITES, strict=True)}

    async def emulated(node: Node, peer: PeerId, address: PeerAddress) -> float:
        rtt = await measure_rtt(node, peer, address, pings=2)
        pair = "".join(sorted(site.get(str(node.peer_id), "L") + site.get(str(peer), "L")))
        return rtt + EXTRA.get(pair, LIAR_EXTRA)

    # a record that does not decode (a round trip beyond the type's range) makes nobody a member
    garbage = {"stages": STAGES, "started": time.time(), "addrs": [], "links": [[str(nodes[0].peer_id), 1e9]]}
    await _record(liar, msgspec.msgpack.encode(garbage))
    assert str(liar.peer_id) not in await read_link_records(seed, STAGES)
    # nobody writes under another's subkey: the validator refuses it before it leaves the writer
    with pytest.raises(RecordRejected):
        await _record(
            liar, msgspec.msgpack.encode(LinkRecord(STAGES, time.time(), [])), str(nodes[0].peer_id)
        )

    config = FormationConfig(window=6.0, workload=WORK, measure=emulated)
    members = [SwarmMember() for _ in nodes]
    for node, member in zip(nodes, members, strict=True):
        nursery.start_soon(
            lambda node=node, member=member: serve_swarm(
                node, task, SPEC, RUN_ID, STAGES, period=600.0, member=member, formation=config,
                collab_config=CollabConfig(poll_period=0.1),
            )
        )  # fmt: skip
    with trio.fail_after(60):  # every server joined (its record is out) before the liar's join time
        while not set(site) <= set(await read_link_records(seed, STAGES)):
            await trio.sleep(0.05)
    # the liar joins late (so it is the formation's leftover), claims absurd links: to itself, to a
    # stranger, twice to one peer, and the longest round trip the type allows to everyone
    stranger = "12D3KooW" + "x" * 44
    lies = [LinkSample(str(liar.peer_id), 0.0), LinkSample(stranger, 0.0)]
    lies += [LinkSample(str(n.peer_id), 60.0) for n in nodes] + [LinkSample(str(nodes[0].peer_id), 0.0)]
    await _record(
        liar, msgspec.msgpack.encode(LinkRecord(STAGES, time.time(), list(liar.host.listen_addrs), lies))
    )

    with trio.fail_after(90):
        while not all(m.formation is not None and m.service is not None for m in members):
            await trio.sleep(0.05)
        while [len(await find_stage_servers(seed.dht, k, STAGES)) for k in range(STAGES)] != [2, 2, 2]:
            await trio.sleep(0.05)

    outcomes = [m.formation for m in members]
    assert all(o is not None for o in outcomes)
    first = outcomes[0]
    assert first is not None
    liar_id = str(liar.peer_id)
    assert set(first.joined) == set(site) | {liar_id}  # the six servers and the (well-formed) liar
    assert first.placement.leftovers == (liar_id,)  # the last to join; scheduled: the six servers
    for o in outcomes:  # every server computed the same placement from the same records
        assert o is not None and dict(o.placement.stages) == dict(first.placement.stages)
    for node, member in zip(nodes, members, strict=True):
        assert member.stage == first.placement.stages[str(node.peer_id)]
        assert member.moves == []
    groups = [{site[p] for p in site if first.placement.stages[p] == k} for k in range(STAGES)]
    assert all(len(g) == 1 for g in groups), groups  # one site per stage
    assert groups[1] == {"B"}  # the pipeline runs A-B-C (or C-B-A): the far link A-C is not used
    # the servers measured each other (k = 8 covers the six of them) and published what they measured
    for peer in site:
        assert set(first.measured[peer]) >= set(site) - {peer}
    # the liar's claims were bounded: members only, not itself, once per peer, within the type's range
    assert set(first.measured[liar_id]) >= {str(n.peer_id) for n in nodes}
    peers = sorted(first.joined)
    me, a1 = peers.index(liar_id), peers.index(str(nodes[0].peer_id))
    assert first.rtt[me][a1] <= 60.0  # the mean of its claim and a1's own measurement, never more
    a2, b1 = peers.index(str(nodes[1].peer_id)), peers.index(str(nodes[2].peer_id))
    assert first.rtt[a1][a2] < 0.9 < first.rtt[a1][b1]  # honest pairs are what the honest measured


async def test_the_workload_estimate_counts_a_stage_s_parameters_and_a_micro_batch() -> None:
    work = estimate_workload(make_task(SPEC), SPEC, STAGES)
    params = sum(p.numel() for p in make_task(SPEC).build_model().parameters())
    assert work.stages == STAGES and work.stage_bytes == pytest.approx(4 * params / STAGES)
    assert work.activation_bytes == SPEC.local_batch * 24 * 32


async def test_serving_servers_keep_their_link_records_measured_newcomers_included(
    nursery: trio.Nursery,
) -> None:
    """keep_links (module docstring, "After the close"): each server republishes its record every refresh
    with fresh measurements of the peers it samples now, so the records outlive the formation, a server
    that joined later is measured and measures, and a link that changed shows its new round trip."""
    seed, _ = await start_node(nursery, RUN_ID, [])
    initial = [seed.host.listen_addrs[0]]
    nodes = [(await start_node(nursery, RUN_ID, initial))[0] for _ in range(3)]
    extra = {"now": 1.0}

    async def emulated(node: Node, peer: PeerId, address: PeerAddress) -> float:
        return await measure_rtt(node, peer, address, pings=1) + extra["now"]

    config = FormationConfig(measure=emulated)
    ids = [str(n.peer_id) for n in nodes]
    started = [time.time() - 50.0, time.time() - 40.0, time.time()]  # the third joined late (a newcomer)

    async def links() -> dict[str, dict[str, float]]:
        found = await read_link_records(seed, STAGES)
        return {p: {s.peer: s.rtt for s in m.record.links} for p, m in found.items()}

    for node, at in zip(nodes, started, strict=True):
        nursery.start_soon(functools.partial(keep_links, node, STAGES, at, config, refresh=0.3))
    with trio.fail_after(60):  # everybody measured everybody else (k = 8 covers them): the newcomer too
        while True:
            seen = await links()
            if all(set(seen.get(p, {})) == set(ids) - {p} for p in ids):
                break
            await trio.sleep(0.05)
    assert all(1.0 <= rtt < 2.0 for p in ids for rtt in seen[p].values())
    records = await read_link_records(seed, STAGES)
    assert [records[p].record.started for p in ids] == started  # the join time stays what it was
    extra["now"] = 3.0  # the links got slower: the next refreshes measure them again
    with trio.fail_after(60):
        while True:
            seen = await links()
            if all(set(seen[p]) == set(ids) - {p} and min(seen[p].values()) >= 3.0 for p in ids):
                break
            await trio.sleep(0.05)
