"""Peer-to-peer download of the training state over the bulk lane (DESIGN §1 "downloads the latest state",
D2; seed 000 §3.1).

A peer that can serve a state announces it under :data:`protocols.training.CHECKPOINT_KEY` as a
:class:`~protocols.training.StateAnnouncement` (step, SHA-256 ``digest``, ``nbytes``). The state itself is
an opaque blob (a safetensors file, see :mod:`shared.state.blob`) that a downloader fetches in chunks,
each chunk one bulk transfer (:mod:`protocols.bulk`) on topic :data:`STATE_TOPIC`::

    downloader -> server  BulkHeader{topic="state.get", nbytes=0, meta=StateRequest{digest, offset, length}}
    server -> downloader  BulkAck{meta=StateChunk{digest, offset, total}, nbytes=n}
    server -> downloader  n raw bytes: blob[offset : offset + n]

The *downloader* opens the connection and the chunk comes back as the ack's reply payload, so a peer
that accepts no inbound connections (client mode) can download too. ``n`` is ``min(length, total -
offset)``: the server never sends more than was asked for, nor past the end. ``total`` is the blob's size,
which the downloader checks against the announcement; at the end it checks the SHA-256 of the whole blob
against ``digest``, so a server cannot make it accept bytes other than the announced ones.

Refusals are ordinary bulk error replies:

* ``NOT_FOUND``    "I do not (or no longer) hold a state with that digest."
* ``BAD_REQUEST``  the meta does not decode, ``length`` is 0 or above :data:`MAX_CHUNK_BYTES`, the request
  carried payload bytes, or ``offset`` is at or beyond the end of the blob.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .errors import ProtocolError
from .types import Bytes32

__all__ = [
    "MAX_CHUNK_BYTES",
    "MAX_STATE_BYTES",
    "STATE_TOPIC",
    "StateChunk",
    "StateRequest",
    "decode_state_chunk",
    "decode_state_request",
    "encode_state_meta",
]

STATE_TOPIC = "state.get"
#: Largest chunk a server sends in one reply (a request for more is refused).
MAX_CHUNK_BYTES = 16 * 1024 * 1024
#: Largest blob the protocol describes (the bound of ``StateAnnouncement.nbytes``).
MAX_STATE_BYTES = 1 << 40

_Offset = Annotated[int, msgspec.Meta(ge=0, le=MAX_STATE_BYTES)]


def _check(name: str, value: int, low: int, high: int) -> None:
    # msgspec applies Meta bounds only when decoding; this covers structs built in code too.
    if not low <= value <= high:
        raise ValueError(f"{name} {value} is outside [{low}, {high}]")


def _check_digest(digest: bytes) -> None:
    if len(digest) != 32:
        raise ValueError(f"digest must be 32 bytes (SHA-256), got {len(digest)}")


class StateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Downloader -> server: "send me up to ``length`` bytes of the blob ``digest`` from ``offset``"."""

    digest: Bytes32
    offset: _Offset
    length: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_BYTES)]

    def __post_init__(self) -> None:
        _check_digest(self.digest)
        _check("offset", self.offset, 0, MAX_STATE_BYTES)
        _check("length", self.length, 1, MAX_CHUNK_BYTES)


class StateChunk(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Server -> downloader (ack meta): the reply payload is the blob's bytes from ``offset``; the blob is
    ``total`` bytes long."""

    digest: Bytes32
    offset: _Offset
    total: Annotated[int, msgspec.Meta(ge=1, le=MAX_STATE_BYTES)]

    def __post_init__(self) -> None:
        _check_digest(self.digest)
        _check("total", self.total, 1, MAX_STATE_BYTES)
        _check("offset", self.offset, 0, self.total - 1)


_REQUEST_DECODER = msgspec.msgpack.Decoder(StateRequest)
_CHUNK_DECODER = msgspec.msgpack.Decoder(StateChunk)
_DECODE_ERRORS = (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError)


def encode_state_meta(meta: StateRequest | StateChunk) -> bytes:
    """The msgpack bytes that travel as a bulk transfer's (or ack's) ``meta``."""
    return msgspec.msgpack.encode(meta)


def decode_state_request(meta: bytes | memoryview) -> StateRequest:
    """Decode and validate a :class:`StateRequest`.

    Raises:
        ProtocolError: malformed msgpack or a field out of range.
    """
    try:
        return _REQUEST_DECODER.decode(meta)
    except _DECODE_ERRORS as exc:  # msgspec.ValidationError is a DecodeError
        raise ProtocolError(f"invalid state request: {exc}") from exc


def decode_state_chunk(meta: bytes | memoryview) -> StateChunk:
    """Decode and validate a :class:`StateChunk`.

    Raises:
        ProtocolError: malformed msgpack or a field out of range.
    """
    try:
        return _CHUNK_DECODER.decode(meta)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"invalid state chunk header: {exc}") from exc
