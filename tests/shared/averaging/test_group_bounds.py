"""Properties of the pure bounds behind robust averaging (shared.averaging.groups, issue 9 findings 5-6)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.averaging.groups import (
    NORM_CAP_MULTIPLE,
    WEIGHT_CAP_MULTIPLE,
    WeightHistory,
    average_norm_bound,
    bound_weights,
    leader_of,
    lower_median,
)

weights = st.floats(min_value=0.0, max_value=2.0**53, allow_nan=False)


@given(
    honest=st.lists(st.floats(min_value=1.0, max_value=1e6), min_size=1, max_size=12),
    liars=st.lists(weights, max_size=11),
)
def test_bound_weights_a_liar_minority_weighs_at_most_eight_honest_maxima(
    honest: list[float], liars: list[float]
) -> None:
    liars = liars[: len(honest) - 1] if len(honest) > 1 else []  # a strict honest majority of senders
    claims = honest + liars
    bounded = bound_weights(claims)
    assert all(0.0 <= b <= c for b, c in zip(bounded, claims, strict=True))
    assert bounded[: len(honest)] == [
        min(h, WEIGHT_CAP_MULTIPLE * lower_median([c for c in claims if c > 0])) for h in honest
    ]
    assert max(bounded) <= WEIGHT_CAP_MULTIPLE * max(honest)  # the median is between honest claims


@given(claims=st.lists(weights, min_size=1, max_size=16), cap=st.floats(min_value=1.0, max_value=1e9))
def test_bound_weights_never_exceeds_the_run_cap(claims: list[float], cap: float) -> None:
    assert all(b <= cap for b in bound_weights(claims, cap))


@given(members=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=10, unique=True))
def test_leader_is_a_member_and_independent_of_order(members: list[str]) -> None:
    leader = leader_of("avg.3.x", members)
    assert leader in members
    assert leader_of("avg.3.x", list(reversed(members))) == leader


@settings(max_examples=50)
@given(
    norms=st.lists(st.floats(min_value=0.1, max_value=1e3), min_size=1, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_average_norm_bound_holds_for_any_weighted_mean_of_parts_within_their_claims(
    norms: list[float], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    numel = 64
    parts = []
    for claim in norms:  # a part of a vector whose whole norm is the claim: the part is at most that long
        v = rng.standard_normal(numel)
        parts.append(v / np.linalg.norm(v) * claim * rng.uniform(0, 1))
    w = rng.uniform(0.1, 10.0, size=len(parts))
    mean = (w[:, None] * np.stack(parts)).sum(axis=0) / w.sum()
    if max(norms) <= NORM_CAP_MULTIPLE * sorted(norms)[len(norms) // 2]:  # honest-looking claims
        assert float(np.linalg.norm(mean)) <= average_norm_bound(norms, "none", numel)
    assert average_norm_bound(norms, "none", numel) <= math.sqrt(len(norms)) * max(norms) * 1.001


@given(
    history=st.lists(st.tuples(st.floats(0.1, 100.0), st.floats(0.0, 1e4)), max_size=10),
    claim=weights,
    floor=st.floats(0.0, 1e4),
)
def test_weight_history_bound_is_between_the_floor_and_the_claim(
    history: list[tuple[float, float]], claim: float, floor: float
) -> None:
    book = WeightHistory(keep=4)
    now = 0.0
    for gap, weight in history:
        now += gap
        book.record("p", weight, now)
    bound = book.bound("p", claim, now + 1.0, floor)
    assert min(claim, floor) <= bound <= claim


@given(
    honest=st.lists(st.floats(min_value=0.0, max_value=1e3), min_size=1, max_size=8),
    liars=st.lists(st.floats(min_value=0.0, max_value=1e30), max_size=7),
)
def test_average_norm_bound_cannot_be_opened_by_a_liar_minority(
    honest: list[float], liars: list[float]
) -> None:
    liars = liars[: len(honest) - 1] if len(honest) > 1 else []
    norms = honest + liars
    bound = average_norm_bound(norms, "none", 1000)
    assert bound <= math.sqrt(len(norms)) * NORM_CAP_MULTIPLE * max(honest) * 1.001 + 1e-12
