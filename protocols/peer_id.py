"""Peer ids: the libp2p encoding of an Ed25519 public key.

A peer id is ``base58btc(multihash_identity(protobuf(PublicKey{Type=Ed25519, Data=key})))``: the 32-byte
public key is *inside* the id (``12D3KooW…``), so anyone holding a peer id can verify signatures made by
that peer without a lookup, and multiaddr libraries accept it in ``/p2p/<id>`` components.

Bytes of the decoded id: ``00 24`` (identity multihash, 36 bytes) ``08 01`` (key type = Ed25519)
``12 20`` (32 bytes of key data) followed by the key.
"""

from __future__ import annotations

from typing import NewType

import base58

__all__ = ["PeerId", "peer_id_from_public_key", "public_key_from_peer_id", "validate_peer_id"]

PeerId = NewType("PeerId", str)

_PREFIX = b"\x00\x24\x08\x01\x12\x20"
ED25519_PUBLIC_KEY_BYTES = 32


def peer_id_from_public_key(public_key: bytes) -> PeerId:
    """Encode a raw 32-byte Ed25519 public key as a peer id."""
    if len(public_key) != ED25519_PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
    return PeerId(base58.b58encode(_PREFIX + public_key).decode("ascii"))


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Return the raw Ed25519 public key inside ``peer_id``.

    Raises:
        ValueError: ``peer_id`` is not a base58 Ed25519 identity peer id.
    """
    try:
        raw = base58.b58decode(peer_id.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"peer id {peer_id!r} is not base58") from exc
    if len(raw) != len(_PREFIX) + ED25519_PUBLIC_KEY_BYTES or not raw.startswith(_PREFIX):
        raise ValueError(f"peer id {peer_id!r} is not an Ed25519 identity peer id")
    return raw[len(_PREFIX) :]


def validate_peer_id(peer_id: str) -> PeerId:
    """Return ``peer_id`` typed as :data:`PeerId` if it is well formed, else raise ``ValueError``."""
    public_key_from_peer_id(peer_id)
    return PeerId(peer_id)
