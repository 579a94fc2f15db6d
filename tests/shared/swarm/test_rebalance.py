"""Adaptive rebalancing (shared.swarm.rebalance): moves never empty a stage, never make the loads less even,
empty stages are refilled first, the hysteresis margin holds, moves stop (no ping-pong), and the plan is
deterministic."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.swarm.rebalance import (
    DEFAULT_HYSTERESIS,
    RATE_FACTOR,
    Move,
    ServerReport,
    bound_rates,
    load_ratio,
    place_newcomer,
    plan_rebalance,
    with_unmeasured_as_typical,
)


@st.composite
def swarms(draw: st.DrawFn) -> tuple[list[ServerReport], int, list[float]]:
    stages = draw(st.integers(1, 5))
    peers = draw(st.integers(0, 12))
    reports = [
        ServerReport(
            peer=f"p{i:02d}",
            stage=draw(st.integers(0, stages - 1)),
            rate=draw(st.one_of(st.just(0.0), st.floats(0.1, 10.0))),
            queue=draw(st.integers(0, 20)),
        )
        for i in range(peers)
    ]
    costs = draw(st.lists(st.floats(0.5, 2.0), min_size=stages, max_size=stages))
    return reports, stages, costs


def apply(reports: list[ServerReport], moves: tuple[Move, ...], costs: list[float]) -> list[ServerReport]:
    """The reports of the next period under the model: a moved peer runs at ``r k_a / k_b``, queue empty."""
    out = list(reports)
    for move in moves:
        i = next(k for k, r in enumerate(out) if r.peer == move.peer)
        assert out[i].stage == move.source
        rate = out[i].rate * costs[move.source] / costs[move.target]
        out[i] = ServerReport(move.peer, move.target, rate, 0)
    return out


def capacities(reports: list[ServerReport], stages: int) -> list[float]:
    """Each stage's summed rates, rounded once (``math.fsum``) as the planner sums them."""
    return [math.fsum(r.rate for r in reports if r.stage == k) for k in range(stages)]


@settings(max_examples=150, deadline=None)
@given(swarms(), st.integers(1, 4), st.floats(0.0, 0.5))
def test_rebalance_moves_never_empty_a_stage_nor_make_loads_less_even(
    swarm: tuple[list[ServerReport], int, list[float]], max_moves: int, h: float
) -> None:
    reports, stages, costs = swarm
    plan = plan_rebalance(reports, stages, costs=costs, hysteresis=h, max_moves=max_moves)
    after = apply(reports, plan.moves, costs)
    before_servers = Counter(r.stage for r in reports)
    after_servers = Counter(r.stage for r in after)
    for stage in before_servers:
        assert after_servers[stage] >= 1
    assert plan.capacities_after == pytest.approx(capacities(after, stages))
    assert load_ratio(plan.capacities_after) <= load_ratio(plan.capacities_before) * (1 + 1e-9)
    assert plan.throughput_after >= plan.throughput_before
    ratios = [load_ratio(capacities(reports, stages))]
    state = reports
    for move in plan.moves:  # each single move, not only their sum, keeps the ratio from growing
        state = apply(state, (move,), costs)
        ratios.append(load_ratio(capacities(state, stages)))
        assert move.source != move.target
    assert all(b <= a * (1 + 1e-9) for a, b in itertools.pairwise(ratios))


@settings(max_examples=80, deadline=None)
@given(swarms(), st.floats(0.0, 0.3))
def test_rebalance_periods_stop_moving_and_never_revisit_an_assignment(
    swarm: tuple[list[ServerReport], int, list[float]], h: float
) -> None:
    reports, stages, costs = swarm
    seen = {frozenset((r.peer, r.stage) for r in reports)}
    for _ in range(200):
        plan = plan_rebalance(reports, stages, costs=costs, hysteresis=h)
        if not plan.moves:
            break
        reports = apply(reports, plan.moves, costs)
        assignment = frozenset((r.peer, r.stage) for r in reports)
        assert assignment not in seen  # no ping-pong, no cycle
        seen.add(assignment)
    else:
        pytest.fail("rebalancing did not settle in 200 periods")


@settings(max_examples=80, deadline=None)
@given(swarms(), st.randoms(use_true_random=False))
def test_rebalance_is_deterministic_whatever_the_order_of_the_reports(
    swarm: tuple[list[ServerReport], int, list[float]], rng: random.Random
) -> None:
    reports, stages, costs = swarm
    shuffled = reports[:]
    rng.shuffle(shuffled)
    assert plan_rebalance(reports, stages, costs=costs, max_moves=3) == plan_rebalance(
        shuffled, stages, costs=costs, max_moves=3
    )
    assert place_newcomer(reports, stages, costs=costs) == place_newcomer(shuffled, stages, costs=costs)


def test_rebalance_moves_a_peer_from_the_least_to_the_most_loaded_stage() -> None:
    reports = [
        ServerReport("a", 0, 1.0),
        ServerReport("b", 1, 1.0),
        ServerReport("c", 1, 1.0),
        ServerReport("d", 1, 1.0),
        ServerReport("e", 2, 1.0),
        ServerReport("f", 2, 1.0),
    ]
    plan = plan_rebalance(reports, 3)
    assert plan.moves == (Move("b", 1, 0),)  # b, c, d are equal: the smaller id moves
    assert plan.capacities_after == (2.0, 2.0, 2.0)
    assert plan.throughput_before == 1.0 and plan.throughput_after == 2.0


def test_rebalance_prefers_the_shortest_queue_among_equal_peers() -> None:
    reports = [ServerReport("a", 0, 1.0), ServerReport("b", 1, 1.0, queue=5), ServerReport("c", 1, 1.0, 2)]
    reports.append(ServerReport("d", 1, 1.0, queue=9))
    assert plan_rebalance(reports, 2).moves == (Move("c", 1, 0),)


def test_rebalance_refills_an_empty_stage_first_even_with_a_large_margin() -> None:
    reports = [ServerReport("a", 0, 3.0, queue=4), ServerReport("b", 0, 1.0), ServerReport("c", 2, 1.0)]
    plan = plan_rebalance(reports, 3, hysteresis=100.0)
    # stage 1 is empty and stage 2's only server cannot leave; moving a or b gives the same capacities
    # up to order, so the shorter queue decides
    assert plan.moves == (Move("b", 0, 1),)
    assert plan.throughput_before == 0.0 and plan.throughput_after == 1.0


def test_rebalance_cannot_refill_when_no_stage_can_spare_a_server() -> None:
    reports = [ServerReport("a", 0, 3.0), ServerReport("c", 2, 1.0)]
    assert plan_rebalance(reports, 3).moves == ()


def test_rebalance_hysteresis_blocks_small_gains() -> None:
    reports = [ServerReport("a", 0, 10.0), ServerReport("b", 1, 10.5), ServerReport("c", 1, 1.0)]
    # moving c: capacities (11, 10.5), bottleneck 10 -> 10.5: a 5 % gain
    assert plan_rebalance(reports, 2, hysteresis=0.1).moves == ()
    assert plan_rebalance(reports, 2, hysteresis=0.01).moves == (Move("c", 1, 0),)


def test_rebalance_frees_tied_bottlenecks_one_move_at_a_time() -> None:
    reports = [
        ServerReport("a", 0, 1.0),
        ServerReport("b", 1, 1.0),
        ServerReport("c", 2, 2.0),
        ServerReport("d", 2, 2.0),
    ]
    first = plan_rebalance(reports, 3)
    assert first.moves == (Move("c", 2, 0),)
    assert first.throughput_after == first.throughput_before == 1.0  # Θ alone would have stalled here
    second = plan_rebalance(apply(reports, first.moves, [1.0] * 3), 3)
    assert second.moves == (Move("a", 0, 1),)
    assert second.capacities_after == (2.0, 2.0, 2.0)
    assert plan_rebalance(reports, 3, max_moves=5).capacities_after == (2.0, 2.0, 2.0)


def test_rebalance_frees_nearly_tied_bottlenecks_whose_measured_rates_differ_by_noise() -> None:
    # as above, but the bottlenecks' measured rates differ by 1 %: moving c into stage 1 raises the sorted
    # minimum by that 1 % only (stage 0 becomes it), below the margin; the gain is at the next position
    reports = [
        ServerReport("a", 0, 1.0),
        ServerReport("b", 1, 0.99),
        ServerReport("c", 2, 2.0),
        ServerReport("d", 2, 2.0),
    ]
    plan = plan_rebalance(reports, 3)
    assert plan.moves == (Move("c", 2, 1),)
    assert plan.throughput_after > plan.throughput_before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.97, 1.03), min_size=9, max_size=9))
def test_rebalance_moves_a_fast_server_out_of_a_stage_that_starves_two_nearly_tied_others(
    noise: list[float],
) -> None:
    # the placement bench_swarm --netns --seed 2 stayed in for 3 minutes: capacities 2 / 8.5 / 2 (speed
    # units); with measured rates (a few % off the emulated speeds) no move was ever planned
    placed = [[1.0, 1.0], [0.5, 2.0, 2.0, 4.0], [1.0, 0.5, 0.5]]
    speeds = [v for stage in placed for v in stage]
    stages = [k for k, stage in enumerate(placed) for _ in stage]
    reports = [
        ServerReport(f"p{i}", k, v * f) for i, (k, v, f) in enumerate(zip(stages, speeds, noise, strict=True))
    ]
    first = plan_rebalance(reports, 3)
    assert len(first.moves) == 1 and first.moves[0].source == 1
    for _ in range(20):  # the periods that follow, rates unchanged: close to the optimum, 4 per stage
        plan = plan_rebalance(reports, 3)
        if not plan.moves:
            break
        reports = apply(reports, plan.moves, [1.0] * 3)
    # moves stop within the hysteresis margin of the next gain, and the noise moves the optimum
    assert min(capacities(reports, 3)) >= 4.0 * min(noise) / max(noise) / (1.0 + DEFAULT_HYSTERESIS)


def test_rebalance_accounts_for_stage_costs() -> None:
    # stage 1 costs twice as much per sample: a peer moving there runs at half its rate
    reports = [ServerReport("a", 0, 4.0), ServerReport("b", 0, 4.0), ServerReport("c", 1, 1.0)]
    plan = plan_rebalance(reports, 2, costs=[1.0, 2.0])
    assert plan.moves == (Move("a", 0, 1),)
    assert plan.capacities_after == (4.0, 3.0)


def test_rebalance_makes_a_lower_ranked_move_when_the_best_would_make_loads_less_even() -> None:
    # stage 1 costs twice as much per sample. Moving b (or c) to the bottleneck stage 0 ranks best
    # leximin, (9, 23) against (9, 16), but leaves the loads less even (23/9 > 17/7): it is refused. The
    # plan used to stop there; d's move also clears the margin and evens the loads
    reports = [
        ServerReport("a", 0, 7.0),
        *(ServerReport(p, 1, r) for p, r in (("b", 8.0), ("c", 8.0), ("d", 1.0))),
    ]
    plan = plan_rebalance(reports, 2, costs=[1.0, 2.0])
    assert plan.moves == (Move("d", 1, 0),)
    assert plan.capacities_after == (9.0, 16.0)


def test_rebalance_makes_no_move_that_only_swaps_two_stages_capacities() -> None:
    # found by the property below (CI, h = 0): moving p00 swaps the two stages' capacities, no gain. The
    # planner predicted the source's sum as 8.157... - 1.203..., an ulp above 6.954..., and took the ulp
    # for a gain; its predicted sums are now exactly rounded like the capacities it reports
    reports = [
        ServerReport("p00", 0, 1.2030958755285228),
        ServerReport("p01", 1, 6.954318909184826),
        ServerReport("p02", 0, 0.0),
        ServerReport("p03", 0, 6.954318909184826),
    ]
    assert plan_rebalance(reports, 2, hysteresis=0.0).moves == ()


def passes_rule_3(before: tuple[float, ...], after: tuple[float, ...], h: float) -> bool:
    """The module docstring's rule 3, restated: a gain by the margin at a sorted position with no earlier
    position lower, and the loads no less even."""
    for old, new in zip(sorted(before), sorted(after), strict=True):
        if new < old:
            return False
        if new > old and new >= (1.0 + h) * old:
            return load_ratio(after) <= load_ratio(before)
    return False


@settings(max_examples=200, deadline=None)
@given(swarms(), st.floats(0.0, 0.3))
def test_rebalance_plans_no_move_only_when_no_single_move_passes_the_rule(
    swarm: tuple[list[ServerReport], int, list[float]], h: float
) -> None:
    reports, stages, costs = swarm
    before = tuple(capacities(reports, stages))
    if not reports or min(Counter(r.stage for r in reports).get(k, 0) for k in range(stages)) == 0:
        return  # an empty stage: the refill rule, tested apart
    plan = plan_rebalance(reports, stages, costs=costs, hysteresis=h)
    if plan.moves:  # judged on the planner's own sums: an untouched stage is then equal to the last bit
        assert passes_rule_3(plan.capacities_before, plan.capacities_after, h)
        return
    target = min(range(stages), key=lambda k: (before[k], k))
    servers = Counter(r.stage for r in reports)
    for r in reports:
        if r.stage != target and servers[r.stage] >= 2:
            after = tuple(capacities(apply(reports, (Move(r.peer, r.stage, target),), costs), stages))
            assert not passes_rule_3(before, after, h), r


def test_newcomer_joins_an_empty_stage_then_the_bottleneck() -> None:
    reports = [ServerReport("a", 0, 1.0), ServerReport("b", 2, 1.0)]
    assert place_newcomer(reports, 3) == 1
    reports.append(ServerReport("c", 1, 5.0))
    assert place_newcomer(reports, 3) == 0  # stages 0 and 2 tie at the bottleneck: the lower index
    assert place_newcomer([], 2) == 0


@pytest.mark.parametrize(
    ("reports", "stages", "match"),
    [
        ([ServerReport("a", 3, 1.0)], 3, "outside"),
        ([ServerReport("a", 0, math.nan)], 1, "rate"),
        ([ServerReport("a", 0, math.inf)], 1, "rate"),
        ([ServerReport("a", 0, -1.0)], 1, "rate"),
        ([ServerReport("a", 0, 1.0, queue=-1)], 1, "queue"),
        ([ServerReport("a", 0, 1.0), ServerReport("a", 0, 2.0)], 1, "twice"),
        ([], 0, "at least one stage"),
    ],
)
def test_rebalance_refuses_malformed_reports(reports: list[ServerReport], stages: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_rebalance(reports, stages)


def test_rebalance_refuses_bad_options() -> None:
    with pytest.raises(ValueError, match="costs"):
        plan_rebalance([], 2, costs=[1.0])
    with pytest.raises(ValueError, match="costs"):
        plan_rebalance([], 1, costs=[0.0])
    with pytest.raises(ValueError, match="hysteresis"):
        plan_rebalance([], 1, hysteresis=math.nan)
    with pytest.raises(ValueError, match="speed"):
        place_newcomer([], 1, speed=0.0)


def test_a_newcomer_serves_an_unserved_stage_before_unmeasured_ones() -> None:
    # unmeasured servers (rate 0) add no capacity, but their stage is served: the newcomer fills the gaps
    assert place_newcomer([ServerReport("a", 0, 0.0)], 3) == 1
    assert place_newcomer([ServerReport("a", 0, 0.0), ServerReport("b", 1, 0.0)], 3) == 2
    assert place_newcomer([ServerReport(p, s, 0.0) for p, s in (("a", 0), ("b", 1), ("c", 2))], 3) == 0
    assert place_newcomer([ServerReport("a", 0, 5.0), ServerReport("b", 2, 1.0)], 3) == 1


def test_newcomers_of_a_growing_run_spread_over_stages_whose_servers_have_not_measured_yet() -> None:
    # every stage served and measured (2 samples/s each); then one newcomer a period joins each stage
    # before it publishes a rate. Counted as 0, the fresh server made its stage look empty of capacity
    # and every later newcomer joined that same stage; counted as typical, they spread.
    reports = [ServerReport(f"m{k}", k, 2.0) for k in range(3)]
    for i in range(6):
        stage = place_newcomer(reports, 3, tiebreak=f"n{i}")
        reports.append(ServerReport(f"n{i}", stage, 0.0))
    assert sorted(sum(1 for r in reports if r.stage == k) for k in range(3)) == [3, 3, 3]


def test_unmeasured_servers_count_as_the_lower_median_of_the_measured_rates() -> None:
    reports = [ServerReport("a", 0, 0.0), ServerReport("b", 1, 3.0), ServerReport("c", 2, 5.0)]
    assert [r.rate for r in with_unmeasured_as_typical(reports)] == [3.0, 3.0, 5.0]
    assert [r.rate for r in with_unmeasured_as_typical([ServerReport("a", 0, 0.0)])] == [1.0]
    assert with_unmeasured_as_typical([]) == []


def test_rebalance_refills_empty_stages_from_servers_that_measured_nothing() -> None:
    # three newcomers read the records at once and all serve stage 0: no trainer gets through the empty
    # stages, so nobody ever measures a rate; the refill rule must still spread them (seen in the demo)
    reports = [ServerReport(peer, 0, 0.0) for peer in ("a", "b", "c")]
    for _ in range(2):
        plan = plan_rebalance(reports, 3)
        assert len(plan.moves) == 1
        reports = apply(reports, plan.moves, [1.0] * 3)
    assert sorted(r.stage for r in reports) == [0, 1, 2]
    assert plan_rebalance(reports, 3).moves == ()


@settings(max_examples=100, deadline=None)
@given(swarms(), st.text(min_size=1, max_size=20))
def test_a_newcomer_takes_an_unserved_stage_whatever_its_tiebreak(
    swarm: tuple[list[ServerReport], int, list[float]], peer: str
) -> None:
    reports, stages, costs = swarm
    chosen = place_newcomer(reports, stages, costs=costs, tiebreak=peer)
    unserved = set(range(stages)) - {r.stage for r in reports}
    assert 0 <= chosen < stages
    if unserved:
        assert chosen in unserved


def test_newcomers_that_see_no_server_spread_by_their_peer_ids() -> None:
    peers = [f"12D3KooW{i}" for i in range(12)]
    chosen = {place_newcomer([], 3, tiebreak=peer) for peer in peers}
    assert chosen == {0, 1, 2}
    assert place_newcomer([], 3) == 0  # no tiebreak: the lower index, as before


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 1e12)), max_size=20), st.floats(1.0, 100.0))
def test_bounded_rates_never_grow_and_stay_within_the_factor_of_the_lower_median(
    rates: list[float], factor: float
) -> None:
    reports = [ServerReport(f"p{i:02d}", i % 3, rate) for i, rate in enumerate(rates)]
    bounded = bound_rates(reports, factor)
    assert [(r.peer, r.stage, r.queue) for r in bounded] == [(r.peer, r.stage, r.queue) for r in reports]
    measured = sorted(r for r in rates if r > 0.0)
    for old, new in zip(reports, bounded, strict=True):
        assert new.rate <= old.rate
        if measured:
            assert new.rate <= factor * measured[(len(measured) - 1) // 2]
        if not measured or old.rate <= factor * measured[(len(measured) - 1) // 2]:
            assert new.rate == old.rate  # honest rates within the bound are untouched


def test_a_stranger_claiming_a_huge_rate_cannot_empty_its_stage_of_honest_servers() -> None:
    """One liar serving stage 0 claims 10^9 samples/s and processes nothing (D10c). Run the periods to
    their fixed point (no hysteresis: it only stops moves earlier). Unbounded, every honest server leaves
    stage 0: the liar alone serves it, and the run stops. Bounded, the liar counts as RATE_FACTOR honest
    servers: the stage keeps about k honest ones, 8 + k = (30 - k) / 2 at balance, k = 14/3."""

    def settle(bound: bool) -> list[ServerReport]:
        reports = [ServerReport("liar", 0, 1e9)]
        reports += [ServerReport(f"h{i:02d}", i % 3, 1.0) for i in range(30)]  # 10 honest per stage
        for _ in range(100):
            plan = plan_rebalance(bound_rates(reports) if bound else reports, 3, hysteresis=0.0)
            if not plan.moves:
                return reports
            reports = apply(reports, plan.moves, [1.0] * 3)
        raise AssertionError("rebalancing did not settle")

    def honest_in_stage_0(reports: list[ServerReport]) -> int:
        return sum(1 for r in reports if r.stage == 0 and r.peer != "liar")

    assert honest_in_stage_0(settle(bound=False)) == 0
    balance = (30 - 2 * RATE_FACTOR) / 3  # RATE_FACTOR + k = (30 - k) / 2
    assert honest_in_stage_0(settle(bound=True)) in (math.floor(balance), math.ceil(balance))


def test_bound_rates_refuses_a_factor_below_one() -> None:
    with pytest.raises(ValueError, match="factor"):
        bound_rates([ServerReport("a", 0, 1.0)], 0.5)
