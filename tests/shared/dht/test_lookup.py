from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.peer_id import PeerId
from shared.dht.keys import KEY_BITS
from shared.dht.lookup import Lookup
from shared.dht.routing import Contact, RoutingTable

TOP = 1 << KEY_BITS


def contact(node_id: int) -> Contact:
    return Contact(node_id, PeerId(f"peer-{node_id:x}"), ("/ip4/127.0.0.1/tcp/1",))


def ids(contacts: list[Contact]) -> list[int]:
    return [c.node_id for c in contacts]


def finished(lookup: Lookup) -> bool:
    # a function call, so that mypy does not narrow the property after `assert not lookup.finished`
    return lookup.finished


def test_lookup_queries_closest_candidates_first_up_to_alpha() -> None:
    lookup = Lookup(0, [contact(i) for i in (9, 3, 5, 1, 7)], k=4, alpha=2)
    assert ids(lookup.next_queries()) == [1, 3]
    assert lookup.in_flight == 2
    assert lookup.next_queries() == []  # alpha reached
    lookup.on_response(contact(1), [])
    assert ids(lookup.next_queries()) == [5]
    assert lookup.contacted == 3


def test_lookup_adds_closer_contacts_from_responses() -> None:
    lookup = Lookup(0, [contact(8)], k=2, alpha=1)
    (first,) = lookup.next_queries()
    lookup.on_response(first, [contact(2), contact(4), contact(16)])
    assert ids(lookup.next_queries()) == [2]


def test_lookup_finishes_when_k_closest_responded_despite_farther_in_flight() -> None:
    lookup = Lookup(0, [contact(8), contact(9)], k=2, alpha=3)
    eight, _nine = lookup.next_queries()
    lookup.on_response(eight, [contact(1), contact(2)])
    one, two = lookup.next_queries()
    lookup.on_response(one, [])
    assert not finished(lookup)
    lookup.on_response(two, [])
    assert lookup.finished
    assert lookup.in_flight == 1  # node 9 is no longer among the k closest; its reply is not needed
    assert ids(lookup.closest()) == [1, 2]
    assert lookup.next_queries() == []


def test_lookup_failure_brings_next_candidate_into_the_k_closest() -> None:
    lookup = Lookup(0, [contact(i) for i in (1, 2, 3)], k=2, alpha=2)
    one, two = lookup.next_queries()
    lookup.on_failure(one)
    lookup.on_response(two, [])
    assert lookup.failed == frozenset({1})
    assert not finished(lookup)
    (three,) = lookup.next_queries()
    assert three.node_id == 3
    lookup.on_response(three, [])
    assert lookup.finished
    assert ids(lookup.closest()) == [2, 3]


def test_lookup_never_queries_own_id_or_a_contact_twice() -> None:
    lookup = Lookup(0, [contact(1), contact(5), contact(1)], k=5, alpha=5, own_id=5)
    (one,) = lookup.next_queries()
    lookup.on_response(one, [contact(1), contact(5), contact(2)])
    assert ids(lookup.next_queries()) == [2]


def test_lookup_without_seeds_is_finished_and_empty() -> None:
    lookup = Lookup(123, [], own_id=1)
    assert lookup.finished
    assert lookup.next_queries() == []
    assert lookup.closest() == []


def test_lookup_closest_limits_count() -> None:
    lookup = Lookup(0, [contact(i) for i in (1, 2, 3)], k=3, alpha=3)
    for c in lookup.next_queries():
        lookup.on_response(c, [])
    assert ids(lookup.closest(2)) == [1, 2]
    assert lookup.closest(0) == []
    with pytest.raises(ValueError, match="count"):
        lookup.closest(-1)


def test_lookup_rejects_outcomes_for_contacts_not_in_flight() -> None:
    lookup = Lookup(0, [contact(1)], alpha=1)
    with pytest.raises(ValueError, match="in flight"):
        lookup.on_response(contact(1), [])
    (one,) = lookup.next_queries()
    lookup.on_failure(one)
    with pytest.raises(ValueError, match="in flight"):
        lookup.on_failure(one)
    with pytest.raises(ValueError, match="in flight"):
        lookup.on_response(contact(99), [])


def test_lookup_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k must"):
        Lookup(0, [], k=0)
    with pytest.raises(ValueError, match="alpha"):
        Lookup(0, [], alpha=0)
    with pytest.raises(ValueError, match="target"):
        Lookup(TOP, [])


def random_nodes(rng: random.Random, n: int) -> list[Contact]:
    node_ids: set[int] = set()
    while len(node_ids) < n:
        node_ids.add(rng.randrange(TOP))
    return [contact(node_id) for node_id in sorted(node_ids)]


def run_lookup(lookup: Lookup, answer: dict[int, list[Contact]], rng: random.Random) -> list[int]:
    """Drive ``lookup`` against a static network, settling in-flight queries in random order.

    ``answer`` maps each live node to its reply; nodes missing from it fail. Returns the query order.
    """
    queried: list[int] = []
    pending: list[Contact] = []
    while not lookup.finished:
        fresh = lookup.next_queries()
        queried += ids(fresh)
        pending += fresh
        assert pending, "an unfinished lookup must have work to hand out or replies to wait for"
        node = pending.pop(rng.randrange(len(pending)))
        if node.node_id in answer:
            lookup.on_response(node, answer[node.node_id])
        else:
            lookup.on_failure(node)
        assert lookup.in_flight == len(pending)
    return queried


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**32),
    n=st.integers(min_value=1, max_value=48),
    k=st.integers(min_value=1, max_value=6),
    alpha=st.integers(min_value=1, max_value=4),
    fail_rate=st.sampled_from([0.0, 0.1, 0.3]),
    target_is_node=st.booleans(),
)
def test_lookup_finds_true_k_closest_live_nodes_of_a_static_network(
    seed: int, n: int, k: int, alpha: int, fail_rate: float, target_is_node: bool
) -> None:
    # Every node's routing table holds all others (buckets of k + |failed| + 1), and replies carry
    # k + |failed| contacts, so failed nodes can never crowd out live ones: Kademlia's lookup must then
    # return exactly the k closest live nodes (other than the searcher).
    rng = random.Random(seed)
    nodes = random_nodes(rng, n)
    origin = nodes[0]
    failed = {c.node_id for c in nodes[1:] if rng.random() < fail_rate}
    reply_size = k + len(failed)
    tables = {}
    for node in nodes:
        tables[node.node_id] = table = RoutingTable(node.node_id, k=reply_size + 1)
        for other in rng.sample(nodes, n):
            table.add_or_update(other, now=0.0)  # a full bucket keeps its first k + |failed| + 1
    target = rng.choice(nodes).node_id if target_is_node else rng.randrange(TOP)
    answer = {
        node_id: table.nearest(target, reply_size, exclude=origin.node_id)
        for node_id, table in tables.items()
        if node_id not in failed
    }

    seeds = tables[origin.node_id].nearest(target, reply_size)
    lookup = Lookup(target, seeds, k=k, alpha=alpha, own_id=origin.node_id)
    queried = run_lookup(lookup, answer, rng)

    assert len(queried) == len(set(queried))
    assert origin.node_id not in queried
    assert lookup.failed <= failed & set(queried)  # some queries may still be in flight at the end
    live = [c for c in nodes[1:] if c.node_id not in failed]
    expected = sorted(live, key=lambda c: c.node_id ^ target)[:k]
    assert lookup.closest() == expected


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**32),
    n=st.integers(min_value=2, max_value=40),
    k=st.integers(min_value=1, max_value=8),
    alpha=st.integers(min_value=1, max_value=5),
)
def test_lookup_never_queries_twice_or_itself_whatever_peers_reply(
    seed: int, n: int, k: int, alpha: int
) -> None:
    # Replies are arbitrary (random nodes, repeats, the searcher itself, failed nodes): the lookup must
    # still terminate, query each node at most once, never query itself, and return only responders.
    rng = random.Random(seed)
    nodes = random_nodes(rng, n)
    origin = nodes[0]
    failed = {c.node_id for c in nodes if rng.random() < 0.3}
    answer = {
        c.node_id: [rng.choice(nodes) for _ in range(rng.randrange(12))]
        for c in nodes
        if c.node_id not in failed
    }
    target = rng.randrange(TOP)
    lookup = Lookup(target, rng.sample(nodes, rng.randrange(1, n)), k=k, alpha=alpha, own_id=origin.node_id)
    queried = run_lookup(lookup, answer, rng)

    assert len(queried) == len(set(queried))
    assert origin.node_id not in queried
    result = ids(lookup.closest())
    assert set(result) <= set(queried) - failed
    assert result == sorted(result, key=lambda node_id: node_id ^ target)
    assert len(result) <= k
