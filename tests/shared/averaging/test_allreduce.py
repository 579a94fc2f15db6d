"""The butterfly all-reduce over real TLS connections on loopback, several hosts in one trio run."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import trio

from protocols.averaging import decode_part_header
from shared.auth.keys import Identity
from shared.averaging.allreduce import PUSH, Averager, GroupPlan, Member
from shared.net.addresses import parse_multiaddr
from shared.net.host import Host, HostConfig

RUN = "avg-test"


async def start_hosts(nursery: trio.Nursery, n: int, *, listen: bool = True) -> list[tuple[Host, Averager]]:
    out = []
    for _ in range(n):
        host = Host(Identity.generate(), RUN, HostConfig(dial_deadline=3, bulk_stall=5))
        averager = Averager(host)
        await nursery.start(host.run, ["/ip4/127.0.0.1/tcp/0"] if listen else [])
        out.append((host, averager))
    return out


def plan_for(
    peers: list[tuple[Host, Averager]],
    numel: int,
    *,
    weights: list[float] | None = None,
    sizes: list[int] | None = None,
    client: set[int] = frozenset(),
    deadline: float = 20.0,
    **kw: object,
) -> GroupPlan:
    n = len(peers)
    weights = weights or [1.0] * n
    if sizes is None:
        owners = [i for i in range(n) if i not in client]
        sizes = [0] * n
        for rank, i in enumerate(owners):
            sizes[i] = numel // len(owners) + (1 if rank < numel % len(owners) else 0)
    members = tuple(
        Member(h.peer_id, None if i in client else parse_multiaddr(h.listen_addrs[0]), weights[i])
        for i, (h, _) in enumerate(peers)
    )
    return GroupPlan(b"g", 1, members, tuple(sizes), deadline, **kw)  # type: ignore[arg-type]


async def run_round(
    peers: list[tuple[Host, Averager]],
    plan: GroupPlan,
    vectors: list[np.ndarray],
    skip: set[int] = frozenset(),
) -> list[object]:
    results: list[object] = [None] * len(peers)

    async def one(i: int) -> None:
        results[i] = await peers[i][1].all_reduce(plan, vectors[i], i)

    async with trio.open_nursery() as nursery:
        for i in range(len(peers)):
            if i not in skip:
                nursery.start_soon(one, i)
    return results


async def test_allreduce_gives_every_peer_the_same_exact_weighted_mean(nursery: trio.Nursery) -> None:
    peers = await start_hosts(nursery, 4)
    numel = 1_000_003
    rng = np.random.default_rng(0)
    vectors = [rng.standard_normal(numel).astype(np.float32) for _ in peers]
    weights = [1.0, 2.0, 3.0, 4.0]
    expected = np.average(np.stack(vectors).astype(np.float64), axis=0, weights=weights).astype(np.float32)
    plan = plan_for(peers, numel, weights=weights, part_numel=100_000)
    results = await run_round(peers, plan, vectors)
    for result in results:
        assert result.outcome.complete  # type: ignore[attr-defined]
    for v in vectors[1:]:
        assert np.array_equal(v, vectors[0])  # bit-identical on every peer
    assert np.max(np.abs(vectors[0] - expected)) < 1e-6


@pytest.mark.parametrize("codec", ["fp16", "int8-blockwise"])
async def test_allreduce_with_compression_is_bit_identical_and_within_the_codec_bound(
    nursery: trio.Nursery, codec: str
) -> None:
    peers = await start_hosts(nursery, 3)
    numel = 300_000
    rng = np.random.default_rng(1)
    vectors = [rng.standard_normal(numel).astype(np.float32) for _ in peers]
    exact = np.mean(np.stack(vectors), axis=0)
    await run_round(peers, plan_for(peers, numel, codec=codec, part_numel=65_536), vectors)
    for v in vectors[1:]:
        assert np.array_equal(v, vectors[0])
    bound = 0.05 if codec == "int8-blockwise" else 0.01
    assert np.max(np.abs(vectors[0] - exact)) < bound


async def test_allreduce_client_mode_and_auxiliary_peers(nursery: trio.Nursery) -> None:
    peers = await start_hosts(nursery, 3) + await start_hosts(nursery, 1, listen=False)
    numel = 50_000
    vectors = [np.full(numel, float(i), dtype=np.float32) for i in range(4)]
    # peer 0 is auxiliary (weight 0: it aggregates and receives, contributes nothing); 3 is client-mode
    plan = plan_for(peers, numel, weights=[0.0, 1.0, 1.0, 2.0], client={3})
    assert plan.slice_sizes[3] == 0
    results = await run_round(peers, plan, vectors)
    expected = (1 * 1 + 2 * 1 + 3 * 2) / 4
    for v, r in zip(vectors, results, strict=True):
        assert r.outcome.complete  # type: ignore[attr-defined]
        assert np.all(v == np.float32(expected))


async def test_allreduce_dead_aggregator_leaves_exactly_its_slice_local(nursery: trio.Nursery) -> None:
    peers = await start_hosts(nursery, 3)
    numel = 30_000
    # no zero vectors: beside a zero part norm, every other part would be a norm outlier
    vectors = [np.full(numel, float(i + 1), dtype=np.float32) for i in range(3)]
    plan = plan_for(peers, numel, deadline=3.0)
    peers[2][0].abort()  # aggregator 2 is gone before the round
    results = await run_round(peers, plan, vectors, skip={2})
    dead = (plan.slice_sizes[0] + plan.slice_sizes[1], numel)
    for i in (0, 1):
        outcome = results[i].outcome  # type: ignore[attr-defined]
        assert outcome.unaveraged() == [dead]
        assert np.all(vectors[i][: dead[0]] == np.float32(1.5))  # 0 and 1 averaged (2 never sent)
        assert np.all(vectors[i][dead[0] :] == np.float32(i + 1))  # untouched, never half-written


async def test_allreduce_sender_that_never_sends_is_dropped_and_weights_renormalize(
    nursery: trio.Nursery,
) -> None:
    peers = await start_hosts(nursery, 3)
    numel = 30_000
    vectors = [np.full(numel, float(i + 1), dtype=np.float32) for i in range(3)]
    # peer 2 owns nothing and never shows up: the others average without it after the deadline
    plan = plan_for(peers, numel, sizes=[numel // 2, numel - numel // 2, 0], deadline=2.0)
    results = await run_round(peers, plan, vectors, skip={2})
    for i in (0, 1):
        assert results[i].outcome.complete  # type: ignore[attr-defined]
        assert np.all(vectors[i] == np.float32(1.5))


async def test_allreduce_rejects_poisoned_parts_and_bans_the_sender(nursery: trio.Nursery) -> None:
    peers = await start_hosts(nursery, 3)
    numel = 20_000
    vectors = [np.full(numel, float(i + 1), dtype=np.float32) for i in range(3)]
    vectors[2][5] = math.nan  # peer 2 sends NaN in the slice of aggregator 0
    plan = plan_for(peers, numel, sizes=[numel, 0, 0], deadline=5.0)
    results = await run_round(peers, plan, vectors)
    for i in (0, 1):
        assert results[i].outcome.complete  # type: ignore[attr-defined]
        assert np.all(vectors[i] == np.float32(1.5))  # peer 2 excluded: (1 + 2) / 2
    banned = results[0].completeness[0].banned  # type: ignore[attr-defined]
    assert peers[2][0].peer_id in dict(banned)


async def test_allreduce_sender_dying_mid_part_is_dropped_at_once(nursery: trio.Nursery) -> None:
    from protocols.averaging import PartHeader, encode_header, encoded_nbytes
    from protocols.bulk import BulkHeader
    from protocols.envelope import Flags, encode_payload, frame_payload

    peers = await start_hosts(nursery, 3)
    numel = 200_000
    vectors = [np.full(numel, float(i + 1), dtype=np.float32) for i in range(3)]
    plan = plan_for(
        peers, numel, sizes=[numel, 0, 0], deadline=60.0, part_numel=numel
    )  # a long deadline: dropping must not wait; one part, so the dying peer's header fits the layout
    dying = peers[2][0]

    async def die_mid_part() -> None:
        conn = await dying._checkout_bulk(parse_multiaddr(peers[0][0].listen_addrs[0]))
        part = PartHeader(
            group_id=plan.group_id,
            round=plan.round,
            part_index=0,
            offset=0,
            numel=numel,
            codec="none",
            weight=1.0,
            nbytes=encoded_nbytes("none", numel),
        )
        header = encode_payload(BulkHeader(topic="avg.push", nbytes=part.nbytes, meta=encode_header(part)))
        await conn.send_frame(frame_payload(BulkHeader.kind, header, 0, Flags.REQUEST))
        await conn.tls.send_all(vectors[2][: numel // 2].tobytes())  # half the part, then the process "dies"
        conn.close()

    started = trio.current_time()
    async with trio.open_nursery() as group:
        group.start_soon(die_mid_part)
        results = await run_round(peers, plan, vectors, skip={2})
    assert trio.current_time() - started < 30  # the aggregator did not wait for the deadline
    for i in (0, 1):
        assert results[i].outcome.complete  # type: ignore[attr-defined]
        assert np.all(vectors[i] == np.float32(1.5))
    dropped = dict(results[0].completeness[0].dropped)  # type: ignore[attr-defined]
    assert "connection lost" in dropped[dying.peer_id]


@pytest.mark.parametrize(
    ("rule", "robust"), [("mean", False), ("centered-clip", True), ("trimmed-mean", True)]
)
async def test_the_manifests_rule_reaches_every_aggregator_and_outvotes_a_flipped_sender(
    nursery: trio.Nursery, rule: str, robust: bool
) -> None:
    from protocols.training import AveragingSpec

    peers = await start_hosts(nursery, 5)
    numel = 40_000
    rng = np.random.default_rng(7)
    honest = [(1.0 + 0.05 * rng.standard_normal(numel)).astype(np.float32) for _ in range(4)]
    flipped = (-3.0 * honest[0]).astype(np.float32)  # within the norm bound: only a robust rule resists it
    vectors = [*honest, flipped]
    plan = plan_for(peers, numel, part_numel=10_000, averaging=AveragingSpec(rule=rule))  # type: ignore[arg-type]
    results = await run_round(peers, plan, vectors)
    for result in results:
        assert result.outcome.complete  # type: ignore[attr-defined]
    for v in vectors[1:]:
        assert np.array_equal(v, vectors[0])
    centre = float(np.mean(vectors[0]))
    if robust:
        assert centre > 0.8, centre  # the honest majority's value, give or take the clipping
    else:
        assert abs(centre - 0.2) < 0.01, centre  # (4 x 1 - 3) / 5: the plain mean is dragged


@pytest.mark.parametrize("late", [0.0, 0.5])
async def test_a_hung_aggregator_holds_the_paced_pushes_only_until_its_stall_timeout(
    nursery: trio.Nursery, late: float
) -> None:
    """Pacing (shared.averaging.pacing) holds a member's pushes to the healthy aggregators behind one that
    acknowledges nothing, for half the stall timeout: only the hung aggregator's slice fails; the healthy
    slices are averaged over every member (a gate never released fails this). ``late``: the seconds a
    loaded machine takes to send part 2, the first one the gate held; held for the whole stall timeout,
    it reached the healthy aggregators after they had dropped its live sender."""
    peers = await start_hosts(nursery, 4)
    numel = 40_000
    hung = 3

    async def never_acknowledge(*args: object) -> bytes:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    peers[hung][0].bulk_handlers["avg.push"] = never_acknowledge
    for host, _ in peers:
        send_bulk = host.send_bulk

        async def descheduled(
            address: Any, topic: str, data: Any, meta: bytes = b"", sink: Any = None, send: Any = send_bulk
        ) -> bytes:
            if topic == PUSH and decode_part_header(meta).part_index == 2:
                await trio.sleep(late)
            return await send(address, topic, data, meta, sink)

        host.send_bulk = descheduled  # type: ignore[method-assign]
    vectors = [np.full(numel, float(i + 1), dtype=np.float32) for i in range(4)]
    plan = plan_for(peers, numel, part_numel=1_000, deadline=60.0)  # 10 parts per slice
    results = await run_round(peers, plan, vectors)
    hung_slice = (3 * numel // 4, numel)
    for i in range(3):
        result = results[i]
        assert result.outcome.unaveraged() == [hung_slice], result  # type: ignore[attr-defined]
        assert np.all(vectors[i][: hung_slice[0]] == np.float32(2.5))  # (1 + 2 + 3 + 4) / 4
        assert np.all(vectors[i][hung_slice[0] :] == np.float32(i + 1))  # its own values there
        assert "stalled" in result.departed[peers[hung][0].peer_id]  # type: ignore[attr-defined]
