"""Group sizing, Moshpit grid keys and adaptive deadlines (pure)."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.auth.keys import Identity
from shared.averaging.groups import (
    adaptive_deadline,
    choose_group_size,
    grid_coordinates,
    grid_dims,
    group_key,
)


def test_choose_group_size_is_large_for_reliable_peers_and_small_for_flaky_ones() -> None:
    assert choose_group_size(100, 0.0, max_size=32) == 32
    assert choose_group_size(100, 0.001) == 32
    assert choose_group_size(100, 0.05) == 2  # (0.95)^2 = 0.9025 >= 0.9
    assert choose_group_size(100, 0.01) == 10  # (0.99)^10 = 0.904
    assert choose_group_size(3, 0.0) == 3  # never more than there are peers


@given(st.integers(1, 10_000), st.floats(0, 0.99), st.integers(2, 64))
@settings(max_examples=200, deadline=None)
def test_choose_group_size_meets_the_spoil_bound_when_it_can(n: int, f: float, max_size: int) -> None:
    m = choose_group_size(n, f, max_size=max_size)
    assert 1 <= m <= min(n, max_size)
    if m > 2:
        assert (1 - f) ** m >= 0.9 - 1e-9


@given(st.integers(1, 100_000), st.integers(2, 64))
def test_grid_dims_is_the_smallest_grid_that_holds_everyone(n: int, m: int) -> None:
    d = grid_dims(n, m)
    assert m**d >= n
    assert d == 1 or m ** (d - 1) < n


def test_group_keys_alternate_and_partition_the_peers() -> None:
    peers = [Identity.generate().peer_id for _ in range(64)]
    m, d = 4, grid_dims(64, 4)
    assert d == 3
    for round_ in range(d):
        keys = {p: group_key(p, epoch=7, round_=round_, dims=d, group_size=m) for p in peers}
        for _p, key in keys.items():  # the free coordinate is the round's
            assert key.split(".")[round_ % d] == "*"
            assert len(key.split(".")) == d
        sizes = Counter(keys.values())
        assert sum(sizes.values()) == len(peers)
    a, b = peers[0], peers[1]
    assert grid_coordinates(a, 1, d, m) != grid_coordinates(a, 2, d, m) or grid_coordinates(
        b, 1, d, m
    ) != grid_coordinates(b, 2, d, m)  # cells change with the epoch


def test_adaptive_deadline_grows_with_observed_slowness_and_is_bounded() -> None:
    assert adaptive_deadline(2.0, []) == 15.0 + 6.0
    assert adaptive_deadline(2.0, [1.0, 4.0]) == 15.0 + 2.0 * 8.0
    assert adaptive_deadline(math.inf, []) == 3600.0
    assert adaptive_deadline(1e9, [1.0]) == 3600.0
