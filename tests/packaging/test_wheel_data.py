"""The wheel carries the dashboard's page, script and style (``[tool.setuptools.package-data]``): a
backbone installed from it serves them (backbone/dashboard.py reads them with importlib.resources)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STATIC = ("backbone/static/dashboard.html", "backbone/static/dashboard.js", "backbone/static/dashboard.css")

pytestmark = pytest.mark.slow


def test_the_wheel_ships_the_dashboard_files(tmp_path: Path) -> None:
    source = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to pyproject.toml
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("backbone", "shared", "protocols", "volunteer"):
        shutil.copytree(ROOT / package, source / package, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source),
         "-w", str(tmp_path / "dist")],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("dedloc-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for path in STATIC:
            assert path in names, f"{path} is not in the wheel"
            assert archive.read(path) == (ROOT / path).read_bytes()
