"""State download between real hosts on loopback (TLS, bulk lane), several in one trio run."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import numpy as np
import pytest
import trio

from protocols.bulk import BulkHeader
from protocols.codes import ErrorCode
from protocols.errors import ProtocolError
from protocols.peer_id import PeerId
from protocols.state import (
    MAX_CHUNK_BYTES,
    STATE_TOPIC,
    StateChunk,
    StateRequest,
    decode_state_request,
    encode_state_meta,
)
from protocols.training import StateAnnouncement
from shared import faults
from shared.auth.keys import Identity
from shared.errors import RemoteError, StateError, StateUnavailable
from shared.net.addresses import PeerAddress, parse_multiaddr
from shared.net.bulk import BulkReader, BulkReply
from shared.net.host import Host, HostConfig
from shared.net.rpc import RequestContext
from shared.state.blob import encode_state, state_digest
from shared.state.limits import SourceBook
from shared.state.transfer import StateServer, fetch_state

#: The largest state the tests expect.
LIMIT = 1 << 24
RUN = "state-test"
CHUNK = 32 * 1024


def make_blob(step: int = 7, numel: int = 60_000, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    tensors = {
        "model/w": rng.standard_normal(numel).astype(np.float32),
        "optim/w.exp_avg": rng.standard_normal(numel // 2).astype(np.float32),
    }
    return encode_state(tensors, {"step": str(step), "run_id": RUN, "task": "tiny-mlm"})


class Peer:
    """A host in its own cancel scope: ``crash()`` stops it at once, every connection closed mid-flight."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.scope = trio.CancelScope()

    async def run(self, listen: list[str], task_status: trio.TaskStatus[None]) -> None:
        with self.scope:
            await self.host.run(listen, task_status=task_status)

    def crash(self) -> None:
        self.scope.cancel()


async def start_peer(nursery: trio.Nursery, *, listen: bool = True) -> Peer:
    peer = Peer(Host(Identity.generate(), RUN, HostConfig(dial_deadline=3, bulk_stall=1)))
    await nursery.start(peer.run, ["/ip4/127.0.0.1/tcp/0"] if listen else [])
    return peer


async def start_host(nursery: trio.Nursery, *, listen: bool = True) -> Host:
    return (await start_peer(nursery, listen=listen)).host


async def start_server(nursery: trio.Nursery) -> tuple[Peer, StateServer, PeerAddress]:
    peer = await start_peer(nursery)
    return peer, StateServer(peer.host), parse_multiaddr(peer.host.listen_addrs[0])


async def test_fetch_state_downloads_in_chunks_to_a_client_mode_peer(nursery: trio.Nursery) -> None:
    _, server, address = await start_server(nursery)
    downloader = await start_host(nursery, listen=False)  # accepts no connections: pulls over its own
    blob = make_blob()
    announcement = server.offer(7, blob)
    progress: list[tuple[int, int]] = []

    got = await fetch_state(
        downloader,
        [(address, announcement)],
        chunk_bytes=CHUNK,
        on_progress=lambda done, total: progress.append((done, total)),
        max_bytes=LIMIT,
    )

    assert got == blob
    assert announcement.digest == state_digest(blob) and announcement.nbytes == len(blob)
    assert [d for d, _ in progress] == sorted({min(len(blob), CHUNK * (i + 1)) for i in range(len(progress))})
    assert progress[-1] == (len(blob), len(blob))
    assert server.statistics().chunks_served == -(-len(blob) // CHUNK)


async def test_fetch_state_continues_from_another_source_when_one_dies_mid_transfer(
    nursery: trio.Nursery,
) -> None:
    dying_peer, dying, dying_addr = await start_server(nursery)
    _, healthy, healthy_addr = await start_server(nursery)
    downloader = await start_host(nursery)
    blob = make_blob()
    announcement = dying.offer(7, blob)
    healthy.offer(7, blob)

    def progress(done: int, total: int) -> None:
        if done >= 2 * CHUNK:
            dying_peer.crash()  # after its second chunk: every connection closed, no goodbye

    got = await fetch_state(
        downloader,
        [(dying_addr, announcement), (healthy_addr, announcement)],
        chunk_bytes=CHUNK,
        on_progress=progress,
        max_bytes=LIMIT,
    )

    assert got == blob
    served = (dying.statistics().bytes_served, healthy.statistics().bytes_served)
    assert served == (2 * CHUNK, len(blob) - 2 * CHUNK)  # no byte twice


async def test_fetch_state_refuses_a_source_serving_other_bytes_and_fetches_elsewhere(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    _, liar, liar_addr = await start_server(nursery)
    _, honest, honest_addr = await start_server(nursery)
    downloader = await start_host(nursery)
    blob = make_blob()
    corrupted = bytearray(blob)
    corrupted[len(blob) // 2] ^= 0xFF
    # the liar announces the honest digest but serves other bytes
    announcement = liar.offer(7, bytes(corrupted), digest=state_digest(blob))
    honest.offer(7, blob)
    assert announcement == msgspec.structs.replace(announcement, digest=state_digest(blob))

    with caplog.at_level(logging.WARNING, logger="shared.state.transfer"):
        got = await fetch_state(
            downloader,
            [(liar_addr, announcement), (honest_addr, announcement)],
            chunk_bytes=CHUNK,
            max_bytes=LIMIT,
        )

    assert got == blob
    assert liar.statistics().bytes_served == len(blob)
    assert honest.statistics().bytes_served == len(blob)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("do not hash to the announced digest" in w and str(liar_addr) in w for w in warnings)


async def test_fetch_state_gives_up_with_reasons_when_only_liars_remain(nursery: trio.Nursery) -> None:
    _, liar, liar_addr = await start_server(nursery)
    downloader = await start_host(nursery)
    blob = make_blob()
    announcement = liar.offer(7, blob[:-1] + b"\0", digest=state_digest(blob))

    with pytest.raises(StateUnavailable, match="do not match the digest") as caught:
        await fetch_state(downloader, [(liar_addr, announcement)], chunk_bytes=CHUNK, max_bytes=LIMIT)
    assert len(caught.value.reasons) == 1


async def test_fetch_state_resumes_a_partial_download_after_a_restart(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    first_peer, first, first_addr = await start_server(nursery)
    _, second, second_addr = await start_server(nursery)
    downloader = await start_host(nursery)
    blob = make_blob()
    announcement = first.offer(7, blob)
    second.offer(7, blob)

    def crash(done: int, total: int) -> None:
        if done >= 3 * CHUNK:
            first_peer.crash()

    # the only source dies after three chunks: nothing else to try, the bytes so far stay on disk
    with pytest.raises(StateUnavailable):
        await fetch_state(
            downloader,
            [(first_addr, announcement)],
            chunk_bytes=CHUNK,
            partial_dir=tmp_path,
            on_progress=crash,
            max_bytes=LIMIT,
        )
    partial = tmp_path / f"{announcement.digest.hex()}.partial"
    assert partial.stat().st_size == 3 * CHUNK

    # "the process restarts": a new download of the same digest picks up where the last one stopped
    progress: list[int] = []
    got = await fetch_state(
        downloader,
        [(second_addr, announcement)],
        chunk_bytes=CHUNK,
        partial_dir=tmp_path,
        on_progress=lambda done, total: progress.append(done),
        max_bytes=LIMIT,
    )

    assert got == blob
    assert progress[0] == 3 * CHUNK
    assert second.statistics().bytes_served == len(blob) - 3 * CHUNK
    assert not partial.exists()


async def test_fetch_state_discards_a_damaged_partial_download_and_starts_over(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, server, address = await start_server(nursery)
    downloader = await start_host(nursery)
    blob = make_blob()
    announcement = server.offer(7, blob)
    (tmp_path / f"{announcement.digest.hex()}.partial").write_bytes(b"\x01" * (2 * CHUNK))

    got = await fetch_state(
        downloader, [(address, announcement)], chunk_bytes=CHUNK, partial_dir=tmp_path, max_bytes=LIMIT
    )

    assert got == blob
    # the source finished the damaged attempt, then served the whole blob again on its own
    assert server.statistics().bytes_served == (len(blob) - 2 * CHUNK) + len(blob)


async def test_fetch_state_needs_no_source_bytes_for_a_complete_partial_download(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, server, address = await start_server(nursery)
    downloader = await start_host(nursery)
    blob = make_blob()
    announcement = server.offer(7, blob)
    partial = tmp_path / f"{announcement.digest.hex()}.partial"
    partial.write_bytes(blob)

    assert (
        await fetch_state(downloader, [(address, announcement)], partial_dir=tmp_path, max_bytes=LIMIT)
        == blob
    )
    assert server.statistics().bytes_served == 0
    assert not partial.exists()

    partial.write_bytes(b"\0" * len(blob))  # complete but wrong, and the only source is gone
    server.forget(announcement.digest)
    with pytest.raises(StateUnavailable, match="partial download"):
        await fetch_state(downloader, [(address, announcement)], partial_dir=tmp_path, max_bytes=LIMIT)


async def test_fetch_state_skips_sources_of_other_digests_and_reports_refusals(nursery: trio.Nursery) -> None:
    _, server, address = await start_server(nursery)
    downloader = await start_host(nursery)
    wanted = StateAnnouncement(step=3, digest=b"\x07" * 32, nbytes=1000, time=0.0)
    other = server.offer(3, make_blob(3))

    with pytest.raises(StateUnavailable) as caught:
        await fetch_state(
            downloader, [(address, wanted), (address, other)], chunk_bytes=CHUNK, max_bytes=LIMIT
        )

    assert len(caught.value.reasons) == 1  # the second source was skipped, not tried
    assert "NOT_FOUND" in caught.value.reasons[0]
    assert server.statistics().bytes_served == 0
    with pytest.raises(StateUnavailable, match="no peer"):
        await fetch_state(downloader, [], max_bytes=LIMIT)


async def test_fetch_state_moves_on_from_a_source_that_never_answers(nursery: trio.Nursery) -> None:
    silent = await start_host(nursery)

    async def never_answer(ctx: RequestContext, header: object, reader: BulkReader) -> bytes:
        await trio.sleep_forever()
        raise AssertionError

    silent.bulk_handlers[STATE_TOPIC] = never_answer
    _, server, address = await start_server(nursery)
    downloader = await start_host(nursery)
    blob = make_blob(numel=5000)
    announcement = server.offer(7, blob)

    with trio.fail_after(15):
        got = await fetch_state(
            downloader,
            [(parse_multiaddr(silent.listen_addrs[0]), announcement), (address, announcement)],
            chunk_bytes=CHUNK,
            max_bytes=LIMIT,
        )
    assert got == blob


async def test_state_server_refuses_bad_requests_with_codes(nursery: trio.Nursery) -> None:
    _, server, address = await start_server(nursery)
    client = await start_host(nursery)
    blob = make_blob(numel=1000)
    announcement = server.offer(7, blob)

    async def ask(meta: bytes, payload: bytes = b"") -> None:
        await client.send_bulk(
            address, STATE_TOPIC, payload, meta, sink=lambda m, n: memoryview(bytearray(n))
        )

    beyond = encode_state_meta(StateRequest(digest=announcement.digest, offset=len(blob), length=10))
    huge = msgspec.msgpack.encode({"digest": announcement.digest, "offset": 0, "length": MAX_CHUNK_BYTES + 1})
    ok = encode_state_meta(StateRequest(digest=announcement.digest, offset=0, length=10))
    unknown = encode_state_meta(StateRequest(digest=b"\x01" * 32, offset=0, length=10))
    for meta, payload, code in [
        (beyond, b"", ErrorCode.BAD_REQUEST),
        (huge, b"", ErrorCode.BAD_REQUEST),
        (b"\xc1garbage", b"", ErrorCode.BAD_REQUEST),
        (ok, b"unexpected", ErrorCode.BAD_REQUEST),
        (unknown, b"", ErrorCode.NOT_FOUND),
    ]:
        with pytest.raises(RemoteError) as caught:
            await ask(meta, payload)
        assert caught.value.code == code
    await ask(ok)  # and it still serves
    assert server.statistics().refused == 5


async def test_state_server_keeps_two_blobs_in_memory_and_serves_files_until_forgotten(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, server, address = await start_server(nursery)
    downloader = await start_host(nursery)
    blobs = [make_blob(step, numel=2000, seed=step) for step in (1, 2, 3)]
    offers = [server.offer(step, blob) for step, blob in zip((1, 2, 3), blobs, strict=True)]
    path = tmp_path / "s.safetensors"
    path.write_bytes(blobs[0])
    from_file = server.offer_file(1, path, offers[0].digest, len(blobs[0]))

    assert [a.step for a in server.offered()] == [3, 2, 1]
    for blob, offer in zip(blobs, offers, strict=True):
        assert await fetch_state(downloader, [(address, offer)], chunk_bytes=CHUNK, max_bytes=LIMIT) == blob

    server.forget(from_file.digest)  # step 1 was dropped from memory by the third offer: now gone
    with pytest.raises(StateUnavailable, match="NOT_FOUND"):
        await fetch_state(downloader, [(address, offers[0])], max_bytes=LIMIT)
    server.offer_file(1, path, offers[0].digest, len(blobs[0]))
    path.unlink()  # a file deleted under the server is refused, not a crash
    with pytest.raises(StateUnavailable, match="NOT_FOUND"):
        await fetch_state(downloader, [(address, offers[0])], max_bytes=LIMIT)


# ------------------------------------------------------------------ strangers' claims (issue 9, finding 2)


async def test_fetch_state_refuses_an_oversized_announcement_before_any_allocation_or_io(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, server, address = await start_server(nursery)
    downloader = await start_host(nursery)
    blob = make_blob()
    honest = server.offer(7, blob)
    book = SourceBook()
    for nbytes in (1 << 40, LIMIT + 1):  # the wire's ceiling (it once sized a bytearray), and above ours
        claim = msgspec.structs.replace(honest, nbytes=nbytes)
        with pytest.raises(StateError, match=f"announced as {nbytes} bytes"):
            await fetch_state(
                downloader, [(address, claim)], max_bytes=LIMIT, partial_dir=tmp_path, book=book
            )
    assert server.statistics().chunks_served == server.statistics().refused == 0  # nothing was asked
    assert not (tmp_path / f"{honest.digest.hex()}.partial").exists()  # no partial file either
    assert book.statistics().failures == 0  # the claim is refused, no source blamed by fetch_state
    # and the same downloader still takes the honest state
    assert await fetch_state(downloader, [(address, honest)], max_bytes=LIMIT, book=book) == blob


class LyingServer:
    """Answers state requests with a chunk that lies: ``more`` bytes more than asked, a wrong total, or
    bytes from ``shift`` bytes further than asked (and says so)."""

    def __init__(
        self, host: Host, blob: bytes, *, more: int = 0, total: int | None = None, shift: int = 0
    ) -> None:
        self.blob, self.more, self.total, self.shift, self.requests = blob, more, total, shift, 0
        host.bulk_handlers[STATE_TOPIC] = self.answer

    async def answer(self, ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> BulkReply:
        self.requests += 1
        request = decode_state_request(header.meta)
        request = msgspec.structs.replace(request, offset=request.offset + self.shift)
        end = request.offset + request.length + self.more
        padded = self.blob + b"\0" * self.more  # also past the blob's end
        total = self.total if self.total is not None else len(self.blob)
        meta = encode_state_meta(StateChunk(digest=request.digest, offset=request.offset, total=total))
        return BulkReply(meta, memoryview(padded[request.offset : end]))


@pytest.mark.parametrize(
    ("more", "total", "shift"),
    [(1, None, 0), (CHUNK, None, 0), (0, 1 << 40, 0), (0, 1, 0), (0, None, 1)],
    ids=["one-byte-more", "a-chunk-more", "total-far-above", "total-below", "other-offset"],
)
async def test_fetch_state_drops_a_source_lying_about_chunk_sizes_and_takes_the_honest_one(
    nursery: trio.Nursery, more: int, total: int | None, shift: int
) -> None:
    liar_host = await start_host(nursery)
    blob = make_blob()
    liar = LyingServer(liar_host, blob, more=more, total=total, shift=shift)
    _, honest, honest_addr = await start_server(nursery)
    announcement = honest.offer(7, blob)
    downloader = await start_host(nursery)
    liar_addr = parse_multiaddr(liar_host.listen_addrs[0])
    book = SourceBook()

    got = await fetch_state(
        downloader,
        [(liar_addr, announcement), (honest_addr, announcement)],
        chunk_bytes=CHUNK,
        max_bytes=LIMIT,
        book=book,
    )

    assert got == blob
    assert liar.requests == 1  # dropped at its first lie
    assert honest.statistics().bytes_served == len(blob)
    assert book.statistics().faults == 1 and not book.usable(str(liar_host.peer_id))
    # while it cools down it is not asked again
    assert (
        await fetch_state(
            downloader, [(liar_addr, announcement), (honest_addr, announcement)], max_bytes=LIMIT, book=book
        )
        == blob
    )
    assert liar.requests == 1


async def test_fetch_state_blames_a_source_serving_other_bytes_in_the_book(nursery: trio.Nursery) -> None:
    _, liar, liar_addr = await start_server(nursery)
    _, honest, honest_addr = await start_server(nursery)
    downloader = await start_host(nursery)
    blob = make_blob()
    announcement = liar.offer(7, blob[:-1] + b"\0", digest=state_digest(blob))
    honest.offer(7, blob)
    book = SourceBook()

    got = await fetch_state(
        downloader, [(liar_addr, announcement), (honest_addr, announcement)], max_bytes=LIMIT, book=book
    )

    assert got == blob
    assert book.statistics().faults == 1
    assert not book.usable(str(liar_addr.peer_id)) and book.usable(str(honest_addr.peer_id))


async def test_a_download_broken_at_the_mid_download_fault_point_resumes_from_its_partial_file(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """``state.mid_download`` fires after a chunk with more to come (issue 10, item 9): a member killed
    there leaves a partial file that its restart resumes."""
    _, server, address = await start_server(nursery)
    downloader = await start_host(nursery)
    blob = make_blob()
    announcement = server.offer(7, blob)
    sources = [(address, announcement)]
    faults.disarm()
    faults.arm("state.mid_download", "raise", on_hit=2)
    try:
        with pytest.raises(faults.FaultInjected):
            await fetch_state(downloader, sources, chunk_bytes=CHUNK, partial_dir=tmp_path, max_bytes=LIMIT)
    finally:
        faults.disarm()  # (also forgets the hit counts)
    partial = tmp_path / f"{announcement.digest.hex()}.partial"
    assert partial.stat().st_size == 2 * CHUNK  # broken after its second chunk
    got = await fetch_state(downloader, sources, chunk_bytes=CHUNK, partial_dir=tmp_path, max_bytes=LIMIT)
    assert got == blob
    chunks = -(-len(blob) // CHUNK)
    assert faults.hits("state.mid_download") == chunks - 3  # resumed after chunk 2; none after the last


async def test_the_server_remembers_which_volunteer_downloaded_its_state_lately() -> None:
    """A lone volunteer does not step while a peer joins from its state (shared.alone, rule (c)): the
    server names the newest volunteer that downloaded a chunk, never a backbone storing a checkpoint nor
    a peer whose request was refused."""
    host = Host(Identity.generate(), "joining-test", HostConfig())
    server = StateServer(host)
    blob = make_blob(3, numel=16)
    digest = server.offer(3, blob).digest
    ask = BulkHeader(
        topic=STATE_TOPIC,
        nbytes=0,
        meta=msgspec.msgpack.encode(StateRequest(digest=digest, offset=0, length=8)),
    )
    reader = None  # a state request carries no payload: the server reads nothing

    def ctx(peer: str, user: str | None) -> RequestContext:
        return RequestContext(PeerId(peer), (), username=user)

    assert server.recent_downloader(30.0) is None
    await server._on_get(ctx("B", "backbone"), ask, reader)  # type: ignore[arg-type]
    assert server.recent_downloader(30.0) is None  # a checkpoint, not a newcomer
    unknown = msgspec.msgpack.encode(StateRequest(digest=bytes(32), offset=0, length=8))
    refused = BulkHeader(topic=STATE_TOPIC, nbytes=0, meta=unknown)
    with pytest.raises(RemoteError):
        await server._on_get(ctx("X", "mallory"), refused, reader)  # type: ignore[arg-type]
    assert server.recent_downloader(30.0) is None  # refused: it downloaded nothing
    await server._on_get(ctx("V", "alice"), ask, reader)  # type: ignore[arg-type]
    assert server.recent_downloader(30.0) == "V"
    await trio.sleep(0.05)
    assert server.recent_downloader(0.01) is None  # not lately


async def test_the_server_counts_a_copy_only_for_a_peer_it_sent_every_byte_in_order() -> None:
    """A leaving stage server hands its state over only to a peer it saw take all of it
    (volunteer.swarm.member, "Leaving"): every byte from offset 0, in order; a peer that skipped a range
    (it had it from elsewhere, or never asked) holds no copy we saw, and neither does one whose request
    was refused. A forgotten offer forgets its copies."""
    host = Host(Identity.generate(), "copies-test", HostConfig())
    server = StateServer(host)
    blob = make_blob(3, numel=16)
    digest = server.offer(3, blob).digest

    def ask(offset: int, length: int, of: bytes = digest) -> BulkHeader:
        request = StateRequest(digest=of, offset=offset, length=length)
        return BulkHeader(topic=STATE_TOPIC, nbytes=0, meta=msgspec.msgpack.encode(request))

    def ctx(peer: str) -> RequestContext:
        return RequestContext(PeerId(peer), (), username="alice")

    half = len(blob) // 2
    for offset in range(0, len(blob), 64):  # "A": the whole state, in order
        await server._on_get(ctx("A"), ask(offset, 64), None)  # type: ignore[arg-type]
    await server._on_get(ctx("B"), ask(0, half), None)  # type: ignore[arg-type]  # "B": the first half
    await server._on_get(ctx("C"), ask(half, len(blob)), None)  # type: ignore[arg-type]  # the rest only
    await server._on_get(ctx("D"), ask(0, 8), None)  # type: ignore[arg-type]  # a gap, then the end
    await server._on_get(ctx("D"), ask(half, len(blob)), None)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):  # beyond the state: refused, nothing served
        await server._on_get(ctx("E"), ask(len(blob), 8), None)  # type: ignore[arg-type]
    assert server.copies(digest) == {"A"}
    await server._on_get(ctx("B"), ask(half, len(blob)), None)  # type: ignore[arg-type]
    assert server.copies(digest) == {"A", "B"}
    assert server.copies(bytes(32)) == set()  # not offered
    server.forget(digest)
    assert server.copies(digest) == set()
