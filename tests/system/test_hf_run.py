"""A Hugging Face run end to end with real processes: the backbone trains the run's tokenizer, two invited
volunteers fetch it and train a tiny ALBERT together with bit-identical parameters, and the export loads
with ``from_pretrained``; a run whose plugin a volunteer lacks stops its join with the pip line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from .procs import ENV, cli, stop
from .test_training import Backbone, Volunteer, assert_identical, kill, wait_for

pytestmark = pytest.mark.slow

MANIFEST = """
task = "hf-mlm"
target_batch = 32
local_batch = 8
checkpoint_every = 2
[task_options]
model_type = "albert"
seq_len = 32
embedding_size = 16
hidden_size = 32
num_hidden_layers = 1
num_attention_heads = 2
intermediate_size = 64
[tokenizer]
kind = "unigram"
vocab_size = 400
[optimizer]
lr = 0.003
[schedule]
kind = "constant"
[dataset]
generate = 2
examples_per_shard = 400
shuffle_buffer = 200
"""


def test_volunteers_train_a_hugging_face_albert_with_the_run_built_tokenizer(tmp_path: Path) -> None:
    backbone = Backbone(tmp_path, MANIFEST)
    backbone.start()
    volunteers = [Volunteer(tmp_path, name, backbone) for name in ("alice", "bob")]
    try:
        wait_for(
            lambda: all(v.step() >= 4 for v in volunteers) and any((backbone.dir / "checkpoints").glob("*")),
            "both volunteers past step 4 and a checkpoint",
            150,
            volunteers,
        )
        assert assert_identical(volunteers) >= 3
        pin = (backbone.dir / "tokenizer.json").read_bytes()
        for v in volunteers:
            kept = list((v.dir / "tokenizers").glob("*.json"))
            assert [p.read_bytes() for p in kept] == [pin]
        for v in volunteers:
            assert stop(v.proc, within=60)[0] == 0
    finally:
        for v in volunteers:
            if v.alive():
                kill(v.proc)
        if backbone.proc is not None:
            stop(backbone.proc, within=30)

    out = tmp_path / "albert"
    result = subprocess.run(
        cli("backbone", "export", "--data-dir", str(backbone.dir), "--format", "hf", "-o", str(out)),
        capture_output=True, text=True, env=ENV, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    check = (
        "from transformers import AutoModelForMaskedLM, AutoTokenizer; import sys; "
        "m = AutoModelForMaskedLM.from_pretrained(sys.argv[1]); "
        "t = AutoTokenizer.from_pretrained(sys.argv[1]); "
        "ids = t('the farmer feeds the cows', return_tensors='pt'); "
        "print(type(m).__name__, tuple(m(**ids).logits.shape))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", check, str(out)],
        capture_output=True, text=True, env=ENV, check=False,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.startswith("AlbertForMaskedLM (1, ")


def test_a_volunteer_without_the_runs_plugin_is_told_the_pip_line(tmp_path: Path) -> None:
    manifest = 'task = "protein-mlm"\nplugin = "dedloc-protein-task==3.1.4"\n[dataset]\ngenerate = 1\n'
    backbone = Backbone(tmp_path, manifest)
    backbone.start()  # the backbone has no plugin and needs none
    volunteer = Volunteer(tmp_path, "alice", backbone)
    try:
        deadline = time.monotonic() + 90
        while volunteer.alive() and time.monotonic() < deadline:
            time.sleep(0.3)
        assert volunteer.proc.wait(timeout=5) == 2
        log = volunteer.log.read_text()
        assert "run `pip install 'dedloc-protein-task==3.1.4'` (in this volunteer's environment)" in log
    finally:
        if volunteer.alive():
            kill(volunteer.proc)
        if backbone.proc is not None:
            stop(backbone.proc, within=30)
