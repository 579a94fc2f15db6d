"""The bulk data plane: big byte transfers through the C-level TLS socket in worker threads.

See :mod:`protocols.bulk` for the wire exchange. The sender holds a bulk connection exclusively for one
transfer; the bytes move in a worker thread (``BULK_THREADS``) with the socket in blocking mode, so the
trio loop stays free and encryption runs in parallel on other cores (the GIL is released inside
OpenSSL). Cancellation shuts the socket down, which makes the thread fail promptly; the file descriptor
is closed only once the thread has let go of it, so it can never be reused under the thread's feet.

Limits: headers and acks are frames of at most ``BULK_FRAME_BYTES``; an accepted bulk lane waiting
longer than ``idle`` for its next header is closed (idle connections of every kind are reaped). Refusals
are signed error replies, checked by the sender like acks. A malformed header, or anything unexpected in
a handler, ends this lane (the exception reaches the host, which logs and counts it), never the node.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from protocols.bulk import BulkAck, BulkHeader
from protocols.codes import ErrorCode
from protocols.envelope import (
    Envelope,
    ErrorReply,
    Flags,
    encode_payload,
    frame_payload,
)
from protocols.errors import ProtocolError

from ..auth.guard import Authenticator
from ..errors import AuthError, PeerUnavailable, RemoteError, remote_error
from .connection import SecureConnection, decode_frame, decode_payload
from .rpc import RequestContext

__all__ = [
    "BULK_THREADS",
    "BulkHandler",
    "BulkReader",
    "BulkReply",
    "ReplySink",
    "send_bulk",
    "serve_bulk_lane",
]

logger = logging.getLogger(__name__)

#: Worker threads moving bulk bytes, process-wide.
BULK_THREADS = trio.CapacityLimiter(32)
#: A refused transfer up to this size is read and dropped, so its sender learns the error code.
REFUSAL_DRAIN_LIMIT = 64 * 1024 * 1024


async def _in_thread(conn: SecureConnection, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(*args)`` (which uses ``conn``'s socket) in a bulk thread; on cancel, abort the socket.

    Who closes the fd after a cancel: the worker, if it is inside ``fn`` then (the trio side only shuts
    the socket down, so the syscall fails and the fd number stays the worker's until it lets go);
    otherwise the trio side, at once. "Otherwise" includes a worker that never started: the cancel can
    come while waiting for a ``BULK_THREADS`` token, or after the thread was handed ``work`` but before
    it ran; such a worker sees ``aborted`` and leaves the socket alone.
    """
    lock = threading.Lock()
    state = {"running": False, "aborted": False}
    tls = conn.tls

    def claim() -> bool:
        """Take the socket for this thread, unless the trio side was cancelled first (and closed it)."""
        with lock:
            if state["aborted"]:
                return False
            state["running"] = True
            return True

    def work() -> None:
        if not claim():
            return
        try:
            fn(*args)
        finally:
            with lock:
                state["running"] = False
                if state["aborted"]:
                    tls.close_from_thread()

    try:
        await trio.to_thread.run_sync(work, abandon_on_cancel=True, limiter=BULK_THREADS)
    except trio.Cancelled:
        with lock:
            state["aborted"] = True
            if state["running"]:
                tls.shutdown()
            else:
                tls.close()
        raise


async def _paced(
    conn: SecureConnection,
    fn: Callable[[memoryview, float], None],
    data: memoryview,
    stall: float,
    upload: bool,
) -> None:
    """Move all of ``data`` with ``fn`` (the socket's blocking send or receive) in a bulk thread, in pieces
    that the host's cap (:mod:`shared.net.ratelimit`) grants first, when it has one that way.

    A cancel while waiting for a grant closes the connection, as a cancel inside the thread does: the
    transfer is cut off mid-way, so the connection cannot be used again.
    """
    throttle = conn.tls.throttle
    limit = None if throttle is None else throttle.upload if upload else throttle.download
    if limit is None:
        await _in_thread(conn, fn, data, stall)
        return
    for start in range(0, data.nbytes, limit.quantum):
        piece = data[start : start + limit.quantum]
        try:
            await limit.acquire(piece.nbytes)
        except trio.Cancelled:
            conn.tls.close()
            raise
        await _in_thread(conn, fn, piece, stall)


async def send_bulk(
    conn: SecureConnection,
    topic: str,
    data: memoryview,
    meta: bytes,
    stall: float,
    auth: Authenticator,
    sink: ReplySink | None = None,
) -> bytes:
    """Send ``data`` on the bulk connection ``conn`` and return the receiver's ack meta.

    The header is signed like any request (the TLS channel binds the raw bytes that follow it to the
    same authenticated peer); the ack is checked like any response.

    Raises:
        PeerUnavailable: the connection broke or stalled for ``stall`` seconds.
        RemoteError: the receiver refused the transfer.
        AuthError: the receiver's ack is not an admitted peer's signed answer.
    """
    flat = data.cast("B") if data.ndim != 1 or data.format != "B" else data
    header = encode_payload(BulkHeader(topic=topic, nbytes=flat.nbytes, meta=meta))
    credentials, nonce = auth.sign_request(conn.remote_peer, BulkHeader.kind, 0, header)
    await conn.send_frame(frame_payload(BulkHeader.kind, header, 0, Flags.REQUEST, credentials))
    if flat.nbytes:
        await _paced(conn, conn.tls.send_all_blocking, flat, stall, upload=True)
    envelope = await _receive_envelope(conn)
    # an ack and a refusal alike must be the receiver's signed answer to this header
    auth.check_response(conn.remote_peer, nonce, envelope.kind, bytes(envelope.payload), envelope.auth)
    ack = await decode_payload(envelope, BulkAck)
    if isinstance(ack, ErrorReply):
        raise remote_error(ack.code, ack.message)
    if not isinstance(ack, BulkAck):
        raise ProtocolError(f"expected {BulkAck.kind}, got {ack.kind}")
    if ack.nbytes:
        if sink is None:
            raise ProtocolError(f"{topic}: unexpected reply payload of {ack.nbytes} bytes")
        buffer = sink(ack.meta, ack.nbytes)
        if buffer.nbytes != ack.nbytes:
            raise ProtocolError(f"{topic}: reply buffer of {buffer.nbytes} bytes for {ack.nbytes} announced")
        await BulkReader(conn, ack.nbytes, stall).read_into(buffer)
    return ack.meta


async def _receive_envelope(conn: SecureConnection) -> Envelope:
    try:
        body = await conn.receive_frame()
    except EOFError as exc:
        raise PeerUnavailable(f"{conn.tls.peer} closed the bulk connection") from exc
    return await decode_frame(body)


class BulkReader:
    """Gives a bulk handler the transfer's bytes; the handler must read exactly ``remaining`` bytes."""

    def __init__(self, conn: SecureConnection, nbytes: int, stall: float) -> None:
        self._conn = conn
        self.remaining = nbytes
        self._stall = stall

    async def read_into(self, buffer: memoryview) -> None:
        """Fill all of ``buffer`` (a writable byte view) with the next bytes of the transfer."""
        view = buffer.cast("B") if buffer.ndim != 1 or buffer.format != "B" else buffer
        if view.nbytes > self.remaining:
            raise ValueError(f"asked for {view.nbytes} bytes, only {self.remaining} remain in the transfer")
        head = self._conn.receiver.take_buffered(view.nbytes)
        view[: len(head)] = head
        rest = view[len(head) :]
        if rest.nbytes:
            await _paced(self._conn, self._conn.tls.recv_into_blocking, rest, self._stall, upload=False)
        self.remaining -= view.nbytes

    async def peer_closed(self) -> None:
        """Return once the sender closed the connection (or spoke out of turn): for a handler that waits
        before it answers a transfer it has read whole, to notice that nobody waits for the answer."""
        if not self.remaining:
            await self._conn.tls.wait_readable()

    async def discard(self) -> None:
        """Read and drop whatever the handler did not consume."""
        scratch = bytearray(min(self.remaining, 1 << 20))
        while self.remaining:
            chunk = memoryview(scratch)[: min(self.remaining, len(scratch))]
            await self.read_into(chunk)


@dataclass(frozen=True)
class BulkReply:
    """A handler's answer with a payload: ``meta`` in the ack, then ``data`` as raw bytes.

    ``on_sent``, if given, is called once the payload has been sent or the attempt failed, so a handler
    can hold a resource (a concurrency slot, a buffer) until its reply is on the wire.
    """

    meta: bytes
    data: memoryview
    on_sent: Callable[[], None] | None = None


#: Called by the sender with the ack's meta and the reply size; returns where to put the reply bytes.
ReplySink = Callable[[bytes, int], memoryview]
BulkHandler = Callable[[RequestContext, BulkHeader, BulkReader], Awaitable[bytes | BulkReply]]


async def serve_bulk_lane(
    conn: SecureConnection,
    handlers: dict[str, BulkHandler],
    stall: float,
    auth: Authenticator,
    idle: float = math.inf,
) -> None:
    """Serve transfers on an accepted bulk connection until the peer closes it or leaves it idle for
    ``idle`` seconds.

    Raises:
        ProtocolError: the peer sent a malformed or oversized header (the lane is closed).
    """
    try:
        while True:
            envelope: Envelope | None = None
            with trio.move_on_after(idle):
                try:
                    envelope = await _receive_envelope(conn)
                except PeerUnavailable:
                    return
            if envelope is None:
                logger.debug("closing bulk lane from %s: idle for %.0f s", conn.remote_peer, idle)
                return
            conn.last_used = trio.current_time()
            header = await decode_payload(envelope, BulkHeader)
            if not isinstance(header, BulkHeader):
                raise ProtocolError(f"expected {BulkHeader.kind}, got {header.kind}")
            reader = BulkReader(conn, header.nbytes, stall)
            handler = handlers.get(header.topic)
            nonce = b""
            try:
                verified = auth.check_request(
                    conn.remote_peer,
                    envelope.kind,
                    envelope.request_id,
                    bytes(envelope.payload),
                    envelope.auth,
                )
                nonce = verified.nonce
                context = RequestContext(
                    conn.remote_peer, conn.remote_addrs, verified.username, conn.remote_host
                )
                if handler is None:
                    raise ProtocolError(f"no bulk handler for topic {header.topic!r}", ErrorCode.UNKNOWN_KIND)
                answer = await handler(context, header, reader)
            except (ProtocolError, RemoteError, AuthError) as exc:
                code = int(exc.code)
                quiet = code in (ErrorCode.NOT_FOUND, ErrorCode.PENDING)  # an answer, not a fault
                logger.log(
                    logging.DEBUG if quiet else logging.WARNING,
                    "refused bulk %s from %s: %s",
                    header.topic,
                    conn.remote_peer,
                    exc,
                )
                # Drain a modest transfer so the sender reads our reason rather than a reset; a huge
                # one is not worth receiving: close, and the sender sees the connection fail.
                drain = not isinstance(exc, AuthError) and reader.remaining <= REFUSAL_DRAIN_LIMIT
                if drain:
                    await reader.discard()
                refusal = encode_payload(ErrorReply(code=int(code), message=str(exc)[:1024]))
                signed = auth.sign_error(envelope.auth, refusal)
                with trio.move_on_after(1):
                    await conn.send_frame(frame_payload(ErrorReply.kind, refusal, 0, Flags.ERROR, signed))
                if drain:
                    continue
                return
            reply = answer if isinstance(answer, BulkReply) else BulkReply(answer, memoryview(b""))
            try:
                if reader.remaining:
                    await reader.discard()
                payload = (
                    reply.data.cast("B") if reply.data.format != "B" or reply.data.ndim != 1 else reply.data
                )
                ack = encode_payload(BulkAck(meta=reply.meta, nbytes=payload.nbytes))
                credentials = auth.sign_response(nonce, BulkAck.kind, ack)
                await conn.send_frame(frame_payload(BulkAck.kind, ack, 0, Flags.RESPONSE, credentials))
                if payload.nbytes:
                    await _paced(conn, conn.tls.send_all_blocking, payload, stall, upload=True)
            finally:
                if reply.on_sent is not None:
                    reply.on_sent()
    except PeerUnavailable as exc:
        logger.debug("bulk lane from %s lost: %s", conn.remote_peer, exc)
    finally:
        conn.close()
