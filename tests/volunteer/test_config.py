"""The volunteer's config file and environment (:mod:`volunteer.config`): every flag has a key, the
precedence is command line > environment > file > default, and every bad input is one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main

from shared.errors import ConfigError
from volunteer.cli import app
from volunteer.config import CONFIG_NAME, join_defaults, parameter_keys

JOIN = typer.main.get_command(app).commands["join"]  # type: ignore[attr-defined]


def parsed(argv: list[str], environ: dict[str, str]) -> dict[str, Any]:
    """``volunteer join`` ``argv`` as the CLI parses it with the file's and environment's defaults."""
    defaults = join_defaults(JOIN, ["join", *argv], environ)
    ctx = JOIN.make_context("join", list(argv), default_map=defaults)
    return dict(ctx.params)


def write(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CONFIG_NAME
    path.write_text(text)
    return path


def test_every_flag_has_a_key() -> None:
    keys = parameter_keys(JOIN)
    flags = {opt[2:] for param in JOIN.params for opt in param.opts if opt.startswith("--")}
    assert flags <= set(keys) | {"v"}, flags - set(keys)
    assert {"run-id", "micro-batch", "initial-peer", "panel", "data-dir", "invite"} <= set(keys)


def test_the_data_dirs_file_sets_the_flags(tmp_path: Path) -> None:
    write(
        tmp_path,
        'run-id = "my-run@4fT9"\nmicro-batch = 8\npanel = false\ndevice = "cpu"\n'
        'initial-peer = ["/ip4/203.0.113.7/tcp/4001", "/ip4/203.0.113.8/tcp/4001"]\nthreads = 1\n',
    )
    params = parsed(["--data-dir", str(tmp_path)], {})
    assert params["run_id"] == "my-run@4fT9"
    assert params["micro_batch"] == 8 and params["panel"] is False and params["threads"] == 1
    assert list(params["initial_peer"]) == ["/ip4/203.0.113.7/tcp/4001", "/ip4/203.0.113.8/tcp/4001"]


def test_the_environment_overrides_the_file_and_the_command_line_overrides_both(tmp_path: Path) -> None:
    config = write(tmp_path / "elsewhere", "micro_batch = 8\ndevice = 'cpu'\nevaluate = true\n")
    env = {
        "VOLUNTEER_MICRO_BATCH": "16",
        "VOLUNTEER_PANEL": "false",
        "VOLUNTEER_LISTEN": "/ip4/0.0.0.0/tcp/1 /ip4/0.0.0.0/tcp/2",
    }
    params = parsed(["--config", str(config)], env)
    assert params["micro_batch"] == 16 and params["device"] == "cpu" and params["evaluate"] is True
    assert params["panel"] is False and list(params["listen"]) == ["/ip4/0.0.0.0/tcp/1", "/ip4/0.0.0.0/tcp/2"]
    params = parsed(["--config", str(config), "--micro-batch", "32", "--panel"], env)
    assert params["micro_batch"] == 32 and params["panel"] is True


def test_the_data_dir_from_the_environment_locates_the_file(tmp_path: Path) -> None:
    write(tmp_path, "micro-batch = 4\n")
    params = parsed([], {"VOLUNTEER_DATA_DIR": str(tmp_path)})
    assert params["micro_batch"] == 4 and Path(params["data_dir"]) == tmp_path


def test_no_file_no_change(tmp_path: Path) -> None:
    params = parsed(["--data-dir", str(tmp_path)], {})
    assert params["micro_batch"] == 0 and params["panel"] is None and params["device"] == "auto"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("micro_btch = 3\n", "no flag --micro_btch (did you mean 'micro-batch'?)"),
        ("micro-batch = 'many'\n", "micro-batch: 'many' is not a valid integer"),
        ("micro-batch = [1, 2]\n", "micro-batch: give one value"),
        ("initial-peer = '/ip4/1.2.3.4/tcp/1'\n", None),  # one string for a repeatable flag: split
        ("initial-peer = [[1]]\n", "is not a single value"),
        ("config = 'other.toml'\n", "no flag --config"),
        ("micro-batch = \n", "is not valid TOML"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_and_key(
    tmp_path: Path, text: str, expected: str | None
) -> None:
    path = write(tmp_path, text)
    if expected is None:
        parsed(["--data-dir", str(tmp_path)], {})
        return
    with pytest.raises(ConfigError) as caught:
        parsed(["--data-dir", str(tmp_path)], {})
    assert expected in str(caught.value) and str(path) in str(caught.value), caught.value


def test_a_bad_variable_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\$VOLUNTEER_THREADS: 'two' is not a valid integer"):
        parsed(["--data-dir", str(tmp_path)], {"VOLUNTEER_THREADS": "two"})


def test_a_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        parsed(["--config", str(tmp_path / "nope.toml")], {})


def test_the_command_exits_2_with_one_line(tmp_path: Path) -> None:
    """The real console script: the file is read before anything heavy is imported."""
    write(tmp_path, "micro-batch = 'many'\n")
    env = {**os.environ, "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-c", "from volunteer.cli import main; main()", "join", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "micro-batch: 'many' is not a valid integer" in lines[0], result.stderr
