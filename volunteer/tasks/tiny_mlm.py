"""``tiny-mlm``: a small transformer encoder trained as a masked language model on English-like text.

Built for the project's synthetic corpus (:mod:`shared.data.corpus`): a word-level tokenizer over its
:data:`~shared.data.corpus.VOCABULARY` plus ``[PAD] [UNK] [MASK] [CLS]``, a BERT-like transformer encoder
with learned positions and an output layer tied to the token embedding. With the default options it
trains at 1,500-2,000 samples/s on two CPU cores (batch 16), and with AdamW at 3e-3 its loss falls from
6.5 (chance) to about 4.9 in 200 steps and to about 2.5 in 1,500 steps (measured on the corpus).

Masking follows BERT: 15 % of the words of each example (at least one) are predicted; of those, 80 %
are replaced by ``[MASK]``, 10 % by a random word, 10 % kept. The choice is seeded by the CRC-32 of the
example's text, so the same example is masked the same way in every process and every batch.

Options (``task_options``, parsed by :class:`shared.tasks.TinyMLMOptions`, which backbones check without
torch): ``d_model`` 64, ``layers`` 2, ``heads`` 4, ``seq_len`` 48 (tokens, with
``[CLS]``), ``ffn`` 128, ``dropout`` 0.0 (0 keeps runs deterministic), ``mask_prob`` 0.15.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from protocols.training import TrainingSpec
from shared.data.corpus import VOCABULARY, split_words
from shared.errors import ConfigError
from shared.tasks import TinyMLMOptions

from .base import Batch

__all__ = ["SPECIAL_TOKENS", "TinyMLM", "TinyMLMModel", "TinyMLMOptions"]

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[MASK]", "[CLS]")
PAD, UNK, MASK, CLS = range(len(SPECIAL_TOKENS))
IGNORE = -100  # label of positions that are not predicted (torch's cross-entropy convention)
INIT_STD = 0.02


class TinyMLMModel(nn.Module):
    """BERT's shape: token + position embedding with a layer norm, post-norm transformer layers, and an
    output layer tied to the token embedding. (Post-norm leaves the loss's early plateau, where it
    predicts word frequencies only, in a third of the steps a pre-norm stack of this size needs.)"""

    def __init__(self, vocab_size: int, options: TinyMLMOptions) -> None:
        super().__init__()
        d = options.d_model
        self.tokens = nn.Embedding(vocab_size, d)
        self.positions = nn.Embedding(options.seq_len, d)
        self.embedding_norm = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(
            d,
            options.heads,
            options.ffn,
            options.dropout,
            activation="gelu",
            batch_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, options.layers, enable_nested_tensor=False)
        self.output_bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``(batch, length, d_model)``; ``[PAD]`` positions are not attended to."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.embedding_norm(self.tokens(input_ids) + self.positions(positions))
        out: torch.Tensor = self.encoder(hidden, src_key_padding_mask=input_ids == PAD)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return functional.linear(hidden, self.tokens.weight, self.output_bias)


class TinyMLM:
    """The ``tiny-mlm`` task (see the module docstring)."""

    name = "tiny-mlm"

    def __init__(self, spec: TrainingSpec, tokenizer: bytes | None = None) -> None:
        del tokenizer  # its vocabulary is the corpus's own
        self.options = TinyMLMOptions.parse(spec.task_options)
        self.seed = spec.seed
        self.text_field = spec.dataset.text_field
        self.tokens: tuple[str, ...] = SPECIAL_TOKENS + VOCABULARY
        self.ids = {word: i for i, word in enumerate(self.tokens)}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def build_model(self) -> TinyMLMModel:
        # Built on the meta device (no RNG touched, no memory), then every parameter is set from a
        # generator of its own: the global RNG is neither read nor advanced.
        with torch.device("meta"):
            model = TinyMLMModel(self.vocab_size, self.options)
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(self.seed)
        norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif id(param) in norms:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, INIT_STD, generator=generator)
        return model

    def encode(self, text: str) -> list[int]:
        """``[CLS]`` and the word ids of ``text``, truncated to ``seq_len``."""
        words = split_words(text)[: self.options.seq_len - 1]
        return [CLS, *(self.ids.get(word, UNK) for word in words)]

    def _mask(self, text: str, ids: list[int]) -> tuple[list[int], list[int]]:
        rng = random.Random(zlib.crc32(text.encode("utf-8")))
        inputs, labels = list(ids), [IGNORE] * len(ids)
        candidates = list(range(1, len(ids)))  # never [CLS]
        count = min(len(candidates), max(1, round(self.options.mask_prob * len(candidates))))
        for k in range(count):  # a partial Fisher-Yates shuffle: stable across Python versions
            j = k + int(rng.random() * (len(candidates) - k))
            candidates[k], candidates[j] = candidates[j], candidates[k]
            position = candidates[k]
            labels[position] = ids[position]
            roll = rng.random()
            if roll < 0.8:
                inputs[position] = MASK
            elif roll < 0.9:
                inputs[position] = len(SPECIAL_TOKENS) + int(rng.random() * len(VOCABULARY))
        return inputs, labels

    def preprocess(self, examples: Iterator[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
        return examples  # an example is a sample; collate tokenizes

    def gradient_checkpointing(self, model: torch.nn.Module, enabled: bool) -> None:
        if enabled:
            raise ConfigError("tiny-mlm has no activation checkpointing; remove gradient_checkpointing")

    def collate(self, examples: Sequence[Mapping[str, Any]]) -> Batch:
        if not examples:
            raise ValueError("cannot collate an empty batch")
        length = self.options.seq_len
        rows, targets = [], []
        for example in examples:
            text = example.get(self.text_field)
            if not isinstance(text, str):
                raise ValueError(f"example has no text field {self.text_field!r}: {sorted(example)}")
            inputs, labels = self._mask(text, self.encode(text))
            rows.append(inputs + [PAD] * (length - len(inputs)))
            targets.append(labels + [IGNORE] * (length - len(labels)))
        return {"input_ids": torch.tensor(rows), "labels": torch.tensor(targets)}

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy over each sample's masked words, averaged per sample, then over samples."""
        assert isinstance(model, TinyMLMModel)
        labels = batch["labels"]
        hidden = model(batch["input_ids"])
        predicted = labels != IGNORE
        losses = functional.cross_entropy(
            model.logits(hidden[predicted]), labels[predicted], reduction="none"
        )
        rows = predicted.nonzero()[:, 0]
        per_sample = torch.zeros(labels.shape[0], dtype=losses.dtype).index_add_(0, rows, losses)
        return (per_sample / predicted.sum(dim=1).clamp(min=1)).mean()

    def batch_size(self, batch: Mapping[str, torch.Tensor]) -> int:
        return int(batch["input_ids"].shape[0])
