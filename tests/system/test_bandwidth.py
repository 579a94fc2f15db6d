"""Emulated per-peer bandwidth (``tc`` on the namespace LAN of ``tests/netns.py``) and the averaging
strategies of ``scripts/bench_strategies.py`` on it (issue 4 item 7; DESIGN §5, DeDLOC Table 1).

The timing assertions are loose and relative (a measured rate against its cap, one strategy's round against
another's on the same network), never absolute wall-clock targets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scripts.bench_strategies import BenchError, parse_scenario, run_benchmark
from tests.netns import lan, netns_available, set_bandwidth, tc_available, tcp_throughput_mbps

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def _need_tc() -> None:
    reason = netns_available() or tc_available()
    if reason is not None:
        pytest.skip(f"network namespaces with tc shaping unavailable: {reason}")


def _within(measured: float, cap: float) -> bool:
    return 0.3 * cap < measured < 1.5 * cap


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.usefixtures("_need_tc")
def test_tc_caps_each_hosts_upload_and_download_separately() -> None:
    # host 1: 40 Mbit/s down, 8 up; host 2 unshaped, so each transfer below meets exactly one cap.
    with lan(3, shape=[(40, 40), (40, 8), None]) as (_, asym, free):
        up = tcp_throughput_mbps(asym, free, 1_000_000)
        down = tcp_throughput_mbps(free, asym, 5_000_000)
        assert _within(up, 8), up
        assert _within(down, 40), down
        assert down > 2.5 * up, (down, up)

        set_bandwidth(asym, 8, 40)  # replaces the caps in place: now the other way round
        up = tcp_throughput_mbps(asym, free, 5_000_000)
        down = tcp_throughput_mbps(free, asym, 1_000_000)
        assert _within(up, 40), up
        assert _within(down, 8), down


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.usefixtures("_need_tc")
def test_all_strategies_on_fast_and_slow_peers_average_exactly_and_adaptive_spares_slow_peers(
    tmp_path: Path,
) -> None:
    """Correctness on a shaped network, traced; how fast each strategy is belongs to
    scripts/bench_strategies.py (timings are not asserted in tests: on a shared 2-core machine they vary by
    tens of percent)."""
    numel = 250_000
    result = run_benchmark(
        parse_scenario("200,200,20,20"), numel, rounds=1, warmup=0, pause=0.5, trace_dir=tmp_path
    )

    strategies = result["strategies"]
    assert set(strategies) == {"all-reduce", "parameter server @0", "adaptive"}
    for name, r in strategies.items():
        assert r["incomplete_rounds"] == 0, name
        assert r["bit_identical"], name  # every peer holds the same bits
        assert r["max_rel_err"] == 0.0, name  # equal weights, short binary fractions: the mean is exact
        assert sum(r["slices"]) == numel, name
    adaptive = strategies["adaptive"]
    assert adaptive["slices"][2:] == [0, 0]  # the slow peers only send and receive
    assert all(adaptive["compute"])
    _check_trace(tmp_path, adaptive, numel)
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"dlt-{os.getpid()}-" not in listing  # the LAN is gone


def _check_trace(folder: Path, result: dict[str, Any], numel: int) -> None:
    """The trace of the adaptive round: files, link bytes that add up, and the protocol's events."""
    assert (folder / "adaptive.svg").read_text().startswith("<svg")
    trace = json.loads((folder / "adaptive.json").read_text())
    summary = result["trace"]
    assert summary == trace["summary"]
    assert result["tcp_last_round"]["OutSegs"] > 0
    for peer in summary["peers"]:
        # on the link: the protocol's payload plus headers (TCP/IP, TLS, parts), counted between readings
        # taken before the round and after it, so no byte of it is missed however late the sampler runs
        for way in ("up", "down"):
            expected = peer[f"protocol_{way}_bytes"]
            assert expected <= peer[f"{way}_bytes"] <= 1.3 * expected + 200_000, (way, peer)
        assert peer["cpu_s"] is not None and peer["cpu_s"] > 0
    events = trace["events"]
    for i, fraction in enumerate(summary_fractions := [p["fraction"] for p in summary["peers"]]):
        kinds = {e[0] for e in events[i]}
        assert "pull" in kinds
        if fraction > 0:  # an aggregator reduced every part of its slice, and served them
            assert {"reduced", "serve", "recv"} <= kinds
        else:
            assert "reduced" not in kinds
    pushed = sum(e[5] for peer_events in events for e in peer_events if e[0] == "push")
    # every member but the aggregator itself pushes its copy of each slice, 4 bytes an element
    assert pushed == sum(4 * size * (len(summary_fractions) - 1) for size in result["slices"])
    assert sum(result["slices"]) == numel


def test_scenario_parsing() -> None:
    scenario = parse_scenario("100/20,500", "0,2.5", "0,1")
    assert scenario.links == ((100.0, 20.0), (500.0, 500.0))
    assert scenario.compute == (0.0, 2.5)
    assert scenario.client_mode == (False, True)
    specs = scenario.peer_specs()
    assert (specs[0].download_bps, specs[0].upload_bps) == (12.5e6, 2.5e6)
    bad: list[tuple[str, str | None, str | None]] = [
        ("100,x", None, None),  # not a number
        ("100,100", "1", None),  # one compute rate for two peers
        ("100,100", None, "0,2"),  # a client flag not 0/1
        ("100,100", None, "1,1"),  # nobody can aggregate
        ("100,100", "0,0", None),  # nobody computes
        ("100", None, None),  # a group of one
        ("100,0", None, None),  # a zero link
    ]
    for args in bad:
        with pytest.raises(BenchError):
            parse_scenario(*args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bandwidth-mbps", "100,-5"], "bandwidths must be positive"),
        (["--bandwidth-mbps", "100,100", "--rtt-ms", "-5"], "--rtt-ms"),
    ],
)
def test_script_reports_bad_arguments_in_one_line(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_strategies.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("bench_strategies: error:") and "Traceback" not in proc.stderr
    assert message in proc.stderr
    assert proc.stdout == ""
