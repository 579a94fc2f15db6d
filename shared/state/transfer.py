"""Serving and downloading training state between peers (DESIGN §1, §6; seed 000 §3.1).

A peer that holds a state offers it to a :class:`StateServer` and announces it in the DHT under
:data:`~protocols.training.CHECKPOINT_KEY` (:func:`announce_state`). A peer that needs the state reads the
announcements, ranks them with :func:`trusted_state`, and downloads one with :func:`fetch_state`, chunk by
chunk over the bulk lane (:mod:`protocols.state`), from any of the peers that announced that digest.

Trust: a blob is accepted only if its SHA-256 equals the announced digest, so a server cannot slip in
other bytes than those announced. Which *announcement* to believe is the job of
:func:`~shared.state.trust.trusted_state` (majorities of distinct admitted users, not of writers).

Limits (DESIGN D10 a, f; :mod:`shared.state.limits`): the announced size is checked against the caller's
expectation before anything is allocated; chunks are checked against the request (digest, offset, total,
at most the length asked) before their buffer is allocated and go to a file, never into a buffer sized by
the claim; every failure of a source is that source's (recorded in a
:class:`~shared.state.limits.SourceBook`), never the process's.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import trio

from protocols.bulk import BulkHeader
from protocols.codes import ErrorCode
from protocols.errors import ProtocolError
from protocols.peer_id import PeerId
from protocols.presence import PRESENCE_KEY, Presence
from protocols.state import (
    MAX_CHUNK_BYTES,
    STATE_TOPIC,
    StateChunk,
    StateRequest,
    decode_state_chunk,
    decode_state_request,
    encode_state_meta,
)
from protocols.training import CHECKPOINT_KEY, StateAnnouncement

from .. import faults
from ..dht.node import DHTNode
from ..errors import AuthError, ConfigError, RemoteError, StateUnavailable
from ..net.addresses import PeerAddress, parse_multiaddr
from ..net.bulk import BulkReader, BulkReply
from ..net.host import CALL_FAILURES, Host
from ..net.rpc import RequestContext
from ..portable import free_bytes, pread, pwrite
from .blob import state_digest
from .limits import SourceBook, check_announced_size
from .trust import BACKBONE_USER, Announced
from .trust import trusted_state as trusted_state

__all__ = [
    "ANNOUNCE_PERIOD",
    "ANNOUNCE_TTL",
    "DEFAULT_CHUNK_BYTES",
    "STATE_IO",
    "StateServer",
    "StateServerStatistics",
    "announce_state",
    "fetch_state",
    "fetch_state_file",
    "presence_addresses",
    "read_announcements",
    "trusted_state",
]

logger = logging.getLogger(__name__)

#: Worker threads reading and writing state files and hashing blobs, process-wide.
STATE_IO = trio.CapacityLimiter(4)
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
#: Blobs a server keeps in memory; older offers are dropped (files are not counted: they cost no memory).
MAX_BLOBS_IN_MEMORY = 2
#: Downloaders whose progress a server tracks per offered state (:meth:`StateServer.copies`); more are
#: not tracked (a stranger opening many identities costs each state a bounded table, never memory).
MAX_TRACKED_COPIES = 256
#: A state announcement lives this long in the DHT and is re-published every ``ANNOUNCE_PERIOD`` seconds.
ANNOUNCE_TTL = 60.0
ANNOUNCE_PERIOD = 20.0
#: A chunk slower than this on top of the host's bulk stall limit counts as a failed source.
_MIN_CHUNK_RATE = 64 * 1024  # bytes/s
_HASH_BLOCK = 8 * 1024 * 1024
_ANNOUNCEMENT = msgspec.msgpack.Decoder(StateAnnouncement)
_PRESENCE = msgspec.msgpack.Decoder(Presence)

Source = tuple[PeerAddress, StateAnnouncement]


# ------------------------------------------------------------------------------------------ serving


@dataclass(frozen=True)
class _Offer:
    announcement: StateAnnouncement
    blob: bytes | None = None
    path: Path | None = None


@dataclass(frozen=True)
class StateServerStatistics:
    offered: int
    chunks_served: int
    bytes_served: int
    refused: int


class StateServer:
    """Serves offered states to peers on the bulk topic :data:`~protocols.state.STATE_TOPIC`.

    Args:
        host: the node's host; the server registers its bulk handler there.
        backbone: whether the announcements it makes carry ``backbone=True``.
    """

    def __init__(self, host: Host, *, backbone: bool = False) -> None:
        self.host = host
        self.backbone = backbone
        self._blobs: dict[bytes, _Offer] = {}  # oldest offer first
        self._files: dict[bytes, _Offer] = {}
        self._chunks = self._bytes = self._refused = 0
        #: the volunteer that downloaded a chunk from us last, and when (trio time)
        self._last_download: tuple[str, float] | None = None
        #: per offered digest, per downloader: the bytes it was served contiguously from offset 0
        self._copies: dict[bytes, dict[str, int]] = {}
        host.bulk_handlers[STATE_TOPIC] = self._on_get

    def offer(self, step: int, blob: bytes, *, digest: bytes | None = None) -> StateAnnouncement:
        """Serve ``blob`` (the state after ``step`` optimizer steps) from memory; return its announcement.

        Only the :data:`MAX_BLOBS_IN_MEMORY` most recent offers stay in memory. Hashing a large blob
        blocks: pass ``digest`` if it is already known (e.g. computed in a worker thread).
        """
        if not blob:
            raise ValueError("cannot offer an empty state")
        digest = state_digest(blob) if digest is None else digest
        offer = _Offer(self._announcement(step, digest, len(blob)), blob=blob)
        self._blobs.pop(digest, None)
        self._blobs[digest] = offer
        while len(self._blobs) > MAX_BLOBS_IN_MEMORY:
            dropped = next(iter(self._blobs))
            del self._blobs[dropped]
            if dropped not in self._files:
                self._copies.pop(dropped, None)
        return offer.announcement

    def offer_file(self, step: int, path: Path, digest: bytes, nbytes: int) -> StateAnnouncement:
        """Serve the state stored in ``path`` (``nbytes`` long, SHA-256 ``digest``) until :meth:`forget`."""
        if nbytes <= 0:
            raise ValueError("cannot offer an empty state")
        offer = _Offer(self._announcement(step, digest, nbytes), path=Path(path))
        self._files[digest] = offer
        return offer.announcement

    def forget(self, digest: bytes) -> None:
        """Stop serving ``digest`` (chunks already being sent still complete)."""
        self._blobs.pop(digest, None)
        self._files.pop(digest, None)
        self._copies.pop(digest, None)

    def offered(self) -> list[StateAnnouncement]:
        """What this server can serve, newest step first."""
        offers = {**self._files, **self._blobs}.values()
        return sorted((o.announcement for o in offers), key=lambda a: (a.step, a.time), reverse=True)

    def recent_downloader(self, within: float) -> str | None:
        """A volunteer (an admitted user other than a backbone, which only stores checkpoints) that
        downloaded a chunk of our state in the last ``within`` seconds, if any (the newest): it is joining
        the run from our state, and not yet visible in the progress records."""
        if self._last_download is None:
            return None
        peer, at = self._last_download
        return peer if trio.current_time() - at <= within else None

    def copies(self, digest: bytes) -> set[str]:
        """The peers that were served every byte of the offered state ``digest`` by us, in order from
        offset 0 (a download's order, :func:`fetch_state`): they hold a copy of it, as far as we saw. A
        peer that took part of it from another source is not counted (what it holds, we did not see)."""
        offer = self._blobs.get(digest) or self._files.get(digest)
        if offer is None:
            return set()
        total = offer.announcement.nbytes
        return {peer for peer, done in self._copies.get(digest, {}).items() if done >= total}

    def statistics(self) -> StateServerStatistics:
        return StateServerStatistics(
            offered=len({*self._blobs, *self._files}),
            chunks_served=self._chunks,
            bytes_served=self._bytes,
            refused=self._refused,
        )

    def _announcement(self, step: int, digest: bytes, nbytes: int) -> StateAnnouncement:
        if len(digest) != 32:
            raise ValueError(f"digest must be 32 bytes (SHA-256), got {len(digest)}")
        return StateAnnouncement(
            step=step, digest=digest, nbytes=nbytes, time=time.time(), backbone=self.backbone
        )

    async def _on_get(self, ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> BulkReply:
        await faults.point("state.serve")  # a peer asked us for a chunk of a state
        try:
            reply = await self._serve(header, str(ctx.peer_id))
        except (ProtocolError, RemoteError):
            self._refused += 1
            raise
        if ctx.username is not None and ctx.username != BACKBONE_USER:  # a backbone stores checkpoints
            self._last_download = (ctx.peer_id, trio.current_time())
        return reply

    async def _serve(self, header: BulkHeader, peer: str) -> BulkReply:
        if header.nbytes:
            raise ProtocolError(f"a state request carries no payload, got {header.nbytes} bytes")
        request = decode_state_request(header.meta)
        offer = self._blobs.get(request.digest) or self._files.get(request.digest)
        if offer is None:
            raise RemoteError(ErrorCode.NOT_FOUND, f"no state {request.digest.hex()[:16]} here")
        total = offer.announcement.nbytes
        if request.offset >= total:
            raise ProtocolError(f"offset {request.offset} is beyond the state's {total} bytes")
        length = min(request.length, total - request.offset)
        if offer.blob is not None:
            data = memoryview(offer.blob)[request.offset : request.offset + length]
        else:
            assert offer.path is not None
            try:
                chunk = await trio.to_thread.run_sync(
                    _read_range, offer.path, request.offset, length, limiter=STATE_IO
                )
            except OSError as exc:
                logger.warning("cannot serve state %s: %s", request.digest.hex()[:16], exc)
                raise RemoteError(ErrorCode.NOT_FOUND, "state file unreadable") from exc
            if len(chunk) != length:
                logger.warning("state file %s is shorter than announced", offer.path)
                raise RemoteError(ErrorCode.NOT_FOUND, "state file truncated")
            data = memoryview(chunk)
        meta = encode_state_meta(StateChunk(digest=request.digest, offset=request.offset, total=total))
        self._chunks += 1
        self._bytes += length
        self._served(request.digest, peer, request.offset, length)
        return BulkReply(meta, data)

    def _served(self, digest: bytes, peer: str, offset: int, length: int) -> None:
        """Extend ``peer``'s contiguous prefix of ``digest`` (:meth:`copies`) by a chunk we served."""
        progress = self._copies.setdefault(digest, {})
        done = progress.get(peer)
        if done is None:
            if offset != 0 or len(progress) >= MAX_TRACKED_COPIES:
                return  # a download resumed from another source's bytes, or too many to track
            done = 0
        if offset <= done:
            progress[peer] = max(done, offset + length)


def _read_range(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as file:
        file.seek(offset)
        return file.read(length)


# ------------------------------------------------------------------------------------------ fetching


async def fetch_state(
    host: Host,
    sources: Sequence[Source],
    *,
    max_bytes: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    partial_dir: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    book: SourceBook | None = None,
) -> bytes:
    """Download the state announced by ``sources[0]`` from the sources that announce the same digest.

    The announced size is checked against ``max_bytes`` before anything else (see
    :mod:`shared.state.limits`). Chunks are written to a file as they arrive (``partial_dir``'s
    ``<hex digest>.partial`` if given, so a download interrupted by a restart resumes there; an anonymous
    temporary file otherwise) and requested in order from the first working source; when one fails
    (connection lost, refusal, timeout, a malformed or lying reply) the download continues at the same
    offset from the next. The finished file must hash to the digest; if it does not, it is refused with a
    warning naming the source(s) it came from, and the download restarts from zero without the source that
    served it alone (after a mixed download, whose culprit is unknown, the surviving source is retried
    alone first). Only the verified blob is read into memory.

    Args:
        host: our host (the downloads use its bulk connections, so client-mode peers can download).
        sources: where the state can be found, as (address, announcement); sources announcing another
            digest than the first are skipped.
        max_bytes: the largest state the caller expects (a volunteer: its model's bound; a backbone: its
            checkpoint limit).
        chunk_bytes: bytes per request (at most :data:`~protocols.state.MAX_CHUNK_BYTES`).
        partial_dir: where to keep a resumable partial download.
        on_progress: called with ``(bytes_done, total)`` after each chunk.
        book: failures of sources are recorded there, and sources it says to skip are skipped.

    Returns:
        The blob, whose SHA-256 is the announced digest.

    Raises:
        StateError: the announcement is refused before any I/O (its size is out of bounds).
        StateUnavailable: no source could provide the state, or the local disk could not take it;
            ``reasons`` says what each source did.
        ConfigError: the partial-download file cannot be created in ``partial_dir``.
        ValueError: ``chunk_bytes`` is out of range.
    """
    download = await _fetch(host, sources, max_bytes, chunk_bytes, partial_dir, on_progress, book)
    try:
        return await trio.to_thread.run_sync(download.read, limiter=STATE_IO)
    except OSError as exc:
        raise StateUnavailable(f"cannot read back the downloaded state: {exc}") from exc
    finally:
        download.close(remove=True)


async def fetch_state_file(
    host: Host,
    sources: Sequence[Source],
    *,
    max_bytes: int,
    directory: Path,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    book: SourceBook | None = None,
) -> Path:
    """Like :func:`fetch_state`, but the verified blob stays on disk: the returned file
    (``<directory>/<hex digest>.partial``) is the caller's to move into place or delete."""
    download = await _fetch(host, sources, max_bytes, chunk_bytes, directory, None, book)
    download.close(remove=False)
    assert download.partial is not None
    return download.partial


async def _fetch(
    host: Host,
    sources: Sequence[Source],
    max_bytes: int,
    chunk_bytes: int,
    partial_dir: Path | None,
    on_progress: Callable[[int, int], None] | None,
    book: SourceBook | None,
) -> _Download:
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    if not sources:
        raise StateUnavailable("no peer announces a state")
    wanted = sources[0][1]
    check_announced_size(wanted, max_bytes)  # before a byte is allocated or a file created
    name = f"state {wanted.digest.hex()[:16]} of step {wanted.step}"
    reasons: list[str] = []
    candidates: list[PeerAddress] = []
    for address, announcement in sources:
        if announcement.digest != wanted.digest:
            logger.debug("skipping %s: it announces another state than %s", address, name)
        elif announcement.nbytes != wanted.nbytes:
            reasons.append(f"{address} announces {announcement.nbytes} bytes, not {wanted.nbytes}")
        elif book is not None and not book.usable(_peer(address)):
            reasons.append(f"{address}: skipped after earlier failures")
        else:
            candidates.append(address)
    download = _Download(wanted, partial_dir)
    try:
        await download.open()
        while True:
            if download.done and on_progress is not None:
                on_progress(download.done, wanted.nbytes)
            while download.done < wanted.nbytes:
                if not candidates:
                    raise StateUnavailable(f"{name} could not be downloaded", tuple(reasons))
                address = candidates[0]
                try:
                    await download.chunk_from(host, address, chunk_bytes)
                except CALL_FAILURES as exc:
                    fault = isinstance(exc, ProtocolError | AuthError)
                    answered = fault or isinstance(exc, RemoteError)  # alive: it answered, even if "no"
                    if book is not None:  # counted there, logged once per streak
                        book.failed(_peer(address), f"{name}: {exc}", fault=fault, unreachable=not answered)
                    else:
                        logger.info("%s: %s failed (%s); trying the next source", name, address, exc)
                    reasons.append(f"{address}: {exc}")
                    candidates.pop(0)
                    continue
                if on_progress is not None:
                    on_progress(download.done, wanted.nbytes)
                if download.done < wanted.nbytes:  # fault point: a chunk in, more to come
                    await faults.point("state.mid_download")
            if await download.verified():
                if book is not None:
                    for address in download.sources:
                        book.succeeded(_peer(address))
                return download
            culprits = download.contributors
            logger.warning(
                "refused %s from %s: its bytes do not hash to the announced digest", name, ", ".join(culprits)
            )
            reasons.append(f"{', '.join(culprits)}: served bytes that do not match the digest")
            if candidates and culprits == [str(candidates[0])]:  # the only contributor: the culprit
                bad = candidates[0].peer_id
                if book is not None:
                    book.failed(
                        _peer(candidates[0]), f"{name}: bytes that do not match the digest", fault=True
                    )
                candidates = [c for c in candidates if c.peer_id != bad]
            await download.restart()
    except BaseException:
        download.close(remove=False)  # a partial file stays for a resume
        raise


def _peer(address: PeerAddress) -> str:
    return str(address.peer_id) if address.peer_id else str(address)


class _Download:
    """One blob being assembled in a file: ``<partial_dir>/<hex digest>.partial`` if asked (it survives a
    restart), an anonymous temporary file otherwise. Nothing in memory grows with the announced size."""

    def __init__(self, wanted: StateAnnouncement, partial_dir: Path | None) -> None:
        self.wanted = wanted
        self.done = 0
        self.contributors: list[str] = []
        self.sources: list[PeerAddress] = []
        self.partial = partial_dir / f"{wanted.digest.hex()}.partial" if partial_dir is not None else None
        self._fd: int | None = None

    async def open(self) -> None:
        try:
            await trio.to_thread.run_sync(self._open, limiter=STATE_IO)
        except OSError as exc:
            where = self.partial if self.partial is not None else "a temporary file"
            raise ConfigError(f"cannot keep a download in {where}: {exc}") from exc
        if self.done:
            logger.info("resuming the download of %s at byte %d", self.partial, self.done)
            self.contributors.append(f"the partial download {self.partial}")
        needed = self.wanted.nbytes - self.done
        free = await trio.to_thread.run_sync(self._free_bytes, limiter=STATE_IO)
        if needed > free:
            raise StateUnavailable(
                f"state of step {self.wanted.step} ({self.wanted.nbytes} bytes) does not fit on disk",
                (f"{needed} bytes needed, {free} free",),
            )

    def _open(self) -> None:
        if self.partial is None:
            with tempfile.TemporaryFile() as file:
                self._fd = os.dup(file.fileno())
            return
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.partial.parent.glob("*.partial"):  # one download per directory: no disk leak
            if stale != self.partial:
                logger.info("deleting the abandoned partial download %s", stale.name)
                stale.unlink(missing_ok=True)
        self._fd = os.open(self.partial, os.O_RDWR | os.O_CREAT, 0o600)
        size = os.fstat(self._fd).st_size
        if size > self.wanted.nbytes:
            os.ftruncate(self._fd, 0)
            size = 0
        self.done = size

    def _free_bytes(self) -> int:
        return free_bytes(self.partial.parent if self.partial is not None else tempfile.gettempdir())

    async def chunk_from(self, host: Host, address: PeerAddress, chunk_bytes: int) -> None:
        digest, total, offset = self.wanted.digest, self.wanted.nbytes, self.done
        length = min(chunk_bytes, total - offset)
        scratch = bytearray(0)  # a fresh buffer per chunk: an abandoned transfer thread writes nowhere

        def sink(meta: bytes, nbytes: int) -> memoryview:
            nonlocal scratch
            chunk = decode_state_chunk(meta)
            if chunk.digest != digest or chunk.offset != offset:
                raise ProtocolError(
                    f"chunk of {chunk.digest.hex()[:16]}@{chunk.offset} answers another request"
                )
            if chunk.total != total:
                raise ProtocolError(f"the source's state is {chunk.total} bytes, announced {total}")
            if not 0 < nbytes <= length:
                raise ProtocolError(f"chunk of {nbytes} bytes for a request of {length}")
            scratch = bytearray(nbytes)  # at most ``length``: checked above, before allocating
            return memoryview(scratch)

        request = encode_state_meta(StateRequest(digest=digest, offset=offset, length=length))
        with trio.fail_after(host.config.bulk_stall + length / _MIN_CHUNK_RATE):
            await host.send_bulk(address, STATE_TOPIC, b"", request, sink=sink)
        if not scratch:
            raise ProtocolError("the source answered without any bytes")
        assert self._fd is not None
        try:
            await trio.to_thread.run_sync(_pwrite_all, self._fd, scratch, offset, limiter=STATE_IO)
        except OSError as exc:
            raise StateUnavailable(f"cannot write the download of step {self.wanted.step}: {exc}") from exc
        self.done += len(scratch)
        if str(address) not in self.contributors:
            self.contributors.append(str(address))
            self.sources.append(address)

    async def verified(self) -> bool:
        try:
            return await trio.to_thread.run_sync(self._hash_matches, limiter=STATE_IO)
        except OSError as exc:
            step = self.wanted.step
            raise StateUnavailable(f"cannot read back the download of step {step}: {exc}") from exc

    def _hash_matches(self) -> bool:
        assert self._fd is not None
        if os.fstat(self._fd).st_size != self.wanted.nbytes:
            return False
        digest = hashlib.sha256()
        offset = 0
        while offset < self.wanted.nbytes:
            block = pread(self._fd, min(_HASH_BLOCK, self.wanted.nbytes - offset), offset)
            if not block:
                return False
            digest.update(block)
            offset += len(block)
        return digest.digest() == self.wanted.digest

    def read(self) -> bytes:
        """The verified blob (at most the caller's ``max_bytes``), read from the file."""
        assert self._fd is not None
        parts = []
        offset = 0
        while offset < self.wanted.nbytes:
            block = pread(self._fd, self.wanted.nbytes - offset, offset)
            if not block:
                raise StateUnavailable(f"the download of step {self.wanted.step} shrank on disk")
            parts.append(block)
            offset += len(block)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def restart(self) -> None:
        self.done = 0
        self.contributors = []
        self.sources = []
        if self._fd is not None:
            await trio.to_thread.run_sync(os.ftruncate, self._fd, 0, limiter=STATE_IO)

    def close(self, *, remove: bool) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if remove and self.partial is not None:
            with contextlib.suppress(FileNotFoundError):
                self.partial.unlink()


def _pwrite_all(fd: int, data: bytearray, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


# ------------------------------------------------------------------------------------------ DHT


async def read_announcements(
    dht: DHTNode, *, users: Mapping[str, str] | None = None, key: str = CHECKPOINT_KEY
) -> dict[str, Announced]:
    """Every peer's current state announcement and the admitted user behind it (malformed entries and other
    peers' subkeys are ignored).

    Args:
        users: the user of each writer, where the caller knows them; otherwise the user the DHT reports
            for the record (``DHTValue.users``: the username of the writer's verified token), otherwise
            the writer itself (see :mod:`shared.state.trust`).

    Raises:
        whatever :meth:`DHTNode.get` raises.
    """
    found = await dht.get(key, latest=True)
    # ``DHTValue.users``: the admitted user of each record, from its verified token
    reported: Mapping[bytes | None, str] = found.users if found is not None else {}
    out: dict[str, Announced] = {}
    for subkey, record in found.entries.items() if found is not None else ():
        if subkey != record.writer.encode():
            continue
        try:
            announcement = _ANNOUNCEMENT.decode(record.value)
        except (msgspec.DecodeError, ValueError):
            logger.debug("ignoring a malformed state announcement by %s", record.writer)
            continue
        user = (users or {}).get(record.writer) or reported.get(subkey) or record.writer
        out[record.writer] = Announced(announcement, user)
    return out


async def presence_addresses(dht: DHTNode) -> dict[str, list[PeerAddress]]:
    """Where each present peer listens (peers in client mode have no addresses and are left out)."""
    found = await dht.get(PRESENCE_KEY, latest=True)
    out: dict[str, list[PeerAddress]] = {}
    for subkey, record in found.entries.items() if found is not None else ():
        if subkey != record.writer.encode():
            continue
        try:
            presence = _PRESENCE.decode(record.value)
        except (msgspec.DecodeError, ValueError):
            continue
        addresses = []
        for text in presence.addrs:
            try:
                addresses.append(parse_multiaddr(text).with_peer(PeerId(record.writer)))
            except ConfigError:
                continue
        if addresses:
            out[record.writer] = addresses
    return out


async def announce_state(dht: DHTNode, announcement: StateAnnouncement, key: str = CHECKPOINT_KEY) -> int:
    """Store our announcement under ``key`` (the run's :data:`CHECKPOINT_KEY`, or a pipeline stage's) for
    :data:`ANNOUNCE_TTL` seconds.

    Returns:
        On how many nodes it is stored (0: nowhere).
    """
    value = msgspec.msgpack.encode(announcement)
    subkey = dht.host.peer_id.encode()
    return await dht.store(key, value, time.time() + ANNOUNCE_TTL, subkey=subkey)
