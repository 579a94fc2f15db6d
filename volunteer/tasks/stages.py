"""A task's model as ``S`` consecutive pipeline stages (issue 17 item 1; seed 004 §3.2; DESIGN D9 ``swarm``).

SWARM splits a model into stages of similar blocks, each served by a swarm of peers (seed 004 §3.2: "we
assume that the model consists of similar blocks and thus partition it into evenly sized stages").
:func:`split_model` does that for the built-in tasks: ``tiny-mlm`` (:mod:`.tiny_mlm`) and the Hugging Face
tasks (:mod:`.hf`) for the model types ``gpt2`` (``hf-clm``), ``bert`` and ``albert`` (``hf-mlm``).
Blocks are split evenly (stage ``k`` holds blocks ``[round(kB/S), round((k+1)B/S))``, Python's
round-half-to-even: sizes differ by at most one), the embeddings go with the first stage and the output
head and the loss with the last; ``S = 1`` is the whole model.

**The contract** (what a stage server and a trainer may rely on, whatever carries the tensors):

* *Forward.* Stage ``k`` is an ``nn.Module`` called as ``stage(hidden, batch)``: ``hidden`` is ``None``
  for the first stage and the previous stage's output otherwise; ``batch`` holds the fields of the task's
  collated batch named in ``stage.needs`` (the trainer sends those along with each request: token ids for
  the attention masks, labels for the loss). Every stage but the last returns a float tensor of shape
  ``(samples, length, width)``; the last returns the task's scalar loss, the mean over the micro-batch's
  samples exactly as :meth:`~volunteer.tasks.base.Task.loss` computes it. Composing the stages
  (:func:`run_stages`) equals ``task.loss(model, batch)`` up to float rounding (tested).
* *Samples are independent.* Row ``i`` of every output depends only on sample ``i`` (no batch
  statistics), so a micro-batch may be split or merged at any stage; since the loss is a per-sample mean,
  a server weights each micro-batch's gradient by its sample count, as the batch mode does.
* *Backward.* Given the gradient of its output (``1`` for the last stage's loss), a stage's autograd graph
  yields the gradient of its input ``hidden`` (sent back to the previous stage; the first stage has none)
  and accumulates its parameters' gradients.
* *Parameters.* The stages' parameters are the model's own ``Parameter`` objects, each in exactly one
  stage (:attr:`StagedModel.names` maps every stage parameter name to the model's name), *except* tied
  weights. A server builds the model from the run's spec (deterministic: :meth:`~.base.Task.build_model`),
  splits it and keeps its stage, so every server of a stage starts from identical parameters.
* *Tied weights.* The three model families tie the output layer to the token embedding. With ``S >= 2``
  the embedding lives in the first stage and the output layer in the last, so the last stage holds a
  *copy* (a separate ``Parameter``, equal at the start) and :attr:`StagedModel.tied` names the pair. The
  whole model's gradient of a tied weight is the *sum* of the two copies' gradients (tested); the serving
  protocol must add them (the two stages exchange that one tensor's accumulated gradient before they
  step, as Megatron-LM all-reduces the embedding gradient between its first and last pipeline stages)
  and apply the same update to both, which keeps them equal. With ``S = 1`` nothing is copied.
* *Randomness.* With dropout ``> 0`` the stages draw different random masks than the whole model would,
  so equivalence then holds in distribution only; the built-in tasks' tests use dropout 0.

**What is refused** (``ConfigError``): more stages than blocks; a model type without an adapter here;
ALBERT layer groups that would span two stages (ALBERT shares one group's parameters among consecutive
layers, so stages split its *groups*: ``num_hidden_groups >= S`` is needed, e.g. the default single group
cannot be split); a BERT configured as a decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional

from shared.errors import ConfigError

from .base import Task
from .hf import HFTask, _per_block_mean
from .tiny_mlm import IGNORE, PAD, TinyMLM, TinyMLMModel

__all__ = ["Stage", "StagedModel", "TiedWeight", "block_ranges", "run_stages", "split_model"]

# (blocks, schedule, hidden, batch) -> hidden: how one architecture runs a stage's blocks
_Runner = Callable[[nn.ModuleList, tuple[int, ...], torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class TiedWeight:
    """A weight the whole model shares between its first and last stage (module docstring).

    Attributes:
        first: the parameter's name in the first stage (the token embedding).
        last: the name of its copy in the last stage (the output layer).
        model: its name in the whole model.
    """

    first: str
    last: str
    model: str


class Stage(nn.Module):
    """One pipeline stage: optional embedding, a run of blocks, optional head and loss (module docstring).

    Attributes:
        index: ``k``, from 0.
        count: ``S``.
        needs: the batch fields :meth:`forward` reads.
    """

    def __init__(
        self,
        index: int,
        count: int,
        embed: nn.Module | None,
        blocks: Sequence[nn.Module],
        schedule: tuple[int, ...],
        head: nn.Module | None,
        runner: _Runner,
        needs: tuple[str, ...],
    ) -> None:
        super().__init__()
        self.index, self.count, self.needs = index, count, needs
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.schedule = schedule  # the order the blocks run in (ALBERT repeats each group)
        self.head = head
        self._runner = runner

    def forward(self, hidden: torch.Tensor | None, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The next stage's input, or the loss for the last stage (module docstring).

        Raises:
            ValueError: ``hidden`` is given to the first stage or missing for a later one, or ``batch``
                lacks a field in :attr:`needs`.
        """
        missing = [name for name in self.needs if name not in batch]
        if missing:
            raise ValueError(f"stage {self.index} needs batch fields {missing}")
        if (hidden is None) != (self.embed is not None):
            raise ValueError(f"stage {self.index} {'takes no' if self.embed else 'needs a'} hidden state")
        if self.embed is not None:
            hidden = self.embed(batch)
        assert hidden is not None
        hidden = self._runner(self.blocks, self.schedule, hidden, batch)
        if self.head is not None:
            out: torch.Tensor = self.head(hidden, batch)
            return out
        return hidden


@dataclass(frozen=True)
class StagedModel:
    """The stages of one model.

    Attributes:
        stages: ``S`` modules, in pipeline order.
        names: per stage, its parameter names mapped to the whole model's (tied copies excluded).
        tied: weights the first and last stage both hold (module docstring); empty when ``S = 1``.
        blocks: per stage, the indices of the model's blocks it holds (ALBERT: layer groups).
    """

    stages: tuple[Stage, ...]
    names: tuple[dict[str, str], ...]
    tied: tuple[TiedWeight, ...]
    blocks: tuple[range, ...]


def block_ranges(blocks: int, count: int) -> list[range]:
    """Even consecutive ranges: stage ``k`` gets ``[round(k B / S), round((k+1) B / S))``.

    Raises:
        ConfigError: ``count < 1`` or more stages than blocks.
    """
    if count < 1:
        raise ConfigError(f"need at least one stage, got {count}")
    if count > blocks:
        raise ConfigError(f"cannot split {blocks} blocks into {count} stages (at most one stage per block)")
    bounds = [round(k * blocks / count) for k in range(count + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(count)]


def run_stages(stages: Sequence[Stage], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Compose the stages on one batch, as one trainer and one server per stage would: the loss."""
    hidden: torch.Tensor | None = None
    for stage in stages:
        hidden = stage(hidden, {name: batch[name] for name in stage.needs})
    assert hidden is not None
    return hidden


def split_model(task: Task, model: nn.Module, count: int) -> StagedModel:
    """``model`` (built by ``task``) as ``count`` consecutive stages (module docstring).

    The stages share the model's parameters (no copy, except tied weights' last-stage copies).

    Raises:
        ConfigError: see "What is refused" in the module docstring.
    """
    if isinstance(task, TinyMLM) and isinstance(model, TinyMLMModel):
        parts = _tiny_mlm(model)
    elif isinstance(task, HFTask):
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        adapter = _HF_ADAPTERS.get(str(model_type))
        if adapter is None:
            raise ConfigError(
                f"{task.name}: no pipeline stages for model type {model_type!r} "
                f"(supported: {', '.join(sorted(_HF_ADAPTERS))})"
            )
        parts = adapter(model)
    else:
        raise ConfigError(f"task {task.name!r} has no pipeline stages")
    return _assemble(parts, model, count)


# --------------------------------------------------------------------------------------------- assembly


@dataclass(frozen=True)
class _Parts:
    embed: nn.Module
    blocks: list[nn.Module]
    layers: list[int]  # the block each layer runs, in order (identity but for ALBERT)
    make_head: Callable[[nn.Parameter], nn.Module]  # given the output weight (tied or a copy)
    tied: nn.Parameter
    runner: _Runner
    needs_first: tuple[str, ...]
    needs_all: tuple[str, ...]
    needs_last: tuple[str, ...]


def _assemble(parts: _Parts, model: nn.Module, count: int) -> StagedModel:
    ranges = block_ranges(len(parts.blocks), count)
    tied_copy = count > 1
    output_weight = nn.Parameter(parts.tied.detach().clone()) if tied_copy else parts.tied
    stages = []
    for k, blocks in enumerate(ranges):
        first, last = k == 0, k == count - 1
        schedule = tuple(b - blocks.start for b in parts.layers if b in blocks)
        needs = parts.needs_all + (parts.needs_first if first else ()) + (parts.needs_last if last else ())
        stages.append(
            Stage(
                index=k,
                count=count,
                embed=parts.embed if first else None,
                blocks=[parts.blocks[b] for b in blocks],
                schedule=schedule,
                head=parts.make_head(output_weight) if last else None,
                runner=parts.runner,
                needs=tuple(dict.fromkeys(needs)),
            )
        )
    by_id = {id(p): name for name, p in model.named_parameters()}  # a shared tensor: its first name
    names: list[dict[str, str]] = []
    tied: list[TiedWeight] = []
    for stage in stages:
        mapping = {}
        for name, param in stage.named_parameters():
            if param is output_weight and tied_copy:
                first_name = next(n for n, p in stages[0].named_parameters() if p is parts.tied)
                tied.append(TiedWeight(first=first_name, last=name, model=by_id[id(parts.tied)]))
                continue
            mapping[name] = by_id[id(param)]
        names.append(mapping)
    return StagedModel(stages=tuple(stages), names=tuple(names), tied=tuple(tied), blocks=tuple(ranges))


# -------------------------------------------------------------------------------------------- tiny-mlm


class _TinyEmbed(nn.Module):
    def __init__(self, model: TinyMLMModel) -> None:
        super().__init__()
        self.tokens, self.positions, self.norm = model.tokens, model.positions, model.embedding_norm

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device)
        out: torch.Tensor = self.norm(self.tokens(ids) + self.positions(positions))
        return out


class _TinyHead(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: nn.Parameter) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, hidden: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        # TinyMLM.loss, with the model's tied output layer replaced by this stage's weight
        labels = batch["labels"]
        predicted = labels != IGNORE
        logits = functional.linear(hidden[predicted], self.weight, self.bias)
        losses = functional.cross_entropy(logits, labels[predicted], reduction="none")
        rows = predicted.nonzero()[:, 0]
        per_sample = torch.zeros(labels.shape[0], dtype=losses.dtype).index_add_(0, rows, losses)
        return (per_sample / predicted.sum(dim=1).clamp(min=1)).mean()


def _tiny_runner(
    blocks: nn.ModuleList, schedule: tuple[int, ...], hidden: torch.Tensor, batch: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    padding = batch["input_ids"] == PAD
    for b in schedule:
        hidden = blocks[b](hidden, src_key_padding_mask=padding)
    return hidden


def _tiny_mlm(model: TinyMLMModel) -> _Parts:
    layers = list(model.encoder.layers)
    if model.encoder.norm is not None:  # not built by TinyMLMModel; refuse rather than drop it
        raise ConfigError("tiny-mlm stages expect an encoder without a final norm")
    bias = model.output_bias
    return _Parts(
        embed=_TinyEmbed(model),
        blocks=layers,
        layers=list(range(len(layers))),
        make_head=lambda weight: _TinyHead(weight, bias),
        tied=cast(nn.Parameter, model.tokens.weight),
        runner=_tiny_runner,
        needs_first=(),
        needs_all=("input_ids",),  # every stage masks [PAD] positions
        needs_last=("labels",),
    )


# ----------------------------------------------------------------------------------- Hugging Face: gpt2


class _Sequential(nn.Module):
    """Modules applied in order to the batch's ``input_ids`` then to the result."""

    def __init__(self, first: nn.Module, *rest: nn.Module) -> None:
        super().__init__()
        self.first, self.rest = first, nn.ModuleList(rest)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.first(batch["input_ids"])
        for module in self.rest:
            out = module(out)
        return out


class _GPT2Embed(nn.Module):
    def __init__(self, base: Any) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = base.wte, base.wpe, base.drop

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        out: torch.Tensor = self.drop(self.wte(ids) + self.wpe(positions))
        return out


class _CausalHead(nn.Module):
    """Final norm, output layer (the tied weight), next-token loss as :class:`~.hf.HFCausalLM`."""

    def __init__(self, norm: nn.Module, weight: nn.Parameter) -> None:
        super().__init__()
        self.norm, self.weight = norm, weight

    def forward(self, hidden: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = functional.linear(self.norm(hidden), self.weight)
        return _per_block_mean(logits[:, :-1], ids[:, 1:])


def _gpt2(model: Any) -> _Parts:
    from transformers.masking_utils import create_causal_mask

    base: Any = model.transformer
    config = model.config

    def runner(
        blocks: nn.ModuleList, schedule: tuple[int, ...], hidden: torch.Tensor, batch: Mapping[str, Any]
    ) -> torch.Tensor:
        # as GPT2Model.forward without a cache or padding mask: the mask depends on the shape alone
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
        )
        for b in schedule:
            hidden = blocks[b](hidden, None, mask, None, use_cache=False, position_ids=positions)
        return hidden

    norm = base.ln_f
    return _Parts(
        embed=_GPT2Embed(base),
        blocks=list(base.h),
        layers=list(range(len(base.h))),
        make_head=lambda weight: _CausalHead(norm, weight),
        tied=_output_weight(model, base.wte.weight),
        runner=runner,
        needs_first=("input_ids",),
        needs_all=(),  # the causal mask depends on the shape alone
        needs_last=("input_ids",),  # the next-token labels
    )


# ---------------------------------------------------------------------------- Hugging Face: bert, albert


class _MaskedHead(nn.Module):
    """Prediction transform, output layer (the tied weight), masked-token loss as :class:`~.hf.HFMaskedLM`."""

    def __init__(self, transform: nn.Module, weight: nn.Parameter, bias: nn.Parameter) -> None:
        super().__init__()
        self.transform, self.weight, self.bias = transform, weight, bias

    def forward(self, hidden: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logits = functional.linear(self.transform(hidden), self.weight, self.bias)
        return _per_block_mean(logits, batch["labels"])


def _bidirectional_runner(config: Any) -> _Runner:
    from transformers.masking_utils import create_bidirectional_mask

    def runner(
        blocks: nn.ModuleList, schedule: tuple[int, ...], hidden: torch.Tensor, batch: Mapping[str, Any]
    ) -> torch.Tensor:
        # as the models' forward without a padding mask (packed blocks have none): shape alone decides
        mask = create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=None)
        for b in schedule:
            hidden = blocks[b](hidden, mask)
        return hidden

    return runner


def _bert(model: Any) -> _Parts:
    config = model.config
    if config.is_decoder:
        raise ConfigError("bert stages are built for the masked-LM encoder, not is_decoder=True")
    base: Any = model.bert
    predictions: Any = model.cls.predictions
    layers = list(base.encoder.layer)
    return _Parts(
        embed=_Sequential(base.embeddings),
        blocks=layers,
        layers=list(range(len(layers))),
        make_head=lambda weight: _MaskedHead(predictions.transform, weight, predictions.decoder.bias),
        tied=_output_weight(model, base.embeddings.word_embeddings.weight),
        runner=_bidirectional_runner(config),
        needs_first=("input_ids",),
        needs_all=(),
        needs_last=("labels",),
    )


def _albert(model: Any) -> _Parts:
    config = model.config
    base: Any = model.albert
    predictions: Any = model.predictions
    groups = list(base.encoder.albert_layer_groups)
    per_group = config.num_hidden_layers / config.num_hidden_groups
    layers = [int(i / per_group) for i in range(config.num_hidden_layers)]  # AlbertTransformer's rule
    transform = nn.Sequential(predictions.dense, _Activation(predictions.activation), predictions.LayerNorm)
    return _Parts(
        embed=_Sequential(base.embeddings, base.encoder.embedding_hidden_mapping_in),
        blocks=groups,
        layers=layers,
        make_head=lambda weight: _MaskedHead(transform, weight, predictions.decoder.bias),
        tied=_output_weight(model, base.embeddings.word_embeddings.weight),
        runner=_bidirectional_runner(config),
        needs_first=("input_ids",),
        needs_all=(),
        needs_last=("labels",),
    )


class _Activation(nn.Module):
    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


def _output_weight(model: Any, embedding: nn.Parameter) -> nn.Parameter:
    """The input embedding, after checking the model's output layer is tied to it (the heads assume so)."""
    output: nn.Module | None = model.get_output_embeddings()
    if output is None or output.weight is not embedding:
        raise ConfigError("pipeline stages expect the output layer tied to the token embedding")
    return embedding


_HF_ADAPTERS: dict[str, Callable[[Any], _Parts]] = {"albert": _albert, "bert": _bert, "gpt2": _gpt2}
