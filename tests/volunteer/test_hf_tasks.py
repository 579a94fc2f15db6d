"""The Hugging Face tasks: tiny ALBERT (``hf-mlm``) and tiny GPT-2 (``hf-clm``) built from configs, trained
from scratch with a run-built tokenizer: deterministic models, packing and masking that depend on the
blocks alone, refusals of bad configs, and two peers equal to one process at the same global batch."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import trio

from protocols.training import OptimizerSpec, ScheduleSpec, TokenizerSpec, TrainingSpec
from shared.data.corpus import generate_examples
from shared.errors import ConfigError
from shared.tasks import check_trainable
from shared.tokenizer import SPECIAL_TOKENS, train_tokenizer
from volunteer.collab.trainer import LocalTrainer
from volunteer.tasks import make_task
from volunteer.tasks.hf import IGNORE, HFMaskedLM, HFTask

from .test_collab import reference_run, run_pair

ROOT = Path(__file__).resolve().parents[2]

ALBERT = TrainingSpec(
    task="hf-mlm",
    task_options={
        "model_type": "albert",
        "hidden_size": 32,
        "embedding_size": 16,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "seq_len": 32,
    },
    tokenizer=TokenizerSpec(kind="unigram", vocab_size=600),
    target_batch=16,
    local_batch=8,
    optimizer=OptimizerSpec(name="adamw", lr=1e-3),
    schedule=ScheduleSpec(kind="constant"),
    checkpoint_every=1000,
)
GPT2 = msgspec.structs.replace(
    ALBERT,
    task="hf-clm",
    task_options={
        "model_type": "gpt2",
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        "seq_len": 32,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    tokenizer=TokenizerSpec(kind="bpe", vocab_size=600),
)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, bytes]:
    texts = list(generate_examples(11, 2000))
    return {
        kind: train_tokenizer(TokenizerSpec(kind=kind, vocab_size=600), texts, masked_lm=kind != "bpe")  # type: ignore[arg-type]
        for kind in ("unigram", "bpe")
    }


def task_of(spec: TrainingSpec, tokenizers: dict[str, bytes]) -> HFTask:
    task = make_task(spec, tokenizers[spec.tokenizer.kind])
    assert isinstance(task, HFTask)
    return task


def blocks(task: HFTask, seed: int, count: int) -> list[dict[str, Any]]:
    stream = ({"text": text} for text in generate_examples(seed, 10**7))
    return list(itertools.islice(task.preprocess(stream), count))


def test_the_specs_pass_the_backbones_check() -> None:
    check_trainable(ALBERT)
    check_trainable(GPT2)


@pytest.mark.parametrize("spec", [ALBERT, GPT2], ids=["albert", "gpt2"])
def test_packing_cuts_the_token_stream_into_full_blocks(
    spec: TrainingSpec, tokenizers: dict[str, bytes]
) -> None:
    task = task_of(spec, tokenizers)
    texts = list(generate_examples(3, 40))
    packed = list(task.preprocess(iter({"text": t} for t in texts)))
    assert packed and all(b["input_ids"].shape == (32,) for b in packed)
    stream: list[int] = []
    for text in texts:
        stream += [*task.tokenizer.encode(text, add_special_tokens=False).ids, task.info.sep]
    if spec.task == "hf-mlm":
        assert all(b["input_ids"][0] == task.info.cls for b in packed)
        rebuilt = [int(i) for b in packed for i in b["input_ids"][1:]]
    else:
        rebuilt = [int(i) for b in packed for i in b["input_ids"]]
    assert rebuilt == stream[: len(rebuilt)]  # nothing lost or reordered; only the last partial block waits
    assert len(stream) - len(rebuilt) < 32


def test_masking_follows_berts_rule_and_depends_on_the_block_alone(tokenizers: dict[str, bytes]) -> None:
    task = task_of(ALBERT, tokenizers)
    assert isinstance(task, HFMaskedLM)
    data = blocks(task, 5, 64)
    whole = task.collate(data)
    halves = [task.collate(data[:17]), task.collate(data[17:])]
    for key in ("input_ids", "labels"):
        assert torch.equal(whole[key], torch.cat([h[key] for h in halves]))
    special = set(task.info.special.values())
    labels, inputs = whole["labels"], whole["input_ids"]
    for row, block in enumerate(data):
        ids = block["input_ids"]
        predicted = (labels[row] != IGNORE).nonzero().flatten().tolist()
        eligible = [i for i, t in enumerate(ids) if int(t) not in special]
        assert len(predicted) == max(1, round(0.15 * len(eligible)))
        assert set(predicted) <= set(eligible)  # never [CLS]/[SEP]
        assert labels[row, predicted].tolist() == [int(ids[i]) for i in predicted]
        unmasked = [i for i in range(len(ids)) if i not in predicted]
        assert inputs[row, unmasked].tolist() == [int(ids[i]) for i in unmasked]
    chosen = labels != IGNORE
    masked = (inputs[chosen] == task.info.mask).float().mean().item()
    assert 0.7 < masked < 0.9  # 80 % [MASK] (about 150 predicted tokens here)


MODEL_DIGEST = """
import hashlib, sys
import msgspec, torch
from protocols.training import TrainingSpec
from volunteer.collab.trainer import LocalTrainer
from volunteer.tasks import make_task
spec = msgspec.json.decode(sys.argv[1], type=TrainingSpec)
before = torch.random.get_rng_state()
model = make_task(spec, open(sys.argv[2], "rb").read()).build_model()
assert torch.equal(before, torch.random.get_rng_state()), "the global RNG moved"
digest = hashlib.sha256()
for name, tensor in model.state_dict().items():
    digest.update(name.encode() + tensor.numpy().tobytes())
print(digest.hexdigest())
"""


@pytest.mark.parametrize("spec", [ALBERT, GPT2], ids=["albert", "gpt2"])
def test_the_initial_model_is_the_same_in_every_process(
    spec: TrainingSpec, tokenizers: dict[str, bytes], tmp_path: Path
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(tokenizers[spec.tokenizer.kind])
    argv = [sys.executable, "-c", MODEL_DIGEST, msgspec.json.encode(spec).decode(), str(path)]
    run = [subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT) for _ in "ab"]
    digests = {result.stdout for result in run}
    assert len(digests) == 1
    other = msgspec.structs.replace(spec, seed=1)
    argv[3] = msgspec.json.encode(other).decode()
    assert subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT).stdout not in digests


def test_bad_configs_and_missing_tokenizers_are_refused_in_words(tokenizers: dict[str, bytes]) -> None:
    def options(**changes: Any) -> TrainingSpec:
        return msgspec.structs.replace(ALBERT, task_options={**ALBERT.task_options, **changes})

    with pytest.raises(ConfigError, match="albert config has no field hiden_size"):
        make_task(options(hiden_size=64), tokenizers["unigram"])
    with pytest.raises(ConfigError, match="seq_len 1024 is longer than the model's 512 positions"):
        make_task(options(seq_len=1024), tokenizers["unigram"])
    with pytest.raises(ConfigError, match="vocab_size comes from the run's tokenizer"):
        make_task(options(vocab_size=100), tokenizers["unigram"])
    with pytest.raises(ConfigError, match=r"needs task_options\.model_type"):
        make_task(msgspec.structs.replace(ALBERT, task_options={}), tokenizers["unigram"])
    with pytest.raises(ConfigError, match="needs the run's tokenizer"):
        make_task(ALBERT, None)
    causal_albert = msgspec.structs.replace(GPT2, task_options={"model_type": "albert", "seq_len": 32})
    with pytest.raises(ConfigError, match="hf-clm"):
        make_task(causal_albert, tokenizers["bpe"]).build_model()
    with pytest.raises(ConfigError, match=r"not a tokenizer\.json"):
        make_task(ALBERT, b'{"version": "1.0"}')
    with pytest.raises(ConfigError, match="add a \\[tokenizer\\] table"):
        check_trainable(msgspec.structs.replace(ALBERT, tokenizer=TokenizerSpec()))


def test_a_tokenizer_without_the_special_tokens_is_refused(tokenizers: dict[str, bytes]) -> None:
    text = tokenizers["unigram"].decode()
    for token in SPECIAL_TOKENS:
        assert f'"{token}"' in text
    broken = text.replace('"[MASK]"', '"[MOSK]"').encode()
    with pytest.raises(ConfigError, match=r"has no \[MASK\] token"):
        make_task(ALBERT, broken)


@pytest.mark.parametrize("spec", [ALBERT, GPT2], ids=["albert", "gpt2"])
async def test_two_peers_with_batch_b_equal_one_process_with_2b(
    spec: TrainingSpec, tokenizers: dict[str, bytes], nursery: trio.Nursery
) -> None:
    steps = 4
    task = task_of(spec, tokenizers)
    data = blocks(task, 21, 2 * spec.local_batch * steps)
    peers, losses = await run_pair(nursery, spec, data, steps, task)
    reference, expected = reference_run(spec, data, steps, task)
    first, second = (p.trainer.parameter_vector() for p in peers)
    assert np.array_equal(first, second)
    np.testing.assert_allclose(first, reference.parameter_vector(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert expected[-1] < expected[0]


@pytest.mark.parametrize("spec", [ALBERT, GPT2], ids=["albert", "gpt2"])
async def test_delayed_parameter_updates_keep_the_loss_within_one_percent(
    spec: TrainingSpec, tokenizers: dict[str, bytes], nursery: trio.Nursery
) -> None:
    steps = 6
    task = task_of(spec, tokenizers)
    data = blocks(task, 22, 2 * spec.local_batch * steps)
    peers, losses = await run_pair(nursery, msgspec.structs.replace(spec, dpu=True), data, steps, task)
    _, expected = reference_run(spec, data, steps, task)
    assert np.array_equal(peers[0].trainer.parameter_vector(), peers[1].trainer.parameter_vector())
    for step, (got, want) in enumerate(zip(losses, expected, strict=True)):
        assert abs(got - want) <= 0.01 * want, (step, got, want)
    assert losses != expected  # the updates really were delayed


def test_activation_checkpointing_from_the_manifest(tokenizers: dict[str, bytes]) -> None:
    gpt2 = msgspec.structs.replace(GPT2, gradient_checkpointing=True)
    task = task_of(gpt2, tokenizers)
    plain = LocalTrainer(task, GPT2, "ckpt")
    checkpointed = LocalTrainer(task, gpt2, "ckpt")
    batch = task.collate(blocks(task, 9, 8))
    plain.accumulate(batch)
    checkpointed.accumulate(batch)  # the same gradient, computed with a second forward pass
    np.testing.assert_allclose(
        checkpointed.take_gradients().gradient_sum, plain.take_gradients().gradient_sum, rtol=1e-4, atol=1e-6
    )
    albert = msgspec.structs.replace(ALBERT, gradient_checkpointing=True)
    with pytest.raises(ConfigError, match="does not support activation checkpointing; remove gradient_che"):
        LocalTrainer(task_of(ALBERT, tokenizers), albert, "x")
