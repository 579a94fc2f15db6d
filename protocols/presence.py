"""Who is in the run right now: one DHT dictionary key, one entry per node, written only by that node.

Key :data:`PRESENCE_KEY`; subkey = the writer's peer id (ASCII); value = msgpack :class:`Presence`.
Entries expire after :data:`PRESENCE_TTL` seconds and are refreshed every third of that, so a node
that vanishes without leaving drops out within a minute.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .types import MultiaddrStr

__all__ = ["PRESENCE_KEY", "PRESENCE_TTL", "Presence", "Role"]

PRESENCE_KEY = "run.presence"
PRESENCE_TTL = 60.0
Role = Literal["backbone", "volunteer"]


class Presence(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Role
    agent: Annotated[str, msgspec.Meta(max_length=64)] = ""
    addrs: Annotated[list[MultiaddrStr], msgspec.Meta(max_length=8)] = []
