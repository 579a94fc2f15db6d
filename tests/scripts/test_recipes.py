"""The ready manifests in deploy/recipes: each is a spec volunteers can train, its Hugging Face config
fields exist, and albert-tiny (the demo's Hugging Face recipe) builds and takes a step."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from shared.data.corpus import generate_examples
from shared.manifest import load_training_spec
from shared.tokenizer import train_tokenizer
from volunteer.collab.trainer import LocalTrainer
from volunteer.tasks import make_task

RECIPES = Path(__file__).resolve().parents[2] / "deploy" / "recipes"


def test_the_recipes_the_demo_offers_exist() -> None:
    assert {p.stem for p in RECIPES.glob("*.toml")} >= {"tiny-mlm", "albert-tiny", "sahajbert"}


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.toml")), ids=lambda p: p.stem)
def test_every_recipe_is_a_spec_volunteers_can_train(path: Path) -> None:
    spec = load_training_spec(path)  # check_trainable included
    tokenizer = None
    if spec.tokenizer.kind != "none":
        tokenizer = train_tokenizer(spec.tokenizer, generate_examples(1, 300))
    make_task(spec, tokenizer)  # the model config's fields exist in transformers


def test_albert_tiny_builds_and_learns_on_the_synthetic_corpus() -> None:
    spec = load_training_spec(RECIPES / "albert-tiny.toml")
    assert spec.task == "hf-mlm" and spec.task_options["model_type"] == "albert"
    assert spec.dataset.generate > 0 and spec.tokenizer.kind == "unigram"
    task = make_task(spec, train_tokenizer(spec.tokenizer, generate_examples(1, 3000)))
    trainer = LocalTrainer(task, spec, "recipe-test")
    blocks = task.preprocess({"text": t} for t in generate_examples(2, 10**6))
    losses = []
    for _ in range(8):
        trainer.accumulate(task.collate(list(itertools.islice(blocks, spec.local_batch))))
        taken = trainer.take_gradients()
        losses.append(taken.loss)
        trainer.apply(taken.mean())
    assert losses[-1] < losses[0]
