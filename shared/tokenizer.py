"""The run's tokenizer: trained once from the run's text, then pinned by its SHA-256 like the parameters.

A Hugging Face task (``hf-mlm``, ``hf-clm``) turns text into token ids with the run's tokenizer, so every
peer must use the same one, byte for byte: a peer with another vocabulary computes gradients for other
embedding rows (or of another shape) and poisons every round. The tokenizer is therefore part of the run
(``[tokenizer]``, :class:`protocols.training.TokenizerSpec`):

* the backbone trains it at its first start with the ``tokenizers`` library (:func:`train_tokenizer`: no
  torch, so a backbone on a CPU server can) or takes the organizer's ``tokenizer.json``;
* its SHA-256 (:func:`tokenizer_sha256`) goes into the training spec the backbone serves; volunteers fetch
  the bytes from the backbone API, refuse bytes that hash to anything else, and keep them in their data
  dir under that hash;
* :func:`read_tokenizer` checks a tokenizer before use: it parses, holds every special token the tasks
  use (:data:`SPECIAL_TOKENS`), and is at most :data:`MAX_TOKENIZER_BYTES` long.

The trained pipeline follows ALBERT's and sahajBERT's (seed 003, "tokenizer"): NFKC normalization, runs of
spaces collapsed, optional lower-casing; Unigram with the "▁" word-boundary marker (ALBERT), WordPiece
with BERT's pre-tokenizer, or byte-level BPE (GPT-2: no unknown tokens); ``[CLS] … [SEP]`` added around a
sequence when a masked-LM tokenizer is asked for special tokens. The tasks themselves never rely on that
template: they add the special tokens where their packing rule says (:mod:`volunteer.tasks.hf`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from protocols.training import TokenizerSpec

from .errors import ConfigError

__all__ = [
    "MAX_TOKENIZER_BYTES",
    "SPECIAL_TOKENS",
    "TokenizerInfo",
    "read_tokenizer",
    "tokenizer_json_config",
    "tokenizer_sha256",
    "train_tokenizer",
]

#: the special tokens every run tokenizer holds, in this order (ids 0-4 in a trained one)
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MAX_TOKENIZER_BYTES = 64 << 20
_TRAIN_BATCH = 1000  # texts handed to the trainer at a time


@dataclass(frozen=True)
class TokenizerInfo:
    """What the tasks and the export need to know of a tokenizer."""

    vocab_size: int
    special: dict[str, int]  # SPECIAL_TOKENS -> id

    @property
    def pad(self) -> int:
        return self.special["[PAD]"]

    @property
    def cls(self) -> int:
        return self.special["[CLS]"]

    @property
    def sep(self) -> int:
        return self.special["[SEP]"]

    @property
    def mask(self) -> int:
        return self.special["[MASK]"]

    @property
    def unk(self) -> int:
        return self.special["[UNK]"]


def tokenizer_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_tokenizer(data: bytes, name: str = "the run's tokenizer") -> tuple[Any, TokenizerInfo]:
    """Parse ``data`` (a ``tokenizer.json``) with the ``tokenizers`` library and check it is usable.

    Returns:
        the ``tokenizers.Tokenizer`` and its :class:`TokenizerInfo`.

    Raises:
        ConfigError: too long, not a tokenizer, or a special token is missing.
    """
    if len(data) > MAX_TOKENIZER_BYTES:
        raise ConfigError(f"{name} is {len(data)} bytes long; at most {MAX_TOKENIZER_BYTES} are accepted")
    from tokenizers import Tokenizer  # the backbone's and the volunteer's extra; not needed to import us

    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, Exception) as exc:  # the Rust side raises plain Exception
        raise ConfigError(f"{name} is not a tokenizer.json the tokenizers library reads: {exc}") from exc
    special: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ConfigError(
                f"{name} has no {token} token; a run's tokenizer needs {', '.join(SPECIAL_TOKENS)}"
            )
        special[token] = int(token_id)
    return tokenizer, TokenizerInfo(int(tokenizer.get_vocab_size(with_added_tokens=True)), special)


def train_tokenizer(spec: TokenizerSpec, texts: Iterable[str], *, masked_lm: bool = True) -> bytes:
    """A new tokenizer of kind ``spec.kind`` trained on at most ``spec.train_examples`` of ``texts``.

    Returns the ``tokenizer.json`` bytes (their SHA-256 pins the run's tokenizer). Blocking (seconds to
    minutes): run it in a worker thread.

    Raises:
        ConfigError: ``spec.kind`` is not a trained kind, or ``texts`` holds no text.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    special = list(SPECIAL_TOKENS)
    steps = [normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.lowercase:
        steps.append(normalizers.Lowercase())
    tokenizer: Any
    if spec.kind == "unigram":
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer: Any = trainers.UnigramTrainer(
            vocab_size=spec.vocab_size, special_tokens=special, unk_token="[UNK]", show_progress=False
        )
    elif spec.kind == "wordpiece":
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(
            vocab_size=spec.vocab_size, special_tokens=special, show_progress=False
        )
    elif spec.kind == "bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=spec.vocab_size,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        raise ConfigError(f"tokenizer kind {spec.kind!r} is not trained; use unigram, wordpiece or bpe")
    tokenizer.normalizer = normalizers.Sequence(steps)
    seen = 0

    def batches() -> Iterator[list[str]]:
        nonlocal seen
        batch: list[str] = []
        for text in texts:
            if seen >= spec.train_examples:
                break
            if isinstance(text, str) and text:
                batch.append(text)
                seen += 1
                if len(batch) == _TRAIN_BATCH:
                    yield batch
                    batch = []
        if batch:
            yield batch

    tokenizer.train_from_iterator(batches(), trainer=trainer)
    if seen == 0:
        raise ConfigError("the run's shards hold no text to train its tokenizer on")
    if masked_lm:
        cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
    data: bytes = tokenizer.to_str().encode("utf-8")
    read_tokenizer(data, "the trained tokenizer")  # every special token made it
    return data


def tokenizer_json_config(info: TokenizerInfo, model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` for a Hugging Face export: a fast tokenizer over ``tokenizer.json``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
        "bos_token": "[CLS]",
        "eos_token": "[SEP]",
    }
