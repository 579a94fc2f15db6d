"""Issue 12 item 7 with real processes: a backbone of the built-in tiny-mlm run and one volunteer with
``--evaluate``: the volunteer evaluates each step's parameters on the held-out shard the backbone
wrote, publishes it signed, and ``backbone ledger --steps`` shows the held-out loss beside the training
loss."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest

from .procs import ENV, cli, stop
from .test_training import Backbone, Volunteer, wait_for

pytestmark = pytest.mark.slow

MANIFEST = """
task = "tiny-mlm"
target_batch = 256
local_batch = 8
[task_options]
d_model = 16
layers = 1
heads = 2
ffn = 32
seq_len = 24
[schedule]
kind = "constant"
[dataset]
generate = 1
examples_per_shard = 200
shuffle_buffer = 50
eval_examples = 32
eval_every = 1
"""


def ledger_steps(backbone: Backbone, *extra: str) -> str:
    argv = cli("backbone", "ledger", "--data-dir", str(backbone.dir), "--steps", "--last", "200", *extra)
    return subprocess.run(argv, capture_output=True, text=True, env=ENV, check=True, timeout=60).stdout


def evaluated_steps(backbone: Backbone) -> dict[int, float]:
    steps = json.loads(ledger_steps(backbone, "--json"))["steps"]
    return {s["global_step"]: s["eval_loss"] for s in steps if s["eval_loss"] is not None}


def evaluated_in_database(backbone: Backbone) -> bool:
    """Whether a recorded step has an evaluation (read directly: cheaper than a CLI process per poll)."""
    path = backbone.dir / "ledger.sqlite3"
    if not path.exists():
        return False
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
        try:
            query = "SELECT COUNT(*) FROM evaluations e JOIN steps s ON s.global_step = e.step"
            return bool(db.execute(query).fetchone()[0])
        except sqlite3.OperationalError:  # the backbone has not made its tables yet
            return False


def test_a_volunteer_with_evaluate_puts_the_held_out_loss_beside_the_training_loss(tmp_path: Path) -> None:
    backbone = Backbone(tmp_path, MANIFEST)
    backbone.start()
    volunteer = Volunteer(tmp_path, "alice", backbone, "--evaluate")
    try:
        wait_for(lambda: evaluated_in_database(backbone), "an evaluated step in the ledger", 240, [volunteer])
        table = ledger_steps(backbone)
    finally:
        results = stop(volunteer.proc, within=40) if volunteer.alive() else None
        assert backbone.proc is not None
        stop(backbone.proc, within=30)
    assert results is None or results[0] == 0, volunteer.log.read_text()[-3000:]
    log = volunteer.log.read_text()
    published = re.findall(r"evaluated step (\d+): held-out loss ([0-9.]+) over 32 examples", log)
    assert published, log[-3000:]
    shown = evaluated_steps(backbone)
    for step, loss in published:
        if int(step) in shown:
            assert shown[int(step)] == pytest.approx(float(loss), abs=1e-4)  # what the volunteer computed
    assert "eval loss" in table and "*" in table  # one evaluator: single-sourced, marked
