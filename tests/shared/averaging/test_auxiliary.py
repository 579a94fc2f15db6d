"""Auxiliary aggregators (issue 14): peers that take slices without computing, and pull nothing else."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from protocols.averaging import JoinTicket
from protocols.training import PROGRESS_KEY, PROGRESS_TTL, Progress, TrainingSpec
from shared.averaging.allreduce import Averager, GroupPlan, Member
from shared.averaging.auxiliary import AuxiliaryAggregator, AuxiliaryConfig
from shared.averaging.groups import leader_of
from shared.averaging.matchmaking import Matchmaker, MatchmakingConfig, agreed_numel
from shared.net.addresses import parse_multiaddr
from shared.node import Node

from .test_allreduce import start_hosts
from .test_matchmaking import start_nodes

BPS = 1e7


def computing(numel: int = 0, *, aux: bool = False) -> JoinTicket:
    return JoinTicket(
        addr=None,
        weight=1.0,
        norm=1.0,
        samples_per_second=1.0,
        upload_bps=BPS,
        download_bps=BPS,
        client_mode=True,
        numel=numel,
    )


def auxiliary() -> JoinTicket:
    return JoinTicket(
        addr="/ip4/127.0.0.1/tcp/1",
        weight=0.0,
        norm=0.0,
        samples_per_second=0.0,
        upload_bps=BPS,
        download_bps=BPS,
        aux=True,
    )


# ---------------------------------------------------------------------------------------- wire and rules


def test_an_auxiliary_ticket_computes_nothing() -> None:
    for bad in ({"weight": 1.0}, {"norm": 1.0}, {"samples_per_second": 1.0}):
        with pytest.raises(ValueError, match="auxiliary ticket computes nothing"):
            JoinTicket(addr=None, upload_bps=1.0, download_bps=1.0, aux=True, **{"weight": 0.0, "norm": 0.0,
                       "samples_per_second": 0.0, **bad})  # fmt: skip
    with pytest.raises(ValueError, match="numel"):
        msgspec.structs.replace(auxiliary(), numel=2**49)
    encoded = msgspec.msgpack.encode({**msgspec.structs.asdict(auxiliary()), "numel": 2**49})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(encoded, type=JoinTicket)


@given(st.lists(st.tuples(st.integers(0, 4), st.booleans()), max_size=12))
def test_agreed_numel_is_never_one_strangers_claim(claims: list[tuple[int, bool]]) -> None:
    tickets = [auxiliary() if aux else computing(numel) for numel, aux in claims]
    stated = [numel for numel, aux in claims if not aux and numel > 0]
    agreed = agreed_numel(tickets)
    if agreed is None:
        counts = sorted((stated.count(n) for n in set(stated)), reverse=True)
        assert not counts or counts[0] < 2 or (len(counts) > 1 and counts[0] == counts[1])
    else:
        assert agreed > 0
        assert stated.count(agreed) >= 2  # at least two computing tickets state it
        assert all(stated.count(agreed) > stated.count(n) for n in set(stated) - {agreed})


def test_agreed_numel_ignores_aux_tickets_and_unstated_lengths() -> None:
    assert agreed_numel([computing(7), computing(0), auxiliary()]) is None
    assert agreed_numel([computing(7), computing(7), computing(9)]) == 7
    assert agreed_numel([computing(7), computing(7), computing(9), computing(9)]) is None


# ---------------------------------------------------------------------------------------- all-reduce


async def test_an_aux_member_pulls_nothing_but_its_own_slice_and_nobody_waits_for_its_pulls(
    nursery: trio.Nursery,
) -> None:
    peers = await start_hosts(nursery, 2) + await start_hosts(nursery, 2, listen=False)
    numel = 60_000
    members = (
        Member(peers[0][0].peer_id, parse_multiaddr(peers[0][0].listen_addrs[0]), 0.0, aux=True),
        Member(peers[1][0].peer_id, parse_multiaddr(peers[1][0].listen_addrs[0]), 1.0),
        Member(peers[2][0].peer_id, None, 1.0),
        Member(peers[3][0].peer_id, None, 2.0),
    )
    plan = GroupPlan(b"g", 1, members, (30_000, 30_000, 0, 0), 20.0)
    vectors = [np.full(numel, float(i), dtype=np.float32) for i in range(4)]
    results: list[object] = [None] * 4

    async def one(i: int) -> None:
        results[i] = await peers[i][1].all_reduce(plan, vectors[i], i)

    async with trio.open_nursery() as group:
        for i in range(4):
            group.start_soon(one, i)
    expected = np.float32((1 * 1 + 2 * 1 + 3 * 2) / 4)
    for i in (1, 2, 3):  # the computing members got everything
        assert results[i].outcome.complete  # type: ignore[attr-defined]
        assert np.all(vectors[i] == expected)
    aux = results[0].outcome  # type: ignore[attr-defined]
    assert aux.slices[0].averaged and np.all(vectors[0][:30_000] == expected)  # its own slice
    assert not aux.slices[1].averaged and "auxiliary" in aux.slices[1].reason
    assert np.all(vectors[0][30_000:] == 0.0)  # nothing pulled from the other aggregator
    # the other aggregator's duty ended with the computing members' pulls: nobody counts on the aux's
    assert not peers[1][1]._duties
    # it received its slice's parts from three senders, never the other slice's average (120 kB)
    assert peers[0][0].statistics().bytes_received < 3 * 30_000 * 4 + 60_000


# ---------------------------------------------------------------------------------------- matchmaking


def _spec() -> TrainingSpec:
    return TrainingSpec(target_batch=4, local_batch=1)


async def _publish_progress(node: Node, step: int) -> None:
    progress = Progress(step=step, samples=1, samples_per_second=1.0, time=time.time())
    await node.dht.store(
        PROGRESS_KEY,
        msgspec.msgpack.encode(progress),
        time.time() + PROGRESS_TTL,
        subkey=node.peer_id.encode(),
    )


async def test_client_mode_peers_average_through_an_auxiliary_aggregator_every_step(
    nursery: trio.Nursery,
) -> None:
    """Two computing peers in client mode cannot average alone ("nobody can aggregate"); with an
    auxiliary aggregator following their progress they average every attempt they make, and it holds
    every slice."""
    nodes = await start_nodes(nursery, 3, client={1, 2})
    spec = _spec()
    aggregator = AuxiliaryAggregator(nodes[0].dht, spec, AuxiliaryConfig(window=0.5, poll_period=0.2))
    numel = 20_000
    config = MatchmakingConfig(window=1.0, plan_wait=4.0, codec=spec.codec, max_weight=5.0)
    matchmakers = {i: Matchmaker(nodes[i].dht, prefix="train.avg", config=config) for i in (1, 2)}
    averagers = {i: Averager(nodes[i].host) for i in (1, 2)}

    async def member(i: int, step: int, attempt: int, out: dict[int, np.ndarray]) -> None:
        vector = np.full(numel, float(i + step), dtype=np.float32)
        ticket = JoinTicket(
            addr=None,
            weight=float(i),
            norm=float(np.linalg.norm(vector.astype(np.float64))),
            samples_per_second=1.0,
            upload_bps=BPS,
            download_bps=BPS,
            client_mode=True,
            numel=numel,
        )
        plan = await matchmakers[i].assemble(step, ticket, numel, group_key=f"a{attempt}")
        assert plan is not None
        me = [m.peer_id for m in plan.members].index(nodes[i].peer_id)
        assert plan.slice_sizes[me] == 0 and sum(plan.slice_sizes) == numel  # the aggregator holds all
        result = await averagers[i].all_reduce(plan, vector, me, step=step + 1)  # as volunteers do
        assert result.outcome.complete
        out[i] = vector

    # without the aggregator, two client-mode peers cannot average
    async def alone(i: int, failures: list[str]) -> None:
        ticket = JoinTicket(addr=None, weight=1.0, norm=1.0, samples_per_second=1.0, upload_bps=BPS,
                            download_bps=BPS, client_mode=True, numel=numel)  # fmt: skip
        try:
            assert await matchmakers[i].assemble(9, ticket, numel, group_key="x") is None
        except ValueError as exc:
            failures.append(str(exc))

    failures: list[str] = []
    async with trio.open_nursery() as group:
        for i in (1, 2):
            group.start_soon(alone, i, failures)
    assert any("nobody can aggregate" in f for f in failures)

    nursery.start_soon(aggregator.serve_forever)
    for step, attempt in ((1, 0), (1, 1), (2, 0)):  # a retried attempt, then the next step
        for i in (1, 2):
            await _publish_progress(nodes[i], step)
        await trio.sleep(0.5)  # the aggregator sees the step (the computing peers compute meanwhile)
        out: dict[int, np.ndarray] = {}
        with trio.fail_after(30):
            async with trio.open_nursery() as group:
                for i in (1, 2):
                    group.start_soon(member, i, step, attempt, out)
        expected = np.float32((1 * (1 + step) + 2 * (2 + step)) / 3)
        assert np.all(out[1] == expected) and np.all(out[2] == expected)
    stats = aggregator.statistics()
    assert stats.rounds_aggregated == 3 and stats.elements_aggregated == 3 * numel
    assert stats.last_step == 2 and stats.errors == 0
    assert "3 round(s) aggregated" in aggregator.status()


async def test_an_aggregator_joins_no_group_whose_length_exceeds_its_limit_or_one_stranger_states(
    nursery: trio.Nursery,
) -> None:
    nodes = await start_nodes(nursery, 3, client={1, 2})
    spec = _spec()
    aggregator = AuxiliaryAggregator(nodes[0].dht, spec, AuxiliaryConfig(window=0.3, max_numel=1000))
    ticket = aggregator.ticket()
    assert ticket is not None and ticket.aux

    async def store(i: int, key: str, numel: int) -> None:
        claim = JoinTicket(addr=None, weight=1.0, norm=1.0, samples_per_second=1.0, upload_bps=BPS,
                           download_bps=BPS, client_mode=True, numel=numel)  # fmt: skip
        await nodes[i].dht.store(
            key, msgspec.msgpack.encode(claim), time.time() + 60, subkey=nodes[i].peer_id.encode()
        )

    # two computing peers agree on a length above the limit: not joined, nothing allocated
    for i in (1, 2):
        await store(i, "train.avg.5.a0", 10**12)
    with trio.fail_after(10):
        assert await aggregator.serve_round(5, 0, ticket) is False
    # one stranger states a length, the other peer none: no agreed length
    await store(1, "train.avg.6.a0", 500)
    await store(2, "train.avg.6.a0", 0)
    with trio.fail_after(10):
        assert await aggregator.serve_round(6, 0, ticket) is False
    stats = aggregator.statistics()
    assert stats.no_group == 2 and stats.rounds_joined == 0 and stats.errors == 0


async def test_computing_peers_that_vanish_after_their_tickets_cost_one_failed_round_not_the_service(
    nursery: trio.Nursery,
) -> None:
    """The computing peers store tickets and never average (they died, or lie): the aggregator either
    waits for a plan that never comes (a follower) or averages nothing before its deadline (the leader);
    either way the round is counted and the aggregator goes on."""
    nodes = await start_nodes(nursery, 3, client={1, 2})
    config = AuxiliaryConfig(window=0.3, plan_wait=1.0)
    aggregator = AuxiliaryAggregator(nodes[0].dht, _spec(), config)
    ticket = aggregator.ticket()
    assert ticket is not None
    for i in (1, 2):
        claim = JoinTicket(addr=None, weight=1.0, norm=1.0, samples_per_second=1.0, upload_bps=BPS,
                           download_bps=BPS, client_mode=True, numel=5000)  # fmt: skip
        value, subkey = msgspec.msgpack.encode(claim), nodes[i].peer_id.encode()
        await nodes[i].dht.store("train.avg.3.a0", value, time.time() + 60, subkey=subkey)
    with trio.fail_after(120):
        assert await aggregator.serve_round(3, 0, ticket) is False
    stats = aggregator.statistics()
    assert stats.rounds_aggregated == 0
    assert stats.no_group + stats.rounds_failed + stats.errors == 1, stats


async def test_a_member_rejoining_a_key_never_adopts_the_plan_of_the_round_that_already_ran(
    nursery: trio.Nursery,
) -> None:
    """Retries cycle back to the first attempt's key, where the plan of a round that ran is still stored;
    a member joining again alone must not adopt it (it would average its own slice with nobody and fork
    the step): it waits for a new plan, and none comes."""
    nodes = await start_nodes(nursery, 2)
    config = MatchmakingConfig(window=0.5, plan_wait=2.0)
    matchmakers = [Matchmaker(nodes[i].dht, config=config) for i in range(2)]
    tickets = [
        JoinTicket(
            addr=n.host.listen_addrs[0],
            weight=1.0,
            norm=1.0,
            samples_per_second=1.0,
            upload_bps=BPS,
            download_bps=BPS,
            numel=1000,
        )
        for n in nodes
    ]
    plans: list[object] = [None, None]

    async def join(i: int) -> None:
        plans[i] = await matchmakers[i].assemble(4, tickets[i], 1000, group_key="a0")

    async with trio.open_nursery() as group:
        for i in range(2):
            group.start_soon(join, i)
    assert plans[0] is not None and plans[0] == plans[1]
    first = plans[0]
    leader = next(
        i for i in range(2) if nodes[i].peer_id == leader_of("avg.4.a0", [n.peer_id for n in nodes])
    )
    follower = 1 - leader
    with trio.fail_after(30):  # the follower comes back alone (the others stepped): no plan to adopt
        assert await matchmakers[follower].assemble(4, tickets[follower], 1000, group_key="a0") is None
    assert first is not None


async def test_a_dead_aggregators_ticket_expires_within_its_lease(nursery: trio.Nursery) -> None:
    """Soak test finding: a backbone lost for good had tickets under the step's attempt keys that lived 600 s;
    the computing peers cycle back through those keys, and every plan gave the dead member a slice. An aux
    ticket now lives window + plan_wait + AUX_TICKET_MARGIN past its last renewal."""
    from shared.averaging.matchmaking import AUX_TICKET_MARGIN

    config = MatchmakingConfig(window=0.2, plan_wait=0.5)
    dht_node, aggregator = await start_nodes(nursery, 2)
    matchmaker = Matchmaker(aggregator.dht, config=config)
    with trio.move_on_after(1.0):  # waiting for computing peers that never come; then it "dies"
        await matchmaker.assemble_auxiliary(7, auxiliary(), "a0", 1000)
    key = f"{matchmaker.prefix}.7.a0"
    found = await dht_node.dht.get(key)
    assert found is not None and aggregator.peer_id.encode() in found.entries
    lease = config.window + config.plan_wait + AUX_TICKET_MARGIN
    assert found.entries[aggregator.peer_id.encode()].expiration <= time.time() + lease + 0.5
