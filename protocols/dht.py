"""Kademlia DHT messages (DESIGN D3; seed 001 App. B).

Keys on the wire are 20-byte key ids (the hash of the user's key, see ``shared.dht.keys``). A key holds
one plain record (``subkey`` is ``None``) and/or a dictionary of records, one per ``subkey``, each with
its own expiry: that is how per-peer progress lives under one key.

Every record is signed by its writer (Ed25519; the public key is inside the writer's peer id) over
:func:`record_payload`. Storing nodes keep the newest valid record per (key, subkey): the one with the
latest expiration time, ties broken by the signature bytes so every node picks the same winner.

In a pinned run a record also carries its writer's access token (:class:`~protocols.auth.SignedToken`,
at most 1,088 bytes), covered by the writer's signature, so that any node holding a copy (not only the
one the writer called) can check that the writer was admitted (see ``shared.dht.admission``). Open runs
send ``token=None``.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from .auth import SignedToken
from .envelope import MAX_FRAME_BYTES, Message, Request, register
from .types import Bytes20, Bytes64, MultiaddrStr, PeerIdStr, Subkey, ValueBytes

__all__ = [
    "FindNodeRequest",
    "FindNodeResponse",
    "FindValueRequest",
    "FindValueResponse",
    "LeaveNotice",
    "NodeInfo",
    "PingRequest",
    "PingResponse",
    "SignedRecord",
    "StoreRequest",
    "StoreResponse",
    "record_payload",
]

MAX_NODES_PER_REPLY = 32
MAX_RECORDS_PER_MESSAGE = 256
_RECORD_DOMAIN = b"dedloc-record-v2"


class NodeInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A DHT node as others can reach it."""

    peer_id: PeerIdStr
    addrs: Annotated[list[MultiaddrStr], msgspec.Meta(min_length=1, max_length=8)]


class SignedRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key: Bytes20
    subkey: Subkey | None
    value: ValueBytes
    expiration: float
    writer: PeerIdStr
    signature: Bytes64
    token: SignedToken | None = None  # the writer's access token (pinned runs), signed over with the rest

    def __post_init__(self) -> None:
        if not (self.expiration == self.expiration and abs(self.expiration) < 1e12):
            raise ValueError(f"expiration {self.expiration!r} is not a finite unix time")


def record_payload(record: SignedRecord) -> bytes:
    """The bytes a writer signs for ``record`` (everything but the signature, the token included)."""
    token = None if record.token is None else (record.token.token, record.token.signature)
    return _RECORD_DOMAIN + msgspec.msgpack.encode(
        (record.key, record.subkey, record.value, record.expiration, record.writer, token)
    )


@register
class PingResponse(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "dht.pong"
    max_bytes: ClassVar[int] = 256


@register
class PingRequest(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "dht.ping"
    response: ClassVar[type[Message]] = PingResponse
    max_bytes: ClassVar[int] = 256


@register
class FindNodeResponse(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "dht.find_node.ok"
    nodes: Annotated[list[NodeInfo], msgspec.Meta(max_length=MAX_NODES_PER_REPLY)]


@register
class FindNodeRequest(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "dht.find_node"
    response: ClassVar[type[Message]] = FindNodeResponse
    max_bytes: ClassVar[int] = 256
    target: Bytes20


@register
class FindValueResponse(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "dht.find_value.ok"
    max_bytes: ClassVar[int] = MAX_FRAME_BYTES - 1024
    records: Annotated[list[SignedRecord], msgspec.Meta(max_length=MAX_RECORDS_PER_MESSAGE)]
    nodes: Annotated[list[NodeInfo], msgspec.Meta(max_length=MAX_NODES_PER_REPLY)]


@register
class FindValueRequest(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "dht.find_value"
    response: ClassVar[type[Message]] = FindValueResponse
    max_bytes: ClassVar[int] = 256
    key: Bytes20


@register
class StoreResponse(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "dht.store.ok"
    max_bytes: ClassVar[int] = 4096
    accepted: Annotated[list[bool], msgspec.Meta(max_length=MAX_RECORDS_PER_MESSAGE)]


@register
class StoreRequest(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "dht.store"
    response: ClassVar[type[Message]] = StoreResponse
    max_bytes: ClassVar[int] = MAX_FRAME_BYTES - 1024
    records: Annotated[list[SignedRecord], msgspec.Meta(min_length=1, max_length=MAX_RECORDS_PER_MESSAGE)]


@register
class LeaveNotice(Message, frozen=True, kw_only=True):
    """One-way: the sender is leaving the DHT; drop it from routing tables now."""

    kind: ClassVar[str] = "dht.leave"
    max_bytes: ClassVar[int] = 256
