"""``hf-mlm`` and ``hf-clm``: any Hugging Face ``transformers`` model with a masked-LM or causal-LM head,
built from a config in the manifest (never from hub weights) and trained from scratch on the run's text
with the run's tokenizer (:mod:`shared.tokenizer`).

**The model** is ``AutoModelForMaskedLM`` / ``AutoModelForCausalLM.from_config`` of the config
:func:`shared.tasks.hf_model_config` gives (the manifest's ``task_options`` plus the tokenizer's vocabulary
size and special token ids), initialized by the model's own ``_init_weights`` under a private copy of
torch's RNG seeded with the run's seed (``torch.random.fork_rng``): bit-identical on every peer, and the
process's global RNG is left as it was. A config field the model type does not have is refused (a typo
would otherwise be kept as a silent attribute).

**The data pipeline** (:meth:`HFTask.preprocess`) runs in the prefetch thread, never in the trio loop:
texts are tokenized in batches (``tokenizers``' ``encode_batch``, without special tokens), then packed
into blocks of exactly ``seq_len`` tokens, the way BERT, ALBERT and GPT-2 were pre-trained:

* ``hf-mlm``: documents are concatenated, each followed by ``[SEP]``; every block is ``[CLS]`` then the next
  ``seq_len - 1`` tokens of that stream;
* ``hf-clm``: the same stream cut into blocks of ``seq_len`` tokens (``[SEP]`` ends each document).

A *block* is one sample. Blocks have no padding, so a batch's loss needs no attention mask, and each
block's masking is seeded by its own token ids, so :meth:`HFTask.collate` depends on the blocks alone:
the property that makes two peers with ``b`` blocks each equal one process with ``2b`` (D1, DESIGN §1).

**Masking** (``hf-mlm``, BERT's rule): of the block's tokens that are not special, ``mask_prob`` (at least
one) are predicted; of those, 80 % are replaced by ``[MASK]``, 10 % by a random non-special token, 10 %
kept. The choice comes from ``numpy.random.default_rng(crc32(block))``.

**The loss** is the mean over a batch's blocks of each block's mean cross-entropy over its predicted
tokens (every masked token for ``hf-mlm``, every next token for ``hf-clm``), computed in float32 whatever
the autocast precision, so the gradient of ``2b`` blocks is the mean of the gradients of its halves.
"""

from __future__ import annotations

import inspect
import logging
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn import functional

from protocols.training import TrainingSpec
from shared.errors import ConfigError
from shared.tasks import HFOptions, hf_model_config
from shared.tokenizer import read_tokenizer

from .base import Batch

__all__ = ["IGNORE", "HFCausalLM", "HFMaskedLM", "HFTask"]

logger = logging.getLogger(__name__)
IGNORE = -100  # label of tokens that are not predicted (torch's cross-entropy convention)
_ENCODE_BATCH = 64  # texts tokenized at a time


class HFTask:
    """What ``hf-mlm`` and ``hf-clm`` share (see the module docstring)."""

    name = "hf"
    masked = False

    def __init__(self, spec: TrainingSpec, tokenizer: bytes | None = None) -> None:
        self.options = HFOptions.parse(self.name, spec.task_options)
        if tokenizer is None:
            raise ConfigError(f"{self.name} needs the run's tokenizer, and none was given")
        self.tokenizer, self.info = read_tokenizer(tokenizer)
        self.seed = spec.seed
        self.text_field = spec.dataset.text_field
        self.seq_len = self.options.seq_len
        self.special_ids = np.array(sorted(self.info.special.values()), dtype=np.int64)
        self.config = self._config()
        self.skipped = 0  # examples without text, skipped by preprocess

    # -------------------------------------------------------------------- the model

    def _config(self) -> Any:
        from transformers import AutoConfig  # heavy: imported when a task is made, not with the module

        values = hf_model_config(self.options, self.info.vocab_size, self.info.special)
        model_type = str(values.pop("model_type"))
        try:
            config = AutoConfig.for_model(model_type, **values)
        except ValueError as exc:
            raise ConfigError(f"{self.name}: {exc}") from exc
        known = set(type(config)().to_dict()) | set(getattr(config, "attribute_map", {}))
        known |= set(inspect.signature(type(config).__init__).parameters)
        unknown = sorted(name for name, _ in self.options.config if name not in known)
        if unknown:
            raise ConfigError(
                f"{self.name}: a {model_type} config has no field {', '.join(unknown)} (task_options)"
            )
        longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if isinstance(longest, int) and longest < self.seq_len:
            raise ConfigError(
                f"{self.name}: seq_len {self.seq_len} is longer than the model's {longest} positions "
                "(max_position_embeddings)"
            )
        return config

    def _auto_class(self) -> Any:
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            try:
                model: torch.nn.Module = self._auto_class().from_config(self.config)
            except ValueError as exc:  # a model type without this head
                raise ConfigError(f"{self.name}: {exc}") from exc
        return model.float()

    def gradient_checkpointing(self, model: torch.nn.Module, enabled: bool) -> None:
        """Activation checkpointing: less memory for a second forward pass in backward.

        Raises:
            ConfigError: the model type cannot checkpoint activations (ALBERT cannot).
        """
        # transformers 5 renamed gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable
        kind = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
        switch = f"{kind}_checkpointing_{'enable' if enabled else 'disable'}"
        try:
            getattr(model, switch)()
        except ValueError as exc:  # "AlbertForMaskedLM does not support activation checkpointing"
            reason = str(exc).rstrip(".")
            raise ConfigError(
                f"{self.name}: {reason}; remove gradient_checkpointing from the manifest"
            ) from exc

    # ------------------------------------------------------------------- the data

    def preprocess(self, examples: Iterator[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
        """Texts to packed blocks of ``seq_len`` token ids (module docstring); blocking, lazy."""
        sep = self.info.sep
        stream: list[int] = []
        width = self.seq_len - 1 if self.masked else self.seq_len
        while True:
            texts = []
            for example in examples:
                text = example.get(self.text_field)
                if isinstance(text, str) and text:
                    texts.append(text)
                    if len(texts) == _ENCODE_BATCH:
                        break
                else:
                    self.skipped += 1
                    if self.skipped in (1, 1000):
                        logger.warning(
                            "skipping examples without text in field %r (%d so far)",
                            self.text_field,
                            self.skipped,
                        )
            if not texts:
                return
            for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False):
                stream.extend(encoding.ids)
                stream.append(sep)
            start = 0
            while len(stream) - start >= width:
                chunk = stream[start : start + width]
                start += width
                block = [self.info.cls, *chunk] if self.masked else chunk
                yield {"input_ids": np.asarray(block, dtype=np.int32)}
            del stream[:start]

    def _blocks(self, examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        if not examples:
            raise ValueError("cannot collate an empty batch")
        rows = []
        for example in examples:
            ids = example.get("input_ids")
            if ids is None:
                raise ValueError(f"{self.name} collates packed blocks (preprocess); got {sorted(example)}")
            block = np.asarray(ids, dtype=np.int64)
            if block.shape != (self.seq_len,):
                raise ValueError(f"a block holds {block.shape} tokens, not ({self.seq_len},)")
            rows.append(block)
        return np.stack(rows)

    def batch_size(self, batch: Mapping[str, torch.Tensor]) -> int:
        return int(batch["input_ids"].shape[0])

    def collate(self, examples: Sequence[Mapping[str, Any]]) -> Batch:
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


def _per_block_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over blocks of each block's mean cross-entropy over its predicted tokens, in float32."""
    rows, length = labels.shape
    losses = functional.cross_entropy(
        logits.reshape(rows * length, -1).float(), labels.reshape(-1), reduction="none", ignore_index=IGNORE
    ).view(rows, length)
    predicted = (labels != IGNORE).sum(dim=1).clamp(min=1)
    return (losses.sum(dim=1) / predicted).mean()


class HFMaskedLM(HFTask):
    """``hf-mlm`` (module docstring)."""

    name = "hf-mlm"
    masked = True

    def _auto_class(self) -> Any:
        from transformers import AutoModelForMaskedLM

        return AutoModelForMaskedLM

    def mask(self, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels) of one block: BERT's rule, seeded by the block (module docstring)."""
        rng = np.random.default_rng(zlib.crc32(block.astype(np.int64).tobytes()))
        inputs, labels = block.copy(), np.full_like(block, IGNORE)
        candidates = np.flatnonzero(~np.isin(block, self.special_ids))
        if candidates.size == 0:
            return inputs, labels
        count = min(candidates.size, max(1, round(self.options.mask_prob * candidates.size)))
        chosen = rng.permutation(candidates)[:count]
        labels[chosen] = block[chosen]
        roll = rng.random(count)
        inputs[chosen[roll < 0.8]] = self.info.mask
        swapped = chosen[(roll >= 0.8) & (roll < 0.9)]
        replacements = rng.integers(0, self.info.vocab_size, size=swapped.size)
        keep = np.isin(replacements, self.special_ids)  # never a special token: the word stays instead
        inputs[swapped] = np.where(keep, block[swapped], replacements)
        return inputs, labels

    def collate(self, examples: Sequence[Mapping[str, Any]]) -> Batch:
        blocks = self._blocks(examples)
        pairs = [self.mask(block) for block in blocks]
        return {
            "input_ids": torch.from_numpy(np.stack([p[0] for p in pairs])),
            "labels": torch.from_numpy(np.stack([p[1] for p in pairs])),
        }

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"]).logits
        return _per_block_mean(logits, batch["labels"])


class HFCausalLM(HFTask):
    """``hf-clm`` (module docstring)."""

    name = "hf-clm"
    masked = False

    def _auto_class(self) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def collate(self, examples: Sequence[Mapping[str, Any]]) -> Batch:
        return {"input_ids": torch.from_numpy(self._blocks(examples))}

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits
        return _per_block_mean(logits[:, :-1], ids[:, 1:])
