"""``pip install dedloc[backbone]`` resolves to a backbone's packages and none of the volunteer's.

pip resolves the install for real (``--dry-run --ignore-installed``: as into an empty environment, from the
package index, installing nothing) and reports what it would install, so a dependency that pulls torch in
indirectly is caught too. About 10 s; it needs the package index, as any install does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.extras import ROLE_PACKAGES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PIP_DRY_RUN = (sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet")


def _resolve(spec: str, report: Path) -> set[str]:
    """The normalized names of every distribution ``pip install spec`` would install."""
    done = subprocess.run(
        [*PIP_DRY_RUN, "--report", str(report), spec],
        cwd=ROOT,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    items = json.loads(report.read_text())["install"]
    return {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower() for item in items}


def test_the_backbone_extra_installs_no_torch_transformers_or_datasets(tmp_path: Path) -> None:
    names = _resolve(".[backbone]", tmp_path / "report.json")

    assert {"dedloc", "sqlalchemy", "psycopg", "starlette", "hypercorn", "tokenizers", "trio"} <= names
    assert not names & {"torch", "transformers", "datasets", "accelerate", "triton"}
    assert not [name for name in names if name.startswith("nvidia-")]


def test_the_packages_the_cli_errors_name_are_pyprojects_extras() -> None:
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for role, packages in ROLE_PACKAGES.items():
        names = {re.match(r"[A-Za-z0-9_.-]+", spec).group().lower() for spec in optional[role]}  # type: ignore[union-attr]
        assert names == packages, role
