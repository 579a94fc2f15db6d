"""The placement scheduler (seed 002 §3): cost model against hand computations and brute force, the search
against exhaustive enumeration, and invariants of every placement."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.swarm.placement_cost import (
    Network,
    Workload,
    best_order,
    data_parallel_cost,
    iteration_cost,
    lower_bound,
    pipeline_cost,
    pipeline_edge_cost,
    random_placement,
)
from shared.swarm.scheduler import SearchConfig, schedule

MB = 1e6


def _net(n: int, seed: int, regions: int = 0) -> Network:
    """Random symmetric links; with ``regions``, fast inside a region and slow across (like seed 002 §4.1)."""
    rng = np.random.default_rng(seed)
    delay = rng.uniform(0.001, 0.2, (n, n))
    bandwidth = rng.uniform(10 * MB, 250 * MB, (n, n))
    if regions:
        region = rng.integers(0, regions, n)
        same = region[:, None] == region[None, :]
        delay = np.where(same, delay / 50, delay)
        bandwidth = np.where(same, bandwidth * 10, bandwidth)
    return Network.from_directed(delay, bandwidth)


def _balanced_partitions(n: int, s: int) -> list[list[tuple[int, ...]]]:
    """Every partition of 0..n-1 into s unordered groups of n/s (the smallest device opens each group)."""
    size = n // s

    def rec(left: tuple[int, ...]) -> list[list[tuple[int, ...]]]:
        if not left:
            return [[]]
        first, rest = left[0], left[1:]
        out = []
        for others in itertools.combinations(rest, size - 1):
            remaining = tuple(x for x in rest if x not in others)
            out.extend([[(first, *others), *tail] for tail in rec(remaining)])
        return out

    return rec(tuple(range(n)))


def _brute_iteration_cost(net: Network, work: Workload, stages: list[tuple[int, ...]]) -> float:
    """Eqs. 2-3 literally: every device's sum, every perfect matching of every adjacent pair of groups."""
    size = len(stages[0])
    dp = max(
        sum(2 * (net.delay[d, e] + work.stage_bytes / (size * net.bandwidth[d, e])) for e in group if e != d)
        for group in stages
        for d in group
    )
    pp = 0.0
    for a, b in itertools.pairwise(stages):
        pp += min(
            max(
                2 * (net.delay[x, y] + work.activation_bytes / net.bandwidth[x, y])
                for x, y in zip(a, perm, strict=True)
            )
            for perm in itertools.permutations(b)
        )
    return dp + pp


# -- the cost model by hand --------------------------------------------------------------------------------


def test_iteration_cost_matches_hand_computation_on_four_devices() -> None:
    delay = np.array(
        [
            [0.0, 0.01, 0.1, 0.3],
            [0.01, 0.0, 0.2, 0.05],
            [0.1, 0.2, 0.0, 0.02],
            [0.3, 0.05, 0.02, 0.0],
        ]
    )
    net = Network(delay, np.full((4, 4), 1 * MB))
    work = Workload(stages=2, stage_bytes=2 * MB, activation_bytes=1 * MB)
    # DP: shard 2 MB / 2 devices at 1 MB/s = 1 s; group {0,1}: 2 (0.01 + 1) = 2.02; {2,3}: 2 (0.02 + 1) = 2.04
    assert data_parallel_cost(net, work, (0, 1)) == pytest.approx(2.02)
    assert data_parallel_cost(net, work, (2, 3)) == pytest.approx(2.04)
    # PP pairs 2 (alpha + 1): 0-2 2.2, 0-3 2.6, 1-2 2.4, 1-3 2.1;
    # matchings {0-2, 1-3} max 2.2, {0-3, 1-2} max 2.6
    assert pipeline_edge_cost(net, work, (0, 1), (2, 3)) == pytest.approx(2.2)
    cost = iteration_cost(net, work, ((0, 1), (2, 3)))
    assert cost.data_parallel == pytest.approx(2.04)
    assert cost.pipeline == pytest.approx(2.2)
    assert cost.total == pytest.approx(4.24)


def test_data_parallel_cost_is_the_slowest_devices_sum_on_three_devices() -> None:
    delay = np.array([[0.0, 0.1, 0.2], [0.1, 0.0, 0.4], [0.2, 0.4, 0.0]])
    bandwidth = np.array([[1.0, 3.0, 1.5], [3.0, 1.0, 1.0], [1.5, 1.0, 1.0]]) * MB
    net = Network(delay, bandwidth)
    work = Workload(stages=1, stage_bytes=3 * MB, activation_bytes=0.0)
    # shard 1 MB: pairs 2 (alpha + 1/β): 0-1 2 (0.1 + 1/3), 0-2 2 (0.2 + 2/3), 1-2 2 (0.4 + 1)
    sums = [2 * (0.1 + 1 / 3) + 2 * (0.2 + 2 / 3), 2 * (0.1 + 1 / 3) + 2.8, 2 * (0.2 + 2 / 3) + 2.8]
    assert data_parallel_cost(net, work, (0, 1, 2)) == pytest.approx(max(sums))
    assert iteration_cost(net, work, ((0, 1, 2),)).total == pytest.approx(max(sums))


def test_best_order_solves_the_open_path_on_three_single_device_stages() -> None:
    delay = np.array([[0.0, 1.0, 5.0], [1.0, 0.0, 2.0], [5.0, 2.0, 0.0]])
    net = Network(delay, np.full((3, 3), math.inf))
    work = Workload(stages=3, stage_bytes=1.0, activation_bytes=1.0)
    # pairs cost 2alpha: 0-1 2, 1-2 4, 0-2 10; the path 0-1-2 (or reversed) costs 6; DP is 0 with one device
    assert iteration_cost(net, work, ((0,), (2,), (1,))).total == pytest.approx(14.0)
    stages, cost = best_order(net, work, ((0,), (2,), (1,)))
    assert stages in (((0,), (1,), (2,)), ((2,), (1,), (0,)))
    assert cost.total == pytest.approx(6.0)
    assert cost.data_parallel == 0.0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(4, 2), (6, 2), (6, 3), (6, 1), (4, 4)]))
def test_iteration_cost_matches_brute_force_over_matchings(seed: int, shape: tuple[int, int]) -> None:
    n, s = shape
    net = _net(n, seed)
    work = Workload(stages=s, stage_bytes=50 * MB, activation_bytes=20 * MB)
    stages = list(random_placement(n, s, np.random.default_rng(seed)))
    assert iteration_cost(net, work, stages).total == pytest.approx(_brute_iteration_cost(net, work, stages))
    _, best = best_order(net, work, stages)
    by_permutation = min(
        iteration_cost(net, work, list(order)).total for order in itertools.permutations(stages)
    )
    assert best.total == pytest.approx(by_permutation)


def test_best_order_beyond_exact_size_returns_a_valid_path() -> None:
    n = 14  # above EXACT_TSP_MAX_STAGES: the 2-opt heuristic
    net = _net(n, 3, regions=3)
    work = Workload(stages=n, stage_bytes=MB, activation_bytes=MB)
    stages, cost = best_order(net, work, [(d,) for d in range(n)])
    assert sorted(x for g in stages for x in g) == list(range(n))
    assert cost.total == pytest.approx(pipeline_cost(net, work, stages))
    assert cost.total <= iteration_cost(net, work, [(d,) for d in range(n)]).total


# -- validation --------------------------------------------------------------------------------------------


def test_network_rejects_bad_matrices() -> None:
    ok = np.ones((3, 3))
    with pytest.raises(ValueError, match="square"):
        Network(np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="differ in shape"):
        Network(ok, np.ones((2, 2)))
    with pytest.raises(ValueError, match="delays"):
        Network(-ok, ok)
    with pytest.raises(ValueError, match="bandwidths"):
        Network(ok, np.zeros((3, 3)))
    asym = ok.copy()
    asym[0, 1] = 2.0
    with pytest.raises(ValueError, match="symmetric"):
        Network(asym, ok)
    net = Network.from_directed(asym, ok)
    assert net.delay[0, 1] == net.delay[1, 0] == 1.5


def test_workload_and_placements_are_validated() -> None:
    with pytest.raises(ValueError, match="stages"):
        Workload(stages=0, stage_bytes=1.0, activation_bytes=1.0)
    with pytest.raises(ValueError, match="stage_bytes"):
        Workload(stages=1, stage_bytes=-1.0, activation_bytes=1.0)
    net = _net(4, 0)
    with pytest.raises(ValueError, match="divide"):
        schedule(net, Workload(stages=3, stage_bytes=1.0, activation_bytes=1.0))
    work = Workload(stages=2, stage_bytes=1.0, activation_bytes=1.0)
    with pytest.raises(ValueError, match="exactly once"):
        iteration_cost(net, work, ((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="N / S"):
        iteration_cost(net, work, ((0,), (1, 2, 3)))
    with pytest.raises(ValueError, match="groups given"):
        iteration_cost(net, work, ((0, 1, 2, 3),))
    with pytest.raises(ValueError, match="population"):
        SearchConfig(population=1)
    with pytest.raises(ValueError, match="mutations"):
        SearchConfig(mutations=-1)
    with pytest.raises(ValueError, match="time_limit"):
        SearchConfig(time_limit=-1.0)


# -- the search --------------------------------------------------------------------------------------------


def test_schedule_is_within_the_stated_bound_of_the_exhaustive_optimum_up_to_eight_devices() -> None:
    """Stated bound, measured with population 16 and 60 generations on seeds 0-29 of these shapes (240
    instances): 238 exactly optimal, worst gap 0.38% (seeds 0-9: all 80 optimal). Asserted on seeds 0-2:
    every gap <= 1% and >= 95% of the instances exactly optimal."""
    gaps = []
    for n, s in [(6, 2), (6, 3), (8, 2), (8, 4)]:
        partitions = _balanced_partitions(n, s)
        for seed in range(3):
            for regions in (0, 3):
                net = _net(n, seed, regions)
                work = Workload(stages=s, stage_bytes=100 * MB, activation_bytes=30 * MB)
                optimum = min(best_order(net, work, p)[1].total for p in partitions)
                config = SearchConfig(population=16, generations=60, time_limit=None)
                placement = schedule(net, work, seed=seed, config=config)
                assert placement.exact_order
                gaps.append(placement.cost.total / optimum - 1)
    assert min(gaps) >= -1e-9  # nothing beats the exhaustive optimum
    assert max(gaps) <= 0.01
    assert sum(g <= 1e-9 for g in gaps) >= 0.95 * len(gaps)


def test_schedule_is_deterministic_under_a_seed_without_time_limit() -> None:
    net = _net(16, 7, regions=4)
    work = Workload(stages=4, stage_bytes=100 * MB, activation_bytes=30 * MB)
    config = SearchConfig(population=6, generations=4, time_limit=None)
    a, b = schedule(net, work, seed=5, config=config), schedule(net, work, seed=5, config=config)
    assert a.stages == b.stages
    assert a.cost == b.cost


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(8, 2), (8, 4), (9, 3), (12, 4), (12, 3), (5, 5)]))
def test_schedule_places_every_device_once_and_never_beats_the_lower_bound(
    seed: int, shape: tuple[int, int]
) -> None:
    n, s = shape
    net = _net(n, seed, regions=seed % 4)
    work = Workload(stages=s, stage_bytes=80 * MB, activation_bytes=40 * MB)
    placement = schedule(
        net, work, seed=seed, config=SearchConfig(population=4, generations=3, time_limit=None)
    )
    assert len(placement.stages) == s
    assert all(len(g) == n // s for g in placement.stages)
    assert sorted(d for g in placement.stages for d in g) == list(range(n))
    assert 0 <= placement.best_found_s <= placement.seconds
    recomputed = iteration_cost(net, work, placement.stages)
    assert recomputed.total == pytest.approx(placement.cost.total)
    bound = lower_bound(net, work)
    assert placement.cost.total >= bound * (1 - 1e-12)
    random_cost = iteration_cost(net, work, random_placement(n, s, np.random.default_rng(seed))).total
    assert random_cost >= bound * (1 - 1e-12)


def test_schedule_beats_the_median_random_placement_on_clustered_devices() -> None:
    net = _net(24, 11, regions=4)
    work = Workload(stages=4, stage_bytes=100 * MB, activation_bytes=30 * MB)
    placement = schedule(net, work, seed=1, config=SearchConfig(population=8, generations=6, time_limit=None))
    rng = np.random.default_rng(0)
    randoms = sorted(iteration_cost(net, work, random_placement(24, 4, rng)).total for _ in range(21))
    assert placement.cost.total < randoms[10]
    assert placement.cost.total <= randoms[0]
