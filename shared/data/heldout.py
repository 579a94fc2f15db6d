"""The held-out examples of a run: read in one fixed order, named by a digest (protocols.evaluation).

Every evaluator must compute its loss over the same examples in the same order, so nothing here shuffles:
:func:`read_heldout` reads files in the order given (callers sort them by name), each line after line,
and stops after ``count`` examples. JSON-lines files (``.jsonl``/``.json``) hold one JSON object per
line; text files (``.txt``) hold one example ``{"text": line}`` per non-empty line, as the training
stream reads them (volunteer.data). :func:`heldout_digest` is the SHA-256 of the examples' canonical JSON
(keys sorted, no spaces, one line each): the same examples give the same digest in any process, so the
backbone can compute it from its own held-out shards without torch.

The backbone writes the synthetic corpus's held-out shard with :func:`write_heldout` (a seed of its own,
derived from the run's seed: no training shard holds the same stream). Blocking file I/O: call these
from a worker thread.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

from .corpus import generate_examples

__all__ = ["HELDOUT_DIR", "HELDOUT_SHARD", "heldout_digest", "read_heldout", "write_heldout"]

#: the held-out shards' directory under a backbone's shard directory
HELDOUT_DIR = "heldout"
#: the held-out shard a backbone writes for a run with ``dataset.generate``
HELDOUT_SHARD = "heldout-00000.jsonl"
#: one held-out line may be this long at most (a JSON example of a long document)
MAX_LINE_BYTES = 1 << 20
_TEXT_SUFFIXES = (".txt",)


def read_heldout(files: Iterable[Path], count: int, text_field: str = "text") -> list[dict[str, Any]]:
    """The first ``count`` examples of ``files`` in this order (fewer if they hold fewer).

    Raises:
        ConfigError: a file cannot be read, a line is not a JSON object, or is longer than 1 MiB.
    """
    examples: list[dict[str, Any]] = []
    for path in files:
        if len(examples) >= count:
            break
        for example in _examples(path, text_field):
            examples.append(example)
            if len(examples) >= count:
                break
    return examples


def _examples(path: Path, text_field: str) -> Iterator[dict[str, Any]]:
    text = path.suffix in _TEXT_SUFFIXES
    try:
        with path.open("rb") as file:
            for number, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), 1):
                if len(raw) > MAX_LINE_BYTES:
                    raise ConfigError(f"held-out file {path.name}, line {number}: longer than 1 MiB")
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.strip():
                    continue
                if text:
                    yield {text_field: line}
                    continue
                example = json.loads(line)
                if not isinstance(example, dict):
                    raise ConfigError(f"held-out file {path.name}, line {number}: not a JSON object")
                yield example
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"cannot read the held-out file {path}: {exc}") from exc


def heldout_digest(examples: Iterable[dict[str, Any]]) -> str:
    """The SHA-256 (hex) of the examples' canonical JSON, one line each (see the module docstring)."""
    digest = hashlib.sha256()
    for example in examples:
        line = json.dumps(example, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()


def write_heldout(directory: Path, examples: int, seed: int) -> Path:
    """Write :data:`HELDOUT_SHARD` of ``examples`` synthetic paragraphs into ``directory`` unless it
    holds that many already (atomically: a shard that exists is complete); returns its path. A run whose
    ``eval_examples`` grew gets a longer shard: the same stream, so its first examples stay the same."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / HELDOUT_SHARD
    if path.exists():
        with path.open("rb") as file:
            if sum(1 for line in file if line.strip()) >= examples:
                return path
    stream = int.from_bytes(hashlib.sha256(f"dedloc-heldout:{seed}".encode()).digest()[:8], "big")
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    try:
        with tmp.open("w", encoding="utf-8") as file:
            file.writelines(json.dumps({"text": text}) + "\n" for text in generate_examples(stream, examples))
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
