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

    result = subprocess.run(
        [sys.executable, str(DEMO), "--seconds", "30", "--volunteers", "2", "--work-dir", str(work)],
        capture_output=True, text=True, env=ENV, timeout=300, check=False,
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
