"""Streaming examples: local files and backbone-served shards, per-epoch shard orders, the shard cache,
and the Prefetcher's thread."""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from protocols.api import ShardInfo
from protocols.training import DatasetSpec
from shared.data.corpus import write_shards
from shared.errors import ConfigError, PeerUnavailable, ProtocolError
from tests.backbone.pinned_api import member_client, serve_pinned_api
from volunteer.data import BackboneShards, Prefetcher, open_examples


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``datasets`` keeps lock files in its cache directory: the test's, not the home directory's."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def _texts(paths: list[Path]) -> list[str]:
    return [json.loads(line)["text"] for path in paths for line in path.read_text().splitlines()]


def _take(iterator: Iterator[dict[str, Any]], count: int) -> list[str]:
    return [example["text"] for example in itertools.islice(iterator, count)]


def test_files_stream_every_example_once_per_epoch_in_a_new_order(tmp_path: Path) -> None:
    paths = write_shards(tmp_path / "data", shards=4, examples_per_shard=15)
    everything = _texts(paths)
    spec = DatasetSpec(source="files", files=[str(tmp_path / "data" / "*.jsonl")], shuffle_buffer=10)
    stream = open_examples(spec, seed=1, cache_dir=tmp_path / "cache")
    epochs = [_take(stream, 60) for _ in range(3)]
    stream.close()
    for epoch in epochs:
        assert sorted(epoch) == sorted(everything)
    assert len({tuple(e) for e in epochs}) == 3  # each epoch its own order
    assert epochs[0] != everything  # shuffled, not file order

    again = open_examples(spec, seed=1, cache_dir=tmp_path / "cache")
    assert _take(again, 120) == epochs[0] + epochs[1]  # the same seed gives the same stream
    other = open_examples(spec, seed=2, cache_dir=tmp_path / "cache")
    assert _take(other, 60) != epochs[0]


def test_files_accept_directories_and_text_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "b.txt").write_text("third line\n")
    spec = DatasetSpec(source="files", files=[str(tmp_path)], shuffle_buffer=2)
    examples = list(itertools.islice(open_examples(spec, seed=0), 6))
    assert sorted(e["text"] for e in examples[:3]) == ["first line", "second line", "third line"]
    assert sorted(e["text"] for e in examples[3:]) == ["first line", "second line", "third line"]


def test_files_refuse_what_matches_nothing_or_mixes_formats(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x\n")
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n')
    (tmp_path / "c.csv").write_text("z\n")
    cases = [
        ([str(tmp_path / "missing" / "*.jsonl")], "matches no file"),
        ([str(tmp_path / "nope.jsonl")], "matches no file"),
        ([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], "mix JSON and text"),
        ([str(tmp_path / "c.csv")], r"must be \.jsonl, \.json or \.txt"),
    ]
    for files, message in cases:
        with pytest.raises(ConfigError, match=message):
            open_examples(DatasetSpec(source="files", files=files), seed=0)  # raised at once
    with pytest.raises(ConfigError, match="needs the run's backbone API"):
        open_examples(DatasetSpec(source="backbone"), seed=0)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="are all empty"):
        open_examples(DatasetSpec(source="files", files=[str(tmp_path / "empty.jsonl")]), seed=0)


class DirectoryShards:
    """A ShardSource over a local directory, counting fetches (and able to serve wrong bytes)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fetched: list[str] = []
        self.corrupt = False

    def list(self) -> list[ShardInfo]:
        paths = sorted(self.directory.glob("*.jsonl"))
        return [
            ShardInfo(p.name, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in paths
        ]

    def fetch(self, info: ShardInfo) -> bytes:
        self.fetched.append(info.name)
        data = (self.directory / info.name).read_bytes()
        return data.replace(b"e", b"E") if self.corrupt else data


def test_backbone_source_fetches_shards_lazily_and_caches_them_verified(tmp_path: Path) -> None:
    paths = write_shards(tmp_path / "served", shards=15, examples_per_shard=4)
    source = DirectoryShards(tmp_path / "served")
    spec = DatasetSpec(source="backbone", shuffle_buffer=4)
    stream = open_examples(spec, seed=3, shards=source, cache_dir=tmp_path / "cache")
    first = next(stream)["text"]
    # streaming: the shuffle reads (at most) 10 shards at a time, so not all were fetched
    assert 1 <= len(source.fetched) <= 10
    epoch = [first, *_take(stream, 59)]
    assert sorted(epoch) == sorted(_texts(paths))
    assert sorted(source.fetched) == sorted(p.name for p in paths)
    second = _take(stream, 60)
    assert sorted(second) == sorted(epoch) and second != epoch
    assert len(source.fetched) == 15  # the second epoch reads the cache
    stream.close()
    cached = sorted(p.read_bytes() for p in (tmp_path / "cache" / "shards").iterdir())
    assert cached == sorted(p.read_bytes() for p in paths)

    # a new stream over the same cache checks the cached files and fetches nothing
    source.fetched.clear()
    again = open_examples(spec, seed=3, shards=source, cache_dir=tmp_path / "cache")
    assert _take(again, 60) == epoch
    assert source.fetched == []
    again.close()

    # bytes that do not match the listing are refused (and not cached)
    source.corrupt = True
    fresh = open_examples(spec, seed=3, shards=source, cache_dir=tmp_path / "other-cache")
    with pytest.raises(ProtocolError, match="does not match its listing"):
        next(fresh)
    assert not any((tmp_path / "other-cache" / "shards").iterdir())


def test_backbone_source_restricts_names_and_refuses_an_empty_list(tmp_path: Path) -> None:
    write_shards(tmp_path / "served", shards=3, examples_per_shard=4)
    source = DirectoryShards(tmp_path / "served")
    spec = DatasetSpec(source="backbone", files=["shard-0000[02].jsonl"], shuffle_buffer=2)
    _take(open_examples(spec, seed=0, shards=source), 8)
    assert sorted(set(source.fetched)) == ["shard-00000.jsonl", "shard-00002.jsonl"]
    nothing = open_examples(DatasetSpec(source="backbone", files=["wiki-*"]), seed=0, shards=source)
    with pytest.raises(ConfigError, match="serve no dataset shards matching wiki-"):
        next(nothing)
    (tmp_path / "served" / "wiki-empty.jsonl").write_text("\n")
    blank = open_examples(DatasetSpec(source="backbone", files=["wiki-*"]), seed=0, shards=source)
    with pytest.raises(ConfigError, match=r"the dataset \(backbone\) holds no examples"):
        next(blank)


async def test_backbone_shards_stream_from_a_real_pinned_backbone(tmp_path: Path) -> None:
    paths = await trio.to_thread.run_sync(write_shards, tmp_path / "bb" / "shards", 3, 10)
    async with serve_pinned_api(tmp_path / "bb", tmp_path / "bb" / "shards") as api:
        source = BackboneShards(member_client(api))  # a private run: shards need its credential
        spec = DatasetSpec(source="backbone", shuffle_buffer=5)
        stream = open_examples(spec, seed=7, shards=source, cache_dir=tmp_path / "cache")
        # consumed in a worker thread: the HTTPS requests run in this trio loop meanwhile
        with Prefetcher(stream, depth=4) as examples:
            epochs = await trio.to_thread.run_sync(lambda: [examples.take(30), examples.take(30)])
    expected = sorted(_texts(paths))
    assert [sorted(e["text"] for e in epoch) for epoch in epochs] == [expected, expected]
    assert len(list((tmp_path / "cache" / "shards").iterdir())) == 3
    with pytest.raises(RuntimeError):  # from the trio thread itself it would deadlock: refused
        source.list()


def test_prefetcher_hands_the_producers_exception_to_the_consumer() -> None:
    def items() -> Iterator[int]:
        yield from range(3)
        raise ValueError("shard 7 is broken")

    prefetcher = Prefetcher(items(), depth=1)
    assert prefetcher.take(3) == [0, 1, 2]
    with pytest.raises(ValueError, match="shard 7 is broken"):
        next(prefetcher)
    assert list(prefetcher) == []
    prefetcher.close()
    assert not prefetcher.running


def test_prefetcher_get_waits_at_most_its_timeout() -> None:
    release = threading.Event()

    def gated() -> Iterator[str]:
        yield "first"
        release.wait(10)
        yield "second"
        raise OSError("disk gone")

    prefetcher = Prefetcher(gated(), depth=4)
    assert prefetcher.get(timeout=5) == "first"
    assert prefetcher.get(timeout=0.05) is None  # nothing yet: the stream goes on
    release.set()
    assert prefetcher.get(timeout=5) == "second"
    with pytest.raises(OSError, match="disk gone"):
        prefetcher.get(timeout=5)
    with pytest.raises(EOFError):
        prefetcher.get(timeout=5)
    with Prefetcher(iter([0, 1]), depth=1) as items:
        assert [items.get(timeout=5), items.get(timeout=5)] == [0, 1]
        with pytest.raises(EOFError):
            items.get(timeout=5)


def test_prefetcher_close_stops_the_thread_and_closes_the_iterator() -> None:
    closed = threading.Event()

    def endless() -> Iterator[int]:
        try:
            yield from itertools.count()
        finally:
            closed.set()

    prefetcher = Prefetcher(endless(), depth=2)
    assert prefetcher.take(5) == [0, 1, 2, 3, 4]
    prefetcher.close()
    assert not prefetcher.running and closed.is_set()
    assert list(prefetcher) == []

    with pytest.raises(ValueError, match="depth"):
        Prefetcher(iter([1]), depth=0)
    with Prefetcher(iter([1, 2]), depth=8) as finite:
        assert list(finite) == [1, 2]


def test_prefetcher_close_releases_a_consumer_waiting_for_a_slow_producer() -> None:
    release = threading.Event()

    def slow() -> Iterator[int]:
        yield 1
        release.wait(10)
        yield 2

    prefetcher = Prefetcher(slow(), depth=2)
    got: list[int] = []
    consumer = threading.Thread(target=lambda: got.extend(prefetcher))
    consumer.start()
    while not got:
        threading.Event().wait(0.01)
    prefetcher.close(wait=0.1)  # the producer is stuck in next(): close does not wait for it
    consumer.join(2)
    assert not consumer.is_alive() and got == [1]
    release.set()
    prefetcher.close()
    assert not prefetcher.running


class Unreachable(DirectoryShards):
    """The backbone API does not answer (a backbone restarting): listing fails."""

    def list(self) -> list[ShardInfo]:
        raise PeerUnavailable("no backbone API of the run answered")


def test_a_restart_while_no_backbone_answers_reads_the_shards_listed_last_time(tmp_path: Path) -> None:
    write_shards(tmp_path / "served", shards=3, examples_per_shard=4)
    spec = DatasetSpec(source="backbone", shuffle_buffer=4)
    first = open_examples(spec, seed=3, shards=DirectoryShards(tmp_path / "served"), cache_dir=tmp_path / "c")
    epoch = _take(first, 12)
    first.close()

    down = Unreachable(tmp_path / "served")
    again = open_examples(spec, seed=3, shards=down, cache_dir=tmp_path / "c")
    assert _take(again, 12) == epoch  # the same shards, read from the cache
    assert down.fetched == []
    again.close()
    with pytest.raises(PeerUnavailable):  # nothing cached: nothing to read
        next(open_examples(spec, seed=3, shards=down, cache_dir=tmp_path / "empty"))


def test_prefetcher_get_with_timeout_zero_takes_an_item_read_ahead_and_never_waits() -> None:
    """The training loop takes ready batches with ``get(timeout=0)`` on the torch thread (issue 12)."""
    release = threading.Event()

    def gated() -> Iterator[str]:
        yield "first"
        release.wait(10)
        yield "second"

    def ready(prefetcher: Prefetcher[str]) -> str:
        for _ in range(1000):  # the producer puts the item soon: wait for it without taking it otherwise
            item = prefetcher.get(timeout=0)
            if item is not None:
                return item
            threading.Event().wait(0.01)
        raise AssertionError("get(timeout=0) never returned the item read ahead")

    with Prefetcher(gated(), depth=4) as prefetcher:
        assert ready(prefetcher) == "first"
        assert prefetcher.get(timeout=0) is None  # the producer is held: nothing ready, no wait
        release.set()
        assert ready(prefetcher) == "second"
        with pytest.raises(EOFError):  # the end of the stream, once it is read
            ready(prefetcher)
