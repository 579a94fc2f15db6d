"""The trainer's answer check (shared.swarm.answers): shape, finiteness and scale, with a bound a minority
of servers cannot inflate."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.swarm.answers import AnswerCheck, AnswerLimits

SHAPE = (4, 16, 32)


def test_answers_refuses_wrong_shapes_and_non_finite_values() -> None:
    check = AnswerCheck()
    assert check.problem((4, 16, 31), SHAPE, finite=True, rms=1.0) == (
        "shape (4, 16, 31) is not the expected (4, 16, 32)"
    )
    assert check.problem(SHAPE, SHAPE, finite=False, rms=1.0) == "non-finite values"
    assert check.problem(SHAPE, SHAPE, finite=True, rms=math.nan) == "non-finite values"
    assert check.problem(SHAPE, SHAPE, finite=True, rms=1.0) is None


def test_answers_only_the_absolute_cap_applies_during_warm_up() -> None:
    check = AnswerCheck(AnswerLimits(warmup=3, max_rms=100.0))
    assert check.problem(SHAPE, SHAPE, finite=True, rms=1.0) is None
    assert check.problem(SHAPE, SHAPE, finite=True, rms=90.0) is None  # no median yet
    assert check.problem(SHAPE, SHAPE, finite=True, rms=101.0) is not None
    assert check.problem(SHAPE, SHAPE, finite=True, rms=1.0) is None
    # warm: accepted (1, 90, 1), lower median 1, bound 10
    assert check.bound() == 10.0
    assert check.problem(SHAPE, SHAPE, finite=True, rms=11.0) == "RMS 11 exceeds the bound 10"
    assert check.problem(SHAPE, SHAPE, finite=True, rms=3.0) is None  # honest variation passes


def test_answers_refused_answers_do_not_move_the_bound() -> None:
    check = AnswerCheck(AnswerLimits(warmup=2, window=4))
    for _ in range(4):
        check.problem(SHAPE, SHAPE, finite=True, rms=1.0)
    for _ in range(50):
        assert check.problem(SHAPE, SHAPE, finite=True, rms=50.0) is not None
    assert check.bound() == 10.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(1.0, 2.0), min_size=200, max_size=300),
    st.floats(1e-3, 1e3),
    st.integers(3, 6),
)
def test_answers_a_minority_cannot_raise_the_bound_past_k_honest_scales(
    honest: list[float], scale: float, every: int
) -> None:
    check = AnswerCheck()
    largest = 0.0
    for i, r in enumerate(honest):
        if i % every == every - 1:  # an attacker answers as large as is accepted, one answer in `every`
            check.problem(SHAPE, SHAPE, finite=True, rms=check.bound())
        else:
            assert check.problem(SHAPE, SHAPE, finite=True, rms=r * scale) is None
            largest = max(largest, r * scale)
    assert check.bound() <= AnswerLimits().factor * largest * (1 + 1e-12)


def test_answers_limits_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="factor"):
        AnswerLimits(factor=1.0)
    with pytest.raises(ValueError, match="warmup"):
        AnswerLimits(warmup=10, window=5)
    with pytest.raises(ValueError, match="max_rms"):
        AnswerLimits(max_rms=math.inf)
