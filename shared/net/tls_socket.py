"""A TLS 1.3 socket driven by trio, with the record layer in C.

trio's ``SSLStream`` pushes every record through a ``MemoryBIO`` in Python, which caps it near
330 MB/s on the machines this runs on. Here the standard library's ``ssl.SSLSocket`` owns the TCP socket
directly, so encryption, framing and the syscall all happen in one C call that releases the GIL:

* on the trio thread (RPC lane) the socket is non-blocking: try the operation, and on
  ``SSLWantRead``/``SSLWantWrite`` park in ``trio.lowlevel.wait_readable``/``wait_writable``;
* for bulk transfers (:meth:`TlsSocket.send_all_blocking`, :meth:`recv_into_blocking`) a worker thread
  takes the socket *exclusively*, switches it to blocking mode with a stall deadline, and moves the
  bytes with no Python per record on the trio side.

With a host's caps (:attr:`TlsSocket.throttle`, :mod:`shared.net.ratelimit`) :meth:`TlsSocket.send_all`
sends in pieces its upload bucket grants first, and :meth:`TlsSocket.receive_into` waits out the download
bucket's debt before each read and charges what it read; bulk transfers are paced by
:mod:`shared.net.bulk` around the blocking methods. Without caps nothing changes.

An ``SSL`` object must never be used by two threads at once; callers guarantee that (the RPC lane
never leaves the trio thread, a bulk lane is checked out by one transfer at a time).

Every failure of the peer or the network surfaces as :class:`~shared.errors.PeerUnavailable`. If a send
is cancelled midway the TLS stream is in an unknown state, so the socket is closed (the connection is
lost, never corrupted).
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import ssl
import sys
import threading
from collections.abc import Awaitable, Callable

import trio

from ..errors import PeerUnavailable
from .ratelimit import Throttle

__all__ = ["TlsSocket", "Traffic", "connect_tcp"]

_RECV_CHUNK = 256 * 1024


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


async def connect_tcp(host: str, port: int) -> socket.socket:
    """Open a non-blocking TCP connection (trying each resolved address in order).

    Raises:
        PeerUnavailable: nothing answered at ``host:port``.
    """
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PeerUnavailable(f"cannot resolve {host!r}: {exc}") from exc
    last: OSError | None = None
    for family, type_, proto, _, sockaddr in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            _tune(sock)
            code = sock.connect_ex(sockaddr)
            if code not in (0, errno.EINPROGRESS):
                raise OSError(code, errno.errorcode.get(code, str(code)))
            if code == errno.EINPROGRESS:
                await trio.lowlevel.wait_writable(sock)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, errno.errorcode.get(code, str(code)))
            return sock
        except OSError as exc:
            last = exc
            trio.lowlevel.notify_closing(sock)
            sock.close()
        except BaseException:
            trio.lowlevel.notify_closing(sock)
            sock.close()
            raise
    raise PeerUnavailable(f"cannot connect to {host}:{port}: {last.strerror if last else 'no address'}")


class Traffic:
    """Bytes every connection of one node sent and received (TLS plaintext: payloads and framing), RPC and
    bulk lanes alike; shared by the node's :class:`TlsSocket` objects, also from the worker threads of bulk
    transfers (hence the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received


class TlsSocket:
    """One TLS connection. Build it with :meth:`handshake`."""

    def __init__(self, sock: ssl.SSLSocket, peer: str) -> None:
        self._sock = sock
        self.peer = peer  # "host:port", for messages
        self._closed = False
        self._worker_closes = False  # set by shutdown(): the worker thread closes the fd when it lets go
        self.bytes_sent = 0
        self.bytes_received = 0
        #: the host's upload/download caps (shared.net.ratelimit); None: not capped
        self.throttle: Throttle | None = None
        #: the host's totals, which this connection's bytes add to; None: counted here only
        self.traffic: Traffic | None = None

    @classmethod
    async def handshake(
        cls, raw: socket.socket, context: ssl.SSLContext, *, server_side: bool, peer: str
    ) -> TlsSocket:
        """Wrap ``raw`` (non-blocking, connected) and run the TLS handshake.

        Raises:
            PeerUnavailable: the peer closed, reset, or spoke something that is not TLS 1.3.
        """
        raw.setblocking(False)
        try:
            sock = context.wrap_socket(raw, server_side=server_side, do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:
            raw.close()
            raise PeerUnavailable(f"TLS setup with {peer} failed: {exc}") from exc
        tls = cls(sock, peer)
        try:
            await tls._retry(sock.do_handshake)
        except BaseException:
            tls.close()
            raise
        return tls

    def socket_peer(self) -> str:
        """``host:port`` of the TCP connection's far end as the kernel has it (``""`` once closed): for a
        relayed connection the relay, for a punched one the other side's NAT."""
        try:
            host, port = self._sock.getpeername()[:2]
        except (OSError, ValueError):
            return ""
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def peer_certificate(self) -> bytes | None:
        return self._sock.getpeercert(binary_form=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def readable_now(self) -> bool:
        """Whether bytes (or the peer's close) are waiting. An idle connection that is readable was
        closed by the peer (or is being spoken to out of turn), so it must not be reused."""
        if self._closed:
            return False
        try:  # poll, not select: select cannot watch descriptors >= 1024 (busy backbones have them)
            if sys.platform == "win32":  # no poll; Windows' select has no such limit
                ready = select.select([self._sock], [], [], 0)[0]
            else:
                poller = select.poll()
                poller.register(self._sock.fileno(), select.POLLIN | select.POLLPRI)
                ready = poller.poll(0)
        except (OSError, ValueError):
            return True
        return bool(ready) or self._sock.pending() > 0

    async def _retry(self, op: object, *args: object) -> int:
        """Run a non-blocking SSL operation until it completes, parking on want-read/want-write."""
        fn = op  # typed loosely: the ssl methods have different signatures
        while True:
            if self._closed:
                raise PeerUnavailable(f"connection to {self.peer} is closed")
            try:
                result = fn(*args)  # type: ignore[operator]
            except ssl.SSLWantReadError:
                await self._wait(trio.lowlevel.wait_readable)
            except ssl.SSLWantWriteError:
                await self._wait(trio.lowlevel.wait_writable)
            except ssl.SSLZeroReturnError:
                return 0
            except (ssl.SSLError, OSError) as exc:
                self.close()
                raise PeerUnavailable(f"connection to {self.peer} broke: {exc}") from exc
            else:
                return int(result) if result is not None else 0

    async def _wait(self, wait: Callable[[ssl.SSLSocket], Awaitable[None]]) -> None:
        try:
            await wait(self._sock)
        except trio.ClosedResourceError as exc:  # another task closed the connection while we waited
            raise PeerUnavailable(f"connection to {self.peer} is closed") from exc

    def _sent(self, n: int) -> None:
        self.bytes_sent += n
        if self.traffic is not None:
            self.traffic.add(sent=n)

    def _received(self, n: int) -> None:
        self.bytes_received += n
        if self.traffic is not None:
            self.traffic.add(received=n)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send every byte of ``data``. A cancelled send closes the socket."""
        view = memoryview(data)
        limit = None if self.throttle is None else self.throttle.upload
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            while view:
                if limit is not None:  # reserve the piece before it goes (shared.net.ratelimit)
                    piece = view[: limit.quantum]
                    await limit.acquire(len(piece))
                    while piece:
                        n = await self._retry(self._sock.send, piece)
                        piece = piece[n:]
                        view = view[n:]
                        self._sent(n)
                    continue
                n = await self._retry(self._sock.send, view)
                view = view[n:]
                self._sent(n)
        except trio.Cancelled:
            self.close()
            raise

    async def receive_into(self, buffer: memoryview) -> int:
        """Receive up to ``len(buffer)`` bytes; 0 means the peer closed the connection."""
        limit = None if self.throttle is None else self.throttle.download
        if limit is None:
            await trio.lowlevel.checkpoint_if_cancelled()
            n = await self._retry(self._sock.recv_into, buffer, len(buffer))
        else:  # wait out the debt, read at most a quantum, charge it (shared.net.ratelimit)
            await limit.wait_ready()
            await trio.lowlevel.checkpoint_if_cancelled()
            n = await self._retry(self._sock.recv_into, buffer, min(len(buffer), limit.quantum))
            limit.charge(n)
        self._received(n)
        return n

    def send_all_blocking(self, data: bytes | bytearray | memoryview, stall: float) -> None:
        """From a worker thread that owns the socket: send all of ``data``.

        ``stall`` bounds the time any single send may make no progress.
        """
        self._sock.settimeout(stall)
        try:
            view = memoryview(data)
            while view:
                n = self._sock.send(view[: 1 << 24])
                view = view[n:]
                self._sent(n)
        except (ssl.SSLError, OSError) as exc:
            raise PeerUnavailable(f"bulk send to {self.peer} failed: {exc}") from exc
        finally:
            self._restore_nonblocking()

    def recv_into_blocking(self, buffer: memoryview, stall: float) -> None:
        """From a worker thread that owns the socket: fill all of ``buffer``."""
        self._sock.settimeout(stall)
        try:
            view = buffer
            while view:
                n = self._sock.recv_into(view, len(view))
                if n == 0:
                    raise PeerUnavailable(f"{self.peer} closed the connection mid-transfer")
                view = view[n:]
                self._received(n)
        except (ssl.SSLError, OSError) as exc:
            raise PeerUnavailable(f"bulk receive from {self.peer} failed: {exc}") from exc
        finally:
            self._restore_nonblocking()

    def _restore_nonblocking(self) -> None:
        if not self._closed:
            with contextlib.suppress(OSError):
                self._sock.setblocking(False)

    def shutdown(self) -> None:
        """Make any operation in progress on the socket (in any thread) fail soon; the fd stays open.

        The socket counts as closed from now on (:meth:`close` does nothing), but the fd is closed only by
        the worker thread that still uses it, in :meth:`close_from_thread`, so its number cannot be reused
        by a new connection under that thread's feet.
        """
        if not self._closed:
            self._closed = True
            self._worker_closes = True
            with contextlib.suppress(OSError):
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)

    def hang_up(self) -> None:
        """End the connection both ways at once, as the kernel does for a process that died: the peer
        sees it end, and operations in progress here fail. Closing stays with whoever owns the socket."""
        if not self._closed:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)

    async def wait_readable(self) -> None:
        """Return once bytes or the peer's close are waiting (or the socket is closed here)."""
        if self._closed or self._sock.pending() > 0:
            return
        with contextlib.suppress(trio.ClosedResourceError, OSError, ValueError):
            await trio.lowlevel.wait_readable(self._sock)

    def close_from_thread(self) -> None:
        """Close from a worker thread that owned the socket (trio is not waiting on it)."""
        if not self._closed or self._worker_closes:
            self._closed = True
            self._worker_closes = False
            self._sock.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._sock)
        self._sock.close()


class BufferedReceiver:
    """Reads exact byte counts from a :class:`TlsSocket` through one reusable buffer."""

    def __init__(self, tls: TlsSocket, size: int = _RECV_CHUNK) -> None:
        self._tls = tls
        self._buf = bytearray(size)
        self._start = 0
        self._end = 0

    async def read_exactly(self, n: int) -> bytes:
        """Return the next ``n`` bytes.

        Raises:
            EOFError: the peer closed the connection cleanly before any byte of this read.
            PeerUnavailable: the connection broke, or closed in the middle of the ``n`` bytes.
        """
        if n > len(self._buf):
            # Grow with what arrives, never by what was announced: a peer that announces a large frame
            # and sends nothing costs no memory.
            out = bytearray(self._buf[self._start : self._end])
            self._start = self._end = 0
            chunk = memoryview(self._buf)
            while len(out) < n:
                got = await self._tls.receive_into(chunk[: min(n - len(out), len(chunk))])
                if got == 0:
                    raise PeerUnavailable(f"{self._tls.peer} closed the connection mid-message")
                out += chunk[:got]
            return bytes(out)
        while self._end - self._start < n:
            if self._start + n > len(self._buf):
                self._buf[: self._end - self._start] = self._buf[self._start : self._end]
                self._end -= self._start
                self._start = 0
            got = await self._tls.receive_into(memoryview(self._buf)[self._end :])
            if got == 0:
                if self._end == self._start:
                    raise EOFError
                raise PeerUnavailable(f"{self._tls.peer} closed the connection mid-message")
            self._end += got
        out_bytes = bytes(self._buf[self._start : self._start + n])
        self._start += n
        return out_bytes

    def take_buffered(self, limit: int) -> bytes:
        """Hand over up to ``limit`` already-received bytes (used when switching to raw bulk reads)."""
        n = min(limit, self._end - self._start)
        out = bytes(self._buf[self._start : self._start + n])
        self._start += n
        return out
