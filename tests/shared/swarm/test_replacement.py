"""Re-placement by the scheduler (shared.swarm.replacement): the trigger fires only on many moves, on a basis
that stood ``settle`` seconds, at most once per cooldown, falls back to single moves after ``patience``; the
placement is deterministic, keeps one current server in every served stage, serves every stage, follows
the links, and is not itself a reason to re-place again."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.swarm.links import bandwidths, round_trips
from shared.swarm.placement_cost import Workload
from shared.swarm.rebalance import ServerReport
from shared.swarm.replacement import (
    GateState,
    ReplacementConfig,
    basis,
    gate,
    is_many,
    rebalance_moves,
    replacement,
)

RUN = "run-x"
PERIOD = 2.0
CONFIG = ReplacementConfig(settle=4.0, patience=12.0, cooldown_periods=10)


def _matrices(
    peers: list[str], rtt: dict[tuple[str, str], float] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    measured: dict[str, dict[str, float]] = {}
    for (a, b), value in (rtt or {}).items():
        measured.setdefault(a, {})[b] = value
    return round_trips(peers, measured), bandwidths(peers, {})


@st.composite
def swarms(draw: st.DrawFn) -> tuple[list[ServerReport], int]:
    stages = draw(st.integers(1, 4))
    peers = draw(st.integers(1, 12))
    reports = [
        ServerReport(
            f"p{i:02d}",
            draw(st.integers(0, stages - 1)),
            draw(st.one_of(st.just(0.0), st.floats(0.5, 4.0))),
        )
        for i in range(peers)
    ]
    return reports, stages


def test_many_is_at_least_two_moves_and_a_share_of_the_servers() -> None:
    config = ReplacementConfig(fraction=0.25)
    assert not is_many(1, 4, config) and is_many(2, 4, config) and is_many(2, 8, config)
    assert not is_many(2, 9, config) and is_many(3, 9, config)
    with pytest.raises(ValueError, match="min_moves"):
        ReplacementConfig(min_moves=1)  # one move is the rebalancer's


def test_two_stages_emptied_at_once_are_many_one_is_not() -> None:
    three = [ServerReport(f"p{i}", 0, 0.0) for i in range(3)]  # two whole stages died
    assert len(rebalance_moves(three, 3)) == 2 and is_many(2, 3, CONFIG)
    one = [ServerReport("a", 0, 1.0), ServerReport("b", 0, 1.0), ServerReport("c", 1, 1.0)]
    assert len(rebalance_moves(one, 3)) == 1  # a stage's only server died: the rebalancer refills it


def _run(reads: list[list[ServerReport]], stages: int, first: int = 0) -> list[str]:
    state, verdicts = GateState(), list[str]()
    for slot, reports in enumerate(reads, first):
        verdict, state = gate(state, slot, PERIOD, reports, stages, CONFIG)
        verdicts.append(verdict)
    return verdicts


def test_the_basis_must_stand_settle_seconds_before_a_re_placement() -> None:
    starved = [ServerReport(f"p{i}", 0, 0.0) for i in range(4)]
    # settle 4 s at T = 2 s: seen at slots 0, 1, 2 -> replace at slot 2; then waiting, then cooling down
    assert _run([starved] * 4, 3) == ["wait", "wait", "replace", "wait"]
    # a read that missed a record (another basis) starts the wait over
    missed = starved[:3]
    assert _run([starved, starved, missed, missed, missed], 3) == ["wait", "wait", "wait", "wait", "replace"]


def test_a_burst_of_departures_seen_one_record_at_a_time_is_re_placed_whole() -> None:
    full = [
        *(ServerReport(f"p{i}", 0, 0.0) for i in range(4)),
        ServerReport("q", 1, 0.0),
        ServerReport("r", 2, 0.0),
    ]
    one = full[:5]  # q's record expired first: one refill, the rebalancer's, yet it waits for the burst
    both = full[:4]  # r's too: two refills
    assert _run([full, one, both, both, both], 3) == ["rebalance", "wait", "wait", "wait", "replace"]
    # a single departure is the rebalancer's, once the basis stood
    assert _run([full, one, one, one], 3) == ["rebalance", "wait", "wait", "rebalance"]


def test_at_most_one_re_placement_per_cooldown() -> None:
    starved = [ServerReport(f"p{i}", 0, 0.0) for i in range(4)]
    verdicts = _run([starved] * 30, 3)
    replaced = [i for i, v in enumerate(verdicts) if v == "replace"]
    assert replaced == [2, 12, 22]  # every cooldown_periods slots, while the plan stays many
    assert all(v == "rebalance" for v in verdicts[5:12])  # after settle: single moves, as without it


def test_a_flapping_basis_holds_single_moves_back_for_patience_only() -> None:
    a = [ServerReport(f"p{i}", 0, 0.0) for i in range(4)]
    b = [*a, ServerReport("liar", 0, 0.0)]
    verdicts = _run([a, b] * 6, 3)
    assert "replace" not in verdicts
    assert verdicts[:6] == ["wait"] * 6 and verdicts[6:] == ["rebalance"] * 6  # patience 12 s = 6 slots


@settings(max_examples=80, deadline=None)
@given(swarms(), st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_the_gate_replaces_only_on_many_moves_of_a_settled_basis(
    swarm: tuple[list[ServerReport], int], picks: list[int]
) -> None:
    reports, stages = swarm
    variants = [reports, reports[1:], reports[:-1], [r for r in reports if r.stage != 0]]
    state, last = GateState(), None
    seen: list[frozenset[tuple[str, int]]] = []
    for slot, pick in enumerate(picks):
        read = variants[pick]
        verdict, state = gate(state, slot, PERIOD, read, stages, CONFIG)
        seen.append(basis(read))
        if verdict == "replace":
            assert is_many(len(rebalance_moves(read, stages)), len(read), CONFIG)
            assert last is None or slot - last >= CONFIG.cooldown_periods
            need = math.ceil(CONFIG.settle / PERIOD)
            assert slot >= need and all(b == seen[-1] for b in seen[-need - 1 :])
            last = slot


@settings(max_examples=25, deadline=None)
@given(swarms())
def test_the_placement_is_deterministic_keeps_every_served_stage_and_serves_every_stage(
    swarm: tuple[list[ServerReport], int],
) -> None:
    reports, stages = swarm
    peers = sorted(r.peer for r in reports)
    rtt, bandwidth = _matrices(peers)
    work = Workload(stages, 1e6, 1e4)
    placed = replacement(reports, rtt, bandwidth, work, RUN, generations=10)
    again = replacement(list(reversed(reports)), rtt, bandwidth, work, RUN, generations=10)
    assert dict(placed.stages) == dict(again.stages)  # every server computes the same placement
    assert set(placed.stages) == set(peers) and all(0 <= k < stages for k in placed.stages.values())
    now = {r.peer: r.stage for r in reports}
    for k in set(now.values()):  # a stage's state stays with one of its servers
        assert any(placed.stages[p] == k for p in peers if now[p] == k)
    served = set(placed.stages.values())
    assert len(served) == min(stages, len(peers))
    assert {(m.peer, m.source, m.target) for m in placed.moves} == {
        (p, now[p], placed.stages[p]) for p in peers if placed.stages[p] != now[p]
    }


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 4), st.integers(1, 4), st.floats(0.5, 4.0))
def test_with_even_rates_the_placement_calls_for_no_further_re_placement(
    stages: int, per_stage: int, rate: float
) -> None:
    reports = [ServerReport(f"p{i:02d}", 0, rate) for i in range(stages * per_stage)]  # all in one stage
    peers = sorted(r.peer for r in reports)
    placed = replacement(reports, *_matrices(peers), Workload(stages, 1e6, 1e4), RUN, generations=10)
    after = [ServerReport(p, placed.stages[p], rate) for p in peers]
    assert not is_many(len(rebalance_moves(after, stages)), len(after), CONFIG)
    assert sorted(placed.stages.values()) == sorted(k for k in range(stages) for _ in range(per_stage))


def test_the_scheduler_groups_servers_by_site_and_keeps_the_stage_that_was_served() -> None:
    sites = {"a1": "A", "a2": "A", "b1": "B", "b2": "B", "c1": "C", "c2": "C"}
    extra = {"AA": 0.0, "BB": 0.0, "CC": 0.0, "AB": 1.0, "BC": 1.0, "AC": 5.0}
    rtt = {(p, q): 0.01 + extra["".join(sorted(sites[p] + sites[q]))] for p in sites for q in sites if p != q}
    peers = sorted(sites)
    # a mass departure left every server in stage 0 (mixed sites)
    reports = [ServerReport(p, 0, 1.0) for p in peers]
    placed = replacement(reports, *_matrices(peers, rtt), Workload(3, 1e6, 1e4), RUN, generations=50)
    groups = [{sites[p] for p in peers if placed.stages[p] == k} for k in range(3)]
    assert all(len(g) == 1 for g in groups), groups  # one site per stage: the scheduler's answer
    assert groups[1] == {"B"}  # the far link A-C is not in the pipeline
    assert sum(k == 0 for k in placed.stages.values()) == 2 and len(placed.moves) == 4
