from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.dht import SignedRecord
from shared.dht.keys import key_id
from shared.dht.records import newer
from shared.dht.storage import RecordStore

NOW = 1_000.0
KEYS = [key_id(name) for name in ("a", "b", "c")]
WRITER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def rec(
    expiration: float,
    *,
    key: bytes = KEYS[0],
    subkey: bytes | None = None,
    signature: bytes = b"\x00" * 64,
    value: bytes = b"v",
) -> SignedRecord:
    return SignedRecord(key, subkey, value, expiration, WRITER, signature)


def test_store_returns_plain_record_then_subkeys_in_order() -> None:
    store = RecordStore()
    for subkey in (b"b", None, b"a"):
        assert store.put(rec(NOW + 10, subkey=subkey), NOW)
    assert [r.subkey for r in store.get(KEYS[0], NOW)] == [None, b"a", b"b"]
    assert store.get(KEYS[1], NOW) == []
    assert len(store) == 3
    assert store.keys() == [KEYS[0]]
    assert sorted(r.subkey or b"" for r in store.records()) == [b"", b"a", b"b"]


def test_store_keeps_the_later_expiring_record() -> None:
    store = RecordStore()
    old, new = rec(NOW + 10, value=b"old"), rec(NOW + 20, value=b"new")
    assert store.put(old, NOW)
    assert store.put(new, NOW)
    assert not store.put(old, NOW)
    assert not store.put(new, NOW)  # already held: nothing stored
    assert store.get(KEYS[0], NOW) == [new]
    assert len(store) == 1


def test_store_breaks_expiration_ties_by_larger_signature() -> None:
    store = RecordStore()
    small, large = rec(NOW + 10, signature=b"\x01" * 64), rec(NOW + 10, signature=b"\x02" * 64)
    assert store.put(large, NOW)
    assert not store.put(small, NOW)
    assert store.get(KEYS[0], NOW) == [large]


def test_store_rejects_expired_records_and_hides_them_once_expired() -> None:
    store = RecordStore()
    assert not store.put(rec(NOW), NOW)
    assert store.put(rec(NOW + 5), NOW)
    assert store.put(rec(NOW + 50, subkey=b"s"), NOW)
    assert [r.subkey for r in store.get(KEYS[0], NOW + 5)] == [b"s"]
    assert store.remove_expired(NOW + 5) == 1
    assert store.remove_expired(NOW + 5) == 0
    assert store.remove_expired(NOW + 50) == 1
    assert len(store) == 0
    assert store.keys() == []


def test_full_store_evicts_soonest_expiring_for_a_longer_lived_record() -> None:
    store = RecordStore(max_records=2)
    assert store.put(rec(NOW + 10, key=KEYS[0]), NOW)
    assert store.put(rec(NOW + 30, key=KEYS[1]), NOW)
    assert not store.put(rec(NOW + 10, key=KEYS[2]), NOW)
    assert store.put(rec(NOW + 20, key=KEYS[2]), NOW)
    assert sorted(store.keys()) == sorted(KEYS[1:])
    assert len(store) == 2


def test_full_store_still_replaces_records_in_place() -> None:
    store = RecordStore(max_records=1)
    assert store.put(rec(NOW + 10), NOW)
    assert store.put(rec(NOW + 11), NOW)
    assert store.get(KEYS[0], NOW) == [rec(NOW + 11)]


def test_full_store_makes_room_by_dropping_expired_records() -> None:
    store = RecordStore(max_records=1)
    assert store.put(rec(NOW + 10, key=KEYS[0]), NOW)
    assert store.put(rec(NOW + 12, key=KEYS[1]), NOW + 10)
    assert store.keys() == [KEYS[1]]


def test_full_key_dictionary_evicts_soonest_expiring_subkey() -> None:
    store = RecordStore(max_subkeys_per_key=2)
    assert store.put(rec(NOW + 10, subkey=b"a"), NOW)
    assert store.put(rec(NOW + 30, subkey=b"b"), NOW)
    assert store.put(rec(NOW + 5), NOW)  # the plain value is not a dictionary entry
    assert not store.put(rec(NOW + 10, subkey=b"c"), NOW)
    assert store.put(rec(NOW + 20, subkey=b"c"), NOW)
    assert [r.subkey for r in store.get(KEYS[0], NOW)] == [None, b"b", b"c"]
    assert store.put(rec(NOW + 5, key=KEYS[1], subkey=b"a"), NOW)  # other keys are not affected


def test_store_rejects_malformed_keys_and_limits() -> None:
    store = RecordStore()
    with pytest.raises(ValueError, match="20 bytes"):
        store.put(rec(NOW + 1, key=b"short"), NOW)
    with pytest.raises(ValueError, match="20 bytes"):
        store.get(b"short", NOW)
    with pytest.raises(ValueError, match="max_records"):
        RecordStore(max_records=0)
    with pytest.raises(ValueError, match="max_subkeys_per_key"):
        RecordStore(max_subkeys_per_key=0)


def test_store_stays_consistent_under_many_superseding_writes() -> None:
    store = RecordStore(max_records=3)
    for i in range(1, 500):
        store.put(rec(NOW + i, subkey=bytes([i % 4])), NOW)
    assert len(store) == 3
    assert len(list(store.records())) == 3
    assert store.remove_expired(NOW + 10_000) == 3


records_strategy = st.lists(
    st.builds(
        rec,
        st.sampled_from([NOW - 1, NOW, NOW + 1, NOW + 2, NOW + 3]),
        key=st.sampled_from(KEYS[:2]),
        subkey=st.sampled_from([None, b"x", b"y"]),
        signature=st.binary(min_size=64, max_size=64),
    ),
    max_size=24,
    unique_by=lambda r: r.signature,  # distinct records never share a signature
)


@settings(max_examples=100, deadline=None)
@given(records_strategy.flatmap(lambda rs: st.tuples(st.just(rs), st.permutations(rs))))
def test_store_keeps_exactly_the_newest_record_per_slot_in_any_order(
    orders: tuple[list[SignedRecord], list[SignedRecord]],
) -> None:
    results = []
    for order in orders:
        store = RecordStore()
        for record in order:
            store.put(record, NOW)
        results.append({key: store.get(key, NOW) for key in KEYS})
    assert results[0] == results[1]

    newest: dict[tuple[bytes, bytes | None], SignedRecord] = {}
    for record in orders[0]:
        slot = (record.key, record.subkey)
        if record.expiration > NOW and (slot not in newest or newer(record, newest[slot])):
            newest[slot] = record
    held = [r for key in KEYS for r in results[0][key]]
    assert sorted(held, key=lambda r: r.signature) == sorted(newest.values(), key=lambda r: r.signature)


@settings(max_examples=100, deadline=None)
@given(
    records_strategy,
    st.lists(st.sampled_from([NOW, NOW + 1, NOW + 1.5, NOW + 2, NOW + 3]), max_size=4).map(sorted),
    st.integers(min_value=1, max_value=6),
)
def test_store_never_returns_expired_records_and_stays_bounded(
    records: list[SignedRecord], times: list[float], max_records: int
) -> None:
    store = RecordStore(max_records=max_records, max_subkeys_per_key=1)
    for record in records:
        store.put(record, NOW)
        assert len(store) <= max_records
    for now in times:
        assert all(r.expiration > now for key in KEYS for r in store.get(key, now))
        store.remove_expired(now)
        assert all(r.expiration > now for r in store.records())
        assert len(store) == len(list(store.records()))
        assert all(sum(r.subkey is not None for r in store.get(key, now)) <= 1 for key in KEYS)
