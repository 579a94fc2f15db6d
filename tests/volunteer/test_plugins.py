"""Task plugins: an installed distribution's ``dedloc.tasks`` entry point gives a run its task, through the
interface of the built-in tasks; a missing, mismatched or broken plugin stops the join with the exact
``pip install`` line, and nothing is ever fetched from the network."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocols.training import TrainingSpec
from shared.data.corpus import generate_examples
from shared.errors import ConfigError
from shared.tasks import check_trainable
from volunteer.collab.trainer import LocalTrainer
from volunteer.tasks import make_task

PLUGIN_CODE = '''
from volunteer.tasks.tiny_mlm import TinyMLM


class ProteinMLM(TinyMLM):
    """A plugin's task: the built-in masked-LM under another name, so it trains here."""

    name = "protein-mlm"


BROKEN = 1 / 0 if __import__("os").environ.get("BREAK_PLUGIN") else None
'''


def install_plugin(site: Path, version: str = "1.2.0", entry: str = "protein-mlm") -> None:
    """A real installed distribution (what ``pip install`` leaves): a package and its dist-info."""
    (site / "protein_task").mkdir(parents=True, exist_ok=True)
    (site / "protein_task" / "__init__.py").write_text(PLUGIN_CODE)
    for old in site.glob("protein_task-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = site / f"protein_task-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: protein-task\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[dedloc.tasks]\n{entry} = protein_task:ProteinMLM\n")


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "site"
    path.mkdir()
    sys.path.insert(0, str(path))
    try:
        yield path
    finally:
        sys.path.remove(str(path))
        sys.modules.pop("protein_task", None)


SPEC = TrainingSpec(task="protein-mlm", plugin="protein-task==1.2.0", task_options={"layers": 1})


def test_a_run_names_its_plugin_and_the_backbone_accepts_it_without_having_it() -> None:
    check_trainable(SPEC)  # the backbone does not have the plugin, and need not
    with pytest.raises(ConfigError, match=r"volunteers can train hf-clm, hf-mlm, tiny-mlm, or the task of a"):
        check_trainable(TrainingSpec(task="protein-mlm"))
    with pytest.raises(ConfigError, match="tiny-mlm is a built-in task: remove plugin"):
        check_trainable(TrainingSpec(plugin="protein-task==1.2.0"))


def test_an_installed_plugin_gives_the_task_through_the_built_in_interface(site: Path) -> None:
    install_plugin(site)
    task = make_task(SPEC)
    assert task.name == "protein-mlm"
    trainer = LocalTrainer(task, SPEC, "plugin-run")
    examples = task.preprocess({"text": t} for t in generate_examples(1, 100))
    trainer.accumulate(task.collate(list(itertools.islice(examples, 16))))
    assert trainer.take_gradients().samples == 16


def test_a_missing_or_mismatched_plugin_is_refused_with_the_pip_line(site: Path) -> None:
    pip = r"run `pip install 'protein-task==1\.2\.0'`"
    missing = rf"plugin protein-task==1\.2\.0, which is not installed here: {pip}"
    with pytest.raises(ConfigError, match=missing):
        make_task(SPEC)
    install_plugin(site, version="1.1.0")
    with pytest.raises(ConfigError, match=rf"but protein-task 1\.1\.0 is installed: {pip}"):
        make_task(SPEC)
    install_plugin(site, entry="dna-mlm")
    no_entry = r"has no dedloc\.tasks entry point 'protein-mlm' \(it has dna-mlm\)"
    with pytest.raises(ConfigError, match=no_entry):
        make_task(SPEC)


def test_a_plugin_that_fails_to_import_is_refused_in_one_line(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_plugin(site)
    monkeypatch.setenv("BREAK_PLUGIN", "1")
    with pytest.raises(ConfigError, match="cannot be loaded \\(ZeroDivisionError: division by zero\\)"):
        make_task(SPEC)
