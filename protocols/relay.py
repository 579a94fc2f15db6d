"""The circuit relay and hole punching: wire messages and the plaintext preamble (issue 14 items 3, 8).

Three peers: a target ``T`` that accepts no inbound connections (behind NAT), a reachable relay ``R``,
and a dialer ``D``. ``T`` is reachable at the relayed address
``/ip4/<R's ip>/tcp/<R's port>/p2p/<R's id>/p2p-circuit/p2p/<T's id>``.

**Reservation** (an RPC on the authenticated RPC connection ``T`` opened to ``R``, and kept open)::

    T -> R  RelayReserve{}
    R -> T  RelayReservation{ttl, max_circuit_bytes, max_circuit_seconds, max_circuits}
            or ErrorReply{OVERLOADED} when R's reservation slots are full

``ttl`` is relative (seconds from R's reply), not an absolute time, so the two clocks need not agree; ``T``
renews at half of it. A reservation ends when it expires or when ``T``'s RPC connection to ``R`` closes
(``R`` offers circuits over that very connection, so without it ``T`` cannot be told of a circuit).

**Circuit** (``D`` to ``T`` through ``R``)::

    D -> R  CircuitRequest{target: T}                        over D's RPC connection to R
    R -> T  CircuitOffer{token: token_t, dialer: D}          over T's reservation connection
    T -> R  CircuitAccepted{}                                (or an error: T refuses)
    R -> D  CircuitGranted{token: token_d}
            (or NOT_FOUND: T holds no reservation; OVERLOADED: R's circuits are full; FORBIDDEN: T refused)
    D, T    each open a fresh TCP connection to R's listen address and send the preamble
            MAGIC || token   (PREAMBLE_BYTES bytes, plaintext)
    R       pairs the two sockets by token and splices bytes both ways, within the reservation's
            limits (bytes each way together, seconds), then closes both
    D -> T  TLS 1.3 + identity proof (:mod:`protocols.handshake`) through the splice, D as the TLS client
            expecting T's peer id, T as the server; then RPC or bulk traffic as D's lane says

``token_d`` and ``token_t`` are two independent random 16-byte tokens: each is usable once, by the peer it
was given to, within :data:`CIRCUIT_SETUP_SECONDS` of the grant. ``MAGIC`` starts with ``"D"`` (0x44), a
byte a TLS record never starts with (a ClientHello starts with 0x16), so ``R``'s accept path tells the
two apart by peeking at one byte; a peer that is not a relay never peeks. The preamble has a fixed size,
so ``R`` reads exactly :data:`PREAMBLE_BYTES` and nothing of the TLS bytes behind it. ``R`` splices
ciphertext only: the TLS session keys live in ``D`` and ``T``, and ``D`` checks ``T``'s certificate key
against ``T``'s peer id, ``T`` checks ``D``'s signature over its certificate and nonce, so ``R`` can
neither read the traffic nor impersonate either end (it can only drop or cut it).

**Observed address** (for hole punching): a raw TCP connection to ``R`` that sends the preamble
``OBSERVE_MAGIC || 16 zero bytes`` is answered with one length byte and the ASCII ``ip:port`` that ``R``
sees the connection come from, then closed. No identity is needed: it tells the asker only its own
address.

**Hole punching** (libp2p DCUtR's exchange, over the relayed, authenticated RPC connection between ``A``
(the peer that starts it) and ``B``)::

    A -> B  PunchConnect{observed: A's external ip:port, lane}
    B -> A  PunchReply{observed: B's external ip:port}       A measures the round trip rtt of this exchange
    A -> B  PunchSync{}                                      (notification)
    B       connects to A's observed address at once (from its bound port)
    A       waits rtt / 2, then connects to B's observed address (from its bound port)

Each side learned its external ``ip:port`` from ``R`` (above) over a socket bound with ``SO_REUSEADDR``
and ``SO_REUSEPORT`` to a chosen local port, and connects from that same port, so a NAT that maps a
local port to the same external port whatever the destination (endpoint-independent mapping, the common
"cone" case; Linux MASQUERADE without port randomization) lets the two SYNs cross: a simultaneous TCP
open. For an RPC connection (``lane="rpc"``) the peer with the lower peer id (as a string) runs the TLS
client side, the other the server; for a bulk connection (``lane="bulk"``, only between peers whose RPC
connection is already punched) ``A`` is the client, since a bulk lane carries transfers from its dialer.
Behind a NAT that picks a new port per destination (symmetric) the observed address is wrong for any other
destination, the connects time out, and the peers stay relayed.

**Relay records** (DHT, for relay discovery): key :data:`RELAYS_KEY`, subkey = the writer's peer id (ASCII,
enforced like presence), value = msgpack :class:`RelayRecord`: the direct addresses where the writer
serves relay slots. Entries expire after :data:`RELAY_RECORD_TTL` seconds and are refreshed every third of
that. A record is a signed *claim*, only a hint: a client trusts a relay when a reservation there succeeds
over the ordinary authenticated handshake (the relay proves the peer id the record names).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from .envelope import Message, Request, register
from .handshake import Lane
from .types import MultiaddrStr, PeerIdStr

__all__ = [
    "CIRCUIT_SETUP_SECONDS",
    "MAGIC",
    "OBSERVE_MAGIC",
    "PREAMBLE_BYTES",
    "TOKEN_BYTES",
    "CircuitAccepted",
    "CircuitGranted",
    "CircuitOffer",
    "CircuitRequest",
    "PunchConnect",
    "PunchReply",
    "PunchSync",
    "RELAYS_KEY",
    "RELAY_RECORD_TTL",
    "RelayRecord",
    "RelayReservation",
    "RelayReserve",
    "parse_preamble",
    "preamble",
]

#: The first bytes a circuit's raw connection sends to the relay (``D`` cannot be a TLS record's first byte).
MAGIC = b"DLRC\x01"
#: The first bytes of an observed-address request.
OBSERVE_MAGIC = b"DLOB\x01"
TOKEN_BYTES = 16
PREAMBLE_BYTES = len(MAGIC) + TOKEN_BYTES
#: A granted token is usable for this long; both ends' raw connections must arrive within it.
CIRCUIT_SETUP_SECONDS = 5.0

Token = Annotated[bytes, msgspec.Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
_Seconds = Annotated[float, msgspec.Meta(ge=0, le=7 * 24 * 3600)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
HostPort = Annotated[str, msgspec.Meta(min_length=3, max_length=64, pattern=r"^[0-9A-Fa-f.:\[\]]+:[0-9]+$")]


def preamble(token: bytes) -> bytes:
    """The preamble a circuit's raw connection starts with."""
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a token has {TOKEN_BYTES} bytes, got {len(token)}")
    return MAGIC + token


def parse_preamble(data: bytes) -> tuple[str, bytes] | None:
    """``("circuit", token)`` or ``("observe", b"")`` for a well-formed preamble, else ``None``."""
    if len(data) != PREAMBLE_BYTES:
        return None
    head, token = data[: len(MAGIC)], data[len(MAGIC) :]
    if head == MAGIC:
        return "circuit", token
    if head == OBSERVE_MAGIC and token == bytes(TOKEN_BYTES):
        return "observe", b""
    return None


@register
class RelayReservation(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "relay.reservation"
    max_bytes: ClassVar[int] = 256
    ttl: _Seconds
    max_circuit_bytes: _Count
    max_circuit_seconds: _Seconds
    max_circuits: _Count


@register
class RelayReserve(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "relay.reserve"
    max_bytes: ClassVar[int] = 64
    response: ClassVar[type[Message]] = RelayReservation


@register
class CircuitGranted(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "relay.granted"
    max_bytes: ClassVar[int] = 128
    token: Token


@register
class CircuitRequest(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "relay.connect"
    max_bytes: ClassVar[int] = 128
    response: ClassVar[type[Message]] = CircuitGranted
    target: PeerIdStr


@register
class CircuitAccepted(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "relay.accepted"
    max_bytes: ClassVar[int] = 64


@register
class CircuitOffer(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "relay.offer"
    max_bytes: ClassVar[int] = 128
    response: ClassVar[type[Message]] = CircuitAccepted
    token: Token
    dialer: PeerIdStr


@register
class PunchReply(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "punch.reply"
    max_bytes: ClassVar[int] = 128
    observed: HostPort


@register
class PunchConnect(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "punch.connect"
    max_bytes: ClassVar[int] = 128
    response: ClassVar[type[Message]] = PunchReply
    observed: HostPort
    lane: Lane = "rpc"


@register
class PunchSync(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "punch.sync"
    max_bytes: ClassVar[int] = 64


RELAYS_KEY = "run.relays"
RELAY_RECORD_TTL = 120.0


class RelayRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the writer serves relay slots (its direct addresses; no relayed ones)."""

    addrs: Annotated[list[MultiaddrStr], msgspec.Meta(max_length=8)] = []
