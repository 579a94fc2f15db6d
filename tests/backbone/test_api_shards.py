"""Dataset shards over the pinned HTTPS API: list, fetch, verify, unknown names, traversal attempts,
and the synthetic corpus a backbone writes at start."""

from __future__ import annotations

import hashlib
import logging
import socket
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest
import trio

from backbone.service import _prepare_shards
from protocols.api import ApiError, ShardInfo, ShardList
from protocols.training import DatasetSpec, TrainingSpec
from shared.data.corpus import write_shards
from shared.errors import ConfigError, PeerUnavailable, ProtocolError
from volunteer.api_client import ApiClient

from .pinned_api import member_client, serve_pinned_api


async def test_api_shards_are_listed_fetched_and_verified(tmp_path: Path) -> None:
    shards = tmp_path / "bb" / "shards"
    paths = await trio.to_thread.run_sync(write_shards, shards, 3, 10)
    (shards / "notes.txt").write_text("not a shard")
    async with serve_pinned_api(tmp_path / "bb", shards) as api:
        client = member_client(api)
        listing = await client.list_shards()
        assert [i.name for i in listing.shards] == [p.name for p in paths]
        for info, path in zip(listing.shards, paths, strict=True):
            data = await client.fetch_shard(info)
            assert data == path.read_bytes()
            assert info.nbytes == len(data) and info.sha256 == hashlib.sha256(data).hexdigest()

        # what the backbone sends must be what it listed
        info = listing.shards[0]
        with pytest.raises(ProtocolError, match="SHA-256"):
            await client.fetch_shard(ShardInfo(info.name, info.nbytes, "0" * 64))
        with pytest.raises(ProtocolError, match="bytes long"):
            await client.fetch_shard(ShardInfo(info.name, info.nbytes + 1, info.sha256))
        # a shard that changed on disk after the listing is caught too
        paths[1].write_bytes(paths[1].read_bytes().replace(b"e", b"E"))
        with pytest.raises(ProtocolError, match="SHA-256"):
            await client.fetch_shard(listing.shards[1])
        # an unknown shard: the client tries every backbone, then gives up
        with pytest.raises(PeerUnavailable, match=r"serves no shard 'shard-00007\.jsonl'"):
            await client.fetch_shard(ShardInfo("shard-00007.jsonl", 1, "0" * 64))


async def test_api_shards_never_serve_files_outside_the_shard_directory(tmp_path: Path) -> None:
    shards = tmp_path / "bb" / "shards"
    await trio.to_thread.run_sync(write_shards, shards, 1, 5)
    (shards / "notes.txt").write_text("not a shard")
    (tmp_path / "bb" / "secret.jsonl").write_text('{"text": "TOPSECRET"}\n')
    async with serve_pinned_api(tmp_path / "bb", shards) as api:
        client = ApiClient(api.run_id, api.urls)
        url = api.urls[0]
        context = await client._pinned_context(url)
        base = f"{url}/v1/runs/{api.run_id}/shards/"
        attempts = [
            "..%2Fsecret.jsonl",
            "..%2F..%2Fbb%2Fsecret.jsonl",
            "%2E%2E%2Fsecret.jsonl",
            "notes.txt",
            ".shard.jsonl",
            "shards%2Fshard-00000.jsonl",
            "%2Fetc%2Fpasswd",
            "authority.key",
        ]
        admin = {"authorization": f"Bearer {api.admin_token}"}
        async with httpx.AsyncClient(verify=context, headers=admin) as http:
            ok = await http.get(base + "shard-00000.jsonl")
            assert ok.status_code == 200 and ok.headers["x-sha256"] == hashlib.sha256(ok.content).hexdigest()
            for attempt in attempts:
                response = await http.get(base + attempt)
                assert response.status_code == 404, attempt
                error = msgspec.json.decode(response.content, type=ApiError)
                assert error.error == "unknown_shard", attempt
                assert b"TOPSECRET" not in response.content and b"PRIVATE" not in response.content
            other_run = await http.get(f"{url}/v1/runs/other-run/shards")
            assert other_run.status_code == 404
            assert msgspec.json.decode(other_run.content, type=ApiError).error == "unknown_run"
        # httpx removes dot segments from URLs; a raw request keeps them
        shard = f"/v1/runs/{api.run_id}/shards/shard-00000.jsonl"
        assert await trio.to_thread.run_sync(_raw_get, url, context, shard) == (200, ok.content)
        for raw in ("../secret.jsonl", "../authority.key", "../../bb/authority.key", "..", "./x.jsonl"):
            status, body = await trio.to_thread.run_sync(
                _raw_get, url, context, f"/v1/runs/{api.run_id}/shards/{raw}"
            )
            assert status == 404, raw
            assert b"TOPSECRET" not in body and b"PRIVATE" not in body and b'"text"' not in body


def _raw_get(url: str, context: ssl.SSLContext, target: str) -> tuple[int, bytes]:
    """GET ``target`` exactly as written (no URL normalization); the status and the body."""
    parts = urlsplit(url)
    with (
        socket.create_connection((parts.hostname, parts.port), timeout=10) as sock,
        context.wrap_socket(sock) as tls,
    ):
        auth = "Authorization: Bearer test-admin-token\r\n"
        tls.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode())
        response = b""
        while chunk := tls.recv(65536):
            response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_api_shards_list_is_empty_without_a_shard_directory(tmp_path: Path) -> None:
    async with serve_pinned_api(tmp_path / "bb") as api:
        assert await member_client(api).list_shards() == ShardList(shards=[])


async def test_backbone_writes_the_synthetic_corpus_once_when_asked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="backbone")
    spec = TrainingSpec(seed=3, dataset=DatasetSpec(generate=2, examples_per_shard=7))
    directory = tmp_path / "shards"
    await _prepare_shards(spec, directory)
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    assert names == ["shard-00000.jsonl", "shard-00001.jsonl"]
    assert len((directory / names[0]).read_text().splitlines()) == 7
    # and the held-out shard, apart (issue 12 item 7): the run's eval_examples examples
    assert len((directory / "heldout" / "heldout-00000.jsonl").read_text().splitlines()) == 256
    assert "writing 2 shards of the synthetic corpus (7 examples each, seed 3)" in caplog.text
    # a restart keeps them; a lost shard is written again, the same as before
    before = (directory / names[1]).read_bytes()
    (directory / names[1]).unlink()
    caplog.clear()
    await _prepare_shards(spec, directory)
    assert (directory / names[1]).read_bytes() == before
    assert "writing 1 shards" in caplog.text


async def test_backbone_does_not_generate_over_the_organizers_shards_or_other_sources(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "wiki-000.jsonl").write_text('{"text": "mine"}\n')
    await _prepare_shards(TrainingSpec(dataset=DatasetSpec(generate=2)), own)
    assert [p.name for p in own.iterdir()] == ["wiki-000.jsonl"]
    files = TrainingSpec(dataset=DatasetSpec(source="files", files=["x.jsonl"], generate=2))
    await _prepare_shards(files, tmp_path / "files")
    none = TrainingSpec(dataset=DatasetSpec(generate=0))
    with pytest.raises(ConfigError, match=r"holds no \.jsonl shard"):  # nothing to serve: refused at start
        await _prepare_shards(none, tmp_path / "none")
    assert not (tmp_path / "files").exists() and not (tmp_path / "none").exists()


async def test_api_heldout_shards_are_fetched_and_verified(tmp_path: Path) -> None:
    shards = tmp_path / "bb" / "shards"
    await trio.to_thread.run_sync(write_shards, shards, 1, 10)
    (kept,) = await trio.to_thread.run_sync(write_shards, shards / "heldout", 1, 10)
    async with serve_pinned_api(tmp_path / "bb", shards) as api:
        client = member_client(api)
        (info,) = (await client.list_heldout()).shards
        assert await client.fetch_heldout(info) == kept.read_bytes()
        with pytest.raises(ProtocolError, match=r"held-out shard \S+ does not match its SHA-256"):
            await client.fetch_heldout(ShardInfo(info.name, info.nbytes, "0" * 64))
        with pytest.raises(ProtocolError, match=r"held-out shard \S+ should be"):
            await client.fetch_heldout(ShardInfo(info.name, info.nbytes + 1, info.sha256))
