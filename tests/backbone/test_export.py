"""`backbone export`: a stored checkpoint's model tensors as a safetensors file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from typer.testing import CliRunner

from backbone.checkpoints import CheckpointStore
from backbone.cli import app
from shared.state.blob import encode_state

runner = CliRunner()


def save_checkpoint(data_dir: Path, step: int) -> dict[str, np.ndarray]:
    model = {
        "embed.weight": np.full((4, 3), step, dtype=np.float32),
        "head.bias": np.arange(3, dtype=np.float32) + step,
    }
    tensors = {f"model/{k}": v for k, v in model.items()} | {
        "optim/embed.weight.exp_avg": np.ones((4, 3), np.float32)
    }
    blob = encode_state(tensors, {"step": str(step), "run_id": "my-run@abc", "task": "tiny-mlm"})
    CheckpointStore(data_dir / "checkpoints", keep=3).save(blob, step)
    return model


def export(data_dir: Path, output: Path, *extra: str) -> tuple[int, str]:
    result = runner.invoke(app, ["export", "--data-dir", str(data_dir), "--output", str(output), *extra])
    return result.exit_code, " ".join(result.output.split())  # rich wraps long error lines


def test_export_writes_the_newest_checkpoints_model_tensors(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 10)
    model = save_checkpoint(tmp_path, 20)
    output = tmp_path / "model.safetensors"

    code, printed = export(tmp_path, output, "--format", "safetensors")

    assert code == 0, printed
    assert str(output) in printed and "step 20" in printed and "2 tensors" in printed
    loaded = safetensors.numpy.load_file(output)
    assert loaded.keys() == model.keys()  # no `model/` prefix, no optimizer tensors
    for name, array in model.items():
        np.testing.assert_array_equal(loaded[name], array)
    with safetensors.safe_open(output, framework="numpy") as opened:
        metadata = opened.metadata()
    assert metadata == {
        "format": "pt",
        "state_format": "dedloc-state-v1",
        "step": "20",
        "run_id": "my-run@abc",
        "task": "tiny-mlm",
    }


def test_export_writes_the_checkpoint_of_a_given_step(tmp_path: Path) -> None:
    model = save_checkpoint(tmp_path, 10)
    save_checkpoint(tmp_path, 20)
    output = tmp_path / "m10.safetensors"

    code, printed = export(tmp_path, output, "--step", "10")

    assert code == 0, printed
    np.testing.assert_array_equal(safetensors.numpy.load_file(output)["head.bias"], model["head.bias"])


@pytest.mark.parametrize(
    ("setup", "extra", "message"),
    [
        (False, (), "no checkpoint in"),
        (False, (), "yet: a running backbone stores one every checkpoint_every steps"),
        (True, ("--step", "11"), "it keeps steps 10; give one of them"),
        (True, ("--format", "onnx"), "use safetensors or hf"),
    ],
)
def test_export_fails_with_exit_2_and_a_reason(
    tmp_path: Path, setup: bool, extra: tuple[str, ...], message: str
) -> None:
    if setup:
        save_checkpoint(tmp_path, 10)
    output = tmp_path / "out.safetensors"

    code, printed = export(tmp_path, output, *extra)

    assert code == 2
    assert message in printed
    assert not output.exists()


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("missing/dir/m.safetensors", "the directory {tmp}/missing/dir does not exist; create it first"),
        (".", "--output {tmp} is a directory; give a file name"),
    ],
)
def test_export_refuses_an_output_it_cannot_write_before_reading_anything(
    tmp_path: Path, output: str, message: str
) -> None:
    save_checkpoint(tmp_path, 10)

    code, printed = export(tmp_path, tmp_path / output)

    assert code == 2
    assert message.format(tmp=tmp_path) in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_export_into_a_missing_directory_is_one_line_from_the_real_cli(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 10)
    argv = ["backbone", "export", "--data-dir", str(tmp_path), "-o", "/nonexistent/dir/m.safetensors"]
    result = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: cannot write /nonexistent/dir/m.safetensors: the directory /nonexistent/dir does not exist; "
        "create it first"
    ]


def test_export_of_a_data_dir_that_does_not_exist_says_so(tmp_path: Path) -> None:
    code, printed = export(tmp_path / "nope", tmp_path / "m.safetensors")

    assert code == 2
    assert f"{tmp_path / 'nope'} is not a backbone data dir" in printed


def test_export_refuses_a_damaged_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 10)
    (path,) = (tmp_path / "checkpoints").glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    path.write_bytes(bytes(data))

    code, printed = export(tmp_path, tmp_path / "out.safetensors")

    assert code == 2
    assert "damaged" in printed
