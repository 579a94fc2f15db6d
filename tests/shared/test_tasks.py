"""The torch-free task catalog and the rules a run's spec must meet before a backbone serves it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from protocols.training import (
    DatasetSpec,
    OptimizerSpec,
    ScheduleSpec,
    SyncSpec,
    TokenizerSpec,
    TrainingSpec,
)
from shared.errors import ConfigError
from shared.manifest import load_training_spec, parse_training_spec
from shared.tasks import TASK_OPTIONS, TinyMLMOptions, check_trainable


def test_check_trainable_accepts_the_default_spec_and_the_readmes_manifest() -> None:
    check_trainable(TrainingSpec())
    readme = b"""task = "tiny-mlm"
target_batch = 256
local_batch = 16
max_steps = 2000
dpu = false
checkpoint_every = 10
[averaging]
rule = "mean"
norm_factor = 10
[optimizer]
name = "adamw"
lr = 0.003
[schedule]
kind = "linear"
warmup_steps = 20
total_steps = 2000
[dataset]
source = "backbone"
generate = 8
shuffle_buffer = 10000
"""
    assert parse_training_spec(readme, "run.toml").optimizer.lr == 0.003


def hf(
    task: str = "hf-mlm", tokenizer: str = "unigram", source: str = "backbone", **options: Any
) -> TrainingSpec:
    """A Hugging Face task's spec with ``options`` as its task_options."""
    dataset = DatasetSpec(source="files", files=["x.jsonl"]) if source == "files" else DatasetSpec()
    kind = TokenizerSpec(kind=tokenizer)  # type: ignore[arg-type]
    return TrainingSpec(task=task, task_options=options, tokenizer=kind, dataset=dataset)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (TrainingSpec(task="gpt-5"), "unknown task 'gpt-5': volunteers can train hf-clm, hf-mlm, tiny-mlm"),
        (TrainingSpec(task_options={"d_model": 30, "heads": 4}), "multiple of heads"),
        (TrainingSpec(task_options={"width": 3}), "tiny-mlm has no option width"),
        (TrainingSpec(optimizer=OptimizerSpec(momentum=0.9)), "momentum applies to sgd only"),
        (TrainingSpec(optimizer=OptimizerSpec(name="lamb", momentum=0.9)), "momentum applies to sgd only"),
        (
            TrainingSpec(target_batch=64, local_batch=128),
            "local_batch (128) is larger than target_batch (64)",
        ),
        (TrainingSpec(schedule=ScheduleSpec(warmup_steps=50, total_steps=10)), "warmup_steps (50) exceeds"),
        (TrainingSpec(dataset=DatasetSpec(generate=8, text_field="body")), "keeps its text in 'text'"),
        (hf(), "needs task_options.model_type"),
        (hf(model_type="Albert!"), "needs task_options.model_type"),
        (hf(model_type="albert", vocab_size=9), "vocab_size comes from the run's tokenizer"),
        (hf(model_type="albert", seq_len=4), "seq_len must be an integer in [8, 65536]"),
        (hf(model_type="albert", mask_prob=1.5), "mask_prob must be in (0, 1)"),
        (hf(task="hf-clm", model_type="gpt2", mask_prob=0.2), "hf-clm has no option mask_prob"),
        (hf(tokenizer="none", model_type="albert"), "add a [tokenizer] table"),
        (hf(task="tiny-mlm"), "tiny-mlm has a vocabulary of its own"),
        (
            hf(model_type="albert", source="files"),
            "the backbone trains a unigram tokenizer on the shards it serves, but dataset.source is 'files'",
        ),
        (TrainingSpec(sync=SyncSpec(mode="swarm")), 'mode = "swarm" needs stages = 2 or more (got 0)'),
        (TrainingSpec(sync=SyncSpec(stages=3)), 'stages splits the model of mode = "swarm"'),
        (TrainingSpec(dpu=True, sync=SyncSpec(mode="swarm", stages=2)), 'remove it in mode = "swarm"'),
        (
            TrainingSpec(sync=SyncSpec(mode="swarm", stages=3)),
            "tiny-mlm with 2 layers splits into at most 2 stages (got stages = 3)",
        ),
    ],
)
def test_check_trainable_refuses_what_no_volunteer_could_train(spec: TrainingSpec, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_trainable(spec)
    assert message in str(caught.value)


def test_check_trainable_allows_sgd_momentum_lamb_and_own_shards_with_another_text_field() -> None:
    check_trainable(TrainingSpec(optimizer=OptimizerSpec(name="sgd", momentum=0.9)))
    check_trainable(TrainingSpec(optimizer=OptimizerSpec(name="lamb", weight_decay=0.01)))
    check_trainable(TrainingSpec(dataset=DatasetSpec(generate=0, text_field="body")))
    check_trainable(TrainingSpec(target_batch=16, local_batch=16))


def test_manifest_with_an_unknown_task_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('task = "gpt-5"\n')
    with pytest.raises(ConfigError) as caught:
        load_training_spec(path)
    assert str(caught.value).startswith(
        f"{path}: unknown task 'gpt-5': volunteers can train hf-clm, hf-mlm, tiny-mlm, or the task of a "
    )


def test_manifest_reads_no_more_than_its_limit_from_an_endless_file() -> None:
    with pytest.raises(ConfigError, match="larger than"):
        load_training_spec(Path("/dev/zero"))


def test_task_catalog_is_importable_without_torch() -> None:
    import subprocess

    code = "import sys, shared.tasks, shared.manifest; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tiny_mlm_options_parse_defaults_and_overrides() -> None:
    assert TASK_OPTIONS["tiny-mlm"]({}) == TinyMLMOptions()
    assert TinyMLMOptions.parse({"layers": 3, "dropout": 0}) == TinyMLMOptions(layers=3, dropout=0.0)


def test_a_swarm_manifest_parses_with_its_stages_and_period() -> None:
    spec = parse_training_spec(
        b'task = "tiny-mlm"\n[task_options]\nlayers = 4\n[sync]\nmode = "swarm"\nstages = 4\n'
        b"rebalance_period = 12.5\n"
    )
    assert (spec.sync.mode, spec.sync.stages, spec.sync.rebalance_period) == ("swarm", 4, 12.5)
    with pytest.raises(ConfigError, match="stages"):
        parse_training_spec(b'task = "tiny-mlm"\n[sync]\nmode = "swarm"\nstages = 65\n')
