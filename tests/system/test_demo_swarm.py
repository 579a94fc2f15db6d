"""``scripts/demo --sync swarm`` end to end (shortened): four volunteers serve the three stages of a
pipeline and run trainers; every stage steps, the servers of a stage hold identical parameters, the
volunteer that the demo stops half-way hands its stage over without the stage losing its steps, a
volunteer moves to refill it, and the loss of the last stage falls."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shared.manifest import load_training_spec

from .procs import ENV

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"
UNTIL = 12  # every stage's step at the end
STAGES = 3


def _rows(work: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        path.parent.name: [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(work.glob("volunteer*/steps.jsonl"))
    }


def test_demo_in_swarm_mode_trains_stages_and_refills_the_one_a_volunteer_left(tmp_path: Path) -> None:
    work = tmp_path / "work"
    argv = [sys.executable, str(DEMO), "--sync", "swarm", "--until-step", str(UNTIL), "--seconds", "300"]
    result = subprocess.run(
        [*argv, "--work-dir", str(work)], capture_output=True, text=True, env=ENV, timeout=600, check=False
    )
    shown = result.stdout
    assert result.returncode == 0, f"{shown[-4000:]}\n{result.stderr[-2000:]}"
    assert "every node left cleanly" in shown
    spec = load_training_spec(work / "manifest.toml")
    assert (spec.sync.mode, spec.sync.stages) == ("swarm", STAGES)

    rows = _rows(work)
    assert len(rows) == 4
    reached = {
        k: max((r["step"] for vs in rows.values() for r in vs if r["stage"] == k), default=0)
        for k in range(STAGES)
    }
    assert all(step >= UNTIL for step in reached.values()), reached

    # the servers of a stage step together: one fingerprint per (stage, step), whoever took it
    fingerprints: dict[tuple[int, int], set[str]] = {}
    for volunteer_rows in rows.values():
        for r in volunteer_rows:
            fingerprints.setdefault((r["stage"], r["step"]), set()).add(r["fingerprint"])
    forks = {key: prints for key, prints in fingerprints.items() if len(prints) > 1}
    assert not forks, forks

    # the volunteer stopped half-way handed its stage over: the stage went on from its step
    match = re.search(r"stopping (volunteer\d) \(serving stage (\d)", shown)
    assert match is not None, shown[-3000:]
    departed, stage = match.group(1), int(match.group(2))
    mine = [r for r in rows[departed] if r["stage"] == stage]
    left_at = max((r["step"] for r in mine), default=0)
    left_time = max((r["time"] for r in mine), default=0.0)
    later = [
        r
        for name, vs in rows.items()
        if name != departed
        for r in vs
        if r["stage"] == stage and r["time"] > left_time
    ]
    assert later, f"nobody served stage {stage} after {departed} left"
    assert min(r["step"] for r in later) > left_at, (
        f"stage {stage} restarted below step {left_at}: {later[:3]}"
    )
    log = (work / f"{departed}.log").read_text()
    assert re.search(r"is served by \S+ now: leaving it", log), log[-3000:]

    # rebalancing moved someone (a stage left alone was refilled), and every volunteer carried samples
    facts = {name: json.loads((work / name / "swarm.json").read_text()) for name in rows}
    assert any(f["moves"] for f in facts.values()), facts
    assert all(f["trainer_samples"] > 0 for f in facts.values()), facts

    last_stage = sorted(
        (r for vs in rows.values() for r in vs if r["stage"] == STAGES - 1), key=lambda r: r["time"]
    )
    losses = [r["loss"] for r in last_stage if r["loss"] is not None]
    assert len(losses) >= 6
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
