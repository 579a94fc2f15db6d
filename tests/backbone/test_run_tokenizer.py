"""The run's tokenizer: trained or taken once by the backbone and pinned by its SHA-256 in the spec it
serves; fetched, checked and kept by volunteers; any tokenizer that is not the pinned one is refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest
import trio

from backbone.tokenizer import TOKENIZER_FILE, prepare_tokenizer
from protocols.training import TokenizerSpec, TrainingSpec
from shared.data.corpus import generate_examples, write_shards
from shared.errors import ConfigError, PeerUnavailable, ProtocolError
from shared.tokenizer import read_tokenizer, train_tokenizer
from volunteer.run_tokenizer import TOKENIZERS_DIR, obtain_tokenizer

from .pinned_api import member_client, serve_pinned_api

SPEC = TrainingSpec(
    task="hf-mlm",
    task_options={"model_type": "albert"},
    tokenizer=TokenizerSpec(kind="unigram", vocab_size=500),
)


def with_tokenizer(spec: TrainingSpec, **changes: object) -> TrainingSpec:
    return msgspec.structs.replace(spec, tokenizer=msgspec.structs.replace(spec.tokenizer, **changes))


def tokenizer_of(vocab_size: int, seed: int) -> bytes:
    spec = TokenizerSpec(kind="wordpiece", vocab_size=vocab_size)
    return train_tokenizer(spec, generate_examples(seed, 500))


def backbone_dir(tmp_path: Path, name: str = "bb") -> Path:
    data_dir = tmp_path / name
    write_shards(data_dir / "shards", 2, 300, seed=3)
    return data_dir


def test_the_first_start_trains_the_tokenizer_and_later_starts_keep_it(tmp_path: Path) -> None:
    data_dir = backbone_dir(tmp_path)
    served = prepare_tokenizer(SPEC, data_dir, data_dir / "shards")
    held = data_dir / TOKENIZER_FILE
    assert served.tokenizer.sha256 == hashlib.sha256(held.read_bytes()).hexdigest()
    _, info = read_tokenizer(held.read_bytes())
    assert 100 < info.vocab_size <= 500
    assert msgspec.structs.replace(served, tokenizer=SPEC.tokenizer) == SPEC  # only the pin was added
    before = held.stat().st_mtime_ns
    (data_dir / "shards" / "shard-00000.jsonl").write_text('{"text": "other text now"}\n')
    again = prepare_tokenizer(SPEC, data_dir, data_dir / "shards")
    assert again.tokenizer.sha256 == served.tokenizer.sha256  # never trained again
    assert held.stat().st_mtime_ns == before
    assert prepare_tokenizer(TrainingSpec(), data_dir, data_dir / "shards") == TrainingSpec()


def test_a_pinned_tokenizer_the_backbone_does_not_hold_refuses_the_start(tmp_path: Path) -> None:
    first = backbone_dir(tmp_path, "first")
    pin = prepare_tokenizer(SPEC, first, first / "shards").tokenizer.sha256
    second = backbone_dir(tmp_path, "second")
    with pytest.raises(ConfigError, match=r"holds no tokenizer\.json: copy it from the run's first backbone"):
        prepare_tokenizer(with_tokenizer(SPEC, sha256=pin), second, second / "shards")
    assert not (second / TOKENIZER_FILE).exists()  # it did not train one of its own
    (second / TOKENIZER_FILE).write_bytes((first / TOKENIZER_FILE).read_bytes())
    kept = prepare_tokenizer(with_tokenizer(SPEC, sha256=pin), second, second / "shards")
    assert kept.tokenizer.sha256 == pin
    with pytest.raises(ConfigError, match="a run keeps one tokenizer"):
        prepare_tokenizer(with_tokenizer(SPEC, sha256="ab" * 32), second, second / "shards")


def test_the_organizers_file_is_taken_once_and_must_stay_the_same(tmp_path: Path) -> None:
    data_dir = tmp_path / "bb"
    data_dir.mkdir()
    shipped = tmp_path / "tokenizer.json"
    shipped.write_bytes(tokenizer_of(300, 1))
    spec = with_tokenizer(SPEC, kind="file", file=str(shipped))
    served = prepare_tokenizer(spec, data_dir, data_dir / "shards")
    assert (data_dir / TOKENIZER_FILE).read_bytes() == shipped.read_bytes()
    assert served.tokenizer.sha256 == hashlib.sha256(shipped.read_bytes()).hexdigest()
    shipped.write_bytes(tokenizer_of(200, 2))
    with pytest.raises(ConfigError, match="is not the tokenizer this run was started with"):
        prepare_tokenizer(spec, data_dir, data_dir / "shards")
    (data_dir / TOKENIZER_FILE).unlink()
    shipped.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ConfigError, match=r"not a tokenizer\.json"):
        prepare_tokenizer(spec, data_dir, data_dir / "shards")
    assert not (data_dir / TOKENIZER_FILE).exists()


async def test_volunteers_fetch_check_and_keep_the_pinned_tokenizer(tmp_path: Path) -> None:
    data_dir = backbone_dir(tmp_path)
    served = await trio.to_thread.run_sync(prepare_tokenizer, SPEC, data_dir, data_dir / "shards")
    pin = served.tokenizer.sha256
    held = data_dir / TOKENIZER_FILE
    volunteer = tmp_path / "volunteer"
    async with serve_pinned_api(data_dir, training=served, tokenizer=held) as api:
        client = member_client(api)
        data = await obtain_tokenizer(served.tokenizer, client, volunteer)
        assert data == held.read_bytes()
        kept = volunteer / TOKENIZERS_DIR / f"{pin}.json"
        assert kept.read_bytes() == data
        assert await obtain_tokenizer(served.tokenizer, None, volunteer) == data  # no API needed now

        kept.write_bytes(data[:-10])  # a damaged copy is fetched again
        assert await obtain_tokenizer(served.tokenizer, client, volunteer) == data

        # a tokenizer of another hash is not served, and bytes that are not the pinned ones are refused
        with pytest.raises(PeerUnavailable, match="serves no tokenizer of that SHA-256"):
            await obtain_tokenizer(with_tokenizer(served, sha256="cd" * 32).tokenizer, client, volunteer)
        kept.unlink()
        original = held.read_bytes()
        held.write_bytes(original.replace(b"[UNK]", b"[UNQ]"))
        with pytest.raises(ProtocolError, match=f"not the run's {pin[:12]}"):
            await obtain_tokenizer(served.tokenizer, client, volunteer)
        assert not kept.exists()


async def test_a_local_tokenizer_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "mine.json"
    other.write_bytes(tokenizer_of(200, 1))
    spec = TokenizerSpec(kind="file", file=str(other), sha256="ef" * 32)
    with pytest.raises(ConfigError, match="is not the run's: its SHA-256 is"):
        await obtain_tokenizer(spec, None, tmp_path / "volunteer")
    with pytest.raises(ConfigError, match="pins no tokenizer"):
        await obtain_tokenizer(TokenizerSpec(kind="unigram"), None, tmp_path / "volunteer")
    unpinned = TokenizerSpec(kind="file", file=str(other))  # a local manifest: the file is the tokenizer
    assert await obtain_tokenizer(unpinned, None, tmp_path / "volunteer") == other.read_bytes()
