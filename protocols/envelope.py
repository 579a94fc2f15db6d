"""One envelope for every message on the wire, and the framing that carries it.

Frame (RPC lane)::

    +----------------+---------------------------------------------------------------+
    | length: u32 BE | msgpack array [version, kind, request_id, flags, payload, auth?] |
    +----------------+---------------------------------------------------------------+

* ``version`` must equal :data:`PROTOCOL_VERSION`; anything else is answered with ``WRONG_VERSION``
  (:class:`~protocols.errors.WrongVersion`). Every connection begins with the listener's
  ``ServerHello`` envelope, so a dialer of another version fails there, before it sends anything, with
  one line that says who must upgrade (``upgrade dedloc: this run speaks protocol N, you speak M``);
  a volunteer that reaches no initial peer for that reason exits with one error line ending in it.
* ``kind`` names the payload type (``"dht.find_node"``); each kind is registered once with its
  :class:`Message` subclass and a per-kind size limit.
* ``request_id`` pairs a response with its request; ids are chosen by the requester and are unique per
  direction of one connection.
* ``flags`` is a :class:`Flags` value: request, response, error reply, or one-way notification.
* ``payload`` is the msgpack encoding of the message struct, decoded only after the header has been
  validated, so a huge or unknown payload is rejected before any work is spent on it.
* ``auth`` (optional sixth element) carries the sender's credentials in pinned runs
  (:mod:`protocols.auth`); its signature covers the payload bytes exactly as sent.

Decoding validates everything (types, lengths, patterns, ``__post_init__`` checks) and raises
:class:`~protocols.errors.ProtocolError` naming what was wrong — and nothing else, whatever the bytes
(:func:`~protocols.errors.decode_typed`). There is no pickle anywhere.

**Limits before work** (DESIGN D10a). Every frame's length prefix is checked against the limit of the
stage the connection is in *before* any buffer is allocated for it:

* :data:`HANDSHAKE_FRAME_BYTES` (16 KiB) until the peer has proven its identity — the handshake
  messages are at most 8 KiB, so an unauthenticated stranger can make a node hold no more than that;
* :data:`BULK_FRAME_BYTES` for the headers and acks of the bulk lane;
* :data:`MAX_FRAME_BYTES` (4 MiB) on an RPC connection after the identity proof; per-kind limits are
  then checked on the envelope before the payload is decoded.

Decoding is always typed (never an untyped ``decode`` of a frame) and its cost is linear in the frame
size. A frame above :data:`INLINE_DECODE_BYTES` is decoded off the event loop (the engine runs it in a
worker thread behind a limiter), so no frame keeps the loop busy for more than about a millisecond.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, ClassVar, TypeVar

import msgspec

from .codes import ErrorCode
from .errors import DECODE_FAILURES, ProtocolError, WrongVersion, decode_typed

__all__ = [
    "BULK_FRAME_BYTES",
    "FRAME_HEADER",
    "HANDSHAKE_FRAME_BYTES",
    "INLINE_DECODE_BYTES",
    "MAX_AUTH_BYTES",
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "Envelope",
    "ErrorReply",
    "Flags",
    "Message",
    "Request",
    "check_envelope",
    "decode_envelope",
    "decode_message",
    "encode_frame",
    "encode_payload",
    "frame_payload",
    "parse_envelope",
    "register",
    "registered_kinds",
]

#: 2: averaged parts carry their aggregator's signature and digest, and members relay them (``avg.relay``).
#: 3: round tickets and plans carry a member's fp16 overflow claim (collective loss scaling).
#: 4: connection reversal (the ``"reverse"`` lane and ``conn.dialback``, :mod:`protocols.reversal`), the
#:    circuit relay and hole punching (:mod:`protocols.relay`).
#: 5: round tickets and plans carry the auxiliary-aggregator flag (``aux``: pulls no average) and tickets
#:    the vector's length (``numel``), so an auxiliary aggregator learns it from the computing members.
PROTOCOL_VERSION = 5
#: Hard ceiling on any frame of the RPC lane; per-kind limits are lower. Bulk bytes do not use frames.
MAX_FRAME_BYTES = 4 * 1024 * 1024
DEFAULT_MESSAGE_BYTES = 64 * 1024
MAX_AUTH_BYTES = 4096
#: Frame limit before the peer's identity proof (the largest handshake message is 8 KiB).
HANDSHAKE_FRAME_BYTES = 16 * 1024
#: Frame limit on the bulk lane (its header and ack carry at most 70 KiB, plus credentials).
BULK_FRAME_BYTES = 80 * 1024
#: Frames up to this size are decoded on the event loop (well under a millisecond); larger ones in a thread.
INLINE_DECODE_BYTES = 128 * 1024
FRAME_HEADER = struct.Struct("!I")

M = TypeVar("M", bound="Message")


class Flags(enum.IntEnum):
    REQUEST = 0
    RESPONSE = 1
    ERROR = 2
    NOTIFY = 3


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every payload. Subclasses set ``kind`` and may lower or raise ``max_bytes``."""

    kind: ClassVar[str] = ""
    max_bytes: ClassVar[int] = DEFAULT_MESSAGE_BYTES


class Request(Message, frozen=True, kw_only=True):
    """A message that expects exactly one reply of type ``response`` (or an :class:`ErrorReply`)."""

    response: ClassVar[type[Message]]


class Envelope(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    version: int
    kind: str
    request_id: int
    flags: int
    payload: msgspec.Raw
    auth: bytes = b""  # RequestAuth / ResponseAuth in pinned runs (protocols.auth); absent in open runs


class ErrorReply(Message, frozen=True, kw_only=True):
    """Sent instead of a response when a request fails; ``code`` says why."""

    kind: ClassVar[str] = "error"
    code: int
    message: str = ""

    def __post_init__(self) -> None:
        if len(self.message) > 1024:
            raise ValueError("error message longer than 1024 characters")


_REGISTRY: dict[str, type[Message]] = {}
_DECODERS: dict[type[Message], msgspec.msgpack.Decoder[Any]] = {}
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)
_ENCODER = msgspec.msgpack.Encoder()


def register(cls: type[M]) -> type[M]:
    """Class decorator: make ``cls`` decodable under ``cls.kind``. Each kind is registered once."""
    if not cls.kind:
        raise ValueError(f"{cls.__name__} has no kind")
    existing = _REGISTRY.get(cls.kind)
    if existing is not None and existing is not cls:
        raise ValueError(f"kind {cls.kind!r} is already registered to {existing.__name__}")
    _REGISTRY[cls.kind] = cls
    _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    return cls


def registered_kinds() -> dict[str, type[Message]]:
    return dict(_REGISTRY)


register(ErrorReply)


def encode_payload(message: Message) -> bytes:
    """The msgpack payload of ``message`` (what request signatures cover).

    Raises:
        ProtocolError: the encoded message exceeds its kind's size limit.
    """
    payload = _ENCODER.encode(message)
    if len(payload) > type(message).max_bytes:
        raise ProtocolError(
            f"{message.kind} payload of {len(payload)} bytes exceeds its limit of {type(message).max_bytes}",
            ErrorCode.TOO_LARGE,
        )
    return payload


def frame_payload(kind: str, payload: bytes, request_id: int, flags: Flags, auth: bytes = b"") -> bytes:
    """Wrap an encoded payload (and its credentials) in an envelope, with the length prefix."""
    body = _ENCODER.encode(
        Envelope(PROTOCOL_VERSION, kind, request_id, int(flags), msgspec.Raw(payload), auth)
    )
    return FRAME_HEADER.pack(len(body)) + body


def encode_frame(message: Message, request_id: int, flags: Flags) -> bytes:
    """Encode ``message`` in an envelope without credentials, with the length prefix.

    Raises:
        ProtocolError: the encoded message exceeds its kind's size limit.
    """
    return frame_payload(message.kind, encode_payload(message), request_id, flags)


def decode_envelope(body: bytes | memoryview) -> Envelope:
    """Decode and check an envelope's header fields (not its payload).

    Raises:
        ProtocolError: garbage, wrong version (:class:`~protocols.errors.WrongVersion`), unknown kind
            (``UNKNOWN_KIND``), payload too large for its kind (``TOO_LARGE``), bad flags or request id.
    """
    return check_envelope(parse_envelope(body))


def parse_envelope(body: bytes | memoryview) -> Envelope:
    """Decode an envelope's structure only (the first half of :func:`decode_envelope`).

    Raises:
        ProtocolError: the bytes are not an envelope.
    """
    return decode_typed(_ENVELOPE_DECODER, body, "envelope")


def check_envelope(envelope: Envelope) -> Envelope:
    """Check a parsed envelope's header fields (the second half of :func:`decode_envelope`).

    Raises:
        ProtocolError: as :func:`decode_envelope`; ``request_id`` is set when the envelope's is valid.
    """
    request_id = envelope.request_id if 0 <= envelope.request_id < 2**63 else 0
    if envelope.version != PROTOCOL_VERSION:
        raise WrongVersion(envelope.version, PROTOCOL_VERSION, request_id=request_id)
    if not 0 <= envelope.request_id < 2**63:
        raise ProtocolError(f"request id {envelope.request_id} out of range")
    if envelope.flags not in _FLAG_VALUES:
        raise ProtocolError(f"unknown envelope flags {envelope.flags}", request_id=request_id)
    if len(envelope.auth) > MAX_AUTH_BYTES:
        raise ProtocolError(
            f"credentials of {len(envelope.auth)} bytes exceed {MAX_AUTH_BYTES}",
            ErrorCode.TOO_LARGE,
            request_id=request_id,
        )
    cls = _REGISTRY.get(envelope.kind)
    if cls is None:
        raise ProtocolError(
            f"unknown message kind {envelope.kind[:64]!r}", ErrorCode.UNKNOWN_KIND, request_id=request_id
        )
    if len(envelope.payload) > cls.max_bytes:
        raise ProtocolError(
            f"{envelope.kind} payload of {len(envelope.payload)} bytes exceeds its limit of {cls.max_bytes}",
            ErrorCode.TOO_LARGE,
            request_id=request_id,
        )
    return envelope


def decode_message(envelope: Envelope, expected: type[M] | None = None) -> Message:
    """Decode the payload of a checked envelope into its registered type.

    Args:
        envelope: from :func:`decode_envelope`.
        expected: if given, the payload must be of this kind (or an :class:`ErrorReply`).

    Raises:
        ProtocolError: the payload does not match its kind's schema or the expected kind.
    """
    cls = _REGISTRY[envelope.kind]
    if expected is not None and cls is not expected and cls is not ErrorReply:
        raise ProtocolError(
            f"expected a {expected.kind} message, got {envelope.kind}", request_id=envelope.request_id
        )
    try:
        message: Message = _DECODERS[cls].decode(envelope.payload)
    except msgspec.ValidationError as exc:
        raise ProtocolError(
            f"invalid {envelope.kind} message: {str(exc)[:200]}", request_id=envelope.request_id
        ) from exc
    except DECODE_FAILURES as exc:
        raise ProtocolError(
            f"malformed {envelope.kind} payload: {str(exc)[:200]}", request_id=envelope.request_id
        ) from exc
    return message


_FLAG_VALUES = frozenset(int(f) for f in Flags)
