"""The dataset shards of one directory: names, sizes and SHA-256 digests (DESIGN D6).

A *shard* is a regular file directly in the directory whose name matches
:data:`protocols.api.SHARD_NAME_PATTERN`, ends with ``.jsonl`` and does not start with a dot (temporary
files of :func:`shared.data.corpus.write_shards` do). Digests are cached per file by ``(mtime, size)``,
so listing a directory of unchanged shards hashes nothing. Blocking file I/O: call it from a worker
thread.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path

from protocols.api import SHARD_NAME_PATTERN, ShardInfo

__all__ = ["ShardCatalog", "file_sha256", "is_shard_name"]

SHARD_SUFFIX = ".jsonl"
_NAME = re.compile(SHARD_NAME_PATTERN)
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_shard_name(name: str) -> bool:
    return bool(_NAME.match(name)) and name.endswith(SHARD_SUFFIX) and not name.startswith(".")


class ShardCatalog:
    """The shards of ``directory`` (which need not exist yet); safe to use from several threads."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._digests: dict[str, tuple[int, int, str]] = {}  # name -> (mtime_ns, size, sha256)

    def list(self) -> list[ShardInfo]:
        """Every shard, sorted by name. Files that vanish while being listed are left out."""
        with self._lock:
            infos: list[ShardInfo] = []
            try:
                entries = sorted(os.scandir(self.directory), key=lambda e: e.name)
            except FileNotFoundError:
                entries = []
            for entry in entries:
                if not is_shard_name(entry.name):
                    continue
                try:
                    if not entry.is_file():
                        continue
                    stat = entry.stat()
                    cached = self._digests.get(entry.name)
                    if cached is None or cached[:2] != (stat.st_mtime_ns, stat.st_size):
                        cached = (stat.st_mtime_ns, stat.st_size, file_sha256(Path(entry.path)))
                        self._digests[entry.name] = cached
                except FileNotFoundError:
                    continue
                infos.append(ShardInfo(name=entry.name, nbytes=cached[1], sha256=cached[2]))
            for gone in self._digests.keys() - {info.name for info in infos}:
                del self._digests[gone]
            return infos

    def find(self, name: str) -> tuple[ShardInfo, Path] | None:
        """The shard called ``name`` and its path, or None. Only names the listing yields are served,
        so no request can reach outside the directory."""
        if not is_shard_name(name):
            return None
        for info in self.list():
            if info.name == name:
                return info, self.directory / info.name
        return None
