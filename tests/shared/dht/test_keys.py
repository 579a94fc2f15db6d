from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.auth.keys import Identity
from shared.dht.keys import KEY_BITS, check_id, distance, id_bytes, key_id, key_int, node_id_of

ids = st.integers(min_value=0, max_value=(1 << KEY_BITS) - 1)


def test_node_id_of_is_truncated_domain_separated_sha256() -> None:
    peer_id = Identity.generate().peer_id
    expected = hashlib.sha256(b"dedloc-node:" + peer_id.encode("ascii")).digest()[:20]
    assert node_id_of(peer_id) == int.from_bytes(expected, "big")
    assert 0 <= node_id_of(peer_id) < 1 << KEY_BITS


def test_key_id_hashes_str_as_utf8_and_bytes_as_is() -> None:
    assert key_id("héllo") == hashlib.sha256(b"dedloc-key:" + "héllo".encode()).digest()[:20]
    assert key_id("héllo") == key_id("héllo".encode())
    assert len(key_id(b"")) == 20


def test_key_and_node_ids_of_the_same_string_differ() -> None:
    peer_id = Identity.generate().peer_id
    assert key_int(key_id(peer_id)) != node_id_of(peer_id)


@pytest.mark.parametrize("bad", ["", "péer"])
def test_node_id_of_rejects_empty_or_non_ascii_peer_ids(bad: str) -> None:
    with pytest.raises(ValueError, match="peer id"):
        node_id_of(bad)


@given(ids)
def test_id_bytes_and_key_int_round_trip(node_id: int) -> None:
    assert key_int(id_bytes(node_id)) == node_id
    assert len(id_bytes(node_id)) == 20


@pytest.mark.parametrize("raw", [b"", b"\x00" * 19, b"\x00" * 21])
def test_key_int_rejects_wrong_length(raw: bytes) -> None:
    with pytest.raises(ValueError, match="20 bytes"):
        key_int(raw)


@pytest.mark.parametrize("bad", [-1, 1 << KEY_BITS])
def test_id_bytes_and_check_id_reject_out_of_range_ids(bad: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        id_bytes(bad)
    with pytest.raises(ValueError, match="outside"):
        check_id(bad)


@given(ids, ids, ids)
def test_distance_is_a_metric(a: int, b: int, c: int) -> None:
    assert distance(a, a) == 0
    assert distance(a, b) == distance(b, a)
    assert (distance(a, b) == 0) == (a == b)
    assert distance(a, c) <= distance(a, b) + distance(b, c)


@given(ids, ids)
def test_distance_is_unidirectional(a: int, delta: int) -> None:
    # For each id and distance there is exactly one id at that distance (Kademlia §2.1).
    assert distance(a, distance(a, delta)) == delta
