"""The circuit relay (issue 14 item 3, transport part): the relay's service, the target's reservation,
and the dialer's relayed dial. The wire exchange is in :mod:`protocols.relay`; this module keeps it.

**Relay** (:class:`RelayService` on a reachable host ``R``). It grants reservations while it has slots
(:class:`RelayLimits`: ``max_reservations``), and circuits to a target with a live reservation while fewer
than ``max_circuits`` are set up or running. For a circuit it mints two independent random tokens, offers
``token_t`` to the target over the target's own RPC connection, and grants ``token_d`` to the dialer. The
host's accept path (:attr:`shared.net.host.Host.preamble_handler`) hands it every incoming connection whose
first byte is a preamble's; the service reads exactly :data:`~protocols.relay.PREAMBLE_BYTES` within
``preamble_deadline`` (a fixed size: nothing is allocated by what a stranger announces), then:

* an unknown token, a token of a circuit whose setup time passed, garbage, or a preamble too slow is
  closed and counted in ``RelayStatistics.refused`` by reason (``unknown``, ``expired``, ``garbage``,
  ``slow``); each token is removed from the table by its first use, so it is single-use;
* the first socket of a circuit waits (until the circuit's setup deadline) for its partner; the second
  splices the two: bytes are copied both ways as they come, through one 256 KiB buffer per direction
  (the copy waits for the destination's socket buffer, so a slow reader slows its writer, with no queue
  here). The circuit ends when both directions reached end of file, either side broke, the bytes of both
  directions together exceed ``max_circuit_bytes`` (``refused["bytes"]``), or ``max_circuit_seconds``
  passed (``refused["seconds"]``). Both sockets are then shut down.

Bytes spliced are counted per ``(dialer, target)`` (:meth:`RelayService.bytes_relayed`) for the ledger's
credit (the relay's claim); both ends count what they receive through the circuit per relay
(:mod:`shared.net.relaytraffic`: the evidence). ``tap`` (optional) sees every chunk forwarded, as the
relay sees it: the relayed-encryption test checks that no plaintext is in it. The relay never holds
more than two buffers per circuit.

**Target** (:class:`RelayClient` on a host that accepts no inbound connections). ``reserve`` asks a relay
for a reservation; :meth:`RelayClient.keep` renews it at half its ``ttl``, or at a third of the host's
``idle_timeout`` if that is sooner (so the connection never sits idle long enough to be reaped), and
:meth:`RelayClient.addresses` lists the relayed addresses of the relays that hold one now. An offer is
accepted only from a relay we hold a reservation with: the target opens a fresh TCP connection to the
relay, sends the preamble and serves the connection as an ordinary incoming one
(:meth:`shared.net.host.Host.serve_socket`: TLS server side, identity proof, then RPC or bulk as the
dialer chose). The dialer it proves may differ from the offer's ``dialer`` only if the relay lied; it
gains nothing by that (the dialer still had to prove its own key), so the target does not check it.

**Dialer** (:func:`relay_dial`, called by ``Host._dial`` for any address with a ``relay``): an RPC connection
to the relay, proven to be the relay's peer id (a relay that is not who the address says fails there
with :class:`~shared.errors.PeerIdMismatch`), a ``CircuitRequest``, a fresh TCP connection with the
preamble, then the ordinary client handshake expecting the target's peer id, all within
``dial_deadline`` each (connecting to the relay, then the circuit). The dial of the relay itself goes
through the host's :class:`~shared.net.dialing.DialGuard` like any other dial. A refused circuit is
:class:`~shared.errors.PeerUnavailable` (the target is not reachable that way now), as is a relay that dies
mid-transfer (the TLS stream breaks).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from protocols.codes import ErrorCode
from protocols.errors import ProtocolError
from protocols.handshake import Lane
from protocols.peer_id import PeerId
from protocols.relay import (
    CIRCUIT_SETUP_SECONDS,
    MAGIC,
    OBSERVE_MAGIC,
    PREAMBLE_BYTES,
    TOKEN_BYTES,
    CircuitAccepted,
    CircuitGranted,
    CircuitOffer,
    CircuitRequest,
    RelayReservation,
    RelayReserve,
    parse_preamble,
    preamble,
)

from ..errors import HandshakeError, PeerUnavailable, RemoteError, remote_error
from .addresses import PeerAddress, relayed
from .connection import SecureConnection, dial
from .tls_socket import connect_tcp

if TYPE_CHECKING:
    from .host import Host
    from .rpc import RequestContext

__all__ = [
    "PREAMBLE_FIRST_BYTE",
    "PreambleHandler",
    "RelayClient",
    "RelayLimits",
    "RelayService",
    "RelayStatistics",
    "observe_address",
    "recv_exactly",
    "relay_dial",
    "send_raw",
]

logger = logging.getLogger(__name__)

#: The byte every relay preamble starts with (a TLS record never does: it starts with 0x14..0x18).
PREAMBLE_FIRST_BYTE = MAGIC[:1]
assert OBSERVE_MAGIC[:1] == PREAMBLE_FIRST_BYTE
#: ``handler(raw socket, "host:port", admitted)``: takes an accepted socket whose first byte is
#: :data:`PREAMBLE_FIRST_BYTE`; calls ``admitted()`` once the preamble proved valid (the host then stops
#: counting the socket as a pending handshake); the host closes the socket when the handler returns.
PreambleHandler = Callable[[socket.socket, str, Callable[[], None]], Awaitable[None]]
_CHUNK = 256 * 1024
_SWEEP_AFTER = 60.0  # a circuit's tokens are forgotten this long after its setup deadline


@dataclass(frozen=True)
class RelayLimits:
    """What a relay offers. The defaults suit a home uplink sharing a few circuits."""

    max_reservations: int = 32
    max_circuits: int = 16  # circuits being set up or spliced at once, relay-wide
    max_circuit_bytes: int = 1 << 30  # both directions together, per circuit
    max_circuit_seconds: float = 600.0
    reservation_ttl: float = 600.0
    preamble_deadline: float = 2.0  # a raw connection must deliver its preamble within this
    circuit_setup_seconds: float = CIRCUIT_SETUP_SECONDS  # both raw connections must arrive within this


@dataclass(frozen=True)
class RelayStatistics:
    reservations: int  # live now
    circuits_granted: int
    circuits_active: int  # being set up or spliced now
    circuits_refused: int  # CircuitRequests refused (no reservation, full, target refused)
    bytes_relayed: int  # both directions, all circuits
    observed: int  # observed-address requests answered
    refused: dict[str, int] = field(default_factory=dict)  # raw connections closed, by reason


class _Circuit:
    __slots__ = ("bytes", "deadline", "dialer", "done", "paired", "sockets", "target")

    def __init__(self, dialer: PeerId, target: PeerId, deadline: float) -> None:
        self.dialer = dialer
        self.target = target
        self.deadline = deadline
        self.sockets: dict[str, socket.socket] = {}
        self.paired = trio.Event()
        self.done = trio.Event()
        self.bytes = 0


class RelayService:
    """Serves reservations and circuits on ``host`` (registers its handlers at construction).

    Raises:
        ValueError: ``host`` already serves as a relay, or a limit is not positive.
    """

    def __init__(
        self,
        host: Host,
        limits: RelayLimits | None = None,
        tap: Callable[[str, bytes], None] | None = None,
    ) -> None:
        self.limits = limits = limits or RelayLimits()
        if (
            min(limits.max_reservations, limits.max_circuits, limits.max_circuit_bytes) < 1
            or min(
                limits.max_circuit_seconds,
                limits.reservation_ttl,
                limits.preamble_deadline,
                limits.circuit_setup_seconds,
            )
            <= 0
        ):
            raise ValueError(f"relay limits must be positive: {limits}")
        if host.preamble_handler is not None:
            raise ValueError("this host already serves as a relay")
        self.host = host
        self.tap = tap
        self._reservations: dict[PeerId, float] = {}  # target -> expiry (trio time)
        self._tokens: dict[bytes, tuple[_Circuit, str]] = {}
        self._circuits: set[_Circuit] = set()
        self._by_pair: Counter[tuple[PeerId, PeerId]] = Counter()
        self._refused: Counter[str] = Counter()
        self._granted = self._circuits_refused = self._observed = 0
        host.registry.add(RelayReserve, self._on_reserve)
        host.registry.add(CircuitRequest, self._on_circuit)
        host.preamble_handler = self._on_preamble

    # ---------------------------------------------------------------- statistics

    def statistics(self) -> RelayStatistics:
        self._sweep(trio.current_time())
        return RelayStatistics(
            reservations=len(self._reservations),
            circuits_granted=self._granted,
            circuits_active=len(self._circuits),
            circuits_refused=self._circuits_refused,
            bytes_relayed=sum(self._by_pair.values()),
            observed=self._observed,
            refused=dict(self._refused),
        )

    def reservations_connected(self) -> int:
        """Reservations whose holder is still connected, for status pages; unlike :meth:`statistics` this
        needs no trio context (callable from a worker thread), so it does not check expiry."""
        return sum(self.host.channel_for(peer) is not None for peer in list(self._reservations))

    def bytes_relayed(self) -> dict[tuple[PeerId, PeerId], int]:
        """Bytes spliced so far per ``(dialer, target)``, both directions together."""
        return dict(self._by_pair)

    # ---------------------------------------------------------------- RPC handlers

    def _holds_reservation(self, peer: PeerId, now: float) -> bool:
        expiry = self._reservations.get(peer)
        return expiry is not None and now < expiry and self.host.channel_for(peer) is not None

    def _sweep(self, now: float) -> None:
        for peer in [p for p in self._reservations if not self._holds_reservation(p, now)]:
            del self._reservations[peer]
        for token, (circuit, _) in list(self._tokens.items()):
            if now > circuit.deadline + _SWEEP_AFTER:
                del self._tokens[token]
        for circuit in [c for c in self._circuits if not c.paired.is_set() and now > c.deadline]:
            self._circuits.discard(circuit)

    async def _on_reserve(self, ctx: RequestContext, _: RelayReserve) -> RelayReservation:
        now = trio.current_time()
        self._sweep(now)
        if ctx.peer_id not in self._reservations and len(self._reservations) >= self.limits.max_reservations:
            raise remote_error(
                ErrorCode.OVERLOADED, f"all {self.limits.max_reservations} reservation slots are taken"
            )
        self._reservations[ctx.peer_id] = now + self.limits.reservation_ttl
        return RelayReservation(
            ttl=self.limits.reservation_ttl,
            max_circuit_bytes=self.limits.max_circuit_bytes,
            max_circuit_seconds=self.limits.max_circuit_seconds,
            max_circuits=self.limits.max_circuits,
        )

    async def _on_circuit(self, ctx: RequestContext, request: CircuitRequest) -> CircuitGranted:
        now = trio.current_time()
        self._sweep(now)
        target = PeerId(request.target)
        try:
            if target == ctx.peer_id:
                raise ProtocolError("a circuit to yourself")
            if not self._holds_reservation(target, now):
                raise remote_error(ErrorCode.NOT_FOUND, f"{target} holds no reservation here")
            if len(self._circuits) >= self.limits.max_circuits:
                raise remote_error(
                    ErrorCode.OVERLOADED, f"{self.limits.max_circuits} circuits are already open"
                )
            channel = self.host.channel_for(target)
            if channel is None:
                raise remote_error(ErrorCode.NOT_FOUND, f"{target} holds no reservation here")
            setup = self.limits.circuit_setup_seconds
            circuit = _Circuit(ctx.peer_id, target, now + setup)
            token_d, token_t = secrets.token_bytes(TOKEN_BYTES), secrets.token_bytes(TOKEN_BYTES)
            self._circuits.add(circuit)
            self._tokens[token_d] = (circuit, "dialer")
            self._tokens[token_t] = (circuit, "target")
            try:
                with trio.fail_after(setup):
                    await channel.call(CircuitOffer(token=token_t, dialer=ctx.peer_id))
            except RemoteError as exc:
                self._forget(circuit)
                raise remote_error(ErrorCode.FORBIDDEN, f"{target} refused the circuit: {exc}") from exc
            except (PeerUnavailable, ProtocolError, trio.TooSlowError) as exc:
                self._forget(circuit)
                raise remote_error(ErrorCode.NOT_FOUND, f"{target} did not take the circuit: {exc}") from exc
        except (RemoteError, ProtocolError):
            self._circuits_refused += 1
            raise
        self._granted += 1
        return CircuitGranted(token=token_d)

    def _forget(self, circuit: _Circuit) -> None:
        self._circuits.discard(circuit)
        for token in [t for t, (c, _) in self._tokens.items() if c is circuit]:
            del self._tokens[token]

    # ---------------------------------------------------------------- raw connections

    async def _on_preamble(self, raw: socket.socket, peer: str, admitted: Callable[[], None]) -> None:
        raw.setblocking(False)
        data = b""
        with trio.move_on_after(self.limits.preamble_deadline):
            data = await recv_exactly(raw, PREAMBLE_BYTES)
        parsed = parse_preamble(data)
        if parsed is None:
            self._refuse("garbage" if len(data) == PREAMBLE_BYTES else "slow", peer)
            return
        kind, token = parsed
        if kind == "observe":
            admitted()
            self._observed += 1
            text = peer.encode()
            with trio.move_on_after(self.limits.preamble_deadline), contextlib.suppress(OSError):
                await send_raw(raw, bytes([len(text)]) + text)
            return
        entry = self._tokens.pop(token, None)
        now = trio.current_time()
        if entry is None:
            self._refuse("unknown", peer)
            return
        circuit, role = entry
        if now > circuit.deadline or role in circuit.sockets or circuit.done.is_set():
            self._refuse("expired", peer)
            return
        admitted()
        circuit.sockets[role] = raw
        if len(circuit.sockets) == 2:
            circuit.paired.set()
            try:
                await self._splice(circuit)
            finally:
                self._circuits.discard(circuit)
                for sock in circuit.sockets.values():
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                circuit.done.set()
            return
        with trio.move_on_after(max(0.0, circuit.deadline - now)):
            await circuit.paired.wait()
        if not circuit.paired.is_set():
            # the partner's token stays in the table until swept, so a late partner counts as "expired"
            self._circuits.discard(circuit)
            circuit.done.set()
            self._refuse("unpaired", peer)
            return
        await circuit.done.wait()

    def _refuse(self, reason: str, peer: str) -> None:
        self._refused[reason] += 1
        logger.info("relay: closed a raw connection from %s (%s preamble)", peer, reason)

    async def _splice(self, circuit: _Circuit) -> None:
        dialer, target = circuit.sockets["dialer"], circuit.sockets["target"]
        with trio.move_on_after(self.limits.max_circuit_seconds) as timer:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, dialer, target, circuit, "d>t", nursery.cancel_scope)
                nursery.start_soon(self._pump, target, dialer, circuit, "t>d", nursery.cancel_scope)
        if timer.cancelled_caught:
            self._refused["seconds"] += 1

    async def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        circuit: _Circuit,
        direction: str,
        scope: trio.CancelScope,
    ) -> None:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        pair = (circuit.dialer, circuit.target)
        while True:
            try:
                await trio.lowlevel.wait_readable(src)
                n = src.recv_into(view)
            except BlockingIOError:
                continue
            except (OSError, trio.ClosedResourceError):
                scope.cancel()
                return
            if n == 0:  # half-close: pass the end of file on, keep the other direction going
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            if circuit.bytes + n > self.limits.max_circuit_bytes:
                self._refused["bytes"] += 1
                scope.cancel()
                return
            circuit.bytes += n
            self._by_pair[pair] += n
            if self.tap is not None:
                self.tap(direction, bytes(view[:n]))
            try:
                await send_raw(dst, view[:n])
            except (OSError, trio.ClosedResourceError):
                scope.cancel()
                return


# -------------------------------------------------------------------- raw socket helpers


async def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes from a non-blocking socket: all ``n``, or fewer if the peer closed first."""
    out = bytearray()
    while len(out) < n:
        await trio.lowlevel.wait_readable(sock)
        try:
            chunk = sock.recv(n - len(out))
        except BlockingIOError:
            continue
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


async def send_raw(sock: socket.socket, data: bytes | memoryview) -> None:
    """Send all of ``data`` on a non-blocking socket. Raises OSError if the connection broke."""
    view = memoryview(data)
    while view:
        try:
            n = sock.send(view)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        view = view[n:]
    await trio.lowlevel.checkpoint()


async def observe_address(relay: PeerAddress, sock: socket.socket) -> str:
    """Ask ``relay`` which ``ip:port`` the bound, non-blocking, unconnected TCP socket ``sock`` appears
    from (then ``sock`` is closed). Bounded by the caller's cancel scope.

    Raises:
        PeerUnavailable: the relay did not answer, or answered garbage.
    """
    try:
        code = sock.connect_ex((relay.host, relay.port))
        if code not in (0, 115):  # EINPROGRESS
            raise PeerUnavailable(f"cannot connect to relay {relay}: error {code}")
        await trio.lowlevel.wait_writable(sock)
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            raise PeerUnavailable(f"cannot connect to relay {relay}: error {code}")
        await send_raw(sock, OBSERVE_MAGIC + bytes(TOKEN_BYTES))
        length = await recv_exactly(sock, 1)
        text = await recv_exactly(sock, length[0]) if length else b""
        if not length or len(text) != length[0]:
            raise PeerUnavailable(f"relay {relay} did not report an observed address")
        return text.decode("ascii", "replace")
    except OSError as exc:
        raise PeerUnavailable(f"observed-address request to {relay} failed: {exc}") from exc
    finally:
        trio.lowlevel.notify_closing(sock)
        sock.close()


# -------------------------------------------------------------------- dialer


async def relay_dial(host: Host, address: PeerAddress, lane: Lane) -> SecureConnection:
    """Reach ``address.peer_id`` through ``address.relay`` and authenticate it end to end.

    Raises:
        PeerUnavailable: the relay is unreachable or refused the circuit, or the circuit broke.
        HandshakeError: the relay, or the target behind it, is not who ``address`` says.
        RemoteError, ProtocolError: the target refused our proof, or sent garbage.
    """
    relay, target = address.relay, address.peer_id
    assert relay is not None  # parse_multiaddr and relayed() guarantee both
    assert target is not None
    channel = await host.channel_to(relay)
    raw: socket.socket | None = None
    try:
        with trio.fail_after(host.config.dial_deadline):
            granted = await channel.call(CircuitRequest(target=target))
            assert isinstance(granted, CircuitGranted)
            raw = await connect_tcp(relay.host, relay.port)
            await send_raw(raw, preamble(granted.token))
            conn = await dial(host.endpoint, address, lane, raw=raw)
    except trio.TooSlowError as exc:
        if raw is not None:
            raw.close()
        raise PeerUnavailable(
            f"no circuit to {target} through {relay} within {host.config.dial_deadline} s"
        ) from exc
    except RemoteError as exc:
        raise PeerUnavailable(f"relay {relay} gave no circuit to {target}: {exc}") from exc
    except OSError as exc:
        if raw is not None:
            raw.close()
        raise PeerUnavailable(f"circuit to {target} through {relay} broke: {exc}") from exc
    conn.via = "relayed"
    assert relay.peer_id is not None  # relayed() requires it, and channel_to proved it
    host.relay_traffic.track(relay.peer_id, conn.tls)  # evidence of the relay's work (relaytraffic)
    return conn


# -------------------------------------------------------------------- target


@dataclass(frozen=True)
class Reservation:
    relay: PeerAddress
    terms: RelayReservation
    expires_at: float  # trio time


class RelayClient:
    """The target side: holds reservations and answers circuit offers (registers its handler)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.reservations: dict[PeerId, Reservation] = {}
        self.circuits_served = 0
        self.offers_refused = 0
        host.registry.add(CircuitOffer, self._on_offer)

    async def reserve(self, relay: PeerAddress) -> Reservation:
        """Reserve a slot at ``relay`` (which must carry its peer id).

        Raises:
            PeerUnavailable, HandshakeError: the relay cannot be reached, or is not who it says.
            RemoteError: the relay refused (``OVERLOADED``: no slot free).
        """
        if relay.peer_id is None:
            raise ValueError(f"a relay address needs its peer id: {relay}")
        sent = trio.current_time()
        terms = await self.host.call(relay, RelayReserve())
        assert isinstance(terms, RelayReservation)
        reservation = Reservation(relay, terms, sent + terms.ttl)
        self.reservations[relay.peer_id] = reservation
        return reservation

    async def keep(
        self, relay: PeerAddress, *, task_status: trio.TaskStatus[Reservation] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Reserve at ``relay`` and renew at half the ``ttl`` until cancelled or the relay fails us
        (then the reservation is dropped and the error raised)."""
        assert relay.peer_id is not None
        try:
            reservation = await self.reserve(relay)
            task_status.started(reservation)
            while True:
                channel = self.host.channel_for(relay.peer_id)
                # renew at half the ttl, and often enough that neither side reaps the connection as idle
                with trio.move_on_after(min(reservation.terms.ttl / 2, self.host.config.idle_timeout / 3)):
                    if channel is not None:
                        await channel.wait_closed()
                        raise PeerUnavailable(f"the connection to relay {relay} closed")
                reservation = await self.reserve(relay)
        finally:
            self.reservations.pop(relay.peer_id, None)

    def addresses(self) -> list[PeerAddress]:
        """Our relayed addresses, one per relay whose reservation is live."""
        now = trio.current_time()
        return [
            relayed(r.relay, self.host.peer_id)
            for peer, r in self.reservations.items()
            if now < r.expires_at and self.host.channel_for(peer) is not None
        ]

    async def _on_offer(self, ctx: RequestContext, offer: CircuitOffer) -> CircuitAccepted:
        reservation = self.reservations.get(ctx.peer_id)
        if reservation is None:
            self.offers_refused += 1
            raise remote_error(ErrorCode.FORBIDDEN, "I hold no reservation with you")
        nursery = self.host._require_running()
        nursery.start_soon(self._serve_circuit, reservation.relay, offer.token)
        return CircuitAccepted()

    async def _serve_circuit(self, relay: PeerAddress, token: bytes) -> None:
        try:
            with trio.fail_after(CIRCUIT_SETUP_SECONDS):
                raw = await connect_tcp(relay.host, relay.port)
                try:
                    await send_raw(raw, preamble(token))
                except BaseException:
                    raw.close()
                    raise
        except (PeerUnavailable, OSError, trio.TooSlowError) as exc:
            logger.info("could not open the circuit's connection to relay %s: %s", relay, exc)
            return
        self.circuits_served += 1
        try:
            await self.host.serve_socket(raw, f"{relay.host}:{relay.port}", "relayed", relay.peer_id)
        except (PeerUnavailable, HandshakeError) as exc:
            logger.info("relayed connection through %s ended: %s", relay, exc)
