"""``scripts/setup``'s install stamps, run for real in a copy of the repository whose ``.venv/bin/python``
is a stub that records what it is asked to do: ``scripts/demo`` (base) and ``scripts/test`` (test extras)
one after the other install once per ``pyproject.toml``, and pip's chatter stays out of the terminal."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Stands in for both the system Python and .venv/bin/python: logs its arguments, says something alarming
#: as pip does, and fails when told to.
STUB = """#!/bin/sh
echo "$*" >> "$STUB_LOG"
case "$*" in
  *"pip install"*)
    echo "WARNING: Running pip as the 'root' user can result in broken permissions" >&2
    if [ -n "${STUB_FAIL:-}" ]; then
      echo "ERROR: No matching distribution found for dedloc" >&2
      exit 1
    fi ;;
esac
exit 0
"""

#: What every setup installs: this checkout runs a backbone and volunteers (scripts/demo), and the tests too.
BOTH = ".[volunteer,backbone]"
BOTH_TEST = ".[volunteer,backbone,test]"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("sha256sum") is None, reason="bash"
)


class Checkout:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "scripts").mkdir(parents=True)
        shutil.copy2(REPO / "scripts" / "setup", root / "scripts" / "setup")
        shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
        python = root / ".venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(STUB)
        python.chmod(0o755)
        self.log = root / "calls.log"
        self.log.touch()

    def setup(self, *extras: str, fail: bool = False) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "PYTHON": str(self.root / ".venv" / "bin" / "python"),
            "STUB_LOG": str(self.log),
            "STUB_FAIL": "1" if fail else "",
        }
        return subprocess.run(
            ["bash", str(self.root / "scripts" / "setup"), *extras],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )

    def installs(self) -> list[str]:
        """The project installs asked of pip so far (``.[volunteer,backbone…]``)."""
        calls = self.log.read_text().splitlines()
        return [call.split()[-1] for call in calls if call.startswith("-m pip install -q -e")]

    def stamps(self) -> list[str]:
        return sorted(p.name.rsplit("-", 1)[1] for p in (self.root / ".venv").glob(".installed-*"))


def test_demo_and_test_setups_install_once_per_pyproject(tmp_path: Path) -> None:
    repo = Checkout(tmp_path / "repo")

    first = repo.setup("test")
    assert first.returncode == 0, first.stderr
    assert repo.installs() == [BOTH_TEST]
    assert "WARNING" not in first.stderr  # pip's output went to .venv/pip.log
    assert "WARNING: Running pip" in (repo.root / ".venv" / "pip.log").read_text()

    for extras in ((), ("test",), (), ("test",)):  # scripts/demo, scripts/test, … in turn
        again = repo.setup(*extras)
        assert again.returncode == 0, again.stderr
        assert again.stderr == ""
    assert repo.installs() == [BOTH_TEST]

    with (repo.root / "pyproject.toml").open("a") as pyproject:
        pyproject.write("# a changed dependency\n")
    assert repo.setup().returncode == 0
    assert repo.stamps() == ["base"]  # the old pyproject's stamp is gone
    assert repo.setup("test").returncode == 0  # the base install lacks the test extras
    assert repo.setup().returncode == 0
    assert repo.installs() == [BOTH_TEST, BOTH, BOTH_TEST]
    assert repo.stamps() == ["base", "test"]


def test_a_failed_install_shows_pips_error_and_leaves_no_stamp(tmp_path: Path) -> None:
    repo = Checkout(tmp_path / "repo")

    failed = repo.setup("test", fail=True)

    assert failed.returncode == 1
    assert "No matching distribution found for dedloc" in failed.stderr
    assert repo.stamps() == []
    assert repo.setup("test").returncode == 0
    assert repo.stamps() == ["test"]


def test_every_setup_installs_the_pinned_torch_first_then_both_roles(tmp_path: Path) -> None:
    repo = Checkout(tmp_path / "repo")

    assert repo.setup().returncode == 0

    pip = [call for call in repo.log.read_text().splitlines() if call.startswith("-m pip install")]
    assert pip == [
        "-m pip install -q --upgrade pip",
        "-m pip install -q torch==2.13.0",
        f"-m pip install -q -e {BOTH}",
    ]
