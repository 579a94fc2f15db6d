"""``scripts/bench_swarm.py``: its model of fixed pipelines and swarm placements (pure), its throughput
windows and recovery figures, its refusals, and one tiny run for real (4 peers of 2 stages on loopback, in
seconds). No performance target is asserted: the run only has to report every figure."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scripts.bench_swarm import (
    best_swarm_capacity,
    fixed_capacity,
    group,
    recovery,
    stage_capacity,
    windows,
)
from volunteer.swarm.member import PERIOD_OUTCOMES

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_swarm.py"


def test_the_model_on_a_hand_computed_pool() -> None:
    order = [4.0, 1.0, 0.5, 2.0, 2.0, 1.0]
    assert group(order, 3) == [[4.0, 1.0, 0.5], [2.0, 2.0, 1.0]]
    assert fixed_capacity(group(order, 3)) == 1.5  # each pipeline at its slowest peer
    assert stage_capacity([[4.0], [2.0, 2.0], [1.0, 1.0, 0.5]]) == 2.5
    assert best_swarm_capacity(order, 3) == (3.0, True)  # {4}, {2, 1}, {2, 1, 0.5}
    assert best_swarm_capacity([1.0] * 30, 3) == (10.0, False)  # too many placements: the bound


@given(st.integers(2, 3), st.data())
def test_no_grouping_of_fixed_pipelines_beats_the_best_swarm_placement(
    stages: int, data: st.DataObject
) -> None:
    pipelines = data.draw(st.integers(1, 2))
    speeds = data.draw(
        st.lists(st.floats(0.1, 10.0), min_size=stages * pipelines, max_size=stages * pipelines)
    )
    best, exact = best_swarm_capacity(speeds, stages)
    assert exact
    # the j-th peers of the pipelines form a placement whose stages each sum at least sum_p min_p
    assert fixed_capacity(group(speeds, stages)) <= best * (1 + 1e-12)
    assert best <= math.fsum(speeds) / stages * (1 + 1e-12)


def test_windows_count_the_completions_they_hold() -> None:
    completions = [(0.5, 8), (1.5, 8), (2.5, 8), (3.5, 16)]
    got = windows(completions, 0.0, 4.0, 2.0)
    assert [end for end, _ in got] == pytest.approx([2.0, 2.4, 2.8, 3.2, 3.6, 4.0])
    assert [rate for _, rate in got] == pytest.approx([8.0, 8.0, 8.0, 8.0, 12.0, 12.0])


def test_recovery_is_the_first_window_from_which_every_later_one_holds_90_percent() -> None:
    series = [(1.0, 95.0), (2.0, 40.0), (3.0, 92.0), (4.0, 80.0), (5.0, 91.0), (6.0, 99.0)]
    figures = recovery(series, pre=100.0, kill=0.0, period=2.0)
    assert figures["recovered_s"] == 5.0 and figures["recovered_periods"] == 2.5
    assert figures["post_min_samples_per_s"] == 40.0 and figures["post_min_fraction"] == 0.4
    assert figures["final_fraction"] == 0.99
    assert recovery([(1.0, 50.0), (2.0, 80.0)], 100.0, 0.0, 1.0)["recovered_s"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--speeds", "1,1,1,1"], "multiple of --stages"),
        (["--speeds", "1,0,1,1,1,1"], "speeds must be finite and > 0"),
        (["--period", "0"], "--period must be"),
    ],
)
def test_bad_arguments_are_one_line_errors(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_tiny_run_reports_both_modes_and_the_recovery() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *("--stages", "2", "--speeds", "2,1,1,1", "--base-seconds", "0.02", "--period", "2"),
            *("--window", "2", "--observe", "2", "--max-warmup", "2", "--warmup", "1", "--join-gap", "0.3"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["stages"] == 2 and sorted(result["arrival_order"]) == [1.0, 1.0, 1.0, 2.0]
    fixed, swarm = result["fixed"], result["swarm"]
    assert sorted(map(sorted, fixed["pipelines"])) == sorted(map(sorted, group(result["arrival_order"], 2)))
    assert len(fixed["per_pipeline_samples_per_s"]) == 2
    # both modes moved micro-batches (how fast depends on the machine: no target is asserted)
    assert fixed["samples_per_s"] > 0 and swarm["samples_per_s"] > 0
    assert sorted(s for stage in swarm["placement"] for s in stage) == [1.0, 1.0, 1.0, 2.0]
    assert all(swarm["placement"])  # every stage served
    assert result["ratio"] == pytest.approx(swarm["samples_per_s"] / fixed["samples_per_s"], abs=1e-3)
    assert result["ratio_target"]["met"] in (True, False)
    rec = swarm["recovery"]
    assert len(rec["killed_speeds"]) == 1 and rec["servers"] >= 2  # a third of the most-served stage
    assert rec["pre_samples_per_s"] == swarm["samples_per_s"]
    assert rec["series"] and all(len(point) == 2 for point in rec["series"])
    assert rec["post_min_fraction"] >= 0 and rec["target"]["met"] in (True, False)
    assert 0 < rec["bound_fraction"] <= 1
    assert result["predicted_samples_per_s"]["swarm_optimum"] == 100.0  # {2, 1} and {1, 1}: 2 / 0.02
    _check_rebalancing(swarm["rebalancing_at_kill"], 4)
    _check_rebalancing(rec["rebalancing_after"], 3)


def _check_rebalancing(seen: dict[str, Any], servers: int) -> None:
    """The servers' rebalancing periods by outcome (every server ran a few by then) and what they saw."""
    assert set(seen["periods"]) <= set(PERIOD_OUTCOMES) and sum(seen["periods"].values()) > 0
    assert len(seen["capacities_seen"]) == servers
    for speed, capacities in seen["capacities_seen"]:
        assert speed in (1.0, 2.0) and (capacities is None or len(capacities) == 2)


@pytest.mark.slow
def test_a_tiny_netns_run_reports_the_same_figures_and_the_links() -> None:
    from tests.netns import netns_available, tc_available

    reason = netns_available() or tc_available()
    if reason is not None:
        pytest.skip(f"network namespaces with tc shaping unavailable: {reason}")
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *("--netns", "--netns-mbps", "50,100,100,100", "--netns-rtt-ms", "10"),
            *("--stages", "2", "--speeds", "2,1,1,1", "--base-seconds", "0.02", "--period", "2"),
            *("--window", "2", "--observe", "1", "--max-warmup", "2", "--warmup", "1", "--join-gap", "0.2"),
        ],
        capture_output=True,
        text=True,
        timeout=420,  # 6 peer processes import torch at once: 2-3 minutes on a busy 2-core machine
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    links = result["links"]
    assert links["rtt_ms"] == 10.0 and links["trainer_mbps"] == 100.0
    assert links["mbps_per_peer"] == [50.0, 100.0, 100.0, 100.0]  # in the order of --speeds
    fixed, swarm = result["fixed"], result["swarm"]
    assert fixed["samples_per_s"] > 0 and len(fixed["per_pipeline_samples_per_s"]) == 2
    assert sorted(s for stage in swarm["placement"] for s in stage) == [1.0, 1.0, 1.0, 2.0]
    for mode in (fixed, swarm):
        before, after = mode["loadavg"]
        assert len(before) == len(after) == 3 and mode["cpu_fraction"] > 0
    rec = swarm["recovery"]
    assert len(rec["killed_speeds"]) == 1 and rec["pre_samples_per_s"] == swarm["samples_per_s"]
    assert 0 < rec["bound_fraction"] <= 1 and rec["series"]
    assert set(rec["target"]) == {"fraction", "periods", "met", "reachable", "met_of_bound"}
    assert sum(len(stage) for stage in rec["placement_after"]) == 3  # the killed server is gone
    _check_rebalancing(swarm["rebalancing_at_kill"], 4)
    _check_rebalancing(rec["rebalancing_after"], 3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--netns", "--netns-mbps", "1,2"], "one per peer of --speeds"),
        (["--netns", "--netns-rtt-ms", "-1"], "--netns-rtt-ms must be"),
    ],
)
def test_bad_netns_arguments_are_one_line_errors(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert message in proc.stderr and "Traceback" not in proc.stderr
