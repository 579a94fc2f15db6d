"""Typed request/response over one :class:`SecureConnection`, in both directions at once.

Either end may send requests on a connection (so a peer that accepts no inbound connections can still
be called back over the one it opened). Each request carries an id chosen by its sender; the reply uses
the same id with the ``RESPONSE`` or ``ERROR`` flag.

Handlers are registered explicitly by request type in a :class:`HandlerRegistry`.

Back-pressure, without unbounded buffers:

* the reader never stops draining the socket; a request that arrives while ``max_inflight`` of the
  peer's requests are being handled, or while their frames hold ``max_inflight_bytes`` already, is
  answered ``OVERLOADED`` at once (the caller sees :class:`~shared.errors.Overloaded`), so one
  connection holds at most ``max_inflight_bytes`` plus one frame;
* writes go through one FIFO lock straight into the kernel's socket buffer; a peer that stops reading
  blocks our writers (and only them), never our memory.

Errors: a frame that cannot be decoded is answered with an :class:`ErrorReply` (request id 0 when even
the envelope is unreadable) and the connection keeps serving; an oversized frame closes the connection,
because the stream cannot be resynchronised. Decoding failures of every kind are ``ProtocolError``
(:mod:`protocols.errors`); anything unexpected while serving a connection ends that connection (logged
with its traceback, counted in ``failures``), never the host. Error replies are signed like responses
(:meth:`~shared.auth.guard.Authenticator.sign_error`) and checked like responses: a refusal that does not
verify is an :class:`~shared.errors.AuthError` of that call, not believed. Handler exceptions map to
codes: ``ProtocolError`` to its code, ``RemoteError`` to its code, anything else to ``INTERNAL``
(logged with its traceback, not sent). Per-call deadlines are the caller's cancel scopes; a cancelled
call forgets its id and a late reply is dropped.

Traffic by kind: every frame a channel builds to send (requests, notifications, responses, error replies)
adds its length to ``sent_by_kind[kind]`` (a counter the host shares among its channels, so closed
channels keep counting): which protocols a node's RPC bytes go to, e.g. progress reads against stores.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import trio

from protocols.codes import ErrorCode
from protocols.envelope import (
    Envelope,
    ErrorReply,
    Flags,
    Message,
    Request,
    check_envelope,
    encode_payload,
    frame_payload,
)
from protocols.errors import ProtocolError
from protocols.peer_id import PeerId

from ..auth.guard import Authenticator, OpenAuthenticator
from ..errors import AUTH_CODES, AuthError, PeerUnavailable, RemoteError, remote_error
from .connection import SecureConnection, decode_payload, parse_frame

__all__ = ["HandlerRegistry", "RequestContext", "RpcChannel", "RpcStatistics"]

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=Request)
N = TypeVar("N", bound=Message)


@dataclass(frozen=True)
class RequestContext:
    """Who sent a request: a proven peer id, the addresses it says it listens on, in pinned runs the
    admitted user it belongs to, and the host (IP) its connection comes from as this node sees it."""

    peer_id: PeerId
    listen_addrs: tuple[str, ...]
    username: str | None = None
    remote_host: str = ""


Handler = Callable[[RequestContext, Any], Awaitable[Message]]
NotifyHandler = Callable[[RequestContext, Any], Awaitable[None]]


class HandlerRegistry:
    """Explicit map from request (or notification) type to its async handler."""

    def __init__(self) -> None:
        self.requests: dict[type[Request], Handler] = {}
        self.notifications: dict[type[Message], NotifyHandler] = {}
        self.observers: list[Callable[[RequestContext], None]] = []

    def observe(self, observer: Callable[[RequestContext], None]) -> None:
        """Call ``observer`` with the context of every request and notification that passed
        authentication, before its handler runs (the DHT learns its contacts from every message)."""
        self.observers.append(observer)

    def observed(self, context: RequestContext) -> None:
        for observer in self.observers:
            observer(context)

    def add(self, request_type: type[R], handler: Callable[[RequestContext, R], Awaitable[Message]]) -> None:
        if request_type in self.requests:
            raise ValueError(f"a handler for {request_type.kind} is already registered")
        self.requests[request_type] = handler

    def add_notification(
        self, message_type: type[N], handler: Callable[[RequestContext, N], Awaitable[None]]
    ) -> None:
        if message_type in self.notifications:
            raise ValueError(f"a handler for {message_type.kind} is already registered")
        self.notifications[message_type] = handler


@dataclass(frozen=True)
class RpcStatistics:
    calls_sent: int
    calls_failed: int
    requests_served: int
    requests_rejected: int
    bytes_sent: int
    bytes_received: int
    protocol_errors: int = 0
    failures: int = 0


class _Pending:
    __slots__ = ("done", "expected", "nonce", "outcome")

    def __init__(self, expected: type[Message], nonce: bytes) -> None:
        self.expected = expected
        self.nonce = nonce
        self.done = trio.Event()
        self.outcome: Message | BaseException | None = None


class RpcChannel:
    """Serves and issues RPCs over one connection; :meth:`run` must be running for either."""

    def __init__(
        self,
        conn: SecureConnection,
        registry: HandlerRegistry,
        *,
        max_inflight: int = 128,
        handler_deadline: float = 30.0,
        authenticator: Authenticator | None = None,
        max_inflight_bytes: int = 32 * 1024 * 1024,
        sent_by_kind: Counter[str] | None = None,
    ) -> None:
        self.conn = conn
        #: bytes of the frames built to send, by message kind (module docstring, "Traffic by kind")
        self.sent_by_kind: Counter[str] = Counter() if sent_by_kind is None else sent_by_kind
        self.peer_id = conn.remote_peer
        self._registry = registry
        self._auth: Authenticator = authenticator or OpenAuthenticator()
        self._context = RequestContext(conn.remote_peer, conn.remote_addrs, remote_host=conn.remote_host)
        self._max_inflight = max_inflight
        self._max_inflight_bytes = max_inflight_bytes
        self._inflight_bytes = 0
        self._handler_deadline = handler_deadline
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._inflight = 0
        self._closed = trio.Event()
        self._calls_sent = self._calls_failed = self._served = self._rejected = 0
        self._protocol_errors = self._failures = 0
        self.last_rtt: float = math.nan
        self.last_activity = trio.current_time()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def idle(self) -> bool:
        """No call of ours awaits a reply and no request of the peer is being handled."""
        return not self._pending and self._inflight == 0

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def statistics(self) -> RpcStatistics:
        return RpcStatistics(
            self._calls_sent,
            self._calls_failed,
            self._served,
            self._rejected,
            self.conn.tls.bytes_sent,
            self.conn.tls.bytes_received,
            self._protocol_errors,
            self._failures,
        )

    async def call(self, request: Request) -> Message:
        """Send ``request`` and return its reply (an instance of ``type(request).response``).

        Raises:
            PeerUnavailable: the connection is or becomes closed before the reply.
            RemoteError: the peer answered with an error code (``Overloaded`` for ``OVERLOADED``).
            ProtocolError: the reply was malformed or of the wrong kind.
        """
        if self._closed.is_set():
            raise PeerUnavailable(f"connection to {self.peer_id} is closed")
        request_id = next(self._ids)
        payload = encode_payload(request)
        auth, nonce = self._auth.sign_request(self.peer_id, request.kind, request_id, payload)
        slot = _Pending(type(request).response, nonce)
        self._pending[request_id] = slot
        self._calls_sent += 1
        started = self.last_activity = trio.current_time()
        try:
            await self.conn.send_frame(self._frame(request.kind, payload, request_id, Flags.REQUEST, auth))
            await slot.done.wait()
        finally:
            self._pending.pop(request_id, None)
        outcome = slot.outcome
        if isinstance(outcome, BaseException):
            self._calls_failed += 1
            raise outcome
        assert outcome is not None  # set together with done
        self.last_rtt = trio.current_time() - started
        return outcome

    async def notify(self, message: Message) -> None:
        """Send a one-way message (no reply)."""
        payload = encode_payload(message)
        auth, _ = self._auth.sign_request(self.peer_id, message.kind, 0, payload)
        await self.conn.send_frame(self._frame(message.kind, payload, 0, Flags.NOTIFY, auth))

    async def run(self) -> None:
        """Read frames until the connection closes; serve requests in a nursery owned here.

        Whatever goes wrong on this connection ends this connection only: an unexpected exception is
        logged with its traceback and counted, and ``run`` returns.
        """
        try:
            async with trio.open_nursery() as nursery:
                await self._read_loop(nursery)
                nursery.cancel_scope.cancel()
        except Exception:
            self._failures += 1
            logger.exception("closing connection to %s after an unexpected error", self.peer_id)
        finally:
            self._shutdown(PeerUnavailable(f"connection to {self.peer_id} closed"))

    def _shutdown(self, error: PeerUnavailable) -> None:
        self._closed.set()
        self.conn.close()
        for slot in self._pending.values():
            if not slot.done.is_set():
                slot.outcome = error
                slot.done.set()

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        while True:
            try:
                body = await self.conn.receive_frame()
            except EOFError:
                return
            except PeerUnavailable as exc:
                logger.debug("connection to %s lost: %s", self.peer_id, exc)
                return
            except ProtocolError as exc:
                self._protocol_errors += 1
                logger.warning("closing connection to %s: %s", self.peer_id, exc)
                await self._reply_error(0, exc.code, str(exc))
                return
            self.last_activity = trio.current_time()
            await self._dispatch(body, nursery)

    async def _dispatch(self, body: bytes, nursery: trio.Nursery) -> None:
        try:
            envelope = await parse_frame(body)
        except ProtocolError as exc:
            self._protocol_errors += 1
            logger.warning("bad frame from %s: %s", self.peer_id, exc)
            await self._reply_error(0, exc.code, str(exc))
            return
        try:
            check_envelope(envelope)
        except ProtocolError as exc:
            self._protocol_errors += 1
            logger.warning("bad frame from %s: %s", self.peer_id, exc)
            if envelope.flags not in (Flags.RESPONSE, Flags.ERROR):  # never answer an answer
                await self._reply_error(exc.request_id, exc.code, str(exc), envelope.auth)
            return
        flags = envelope.flags
        if flags in (Flags.RESPONSE, Flags.ERROR):
            slot = self._pending.get(envelope.request_id)
            if slot is None or slot.done.is_set():
                logger.debug("dropping late or unknown reply %d from %s", envelope.request_id, self.peer_id)
                return
            try:
                # a response and a refusal alike must be the peer's signed answer to our request
                self._auth.check_response(
                    self.peer_id, slot.nonce, envelope.kind, bytes(envelope.payload), envelope.auth
                )
                message = await decode_payload(envelope, slot.expected)
                if isinstance(message, ErrorReply) and message.code in AUTH_CODES:
                    self._auth.note_refused(message.code)
                slot.outcome = (
                    remote_error(message.code, message.message)
                    if isinstance(message, ErrorReply)
                    else message
                )
            except (ProtocolError, AuthError) as exc:
                if isinstance(exc, AuthError):
                    logger.warning("refused an answer from %s: %s", self.peer_id, exc)
                else:
                    self._protocol_errors += 1
                    logger.warning("malformed answer from %s: %s", self.peer_id, exc)
                slot.outcome = exc
            slot.done.set()
        elif (
            self._inflight >= self._max_inflight
            or self._inflight_bytes + len(body) > self._max_inflight_bytes
        ):
            self._rejected += 1
            if flags == Flags.REQUEST:
                await self._reply_error(
                    envelope.request_id, ErrorCode.OVERLOADED, "too many requests in flight", envelope.auth
                )
        else:
            self._inflight += 1
            self._inflight_bytes += len(body)
            serve = self._serve_request if flags == Flags.REQUEST else self._serve_notification
            nursery.start_soon(serve, envelope, len(body))

    def _verify(self, envelope: Envelope) -> tuple[RequestContext, bytes]:
        verified = self._auth.check_request(
            self.peer_id, envelope.kind, envelope.request_id, bytes(envelope.payload), envelope.auth
        )
        if verified.username is None:
            return self._context, verified.nonce
        return replace(self._context, username=verified.username), verified.nonce

    async def _serve_notification(self, envelope: Envelope, size: int) -> None:
        try:
            context, _ = self._verify(envelope)
            message = await decode_payload(envelope)
            self._registry.observed(context)
            handler = self._registry.notifications.get(type(message))
            if handler is None:
                logger.debug("no handler for notification %s from %s", message.kind, self.peer_id)
                return
            with trio.move_on_after(self._handler_deadline):
                await handler(context, message)
        except (ProtocolError, AuthError) as exc:
            logger.warning("dropped notification %s from %s: %s", envelope.kind, self.peer_id, exc)
        except Exception:
            logger.exception("handler for notification %s from %s failed", envelope.kind, self.peer_id)
        finally:
            self._inflight -= 1
            self._inflight_bytes -= size

    async def _serve_request(self, envelope: Envelope, size: int) -> None:
        try:
            frame = await self._handle(envelope)
            await self.conn.send_frame(frame)
        except PeerUnavailable:
            pass  # the connection is gone; nobody is left to answer
        finally:
            self._inflight -= 1
            self._inflight_bytes -= size

    async def _handle(self, envelope: Envelope) -> bytes:
        """Run the handler; return the reply frame (a response or an error reply, never raises)."""
        code: int
        try:
            context, nonce = self._verify(envelope)
            request = await decode_payload(envelope)
            self._registry.observed(context)
            handler = self._registry.requests.get(type(request))  # type: ignore[arg-type]
            if handler is None:
                raise ProtocolError(f"no handler for {request.kind}", ErrorCode.UNKNOWN_KIND)
            with trio.fail_after(self._handler_deadline):
                reply = await handler(context, request)
            payload = encode_payload(reply)
            auth = self._auth.sign_response(nonce, reply.kind, payload)
            self._served += 1
            return self._frame(reply.kind, payload, envelope.request_id, Flags.RESPONSE, auth)
        except AuthError as exc:
            logger.warning("rejected %s from %s: %s", envelope.kind, self.peer_id, exc)
            code, text = exc.code, str(exc)
        except ProtocolError as exc:
            self._protocol_errors += 1
            logger.warning("rejected %s from %s: %s", envelope.kind, self.peer_id, exc)
            code, text = exc.code, str(exc)
        except RemoteError as exc:
            code, text = int(exc.code), exc.remote_message
        except trio.TooSlowError:
            logger.warning("handler for %s from %s timed out", envelope.kind, self.peer_id)
            code, text = ErrorCode.INTERNAL, "handler timed out"
        except Exception:
            logger.exception("handler for %s from %s failed", envelope.kind, self.peer_id)
            code, text = ErrorCode.INTERNAL, "internal error"
        return self._error_frame(envelope.request_id, code, text, envelope.auth)

    def _error_frame(self, request_id: int, code: int, message: str, request_auth: bytes = b"") -> bytes:
        """An error reply, signed (bound to the request's nonce) when the request's credentials name one."""
        reply = ErrorReply(code=int(code), message=message[:1024])
        payload = encode_payload(reply)
        auth = self._auth.sign_error(request_auth, payload) if request_id else b""
        return self._frame(reply.kind, payload, request_id, Flags.ERROR, auth)

    def _frame(self, kind: str, payload: bytes, request_id: int, flags: Flags, auth: bytes) -> bytes:
        frame = frame_payload(kind, payload, request_id, flags, auth)
        self.sent_by_kind[kind] += len(frame)
        return frame

    async def _reply_error(self, request_id: int, code: int, message: str, request_auth: bytes = b"") -> None:
        with contextlib.suppress(PeerUnavailable):  # the connection is gone; nobody is left to answer
            await self.conn.send_frame(self._error_frame(request_id, code, message, request_auth))
