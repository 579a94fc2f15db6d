"""The main job, ``scripts/demo.py``, end to end (shortened): a backbone and two invited volunteers train on
loopback, every node leaves with exit code 0, the ledger credits both volunteers and the loss fell."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .procs import ENV, cli

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"


def test_demo_trains_stops_cleanly_and_prints_the_ledger(tmp_path: Path) -> None:
    work = tmp_path / "work"

    # Until the ledger recorded step 10, not for a fixed time: the assertions below need steps (5 of them
    # in the curve, a loss that fell by 0.5), and on a loaded machine the start-up took half of a 30-s
    # demo (6 steps, the loss fell by 0.45). --seconds only bounds a demo that does not train.
    result = subprocess.run(
        [
            sys.executable, str(DEMO), "--until-step", "10", "--seconds", "180", "--volunteers", "2",
            "--work-dir", str(work),
        ],
        capture_output=True, text=True, env=ENV, timeout=400, check=False,
    )  # fmt: skip

    shown = result.stdout
    assert result.returncode == 0, f"{shown[-4000:]}\n{result.stderr[-2000:]}"
    assert f"work dir (data dirs, manifest, one log per process): {work}" in shown
    assert "volunteer1: exit code 0" in shown and "volunteer2: exit code 0" in shown
    assert "backbone: exit code 0" in shown and "every node left cleanly" in shown
    assert "contributions" in shown and "loss curve" in shown  # the leaderboard, then the steps view
    assert {p.name for p in work.glob("*.log")} == {"backbone.log", "volunteer1.log", "volunteer2.log"}

    def ledger(*extra: str) -> object:
        argv = cli("backbone", "ledger", "--data-dir", str(work / "backbone"), "--json", *extra)
        return json.loads(subprocess.run(argv, capture_output=True, text=True, env=ENV, check=True).stdout)

    board = ledger()
    assert isinstance(board, list)
    assert {row["username"] for row in board if row["samples"] > 0} == {"volunteer1", "volunteer2"}
    steps = ledger("--steps", "--last", "5")
    assert isinstance(steps, dict)
    assert steps["curve_steps"] >= 5
    curve = [point["loss"] for point in steps["curve"]]
    assert curve[-1] < curve[0] - 0.5, curve  # from about 6.4 (chance): it visibly fell
    assert_steps_hold_the_target_batch(work, target=128)  # the demo manifest's target_batch


def assert_steps_hold_the_target_batch(work: Path, target: int) -> None:
    """Issue 11: steps held 1.1-2x the target batch. Each volunteer's steps.jsonl says what it put into
    each step and the step's whole batch; they agree, and the median step holds at most 1.5x the target
    (the benchmark's bar is 1.1x; this bound leaves room for a loaded machine)."""
    ours: dict[int, int] = {}
    claimed: dict[int, set[int]] = {}
    for path in work.glob("volunteer*/steps.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            ours[row["step"]] = ours.get(row["step"], 0) + row["samples"]
            claimed.setdefault(row["step"], set()).add(row["batch"])
    assert len(ours) >= 5, ours
    assert all(len(batches) == 1 for batches in claimed.values()), claimed  # every member says the same
    batches = sorted(next(iter(claimed[step])) for step in ours)
    assert batches[len(batches) // 2] <= 1.5 * target, batches
    # a step every volunteer took: its batch is exactly the sum of what they put in
    whole = [step for step, got in ours.items() if next(iter(claimed[step])) == got]
    assert len(whole) >= len(ours) // 2, (ours, claimed)
