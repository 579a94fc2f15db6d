"""Byzantine-robust aggregation of one slice, and the norm bound derived from the group's own statistics.

Notation: the senders of a slice, in **sorted peer-id order**, deliver ``x_1 … x_n`` (float32 vectors of
``d`` elements, each already checked finite) with weights ``w_i > 0`` (sample counts; weight-0 senders
never reach these functions), ``W = Σ w_i``. ``lmed(a_1 … a_n)`` is the *lower median*: the element of
rank ``(n - 1) // 2`` (0-based) of the sorted values; with ``f < n/2`` arbitrary values among them it lies
between the smallest and the largest honest value (at least ``n - f > n/2`` values are honest, so both
``rank <= (n-1)//2`` and ``rank >= (n-1)//2`` contain an honest one). The *weight allowance* of sender
``i`` is ``a_i = sqrt(max(1, lmed(w) / w_i))``: an honest mean gradient over ``w`` samples has
``E||x||² = ||g||² + tr(Σ)/w``, so a batch smaller than the median one may be ``sqrt(lmed(w)/w_i)``
times longer, a larger one is not expected to be longer.

**Norm bound** (:func:`norm_outliers`; on by default, factor ``k`` = ``AveragingSpec.norm_factor``, default
10). With ``M = lmed(||x_1|| … ||x_n||)``, sender ``i`` is rejected (and banned for the round) when ``||x_i||
> k · a_i · M``. It is robust because ``M`` is set by the honest majority: ``f < n/2`` senders can neither
raise ``M`` above the largest honest norm nor lower it below the smallest one. So an attacker's accepted part
has ``||x_i|| <= k · a_i · max_honest_norm`` and moves the weighted mean by at most ``w_i · k · a_i ·
max_honest_norm / W``; claiming a small weight buys a larger ``a_i`` but not more influence (``w_i · a_i <=
sqrt(w_i · lmed(w)) <= lmed(w)`` for ``w_i <= lmed(w)``). Why k = 10: honest parts of one group,
weight-corrected, differ by the batch-to-batch fluctuation of the gradient norm. Measured on tiny-mlm (114k
parameters, 16,384-element parts as the all-reduce cuts them, batches 4, 16, 16, 64 and twice that group, 20
rounds): at most 2.6x the lower median, and 5.8x the *smallest* honest norm, which is as low as attackers
sending zeros can push ``M``; k = 10 leaves room above both. A part that stays within k honest norms can still
bias the mean: that is the robust rules' business. With **one sender** there is nothing to compare with: ``M``
is its own norm and only finiteness and the absolute limits apply. With **two**, ``M`` is the smaller norm: of
two parts more than ``k · a_i`` apart, the larger one (the one that could do damage) is rejected, since no
majority can say who is honest. When ``M = 0`` (most senders' part is exactly zero: sparse gradients such as
untouched embedding rows, or an honest peer that sent zeros) there is no scale to judge by and the bound
rejects nothing: rejecting every non-zero part would ban the one honest peer that did touch those rows. That
leaves the weighted mean open in such parts; CenteredClip and the trimmed mean close it (their median start
and ``τ`` are 0 there, so a lone non-zero part is clipped to nothing). The check needs every sender's part, so
the aggregator holds a part's inputs until all arrived (it already does, for the deterministic sum): at most
``senders x part size`` bytes (8 x 4 MiB per part in flight).

**Weighted mean** (``rule = "mean"``): ``Σ w_i x_i / W`` summed in float64 in sender order
(:mod:`shared.averaging.reducer`).

**CenteredClip** (``rule = "centered-clip"``; BTARD, Gorbunov et al. 2021; Karimireddy et al. 2021)::

    v_0     = coordinate-wise median of x_1 … x_n          (robust start: within the honest range per
                                                              coordinate for f < n/2, weights ignored)
    τ_i     = τ · a_i,   τ = c · lmed(||x_j - v_0|| / a_j)  (c = clip_factor, default 1)
    v_{t+1} = v_t + Σ_i (w_i / W) · (x_i - v_t) · min(1, τ_i / ||x_i - v_t||)

The fixed point is the weighted mean of the inputs, each pulled to within ``τ_i`` of the result; the iteration
stops when a step moves ``v`` by at most ``1e-4 · τ`` or after ``clip_iterations`` (default 20) steps. *Honest
case*: before iterating, the weighted mean ``m`` (bit-identical to ``rule = "mean"``) is returned if every
``||x_i - m|| <= τ_i``, because ``m`` is then the exact fixed point; so without outliers CenteredClip costs a
median, two passes over the inputs, and changes nothing. *Guarantee* (Karimireddy et al. 2021, used by BTARD):
for a small enough fraction ``δ`` of Byzantine inputs and honest inputs of variance ``s²``, a radius ``τ ~
s/sqrt(δ)`` gives ``E||v - x̄_honest||² = O(δ s²)``: the error shrinks with the attackers' share instead of
growing with their values; here ``τ`` is estimated from the group itself. What holds for *any* inputs here:
each step is a weighted average of vectors of norm ``<= τ_i``, so ``||v_T - v_0|| <= T · max τ_i``, and
``v_0`` and ``τ`` are set by the honest majority (median arguments above): a minority moves the result by an
amount bounded by the honest inputs' spread, whatever it sends. The flip side, measured by
``scripts/bench_robust.py``: an attacker that stays within that spread (a sign-flipped gradient when the
peers' gradient noise is as large as their mean, as on tiny-mlm at 16 to 64 samples per peer) is barely
clipped, and no rule here can tell it from an honest peer in one round; Karimireddy et al. make CenteredClip
effective there by clipping the peers' *momenta* (noise shrunk by ``1/(1 - β)``), which would change what
peers send. Why c = 1: on tiny-mlm it cut the sign-flip's damage (final loss 2.9 % above the honest run at 16
samples per peer, 1.6 % at 64; c = 2: 3.7 % and 2.2 %, plain mean 3.7 % and 2.3 %) and cost the honest run
under 0.1 %; with c = 2 concentrated honest inputs more often get the mean bit for bit. If most inputs equal
the median (``τ = 0``), the result is that median.

**Trimmed mean** (``rule = "trimmed-mean"``): for every coordinate, the ``n`` values are sorted (ties by
weight, then sender: equal values of equal weight are interchangeable, so relabelling the senders changes
nothing), the ``b`` smallest and ``b`` largest are dropped, ``b = min(max(1, floor(β·n)), (n - 1) // 2)``
for ``β > 0`` (``β = trim_fraction``, default 0.25: 3 to 7 senders ``b = 1``, 8 to 11 ``b = 2``; 2
senders ``b = 0``, the plain mean), and the rest is averaged *with its weights*:
``Σ_kept w_i x_i / Σ_kept w_i``. With ``f <= b`` arbitrary senders every kept value lies between the
smallest and the largest honest value of that coordinate, whatever the weights claim, and so does the
result.

**Determinism.** Every rule is a function of the *set* of ``(sender, weight, values)``: inputs are taken in
sorted sender order, accumulated in float64 in that order (or in rank order, for the trimmed mean,
with ties by weight, then sender), and rounded to float32 once. Iteration counts depend only on the values, so
any member computing it gets the same bits; in practice only the aggregator computes, and every member
pulls its bytes.

**Cost** (``scripts/bench_robust.py``): the norm bound reuses the norm computed when each part was
checked (one float32 dot product; float64 when that overflows). The per-coordinate work (the median
start, the trimmed mean) sorts ``CHUNK`` coordinates at a time with a sorting network over the ``n`` rows
(``n`` rounds of whole-row ``minimum``/``maximum``), not one sort call per coordinate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from protocols.training import AggregationRule, AveragingSpec

__all__ = [
    "CHUNK",
    "ClipReport",
    "aggregate",
    "allowances",
    "centered_clip",
    "coordinate_median",
    "sort_columns",
    "lower_median",
    "norm_outliers",
    "sq_norm",
    "trimmed_count",
    "trimmed_mean",
    "weighted_mean",
]

Float32Array = npt.NDArray[np.float32]
Float64Array = npt.NDArray[np.float64]
#: Coordinates processed at a time by the per-coordinate rules (bounded temporaries, cache friendly).
CHUNK = 1 << 16
#: below this, a float32 sum of squares has lost digits to underflow (float32's smallest normal is 1.2e-38):
#: norms and distances that small are measured again in float64
SMALLEST_EXACT_SQUARE = 1e-30
#: CenteredClip stops once a step moves the estimate by at most this fraction of τ.
CLIP_TOLERANCE = 1e-4


def _dot(x: Float64Array) -> float:
    """``x · x`` by numpy's own loop: BLAS ``ddot`` may split the sum over threads (and was 7x slower on a
    loaded machine); this is one deterministic pass."""
    return float(np.einsum("i,i->", x, x))


def lower_median(values: Sequence[float]) -> float:
    """The element of rank ``(n - 1) // 2`` of the sorted values (module docstring)."""
    if not values:
        raise ValueError("median of nothing")
    return sorted(values)[(len(values) - 1) // 2]


def sq_norm(x: Float32Array) -> float:
    """``||x||²`` accumulated in float64, chunk by chunk (deterministic for the same values)."""
    total = 0.0
    buf = np.empty(min(CHUNK, x.size), dtype=np.float64)
    for lo in range(0, x.size, CHUNK):
        b = buf[: min(CHUNK, x.size - lo)]
        b[...] = x[lo : lo + CHUNK]
        total += _dot(b)
    return total


def allowances(weights: Sequence[float]) -> list[float]:
    """``a_i = sqrt(max(1, lmed(w) / w_i))`` for positive weights (module docstring)."""
    if any(not w > 0 for w in weights):
        raise ValueError(f"weights must be positive, got {list(weights)}")
    median = lower_median(weights)
    return [math.sqrt(max(1.0, median / w)) for w in weights]


def norm_outliers(norms: Sequence[float], weights: Sequence[float], factor: float) -> list[int]:
    """Indices of the inputs whose norm exceeds ``factor · a_i · lmed(norms)`` (module docstring)."""
    if len(norms) != len(weights):
        raise ValueError("one norm per weight")
    if not norms:
        return []
    reference = lower_median(norms)
    if not reference > 0:  # most parts are exactly zero: no scale to judge by (module docstring)
        return []
    limits = [factor * a * reference for a in allowances(weights)]
    return [i for i, (norm, limit) in enumerate(zip(norms, limits, strict=True)) if norm > limit]


def _check(inputs: Sequence[Float32Array], weights: Sequence[float]) -> int:
    if not inputs or len(inputs) != len(weights):
        raise ValueError(f"need one weight per input and some input, got {len(inputs)}/{len(weights)}")
    if any(not (math.isfinite(w) and w > 0) for w in weights):
        raise ValueError(f"weights must be finite and positive, got {list(weights)}")
    d = inputs[0].size
    if any(x.ndim != 1 or x.size != d for x in inputs):
        raise ValueError("inputs must be 1-D of one length")
    return d


def weighted_mean(inputs: Sequence[Float32Array], weights: Sequence[float]) -> Float64Array:
    """``Σ w_i x_i / W`` in float64, summed in the given order (the reducer's exact arithmetic)."""
    d = _check(inputs, weights)
    total = math.fsum(weights)
    acc = np.empty(d, dtype=np.float64)
    term = np.empty_like(acc)
    for k, (x, w) in enumerate(zip(inputs, weights, strict=True)):
        np.multiply(x, np.float64(w), out=acc if k == 0 else term)
        if k:
            acc += term
    np.divide(acc, total, out=acc)
    return acc


def sort_columns(stack: Float32Array, weights: Float64Array | None = None) -> None:
    """Sort every column of ``stack`` (``n`` rows) in place, carrying ``weights`` (same shape) along.

    An odd-even transposition network (``n`` rounds of compare-exchanges of neighbouring rows, done with
    whole-row ``minimum``/``maximum``): no per-column calls, so it is fast for the few rows of a group,
    and a fixed sequence of operations, so the outcome depends on the input order alone. Equal values
    are never exchanged, so ties keep their row order.
    """
    n = stack.shape[0]
    low = np.empty_like(stack[0])
    swap = np.empty(stack.shape[1], dtype=bool)
    for r in range(n):
        for i in range(r % 2, n - 1, 2):
            a, b = stack[i], stack[i + 1]
            if weights is not None:
                np.greater(a, b, out=swap)
                wa, wb = weights[i], weights[i + 1]
                exchanged = np.where(swap, wb, wa)
                np.copyto(wb, wa, where=swap)
                wa[...] = exchanged
            np.minimum(a, b, out=low)
            np.maximum(a, b, out=b)
            a[...] = low


def coordinate_median(inputs: Sequence[Float32Array]) -> Float64Array:
    """The per-coordinate median (the mean of the two middle values for even ``n``), in float64."""
    n, d = len(inputs), inputs[0].size
    out = np.empty(d, dtype=np.float64)
    stack = np.empty((n, min(CHUNK, d)), dtype=np.float32)
    for lo in range(0, d, CHUNK):
        hi = min(d, lo + CHUNK)
        s = stack[:, : hi - lo]
        for i, x in enumerate(inputs):
            s[i] = x[lo:hi]
        sort_columns(s)
        o = out[lo:hi]
        np.add(s[(n - 1) // 2], s[n // 2], out=o, dtype=np.float64)  # exact: float32 + float32
        o *= 0.5
    return out


@dataclass(frozen=True)
class ClipReport:
    """What CenteredClip did: iterations run (0: the mean was the fixed point), τ, and whether it stopped
    by the tolerance rather than the iteration cap."""

    iterations: int
    tau: float
    converged: bool


def _difference(x: Float32Array, v: Float64Array, v32: Float32Array, buf: Float32Array) -> tuple[Any, float]:
    """``x - v`` and its norm: in float32 (into ``buf``), or in float64 (a new array) when float32
    overflows (inputs near the float32 limit: only possible for parts that are outliers anyway) or
    underflows (differences near float32's smallest normal, whose squares would measure 0)."""
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        np.subtract(x, v32, out=buf)
        square = float(np.dot(buf, buf))
    if SMALLEST_EXACT_SQUARE <= square < math.inf or (square == 0.0 and np.array_equal(x, v)):
        return buf, math.sqrt(square)
    wide = np.subtract(x, v, dtype=np.float64)
    return wide, math.sqrt(_dot(wide))


def _distances(inputs: Sequence[Float32Array], center: Float64Array, buf: Float32Array) -> list[float]:
    center32 = center.astype(np.float32)
    return [_difference(x, center, center32, buf)[1] for x in inputs]


def centered_clip(
    inputs: Sequence[Float32Array],
    weights: Sequence[float],
    *,
    clip_factor: float = 1.0,
    max_iterations: int = 20,
    tau: float | None = None,
) -> tuple[Float64Array, ClipReport]:
    """CenteredClip of the inputs (module docstring), in float64, with what it did; ``tau`` replaces the
    radius estimated from the group (``c · lmed``), e.g. to carry one over from an earlier round.

    The estimate ``v`` and the step are accumulated in float64; the differences ``x_i - v`` and their
    norms are taken in float32 against ``v`` rounded to float32 (they only scale a step, and float32
    passes are several times cheaper), which is why the tolerance is ``1e-4 · τ``.
    """
    _check(inputs, weights)
    if not clip_factor > 0 or max_iterations < 1:
        raise ValueError(f"need clip_factor > 0 and max_iterations >= 1, got {clip_factor}, {max_iterations}")
    total = math.fsum(weights)
    a = allowances(weights)
    v = coordinate_median(inputs)
    with np.errstate(over="ignore"):
        v32 = v.astype(np.float32)  # a median of float32 values: representable
    diff = np.empty_like(v32)
    if tau is None:
        tau = clip_factor * lower_median(
            [r / ai for r, ai in zip(_distances(inputs, v, diff), a, strict=True)]
        )
    elif not tau >= 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    radii = [tau * ai for ai in a]
    mean = weighted_mean(inputs, weights)
    if all(
        r <= radius
        for r, radius in zip(_distances(inputs, mean.astype(np.float32), diff), radii, strict=True)
    ):
        return mean, ClipReport(0, tau, True)
    step = np.empty_like(v)
    for t in range(1, max_iterations + 1):
        step.fill(0.0)
        for x, w, radius in zip(inputs, weights, radii, strict=True):
            delta, r = _difference(x, v, v32, diff)
            scale = 1.0 if r <= radius else radius / r
            delta *= np.float32(w * scale / total) if delta is diff else w * scale / total
            step += delta
        v += step
        np.copyto(v32, v, casting="same_kind")
        if math.sqrt(_dot(step)) <= CLIP_TOLERANCE * tau:
            return v, ClipReport(t, tau, True)
    return v, ClipReport(max_iterations, tau, False)


def trimmed_count(n: int, trim_fraction: float) -> int:
    """``b``: values dropped at each end of every coordinate (module docstring)."""
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    wanted = max(math.floor(trim_fraction * n), 1) if trim_fraction > 0 else 0
    return min(wanted, (n - 1) // 2)


def trimmed_mean(
    inputs: Sequence[Float32Array], weights: Sequence[float], *, trim_fraction: float = 0.25
) -> Float64Array:
    """Coordinate-wise weighted trimmed mean (module docstring), in float64."""
    d = _check(inputs, weights)
    n = len(inputs)
    b = trimmed_count(n, trim_fraction)
    if b == 0:
        return weighted_mean(inputs, weights)
    by_weight = sorted(range(n), key=lambda i: weights[i])  # stable: equal weights keep sender order
    equal = len(set(weights)) == 1
    out = np.empty(d, dtype=np.float64)
    stack = np.empty((n, min(CHUNK, d)), dtype=np.float32)
    w = None if equal else np.empty((n, stack.shape[1]), dtype=np.float64)
    for lo in range(0, d, CHUNK):
        hi = min(d, lo + CHUNK)
        s = stack[:, : hi - lo]
        ws = None if w is None else w[:, : hi - lo]
        for row, i in enumerate(by_weight):
            s[row] = inputs[i][lo:hi]
            if ws is not None:
                ws[row] = weights[i]
        sort_columns(s, ws)  # ties keep (weight, sender) order
        o = out[lo:hi]
        if ws is None:  # equal weights: the plain mean of the kept ranks, in rank order
            np.add(s[b], 0.0, out=o, dtype=np.float64)
            for r in range(b + 1, n - b):
                np.add(o, s[r], out=o, dtype=np.float64)
            o /= n - 2 * b
        else:
            np.multiply(s[b], ws[b], out=o, dtype=np.float64)
            den = ws[b].copy()
            for r in range(b + 1, n - b):
                o += s[r] * ws[r]
                den += ws[r]
            o /= den
    return out


def aggregate(
    inputs: Sequence[Float32Array], weights: Sequence[float], spec: AveragingSpec
) -> tuple[Float64Array, ClipReport | None]:
    """The slice's aggregate under ``spec.rule`` in float64 (inputs in sorted sender order), with
    CenteredClip's report when that rule ran."""
    rule: AggregationRule = spec.rule
    if rule == "centered-clip":
        return centered_clip(
            inputs, weights, clip_factor=spec.clip_factor, max_iterations=spec.clip_iterations
        )
    if rule == "trimmed-mean":
        return trimmed_mean(inputs, weights, trim_fraction=spec.trim_fraction), None
    return weighted_mean(inputs, weights), None
