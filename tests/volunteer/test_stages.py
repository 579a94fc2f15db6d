"""Pipeline stages (volunteer.tasks.stages): composing a task's stages gives the whole model's loss and
gradients, the stages partition the model's parameters (tied weights copied once, their gradients
adding up), and splits the stages cannot make are refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import pytest
import torch

from protocols.training import TokenizerSpec, TrainingSpec
from shared.data.corpus import generate_examples
from shared.errors import ConfigError
from shared.swarm.wiring import Pick, StageRouter
from shared.tokenizer import train_tokenizer
from volunteer.tasks import make_task
from volunteer.tasks.base import Task
from volunteer.tasks.stages import block_ranges, run_stages, split_model

TINY = TrainingSpec(task_options={"layers": 4, "d_model": 32, "heads": 2, "ffn": 64, "seq_len": 24})
HF_COMMON = {"seq_len": 16}
HF = {
    "gpt2": (
        "hf-clm",
        {"n_embd": 32, "n_layer": 4, "n_head": 2, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0},
    ),
    "bert": (
        "hf-mlm",
        {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 64,
         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    ),
    "albert": (
        "hf-mlm",
        {"hidden_size": 32, "embedding_size": 16, "num_hidden_layers": 6, "num_hidden_groups": 3,
         "num_attention_heads": 2, "intermediate_size": 64, "hidden_dropout_prob": 0.0,
         "attention_probs_dropout_prob": 0.0},
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, bytes]:
    texts = list(generate_examples(5, 300))
    return {
        kind: train_tokenizer(TokenizerSpec(kind=kind, vocab_size=300), texts, masked_lm=kind != "bpe")
        for kind in ("unigram", "bpe")
    }


def hf_task(model_type: str, tokenizers: dict[str, bytes], **extra: Any) -> Task:
    name, options = HF[model_type]
    kind = "bpe" if name == "hf-clm" else "unigram"
    spec = msgspec.structs.replace(
        TINY,
        task=name,
        task_options={"model_type": model_type, **HF_COMMON, **options, **extra},
        tokenizer=TokenizerSpec(kind=kind, vocab_size=300),  # type: ignore[arg-type]
    )
    return make_task(spec, tokenizers[kind])


def batch_of(task: Task, count: int = 6) -> Mapping[str, torch.Tensor]:
    examples = [{"text": text} for text in generate_examples(9, 200)]
    samples = list(task.preprocess(iter(examples)))[:count]
    assert len(samples) == count
    return task.collate(samples)


def check_equivalence(task: Task, count: int) -> None:
    model = task.build_model()
    batch = batch_of(task)
    reference = task.loss(model, batch)
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    staged = split_model(task, model, count)
    assert len(staged.stages) == count
    loss = run_stages(staged.stages, batch)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    loss.backward()

    params = dict(model.named_parameters())
    copies = {t.model: dict(staged.stages[-1].named_parameters())[t.last] for t in staged.tied}
    assert len(copies) == (1 if count > 1 else 0)  # every family ties its output layer to the embedding
    for name, grad in expected.items():
        got = params[name].grad
        assert got is not None, name
        if name in copies:  # the whole model's gradient of a tied weight is the sum of both copies'
            copy_grad = copies[name].grad
            assert copy_grad is not None
            got = got + copy_grad
        torch.testing.assert_close(got, grad, rtol=1e-4, atol=1e-6, msg=name)


def check_partition(task: Task, count: int) -> None:
    model = task.build_model()
    staged = split_model(task, model, count)
    model_params = {id(p): p for p in model.parameters()}
    owner: dict[int, int] = {}
    for k, stage in enumerate(staged.stages):
        tied_here = {t.last for t in staged.tied} if k == count - 1 else set()
        for name, param in stage.named_parameters():
            if name in tied_here:
                assert id(param) not in model_params  # a copy, not the model's parameter
                continue
            assert id(param) in model_params, name
            assert id(param) not in owner, f"{name} is in stages {owner.get(id(param))} and {k}"
            owner[id(param)] = k
        assert set(staged.names[k]) == {n for n, _ in stage.named_parameters()} - tied_here
    assert set(owner) == set(model_params)  # every parameter is in exactly one stage
    stage_numel = sum(p.numel() for s in staged.stages for p in s.parameters())
    tied_numel = sum(dict(staged.stages[-1].named_parameters())[t.last].numel() for t in staged.tied)
    assert stage_numel - tied_numel == sum(p.numel() for p in model.parameters())
    for t in staged.tied:
        first = dict(staged.stages[0].named_parameters())[t.first]
        assert first is dict(model.named_parameters())[t.model]
        assert torch.equal(first, dict(staged.stages[-1].named_parameters())[t.last])


@pytest.mark.parametrize("count", [1, 3, 4])
def test_stages_tiny_mlm_compose_to_the_whole_model(count: int) -> None:
    task = make_task(TINY)
    check_equivalence(task, count)
    check_partition(task, count)


@pytest.mark.parametrize(
    ("model_type", "count"), [("gpt2", 1), ("gpt2", 3), ("bert", 3), ("albert", 2), ("albert", 3)]
)
def test_stages_hf_models_compose_to_the_whole_model(
    model_type: str, count: int, tokenizers: dict[str, bytes]
) -> None:
    task = hf_task(model_type, tokenizers)
    check_equivalence(task, count)
    check_partition(task, count)


def test_stages_hold_embeddings_first_head_last_and_blocks_evenly() -> None:
    task = make_task(TINY)
    staged = split_model(task, task.build_model(), 3)
    assert staged.blocks == (range(0, 1), range(1, 3), range(3, 4))
    first, middle, last = staged.stages
    assert first.embed is not None and first.head is None
    assert middle.embed is None and middle.head is None
    assert last.embed is None and last.head is not None
    assert all(n.startswith("encoder.layers.") for n in staged.names[1].values())
    assert middle.needs == ("input_ids",) and last.needs == ("input_ids", "labels")
    hidden = first(None, batch_of(task))
    assert hidden.shape == (6, 24, 32)
    with pytest.raises(ValueError, match="needs a hidden state"):
        middle(None, batch_of(task))
    with pytest.raises(ValueError, match="needs batch fields"):
        last(hidden, {"input_ids": torch.zeros(6, 24, dtype=torch.long)})


def test_block_ranges_are_even_and_consecutive() -> None:
    for blocks in range(1, 30):
        for count in range(1, blocks + 1):
            ranges = block_ranges(blocks, count)
            assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]]
            assert ranges[0].start == 0 and ranges[-1].stop == blocks
            sizes = [len(r) for r in ranges]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_stages_refuse_splits_they_cannot_make(tokenizers: dict[str, bytes]) -> None:
    task = make_task(TINY)
    with pytest.raises(ConfigError, match="cannot split 4 blocks into 5 stages"):
        split_model(task, task.build_model(), 5)
    with pytest.raises(ConfigError, match="at least one stage"):
        split_model(task, task.build_model(), 0)
    shared_groups = hf_task("albert", tokenizers, num_hidden_groups=1)  # ALBERT's default: one group
    with pytest.raises(ConfigError, match="cannot split 1 blocks into 2 stages"):
        split_model(shared_groups, shared_groups.build_model(), 2)
    split_model(shared_groups, shared_groups.build_model(), 1)  # the whole model is one stage
    other = hf_task("gpt2", tokenizers)
    model: Any = other.build_model()
    model.config.model_type = "mystery"
    with pytest.raises(ConfigError, match="no pipeline stages for model type 'mystery'"):
        split_model(other, model, 2)


def test_stages_served_by_two_peers_each_match_one_process_at_the_global_batch() -> None:
    """Seed 004 App. E in miniature: micro-batches routed by stochastic wiring through two servers per
    stage, each server weighting its micro-batches' gradients by their sample counts, then each stage
    averaging over its servers by samples and adding the tied copy's gradient, give the gradient of one
    process running the whole model on the whole global batch."""
    task = make_task(TINY)
    count, servers = 3, ("r0", "r1")
    staged = {server: split_model(task, task.build_model(), count) for server in servers}
    routers = [StageRouter() for _ in range(count)]
    for router in routers:
        router.announce(dict.fromkeys(servers, 0.0))
        router.observe("r0", 0.5)  # r0 answers twice as fast: it gets two micro-batches in three
        router.observe("r1", 1.0)
    examples = [{"text": text} for text in generate_examples(9, 12)]
    sizes = [3, 2, 4, 1, 2]
    assert sum(sizes) == len(examples)
    routes: list[tuple[str, ...]] = []
    start = 0
    for size in sizes:
        batch = task.collate(examples[start : start + size])
        start += size
        route = []
        inputs: list[torch.Tensor | None] = []
        outputs: list[torch.Tensor] = []
        hidden: torch.Tensor | None = None
        for k, router in enumerate(routers):  # forward: each hop is a request to the chosen server
            choice = router.choose(0.0)
            assert isinstance(choice, Pick)
            stage = staged[choice.server].stages[k]
            x = None if hidden is None else hidden.detach().requires_grad_(True)
            hidden = stage(x, {name: batch[name] for name in stage.needs})
            route.append(choice.server)
            inputs.append(x)
            outputs.append(hidden)
        routes.append(tuple(route))
        grad = torch.tensor(float(size))  # the loss is a per-sample mean: weight by the sample count
        for k in reversed(range(count)):  # backward: each hop returns the gradient of its input
            outputs[k].backward(grad)
            x = inputs[k]
            if x is not None:
                assert x.grad is not None
                grad = x.grad
    assert {r for route in routes for r in route} == set(servers)  # both servers of a stage took work

    whole = task.build_model()
    task.loss(whole, task.collate(examples)).backward()
    expected = {name: p.grad for name, p in whole.named_parameters()}
    total = float(sum(sizes))
    tied = staged["r0"].tied[0]
    for k in range(count):
        for stage_name, model_name in staged["r0"].names[k].items():
            grads = [dict(staged[s].stages[k].named_parameters())[stage_name].grad for s in servers]
            if k == 0 and stage_name == tied.first:
                grads += [dict(staged[s].stages[-1].named_parameters())[tied.last].grad for s in servers]
            averaged = sum(g for g in grads if g is not None) / total  # the stage's all-reduce
            torch.testing.assert_close(averaged, expected[model_name], rtol=1e-4, atol=1e-6, msg=model_name)
