"""The notebook one-liner (``deploy/notebooks/join.ipynb``), executed headlessly by a real Jupyter kernel
(``nbclient``) against a local pinned backbone: its one cell installs the project (from this checkout,
editable and without dependencies, into the environment the tests run in: torch is never resolved anew),
joins the run with the invite, shows the live panel in the cell, and returns when the run reaches its step
limit. The volunteer it started took the run's steps, and the panel in the cell shows them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .procs import invite, start_pinned_backbone, stop

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "deploy" / "notebooks" / "join.ipynb"
MANIFEST = """
task = "tiny-mlm"
target_batch = 32
local_batch = 8
max_steps = 3
[task_options]
d_model = 32
layers = 1
heads = 2
ffn = 64
seq_len = 32
[dataset]
generate = 1
examples_per_shard = 200
shuffle_buffer = 100
"""


def configured(run_id: str, code: str, data_dir: Path) -> object:
    """The shipped notebook with its three lines set as a user would, and a data dir for the test."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    (cell,) = [c for c in notebook.cells if c.cell_type == "code"]
    lines = cell.source.splitlines()
    assert [line.split("=")[0].strip() for line in lines[:3]] == ["SOURCE", "RUN_ID", "INVITE"], lines[:3]
    assert "%pip install -q {SOURCE}" in lines and lines[-1] == "join(RUN_ID, invite=INVITE)", lines
    lines[0] = f'SOURCE = "--no-deps -e {ROOT}"'
    lines[1] = f"RUN_ID = {run_id!r}"
    lines[2] = f"INVITE = {code!r}"
    lines[-1] = f"join(RUN_ID, invite=INVITE, data_dir={str(data_dir)!r})"
    cell.source = "\n".join(lines)
    return notebook


def test_the_notebook_joins_a_run_and_shows_its_panel(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(MANIFEST)
    backbone, _, run_id, _ = start_pinned_backbone(tmp_path / "bb", "--manifest", str(tmp_path / "run.toml"))
    try:
        code = invite(tmp_path / "bb", "colab-user")
        volunteer_dir = tmp_path / "volunteer"
        notebook = configured(run_id, code, volunteer_dir)
        client = nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3", resources={})
        client.execute()
    finally:
        stop(backbone)
    (cell,) = [c for c in notebook.cells if c.cell_type == "code"]  # type: ignore[attr-defined]
    errors = [out for out in cell.outputs if out.output_type == "error"]
    assert not errors, errors
    shown = [out["data"]["text/html"] for out in cell.outputs if "text/html" in out.get("data", {})]
    assert shown, cell.outputs  # the panel, as HTML in the cell
    steps = [json.loads(line) for line in (volunteer_dir / "steps.jsonl").read_text().splitlines()]
    assert steps and steps[-1]["step"] == 3, steps  # it trained up to the run's step limit, then left
    last = shown[-1]
    assert "step" in last and "loss" in last and run_id.split("@")[0] in last
    assert f"{steps[-1]['loss']:.4f}" in last  # the panel shows the step the volunteer took
