"""``backbone export --format hf``: a trained tiny ALBERT (and GPT-2) checkpoint becomes a folder that
``transformers`` loads with ``from_pretrained``, giving the trained model's logits and the run's tokens."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from backbone.checkpoints import CheckpointStore
from backbone.export_hf import export_hf
from backbone.runinfo import write_served_spec
from backbone.tokenizer import TOKENIZER_FILE
from protocols.training import TrainingSpec
from shared.data.corpus import generate_examples
from shared.errors import ConfigError
from shared.tokenizer import tokenizer_sha256, train_tokenizer
from volunteer.collab.trainer import LocalTrainer
from volunteer.tasks import make_task
from volunteer.tasks.hf import HFTask

from ..volunteer.test_hf_tasks import ALBERT, GPT2

ROOT = Path(__file__).resolve().parents[2]
TEXT = "The farmer feeds the hungry cows in the barn, but the dog sleeps."


def trained_run(
    spec: TrainingSpec, data_dir: Path, steps: int = 3
) -> tuple[TrainingSpec, HFTask, LocalTrainer]:
    """A backbone data dir as a real run leaves it: tokenizer, served spec and a checkpoint of ``steps``."""
    data = train_tokenizer(spec.tokenizer, generate_examples(4, 2000), masked_lm=spec.task == "hf-mlm")
    spec = msgspec.structs.replace(
        spec, tokenizer=msgspec.structs.replace(spec.tokenizer, sha256=tokenizer_sha256(data))
    )
    data_dir.mkdir()
    (data_dir / TOKENIZER_FILE).write_bytes(data)
    write_served_spec(data_dir, spec)
    task = make_task(spec, data)
    assert isinstance(task, HFTask)
    trainer = LocalTrainer(task, spec, "export-test")
    stream = task.preprocess({"text": t} for t in generate_examples(5, 10**6))
    for _ in range(steps):
        trainer.accumulate(task.collate(list(itertools.islice(stream, spec.local_batch))))
        trainer.apply(trainer.take_gradients().mean())
    CheckpointStore(data_dir / "checkpoints").save(trainer.state_blob(), trainer.step)
    return spec, task, trainer


@pytest.mark.parametrize("spec", [ALBERT, GPT2], ids=["albert", "gpt2"])
def test_the_exported_folder_loads_with_from_pretrained_and_gives_the_trained_logits(
    spec: TrainingSpec, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    spec, task, trainer = trained_run(spec, tmp_path / "backbone")
    out = tmp_path / "export"
    written = export_hf(tmp_path / "backbone", tmp_path / "backbone" / "checkpoints", out)
    assert "of step 3" in written
    head = AutoModelForMaskedLM if spec.task == "hf-mlm" else AutoModelForCausalLM
    loaded = head.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(TEXT)["input_ids"]
    ours = task.tokenizer.encode(TEXT).ids  # the run's tokenizer, with its own special tokens
    assert ids == ours
    batch = torch.tensor([ids])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=batch).logits, trainer.model(input_ids=batch).logits)
    assert tokenizer.pad_token == "[PAD]"
    assert tokenizer.mask_token == "[MASK]"


def test_exports_that_cannot_be_right_are_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "backbone"
    trained_run(ALBERT, data_dir, steps=1)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not an empty directory"):
        export_hf(data_dir, data_dir / "checkpoints", taken)
    assert (taken / "x").read_text() == "mine"
    tokenizer = data_dir / TOKENIZER_FILE
    tokenizer.write_bytes(tokenizer.read_bytes().replace(b"[MASK]", b"[MOSK]"))
    with pytest.raises(ConfigError, match="is not the tokenizer the run's spec pins"):
        export_hf(data_dir, data_dir / "checkpoints", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    write_served_spec(data_dir, TrainingSpec())
    with pytest.raises(ConfigError, match="trains tiny-mlm, not a Hugging Face model"):
        export_hf(data_dir, data_dir / "checkpoints", tmp_path / "out")
    result = subprocess.run(
        [sys.executable, "-m", "backbone", "export", "--data-dir", str(data_dir), "--format", "onnx",
         "-o", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "use safetensors or hf" in result.stderr
