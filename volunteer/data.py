"""Training examples, streamed (DESIGN D6; seed 000 §3.3 "Training on large datasets").

:func:`open_examples` yields dataset examples (dicts) forever, pass after pass ("epochs"). Each epoch
reads the shards in a random order of its own (seeded by the peer's seed and the epoch number) through a
shuffle buffer of ``spec.shuffle_buffer`` examples, both done by the ``datasets`` library in streaming
mode, so the first example arrives as soon as the first shard starts to be read. (In datasets 5 the
shuffle also interleaves up to 10 shards at a time, read by a pool of threads.) Sources:

* ``files``: local JSON-lines / JSON (the ``json`` builder) or text files (the ``text`` builder: one
  example ``{"text": line}`` per line), named by paths, directories or globs;
* ``backbone``: the shards the run's backbones serve (:class:`ShardSource`). Each shard is fetched when
  the epoch reaches it, checked against its SHA-256 and kept in ``cache_dir``; the list is read again at
  every epoch, so shards added to a backbone join the next pass. The last list read is kept in
  ``cache_dir`` too (``shards.json``): a volunteer (re)started while no backbone API answers (a backbone
  restarting) reads the shards it cached, listed as the backbone last listed them, instead of exiting;
* ``hub``: a dataset of a dataset hub, streamed (needs network access to the hub).

Everything here blocks: consume the iterator in a worker thread, never in the trio loop. A
:class:`Prefetcher` does that in a daemon thread, ahead of the trainer, through a bounded queue.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import itertools
import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import msgspec
import trio

from protocols.api import ShardInfo
from protocols.errors import DECODE_FAILURES
from protocols.training import DatasetSpec
from shared.data import file_sha256
from shared.errors import ConfigError, ProjectError, ProtocolError

from .api_client import ApiClient

__all__ = ["BackboneShards", "Prefetcher", "ShardSource", "open_examples"]

logger = logging.getLogger(__name__)
LISTING_FILE = "shards.json"  # the last shard list a backbone gave, in the cache dir
X = TypeVar("X")
JSON_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt",)
_POLL = 0.05  # seconds between looks at the stop flag of a blocked Prefetcher queue operation


class ShardSource(Protocol):
    """Where the ``backbone`` source gets shards; called from a worker thread."""

    def list(self) -> list[ShardInfo]:
        """The shards available now."""
        ...

    def fetch(self, info: ShardInfo) -> bytes:
        """The bytes of one shard (the caller checks them against ``info``)."""
        ...


class BackboneShards:
    """The shards of a run's backbones through an :class:`ApiClient`, for worker threads.

    The HTTPS requests run as tasks of the trio loop that created this object (``trio.from_thread``),
    so they never block it, and the pinned-certificate checks of the client apply. Create it in that
    loop; call :meth:`list` and :meth:`fetch` from any other thread.
    """

    def __init__(self, client: ApiClient, trio_token: trio.lowlevel.TrioToken | None = None) -> None:
        self.client = client
        self.trio_token = trio_token or trio.lowlevel.current_trio_token()

    def list(self) -> list[ShardInfo]:
        return trio.from_thread.run(self.client.list_shards, trio_token=self.trio_token).shards

    def fetch(self, info: ShardInfo) -> bytes:
        return trio.from_thread.run(self.client.fetch_shard, info, trio_token=self.trio_token)


def open_examples(
    spec: DatasetSpec, *, seed: int, shards: ShardSource | None = None, cache_dir: Path | None = None
) -> Iterator[dict[str, Any]]:
    """An endless stream of the examples of ``spec``, epoch after epoch (see the module docstring).

    Args:
        spec: the run's dataset.
        seed: this peer's seed; with the epoch number it picks each epoch's shard order and shuffling.
        shards: where the ``backbone`` source gets its shards.
        cache_dir: where fetched shards (and the ``datasets`` library's bookkeeping) are kept; a
            temporary directory, removed when the stream is closed, if None.

    Raises:
        ConfigError: (at once) no file matches a ``files`` entry, the files mix JSON and text, or the
            ``backbone`` source has no ``shards``; (while iterating) an epoch yields no example.
    """
    if spec.source == "files":
        builder, files = _local_files(spec.files)
        return _epochs(spec, seed, lambda hf_cache: _load(builder, files, hf_cache), cache_dir)
    if spec.source == "backbone":
        if shards is None:
            raise ConfigError("dataset source 'backbone' needs the run's backbone API to fetch shards from")
        return _backbone_epochs(spec, seed, shards, cache_dir)
    return _epochs(spec, seed, lambda hf_cache: _hub(spec, hf_cache), cache_dir)


def _epochs(
    spec: DatasetSpec, seed: int, make: Callable[[Path], Any], cache_dir: Path | None
) -> Iterator[dict[str, Any]]:
    with _cache(cache_dir) as directory:
        dataset = make(directory / "hf")
        for epoch in itertools.count():
            yield from _one_epoch(dataset, spec, seed, epoch)


def _one_epoch(dataset: Any, spec: DatasetSpec, seed: int, epoch: int) -> Iterator[dict[str, Any]]:
    count = 0
    for example in dataset.shuffle(seed=_epoch_seed(seed, epoch), buffer_size=spec.shuffle_buffer):
        count += 1
        yield example
    if count == 0:
        raise ConfigError(f"the dataset ({spec.source}) holds no examples")


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"dedloc-epoch:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


@contextlib.contextmanager
def _cache(cache_dir: Path | None) -> Iterator[Path]:
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        yield cache_dir
        return
    directory = Path(tempfile.mkdtemp(prefix="dedloc-data-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _local_files(patterns: list[str]) -> tuple[str, list[str]]:
    """The ``datasets`` builder and the sorted files that ``patterns`` name."""
    files: list[str] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        if glob.has_magic(pattern):
            found = [p for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
        elif path.is_dir():
            found = [str(p) for p in path.iterdir() if p.suffix in JSON_SUFFIXES + TEXT_SUFFIXES]
        else:
            found = [str(path)] if path.is_file() else []
        if not found:
            raise ConfigError(f"dataset file {pattern!r} matches no file")
        files += sorted(found)
    kinds = {
        "json" if f.endswith(JSON_SUFFIXES) else "text" if f.endswith(TEXT_SUFFIXES) else f for f in files
    }
    if kinds - {"json", "text"}:
        odd = sorted(kinds - {"json", "text"})[:3]
        raise ConfigError(f"dataset files must be .jsonl, .json or .txt; got {', '.join(odd)}")
    if len(kinds) > 1:
        raise ConfigError("dataset files mix JSON and text; use one kind per run")
    # an empty file holds no example, and the json builder infers the columns from the first file
    nonempty = [f for f in dict.fromkeys(files) if os.path.getsize(f) > 0]
    if not nonempty:
        raise ConfigError(f"the dataset files ({', '.join(patterns)[:200]}) are all empty")
    return kinds.pop(), nonempty


def _load(builder: str, files: list[str], hf_cache: Path) -> Any:
    import datasets  # heavy (pyarrow, pandas): imported when a stream opens, not with the module

    return datasets.load_dataset(
        builder, data_files=files, split="train", streaming=True, cache_dir=str(hf_cache)
    )


def _hub(spec: DatasetSpec, hf_cache: Path) -> Any:
    import datasets

    return datasets.load_dataset(
        spec.hub_id, spec.hub_config or None, split=spec.split, streaming=True, cache_dir=str(hf_cache)
    )


class _ShardReader:
    """Reads shards of a :class:`ShardSource` through a verified on-disk cache."""

    def __init__(self, source: ShardSource, directory: Path) -> None:
        self.source = source
        self.directory = directory
        self.infos: dict[str, ShardInfo] = {}
        self._verified: set[Path] = set()

    def path(self, info: ShardInfo) -> Path:
        """The cached file of ``info``, fetched (and checked) if it is not cached yet."""
        path = self.directory / f"{info.sha256[:16]}-{info.name}"
        if path in self._verified:
            return path
        if path.is_file() and path.stat().st_size == info.nbytes and file_sha256(path) == info.sha256:
            self._verified.add(path)
            return path
        data = self.source.fetch(info)
        if len(data) != info.nbytes or hashlib.sha256(data).hexdigest() != info.sha256:
            raise ProtocolError(f"shard {info.name} does not match its listing (length or SHA-256)")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self._verified.add(path)
        return path

    def examples(self, names: list[str]) -> Iterator[dict[str, Any]]:
        for name in names:
            info = self.infos[name]
            with self.path(info).open(encoding="utf-8") as file:
                for number, line in enumerate(file, 1):
                    if not line.strip():
                        continue
                    example = json.loads(line)
                    if not isinstance(example, dict):
                        raise ProtocolError(f"shard {name}, line {number}: not a JSON object")
                    yield example


# ``datasets`` fingerprints a generator's arguments by pickling them (dill), which a live reader (locks,
# a trio token, TLS contexts) does not survive; the generator gets plain data and a key into this table.
_READERS: dict[str, _ShardReader] = {}
_reader_keys = itertools.count()


def _shard_examples(shards: list[str], reader: str) -> Iterator[dict[str, Any]]:
    yield from _READERS[reader].examples(shards)


def _backbone_epochs(
    spec: DatasetSpec, seed: int, source: ShardSource, cache_dir: Path | None
) -> Iterator[dict[str, Any]]:
    import datasets

    with _cache(cache_dir) as directory:
        key = str(next(_reader_keys))
        reader = _READERS[key] = _ShardReader(source, directory / "shards")
        reader.directory.mkdir(exist_ok=True)
        try:
            for epoch in itertools.count():
                reader.infos = _list_shards(source, spec, reader.infos, directory / LISTING_FILE)
                dataset = datasets.IterableDataset.from_generator(
                    _shard_examples, gen_kwargs={"shards": sorted(reader.infos), "reader": key}
                )
                yield from _one_epoch(dataset, spec, seed, epoch)
        finally:
            del _READERS[key]


def _list_shards(
    source: ShardSource, spec: DatasetSpec, previous: dict[str, ShardInfo], saved: Path | None = None
) -> dict[str, ShardInfo]:
    """The shards to read this epoch (``spec.files`` are name patterns); the previous epoch's list if
    the backbones cannot be asked right now, else the list ``saved`` at the last successful listing
    (written here after each one)."""
    try:
        infos = source.list()
    except ProjectError as exc:
        if previous:
            logger.warning("cannot list the dataset shards (%s); reading the previous list again", exc)
            return previous
        remembered = _load_listing(saved)
        if not remembered:
            raise
        logger.warning(
            "cannot list the dataset shards (%s); reading the %d listed last time", exc, len(remembered)
        )
        return remembered
    chosen = {
        info.name: info
        for info in infos
        if not spec.files or any(fnmatch.fnmatchcase(info.name, pattern) for pattern in spec.files)
    }
    if not chosen:
        wanted = f" matching {', '.join(spec.files)}" if spec.files else ""
        raise ConfigError(f"the run's backbones serve no dataset shards{wanted}")
    if saved is not None and chosen != previous:
        tmp = saved.with_name(f".{saved.name}.{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(list(chosen.values())))
        os.replace(tmp, saved)
    return chosen


def _load_listing(saved: Path | None) -> dict[str, ShardInfo]:
    """The shard list saved at the last listing; empty if there is none or it does not decode."""
    if saved is None:
        return {}
    try:
        infos = msgspec.json.decode(saved.read_bytes(), type=list[ShardInfo])
    except FileNotFoundError:
        return {}
    except DECODE_FAILURES as exc:
        logger.warning("ignoring the damaged shard list %s: %s", saved, exc)
        return {}
    return {info.name: info for info in infos}


_ITEM, _END, _ERROR = range(3)


class Prefetcher(Generic[X]):
    """Items of ``iterator`` read ahead by one daemon thread into a queue of at most ``depth`` items.

    Iterate over it (or :meth:`take`, or :meth:`get` with a timeout) from one consumer thread. The
    producer's exception is raised to the consumer once the items before it are consumed.
    :meth:`close` (also on leaving a ``with`` block) stops the producer: it closes ``iterator`` in its
    own thread and exits as soon as the current ``next()`` returns; iteration then ends.
    """

    def __init__(self, iterator: Iterator[X], depth: int = 256) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, args=(iterator,), name="prefetch", daemon=True)
        self._thread.start()

    def _produce(self, iterator: Iterator[X]) -> None:
        try:
            for item in iterator:
                if not self._put((_ITEM, item)):
                    return
            self._put((_END, None))
        except Exception as exc:  # handed to the consumer, who re-raises it
            self._put((_ERROR, exc))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def _put(self, entry: tuple[int, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher[X]:
        return self

    def __next__(self) -> X:
        got = self._next(None)
        assert got is not None  # without a deadline it waits for an item or the end
        return got[0]

    def get(self, timeout: float) -> X | None:
        """The next item, or None if none arrived within ``timeout`` seconds (the stream goes on).
        ``timeout=0`` never blocks: an item already read ahead, else None.

        Raises:
            EOFError: the stream ended (or the prefetcher was closed). Not StopIteration: that one would
                turn into a RuntimeError in the coroutine that awaits this call in a worker thread.
            Exception: whatever the producer raised.
        """
        try:
            got = self._next(time.monotonic() + timeout)
        except StopIteration:
            raise EOFError("the example stream has ended") from None
        return None if got is None else got[0]

    def _next(self, deadline: float | None) -> tuple[X] | None:
        """The next item (in a 1-tuple), None at ``deadline``; StopIteration at the end of the stream."""
        while not self._finished:
            if self._stop.is_set():
                self._finished = True
                break
            wait = _POLL if deadline is None else min(_POLL, deadline - time.monotonic())
            try:  # past the deadline: an item already read ahead still counts (``get(timeout=0)``)
                kind, value = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                if wait <= 0:
                    return None
                if not self._thread.is_alive() and self._queue.empty():  # it died without a word
                    self._finished = True
                continue
            if kind == _ITEM:
                return (value,)
            self._finished = True
            if kind == _ERROR:
                raise value
        raise StopIteration

    def take(self, count: int) -> list[X]:
        """The next ``count`` items (fewer only at the end of the stream)."""
        return list(itertools.islice(self, count))

    @property
    def running(self) -> bool:
        """Whether the producer thread is still alive."""
        return self._thread.is_alive()

    def close(self, wait: float = 1.0) -> None:
        """Stop the producer and wait up to ``wait`` seconds for its thread to end (it ends by itself
        later if it is inside a slow ``next()`` of the iterator)."""
        self._stop.set()
        self._thread.join(wait)

    def __enter__(self) -> Prefetcher[X]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
