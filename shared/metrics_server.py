"""A minimal HTTP/1.1 server for one page, ``GET /metrics`` (Prometheus text format), on trio.

The volunteer serves its metrics with this (``volunteer join --metrics-listen``) rather than with an ASGI
stack: one path, one method, no body, so a few dozen lines on :func:`trio.serve_listeners` do, and the
daemon's own nursery owns the server (it stops with the daemon).

**Bounded, whatever a client sends.** A connection is answered once and closed (``Connection: close``). The
request head (request line and headers) is read up to :data:`MAX_HEAD_BYTES`; a longer one gets ``431`` and
the connection is closed. A client that has not sent its whole head within :data:`REQUEST_TIMEOUT` seconds
gets ``408`` (best effort) and is dropped, and the answer itself must be written within the same time; then
what the client still sends is read and dropped (at most :data:`DRAIN_BYTES` for :data:`DRAIN_SECONDS`) so
that closing does not reset the answer away. At most :data:`MAX_CONNECTIONS` connections are served at once;
one more is closed as soon as it is accepted. Answers: ``200`` for ``GET /metrics`` (a query string is
ignored), ``404`` for another path, ``405`` (``Allow: GET``) for another method, ``400`` for a head that is
not HTTP/1.x, ``500`` if rendering the page failed (logged). Nothing a client does raises out of the
connection's handler: a malformed, truncated, oversized or abandoned request costs one connection, never the
daemon.

**Where.** :func:`parse_listen` reads ``HOST:PORT`` (``[v6]:PORT`` for IPv6) or a bare ``PORT``, which
means ``127.0.0.1:PORT``: the page is this machine's own numbers, for a local Prometheus or node agent.
A non-loopback host is served only when given explicitly (:func:`is_loopback` tells the caller, which
warns).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable

import trio

from .errors import ConfigError
from .prometheus import CONTENT_TYPE

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_HEAD_BYTES",
    "REQUEST_TIMEOUT",
    "is_loopback",
    "parse_listen",
    "parse_request_head",
    "response",
    "serve_metrics",
]

logger = logging.getLogger("shared.metrics_server")

#: The request line and headers of a scrape are ~200 bytes; a head longer than this is refused.
MAX_HEAD_BYTES = 8 * 1024
#: Seconds a client has to send its request head, and then to take the answer.
REQUEST_TIMEOUT = 5.0
#: After answering, what the client still sends is read and dropped, at most this much for this long.
DRAIN_BYTES = 64 * 1024
DRAIN_SECONDS = 1.0
#: Connections served at once (a scraper opens one at a time).
MAX_CONNECTIONS = 16
PATH = "/metrics"

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}


def parse_listen(text: str, flag: str = "--metrics-listen") -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT``, ``[V6]:PORT`` or ``PORT`` (host ``127.0.0.1``); port 0: any free.

    Raises:
        ConfigError: not of that form, the host not an IP address (or ``localhost``), the port out of range.
    """
    text = text.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "127.0.0.1", text
    elif host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"{flag} {text!r}: write an IPv6 host in brackets, e.g. [::1]:9101")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(
            f"{flag} {text!r}: give HOST:PORT with an IP address, e.g. 127.0.0.1:9101"
        ) from None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{flag} {text!r}: the port must be a number from 0 to 65535")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address) is reachable only from this machine."""
    return ipaddress.ip_address(host).is_loopback


def parse_request_head(head: bytes) -> tuple[str, str]:
    """``(method, path)`` of an HTTP/1.x request head (its query string dropped).

    Raises:
        ValueError: the request line is not ``METHOD TARGET HTTP/1.x`` in ASCII.
    """
    line = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    try:
        text = line.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("the request line is not ASCII") from None
    parts = text.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x request line: {text[:80]!r}")
    method, target, _ = parts
    if not method.isalpha() or not method.isupper() or not target.startswith("/"):
        raise ValueError(f"not an HTTP/1.x request line: {text[:80]!r}")
    return method, target.split("?", 1)[0]


def response(status: int, body: bytes = b"", content_type: str = "text/plain; charset=utf-8") -> bytes:
    """A whole HTTP/1.1 answer that closes the connection."""
    headers = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if status == 405:
        headers.append("Allow: GET")
    return ("\r\n".join(headers) + "\r\n\r\n").encode("ascii") + body


def _answer(head: bytes, page: Callable[[], str]) -> bytes:
    try:
        method, path = parse_request_head(head)
    except ValueError:
        return response(400, b"not an HTTP/1.x request\n")
    if path != PATH:
        return response(404, b"only /metrics is served here\n")
    if method != "GET":
        return response(405, b"only GET\n")
    try:
        body = page().encode("utf-8")
    except Exception:  # a bug in rendering must not end the daemon: the scraper sees a 500
        logger.exception("rendering /metrics failed")
        return response(500, b"rendering the metrics failed; see the daemon's log\n")
    return response(200, body, CONTENT_TYPE)


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    """The request head, or None when it grew past :data:`MAX_HEAD_BYTES` (the caller answers 431)."""
    data = bytearray()
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        if len(data) > MAX_HEAD_BYTES:
            return None
        chunk = await stream.receive_some(4096)
        if not chunk:  # the client closed before ending its head: answer what we have
            break
        data += chunk
    return bytes(data)


async def _drain(stream: trio.SocketStream) -> None:
    """Read what the client still sends, bounded, until it closes: closing a socket with unread input
    resets the connection, and the client could lose the answer (a 431's, say) before reading it."""
    left = DRAIN_BYTES
    with trio.move_on_after(DRAIN_SECONDS):
        while left > 0 and (chunk := await stream.receive_some(min(left, 4096))):
            left -= len(chunk)


async def _handle(stream: trio.SocketStream, page: Callable[[], str], limiter: trio.CapacityLimiter) -> None:
    try:
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:  # as many clients as we serve already: this one is closed at once
            await stream.aclose()
            return
        try:
            async with stream:
                answer = response(408)
                with trio.move_on_after(REQUEST_TIMEOUT):
                    head = await _read_head(stream)
                    answer = response(431) if head is None else _answer(head, page)
                with trio.move_on_after(REQUEST_TIMEOUT):
                    await stream.send_all(answer)
                    await stream.send_eof()
                await _drain(stream)
        finally:
            limiter.release()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        logger.debug("a /metrics client went away: %s", exc)


async def serve_metrics(
    host: str,
    port: int,
    page: Callable[[], str],
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``page()`` (Prometheus text) at ``http://host:port/metrics`` until cancelled.

    Started with ``nursery.start``, it reports the bound port (the one chosen, for port 0) once listening.

    Raises:
        ConfigError: the address cannot be bound (taken, or not this machine's).
    """
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
    limiter = trio.CapacityLimiter(MAX_CONNECTIONS)
    bound = listeners[0].socket.getsockname()[1]

    async def handle(stream: trio.SocketStream) -> None:
        await _handle(stream, page, limiter)

    async with trio.open_nursery() as nursery:
        task_status.started(bound)
        await trio.serve_listeners(handle, listeners, handler_nursery=nursery)
