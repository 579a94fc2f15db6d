"""The built-in task: registry errors, deterministic model and batches, the per-sample loss, and a real
short training run whose loss falls."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from protocols.training import OptimizerSpec, TrainingSpec
from shared.data.corpus import VOCABULARY, generate_examples
from shared.errors import ConfigError, ProjectError
from shared.tasks import OPTIMIZERS, TASK_OPTIONS, HFOptions, check_trainable
from volunteer.collab.trainer import make_optimizer
from volunteer.tasks import TASKS, TinyMLM, make_task
from volunteer.tasks.tiny_mlm import CLS, IGNORE, MASK, PAD

ROOT = Path(__file__).resolve().parents[2]
PARAMS_DIGEST = """
import hashlib, sys
from protocols.training import TrainingSpec
from volunteer.tasks import make_task
model = make_task(TrainingSpec(seed=int(sys.argv[1]))).build_model()
digest = hashlib.sha256()
for name, tensor in model.state_dict().items():
    digest.update(name.encode() + tensor.numpy().tobytes())
print(digest.hexdigest())
"""


def _digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode() + tensor.numpy().tobytes())
    return digest.hexdigest()


def _examples(seed: int, count: int) -> list[dict[str, str]]:
    return [{"text": text} for text in generate_examples(seed, count)]


def test_make_task_rejects_unknown_tasks_and_bad_options() -> None:
    assert isinstance(make_task(TrainingSpec()), TinyMLM)
    known = "known tasks: hf-clm, hf-mlm, tiny-mlm"
    with pytest.raises(ConfigError, match=f"unknown training task 'gpt-17'; {known}"):
        make_task(TrainingSpec(task="gpt-17"))
    bad = [
        ({"width": 3}, "no option width; it knows d_model"),
        ({"layers": 2.5}, "layers must be an integer"),
        ({"heads": True}, "heads must be a number"),
        ({"ffn": "big"}, "ffn must be a number"),
        ({"d_model": 30, "heads": 4}, "multiple of heads"),
        ({"layers": 0}, r"layers must be in \[1, 64\]"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
        ({"mask_prob": 0}, r"mask_prob must be in \(0, 1\)"),
    ]
    for options, message in bad:
        with pytest.raises(ConfigError, match=message):
            make_task(TrainingSpec(task_options=options))
    assert set(TASKS) == {"tiny-mlm", "hf-mlm", "hf-clm"}


def test_registry_and_the_torch_free_catalog_know_the_same_tasks_with_the_same_options() -> None:
    # Backbones check a run's task against shared.tasks (no torch); volunteers build it from this registry.
    assert set(TASKS) == set(TASK_OPTIONS)
    task = make_task(TrainingSpec(task_options={"layers": 1}))
    assert task.options == TASK_OPTIONS["tiny-mlm"]({"layers": 1})  # type: ignore[attr-defined]
    # the Hugging Face tasks: the same parser (test_hf_tasks builds them with a tokenizer)
    options = {"model_type": "albert", "seq_len": 32, "hidden_size": 16}
    assert TASK_OPTIONS["hf-mlm"](options) == HFOptions.parse("hf-mlm", options)


@pytest.mark.parametrize("name", typing.get_args(typing.get_type_hints(OptimizerSpec)["name"]))
def test_volunteers_build_exactly_the_optimizers_the_catalog_lists(name: str) -> None:
    spec = OptimizerSpec(name=name)  # type: ignore[arg-type]
    params = [torch.nn.Parameter(torch.zeros(2))]
    if name in OPTIMIZERS:
        assert isinstance(make_optimizer(spec, params), torch.optim.Optimizer)
    else:
        with pytest.raises(ProjectError):
            make_optimizer(spec, params)
        with pytest.raises(ConfigError):
            check_trainable(TrainingSpec(optimizer=spec))


def test_tiny_mlm_options_default_and_override() -> None:
    task = make_task(TrainingSpec(task_options={"d_model": 32, "dropout": 0, "seq_len": 16}))
    assert isinstance(task, TinyMLM)
    assert (task.options.d_model, task.options.layers, task.options.heads) == (32, 2, 4)
    assert (task.options.seq_len, task.options.ffn, task.options.dropout) == (16, 128, 0.0)
    batch = task.collate(_examples(0, 3))
    assert batch["input_ids"].shape == (3, 16)


def test_tiny_mlm_model_is_deterministic_in_any_process_and_leaves_the_global_rng_alone() -> None:
    task = make_task(TrainingSpec(seed=11))
    state = torch.get_rng_state()
    first, second = task.build_model(), task.build_model()
    assert torch.equal(torch.get_rng_state(), state)
    assert _digest(first) == _digest(second)
    assert _digest(make_task(TrainingSpec(seed=12)).build_model()) != _digest(first)
    weights = first.state_dict()["tokens.weight"]
    assert 0.015 < float(weights.std()) < 0.025  # really initialized, not left empty
    assert all(torch.isfinite(t).all() for t in first.state_dict().values())
    other = subprocess.run(
        [sys.executable, "-c", PARAMS_DIGEST, "11"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert other.stdout.strip() == _digest(first)


def test_tiny_mlm_collate_is_a_function_of_each_example_alone() -> None:
    task = make_task(TrainingSpec())
    examples = _examples(1, 8)
    whole = task.collate(examples)
    again = task.collate(examples)
    halves = [task.collate(examples[:3]), task.collate(examples[3:])]
    for key in ("input_ids", "labels"):
        assert torch.equal(whole[key], again[key])
        assert torch.equal(whole[key], torch.cat([h[key] for h in halves]))
    assert torch.equal(task.collate(examples[5:6])["labels"], whole["labels"][5:6])
    assert task.batch_size(whole) == 8


def test_tiny_mlm_collate_masks_about_fifteen_percent_of_the_words() -> None:
    task = make_task(TrainingSpec())
    batch = task.collate(_examples(2, 200))
    ids, labels = batch["input_ids"], batch["labels"]
    words = (ids != PAD).sum() - ids.shape[0]  # minus [CLS]
    predicted = labels != IGNORE
    assert (ids[:, 0] == CLS).all() and not predicted[:, 0].any()
    assert 0.13 < float(predicted.sum() / words) < 0.18
    assert (predicted.sum(dim=1) >= 1).all()
    assert not predicted[ids == PAD].any()
    replaced = ids[predicted]
    share_masked = float((replaced == MASK).float().mean())
    share_kept = float((replaced == labels[predicted]).float().mean())
    assert 0.72 < share_masked < 0.88 and 0.05 < share_kept < 0.16
    # unknown words and an empty text still give a well-formed row
    odd = task.collate([{"text": "The zyzzyva sleeps."}, {"text": ""}])
    assert odd["input_ids"][0, :5].tolist()[:1] == [CLS] and (odd["labels"][1] == IGNORE).all()
    with pytest.raises(ValueError, match="no text field 'text'"):
        task.collate([{"content": "x"}])
    with pytest.raises(ValueError, match="empty batch"):
        task.collate([])


def test_tiny_mlm_loss_is_a_mean_over_samples_so_half_batch_gradients_average_to_the_full_one() -> None:
    task = make_task(TrainingSpec(seed=4))
    model = task.build_model()
    examples = _examples(3, 16)

    def gradient(part: list[dict[str, str]]) -> torch.Tensor:
        model.zero_grad()
        task.loss(model, task.collate(part)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    full = gradient(examples)
    halves = (gradient(examples[:8]) + gradient(examples[8:])) / 2
    assert torch.allclose(full, halves, rtol=1e-4, atol=1e-7)
    # and it is not a mean over masked tokens: uneven halves would differ then
    uneven = (gradient(examples[:2]) * 2 + gradient(examples[2:]) * 14) / 16
    assert torch.allclose(full, uneven, rtol=1e-4, atol=1e-7)
    loss = task.loss(model, task.collate(examples))
    per_sample = torch.stack([task.loss(model, task.collate([e])) for e in examples])
    assert torch.allclose(loss, per_sample.mean(), rtol=1e-5)


def test_tiny_mlm_learns_the_synthetic_corpus() -> None:
    task = make_task(TrainingSpec(seed=0))
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    examples = _examples(9, 200 * 16)
    losses = []
    for step in range(200):
        loss = task.loss(model, task.collate(examples[step * 16 : (step + 1) * 16]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    initial, final = losses[0], sum(losses[-20:]) / 20
    assert abs(initial - torch.log(torch.tensor(float(len(VOCABULARY) + 4)))) < 0.3  # chance level
    assert final < 0.8 * initial, (initial, final)
