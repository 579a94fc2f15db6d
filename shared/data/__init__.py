"""Training data that any role may handle: the synthetic corpus and the catalog of shard files.

Modules:
    corpus  a deterministic synthetic English-like corpus (a small probabilistic grammar) and the
            JSON-lines shards the backbone writes from it
    heldout the held-out examples of a run in their fixed order, their digest, the synthetic held-out
            shard
    shards  the shard files of a directory with their sizes and SHA-256 digests, cached by mtime

Pure Python (no torch, no numpy, no trio).
"""

from __future__ import annotations

from .corpus import VOCABULARY as VOCABULARY
from .corpus import generate_examples as generate_examples
from .corpus import split_words as split_words
from .corpus import write_shards as write_shards
from .shards import ShardCatalog as ShardCatalog
from .shards import file_sha256 as file_sha256
from .shards import is_shard_name as is_shard_name

__all__ = [
    "VOCABULARY",
    "ShardCatalog",
    "file_sha256",
    "generate_examples",
    "is_shard_name",
    "split_words",
    "write_shards",
]
