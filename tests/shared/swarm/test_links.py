"""The rules a forming swarm run applies to its link records (shared.swarm.links): sampling, bounds, the
matrix fill, and the deterministic placement every server computes alike."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.errors import ProtocolError
from protocols.swarm import MAX_LINK_RTT, MAX_LINK_SAMPLES, LinkRecord, LinkSample, decode_link_record
from shared.swarm.links import (
    DEFAULT_BANDWIDTH,
    DEFAULT_RTT,
    MAX_BANDWIDTH,
    MIN_BANDWIDTH,
    bandwidths,
    bounded_links,
    formation_placement,
    network,
    round_trips,
    sample_peers,
)
from shared.swarm.placement_cost import Workload, iteration_cost
from shared.swarm.rebalance import ServerReport, place_newcomer

PEERS = [f"p{i:02d}" for i in range(12)]
rtts = st.one_of(
    st.floats(min_value=-1.0, max_value=1e3), st.sampled_from([math.nan, math.inf, -math.inf, 1e9])
)


@st.composite
def measurements(draw: st.DrawFn, n: int | None = None) -> tuple[list[str], dict[str, dict[str, float]]]:
    count = draw(st.integers(2, 9)) if n is None else n
    peers = PEERS[:count]
    measured: dict[str, dict[str, float]] = {}
    for a in peers:
        targets = draw(st.lists(st.sampled_from([*peers, "stranger"]), max_size=count + 1))
        measured[a] = {b: draw(rtts) for b in targets}
    return peers, measured


@given(st.integers(0, 12), st.integers(0, 12), st.sampled_from(PEERS))
def test_sampling_picks_k_others_stably_as_peers_join(n: int, k: int, me: str) -> None:
    peers = PEERS[:n]
    picked = sample_peers(me, peers, k)
    assert len(picked) == min(k, len([p for p in peers if p != me]))
    assert me not in picked and len(set(picked)) == len(picked)
    assert picked == sample_peers(me, list(reversed(peers)), k)  # order of discovery does not matter
    if n < len(PEERS):
        newcomer = PEERS[n]
        later = sample_peers(me, [*peers, newcomer], k)
        assert set(later) <= set(picked) | {newcomer}  # a join displaces at most one sampled pair


def test_sampling_measures_fewer_than_all_pairs_yet_every_server_some() -> None:
    peers = [f"peer-{i}" for i in range(40)]
    measured = {(a, b) for a in peers for b in sample_peers(a, peers, 8)}
    pairs = {frozenset(p) for p in measured}
    assert len(pairs) < 40 * 39 // 2 // 2  # far fewer than all pairs
    assert all(sum(a in p for p in pairs) >= 8 for a in peers)


@given(
    st.sampled_from(PEERS),
    st.lists(st.tuples(st.sampled_from([*PEERS, "x"]), rtts), max_size=3 * MAX_LINK_SAMPLES),
)
def test_a_writer_claims_are_bounded(writer: str, samples: list[tuple[str, float]]) -> None:
    members = PEERS[:6]
    kept = bounded_links(writer, samples, members)
    assert len(kept) <= MAX_LINK_SAMPLES
    assert set(kept) <= set(members) - {writer}  # never itself, never a stranger
    assert all(0.0 <= v <= MAX_LINK_RTT for v in kept.values())
    for peer, value in kept.items():  # the first finite claim per peer, clamped
        first = next(r for p, r in samples if p == peer and math.isfinite(r))
        assert value == min(max(first, 0.0), MAX_LINK_RTT)


@given(measurements())
def test_the_filled_matrix_is_symmetric_bounded_and_keeps_what_was_measured(
    case: tuple[list[str], dict[str, dict[str, float]]],
) -> None:
    peers, measured = case
    out = round_trips(peers, measured)
    assert out.shape == (len(peers), len(peers))
    assert np.array_equal(out, out.T) and np.all(np.diag(out) == 0)
    assert np.all(np.isfinite(out)) and np.all((out >= 0) & (out <= MAX_LINK_RTT))
    kept = {a: bounded_links(a, row.items(), peers) for a, row in measured.items()}
    for i, a in enumerate(peers):
        for j, b in enumerate(peers):
            ways = [x for x in (kept.get(a, {}).get(b), kept.get(b, {}).get(a)) if x is not None]
            if i != j and ways:
                assert out[i, j] == pytest.approx(sum(ways) / len(ways))
    assert np.array_equal(out, round_trips(peers, dict(reversed(list(measured.items())))))


def test_missing_pairs_are_filled_by_the_triangle_rule_then_the_median() -> None:
    # two sites 0.2 s apart; nobody measured its own site's other server
    peers = ["a1", "a2", "b1", "b2"]
    measured = {"a1": {"b1": 0.2, "b2": 0.2}, "a2": {"b1": 0.2, "b2": 0.2}}
    out = round_trips(peers, measured)
    assert out[0, 1] == pytest.approx(0.2)  # L = 0, U = 0.4: the midpoint
    measured["a1"]["a2"] = 0.0
    out = round_trips(peers, measured)
    assert out[2, 3] == pytest.approx(0.2)  # via a1 and a2: L = 0, U = 0.4
    far = round_trips(["a", "b", "c", "d"], {"a": {"b": 0.1}, "c": {"d": 0.3}})
    assert far[0, 2] == pytest.approx(0.2)  # no common neighbour: the median of the measured
    assert np.all(round_trips(["a", "b", "c"], {})[~np.eye(3, dtype=bool)] == DEFAULT_RTT)
    exact = round_trips(["a", "b", "c"], {"a": {"b": 0.1, "c": 0.5}, "b": {"c": 0.4}})
    assert exact[0, 1] == pytest.approx(0.1) and exact[1, 2] == pytest.approx(0.4)


@given(
    st.dictionaries(
        st.sampled_from(PEERS[:6]),
        st.tuples(st.floats(allow_nan=True), st.floats(allow_nan=True)),
    )
)
def test_bandwidths_are_symmetric_and_clamped(caps: dict[str, tuple[float, float]]) -> None:
    peers = PEERS[:6]
    out = bandwidths(peers, caps)
    off = ~np.eye(6, dtype=bool)
    assert np.array_equal(out, out.T) and np.all(np.isinf(np.diag(out)))
    assert np.all((out[off] >= MIN_BANDWIDTH) & (out[off] <= MAX_BANDWIDTH))


def test_bandwidth_of_a_pair_is_the_mean_of_its_directions_bottlenecks() -> None:
    out = bandwidths(["a", "b", "c"], {"a": (10e6, 100e6), "b": (20e6, 5e6)})
    assert out[0, 1] == pytest.approx((min(10e6, 5e6) + min(20e6, 100e6)) / 2)
    assert out[0, 2] == out[1, 2] == pytest.approx(out[0, 1])  # c published nothing: the median
    assert np.all(bandwidths(["a", "b"], {})[0, 1] == DEFAULT_BANDWIDTH)


WORK = Workload(3, stage_bytes=1e6, activation_bytes=1e4)


def _random_case(n: int, seed: int) -> tuple[dict[str, float], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    peers = PEERS[:n]
    joined = {p: float(rng.integers(0, 3)) for p in peers}
    upper = np.triu(rng.uniform(0.001, 0.3, (n, n)), 1)
    rtt = upper + upper.T
    return joined, rtt, bandwidths(peers, {})


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 11), st.integers(0, 2**16))
def test_the_placement_is_deterministic_balanced_and_serves_every_stage(n: int, seed: int) -> None:
    joined, rtt, bandwidth = _random_case(n, seed)
    placed = formation_placement(joined, rtt, bandwidth, WORK, "run", generations=10)
    again = formation_placement(
        dict(reversed(list(joined.items()))), rtt, bandwidth, WORK, "run", generations=10
    )
    assert dict(placed.stages) == dict(again.stages)  # every server computes the same
    assert set(placed.stages) == set(joined)
    m = 3 * (n // 3)
    assert len(placed.scheduled) == m and len(placed.leftovers) == n - m
    # the earliest joiners are scheduled
    order = sorted(joined, key=lambda p: (joined[p], p))
    assert list(placed.scheduled) == order[:m]
    counts = [sum(1 for p in placed.scheduled if placed.stages[p] == k) for k in range(3)]
    assert counts == [n // 3] * 3  # balanced groups
    served = {placed.stages[p] for p in joined}
    assert len(served) == min(3, n)  # every stage once there are enough servers
    assert len({placed.stages[p] for p in placed.leftovers}) == len(placed.leftovers)  # leftovers spread


def test_the_scheduler_keeps_sites_together_and_orders_them_by_distance() -> None:
    sites = {"a1": "A", "a2": "A", "b1": "B", "b2": "B", "c1": "C", "c2": "C"}
    between = {frozenset("AB"): 0.2, frozenset("BC"): 0.2, frozenset("AC"): 1.0}
    peers = sorted(sites)
    rtt = np.array(
        [
            [
                0.0 if p == q else 0.002 if sites[p] == sites[q] else between[frozenset(sites[p] + sites[q])]
                for q in peers
            ]
            for p in peers
        ]
    )
    bandwidth = bandwidths(peers, {})
    joined = dict.fromkeys(peers, 0.0)
    placed = formation_placement(joined, rtt, bandwidth, WORK, "run")
    groups = [{sites[p] for p in peers if placed.stages[p] == k} for k in range(3)]
    assert all(len(g) == 1 for g in groups)  # each stage served by one site
    assert groups[1] == {"B"}  # the middle site in the middle: A and C are far apart
    # the place_newcomer rule, joining in id order, would not see the sites at all
    reports: list[ServerReport] = []
    for p in peers:
        reports.append(ServerReport(p, place_newcomer(reports, 3, tiebreak=p), 1.0))
    net = network(rtt, bandwidth)
    newcomer = [[peers.index(r.peer) for r in reports if r.stage == k] for k in range(3)]
    scheduled = [[peers.index(p) for p in peers if placed.stages[p] == k] for k in range(3)]
    best, blind = iteration_cost(net, WORK, scheduled).total, iteration_cost(net, WORK, newcomer).total
    assert best <= blind
    if any(len({sites[peers[i]] for i in g}) > 1 for g in newcomer):  # it mixed sites: strictly worse
        assert best < 0.8 * blind


def test_a_link_record_out_of_bounds_does_not_decode() -> None:
    peer = "12D3KooW" + "a" * 44
    good = LinkRecord(3, 1.0, ["/ip4/127.0.0.1/tcp/1"], [LinkSample(peer, 0.1)])
    assert decode_link_record(msgspec.msgpack.encode(good)) == good
    bad = [
        {"stages": 3, "started": 1.0, "addrs": [], "links": [[peer, 0.1]] * (MAX_LINK_SAMPLES + 1)},
        {"stages": 3, "started": 1.0, "addrs": [], "links": [[peer, MAX_LINK_RTT * 2]]},
        {"stages": 3, "started": 1.0, "addrs": [], "links": [[peer, -1.0]]},
        {"stages": 3, "started": 1.0, "addrs": [], "links": [[peer, math.nan]]},
        {"stages": 3, "started": math.inf, "addrs": []},
        {"stages": 3, "started": 1.0, "addrs": [], "links": [["not a peer id", 0.1]]},
        {"stages": 0, "started": 1.0, "addrs": []},
    ]
    for value in bad:
        with pytest.raises(ProtocolError):
            decode_link_record(msgspec.msgpack.encode(value))
