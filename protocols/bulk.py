"""The bulk lane: raw bytes on a dedicated authenticated TLS connection (DESIGN D1).

A bulk connection (``lane="bulk"`` in the identity proof) carries one transfer at a time and is then
reused for the next::

    sender   -> receiver  frame BulkHeader{topic, nbytes, meta}
    sender   -> receiver  exactly ``nbytes`` raw bytes (TLS application data, no framing)
    receiver -> sender    frame BulkAck{meta, nbytes}  (or ErrorReply{code}; the lane is then closed)
    receiver -> sender    exactly ``BulkAck.nbytes`` raw bytes (a reply payload; usually none)

``topic`` selects the receiver's handler; ``meta`` is a small typed header the handler decodes itself.
A reply payload lets a peer that accepts no connections *download* over a connection it opened (the
averaged parts of an all-reduce come back this way).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from .envelope import Message, register

__all__ = ["MAX_BULK_BYTES", "BulkAck", "BulkHeader"]

MAX_BULK_BYTES = 1 << 40
_Topic = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9._-]+$")]
_Meta = Annotated[bytes, msgspec.Meta(max_length=64 * 1024)]


@register
class BulkHeader(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "bulk.header"
    max_bytes: ClassVar[int] = 70 * 1024
    topic: _Topic
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_BULK_BYTES)]
    meta: _Meta = b""


@register
class BulkAck(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "bulk.ack"
    max_bytes: ClassVar[int] = 70 * 1024
    meta: _Meta = b""
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_BULK_BYTES)] = 0
