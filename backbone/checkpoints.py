"""The backbone's checkpoints: opaque, content-addressed state blobs on disk (DESIGN D2, §6).

Layout of the directory::

    <sha256 hex>.safetensors   one state blob each, named by the SHA-256 of its bytes
    index.json                 msgspec JSON: (step, digest, nbytes, time) of each kept checkpoint
    partial/                   downloads in progress (see :func:`shared.state.fetch_state`)
    discarded/                 the last few checkpoints set aside as a losing fork's (``discard``)

**Crash safety.** A checkpoint is written to a temporary file, fsynced, renamed into place and the
directory fsynced; only then is the index rewritten the same way (temporary file, fsync, rename). A
kill -9 at any point therefore leaves either the old index (plus perhaps a complete file it does not
list yet, which the next open adopts after checking its hash) or the new one. On open, index entries whose
file is missing or has the wrong size are dropped, so the newest checkpoint is never a broken one.

The store holds no torch and never looks inside the tensors; it is blocking code, called by the trio
service through worker threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from pathlib import Path
from typing import Annotated

import msgspec

from shared.errors import ConfigError, StateError
from shared.state.blob import file_digest, read_metadata, state_digest, state_step

__all__ = ["DISCARDED_DIR", "CheckpointEntry", "CheckpointStore"]

logger = logging.getLogger(__name__)

INDEX_FILE = "index.json"
DISCARDED_DIR = "discarded"
_SUFFIX = ".safetensors"
_NAME = re.compile(r"^[0-9a-f]{64}\.safetensors$")
_TMP_PREFIX = ".tmp-"


class CheckpointEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One stored checkpoint: the state after ``step`` steps, ``nbytes`` long, saved at ``time`` (unix)."""

    step: Annotated[int, msgspec.Meta(ge=0)]
    digest: Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
    nbytes: Annotated[int, msgspec.Meta(ge=1)]
    time: float


class _Index(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    entries: list[CheckpointEntry]


class CheckpointStore:
    """The last ``keep`` checkpoints of a run in ``directory`` (see the module docstring).

    Args:
        directory: where the checkpoints live (created unless ``readonly``).
        keep: how many checkpoints to keep; saving one more deletes the oldest.
        readonly: only read (``backbone export`` beside a running backbone): nothing on disk is changed,
            broken entries are merely skipped.

    Raises:
        ConfigError: the directory cannot be created or read.
    """

    def __init__(self, directory: Path, keep: int = 3, *, readonly: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.readonly = readonly
        self._entries: dict[bytes, CheckpointEntry] = {}
        try:
            if not readonly:
                self.directory.mkdir(parents=True, exist_ok=True)
            self._load()
        except OSError as exc:
            raise ConfigError(f"cannot use {self.directory} for checkpoints: {exc}") from exc

    # ---------------------------------------------------------------- reading

    def path(self, digest: bytes) -> Path:
        """Where the checkpoint with SHA-256 ``digest`` is (or would be) stored."""
        return self.directory / f"{digest.hex()}{_SUFFIX}"

    def entries(self) -> list[CheckpointEntry]:
        """The kept checkpoints, oldest step first."""
        return sorted(self._entries.values(), key=lambda e: (e.step, e.time))

    def newest(self) -> CheckpointEntry | None:
        """The checkpoint of the highest step (the most recently stored among equal steps)."""
        entries = self.entries()
        return entries[-1] if entries else None

    def at_step(self, step: int) -> CheckpointEntry | None:
        """The (most recently stored) checkpoint of ``step``, if kept."""
        matches = [e for e in self.entries() if e.step == step]
        return matches[-1] if matches else None

    # ---------------------------------------------------------------- writing

    def save(self, blob: bytes, step: int, *, digest: bytes | None = None) -> CheckpointEntry:
        """Store ``blob`` as the checkpoint of ``step`` (durably, see the module docstring).

        Raises:
            OSError: the disk refused (full, read-only).
        """
        digest = state_digest(blob) if digest is None else digest
        self._require_writable()
        tmp = self._tmp_path(digest)
        try:
            with tmp.open("wb") as file:
                file.write(blob)
                file.flush()
                os.fsync(file.fileno())
            return self.save_file(tmp, digest, step)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def save_file(self, tmp_path: Path, digest: bytes, step: int) -> CheckpointEntry:
        """Move the complete blob at ``tmp_path`` (same file system; its SHA-256 is ``digest``) into the
        store as the checkpoint of ``step``. The caller has verified the digest.

        Raises:
            OSError: the disk refused.
        """
        self._require_writable()
        if len(digest) != 32:
            raise ValueError(f"digest must be 32 bytes, got {len(digest)}")
        with Path(tmp_path).open("rb") as file:
            os.fsync(file.fileno())
            nbytes = os.fstat(file.fileno()).st_size
        if nbytes == 0:
            raise ValueError(f"{tmp_path} is empty")
        os.replace(tmp_path, self.path(digest))
        _fsync_dir(self.directory)
        entry = CheckpointEntry(step=step, digest=digest, nbytes=nbytes, time=time.time())
        self._entries[digest] = entry
        self._prune()
        self._write_index()
        self._delete_unlisted()
        return entry

    def discard(self, digest: bytes) -> bool:
        """Set the checkpoint ``digest`` aside -- a state the run did not keep (a losing fork's, see
        :mod:`backbone.checkpointer`): its file moves to ``discarded/`` (the last ``keep`` are kept there,
        for an operator who disagrees) and the index no longer lists it. The file moves first, so a crash
        in between leaves an index entry without a file, which the next open drops -- never an unlisted
        file in the store, which it would adopt. Returns whether it was kept.

        Raises:
            OSError: the disk refused.
        """
        self._require_writable()
        if digest not in self._entries:
            return False
        aside = self.directory / DISCARDED_DIR
        aside.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.path(digest), aside / self.path(digest).name)
        _fsync_dir(self.directory)
        del self._entries[digest]
        self._write_index()
        for old in sorted(aside.glob(f"*{_SUFFIX}"), key=lambda path: path.stat().st_mtime)[: -self.keep]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        return True

    # ---------------------------------------------------------------- internals

    def _require_writable(self) -> None:
        if self.readonly:
            raise RuntimeError("this checkpoint store was opened read-only")

    def _tmp_path(self, digest: bytes) -> Path:
        return self.directory / f"{_TMP_PREFIX}{digest.hex()}-{os.getpid()}-{time.monotonic_ns()}"

    def _prune(self) -> None:
        for entry in self.entries()[: -self.keep]:
            del self._entries[entry.digest]

    def _write_index(self) -> None:
        data = msgspec.json.encode(_Index(version=1, entries=self.entries()))
        tmp = self.directory / f"{_TMP_PREFIX}{INDEX_FILE}"
        with tmp.open("wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, self.directory / INDEX_FILE)
        _fsync_dir(self.directory)

    def _delete_unlisted(self) -> None:
        """Remove blob files the index no longer lists (pruned checkpoints, broken leftovers)."""
        listed = {self.path(d).name for d in self._entries}
        for path in self.directory.iterdir():
            if _NAME.match(path.name) and path.name not in listed:
                logger.info("deleting checkpoint file %s", path.name)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _load(self) -> None:
        index = self.directory / INDEX_FILE
        entries: list[CheckpointEntry] = []
        try:
            entries = msgspec.json.decode(index.read_bytes(), type=_Index).entries
        except FileNotFoundError:
            pass
        except (msgspec.DecodeError, ValueError) as exc:
            logger.warning("ignoring the unreadable checkpoint index %s: %s", index, exc)
        dirty = False
        for entry in entries:
            path = self.path(entry.digest)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                logger.warning("checkpoint of step %d is listed but %s is missing", entry.step, path.name)
                dirty = True
                continue
            if size != entry.nbytes:
                logger.warning(
                    "checkpoint of step %d: %s has %d bytes, not %d; ignoring it",
                    entry.step,
                    path.name,
                    size,
                    entry.nbytes,
                )
                dirty = True
                continue
            self._entries[entry.digest] = entry
        if self.readonly or not self.directory.is_dir():
            return
        dirty = self._adopt_orphans() or dirty
        for path in self.directory.iterdir():
            if path.name.startswith(_TMP_PREFIX):
                path.unlink()  # a write a crash interrupted
        if dirty:
            self._prune()
            self._write_index()
            self._delete_unlisted()

    def _adopt_orphans(self) -> bool:
        """List complete blobs a crash left unlisted (renamed into place, index not yet rewritten)."""
        adopted = False
        listed = {self.path(d).name for d in self._entries}
        for path in sorted(self.directory.iterdir()):
            if not _NAME.match(path.name) or path.name in listed:
                continue
            digest = bytes.fromhex(path.name[: -len(_SUFFIX)])
            try:
                if file_digest(path) != digest:
                    raise StateError("its bytes do not match its name")
                step = state_step(read_metadata(path))
            except StateError as exc:
                logger.warning("not adopting checkpoint file %s: %s", path.name, exc)
                adopted = True  # _delete_unlisted removes it
                continue
            stat = path.stat()
            self._entries[digest] = CheckpointEntry(step, digest, stat.st_size, stat.st_mtime)
            logger.info("adopted checkpoint of step %d (%s) that the index did not list", step, path.name)
            adopted = True
        return adopted


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
