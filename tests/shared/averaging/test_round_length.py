"""The DiLoCo round length (shared.averaging.round_length): monotone, bounded, and meets the fraction."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.averaging.load_balance import PeerSpec, plan_averaging
from shared.averaging.round_length import DEFAULT_FRACTION, round_length

rates = st.lists(st.floats(0.0, 1e5), min_size=1, max_size=8).filter(lambda r: sum(r) > 1e-3)
seconds = st.floats(0.0, 1e4)
fractions = st.floats(1e-3, 1.0)
bounds = st.tuples(st.integers(1, 10**7), st.integers(0, 10**9)).map(lambda b: (b[0], b[0] + b[1]))


@given(rates, seconds, seconds, fractions, bounds)
def test_round_length_grows_with_the_averaging_time(
    s: list[float], a: float, b: float, f: float, nb: tuple[int, int]
) -> None:
    lo, hi = sorted((a, b))
    short = round_length(s, lo, fraction=f, min_samples=nb[0], max_samples=nb[1])
    long = round_length(s, hi, fraction=f, min_samples=nb[0], max_samples=nb[1])
    assert short.target_samples <= long.target_samples


@given(rates, seconds, fractions, fractions, bounds)
def test_round_length_shrinks_as_the_allowed_fraction_grows(
    s: list[float], a: float, f: float, g: float, nb: tuple[int, int]
) -> None:
    tight, loose = sorted((f, g))
    strict = round_length(s, a, fraction=tight, min_samples=nb[0], max_samples=nb[1])
    lax = round_length(s, a, fraction=loose, min_samples=nb[0], max_samples=nb[1])
    assert lax.target_samples <= strict.target_samples


@given(rates, st.floats(1.0, 100.0), seconds, fractions, bounds)
def test_round_length_grows_with_the_collaboration_speed(
    s: list[float], factor: float, a: float, f: float, nb: tuple[int, int]
) -> None:
    slow = round_length(s, a, fraction=f, min_samples=nb[0], max_samples=nb[1])
    fast = round_length([x * factor for x in s], a, fraction=f, min_samples=nb[0], max_samples=nb[1])
    assert slow.target_samples <= fast.target_samples


@given(rates, st.one_of(seconds, st.just(math.inf)), fractions, bounds)
def test_round_length_respects_bounds_and_meets_the_fraction_when_it_can(
    s: list[float], a: float, f: float, nb: tuple[int, int]
) -> None:
    r = round_length(s, a, fraction=f, min_samples=nb[0], max_samples=nb[1])
    assert nb[0] <= r.target_samples <= nb[1]
    assert r.fraction == pytest.approx(a * sum(s) / r.target_samples, rel=1e-9)
    assert r.compute_seconds == pytest.approx(r.target_samples / sum(s), rel=1e-9)
    if r.bound == "max":
        assert r.required_samples > nb[1] and r.target_samples == nb[1]
        assert r.fraction > f * (1 - 1e-9)  # the fraction could not be met
    else:
        assert r.fraction <= f * (1 + 1e-9)
        if r.bound == "min":
            assert r.target_samples == nb[0] and r.required_samples < nb[0]
        else:  # the shortest round that meets it: one sample fewer would not
            assert r.target_samples == math.ceil(r.required_samples)
            assert r.target_samples - 1 < r.required_samples


def test_round_length_example_and_its_bounds() -> None:
    # 3 members, 100 samples/s in all; averaging 2 s; 5 %: compute must last 40 s, so 4000 samples
    r = round_length([50.0, 30.0, 20.0], 2.0, min_samples=256, max_samples=100_000)
    assert (r.target_samples, r.bound, r.compute_seconds) == (4000, None, 40.0)
    assert r.fraction == pytest.approx(DEFAULT_FRACTION)
    assert round_length([100.0], 2.0, max_samples=1000).bound == "max"
    assert round_length([100.0], 2.0, max_samples=1000).fraction == pytest.approx(0.2)
    assert round_length([100.0], 0.0, min_samples=64, max_samples=1000).bound == "min"


def test_round_length_from_an_lp_plan() -> None:
    """The averaging time comes from the LP: 4 peers on 20 Mbit/s links, a 10M-parameter vector in 8 bit."""
    peers = [
        PeerSpec(samples_per_second=s, download_bps=2.5e6, upload_bps=2.5e6) for s in (40.0, 20.0, 10.0, 10.0)
    ]
    vector_bytes = 10_000_000 + 4 * -(-10_000_000 // 4096)
    plan = plan_averaging(peers, target_batch=4096, gradient_bytes=vector_bytes)
    r = round_length([p.samples_per_second for p in peers], plan.averaging_seconds, max_samples=10**7)
    assert r.bound is None and r.fraction <= DEFAULT_FRACTION
    assert r.compute_seconds >= plan.averaging_seconds / DEFAULT_FRACTION * (1 - 1e-9)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"samples_per_second": [], "averaging_seconds": 1.0}, "samples_per_second"),
        ({"samples_per_second": [0.0, 0.0], "averaging_seconds": 1.0}, "no member computes"),
        ({"samples_per_second": [1.0, -1.0], "averaging_seconds": 1.0}, "samples_per_second"),
        ({"samples_per_second": [1.0], "averaging_seconds": -1.0}, "averaging_seconds"),
        ({"samples_per_second": [1.0], "averaging_seconds": math.nan}, "averaging_seconds"),
        ({"samples_per_second": [1.0], "averaging_seconds": 1.0, "fraction": 0.0}, "fraction"),
        ({"samples_per_second": [1.0], "averaging_seconds": 1.0, "min_samples": 0}, "min_samples"),
        ({"samples_per_second": [1.0], "averaging_seconds": 1.0, "min_samples": 9, "max_samples": 8}, "<="),
    ],
)
def test_round_length_refuses_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    kwargs.setdefault("max_samples", 1000)
    with pytest.raises(ValueError, match=match):
        round_length(**kwargs)  # type: ignore[arg-type]
