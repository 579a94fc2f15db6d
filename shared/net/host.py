"""The node's network presence: listeners, a connection pool, RPC dispatch and the bulk data plane.

One :class:`Host` per node. It owns every connection task in its own nursery (started by :meth:`run`),
so leaving the ``run`` scope closes every connection; nothing outlives it.

Pooling: at most one RPC connection per peer is used for outgoing calls (either direction's: a
connection the peer opened to us is reused for our calls to it). Concurrent calls to a peer we are not
connected to share one dial. Bulk connections are pooled separately per peer and checked out by one
transfer at a time.

**Budgets before authentication** (DESIGN D10a). Anyone can open a TCP connection, so before a
connection's peer has proven its identity it is held to small, configurable budgets (:class:`HostConfig`):

* per connection: ``HANDSHAKE_FRAME_BYTES`` of frames (:mod:`protocols.envelope`), and
  ``accept_deadline`` seconds to finish TLS and the identity proof;
* per source address (an IPv4 address or an IPv6 /64): at most ``max_pending_per_address`` connections
  still in the handshake and ``max_incoming_per_address`` accepted connections in all; host-wide,
  ``max_pending`` connections in the handshake and ``max_incoming`` in all. A connection over any
  budget is closed at ``accept()``, before TLS, and counted (``connections_refused``). So one address
  cannot take more than its share of ``max_incoming``, and strangers still in the handshake cannot take
  more than ``max_pending``:
  admitted peers coming from elsewhere still get in.

Idle connections of every kind are reaped after ``idle_timeout``: RPC connections with no traffic,
accepted bulk lanes waiting for their next header, and our own pooled idle bulk connections.

**Faults end a connection, never the host** (DESIGN D10f): a decoding failure is a ``ProtocolError``
that ends one request or connection; anything unexpected while serving one connection is logged with
its traceback and counted (``connection_failures``). Dialing follows :mod:`shared.net.dialing`.

**Advertised addresses.** ``listen_addrs`` are where the listeners are bound (a listener on ``0.0.0.0``
expands to every interface, loopback included); ``advertised_addrs`` are what this node tells others
(its identity proof's ``listen_addrs``, which become its DHT contact): by default the same less loopback
ones when there are others (a loopback address serves only this machine, which can use the others too),
and after :meth:`Host.advertise` only what a reachability check proved others can dial (none: client
mode; :mod:`shared.net.reachability`).

**Connection reversal** (:mod:`protocols.reversal`). A bulk transfer to :meth:`PeerAddress.dial_back
<shared.net.addresses.PeerAddress.dial_back>` asks that peer, over the RPC connection it opened to us, to
dial us a ``"reverse"`` lane, and runs on it; the other way round, this host answers such requests from
peers it dialed itself, dialing back the address it dialed, and serves the lane with its bulk handlers.

**Relayed addresses** (:mod:`shared.net.relay`): dialing an address with a ``relay`` asks that relay for a
circuit and runs the usual TLS + identity handshake through it, so every service works over relayed
addresses unchanged. A host serving as a relay sets :attr:`Host.preamble_handler`: its accept path then
peeks at an incoming connection's first byte and hands relay preambles (never a TLS record) to it.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import trio

from protocols.codes import ErrorCode
from protocols.envelope import Message, Request
from protocols.errors import ProtocolError
from protocols.handshake import Lane
from protocols.peer_id import PeerId
from protocols.reversal import MAX_PENDING_DIAL_BACKS, DialBackReply, DialBackRequest

from ..auth.guard import Authenticator, OpenAuthenticator
from ..auth.keys import Identity
from ..errors import AuthError, ConfigError, HandshakeError, PeerIdMismatch, PeerUnavailable, RemoteError
from .addresses import PeerAddress, expand_unspecified, format_multiaddr, parse_multiaddr
from .bulk import BulkHandler, ReplySink, send_bulk, serve_bulk_lane
from .connection import LocalEndpoint, SecureConnection, accept, dial
from .dialing import DialGuard, DialPolicy
from .ratelimit import Throttle
from .relay import PREAMBLE_FIRST_BYTE, PreambleHandler, relay_dial
from .relaytraffic import RelayTraffic
from .rpc import HandlerRegistry, RequestContext, RpcChannel, RpcStatistics

__all__ = ["CALL_FAILURES", "Host", "HostConfig", "HostStatistics"]

logger = logging.getLogger(__name__)

#: Everything a call to another peer may fail with, for callers that treat every failure alike. An
#: answer we refuse (AuthError: not an admitted peer, revoked) counts as no answer at all.
CALL_FAILURES = (PeerUnavailable, HandshakeError, RemoteError, ProtocolError, AuthError, trio.TooSlowError)

#: accept() errors that mean "the system is overloaded", not "the listener is broken" (as in trio).
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


@dataclass(frozen=True)
class HostConfig:
    """Tunables of the network engine. The defaults suit the Internet; tests may shorten them."""

    dial_deadline: float = 5.0  # TCP connect + TLS + identity proof, outgoing
    accept_deadline: float = 5.0  # the same, incoming (a silent dialer is dropped after this)
    max_inflight: int = 128  # requests served concurrently per connection before OVERLOADED
    max_inflight_bytes: int = 32 * 1024 * 1024  # ... and the bytes their frames may hold
    handler_deadline: float = 30.0  # a handler running longer is answered INTERNAL
    bulk_stall: float = 30.0  # a bulk transfer making no progress this long fails
    max_idle_bulk: int = 8  # idle bulk connections kept per peer
    max_incoming: int = 4096  # accepted connections open at once; more are refused at accept()
    idle_timeout: float = (
        300.0  # a connection (RPC or bulk, either side's) with no traffic this long is closed
    )
    max_pending: int = 256  # accepted connections still in the handshake, host-wide
    max_pending_per_address: int = 16  # ... from one source IP
    max_incoming_per_address: int = 256  # accepted connections from one source IP (NATs share IPs)
    redial_after_failure: float = 0.5  # back-off after a failed dial of a target, doubling per failure
    max_redial_backoff: float = 8.0
    identity_block: float = 600.0  # a target that failed the identity check is not redialed this long
    bulk_backoff_wait: float = 1.0  # a bulk dial of a known peer waits out a back-off this short (dialing)
    max_upload_bps: float | None = None  # cap on all this node's sending, bytes/s (shared.net.ratelimit)
    max_download_bps: float | None = None  # ... and on its receiving; None: not capped


@dataclass(frozen=True)
class HostStatistics:
    peers_connected: int
    rpc_connections: int
    idle_bulk_connections: int
    calls_sent: int
    calls_failed: int
    requests_served: int
    bytes_sent: int  # over every connection of the host, RPC and bulk lanes (TLS plaintext)
    bytes_received: int
    connections_refused: int = 0  # closed at accept(): over a global or per-address budget
    handshakes_failed: int = 0  # incoming connections that did not complete the identity proof
    protocol_errors: int = 0  # malformed frames and messages received
    connection_failures: int = 0  # connections ended by an unexpected error (logged with a traceback)
    dials_refused: int = 0  # dials not attempted: target in back-off or failed its identity check
    dial_backs: int = 0  # reverse lanes we dialed (and served) for peers that cannot dial us
    reverse_lanes: int = 0  # ... and reverse lanes peers dialed back to us on our request (used)
    reverse_refused: int = 0  # dial-back requests refused, and reverse lanes nobody asked for
    incoming_connections: int = 0  # accepted connections open now (RPC and bulk, in the handshake or not)
    pending_connections: int = 0  # ... of which still in the handshake
    #: bytes of the RPC frames sent, by message kind, over every channel the host has had (bulk lanes'
    #: payloads are not RPC frames: ``bytes_sent`` less these is roughly the bulk traffic)
    rpc_sent_by_kind: dict[str, int] = field(default_factory=dict)


class Host:
    """A node's endpoint on the network. Call :meth:`run` (via ``nursery.start``) before anything else."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        config: HostConfig | None = None,
        authenticator: Authenticator | None = None,
    ) -> None:
        self.endpoint = LocalEndpoint(identity, run_id)
        self.config = config or HostConfig()
        self.endpoint.throttle = Throttle.from_rates(self.config.max_upload_bps, self.config.max_download_bps)
        self.authenticator: Authenticator = authenticator or OpenAuthenticator()
        self.registry = HandlerRegistry()
        self.bulk_handlers: dict[str, BulkHandler] = {}
        self.listen_addrs: list[str] = []
        #: what we tell others about where we can be reached (module docstring); None: ``listen_addrs``
        self._advertised: list[str] | None = None
        #: called with the peer id of every new RPC connection, either side's, once the peer proved its
        #: identity (not yet its admission: that is checked per request)
        self.connection_observers: list[Callable[[PeerId], None]] = []
        #: set by a relay (:class:`shared.net.relay.RelayService`): takes incoming relay preambles
        self.preamble_handler: PreambleHandler | None = None
        #: set by :class:`shared.net.punch.HolePuncher`: a direct bulk connection to a peer we would
        #: otherwise reach through a relay, or ``None`` (then the relay is used)
        self.bulk_upgrader: Callable[[PeerId], Awaitable[SecureConnection | None]] | None = None
        #: bytes received through relays' circuits, per relay (the ledger's evidence of their relaying)
        self.relay_traffic = RelayTraffic()
        self._channels: dict[PeerId, RpcChannel] = {}
        self._all_channels: set[RpcChannel] = set()
        self._by_address: dict[tuple[str, int], PeerId] = {}
        self._dial_locks: dict[object, trio.Lock] = {}
        self._idle_bulk: dict[PeerId, list[SecureConnection]] = {}
        self._accepted: set[SecureConnection] = set()  # authenticated incoming connections, open now
        self._busy_bulk: set[SecureConnection] = set()  # our bulk connections checked out by a transfer
        self._preambled: set[socket.socket] = set()  # raw sockets a relay's preamble handler holds
        self._nursery: trio.Nursery | None = None
        self._listeners: list[socket.socket] = []
        self._aborted = False
        self._stopped = False
        self._incoming = 0
        self._pending = 0
        self._incoming_by_address: dict[str, int] = {}
        self._pending_by_address: dict[str, int] = {}
        self._warned_full = False
        self._closed_stats = [0, 0, 0, 0, 0, 0, 0]
        self._sent_by_kind: Counter[str] = Counter()  # every channel's (shared.net.rpc, "Traffic by kind")
        self._refused = self._handshakes_failed = self._failures = self._protocol_errors = 0
        self._dial_guard = DialGuard(
            DialPolicy(
                self.config.redial_after_failure, self.config.max_redial_backoff, self.config.identity_block
            )
        )
        #: our outstanding dial-back requests, per peer: the channels their reverse lanes go to, oldest first
        self._reverse_waiters: dict[PeerId, list[trio.MemorySendChannel[SecureConnection]]] = {}
        self._backoff_waits: dict[tuple[str, int], trio.Lock] = {}  # bulk dials waiting out a back-off
        self._dial_backs_running: dict[str, int] = {}
        self._reversal_counts = [0, 0, 0]  # dial_backs, reverse_lanes, reverse_refused
        self.registry.add(DialBackRequest, self._on_dial_back)

    @property
    def peer_id(self) -> PeerId:
        return self.endpoint.peer_id

    @property
    def run_id(self) -> str:
        return self.endpoint.run_id

    @property
    def advertised_addrs(self) -> list[str]:
        """Where we tell others we can be reached (module docstring); empty: client mode."""
        if self._advertised is not None:
            return list(self._advertised)
        routable = [a for a in self.listen_addrs if not _is_loopback(a)]
        return routable or list(self.listen_addrs)

    def advertise(self, addrs: Sequence[str]) -> None:
        """Tell others only ``addrs`` from now on (none: we accept no connections they could open).

        Raises:
            ConfigError: an address is not a multiaddr.
        """
        for text in addrs:
            parse_multiaddr(text)
        self._advertised = list(dict.fromkeys(addrs))
        self.endpoint.listen_addrs[:] = self._advertised

    # ---------------------------------------------------------------- lifecycle

    async def run(
        self,
        listen: Sequence[PeerAddress | str] = ("/ip4/127.0.0.1/tcp/0",),
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``listen`` (none: a client-mode node) and serve until cancelled.

        Raises:
            ConfigError: an address cannot be listened on (in use, not local, malformed).
        """
        listeners: list[tuple[socket.socket, PeerAddress]] = []
        self._listeners = []
        try:
            for item in listen:
                address = parse_multiaddr(item) if isinstance(item, str) else item
                listeners.append(_bind(address))
                self._listeners.append(listeners[-1][0])
            for sock, address in listeners:
                port = sock.getsockname()[1]
                for host in expand_unspecified(address.host):
                    self.listen_addrs.append(format_multiaddr(host, port, self.peer_id))
            self.endpoint.listen_addrs[:] = self.advertised_addrs
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for sock in self._listeners:
                    nursery.start_soon(self._accept_loop, sock, nursery)
                nursery.start_soon(self._reap_idle)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self._stopped = True
            self._close_everything()

    def _close_everything(self) -> None:
        for sock in self._listeners:
            if sock.fileno() != -1:
                trio.lowlevel.notify_closing(sock)
                sock.close()
        for channel in list(self._all_channels):
            channel.conn.close()
        for lanes in self._idle_bulk.values():
            for lane in lanes:
                lane.close()
        self._idle_bulk.clear()
        # connections in use: hung up now, closed by the task using them (a bulk thread may hold one)
        for conn in [*self._accepted, *self._busy_bulk]:
            conn.tls.hang_up()
        for raw in self._preambled:  # a relay's circuits end with it
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_RDWR)

    def _require_running(self) -> trio.Nursery:
        if self._nursery is None:
            if self._stopped:
                raise PeerUnavailable("this host has stopped")
            raise RuntimeError("Host.run() has not been started")
        if self._aborted:
            raise PeerUnavailable("this host has been aborted")
        return self._nursery

    def abort(self) -> None:
        """Drop off the network at once, as a crash would: close listeners and every connection (the ones
        peers opened to us and the ones in use by a transfer included), refuse new dials. Peers see
        connections reset, with no goodbye. ``run`` still has to be cancelled."""
        self._aborted = True
        self._close_everything()

    async def _accept_loop(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        while True:
            if listener.fileno() == -1:
                return  # closed by abort() (possibly before this task first ran)
            try:
                await trio.lowlevel.wait_readable(listener)
            except trio.ClosedResourceError:
                return  # closed by abort() while we waited
            if listener.fileno() == -1:
                return  # closed by abort() after a connection woke us, before this task ran again
            try:
                raw, addr = listener.accept()
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno in _ACCEPT_CAPACITY_ERRNOS:
                    logger.error("accept() failed (%s); retrying in 0.1 s", exc.strerror)
                    await trio.sleep(0.1)
                    continue
                raise
            ip = _budget_key(str(addr[0]))
            refusal = self._over_budget(ip)
            if refusal is not None:
                self._refused += 1
                if not self._warned_full:
                    logger.warning("refusing connections: %s", refusal)
                    self._warned_full = True
                raw.close()
                continue
            self._warned_full = False
            self._incoming += 1
            self._pending += 1
            self._incoming_by_address[ip] = self._incoming_by_address.get(ip, 0) + 1
            self._pending_by_address[ip] = self._pending_by_address.get(ip, 0) + 1
            nursery.start_soon(self._serve_incoming, raw, ip, f"{addr[0]}:{addr[1]}")

    def _over_budget(self, ip: str) -> str | None:
        """Why one more incoming connection from ``ip`` must be refused, or ``None``."""
        config = self.config
        if self._incoming >= config.max_incoming:
            return f"{self._incoming} incoming connections already open"
        if self._pending >= config.max_pending:
            return f"{self._pending} connections already in the handshake"
        if self._incoming_by_address.get(ip, 0) >= config.max_incoming_per_address:
            return f"{config.max_incoming_per_address} connections from {ip} already open"
        if self._pending_by_address.get(ip, 0) >= config.max_pending_per_address:
            return f"{config.max_pending_per_address} connections from {ip} already in the handshake"
        return None

    def _handshake_done(self, ip: str) -> None:
        self._pending -= 1
        _decrement(self._pending_by_address, ip)

    async def serve_socket(
        self, raw: socket.socket, peer: str, via: str, relay: PeerId | None = None
    ) -> None:
        """Serve ``raw``, a TCP socket this host connected itself (a relay circuit's target end, a punched
        connection), as if it had been accepted: TLS server side, identity proof, then RPC or bulk as the
        dialer chose. Counted in the incoming budgets under ``peer``'s host; returns when it closes. What
        it receives is counted in :attr:`relay_traffic` under ``relay`` (the circuit's relay), if given."""
        ip = _budget_key(peer.rpartition(":")[0].strip("[]"))
        refusal = self._over_budget(ip)
        if refusal is not None:
            self._refused += 1
            raw.close()
            raise PeerUnavailable(f"not serving a {via} connection: {refusal}")
        self._incoming += 1
        self._pending += 1
        self._incoming_by_address[ip] = self._incoming_by_address.get(ip, 0) + 1
        self._pending_by_address[ip] = self._pending_by_address.get(ip, 0) + 1
        await self._serve_incoming(raw, ip, peer, via, relay)

    async def _serve_incoming(
        self, raw: socket.socket, ip: str, peer: str, via: str = "direct", relay: PeerId | None = None
    ) -> None:
        pending = [True]
        try:
            await self._serve_incoming_counted(raw, ip, peer, pending, via, relay)
        except ProtocolError as exc:
            self._protocol_errors += 1
            logger.warning("closed connection from %s: %s", peer, exc)
        except Exception:
            self._failures += 1
            logger.exception("closed connection from %s after an unexpected error", peer)
        finally:
            raw.close()
            if pending[0]:
                self._handshake_done(ip)
            self._incoming -= 1
            _decrement(self._incoming_by_address, ip)

    async def _reap_idle(self) -> None:
        """Close RPC connections idle in both directions for ``idle_timeout``, and pooled bulk connections
        unused that long; peers redial on demand. (Accepted bulk lanes time out on their own.)"""
        period = self.config.idle_timeout / 4
        while True:
            await trio.sleep(period)
            cutoff = trio.current_time() - self.config.idle_timeout
            for channel in list(self._all_channels):
                if channel.last_activity < cutoff and channel.idle:
                    logger.debug("closing idle connection to %s", channel.peer_id)
                    channel.conn.close()
            for peer, lanes in list(self._idle_bulk.items()):  # closed by us, idle, or closed by the peer
                for lane in [
                    lane
                    for lane in lanes
                    if lane.last_used < cutoff or lane.tls.closed or lane.tls.readable_now()
                ]:
                    lanes.remove(lane)
                    lane.close()
                if not lanes:
                    del self._idle_bulk[peer]

    async def _serve_incoming_counted(
        self,
        raw: socket.socket,
        ip: str,
        peer: str,
        pending: list[bool],
        via: str = "direct",
        relay: PeerId | None = None,
    ) -> None:
        handler = self.preamble_handler
        if handler is not None and via == "direct":
            first = b""
            with trio.move_on_after(self.config.accept_deadline):
                first = await _peek_byte(raw)
            if not first:  # silent for accept_deadline, or closed
                self._handshakes_failed += 1
                return
            if first == PREAMBLE_FIRST_BYTE:

                def admitted() -> None:
                    if pending[0]:
                        pending[0] = False
                        self._handshake_done(ip)

                self._preambled.add(raw)
                try:
                    await handler(raw, peer, admitted)
                finally:
                    self._preambled.discard(raw)
                return
        try:
            with trio.fail_after(self.config.accept_deadline):
                conn = await accept(self.endpoint, raw, peer)
        except trio.TooSlowError:
            self._handshakes_failed += 1
            logger.info(
                "dropped connection from %s: no complete handshake within %.0f s",
                peer,
                self.config.accept_deadline,
            )
            return
        except (HandshakeError, ProtocolError, RemoteError) as exc:
            self._handshakes_failed += 1
            logger.warning("rejected connection from %s: %s", peer, exc)
            return
        except PeerUnavailable as exc:
            self._handshakes_failed += 1
            logger.info("connection from %s ended during the handshake: %s", peer, exc)
            return
        pending[0] = False
        self._handshake_done(ip)
        if conn.lane == "reverse":
            self._reverse_arrived(conn)
            return
        conn.via = via
        if relay is not None:
            self.relay_traffic.track(relay, conn.tls)
        await self.serve_connection(conn)

    async def serve_connection(self, conn: SecureConnection) -> None:
        """Serve an authenticated connection the peer opened (or, punched, that both opened) as its lane
        says: bulk transfers to our handlers, or an RPC channel (a punched one becomes the peer's channel
        for our calls). Closes it when it ends."""
        self._accepted.add(conn)
        try:
            if conn.lane == "bulk":
                await serve_bulk_lane(
                    conn,
                    self.bulk_handlers,
                    self.config.bulk_stall,
                    self.authenticator,
                    self.config.idle_timeout,
                )
            else:
                if conn.via == "punched":
                    self._replace_channel(conn.remote_peer)
                await self._run_channel(self._adopt(conn))
        finally:
            self._accepted.discard(conn)
            conn.close()

    # ---------------------------------------------------------------- RPC

    def _adopt(self, conn: SecureConnection) -> RpcChannel:
        channel = RpcChannel(
            conn,
            self.registry,
            max_inflight=self.config.max_inflight,
            handler_deadline=self.config.handler_deadline,
            authenticator=self.authenticator,
            max_inflight_bytes=self.config.max_inflight_bytes,
            sent_by_kind=self._sent_by_kind,
        )
        self._all_channels.add(channel)
        current = self._channels.get(channel.peer_id)
        if current is None or current.closed:
            self._channels[channel.peer_id] = channel
        for observer in self.connection_observers:
            observer(channel.peer_id)
        return channel

    async def _run_channel(self, channel: RpcChannel) -> None:
        try:
            await channel.run()
        finally:
            self._all_channels.discard(channel)
            if self._channels.get(channel.peer_id) is channel:
                del self._channels[channel.peer_id]
            stats = channel.statistics()
            for i, value in enumerate(_counted(stats)):
                self._closed_stats[i] += value

    async def connect(self, target: PeerAddress | str) -> PeerId:
        """Make sure an RPC connection to ``target`` exists; return the peer id it proved.

        Raises:
            ConfigError: ``target`` is a malformed multiaddr.
            PeerUnavailable, HandshakeError, RemoteError: see :func:`shared.net.connection.dial`.
        """
        address = parse_multiaddr(target) if isinstance(target, str) else target
        return (await self.channel_to(address)).peer_id

    async def channel_to(self, address: PeerAddress) -> RpcChannel:
        """A live RPC channel to ``address``'s peer: a pooled one, else one dial shared by all callers."""
        self._require_running()
        key: object = address.peer_id or (address.host, address.port)
        existing = self._live_channel(address)
        if existing is not None:
            return existing
        lock = self._dial_locks.setdefault(key, trio.Lock())
        try:
            async with lock:
                existing = self._live_channel(address)
                if existing is not None:
                    return existing
                conn = await self._dial(address, "rpc")
                try:
                    nursery = self._require_running()
                except PeerUnavailable:
                    conn.close()  # the host stopped while we were dialing
                    raise
                if address.relay is None:
                    self._by_address[(address.host, address.port)] = conn.remote_peer
                channel = self._adopt(conn)
                nursery.start_soon(self._run_channel, channel)
                return channel
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._dial_locks.pop(key, None)

    async def dial_fresh(self, address: PeerAddress) -> PeerId:
        """Open a *new* connection to ``address`` (never a pooled one), authenticate it, close it, and
        return the peer id it proved. Reachability probes use it: only a fresh dial shows that the peer
        accepts connections there. The bulk lane is used so the peer's RPC pool is left alone.

        Raises:
            PeerUnavailable: nobody answered within ``dial_deadline``, or the connection broke.
            HandshakeError, RemoteError, ProtocolError: see :func:`shared.net.connection.dial`.
        """
        self._require_running()
        conn = await self._dial(address, "bulk")
        conn.close()
        return conn.remote_peer

    async def _dial(self, address: PeerAddress, lane: Lane) -> SecureConnection:
        """Dial ``address`` within ``dial_deadline``, under the :class:`DialGuard`'s rules.

        Raises:
            PeerUnavailable: the target is in back-off or failed its identity check before, nobody
                answered, or the handshake did not complete in time.
            HandshakeError, RemoteError, ProtocolError: see :func:`shared.net.connection.dial`.
        """
        ours = address.relay is not None and address.relay.peer_id == self.peer_id  # we are its relay
        if address.is_dial_back or ours:  # reached only over its own connections (bulk: _dial_back)
            raise PeerUnavailable(f"{address} accepts no connections and has no RPC connection open to us")
        if address.relay is not None:  # backed off per relayed address, not per relay host:port
            key, now = str(address), trio.current_time()
            refusal = self._dial_guard.refusal(key, 0, None, now)
            if refusal is not None:
                raise PeerUnavailable(f"not dialing {address}: {refusal}")
            try:
                conn = await relay_dial(self, address, lane)
            except PeerUnavailable:
                self._dial_guard.failed(key, 0, trio.current_time())
                raise
            self._dial_guard.succeeded(key, 0)
            return conn
        guard, target = self._dial_guard, (address.host, address.port)
        refusal = guard.refusal(*target, address.peer_id, trio.current_time())
        left = guard.backoff_left(*target, trio.current_time())
        if (
            refusal is not None
            and lane == "bulk"
            and address.peer_id
            and 0 < left <= self.config.bulk_backoff_wait
        ):
            # a known peer in a short back-off: wait for its end, the waiters of a target dialing one at a
            # time, each after checking again (module docstring of .dialing)
            lock = self._backoff_waits.setdefault(target, trio.Lock())
            try:
                async with lock:
                    await trio.sleep(guard.backoff_left(*target, trio.current_time()))
                    refusal = guard.refusal(*target, address.peer_id, trio.current_time())
                    if refusal is None:
                        return await self._dial_direct(address, lane)
            finally:
                if not lock.locked() and lock.statistics().tasks_waiting == 0:
                    self._backoff_waits.pop(target, None)
        if refusal is not None:
            raise PeerUnavailable(f"not dialing {address}: {refusal}")
        return await self._dial_direct(address, lane)

    async def _dial_direct(self, address: PeerAddress, lane: Lane) -> SecureConnection:
        """Dial ``address`` (no relay) now, recording the outcome in the :class:`DialGuard`."""
        try:
            with trio.fail_after(self.config.dial_deadline):
                conn = await dial(self.endpoint, address, lane)
        except trio.TooSlowError as exc:
            self._dial_guard.failed(address.host, address.port, trio.current_time())
            raise PeerUnavailable(
                f"{address} did not complete a handshake within {self.config.dial_deadline} s"
            ) from exc
        except PeerUnavailable:
            self._dial_guard.failed(address.host, address.port, trio.current_time())
            raise
        except PeerIdMismatch:
            self._dial_guard.failed_identity(address.host, address.port, address.peer_id, trio.current_time())
            raise
        except (HandshakeError, RemoteError, ProtocolError):
            self._dial_guard.failed_identity(address.host, address.port, None, trio.current_time())
            raise
        self._dial_guard.succeeded(address.host, address.port)
        return conn

    def _live_channel(self, address: PeerAddress) -> RpcChannel | None:
        peer = address.peer_id or self._by_address.get((address.host, address.port))
        channel = self._channels.get(peer) if peer else None
        return channel if channel is not None and not channel.closed else None

    async def call(self, address: PeerAddress, request: Request) -> Message:
        """Send ``request`` to the peer at ``address`` and return its reply.

        Raises:
            PeerUnavailable: the peer cannot be reached or the connection broke.
            RemoteError: the peer answered with an error code.
            HandshakeError: the peer at that address is not who ``address`` says.
            ProtocolError: the reply is malformed.
        """
        channel = await self.channel_to(address)
        return await channel.call(request)

    async def notify(self, address: PeerAddress, message: Message) -> None:
        channel = await self.channel_to(address)
        await channel.notify(message)

    def connected_peers(self) -> list[PeerId]:
        return [peer for peer, channel in self._channels.items() if not channel.closed]

    def connection_kind(self, peer_id: PeerId) -> str | None:
        """How our RPC connection to ``peer_id`` travels: ``"direct"``, ``"relayed"`` or ``"punched"``
        (``None``: not connected)."""
        channel = self.channel_for(peer_id)
        return channel.conn.via if channel is not None else None

    def adopt_connection(self, conn: SecureConnection) -> RpcChannel:
        """Serve ``conn`` (an authenticated RPC connection this host set up itself, e.g. a punched one) and
        make it the channel our calls to its peer use from now on; the one it replaces is closed once idle.

        Raises:
            PeerUnavailable: the host has stopped.
        """
        nursery = self._require_running()
        self._replace_channel(conn.remote_peer)
        channel = self._adopt(conn)
        nursery.start_soon(self._run_channel, channel)
        return channel

    def _replace_channel(self, peer: PeerId) -> None:
        """Retire ``peer``'s current channel (closed once idle) so that the next one adopted is used."""
        old = self._channels.pop(peer, None)
        if old is not None and self._nursery is not None:
            self._nursery.start_soon(_close_when_idle, old, self.config.handler_deadline)

    def channel_for(self, peer_id: PeerId) -> RpcChannel | None:
        channel = self._channels.get(peer_id)
        return channel if channel is not None and not channel.closed else None

    def disconnect(self, peer_id: PeerId) -> None:
        """Close every connection to ``peer_id`` (used when it is known to be gone)."""
        for channel in list(self._all_channels):
            if channel.peer_id == peer_id:
                channel.conn.close()
        for lane in self._idle_bulk.pop(peer_id, []):
            lane.close()

    # ---------------------------------------------------------------- bulk

    async def send_bulk(
        self,
        address: PeerAddress,
        topic: str,
        data: memoryview | bytes,
        meta: bytes = b"",
        sink: ReplySink | None = None,
    ) -> bytes:
        """Send ``data`` to the bulk handler for ``topic`` at ``address``; return its ack meta.

        If the handler answers with a payload, ``sink(meta, nbytes)`` says where to put it.

        Raises:
            PeerUnavailable, HandshakeError, RemoteError: as for :meth:`call`.
        """
        conn = await self._checkout_bulk(address)
        ok = False
        self._busy_bulk.add(conn)
        try:
            ack = await send_bulk(
                conn, topic, memoryview(data), meta, self.config.bulk_stall, self.authenticator, sink
            )
            ok = True
            return ack
        finally:
            self._busy_bulk.discard(conn)
            idle = self._idle_bulk.setdefault(conn.remote_peer, [])
            if (
                ok
                and not conn.tls.closed
                and len(idle) < self.config.max_idle_bulk
                and self._nursery is not None
            ):
                conn.last_used = trio.current_time()
                idle.append(conn)
            else:
                conn.close()

    async def _checkout_bulk(self, address: PeerAddress) -> SecureConnection:
        peer = address.peer_id or self._by_address.get((address.host, address.port))
        idle = self._idle_bulk.get(peer, []) if peer else []
        while idle:
            conn = idle.pop()
            if not conn.tls.closed and not conn.tls.readable_now():
                return conn
            conn.close()  # the peer closed it (e.g. reaped it as idle) while it sat in our pool
        self._require_running()
        relay = address.relay
        if relay is not None and relay.peer_id == self.peer_id and address.peer_id is not None:
            address = PeerAddress.dial_back(address.peer_id)  # we are its relay: it holds a connection to us
        if address.is_dial_back:
            return await self._dial_back(address)
        if address.relay is not None and peer is not None and self.bulk_upgrader is not None:
            direct = await self.bulk_upgrader(peer)
            if direct is not None:
                return direct
        conn = await self._dial(address, "bulk")
        if address.relay is None:
            self._by_address[(address.host, address.port)] = conn.remote_peer
        return conn

    # ---------------------------------------------------------------- connection reversal

    async def _dial_back(self, address: PeerAddress) -> SecureConnection:
        """A reverse lane from ``address.peer_id``, dialed by it on our request (:mod:`protocols.reversal`).

        Raises:
            PeerUnavailable: it has no RPC connection to us, refused, could not dial, or its lane did not
                arrive within ``dial_deadline``.
        """
        peer = address.peer_id
        channel = self.channel_for(peer) if peer is not None else None
        if peer is None or channel is None:
            raise PeerUnavailable(f"{address}: it accepts no connections and has none open to us")
        send, receive = trio.open_memory_channel[SecureConnection](1)
        waiters = self._reverse_waiters.setdefault(peer, [])
        waiters.append(send)
        try:
            with trio.move_on_after(2 * self.config.dial_deadline):
                try:
                    reply = await channel.call(DialBackRequest())
                except (RemoteError, ProtocolError) as exc:
                    raise PeerUnavailable(f"{address} did not dial back: {exc}") from exc
                if not isinstance(reply, DialBackReply):
                    raise PeerUnavailable(f"{address} answered a dial-back request with {reply.kind}")
                conn = await receive.receive()
                self._reversal_counts[1] += 1
                return conn
            raise PeerUnavailable(f"{address} did not dial back within {2 * self.config.dial_deadline:.0f} s")
        finally:
            waiters.remove(send)
            if not waiters:
                self._reverse_waiters.pop(peer, None)
            send.close()
            while True:  # a lane that arrived just as we gave up is nobody's
                try:
                    receive.receive_nowait().close()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break

    def _reverse_arrived(self, conn: SecureConnection) -> None:
        """Hand an accepted reverse lane to the oldest dial-back waiting for its peer, or close it."""
        for send in self._reverse_waiters.get(conn.remote_peer, []):
            try:
                send.send_nowait(conn)
                return
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                continue  # that request already has its lane, or gave up
        self._reversal_counts[2] += 1
        logger.info("closed a reverse lane from %s that we did not ask for", conn.remote_peer)
        conn.close()

    async def _on_dial_back(self, ctx: RequestContext, request: DialBackRequest) -> DialBackReply:
        """Dial ``ctx.peer_id`` back where we dialed it, and serve the lane (its bulk requests)."""
        peer = ctx.peer_id
        channel = self.channel_for(peer)
        if channel is None or not channel.conn.initiator or not channel.conn.remote_addrs:
            self._reversal_counts[2] += 1
            raise RemoteError(ErrorCode.FORBIDDEN, "dial-backs go only to peers this node dialed: dial it")
        if self._dial_backs_running.get(peer, 0) >= MAX_PENDING_DIAL_BACKS:
            self._reversal_counts[2] += 1
            busy = f"{MAX_PENDING_DIAL_BACKS} dial-backs to you already running"
            raise RemoteError(ErrorCode.OVERLOADED, busy)
        self._dial_backs_running[peer] = self._dial_backs_running.get(peer, 0) + 1
        try:
            conn = await self._dial(parse_multiaddr(channel.conn.remote_addrs[0]).with_peer(peer), "reverse")
        finally:
            _decrement(self._dial_backs_running, peer)
        try:
            nursery = self._require_running()
        except PeerUnavailable:
            conn.close()
            raise
        self._reversal_counts[0] += 1
        nursery.start_soon(self._serve_reverse, conn)
        return DialBackReply()

    async def _serve_reverse(self, conn: SecureConnection) -> None:
        self._accepted.add(conn)  # hung up with the others when the host stops
        try:
            await serve_bulk_lane(
                conn, self.bulk_handlers, self.config.bulk_stall, self.authenticator, self.config.idle_timeout
            )
        except ProtocolError as exc:
            self._protocol_errors += 1
            logger.warning("closed the reverse lane to %s: %s", conn.remote_peer, exc)
        except Exception:
            self._failures += 1
            logger.exception("closed the reverse lane to %s after an unexpected error", conn.remote_peer)
        finally:
            self._accepted.discard(conn)
            conn.close()

    # ---------------------------------------------------------------- metrics

    def statistics(self) -> HostStatistics:
        totals = list(self._closed_stats)
        for channel in self._all_channels:
            for i, value in enumerate(_counted(channel.statistics())):
                totals[i] += value
        return HostStatistics(
            peers_connected=len(self.connected_peers()),
            rpc_connections=len(self._all_channels),
            idle_bulk_connections=sum(len(v) for v in self._idle_bulk.values()),
            calls_sent=totals[0],
            calls_failed=totals[1],
            requests_served=totals[2],
            bytes_sent=self.endpoint.traffic.sent,  # every connection: RPC and bulk lanes
            bytes_received=self.endpoint.traffic.received,
            connections_refused=self._refused,
            handshakes_failed=self._handshakes_failed,
            protocol_errors=self._protocol_errors + totals[5],
            connection_failures=self._failures + totals[6],
            dials_refused=self._dial_guard.refused,
            dial_backs=self._reversal_counts[0],
            reverse_lanes=self._reversal_counts[1],
            reverse_refused=self._reversal_counts[2],
            incoming_connections=self._incoming,
            pending_connections=self._pending,
            rpc_sent_by_kind=dict(self._sent_by_kind),
        )


def _counted(stats: RpcStatistics) -> tuple[int, ...]:
    return (
        stats.calls_sent,
        stats.calls_failed,
        stats.requests_served,
        stats.bytes_sent,
        stats.bytes_received,
        stats.protocol_errors,
        stats.failures,
    )


async def _close_when_idle(channel: RpcChannel, patience: float) -> None:
    """Close a replaced channel now if nothing is in flight on it, else after ``patience`` seconds (the
    longest a handler runs) unless it closed before."""
    if not channel.idle:
        with trio.move_on_after(patience):
            await channel.wait_closed()
    channel.conn.close()


async def _peek_byte(raw: socket.socket) -> bytes:
    """The first byte waiting on ``raw`` without consuming it (``b""``: the peer closed)."""
    while True:
        await trio.lowlevel.wait_readable(raw)
        try:
            return raw.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            continue
        except OSError:
            return b""


def _budget_key(host: str) -> str:
    """What a per-address budget counts by: an IPv4 address (IPv4-mapped ones included), or an IPv6 /64
    (one subscriber usually holds a whole /64, so per-/128 budgets would be no budgets at all)."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def _is_loopback(multiaddr: str) -> bool:
    try:
        return ipaddress.ip_address(parse_multiaddr(multiaddr).host).is_loopback
    except (ConfigError, ValueError):
        return False


def _decrement(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _bind(address: PeerAddress) -> tuple[socket.socket, PeerAddress]:
    try:
        ip = ipaddress.ip_address(address.host)
    except ValueError as exc:
        raise ConfigError(f"cannot listen on {address}: give an IP address, not a host name") from exc
    sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address.host, address.port))
        sock.listen(512)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise ConfigError(f"cannot listen on {address}: {reason}") from exc
    return sock, address
