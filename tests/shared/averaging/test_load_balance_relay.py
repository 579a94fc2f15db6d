"""The adaptive-averaging program with relayed peers (``load_balance``, "Relays").

The reference here is written independently of the module, connection by connection: every computing peer
dials every other aggregator, pushes its part of that slice and pulls the average back; a connection to a
relayed aggregator goes through its relay (unless the relay itself dials), loading each hop's upload and
download, and every byte the relay forwards counts against its slot limit. Brute force enumerates every
compute set on that reference.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from shared.averaging import PeerSpec, Plan, plan_all_reduce, plan_averaging, plan_parameter_server
from shared.averaging.load_balance import _problem
from shared.averaging.load_balance_model import max_rates, relay_load
from shared.averaging.load_balance_search import _best_of_size, _best_single_capped, _pair_limits

MB = 1e6
Caps = Mapping[tuple[int, int], float]


def spec(samples: float, mb: float, *, relay: int | None = None, cap_mb: float | None = None) -> PeerSpec:
    return PeerSpec(
        samples, mb * MB, mb * MB, relay=relay, relay_capacity_bps=None if cap_mb is None else cap_mb * MB
    )


def loads(peers: Sequence[PeerSpec], compute: Sequence[bool]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-peer upload, download and forwarded bytes/s per unit of each ``x_j``: matrices (n, n)."""
    n = len(peers)
    up, down, forwarded = np.zeros((n, n)), np.zeros((n, n)), np.zeros((n, n))
    for a, j in itertools.permutations(range(n), 2):
        if not compute[a] or peers[j].client_mode:
            continue
        r = peers[j].relay
        path = [a, j] if r is None or r == a else [a, r, j]
        for u, v in itertools.pairwise(path):  # push x_j along the path, pull x_j back along it
            up[u, j] += 1.0
            down[v, j] += 1.0
            up[v, j] += 1.0
            down[u, j] += 1.0
        if len(path) == 3:
            forwarded[r, j] += 2.0
    return up, down, forwarded


def pair_load(peers: Sequence[PeerSpec], compute: Sequence[bool], i: int, j: int) -> np.ndarray:
    """Bytes/s from i to j end to end per unit of each x (what a pairwise cap t_ij bounds)."""
    row = np.zeros(len(peers))
    if compute[i] and not peers[j].client_mode:
        row[j] += 1.0
    if compute[j] and not peers[i].client_mode:
        row[i] += 1.0
    return row


def reference_rate(peers: Sequence[PeerSpec], compute: Sequence[bool], caps: Caps | None = None) -> float:
    n = len(peers)
    if sum(compute) == 1 and any(c and not p.client_mode for c, p in zip(compute, peers, strict=True)):
        return math.inf
    up, down, forwarded = loads(peers, compute)
    a_ub = [*up, *down]
    b_ub = [p.upload_bps for p in peers] + [p.download_bps for p in peers]
    for r, p in enumerate(peers):
        if p.relay_capacity_bps is not None:
            a_ub.append(forwarded[r])
            b_ub.append(p.relay_capacity_bps)
    for (i, j), cap in (caps or {}).items():
        a_ub.append(pair_load(peers, compute, i, j))
        b_ub.append(cap)
    bounds = [(0.0, 0.0 if p.client_mode else None) for p in peers]
    res = linprog(-np.ones(n), A_ub=np.array(a_ub), b_ub=b_ub, bounds=bounds, method="highs")
    assert res.status == 0, res.message
    return float(-res.fun)


def brute_force(peers: Sequence[PeerSpec], batch: float, size: float, caps: Caps | None = None) -> float:
    best = -math.inf
    for bits in itertools.product([False, True], repeat=len(peers)):
        if any(bits):
            samples = sum(p.samples_per_second for p, c in zip(peers, bits, strict=True) if c)
            best = max(best, min(samples / batch, reference_rate(peers, bits, caps) / size))
    return best


def worst_load(plan: Plan, peers: Sequence[PeerSpec], size: float, caps: Caps | None = None) -> float:
    if math.isinf(plan.comm_rate):
        return 0.0
    x = np.array(plan.fractions) * plan.comm_rate * size
    up, down, forwarded = loads(peers, plan.compute)
    worst = max(
        float((up @ x / [p.upload_bps for p in peers]).max()),
        float((down @ x / [p.download_bps for p in peers]).max()),
    )
    for r, p in enumerate(peers):
        if p.relay_capacity_bps is not None and forwarded[r] @ x > 0:
            worst = max(
                worst, math.inf if p.relay_capacity_bps == 0 else forwarded[r] @ x / p.relay_capacity_bps
            )
    for (i, j), cap in (caps or {}).items():
        worst = max(worst, pair_load(peers, plan.compute, i, j) @ x / cap)
    return worst


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


# -- strategies ------------------------------------------------------------------------------------------

samples_st = st.one_of(st.sampled_from([0.0, 1.0, 5.0, 20.0]), st.floats(0.1, 100.0))
bandwidth_st = st.one_of(st.sampled_from([1.0, 3.0, 10.0, 100.0]), st.floats(0.2, 200.0)).map(
    lambda mb: mb * MB
)


@st.composite
def relayed_groups(draw: st.DrawFn, max_peers: int = 6) -> list[PeerSpec]:
    """Peers of which some are relayed by others (and some relays have a slot limit)."""
    n = draw(st.integers(2, max_peers))
    client = [draw(st.booleans()) and draw(st.booleans()) for _ in range(n)]  # ~1 in 4
    relay: list[int | None] = [None] * n
    relays: set[int] = set()
    for i in range(n):
        if client[i] or i in relays or not draw(st.booleans()):
            continue
        options = [j for j in range(n) if j != i and not client[j] and relay[j] is None]
        if options:
            relay[i] = draw(st.sampled_from(options))
            relays.add(relay[i])
    peers = [
        PeerSpec(
            draw(samples_st),
            draw(bandwidth_st),
            draw(bandwidth_st),
            client[i],
            relay=relay[i],
            relay_capacity_bps=draw(st.one_of(st.none(), bandwidth_st.map(lambda b: b / 8), st.just(0.0)))
            if i in relays
            else None,
        )
        for i in range(n)
    ]
    assume(any(not p.client_mode for p in peers))
    assume(any(p.samples_per_second > 0 for p in peers))
    assume(any(p.relay is not None for p in peers))
    return peers


@st.composite
def caps_for(draw: st.DrawFn, n: int) -> dict[tuple[int, int], float] | None:
    if draw(st.booleans()):
        return None
    pairs = draw(
        st.sets(
            st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).filter(lambda p: p[0] != p[1]), max_size=6
        )
    )
    return {pair: draw(bandwidth_st) / 4 for pair in sorted(pairs)}


batch_st = st.floats(1.0, 5000.0)
size_st = st.floats(1e5, 1e9)
SLOW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- exactness and feasibility ---------------------------------------------------------------------------


@given(peers=relayed_groups(), batch=batch_st, size=size_st, data=st.data())
@SLOW
def test_relayed_plan_matches_brute_force_over_all_compute_sets(
    peers: list[PeerSpec], batch: float, size: float, data: st.DataObject
) -> None:
    caps = data.draw(caps_for(len(peers)))
    plan = plan_averaging(peers, batch, size, pairwise=caps, time_limit=None)
    assert plan.gap == 0.0
    assert close(plan.steps_per_second, brute_force(peers, batch, size, caps))
    assert worst_load(plan, peers, size, caps) <= 1 + 1e-6
    assert plan == plan_averaging(peers, batch, size, pairwise=caps, time_limit=None)  # deterministic


@given(peers=relayed_groups(), batch=st.floats(500.0, 5000.0), size=st.floats(1e7, 3e8), data=st.data())
@SLOW
def test_relayed_plan_matches_brute_force_where_communication_binds(
    peers: list[PeerSpec], batch: float, size: float, data: st.DataObject
) -> None:
    # batches and gradients where many peers compute and the links bind: the search's MILP route runs often
    caps = data.draw(caps_for(len(peers)))
    plan = plan_averaging(peers, batch, size, pairwise=caps, time_limit=None)
    assert close(plan.steps_per_second, brute_force(peers, batch, size, caps))
    assert worst_load(plan, peers, size, caps) <= 1 + 1e-6


@given(peers=relayed_groups(), batch=st.floats(500.0, 5000.0), size=st.floats(1e7, 3e8), data=st.data())
@SLOW
def test_relayed_plan_with_no_budget_is_feasible_and_its_gap_holds(
    peers: list[PeerSpec], batch: float, size: float, data: st.DataObject
) -> None:
    # time_limit=0: no MILP runs; the plan is the incumbent re-rated under the relay rows, and the optimum
    # lies within its reported gap
    caps = data.draw(caps_for(len(peers)))
    plan = plan_averaging(peers, batch, size, pairwise=caps, time_limit=0.0)
    best = brute_force(peers, batch, size, caps)
    assert worst_load(plan, peers, size, caps) <= 1 + 1e-6
    assert plan.steps_per_second <= best * (1 + 1e-7)
    assert best <= plan.steps_per_second / (1 - plan.gap) * (1 + 1e-7)


@given(peers=relayed_groups(), batch=st.floats(500.0, 5000.0), size=st.floats(1e7, 3e8), data=st.data())
@SLOW
def test_fixed_size_milp_with_relay_rows_finds_the_best_set_of_each_size(
    peers: list[PeerSpec], batch: float, size: float, data: st.DataObject
) -> None:
    caps = data.draw(caps_for(len(peers)))
    p = _problem(peers, batch, size, caps)
    cand = np.flatnonzero(p.s > 0)
    for k in range(2, len(cand) + 1):
        best = -math.inf
        for members in itertools.combinations(cand.tolist(), k):
            bits = [i in members for i in range(len(peers))]
            samples = sum(peers[i].samples_per_second for i in members)
            best = max(best, min(samples / batch, reference_rate(peers, bits, caps) / size))
        if best <= 0:
            continue
        # as in the search, the floor is an incumbent to beat: just below the best of size k, the MILP finds a
        # set that good (its rows do not cut the optimum); just above it, none (they do not let worse sets
        # pass). 1e-3: the MILP's rows other than the relay rows are in units of the fastest link, where
        # HiGHS's MIP feasibility tolerance (1e-6) blurs closer ties on links ~100x slower.
        limits = _pair_limits(p, cand)
        found, open_bound = _best_of_size(p, cand, k, best * 1.5, best * (1 - 1e-3), limits, None)
        above = _best_of_size(p, cand, k, best * 1.5, best * (1 + 1e-3), limits, None)
        # HiGHS status 4 ("Solve error", also seen without relays on such floors) leaves the size open with
        # its bound (no set, a finite bound): that case is the search's to report as a gap, not this test's
        gave_up = (found is None and open_bound > -math.inf) or (above[0] is None and above[1] > -math.inf)
        assume(not gave_up)
        assert found is not None and int(found.sum()) == k and open_bound == -math.inf
        samples = float(p.s[found].sum())
        assert min(samples / batch, reference_rate(peers, found.tolist(), caps) / size) >= best * (1 - 1e-3)
        assert above[0] is None and above[1] == -math.inf


@given(peers=relayed_groups(), data=st.data())
@SLOW
def test_relay_rate_lp_matches_the_connection_by_connection_reference(
    peers: list[PeerSpec], data: st.DataObject
) -> None:
    compute = data.draw(st.lists(st.booleans(), min_size=len(peers), max_size=len(peers)).filter(any))
    p = _problem(peers, 100.0, 1e6, None)
    total, x = max_rates(p, np.array(compute))
    expected = reference_rate(peers, compute)
    if math.isinf(expected):
        assert math.isinf(total)
        return
    assert close(total * p.scale, expected)
    _, _, forwarded = loads(peers, compute)
    assert np.allclose(relay_load(p, np.array(compute), x), forwarded @ x, rtol=1e-9, atol=1e-12)


@given(peers=relayed_groups(), data=st.data())
@SLOW
def test_best_lone_client_closed_form_matches_the_lp(peers: list[PeerSpec], data: st.DataObject) -> None:
    caps = data.draw(caps_for(len(peers)))
    p = _problem(peers, 100.0, 1e6, caps)
    cand = np.flatnonzero(p.s > 0)
    value, _ = _best_single_capped(p, cand)
    best = -math.inf
    for c in cand:
        compute = np.zeros(p.n, dtype=bool)
        compute[c] = True
        best = max(best, min(p.s[c] / p.batch, max_rates(p, compute)[0] / p.size))
    assert close(value, best, 1e-7)


@given(peers=relayed_groups(), batch=batch_st, size=size_st)
@SLOW
def test_a_relayed_peer_is_never_planned_worse_than_in_client_mode(
    peers: list[PeerSpec], batch: float, size: float
) -> None:
    relayed = plan_averaging(peers, batch, size, time_limit=None)
    as_clients = [
        PeerSpec(p.samples_per_second, p.download_bps, p.upload_bps, p.client_mode or p.relay is not None)
        for p in peers
    ]
    assume(any(not p.client_mode for p in as_clients))
    clients = plan_averaging(as_clients, batch, size, time_limit=None)
    assert relayed.steps_per_second >= clients.steps_per_second * (1 - 1e-7)
    direct = [PeerSpec(p.samples_per_second, p.download_bps, p.upload_bps, p.client_mode) for p in peers]
    assert relayed.steps_per_second <= plan_averaging(
        direct, batch, size, time_limit=None
    ).steps_per_second * (1 + 1e-7)


# -- special cases ---------------------------------------------------------------------------------------


def test_a_relay_with_ample_spare_bandwidth_plans_as_if_its_peer_were_direct() -> None:
    # four GPUs on 10 MB/s bound X at 10 MB/s; two CPU-only aggregators take the slices, one of them behind
    # NAT and relayed by the other, whose 200 MB/s carry its own slice and the relayed one with room to spare
    gpus = [spec(10.0, 10.0) for _ in range(4)]
    direct = [*gpus, spec(0.0, 20.0), spec(0.0, 200.0)]
    relayed = [*gpus, spec(0.0, 20.0, relay=5), spec(0.0, 200.0, cap_mb=100.0)]
    a = plan_averaging(direct, 16, 5 * MB, numel=10_000, time_limit=None)
    b = plan_averaging(relayed, 16, 5 * MB, numel=10_000, time_limit=None)
    assert a.compute == b.compute == (True,) * 4 + (False,) * 2
    assert close(a.steps_per_second, b.steps_per_second, 1e-7)
    assert (a.fractions, a.slices) == (b.fractions, b.slices)  # exactly: the no-relay split fits
    assert b.fractions[4] > 0.05
    x = np.array(b.fractions) * b.comm_rate * 5 * MB
    up, _, forwarded = loads(relayed, b.compute)
    assert forwarded[5] @ x > 0 and up[5] @ x < 0.5 * 200 * MB  # the relay forwards, with room to spare
    assert "relays slack" in b.method


@given(peers=relayed_groups(), batch=batch_st, size=size_st)
@SLOW
def test_relays_that_carry_the_direct_plan_change_nothing(
    peers: list[PeerSpec], batch: float, size: float
) -> None:
    direct = [PeerSpec(p.samples_per_second, p.download_bps, p.upload_bps, p.client_mode) for p in peers]
    plan = plan_averaging(direct, batch, size, time_limit=None)
    assume(worst_load(plan, peers, size) <= 1.0)  # the relays can carry the direct plan's traffic
    relayed = plan_averaging(peers, batch, size, time_limit=None)
    assert close(relayed.steps_per_second, plan.steps_per_second, 1e-7)


def test_a_relay_with_no_spare_capacity_leaves_its_peer_only_the_client_role() -> None:
    # the relay's slot limit is 0: its relayed peer aggregates nothing, exactly as in client mode
    peers = [spec(10.0, 10.0, cap_mb=0.0), spec(10.0, 10.0), spec(10.0, 10.0), spec(10.0, 10.0, relay=0)]
    plan = plan_averaging(peers, 4096, 10 * MB, numel=1000, time_limit=None)
    clients = [*peers[:3], PeerSpec(10.0, 10 * MB, 10 * MB, True)]
    assert plan.fractions[3] == 0.0 and plan.slices[3] == 0
    assert close(
        plan.steps_per_second, plan_averaging(clients, 4096, 10 * MB, time_limit=None).steps_per_second
    )
    assert all(plan.compute)


def test_a_relay_at_its_slot_limit_shrinks_its_peers_slice_to_what_it_carries() -> None:
    # as above, but the relay forwards at most 2 MB/s: slice 4 shrinks to 2 MB/s / (2 · 4 dialers) and the
    # relay's own slice takes the rest, so the group's rate is unchanged
    gpus = [spec(10.0, 10.0) for _ in range(4)]
    direct = plan_averaging([*gpus, spec(0.0, 20.0), spec(0.0, 200.0)], 16, 5 * MB, time_limit=None)
    peers = [*gpus, spec(0.0, 20.0, relay=5), spec(0.0, 200.0, cap_mb=2.0)]
    plan = plan_averaging(peers, 16, 5 * MB, time_limit=None)
    x = np.array(plan.fractions) * plan.comm_rate * 5 * MB
    assert close(x[4], 2 * MB / 8)
    assert close(plan.steps_per_second, direct.steps_per_second, 1e-7)
    assert plan.fractions[4] < direct.fractions[4]
    assert worst_load(plan, peers, 5 * MB) <= 1 + 1e-6
    assert close(plan.steps_per_second, brute_force(peers, 16, 5 * MB))


def test_a_relay_whose_link_is_full_makes_the_lp_trade_compute_for_averaging() -> None:
    # the relay's 30 MB/s cannot carry its own slice and slice 4 at the direct plan's rates (4 dialers: each
    # byte of slice 4 costs it 8, of its own slice 4); the optimum found by the MILP takes a GPU out of the
    # compute set (it aggregates instead), fewer dialers make relaying cheaper, and the relay's link is full
    gpus = [spec(10.0, 10.0) for _ in range(4)]
    peers = [*gpus, spec(0.0, 20.0, relay=5), spec(0.0, 30.0)]
    plan = plan_averaging(peers, 16, 5 * MB, time_limit=None)
    direct = plan_averaging([*gpus, spec(0.0, 20.0), spec(0.0, 30.0)], 16, 5 * MB, time_limit=None)
    assert sum(plan.compute) == 3 and sum(direct.compute) == 4
    assert "milp" in plan.method
    assert 0 < plan.fractions[4] < direct.fractions[4]
    assert plan.steps_per_second < direct.steps_per_second
    x = np.array(plan.fractions) * plan.comm_rate * 5 * MB
    up, _, forwarded = loads(peers, plan.compute)
    assert forwarded[5] @ x > 0 and close(up[5] @ x, 30 * MB)
    assert close(plan.steps_per_second, brute_force(peers, 16, 5 * MB))


def test_a_relay_link_without_spare_bandwidth_trades_its_own_slice_against_relaying() -> None:
    # no slot limit, but the relay's own link is the bottleneck: the LP splits it between its own slice and
    # forwarding, whatever maximizes the group's rate, and stays feasible and optimal
    size = 10 * MB
    peers = [spec(10.0, 4.0), spec(10.0, 20.0), spec(10.0, 20.0), spec(10.0, 20.0, relay=0)]
    plan = plan_averaging(peers, 4096, size, time_limit=None)
    p = _problem(peers, 4096, size, None)
    x = np.array(plan.fractions) * plan.comm_rate * size / p.scale
    own = 3 * x[0] + (x.sum() - x[0])  # k = 4: (k-1) x_0 received + (X - x_0) sent
    assert close((own + relay_load(p, np.array(plan.compute), x)[0]) * p.scale, 4.0 * MB, 1e-6)
    assert close(plan.steps_per_second, brute_force(peers, 4096, size))


def test_forced_plans_account_for_relays() -> None:
    peers = [spec(10.0, 10.0, cap_mb=1.0), spec(10.0, 10.0), spec(10.0, 10.0, relay=0)]
    ar = plan_all_reduce(peers, 4096, 10 * MB)
    assert worst_load(ar, peers, 10 * MB) == pytest.approx(1.0)
    ps = plan_parameter_server(peers, 2, 4096, 10 * MB)
    assert worst_load(ps, peers, 10 * MB) == pytest.approx(1.0)
    assert ps.comm_rate * 10 * MB == pytest.approx(0.5 * MB)  # relay forwards 2 · 1 dialer · X <= 1 MB/s


# -- validation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peers", "match"),
    [
        ([spec(1.0, 1.0), spec(1.0, 1.0, relay=5)], r"relay = 5: not a member index in \[0, 2\)"),
        ([spec(1.0, 1.0), spec(1.0, 1.0, relay=1)], "cannot relay itself"),
        (
            [PeerSpec(1.0, MB, MB, True), spec(1.0, 1.0, relay=0)],
            "member 0 is in client mode and cannot relay",
        ),
        (
            [spec(1.0, 1.0), spec(1.0, 1.0, relay=0), spec(1.0, 1.0, relay=1)],
            r"member 1 is itself relayed \(by 0\)",
        ),
    ],
)
def test_planners_reject_impossible_relays(peers: list[PeerSpec], match: str) -> None:
    for plan in (plan_averaging, plan_all_reduce):
        with pytest.raises(ValueError, match=match):
            plan(peers, 100, 1e6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"relay": -1}, "relay must be a member index"),
        ({"relay": True}, "relay must be a member index"),
        ({"relay": 1.0}, "relay must be a member index"),
        ({"relay": 1, "client_mode": True}, "not in client mode"),
        ({"relay_capacity_bps": -1.0}, "relay_capacity_bps must be a non-negative"),
        ({"relay_capacity_bps": math.inf}, "relay_capacity_bps must be a non-negative"),
    ],
)
def test_peer_spec_rejects_bad_relay_fields(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        PeerSpec(1.0, MB, MB, **kwargs)  # type: ignore[arg-type]
