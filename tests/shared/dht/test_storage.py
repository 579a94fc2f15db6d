from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.dht import SignedRecord
from shared.dht.keys import key_id
from shared.dht.records import newer
from shared.dht.storage import PutResult, RecordStore, StoreLimits, record_cost

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


# ---------------------------------------------------------------- per-writer quotas (issue 9, finding 4)

HONEST, MALLORY, MALLORY2 = "honest-peer", "mallory-peer", "mallory-2"


def by(writer: str, expiration: float, *, key: bytes = KEYS[0], subkey: bytes | None = None) -> SignedRecord:
    """A record of ``writer`` (its owner, in an open run), distinct per (key, subkey, expiration)."""
    signature = hashlib.sha512(repr((writer, key, subkey, expiration)).encode()).digest()
    return SignedRecord(key, subkey, b"v", expiration, writer, signature)


def flood_key(i: int) -> bytes:
    return key_id(f"flood-{i}")


def test_flooding_writer_cannot_displace_another_writers_records() -> None:
    """Finding 4: a full store used to evict the soonest-expiring record, whoever wrote it."""
    store = RecordStore(max_records=40)
    presence = by(HONEST, NOW + 60, key=KEYS[0], subkey=HONEST.encode())
    progress = by(HONEST, NOW + 30, key=KEYS[1], subkey=HONEST.encode())
    assert store.put(presence, NOW) and store.put(progress, NOW)
    for i in range(300):  # longer-lived than the honest records
        store.put(by(MALLORY, NOW + 3600 + i, key=flood_key(i)), NOW)
    assert store.get(KEYS[0], NOW) == [presence]
    assert store.get(KEYS[1], NOW) == [progress]
    assert len(store) == 40
    # the honest writer can still write, in place and anew: the flooder makes room for it
    assert store.put(by(HONEST, NOW + 31, key=KEYS[1], subkey=HONEST.encode()), NOW)
    assert store.put(by(HONEST, NOW + 900, key=KEYS[2], subkey=HONEST.encode()), NOW)
    assert store.usage(HONEST)[0] == 3
    assert len(store) == 40


def test_writer_over_its_quota_is_refused_with_a_reason_and_counted() -> None:
    store = RecordStore(StoreLimits(owner_records=5, owner_bytes=10_000))
    for i in range(5):
        assert store.put(by(MALLORY, NOW + 10, key=flood_key(i)), NOW)
    refused = store.put(by(MALLORY, NOW + 99, key=flood_key(5)), NOW)
    assert refused is PutResult.OWNER_QUOTA and not refused
    assert store.put(by(MALLORY, NOW + 11, key=flood_key(0)), NOW)  # replacing in place is no new record
    assert store.put(by(HONEST, NOW + 10, key=flood_key(5)), NOW)
    assert store.refusals[PutResult.OWNER_QUOTA] == 1
    big = SignedRecord(KEYS[0], None, b"x" * 10_000, NOW + 10, HONEST, b"\x01" * 64)
    assert store.put(big, NOW) is PutResult.OWNER_QUOTA  # bytes count too
    assert record_cost(big) > 10_000


def test_full_store_evicts_only_from_an_owner_holding_more_than_the_newcomer() -> None:
    store = RecordStore(StoreLimits(max_records=4))
    for i in range(2):
        assert store.put(by(MALLORY, NOW + 10, key=flood_key(i)), NOW)
        assert store.put(by(MALLORY2, NOW + 10, key=flood_key(10 + i)), NOW)
    # each flooder holds 2; a newcomer holding 0 takes a place from one of them
    assert store.put(by(HONEST, NOW + 5, key=KEYS[0]), NOW)
    assert store.usage(HONEST)[0] == 1
    # now a 2-1-1 split: a newcomer would hold 2, so nobody holds more and it is refused
    assert store.put(by(HONEST, NOW + 5, key=KEYS[1]), NOW) is PutResult.STORE_FULL
    assert store.put(by(HONEST, NOW + 99, key=KEYS[1]), NOW)  # ...unless it replaces its own sooner one
    assert store.usage(HONEST)[0] == 1
    assert store.get(KEYS[0], NOW) == []


def test_full_key_dictionary_evicts_only_from_an_owner_holding_more_entries() -> None:
    store = RecordStore(StoreLimits(max_subkeys_per_key=3))
    for sub in (b"m1", b"m2", b"m3"):
        assert store.put(by(MALLORY, NOW + 99, subkey=sub), NOW)
    assert store.put(by(HONEST, NOW + 5, subkey=b"h"), NOW)  # mallory holds 3 > 1
    assert store.put(by(MALLORY2, NOW + 5, subkey=b"n"), NOW)  # mallory holds 2 > 1
    assert store.put(by("third", NOW + 500, subkey=b"t"), NOW) is PutResult.KEY_FULL  # 1-1-1
    assert sorted(r.subkey or b"" for r in store.get(KEYS[0], NOW)) == [b"h", b"m3", b"n"]


def test_exempt_records_are_stored_outside_every_limit_and_never_evicted() -> None:
    revocations = KEYS[2]
    store = RecordStore(StoreLimits(max_records=2, owner_records=1, exempt_keys=frozenset({revocations})))
    for i in range(5):
        assert store.put(by(HONEST, NOW + 10, key=revocations, subkey=b"user%d" % i), NOW)
    assert store.put(by(MALLORY, NOW + 10, key=KEYS[0]), NOW)
    assert store.put(by(MALLORY2, NOW + 10, key=KEYS[1]), NOW)
    assert store.put(by("third", NOW + 10, key=flood_key(0)), NOW) is PutResult.STORE_FULL
    assert len(store.get(revocations, NOW)) == 5
    assert store.charged == (2, 2 * record_cost(by(MALLORY, NOW + 10)))
    assert len(store) == 7


def test_drop_owner_forgets_a_revoked_users_records_only() -> None:
    store = RecordStore()
    for i in range(3):
        store.put(by(MALLORY, NOW + 10, key=flood_key(i)), NOW)
    store.put(by(HONEST, NOW + 10), NOW)
    assert store.drop_owner(MALLORY) == 3
    assert store.drop_owner(MALLORY) == 0
    assert [r.writer for r in store.records()] == [HONEST]
    assert store.usage(MALLORY) == (0, 0)


def test_store_limits_reject_bad_values() -> None:
    for name in ("max_bytes", "owner_records", "owner_bytes"):
        with pytest.raises(ValueError, match=name):
            StoreLimits(**{name: 0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="20 bytes"):
        StoreLimits(exempt_keys=frozenset({b"short"}))


OWNERS = [HONEST, MALLORY, MALLORY2, "third"]
SMALL = StoreLimits(
    max_records=8,
    max_bytes=8 * 300,
    max_subkeys_per_key=3,
    owner_records=4,
    owner_bytes=4 * 300,
    exempt_keys=frozenset({KEYS[2]}),
)
puts = st.lists(
    st.tuples(
        st.sampled_from(OWNERS),
        st.sampled_from([*KEYS, flood_key(0), flood_key(1)]),
        st.sampled_from([None, b"a", b"b", b"c", b"d"]),
        st.integers(1, 6),
        st.integers(0, 40),  # value bytes: costs 256-300
    ),
    max_size=60,
)


def _usage(store: RecordStore) -> dict[str, tuple[int, int]]:
    return {owner: store.usage(owner) for owner in OWNERS}


@settings(max_examples=400, deadline=None)
@given(puts)
def test_store_quota_accounting_never_exceeds_limits_nor_evicts_a_smaller_owner(
    ops: list[tuple[str, bytes, bytes | None, int, int]],
) -> None:
    store = RecordStore(SMALL)
    for owner, key, subkey, ttl, size in ops:
        signature = hashlib.sha512(repr((owner, key, subkey, ttl, size)).encode()).digest()
        new = SignedRecord(key, subkey, b"x" * size, NOW + ttl, owner, signature)
        before = {(r.key, r.subkey): r for r in store.records()}
        usage_before = _usage(store)
        result = store.put(new, NOW)
        after = {(r.key, r.subkey): r for r in store.records()}
        # accounting matches the records held, and stays within every limit
        charged = [r for r in after.values() if r.key not in SMALL.exempt_keys]
        for name in OWNERS:
            mine = [r for r in charged if r.writer == name]
            assert store.usage(name) == (len(mine), sum(record_cost(r) for r in mine))
            assert len(mine) <= SMALL.owner_records
            assert store.usage(name)[1] <= SMALL.owner_bytes
        assert store.charged == (len(charged), sum(record_cost(r) for r in charged))
        assert len(charged) <= SMALL.max_records and store.charged[1] <= SMALL.max_bytes
        assert len(store) == len(after)
        # only the slot written changes, unless records were evicted to make room for a stored record
        gone = [r for slot, r in before.items() if slot not in after or after[slot] is not r]
        gone = [r for r in gone if (r.key, r.subkey) != (key, subkey)]
        if not result:
            assert after == before
            continue
        newcomer = store.usage(owner)
        in_key = Counter(r.writer for (k, sub), r in before.items() if k == key and sub is not None)
        newcomer_in_key = sum(
            r.writer == owner and sub is not None for (k, sub), r in after.items() if k == key
        )
        for victim in gone:
            assert victim.key not in SMALL.exempt_keys  # exempt records are never evicted
            if victim.writer != owner:  # another owner's record goes only if it held more: in the store,
                held = usage_before[victim.writer]  # or in the full key dictionary
                assert (
                    held[0] > newcomer[0]
                    or held[1] > newcomer[1]
                    or (victim.key == key and in_key[victim.writer] > newcomer_in_key)
                )
            else:  # one's own record goes only for a longer-lived one
                assert victim.expiration < new.expiration
