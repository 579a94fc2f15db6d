"""Identifiers and the XOR metric of the Kademlia key space (Maymounkov & Mazières 2002, §2.1).

Nodes and keys share one 160-bit id space. A node's id is derived from its peer id and a key's id from
the user's key, both with SHA-256 truncated to 20 bytes under distinct domain prefixes, so a key id can
never be mistaken for a node id computed from the same string::

    node_id_of(peer_id) = int(sha256(b"dedloc-node:" + ascii(peer_id))[:20])
    key_id(key)         =     sha256(b"dedloc-key:"  + utf8(key))[:20]

The distance between two ids is their bitwise XOR read as an unsigned integer (§2.1): ``d(x, x) = 0``,
``d(x, y) = d(y, x)`` and the triangle inequality holds, and for any ``x`` and distance ``Δ`` there is
exactly one ``y`` with ``d(x, y) = Δ``, which is what makes lookups converge from any starting point.
Ids travel on the wire as 20 big-endian bytes (``Bytes20``); :func:`key_int` and :func:`id_bytes`
convert between the two forms.
"""

from __future__ import annotations

import hashlib

__all__ = ["ID_BYTES", "KEY_BITS", "check_id", "distance", "id_bytes", "key_id", "key_int", "node_id_of"]

KEY_BITS = 160
ID_BYTES = KEY_BITS // 8
_ID_LIMIT = 1 << KEY_BITS
_NODE_DOMAIN = b"dedloc-node:"
_KEY_DOMAIN = b"dedloc-key:"


def node_id_of(peer_id: str) -> int:
    """Return the node id of ``peer_id``: the first 20 bytes of its domain-separated SHA-256.

    Raises:
        ValueError: ``peer_id`` is empty or not ASCII (peer ids are base58).
    """
    if not peer_id:
        raise ValueError("a peer id cannot be empty")
    try:
        raw = peer_id.encode("ascii")
    except UnicodeEncodeError as exc:
        raise ValueError(f"peer id {peer_id!r} is not ASCII") from exc
    return int.from_bytes(hashlib.sha256(_NODE_DOMAIN + raw).digest()[:ID_BYTES], "big")


def key_id(key: str | bytes) -> bytes:
    """Return the 20-byte id a user key is stored under; ``str`` keys are UTF-8 encoded first."""
    raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    return hashlib.sha256(_KEY_DOMAIN + raw).digest()[:ID_BYTES]


def key_int(key_id: bytes) -> int:
    """Return a 20-byte id (as sent on the wire) as an integer in ``[0, 2**160)``.

    Raises:
        ValueError: ``key_id`` is not exactly 20 bytes long.
    """
    if len(key_id) != ID_BYTES:
        raise ValueError(f"an id has {ID_BYTES} bytes, got {len(key_id)}")
    return int.from_bytes(key_id, "big")


def id_bytes(node_id: int) -> bytes:
    """Return an integer id as the 20 big-endian bytes sent on the wire (inverse of :func:`key_int`).

    Raises:
        ValueError: ``node_id`` is outside ``[0, 2**160)``.
    """
    check_id(node_id)
    return node_id.to_bytes(ID_BYTES, "big")


def distance(a: int, b: int) -> int:
    """Return the Kademlia distance ``a XOR b`` between two ids (§2.1)."""
    return a ^ b


def check_id(node_id: int, what: str = "id") -> int:
    """Return ``node_id`` unchanged if it lies in ``[0, 2**160)``, else raise ``ValueError``."""
    if not 0 <= node_id < _ID_LIMIT:
        raise ValueError(f"{what} {node_id!r} is outside [0, 2**{KEY_BITS})")
    return node_id
