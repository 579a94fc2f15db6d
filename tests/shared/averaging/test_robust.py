"""Robust aggregation and the relative norm bound (shared.averaging.robust, through SliceReducer), and the
manifest's ``[averaging]`` table (protocols.training.AveragingSpec)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from protocols.averaging import PartHeader
from protocols.peer_id import PeerId
from protocols.training import AggregationRule, AveragingSpec
from shared.averaging.reducer import RejectReason, SliceReducer
from shared.averaging.robust import (
    aggregate,
    allowances,
    centered_clip,
    lower_median,
    norm_outliers,
    trimmed_count,
    trimmed_mean,
    weighted_mean,
)
from shared.errors import ConfigError
from shared.manifest import parse_training_spec

F32 = np.float32
PEERS = [PeerId(f"peer-{name}") for name in ("kilo", "alpha", "zulu", "echo", "mike", "bravo", "tango")]
RULES: tuple[AggregationRule, ...] = ("mean", "centered-clip", "trimmed-mean")


def header(index: int, offset: int, numel: int, weight: float) -> PartHeader:
    return PartHeader(
        group_id=b"g", round=1, part_index=index, offset=offset, numel=numel, codec="none", weight=weight,
        nbytes=4 * numel,
    )  # fmt: skip


def reduce(
    xs: Sequence[np.ndarray],
    weights: Sequence[float],
    spec: AveragingSpec,
    *,
    part_numel: int = 8,
    order: Sequence[tuple[int, int]] | None = None,
    peers: Sequence[PeerId] = PEERS,
) -> tuple[np.ndarray, SliceReducer]:
    numel = xs[0].size
    nparts = -(-numel // part_numel)
    reducer = SliceReducer(numel, dict.fromkeys(peers[: len(xs)]), math.inf, part_numel=part_numel, rule=spec)
    for p, k in order or [(p, k) for p in range(len(xs)) for k in range(nparts)]:
        chunk = xs[p][k * part_numel : (k + 1) * part_numel]
        reducer.add_part(peers[p], header(k, k * part_numel, chunk.size, float(weights[p])), chunk)
    return reducer.finalize(), reducer


def linear_gradients(rng: np.random.Generator, batches: Sequence[int], d: int = 512) -> list[np.ndarray]:
    """Per-batch gradients of a least-squares linear model at a random point: what honest peers of one
    round send, each the mean over its own batch (small batches: noisier, longer gradients)."""
    truth, point = rng.normal(size=d), rng.normal(size=d)
    out = []
    for b in batches:
        x = rng.normal(size=(b, d))
        y = x @ truth + rng.normal(size=b)
        out.append((2.0 / b * x.T @ (x @ point - y)).astype(F32))
    return out


values = st.floats(-1e3, 1e3, width=32)


# ------------------------------------------------------------------ the norm bound (finding 6)


def test_a_part_scaled_a_million_times_is_rejected_by_default_and_its_sender_banned() -> None:
    """Finding 6: with the defaults (no max_norm, as the all-reduce builds its reducers) the bound is on."""
    rng = np.random.default_rng(6)
    xs = linear_gradients(rng, [16, 16, 16, 16])
    honest, _ = reduce(xs[1:], [16.0] * 3, AveragingSpec(), peers=PEERS[1:])
    xs[0] = xs[0] * F32(1e6)
    result, reducer = reduce(xs, [16.0] * 4, AveragingSpec())
    report = reducer.completeness()
    assert report.banned == ((PEERS[0], RejectReason.OUTLIER_NORM),) and RejectReason.OUTLIER_NORM.bans
    assert PEERS[0] in reducer.outliers and PEERS[0] not in report.contributors
    assert result.tobytes() == honest.tobytes()  # the average of the others, as if it had not sent


@pytest.mark.parametrize("rule", RULES)
def test_honest_unequal_batches_ban_nobody(rule: AggregationRule) -> None:
    """Weights 4, 16, 16, 64 (and twice that group): small batches give longer gradients, and nobody is
    banned in any of 100 rounds, whichever rule runs."""
    rng = np.random.default_rng(4)
    for batches in [[4, 16, 16, 64]] * 50 + [[4, 16, 16, 64, 4, 16, 16]] * 50:
        xs = linear_gradients(rng, batches)
        _, reducer = reduce(xs, [float(b) for b in batches], AveragingSpec(rule=rule), part_numel=128)
        assert reducer.completeness().banned == ()


def test_weight_allowance_lets_a_small_batch_be_longer_but_not_more_influential() -> None:
    assert allowances([4.0, 16.0, 16.0, 64.0]) == [2.0, 1.0, 1.0, 1.0]
    # a norm 30x the median passes for a sender claiming weight 1/16 of the median, not for weight 1
    assert norm_outliers([30.0, 1.0, 1.0, 1.0], [1.0, 16.0, 16.0, 16.0], 10.0) == []
    assert norm_outliers([30.0, 1.0, 1.0, 1.0], [16.0, 16.0, 16.0, 16.0], 10.0) == [0]
    # and its pull on the mean stays below k · median norm · median weight / W
    mean = (1.0 * 30.0 + 3 * 16.0 * 1.0) / 49.0
    assert mean - 1.0 <= 10.0 * 1.0 * 16.0 / 49.0


def test_one_sender_has_no_reference_and_two_keep_the_shorter() -> None:
    big = np.full(8, 1e30, dtype=F32)
    result, reducer = reduce([big], [1.0], AveragingSpec())
    assert result.tobytes() == big.tobytes() and reducer.completeness().banned == ()
    small = np.ones(8, dtype=F32)
    result, reducer = reduce([big, small], [1.0, 1.0], AveragingSpec())
    assert result.tobytes() == small.tobytes()
    assert reducer.completeness().banned == ((PEERS[0], RejectReason.OUTLIER_NORM),)
    near = np.full(8, 5.0, dtype=F32)  # within k = 10 of each other: both kept
    result, reducer = reduce([near, small], [1.0, 1.0], AveragingSpec())
    assert reducer.completeness().banned == () and np.all(result == 3.0)


def test_zero_median_bans_nobody_and_the_robust_rules_clip_the_lone_part() -> None:
    """Most parts exactly zero (sparse rows): no scale, so the bound bans nobody, even for a weight whose
    allowance is infinite; the mean takes the lone part in, the robust rules clip it to nothing."""
    zero, big = np.zeros(8, dtype=F32), np.full(8, 1e30, dtype=F32)
    assert norm_outliers([1.0, 0.0, 0.0], [5e-324, 1.0, 1.0], 10.0) == []
    result, reducer = reduce([big, zero, zero], [1.0] * 3, AveragingSpec())
    assert reducer.completeness().banned == () and np.allclose(result, 1e30 / 3)
    for rule in ("centered-clip", "trimmed-mean"):
        result, reducer = reduce([big, zero, zero], [1.0] * 3, AveragingSpec(rule=rule))
        assert reducer.completeness().banned == () and not result.any(), rule


def test_a_sender_over_the_bound_in_one_part_is_out_of_every_part() -> None:
    xs = [np.ones(24, dtype=F32) for _ in range(3)]
    xs[1] = xs[1].copy()
    xs[1][16:] = 1e4  # only its last part is absurd
    result, reducer = reduce(xs, [1.0, 1.0, 1.0], AveragingSpec(), part_numel=8)
    assert reducer.completeness().banned == ((PEERS[1], RejectReason.OUTLIER_NORM),)
    assert np.all(result == 1.0)


def test_parts_near_float32s_smallest_normal_are_measured_not_rounded_to_zero() -> None:
    """Found by hypothesis: squares of values near 1e-34 underflow in float32, so honest parts measured 0
    and the relative bound had no scale to hold a liar of norm 1 to; and distances near 1.2e-38 measured 0,
    so with a radius of 0 every input looked within it and CenteredClip returned the mean."""
    tiny = np.array([1.1440573e-34], dtype=F32)
    liar = np.array([1.0], dtype=F32)
    result, reducer = reduce([liar, tiny, tiny], [1.0, 1.0, 1.0], AveragingSpec(), part_numel=1)
    assert reducer.completeness().banned == ((PEERS[0], RejectReason.OUTLIER_NORM),)
    assert result.tobytes() == tiny.tobytes()
    xs = [np.zeros(1, dtype=F32), np.zeros(1, dtype=F32), np.array([1.1754944e-38], dtype=F32)]
    clipped, reducer = reduce(xs, [1.0, 1.0, 1.0], AveragingSpec("centered-clip", math.inf, clip_factor=1e6))
    assert reducer.clip_report is not None and reducer.clip_report.tau == 0.0  # most inputs are the median
    assert np.array_equal(clipped, np.zeros(1, dtype=F32))  # ... so it is the result, not the mean


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_mean_under_the_bound_stays_within_k_honest_norms(data: st.DataObject) -> None:
    """However a minority lies (values and weights), the bounded mean is no longer than k · a · the
    longest honest part: it is a convex combination of parts that passed."""
    n = data.draw(st.integers(3, 7))
    bad = data.draw(st.integers(1, (n - 1) // 2))
    d = data.draw(st.integers(1, 24))
    xs = [data.draw(arrays(F32, d, elements=values)) for _ in range(n)]
    scale = data.draw(st.sampled_from([1.0, 1e6, 1e30]))
    for i in range(bad):
        xs[i] = (xs[i] * F32(scale)).astype(F32)
    weights = [float(data.draw(st.integers(1, 1000))) for _ in range(n)]
    assume(all(x.any() for x in xs[bad:]))  # honest parts all zero: no scale (another test)
    result, _ = reduce(xs, weights, AveragingSpec(), part_numel=d)
    longest = max(float(np.linalg.norm(x.astype(np.float64))) for x in xs[bad:])
    bound = 10.0 * max(allowances(weights)) * longest
    assert float(np.linalg.norm(result.astype(np.float64))) <= bound * (1 + 1e-6) + 1e-30


# ------------------------------------------------------------------ the rules


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_rule_is_bit_identical_in_any_arrival_order(data: st.DataObject) -> None:
    n, d, part = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 30)), data.draw(st.integers(1, 12))
    xs = [data.draw(arrays(F32, d, elements=values)) for _ in range(n)]
    weights = [float(data.draw(st.integers(1, 100))) for _ in range(n)]
    arrivals = [(p, k) for p in range(n) for k in range(-(-d // part))]
    shuffled = data.draw(st.permutations(arrivals))
    for rule in RULES:
        spec = AveragingSpec(rule=rule, norm_factor=math.inf)
        first, _ = reduce(xs, weights, spec, part_numel=part, order=arrivals)
        again, _ = reduce(xs, weights, spec, part_numel=part, order=shuffled)
        assert first.tobytes() == again.tobytes(), rule


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_rule_is_invariant_under_relabelling_the_senders(data: st.DataObject) -> None:
    """The same (weight, values) pairs under other peer ids (so in another summation order): the same
    result up to float64 rounding."""
    n, d = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 30))
    xs = [data.draw(arrays(F32, d, elements=values)) for _ in range(n)]
    weights = [float(data.draw(st.integers(1, 100))) for _ in range(n)]
    relabel = data.draw(st.permutations(range(n)))
    for rule in RULES:
        spec = AveragingSpec(rule=rule, norm_factor=math.inf)
        first, _ = reduce(xs, weights, spec)
        other, _ = reduce([xs[i] for i in relabel], [weights[i] for i in relabel], spec)
        assert np.allclose(first, other, rtol=1e-5, atol=1e-3), rule


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_centered_clip_with_a_large_radius_is_exactly_the_mean(data: st.DataObject) -> None:
    n, d = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 30))
    xs = [data.draw(arrays(F32, d, elements=values)) for _ in range(n)]
    weights = [float(data.draw(st.integers(1, 100))) for _ in range(n)]
    mean, _ = reduce(xs, weights, AveragingSpec(norm_factor=math.inf))
    assert centered_clip(xs, weights, tau=1e30)[0].astype(F32).tobytes() == mean.tobytes()
    clipped, reducer = reduce(xs, weights, AveragingSpec("centered-clip", math.inf, clip_factor=1e6))
    report = reducer.clip_report
    exact = np.float64(mean)
    farthest = max(float(np.linalg.norm(x.astype(np.float64) - exact)) for x in xs)
    if n > 1 and report is not None and report.tau == 0.0:  # most inputs equal the median: that is it
        assert np.array_equal(
            clipped, np.median(np.stack(xs).astype(np.float64), axis=0).astype(F32)
        )  # -0.0 == 0.0
    elif n == 1 or report is None or farthest <= report.tau:  # every radius (>= tau) holds every input
        assert clipped.tobytes() == mean.tobytes()
        assert n == 1 or (report is not None and report.iterations == 0)
    else:  # tau is c x the median distance, which can be tiny beside one far input (0, 1, 1.9e-14):
        # then it clips, and every iterate stays a convex combination of the inputs
        stack = np.stack(xs)
        assert np.all(clipped >= stack.min(axis=0) - 1e-6) and np.all(clipped <= stack.max(axis=0) + 1e-6)


def test_without_outliers_the_robust_rules_are_the_mean() -> None:
    """Honest, concentrated inputs: CenteredClip with c = 2 returns the mean bit for bit (with the default
    c = 1 it clips the farther half a little); the trimmed mean stays within the inputs' spread of it."""
    rng = np.random.default_rng(1)
    base = rng.normal(size=4096)
    xs = [(base + 1e-3 * rng.normal(size=base.size)).astype(F32) for _ in range(5)]
    weights = [1.0, 2.0, 3.0, 2.0, 1.0]
    mean = weighted_mean(xs, weights)
    clipped, report = centered_clip(xs, weights, clip_factor=2.0)
    assert report.iterations == 0 and clipped.tobytes() == mean.tobytes()
    spread = np.ptp(np.stack(xs), axis=0)
    assert np.all(np.abs(trimmed_mean(xs, weights) - mean) <= spread)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_a_minority_moves_the_robust_rules_a_bounded_amount(data: st.DataObject) -> None:
    """f < n/2 arbitrary inputs, from 1x to 1e30x the honest scale: the trimmed mean (f <= b) stays in the
    honest per-coordinate range; CenteredClip within the bound its docstring proves, which depends on the
    honest inputs alone."""
    n = data.draw(st.integers(3, 7))
    d = data.draw(st.integers(1, 16))
    honest = [data.draw(arrays(F32, d, elements=values)) for _ in range(n)]
    weights = [float(data.draw(st.integers(1, 1000))) for _ in range(n)]
    f = data.draw(st.integers(1, (n - 1) // 2))
    scale = data.draw(st.sampled_from([1.0, 1e3, 1e30]))
    xs = [(data.draw(arrays(F32, d, elements=values)) * F32(scale)).astype(F32) for _ in range(f)]
    xs += honest[f:]
    h = np.stack(honest[f:]).astype(np.float64)
    if f <= trimmed_count(n, 0.25):
        trimmed = trimmed_mean(xs, weights)
        assert np.all(h.min(axis=0) <= trimmed) and np.all(trimmed <= h.max(axis=0))
    equal = [1.0] * n
    clipped, report = centered_clip(xs, equal, max_iterations=5)
    box = float(np.linalg.norm(h.max(axis=0) - h.min(axis=0)))  # the median start lies in this box
    spread = max(float(np.linalg.norm(row - h.mean(axis=0))) for row in h)
    assert report.tau <= 2.0 * (spread + box) * (1 + 1e-9) + 1e-9  # set by the honest majority
    bound = box + spread + max(1, report.iterations) * report.tau
    assert float(np.linalg.norm(clipped - h.mean(axis=0))) <= bound * (1 + 1e-9) + 1e-6


def test_centered_clip_and_trimmed_mean_resist_scaled_and_flipped_gradients() -> None:
    rng = np.random.default_rng(9)
    for attack in (100.0, -1.0):
        # the signal dominates the noise (CenteredClip's bias is about δ·τ, τ ~ the honest spread)
        xs = linear_gradients(rng, [4096] * 4, d=64)
        honest = weighted_mean(xs[1:], [1.0] * 3)
        xs[0] = (xs[0] * F32(attack)).astype(F32)
        plain = weighted_mean(xs, [1.0] * 4)
        for rule in ("centered-clip", "trimmed-mean"):
            robust, _ = aggregate(xs, [1.0] * 4, AveragingSpec(rule=rule))
            err = np.linalg.norm(robust - honest) / np.linalg.norm(honest)
            assert err < 0.25 * np.linalg.norm(plain - honest) / np.linalg.norm(honest), (rule, attack)


def test_trimmed_mean_counts_and_small_groups() -> None:
    assert [trimmed_count(n, 0.25) for n in range(1, 9)] == [0, 0, 1, 1, 1, 1, 1, 2]
    one, two = np.ones(3, dtype=F32), np.full(3, 2.0, dtype=F32)
    assert trimmed_mean([one, two], [1.0, 3.0]).tolist() == [1.75] * 3  # b = 0: the weighted mean
    three = np.full(3, 100.0, dtype=F32)
    assert trimmed_mean([three, one, two], [1.0, 1.0, 5.0]).tolist() == [2.0] * 3  # b = 1: the median
    assert lower_median([3.0, 1.0, 2.0, 4.0]) == 2.0


def test_robust_functions_refuse_bad_arguments() -> None:
    x = np.ones(2, dtype=F32)
    with pytest.raises(ValueError, match="positive"):
        weighted_mean([x], [0.0])
    with pytest.raises(ValueError, match="one length"):
        trimmed_mean([x, np.ones(3, dtype=F32)], [1.0, 1.0])
    with pytest.raises(ValueError, match="some input"):
        centered_clip([], [])
    with pytest.raises(ValueError, match="trim_fraction"):
        trimmed_count(4, 0.5)


# ------------------------------------------------------------------ the manifest


def test_manifest_selects_the_rule_and_refuses_nonsense() -> None:
    spec = parse_training_spec(b'[averaging]\nrule = "centered-clip"\nclip_factor = 3.0\n')
    assert spec.averaging == AveragingSpec(rule="centered-clip", clip_factor=3.0)
    assert AveragingSpec().clip_factor == 1.0
    assert parse_training_spec(b"task = 'tiny-mlm'\n").averaging == AveragingSpec()
    for bad in (
        b'[averaging]\nrule = "median"\n',
        b"[averaging]\nnorm_factor = inf\n",
        b"[averaging]\nnorm_factor = nan\n",
        b"[averaging]\nnorm_factor = 1.0\n",
        b"[averaging]\ntrim_fraction = 0.5\n",
        b"[averaging]\nclip_iterations = 0\n",
        b"[averaging]\nmax_norm = 5.0\n",
    ):
        with pytest.raises(ConfigError):
            parse_training_spec(bad)
