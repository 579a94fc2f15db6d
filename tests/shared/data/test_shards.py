"""ShardCatalog: which files are shards, their digests, and the cache that follows mtime and size."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from shared.data.corpus import write_shards
from shared.data.shards import ShardCatalog, file_sha256


def test_catalog_lists_only_shards_with_their_size_and_digest(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, shards=2, examples_per_shard=5)
    (tmp_path / "notes.txt").write_text("not a shard")
    (tmp_path / ".shard-00009.jsonl.123.tmp").write_text("half written")
    (tmp_path / ".hidden.jsonl").write_text("{}\n")
    (tmp_path / "bad name.jsonl").write_text("{}\n")
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "extra.jsonl").write_text('{"text": "x"}\n')
    infos = ShardCatalog(tmp_path).list()
    assert [i.name for i in infos] == ["extra.jsonl", "shard-00000.jsonl", "shard-00001.jsonl"]
    for info in infos[1:]:
        data = (tmp_path / info.name).read_bytes()
        assert info.nbytes == len(data)
        assert info.sha256 == hashlib.sha256(data).hexdigest() == file_sha256(tmp_path / info.name)
    assert paths[0].name == infos[1].name


def test_catalog_rehashes_changed_files_and_forgets_removed_ones(tmp_path: Path) -> None:
    catalog = ShardCatalog(tmp_path / "missing")
    assert catalog.list() == []  # the directory need not exist
    catalog = ShardCatalog(tmp_path)
    shard = tmp_path / "a.jsonl"
    shard.write_text('{"text": "one"}\n')
    first = catalog.list()[0]
    stat = shard.stat()
    shard.write_text('{"text": "ONE"}\n')  # same size and mtime: the cached digest is kept (not rehashed)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert catalog.list()[0] == first
    shard.write_text('{"text": "two"}\n')  # same size: only the mtime tells
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = catalog.list()[0]
    assert second.nbytes == first.nbytes and second.sha256 != first.sha256
    assert second.sha256 == file_sha256(shard)
    shard.unlink()
    assert catalog.list() == []
    assert catalog.find("a.jsonl") is None


def test_catalog_find_serves_listed_names_only(tmp_path: Path) -> None:
    write_shards(tmp_path / "shards", shards=1, examples_per_shard=3)
    (tmp_path / "secret.jsonl").write_text("{}\n")
    catalog = ShardCatalog(tmp_path / "shards")
    found = catalog.find("shard-00000.jsonl")
    assert found is not None and found[1] == tmp_path / "shards" / "shard-00000.jsonl"
    for name in ("../secret.jsonl", "..", ".", "", "shard-00001.jsonl", "/etc/passwd", "shard-00000.JSONL"):
        assert catalog.find(name) is None, name
