"""Peer ids: the libp2p encoding of an Ed25519 public key (protocols.peer_id)."""

from __future__ import annotations

import base58
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocols.peer_id import peer_id_from_public_key, public_key_from_peer_id, validate_peer_id

#: libp2p peer-id spec test vector (Ed25519): private seed, raw public key and its peer id.
SPEC_SEED = bytes.fromhex("7e0830617c4a7de83925dfb2694556b12936c477a0e1feb2e148ec9da60fee7d")
SPEC_PUBLIC_KEY = bytes.fromhex("1ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e")
SPEC_PEER_ID = "12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"


def _random_public_key() -> bytes:
    return (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )


def test_peer_id_round_trips_public_key() -> None:
    key = _random_public_key()

    peer_id = peer_id_from_public_key(key)

    assert public_key_from_peer_id(peer_id) == key
    assert validate_peer_id(peer_id) == peer_id


def test_peer_id_starts_with_ed25519_identity_prefix() -> None:
    for _ in range(20):
        assert peer_id_from_public_key(_random_public_key()).startswith("12D3KooW")


def test_peer_id_matches_libp2p_spec_vector() -> None:
    public_key = (
        Ed25519PrivateKey.from_private_bytes(SPEC_SEED)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )

    assert public_key == SPEC_PUBLIC_KEY
    assert peer_id_from_public_key(SPEC_PUBLIC_KEY) == SPEC_PEER_ID
    assert public_key_from_peer_id(SPEC_PEER_ID) == SPEC_PUBLIC_KEY


@pytest.mark.parametrize("length", [0, 31, 33, 64])
def test_peer_id_from_public_key_rejects_wrong_key_length(length: int) -> None:
    with pytest.raises(ValueError, match=f"got {length}"):
        peer_id_from_public_key(b"k" * length)


_VALID = peer_id_from_public_key(bytes(range(32)))
_RAW = base58.b58decode(_VALID)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "0OIl" + _VALID[4:],  # characters outside the base58 alphabet
        "12D3KooWé",
        # an RSA-style sha256 multihash peer id (right base58, wrong prefix)
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
        base58.b58encode(b"\x00\x24\x08\x02\x12\x20" + _RAW[6:]).decode(),  # key type secp256k1
        base58.b58encode(b"\x12\x20" + _RAW[6:]).decode(),  # no protobuf wrapper
        base58.b58encode(_RAW[:-1]).decode(),  # 31 key bytes
        base58.b58encode(_RAW + b"\x00").decode(),  # 33 key bytes
        _VALID[:-1],
    ],
    ids=[
        "empty",
        "spaces",
        "not-base58",
        "non-ascii",
        "sha256-multihash",
        "other-key-type",
        "no-wrapper",
        "short-key",
        "long-key",
        "truncated",
    ],
)
def test_peer_id_parsing_rejects_garbage_wrong_prefix_and_wrong_length(text: str) -> None:
    with pytest.raises(ValueError, match="peer id"):
        public_key_from_peer_id(text)
    with pytest.raises(ValueError, match="peer id"):
        validate_peer_id(text)
