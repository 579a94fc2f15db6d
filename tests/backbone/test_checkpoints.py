"""The backbone's checkpoint store: content addressing, keep-K, and recovery after a crash."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from backbone.checkpoints import INDEX_FILE, CheckpointStore
from shared.state.blob import encode_state, state_digest


def blob_of(step: int, numel: int = 1000) -> bytes:
    tensors: dict[str, np.ndarray] = {
        "model/w": np.full(numel, step, dtype=np.float32),
        "optim/step": np.array(step, dtype=np.int64),
    }
    return encode_state(tensors, {"step": str(step), "run_id": "r", "task": "tiny-mlm"})


def test_checkpoint_store_is_content_addressed_and_survives_reopening(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    assert store.newest() is None and store.entries() == []
    blob = blob_of(10)

    entry = store.save(blob, 10)

    assert (entry.step, entry.digest, entry.nbytes) == (10, state_digest(blob), len(blob))
    assert store.path(entry.digest) == tmp_path / f"{state_digest(blob).hex()}.safetensors"
    assert store.path(entry.digest).read_bytes() == blob
    reopened = CheckpointStore(tmp_path, keep=3)
    assert reopened.entries() == [entry]
    assert reopened.newest() == entry
    assert reopened.at_step(10) == entry and reopened.at_step(11) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([INDEX_FILE, store.path(entry.digest).name])


def test_checkpoint_store_keeps_the_last_k_and_deletes_older_files(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    entries = [store.save(blob_of(step), step) for step in (10, 20, 30, 40)]

    assert [e.step for e in store.entries()] == [30, 40]
    assert store.newest() == entries[-1]
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == sorted(store.path(e.digest).name for e in entries[2:])
    assert [e.step for e in CheckpointStore(tmp_path, keep=2).entries()] == [30, 40]


def test_checkpoint_store_save_file_moves_a_verified_download_in(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", keep=2)
    blob = blob_of(5)
    tmp = tmp_path / "ckpt" / "download"
    tmp.write_bytes(blob)

    entry = store.save_file(tmp, state_digest(blob), 5)

    assert not tmp.exists()
    assert store.path(entry.digest).read_bytes() == blob
    assert CheckpointStore(tmp_path / "ckpt").newest() == entry


def test_checkpoint_store_ignores_a_truncated_newest_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    older = store.save(blob_of(10), 10)
    newest = store.save(blob_of(20), 20)
    path = store.path(newest.digest)
    with path.open("r+b") as file:  # a disk that lost the tail of the file
        file.truncate(newest.nbytes // 2)

    with caplog.at_level(logging.WARNING):
        reopened = CheckpointStore(tmp_path, keep=3)

    assert reopened.newest() == older
    assert not path.exists()
    assert any("not" in r.getMessage() and "step 20" in r.getMessage() for r in caplog.records)
    assert CheckpointStore(tmp_path, keep=3).entries() == [older]  # the index was rewritten


def test_checkpoint_store_ignores_a_missing_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    older = store.save(blob_of(10), 10)
    newest = store.save(blob_of(20), 20)
    store.path(newest.digest).unlink()

    assert CheckpointStore(tmp_path, keep=3).entries() == [older]


def test_checkpoint_store_adopts_a_complete_file_a_crash_left_unlisted(tmp_path: Path) -> None:
    """kill -9 after the blob was renamed into place but before the index was rewritten."""
    store = CheckpointStore(tmp_path, keep=3)
    older = store.save(blob_of(10), 10)
    index_before = (tmp_path / INDEX_FILE).read_bytes()
    newest = store.save(blob_of(20), 20)
    (tmp_path / INDEX_FILE).write_bytes(index_before)
    (tmp_path / f".tmp-{'ab' * 32}-1-2").write_bytes(b"half a write")  # and one interrupted write
    bogus = tmp_path / f"{'cd' * 32}.safetensors"
    bogus.write_bytes(blob_of(30))  # named after another digest than its bytes'

    reopened = CheckpointStore(tmp_path, keep=3)

    assert [(e.step, e.digest) for e in reopened.entries()] == [(10, older.digest), (20, newest.digest)]
    assert not bogus.exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_checkpoint_store_starts_empty_on_a_garbled_index(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    entry = store.save(blob_of(10), 10)
    (tmp_path / INDEX_FILE).write_bytes(b"{not json")

    reopened = CheckpointStore(tmp_path, keep=3)  # the files are still there and get adopted

    assert [(e.step, e.digest) for e in reopened.entries()] == [(10, entry.digest)]


def test_checkpoint_store_read_only_changes_nothing_on_disk(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(blob_of(10), 10)
    newest = store.save(blob_of(20), 20)
    store.path(newest.digest).unlink()
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}

    reader = CheckpointStore(tmp_path, keep=1, readonly=True)

    assert [e.step for e in reader.entries()] == [10]
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    with pytest.raises(RuntimeError):
        reader.save(blob_of(30), 30)
    assert CheckpointStore(tmp_path / "absent", readonly=True).newest() is None
    assert not (tmp_path / "absent").exists()


def test_checkpoint_store_writes_durably(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The blob is fsynced before it is renamed into place, and the index after."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store = CheckpointStore(tmp_path, keep=3)
    entry = store.save(blob_of(10), 10)

    names = [Path(p).name for p in synced]
    first_blob = next(i for i, n in enumerate(names) if n.startswith(".tmp-") and entry.digest.hex() in n)
    index = next(i for i, n in enumerate(names) if n == f".tmp-{INDEX_FILE}")
    assert first_blob < index
    assert tmp_path.name in names[index + 1 :]  # the directory, after the index rename
