"""The run's tokenizer on a backbone: made or taken once, kept in the data dir, pinned into the spec served.

``backbone start`` calls :func:`prepare_tokenizer` after the shards are ready and before the API serves
the manifest. A data dir holds at most one tokenizer, ``tokenizer.json``, for good (like its run id):

=====================  ==============================================================================
``[tokenizer] kind``   what happens
=====================  ==============================================================================
``none``               nothing: the task brings its own vocabulary
``file``               the organizer's ``file`` is copied into the data dir (at the first start; later
                       starts check the file still hashes to what the data dir holds)
``unigram`` …          at the first start, trained on the shards the backbone serves (sorted by name,
                       examples in order: the same shards give the same input); later starts reuse it
=====================  ==============================================================================

The spec served to volunteers carries the tokenizer's SHA-256 (``tokenizer.sha256``). A manifest may
pin it itself: then a data dir holding another tokenizer, or a backbone that would have to train a new
one, refuses to start — that is how a second backbone of a run is kept on the first one's tokenizer
(copy the first backbone's ``tokenizer.json`` into its data dir, or name it in ``file``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from protocols.training import TrainingSpec
from shared.data.shards import is_shard_name
from shared.errors import ConfigError
from shared.tokenizer import MAX_TOKENIZER_BYTES, read_tokenizer, tokenizer_sha256, train_tokenizer

__all__ = ["TOKENIZER_FILE", "prepare_tokenizer"]

logger = logging.getLogger(__name__)
TOKENIZER_FILE = "tokenizer.json"


def prepare_tokenizer(training: TrainingSpec, data_dir: Path, shards_dir: Path) -> TrainingSpec:
    """The spec to serve, with ``tokenizer.sha256`` filled in (module docstring). Blocking.

    Raises:
        ConfigError: the tokenizer cannot be read, made or trusted (the message says what to do).
    """
    spec = training.tokenizer
    if spec.kind == "none":
        return training
    held = data_dir / TOKENIZER_FILE
    if held.exists():
        data = _read(held)
        if spec.kind == "file" and spec.file:
            shipped = _read(Path(spec.file))
            if tokenizer_sha256(shipped) != tokenizer_sha256(data):
                raise ConfigError(
                    f"{spec.file} is not the tokenizer this run was started with ({held}); a run keeps "
                    "its tokenizer: restore that file, or give another --data-dir for a new run"
                )
    elif spec.kind == "file" and spec.file:
        data = _read(Path(spec.file))
    elif spec.sha256:
        raise ConfigError(
            f"the manifest pins tokenizer {spec.sha256[:12]}…, but {data_dir} holds no {TOKENIZER_FILE}: "
            "copy it from the run's first backbone into the data dir"
        )
    else:
        data = _train(training, shards_dir)
    digest = tokenizer_sha256(data)
    if spec.sha256 and spec.sha256 != digest:
        raise ConfigError(
            f"the manifest pins tokenizer {spec.sha256[:12]}…, but this backbone's is {digest[:12]}… "
            f"({held}): a run keeps one tokenizer"
        )
    read_tokenizer(data, str(held))
    if not held.exists():
        _write(held, data)
    logger.info("the run's tokenizer: %s (SHA-256 %s)", held, digest)
    return msgspec.structs.replace(training, tokenizer=msgspec.structs.replace(spec, sha256=digest))


def _read(path: Path) -> bytes:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_TOKENIZER_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the tokenizer {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_TOKENIZER_BYTES:
        raise ConfigError(f"the tokenizer {path} is larger than {MAX_TOKENIZER_BYTES} bytes")
    return data


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    with tmp.open("rb") as file:
        os.fsync(file.fileno())
    tmp.replace(path)


def _train(training: TrainingSpec, shards_dir: Path) -> bytes:
    spec = training.tokenizer
    started = time.monotonic()
    logger.info(
        "training the run's %s tokenizer (%d tokens) on at most %d examples of the shards in %s",
        spec.kind,
        spec.vocab_size,
        spec.train_examples,
        shards_dir,
    )
    texts = _texts(shards_dir, training.dataset.text_field)
    data = train_tokenizer(spec, texts, masked_lm=training.task != "hf-clm")
    logger.info("the tokenizer is trained (%.1f s)", time.monotonic() - started)
    return data


def _texts(shards_dir: Path, field: str) -> Iterator[str]:
    """The texts of the training shards (``*.jsonl`` files, not the held-out ones in a subfolder), shard
    by shard in name order; a malformed line is skipped."""
    listed = shards_dir.iterdir() if shards_dir.is_dir() else iter(())
    paths = sorted(p for p in listed if is_shard_name(p.name) and p.suffix == ".jsonl" and p.is_file())
    skipped = 0
    for path in paths:
        with path.open("rb") as lines:
            for line in lines:
                try:
                    example = json.loads(line)
                except ValueError:
                    skipped += 1
                    continue
                text = example.get(field) if isinstance(example, dict) else None
                if isinstance(text, str):
                    yield text
                else:
                    skipped += 1
    if skipped:
        logger.warning("%d lines of the shards held no text in field %r (tokenizer training)", skipped, field)
