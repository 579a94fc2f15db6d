"""The CLIs' help as a newcomer reads it: instant (no torch behind `--help`), every option described,
defaults shown whole, and the per-user default data dir that `--help` promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from backbone.cli import app as backbone_app
from backbone.ledger import LedgerStore
from shared.console import default_data_dir, shown_path
from volunteer.cli import app as volunteer_app

pytestmark = pytest.mark.slow

#: What `backbone --help` must not wait for: the ledger's SQLAlchemy and the service's HTTP stack.
BACKBONE_HEAVY = ("torch", "sqlalchemy", "hypercorn", "starlette", "backbone.service", "backbone.ledger")
#: What `volunteer`'s input errors must not wait for: torch and what needs it, the datasets and
#: transformers stacks, the daemon.
VOLUNTEER_HEAVY = ("torch", "datasets", "transformers", "volunteer.daemon", "volunteer.session")
#: What its help must not wait for either: the network stack's service code.
VOLUNTEER_HELP_HEAVY = (*VOLUNTEER_HEAVY, "shared.net.host", "shared.dht.node", "volunteer.capabilities")

#: Runs ``APP(ARGS)`` in a fresh interpreter and prints, as its last line, the exit code and which of
#: ``HEAVY`` got imported.
_CHILD = """
import json, sys
from {module} import app
try:
    app({args!r}, prog_name={prog!r})
    code = 0
except SystemExit as exit:
    code = exit.code
print()
print(json.dumps({{"code": code, "imported": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def run_child(module: str, args: list[str], heavy: tuple[str, ...]) -> tuple[int, list[str], str]:
    prog = module.split(".")[0]
    script = _CHILD.format(module=module, args=args, prog=prog, heavy=heavy)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["code"], report["imported"], result.stdout + result.stderr


@pytest.mark.parametrize(
    ("module", "args", "heavy"),
    [
        ("volunteer.cli", ["--help"], VOLUNTEER_HELP_HEAVY),
        ("volunteer.cli", ["join", "--help"], VOLUNTEER_HELP_HEAVY),
        ("backbone.cli", ["--help"], BACKBONE_HEAVY),
        ("backbone.cli", ["start", "--help"], BACKBONE_HEAVY),
    ],
)
def test_help_does_not_import_torch(module: str, args: list[str], heavy: tuple[str, ...]) -> None:
    code, imported, output = run_child(module, args, heavy)

    assert code == 0, output
    assert "Usage:" in output
    assert imported == []


def test_volunteer_input_errors_come_before_torch(tmp_path: Path) -> None:
    args = ["join", "bad run id!", "--no-panel", "--data-dir", str(tmp_path / "v")]

    code, imported, output = run_child("volunteer.cli", args, VOLUNTEER_HEAVY)

    assert code == 2, output
    assert "run id" in output
    assert imported == []


def commands(app: typer.Typer, name: str) -> list[tuple[list[str], Any]]:
    """Every command and group of ``app`` (click objects: typer may vendor its own click) with the
    arguments that reach it, the root first."""
    found: list[tuple[list[str], Any]] = []

    def walk(path: list[str], command: Any) -> None:
        found.append((path, command))
        if hasattr(command, "commands"):
            for sub, child in command.commands.items():
                walk([*path, sub], child)

    walk([], typer.main.get_command(app))
    assert len(found) > 1, name
    return found


ALL = [
    (app, name, path, command)
    for app, name in ((volunteer_app, "volunteer"), (backbone_app, "backbone"))
    for path, command in commands(app, name)
]


@pytest.mark.parametrize(
    ("app", "name", "path", "command"), ALL, ids=[" ".join([n, *p]) for _, n, p, _ in ALL]
)
def test_help_reads_well_at_80_columns(app: typer.Typer, name: str, path: list[str], command: Any) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], prog_name=name, terminal_width=80)
    text = result.output

    assert result.exit_code == 0, text
    assert text.startswith(f"Usage: {' '.join([name, *path])} ")
    # typer >= 0.27 writes `{run_id}` and `<str>`, >= 0.29 `<bool>` after every flag.
    assert "<bool>" not in text and "<str>" not in text and "{" not in text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    listed = text.partition("\nCommands:\n")[2].splitlines()
    assert not [line for line in listed if line.endswith("...")], "a summary is cut short"
    summary = (command.help or "").strip().splitlines()[0]
    assert summary.endswith("."), f"{summary!r}: one sentence"
    assert "(dynamic)" not in text  # a default_factory's default, not shown
    for param in command.params:
        described = getattr(param, "help", None) or ""
        assert described.strip(), f"{' '.join([name, *path])}: {param.name} has no description"


def test_help_shows_the_default_data_dirs_whole() -> None:
    runner = CliRunner()
    join = runner.invoke(volunteer_app, ["join", "--help"], terminal_width=80).output
    start = runner.invoke(backbone_app, ["start", "--help"], terminal_width=80).output

    assert shown_path(default_data_dir("volunteer")) in " ".join(join.split())
    assert shown_path(default_data_dir("backbone")) in " ".join(start.split())
    assert "RUN_ID" in join.splitlines()[0]


def test_backbone_commands_use_the_per_user_data_dir_by_default(tmp_path: Path) -> None:
    data_dir = tmp_path / "dedloc" / "backbone"
    data_dir.mkdir(parents=True)
    with LedgerStore.open(f"sqlite:///{data_dir / 'ledger.sqlite3'}") as store:
        store.add_user("alice", note="first", now=1_700_000_000.0)

    result = CliRunner().invoke(
        backbone_app, ["allow", "list", "--json"], env={"XDG_DATA_HOME": str(tmp_path)}
    )

    assert result.exit_code == 0, result.output
    assert [user["username"] for user in json.loads(result.output)] == ["alice"]


def test_default_data_dir_follows_xdg_and_ignores_a_relative_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_data_dir("volunteer") == tmp_path / "xdg" / "dedloc" / "volunteer"

    monkeypatch.setenv("XDG_DATA_HOME", "relative/dir")  # the XDG spec: ignore it
    assert default_data_dir("backbone") == tmp_path / "home" / ".local" / "share" / "dedloc" / "backbone"
    assert shown_path(default_data_dir("backbone")) == "~/.local/share/dedloc/backbone"

    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_data_dir("volunteer") == tmp_path / "home" / ".local" / "share" / "dedloc" / "volunteer"


@pytest.mark.parametrize(("app", "name"), [(volunteer_app, "volunteer"), (backbone_app, "backbone")])
def test_version(app: typer.Typer, name: str) -> None:
    result = CliRunner().invoke(app, ["--version"])

    assert result.exit_code == 0
    assert result.output.startswith(f"{name} (dedloc) ")
