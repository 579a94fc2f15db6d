from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.dht import NodeInfo
from protocols.peer_id import PeerId
from shared.auth.keys import Identity
from shared.dht.keys import KEY_BITS, node_id_of
from shared.dht.routing import Contact, RoutingTable, random_id_in

TOP = 1 << KEY_BITS
HALF = 1 << (KEY_BITS - 1)


def contact(node_id: int, addr: str = "/ip4/127.0.0.1/tcp/1") -> Contact:
    return Contact(node_id, PeerId(f"peer-{node_id:x}"), (addr,))


def test_contact_of_derives_node_id_from_peer_id() -> None:
    peer_id = Identity.generate().peer_id
    c = Contact.of(peer_id, ("/ip4/10.0.0.1/tcp/5",))
    assert c.node_id == node_id_of(peer_id)
    assert c.peer_id == peer_id


def test_contact_round_trips_through_node_info() -> None:
    peer_id = Identity.generate().peer_id
    info = NodeInfo(peer_id=peer_id, addrs=["/ip4/10.0.0.1/tcp/5", "/ip6/::1/tcp/5"])
    c = Contact.from_info(info)
    assert c.addrs == ("/ip4/10.0.0.1/tcp/5", "/ip6/::1/tcp/5")
    assert c.to_info() == info


def test_contact_rejects_bad_peer_id_empty_addrs_and_out_of_range_id() -> None:
    with pytest.raises(ValueError, match="peer id"):
        Contact.of("not-a-peer-id", ("/ip4/1.2.3.4/tcp/1",))
    with pytest.raises(ValueError, match="addresses"):
        Contact(1, PeerId("p"), ())
    with pytest.raises(ValueError, match="outside"):
        Contact(TOP, PeerId("p"), ("/a",))


def test_routing_table_never_adds_own_id() -> None:
    table = RoutingTable(7, k=2)
    assert table.add_or_update(contact(7), now=0.0) is None
    assert 7 not in table
    assert len(table) == 0


def test_routing_table_splits_bucket_containing_own_id() -> None:
    table = RoutingTable(0, k=2)
    for node_id in (1, 2, HALF + 1):
        assert table.add_or_update(contact(node_id), now=0.0) is None
    assert [(b.lo, b.hi) for b in table.buckets()][-1] == (HALF, TOP)
    assert len(table) == 3


def test_routing_table_full_bucket_requests_ping_of_oldest() -> None:
    table = RoutingTable(0, k=2)
    oldest, other, newcomer = contact(HALF + 1), contact(HALF + 2), contact(HALF + 3)
    table.add_or_update(oldest, now=1.0)
    table.add_or_update(other, now=2.0)
    assert table.add_or_update(newcomer, now=3.0) == oldest
    assert newcomer.node_id not in table
    far = table.buckets()[-1]
    assert (far.lo, far.hi) == (HALF, TOP)
    assert far.contacts == (oldest, other)
    assert far.replacements == (newcomer,)


def test_routing_table_known_contact_moves_to_tail_with_new_addrs() -> None:
    table = RoutingTable(0, k=2)
    table.add_or_update(contact(HALF + 1), now=1.0)
    table.add_or_update(contact(HALF + 2), now=2.0)
    moved = contact(HALF + 1, "/ip4/10.9.9.9/tcp/2")
    assert table.add_or_update(moved, now=3.0) is None
    assert table.get(HALF + 1) == moved
    assert table.last_seen(HALF + 1) == 3.0
    assert table.add_or_update(contact(HALF + 3), now=4.0) == contact(HALF + 2)


def test_routing_table_answered_ping_keeps_old_contact_and_drops_newcomer() -> None:
    table = RoutingTable(0, k=2)
    table.add_or_update(contact(HALF + 1), now=1.0)
    table.add_or_update(contact(HALF + 2), now=2.0)
    to_ping = table.add_or_update(contact(HALF + 3), now=3.0)
    assert to_ping is not None
    table.mark_seen(to_ping.node_id, now=4.0)
    assert table.buckets()[-1].contacts == (contact(HALF + 2), contact(HALF + 1))
    assert HALF + 3 not in table


def test_routing_table_remove_promotes_most_recent_replacement() -> None:
    table = RoutingTable(0, k=2, replacement_cache=2)
    for i in range(1, 6):
        table.add_or_update(contact(HALF + i), now=float(i))
    assert table.buckets()[-1].replacements == (contact(HALF + 4), contact(HALF + 5))
    table.remove(HALF + 1)
    assert HALF + 5 in table
    assert table.buckets()[-1].replacements == (contact(HALF + 4),)
    table.remove(HALF + 4)  # only a replacement: dropped from the cache
    assert table.buckets()[-1].replacements == ()
    table.remove(HALF + 2)
    table.remove(12345)  # unknown: ignored
    assert len(table) == 1


def test_routing_table_without_replacement_cache_still_requests_ping() -> None:
    table = RoutingTable(0, k=1, replacement_cache=0)
    table.add_or_update(contact(HALF + 1), now=1.0)
    assert table.add_or_update(contact(HALF + 2), now=2.0) == contact(HALF + 1)
    table.remove(HALF + 1)
    assert len(table) == 0


def test_routing_table_nearest_sorts_by_xor_distance_and_excludes() -> None:
    table = RoutingTable(0, k=20)
    for node_id in (1, 2, 3, 8, 12):
        table.add_or_update(contact(node_id), now=0.0)
    assert [c.node_id for c in table.nearest(9, 3)] == [8, 12, 1]
    assert [c.node_id for c in table.nearest(9, 3, exclude=8)] == [12, 1, 3]
    assert table.nearest(9, 0) == []
    with pytest.raises(ValueError, match="count"):
        table.nearest(9, -1)


def test_routing_table_buckets_need_refresh_until_touched() -> None:
    table = RoutingTable(0, k=1)
    assert table.buckets_needing_refresh(now=0.0, interval=3600) == [(0, TOP)]
    table.add_or_update(contact(HALF + 1), now=100.0)
    table.add_or_update(contact(1), now=100.0)  # splits; both halves inherit the touch time
    assert table.buckets_needing_refresh(now=200.0, interval=3600) == []
    table.touch(HALF + 7, now=5000.0)
    stale = table.buckets_needing_refresh(now=4000.0 + 100.0, interval=3600)
    assert (HALF, TOP) not in stale
    assert stale


def test_random_id_in_stays_in_range_and_rejects_empty_ranges() -> None:
    rng = random.Random(1)
    assert all(HALF <= random_id_in(HALF, TOP, rng) < TOP for _ in range(100))
    assert random_id_in(5, 6, rng) == 5
    for lo, hi in ((5, 5), (-1, 3), (0, TOP + 1)):
        with pytest.raises(ValueError, match="range"):
            random_id_in(lo, hi, rng)


def test_routing_table_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k must"):
        RoutingTable(0, k=0)
    with pytest.raises(ValueError, match="replacement_cache"):
        RoutingTable(0, replacement_cache=-1)
    with pytest.raises(ValueError, match="own id"):
        RoutingTable(-1)
    assert "x" not in RoutingTable(0)


@st.composite
def near_ids(draw: st.DrawFn, own_id: int) -> int:
    """Ids spread over all distance octaves from ``own_id``, so deep buckets get exercised."""
    bits = draw(st.integers(min_value=0, max_value=KEY_BITS))
    return own_id ^ draw(st.integers(min_value=0, max_value=(1 << bits) - 1))


@st.composite
def table_ops(draw: st.DrawFn) -> tuple[int, int, list[tuple[str, int]]]:
    own_id = draw(st.integers(min_value=0, max_value=TOP - 1))
    k = draw(st.integers(min_value=1, max_value=4))
    ops = draw(
        st.lists(
            st.tuples(st.sampled_from(["add", "add", "add", "remove", "seen"]), near_ids(own_id)),
            max_size=80,
        )
    )
    return own_id, k, ops


@settings(max_examples=150, deadline=None)
@given(table_ops(), st.data())
def test_routing_table_invariants_hold_under_any_operations(
    setup: tuple[int, int, list[tuple[str, int]]], data: st.DataObject
) -> None:
    own_id, k, ops = setup
    table = RoutingTable(own_id, k=k, replacement_cache=3)
    for step, (op, node_id) in enumerate(ops):
        if op == "add":
            to_ping = table.add_or_update(contact(node_id), now=float(step))
            if to_ping is None:
                assert node_id in table or node_id == own_id
            else:
                # the newcomer waits; the bucket's least-recently seen contact is to be pinged
                assert node_id not in table
                bucket = next(b for b in table.buckets() if b.lo <= node_id < b.hi)
                assert bucket.contacts[0] == to_ping
        elif op == "remove":
            table.remove(node_id)
            assert node_id not in table
        else:
            table.mark_seen(node_id, now=float(step))

    buckets = table.buckets()
    assert buckets[0].lo == 0
    assert buckets[-1].hi == TOP
    assert all(a.hi == b.lo for a, b in itertools.pairwise(buckets))
    assert all(len(b.contacts) <= k for b in buckets)
    assert all(b.lo <= c.node_id < b.hi for b in buckets for c in (*b.contacts, *b.replacements))
    assert own_id not in table
    assert len(table) == len(table.contacts()) == len({c.node_id for c in table.contacts()})

    target = data.draw(near_ids(own_id), label="target")
    count = data.draw(st.integers(min_value=0, max_value=2 * k + 2), label="count")
    everyone = sorted(table.contacts(), key=lambda c: c.node_id ^ target)
    assert table.nearest(target, count) == everyone[:count]
