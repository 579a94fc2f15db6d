"""A backbone runs where only ``dedloc[backbone]`` is installed: no torch, transformers or datasets.

Each process here starts with ``without_torch/sitecustomize.py`` first on ``PYTHONPATH``: an import of those
packages fails as if they were not installed, and is recorded with the stack that asked for it, so an
import the code catches (``try: import torch``) fails the test too. tests/architecture/test_layers.py reads
the import statements; this runs the real thing: every module of the backbone and of the layers below it,
the CLI's help, and a real ``backbone start`` that trains the run's tokenizer and serves its API, then the
commands an organizer runs on the stopped data dir. The same guard checks the other half of the split (the
volunteer loads none of the backbone's packages) and the one-line error of a role installed without its
packages.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.system.procs import read_line, stop

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
#: what only the volunteer installs (pyproject's `volunteer` extra)
VOLUNTEER_ONLY = ("torch", "transformers", "datasets")
#: what only the backbone installs (pyproject's `backbone` extra, less tokenizers, which both have)
BACKBONE_ONLY = ("sqlalchemy", "psycopg", "starlette", "hypercorn")
#: a Hugging Face run with a tokenizer the backbone trains at its first start (the `tokenizers` library)
MANIFEST = """\
task = "hf-mlm"
target_batch = 16
local_batch = 8
[task_options]
model_type = "albert"
hidden_size = 32
embedding_size = 16
num_attention_heads = 2
intermediate_size = 64
num_hidden_layers = 2
seq_len = 32
[tokenizer]
kind = "unigram"
vocab_size = 600
[dataset]
source = "backbone"
generate = 2
"""


class WithoutTorch:
    """Runs Python processes in which the ``forbidden`` packages cannot be imported."""

    def __init__(self, tmp_path: Path, forbidden: tuple[str, ...] = VOLUNTEER_ONLY) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.log = tmp_path / "refused-imports.log"
        path = [str(Path(__file__).with_name("without_torch")), str(ROOT), os.environ.get("PYTHONPATH", "")]
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "PYTHONUNBUFFERED": "1",
            "COLUMNS": "200",
            "DEDLOC_FORBID": ",".join(forbidden),
            "DEDLOC_FORBID_LOG": str(self.log),
        }

    def run(self, *args: str, within: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=within,
            check=False,
        )

    def spawn(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def refused(self) -> str:
        """Every refused import so far, each with the stack that asked for it ("" when none was tried)."""
        return self.log.read_text() if self.log.exists() else ""


@pytest.fixture
def without_torch(tmp_path: Path) -> WithoutTorch:
    return WithoutTorch(tmp_path)


def test_the_guard_refuses_the_volunteers_packages_and_records_even_a_caught_import(
    without_torch: WithoutTorch,
) -> None:
    code = (
        "import importlib\n"
        f"for name in {[*VOLUNTEER_ONLY, 'torch.nn']!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as exc:\n"
        "        print(exc.name)\n"
        "import json\n"  # everything else imports as usual
    )
    done = without_torch.run("-c", code)

    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [*VOLUNTEER_ONLY, "torch"]
    refused = without_torch.refused()
    for name in VOLUNTEER_ONLY:
        assert f"import {name} refused" in refused
    assert 'File "<string>", line 4' in refused  # the stack names who asked


def _modules(*packages: str) -> list[str]:
    names = []
    for package in packages:
        path = importlib.import_module(package).__path__
        names += [package, *(info.name for info in pkgutil.walk_packages(path, f"{package}."))]
    return [name for name in names if not name.endswith(".__main__")]  # __main__ would run the CLI


def _import_all(modules: list[str]) -> str:
    return f"import importlib\nfor name in {modules!r}:\n    importlib.import_module(name)\n"


def test_every_module_of_the_backbone_and_the_layers_below_imports_without_them(
    without_torch: WithoutTorch,
) -> None:
    modules = _modules("protocols", "shared", "backbone")
    assert "backbone.cli" in modules and "backbone.ledger.store" in modules and "shared.tokenizer" in modules

    done = without_torch.run("-c", _import_all(modules))

    assert done.returncode == 0, done.stderr
    refused = without_torch.refused()
    assert not refused, refused


def test_the_volunteer_needs_none_of_the_backbones_packages(tmp_path: Path) -> None:
    """The other half of the split: ``dedloc[volunteer]`` has no ledger database and no HTTP server."""
    without_backbone = WithoutTorch(tmp_path, forbidden=BACKBONE_ONLY)
    modules = _modules("volunteer")
    assert "volunteer.cli" in modules and "volunteer.tasks.hf" in modules

    then_help = (
        "import sys\nfrom volunteer.cli import main\nsys.argv = ['volunteer', 'join', '--help']\nmain()\n"
    )

    done = without_backbone.run("-c", _import_all(modules) + then_help)  # one process: torch loads slowly

    assert done.returncode == 0, done.stderr
    assert "--invite" in done.stdout
    refused = without_backbone.refused()
    assert not refused, refused


def test_a_real_backbone_starts_serves_and_stops_without_them(
    without_torch: WithoutTorch, tmp_path: Path
) -> None:
    helped = without_torch.run("-m", "backbone", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "start" in helped.stdout
    manifest = tmp_path / "run.toml"
    manifest.write_text(MANIFEST)
    data_dir = tmp_path / "bb"

    proc = without_torch.spawn(
        *("-m", "backbone", "start", "--run-id", "no-torch", "--data-dir", str(data_dir)),
        *("--listen", "/ip4/127.0.0.1/tcp/0", "--api-listen", "127.0.0.1:0", "--no-mdns"),
        *("--manifest", str(manifest)),
    )
    try:
        run_id = api = ""
        while not api:
            line = read_line(proc)
            if line.startswith("run id "):
                run_id = line.removeprefix("run id ")
            elif line.startswith("api on "):
                api = line.removeprefix("api on ")
        with httpx.Client(verify=False, timeout=30) as client:  # the certificate is pinned by the run id
            served = client.get(f"{api}/v1/runs/{run_id}/manifest")
    finally:
        code, _, err = stop(proc, signal.SIGTERM)
    assert served.status_code == 200, served.text
    training = served.json()["training"]
    assert training["task"] == "hf-mlm"
    assert len(training["tokenizer"]["sha256"]) == 64  # trained at this start
    assert code == 0, err

    for command in (["allow", "add", "alice"], ["ledger", "--steps"]):
        done = without_torch.run("-m", "backbone", *command, "--data-dir", str(data_dir))
        assert done.returncode == 0, f"backbone {' '.join(command)}: {done.stderr}"
    refused = without_torch.refused()
    assert not refused, refused


PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWAFQ3xykdXZzoAzo2FvDi91sdttnkBocq8LcQePV1dQHm"


def test_each_role_without_its_packages_says_in_one_line_what_to_install(tmp_path: Path) -> None:
    """``pip install dedloc`` without a role: exit 2 and the pip line, not a traceback (shared/extras.py)."""
    volunteer = WithoutTorch(tmp_path / "v").run(
        *("-m", "volunteer", "join", "r", "--initial-peer", PEER, "--no-panel"),
        *("--data-dir", str(tmp_path / "volunteer")),
    )
    backbone = WithoutTorch(tmp_path / "b", forbidden=BACKBONE_ONLY).run(
        *("-m", "backbone", "start", "--run-id", "r", "--open", "--no-mdns"),
        *("--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(tmp_path / "backbone")),
    )

    for role, done in (("volunteer", volunteer), ("backbone", backbone)):
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.endswith(f"install the {role}'s packages with: pip install 'dedloc[{role}]'\n")
    assert "needs the torch package" in volunteer.stderr
    assert not (tmp_path / "volunteer").exists()
