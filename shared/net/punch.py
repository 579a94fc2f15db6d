"""Hole punching (issue 14 item 8): two peers connected through a relay upgrade to a direct connection.

The exchange is DCUtR's, carried on the relayed, authenticated RPC connection (see
:mod:`protocols.relay` for the messages). Each side:

1. picks a local port: a socket with ``SO_REUSEADDR`` and ``SO_REUSEPORT`` bound to ``(bind_host, 0)``;
2. learns the ``ip:port`` that port appears from outside by asking its relay over that very socket
   (:func:`shared.net.relay.observe_address`; the relay closes it after answering, so the port's NAT
   mapping now exists and the port is free to bind again);
3. ``A`` (the peer that calls :meth:`HolePuncher.punch`) sends ``PunchConnect{observed_a}``, ``B`` answers
   ``PunchReply{observed_b}``; ``A`` times that exchange as ``rtt``, sends ``PunchSync`` and waits
   ``rtt / 2``, so that both SYNs leave at about the same time (``B`` connects as soon as the sync arrives,
   half a round trip after it was sent);
4. both connect *from their chosen port* to the other's observed address: the two SYNs cross, each NAT
   sees the other's SYN as the reply to its own and lets it in (a simultaneous TCP open). A connect that
   fails at once (reset, refused: the other SYN was not out yet) is retried from the same port after
   ``retry_pause``, until ``timeout``;
5. on the connected socket one side runs the TLS client handshake (:func:`shared.net.connection.dial`,
   expecting the other's peer id), the other the server side (:func:`shared.net.connection.accept`, which
   must prove the expected peer id, else the connection is closed). For the RPC lane the client is the
   peer with the lower peer id (as a string), and the new connection (``via="punched"``) becomes the
   peer's RPC channel on both sides (:meth:`shared.net.host.Host.adopt_connection`); the relayed one is
   closed once idle.

Bulk lanes. Once a peer's RPC connection is punched, the puncher is the host's ``bulk_upgrader``: a transfer
that needs a new bulk connection to that peer punches one more (``lane="bulk"``; ``A``, the sender, is the
TLS client, since a bulk lane carries transfers from its dialer) and the host pools it like any other; if
that punch fails the transfer dials the relayed address as before.

``B`` takes part only where a punch makes sense: an RPC punch from a peer whose connection to it is
relayed, a bulk punch from one whose connection is already punched (else ``FORBIDDEN``), so no peer can
make it send SYNs to an address of the peer's choosing otherwise; retries after an immediate failure are
``retry_pause`` apart. ``A`` runs one punch at a time per peer.

A failure at any step (symmetric NAT: the observed port is not the one a new destination gets, so the
SYNs are dropped; a timeout; a refused step) leaves the relayed connection in place and is counted in
:class:`PunchStatistics` with its reason.

Waits are bounded: every step runs under ``timeout`` (plus one RPC deadline for the exchange), and the
``B`` side forgets a ``PunchConnect`` that no ``PunchSync`` followed within ``timeout``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from protocols.codes import ErrorCode
from protocols.handshake import Lane
from protocols.peer_id import PeerId
from protocols.relay import PunchConnect, PunchReply, PunchSync

from ..errors import HandshakeError, PeerUnavailable, RemoteError, remote_error
from .addresses import PeerAddress
from .connection import SecureConnection, accept, dial
from .relay import observe_address

if TYPE_CHECKING:
    from .host import Host
    from .rpc import RequestContext

__all__ = ["HolePuncher", "PunchStatistics", "bound_socket", "split_host_port"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PunchStatistics:
    attempts: int  # punches this side took part in (either role)
    punched: int  # ... that gave a direct connection
    failures: dict[str, int] = field(default_factory=dict)  # ... that did not, by reason
    last_ms: float | None = None  # how long the last successful punch took on this side


def bound_socket(bind_host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket bound to ``(bind_host, port)`` with address and port reuse."""
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if sys.platform != "win32":  # Windows has no SO_REUSEPORT: no simultaneous open, links stay relayed
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((bind_host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def split_host_port(text: str) -> tuple[str, int]:
    """``"1.2.3.4:5"`` (or ``"[::1]:5"``) as ``("1.2.3.4", 5)``.

    Raises:
        ValueError: not ``host:port`` with a port in 1..65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not an ip:port: {text!r}")
    return host.strip("[]"), int(port)


class _Plan:
    __slots__ = ("deadline", "lane", "observed", "port")

    def __init__(self, port: int, observed: tuple[str, int], deadline: float, lane: Lane) -> None:
        self.port = port
        self.observed = observed
        self.deadline = deadline
        self.lane = lane


class HolePuncher:
    """Punches on ``host`` using ``relay`` (an address with peer id that runs a relay) to learn our
    external address; registers the ``punch.*`` handlers at construction."""

    def __init__(
        self,
        host: Host,
        relay: PeerAddress,
        *,
        timeout: float = 5.0,
        bind_host: str = "0.0.0.0",
        retry_pause: float = 0.2,
    ) -> None:
        self.host = host
        self.relay = relay
        self.timeout = timeout
        self.bind_host = bind_host
        self.retry_pause = retry_pause
        self._plans: dict[PeerId, _Plan] = {}
        self._locks: dict[PeerId, trio.Lock] = {}  # one punch at a time per peer that we start
        self._attempts = self._punched = 0
        self._failures: Counter[str] = Counter()
        self._last_ms: float | None = None
        #: set per peer when a punch involving it ended on this side (either role, either outcome)
        self.finished: dict[PeerId, trio.Event] = {}
        host.registry.add(PunchConnect, self._on_connect)
        host.registry.add_notification(PunchSync, self._on_sync)
        host.bulk_upgrader = self._bulk_for

    def statistics(self) -> PunchStatistics:
        return PunchStatistics(self._attempts, self._punched, dict(self._failures), self._last_ms)

    async def _observe(self) -> tuple[int, tuple[str, int]]:
        sock = bound_socket(self.bind_host, 0)
        port = sock.getsockname()[1]
        with trio.fail_after(self.timeout):
            observed = await observe_address(self.relay, sock)
        try:
            return port, split_host_port(observed)
        except ValueError as exc:
            raise PeerUnavailable(f"relay {self.relay} reported {observed!r}") from exc

    # ---------------------------------------------------------------- A: the side that starts

    async def punch(self, peer: PeerId) -> bool:
        """Try to replace our (relayed) RPC connection to ``peer`` by a direct one; ``True`` on success.

        Raises:
            PeerUnavailable: we have no RPC connection to ``peer`` to coordinate over.
        """
        return await self._punch(peer, "rpc") is not None

    async def _bulk_for(self, peer: PeerId) -> SecureConnection | None:
        """A punched bulk connection to ``peer`` if its RPC connection is punched and this punch works."""
        if self.host.connection_kind(peer) != "punched":
            return None
        with contextlib.suppress(PeerUnavailable):
            return await self._punch(peer, "bulk")
        return None

    async def _punch(self, peer: PeerId, lane: Lane) -> SecureConnection | None:
        lock = self._locks.setdefault(peer, trio.Lock())
        try:
            async with lock:
                return await self._punch_locked(peer, lane)
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._locks.pop(peer, None)

    async def _punch_locked(self, peer: PeerId, lane: Lane) -> SecureConnection | None:
        channel = self.host.channel_for(peer)
        if channel is None:
            raise PeerUnavailable(f"no connection to {peer} to coordinate a hole punch over")
        self._attempts += 1
        started = trio.current_time()
        self.finished[peer] = event = trio.Event()
        try:
            port, observed = await self._observe()
            sent = trio.current_time()
            with trio.fail_after(self.timeout):
                reply = await channel.call(PunchConnect(observed=_text(observed), lane=lane))
            rtt = trio.current_time() - sent
            assert isinstance(reply, PunchReply)
            remote = split_host_port(reply.observed)
            await channel.notify(PunchSync())
            await trio.sleep(rtt / 2)
            conn = await self._connect(peer, port, remote, started, lane, initiator=True)
        except (PeerUnavailable, RemoteError, HandshakeError, trio.TooSlowError, OSError, ValueError) as exc:
            self._failed(peer, exc)
            return None
        finally:
            event.set()
        if lane == "rpc":
            self.host.adopt_connection(conn)
        return conn

    # ---------------------------------------------------------------- B: the side that answers

    async def _on_connect(self, ctx: RequestContext, request: PunchConnect) -> PunchReply:
        kind = self.host.connection_kind(ctx.peer_id)
        if (request.lane, kind) not in (("rpc", "relayed"), ("bulk", "punched")):
            # anything else would let any peer make us send SYNs to an address of its choice
            raise remote_error(ErrorCode.FORBIDDEN, f"no {request.lane} punch over a {kind} connection")
        try:
            remote = split_host_port(request.observed)
            port, observed = await self._observe()
        except (ValueError, PeerUnavailable, trio.TooSlowError, OSError) as exc:
            raise remote_error(ErrorCode.INTERNAL, f"cannot take part in a hole punch: {exc}") from exc
        self._plans[ctx.peer_id] = _Plan(port, remote, trio.current_time() + self.timeout, request.lane)
        return PunchReply(observed=_text(observed))

    async def _on_sync(self, ctx: RequestContext, _: PunchSync) -> None:
        plan = self._plans.pop(ctx.peer_id, None)
        now = trio.current_time()
        for peer in [p for p, stale in self._plans.items() if stale.deadline < now]:
            del self._plans[peer]
        if plan is None or plan.deadline < now:
            return
        self._attempts += 1
        self.finished[ctx.peer_id] = trio.Event()
        self.host._require_running().start_soon(self._answer, ctx.peer_id, plan, now)

    async def _answer(self, peer: PeerId, plan: _Plan, started: float) -> None:
        try:
            conn = await self._connect(peer, plan.port, plan.observed, started, plan.lane, initiator=False)
        except (PeerUnavailable, RemoteError, HandshakeError, trio.TooSlowError, OSError) as exc:
            self._failed(peer, exc)
            return
        finally:
            self.finished[peer].set()
        if plan.lane == "rpc":
            self.host.adopt_connection(conn)
        else:
            await self.host.serve_connection(conn)

    # ---------------------------------------------------------------- both

    def _failed(self, peer: PeerId, exc: BaseException) -> None:
        reason = "timeout" if isinstance(exc, trio.TooSlowError) else type(exc).__name__
        self._failures[reason] += 1
        logger.info("hole punch with %s failed (%s: %s); staying relayed", peer, reason, exc)

    async def _connect(
        self, peer: PeerId, port: int, remote: tuple[str, int], started: float, lane: Lane, *, initiator: bool
    ) -> SecureConnection:
        client = self.host.peer_id < peer if lane == "rpc" else initiator
        with trio.fail_after(self.timeout):
            raw = await self._simultaneous_open(port, remote)
            label = f"{remote[0]}:{remote[1]}"
            conn: SecureConnection
            if client:
                conn = await dial(self.host.endpoint, PeerAddress(remote[0], remote[1], peer), lane, raw=raw)
            else:
                conn = await accept(self.host.endpoint, raw, label)
                if conn.remote_peer != peer:
                    conn.close()
                    raise HandshakeError(f"{label} proved to be {conn.remote_peer}, not {peer}")
                if conn.lane != lane:
                    conn.close()
                    raise HandshakeError(
                        f"{label} opened a {conn.lane} connection, not the {lane} one agreed"
                    )
        conn.via = "punched"
        self._punched += 1
        self._last_ms = (trio.current_time() - started) * 1000
        logger.info("hole punched a %s connection to %s at %s in %.0f ms", lane, peer, label, self._last_ms)
        return conn

    async def _simultaneous_open(self, port: int, remote: tuple[str, int]) -> socket.socket:
        """Connect from ``port`` to ``remote`` until it works (the caller bounds the time)."""
        while True:
            sock = bound_socket(self.bind_host, port)
            try:
                code = sock.connect_ex(remote)
                if code == errno.EINPROGRESS:
                    await trio.lowlevel.wait_writable(sock)
                    code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code == 0:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    return sock
            except BaseException:
                trio.lowlevel.notify_closing(sock)
                sock.close()
                raise
            trio.lowlevel.notify_closing(sock)
            sock.close()
            logger.debug(
                "punch connect to %s from port %d: %s; retrying", remote, port, errno.errorcode.get(code)
            )
            await trio.sleep(self.retry_pause)


def _text(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
