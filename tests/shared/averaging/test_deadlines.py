"""The stall timeout (shared.averaging.deadlines): bounded, monotone, and sane for whatever strangers say."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from shared.averaging.deadlines import (
    FACTOR,
    FLOOR,
    MAX_TIMEOUT,
    PartTimes,
    expected_part_seconds,
    stall_timeout,
    upper_median,
)

anything = st.floats(allow_nan=True, allow_infinity=True)
sane = st.floats(min_value=0.0, max_value=1e6)
measurements = st.lists(anything, max_size=20)


@given(anything, measurements, anything)
def test_stall_timeout_is_never_below_the_floor_nor_above_the_ceiling(
    expected: float, measured: list[float], ceiling: float
) -> None:
    timeout = stall_timeout(expected, measured, ceiling)
    cap = ceiling if math.isfinite(ceiling) and ceiling > 0 else MAX_TIMEOUT
    assert math.isfinite(timeout)
    assert FLOOR <= timeout <= max(FLOOR, min(cap, MAX_TIMEOUT))


@given(anything, anything, measurements, anything)
def test_stall_timeout_is_monotone_in_the_expected_part_time(
    a: float, b: float, measured: list[float], ceiling: float
) -> None:
    low, high = sorted(x if not math.isnan(x) else 0.0 for x in (a, b))
    assert stall_timeout(low, measured, ceiling) <= stall_timeout(high, measured, ceiling)


@given(anything, st.lists(sane, min_size=1, max_size=20), st.integers(0, 19), sane, anything)
def test_stall_timeout_is_monotone_in_every_measurement(
    expected: float, measured: list[float], i: int, more: float, ceiling: float
) -> None:
    i %= len(measured)
    raised = [*measured[:i], measured[i] + more, *measured[i + 1 :]]
    assert stall_timeout(expected, measured, ceiling) <= stall_timeout(expected, raised, ceiling)


@given(anything, measurements, sane, sane)
def test_stall_timeout_is_monotone_in_the_ceiling(
    expected: float, measured: list[float], a: float, b: float
) -> None:
    low, high = sorted((a + 1e-9, b + 1e-9))
    assert stall_timeout(expected, measured, low) <= stall_timeout(expected, measured, high)


@given(sane, st.lists(sane, max_size=20))
def test_stall_timeout_is_the_factor_times_the_typical_part_time_between_the_bounds(
    expected: float, measured: list[float]
) -> None:
    typical = max(expected, upper_median(measured))
    assert stall_timeout(expected, measured) == max(FLOOR, min(MAX_TIMEOUT, FACTOR * typical))


def test_one_slow_measurement_in_three_does_not_move_the_timeout() -> None:
    assert stall_timeout(0.0, [1.0, 1.0, 1000.0]) == FACTOR * 1.0
    assert stall_timeout(0.0, [1.0, 100.0, 100.0]) == FACTOR * 100.0  # a majority is slow: so are we


@given(anything, st.integers(-5, 10**9), st.lists(st.integers(0, 10**9), max_size=8))
def test_expected_part_seconds_is_at_most_the_prediction_and_never_negative(
    predicted: float, part_numel: int, sizes: list[int]
) -> None:
    expected = expected_part_seconds(predicted, part_numel, sizes)
    assert expected >= 0
    if not math.isnan(predicted) and predicted > 0:
        assert expected <= predicted
    else:
        assert expected == 0


@given(sane, st.integers(1, 10**8), st.integers(1, 10**8), st.lists(st.integers(1, 10**8), min_size=1))
def test_expected_part_seconds_is_monotone_in_the_part_size(
    predicted: float, a: int, b: int, sizes: list[int]
) -> None:
    low, high = sorted((a, b))
    assert expected_part_seconds(predicted, low, sizes) <= expected_part_seconds(predicted, high, sizes)


@given(st.lists(anything, max_size=20))
def test_part_times_keep_only_sane_gaps(gaps: list[float]) -> None:
    times = PartTimes()
    for gap in gaps:
        times.observe(0.0, gap)
    assert all(math.isfinite(g) and g >= 0 for g in times.gaps)
    assert FLOOR <= times.timeout() <= MAX_TIMEOUT
