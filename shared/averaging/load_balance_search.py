"""Who computes: the 0/1 part of the adaptive-averaging program, exactly or within a time budget.

(Traffic model and notation in ``load_balance``.)

Objective of a compute set ``C`` (``k = |C|``): ``ξ(C) = min(S(C)/B, X*(C)/P)``. Facts used here:

1. *Monotonicity.* Removing a peer from ``C`` never lowers ``X*``: every row of the model has non-negative
   coefficients in the ``c_i`` (a peer that stops sending frees its own link, the aggregators' download and
   the pair links), and a removed aggregator's row ``(k-1) x_i <= X + (k-2) x_i`` only gets looser. So a
   peer with ``s_i = 0`` never computes, and only the ``m`` peers with ``s_i > 0`` are candidates.
2. *Cells.* Every ``C`` with ``k >= 3`` lies in the cell ``(k, τ)`` with ``τ = min_C w``. Over a cell,
   ``ξ <= min(topS_k(τ)/B, τ/P, F_k(τ)/P)`` where ``topS_k(τ)`` is the sum of the ``k`` largest ``s`` among
   candidates with ``w >= τ``, and ``F_k(τ)`` bounds ``F`` by the ``q_hi`` largest ``w`` of eligible
   aggregators over the smallest possible ``q`` (``q_lo = k - #eligible clients``).
3. *Incumbent.* For every ``τ``, the prefixes of the eligible candidates in order of decreasing ``s``
   (ties: larger ``w`` first) are evaluated in closed form (vectorized, O(m²)); ``k = 1`` and ``k = 2`` are
   enumerated exhaustively (O(m²)).
4. *Certificate or MILP.* If no cell bound exceeds the incumbent (relative tolerance 1e-9), the incumbent
   is optimal. Otherwise HiGHS solves the fixed-``k`` MILP below (``scipy.optimize.milp``) for each size
   whose bound still beats the incumbent, smallest first, with ``ξ >= incumbent · (1 + 1e-9)`` imposed: a
   size that cannot beat the incumbent comes back infeasible, usually after little branching. (Small sizes
   first: with binding pairwise caps few senders win, and an early good incumbent makes the larger sizes'
   proofs short.)
5. *Budget.* With a ``time_limit`` of ``T`` seconds the whole call (steps 1-4) gets ``T``: each MILP runs
   with HiGHS's ``time_limit`` set to what is left, and sizes not started when it is spent stay open. A
   size HiGHS stops early may still yield a feasible set (taken if better) and leaves its dual bound open
   (``r <= -dual / 1e4``, so ``ξ <= bound · r``; ``bound`` itself if HiGHS had no dual bound yet, e.g. the
   limit hit in presolve). With ``U`` the largest bound left open (``U`` = the incumbent when none is), the
   returned set is optimal within ``gap = 1 - ξ/U`` (0 when ``U <= ξ (1 + 1e-9)``). Since the incumbent of
   step 3 (with caps: the no-cap optimum re-rated under caps, or the best lone peer) is in hand before any
   MILP, the result is never worse than it, even if the limit hits before HiGHS finds any solution.

No fixed order of peers is optimal in general: peers trade samples/s against bandwidth and the choice hides a
cardinality-constrained knapsack, so step 4 is what makes the result exact. On measured-looking inputs the
certificate almost always holds (see ``scripts/bench_lp.py``); adversarial ties reach the MILP.

Fixed-``k`` MILP (also the route with pairwise caps). Binary ``c_i``; ``x_j``, ``X``, ``ξ`` continuous;
``Y`` bounds ``X`` (``min(P·topS_k/B, k-th largest w)``; an optimal ``x`` can always be scaled down to it) and
``x̄_j = min(w_j/(k-1), Y, (k-1)-th largest t_ij over candidate senders)`` bounds ``x_j``::

    max ξ   s.t.  X = Σ_j x_j,   B ξ <= Σ s_i c_i,   P ξ <= X,   Σ c_i = k
                  X + (k-2) x_i <= w_i + M (1 - c_i)          aggregator i          (computing)
                  k x_i <= w_i + M c_i                         aggregator i          (not computing)
                  X <= w_i + M (1 - c_i)                       client i
                  x_j <= t_ij + M (1 - c_i)                    i may send to aggregator j
                  x_i + x_j <= t_ij + M (2 - c_i - c_j)        both may compute and aggregate

with each ``M`` the smallest value that makes the row void when its condition is off. Relays
(``load_balance``, "Relays") add, for each relay ``r`` with relayed set ``R``, variables ``u_j = c_j x_j``
(``j ∈ R``; they enter with a minus sign, so ``u_j <= x_j`` and ``u_j <= x̄_j c_j`` make them exact) and, with
``F_r = 2 (k - c_r) Σ_R x_j - 2 Σ_R u_j``, the rows::

                  X + (k-2) x_r + F_r <= w_r + M (1 - c_r),    k x_r + F_r <= w_r + M c_r
                  F_r <= h_r + M (1 - c_r)  (F_r at c_r = 1),  F_r <= h_r + M c_r  (F_r at c_r = 0)

The relay rows keep fact 1 (their coefficients count the *other* computing peers) and only tighten the
model, so every closed-form bound above stays an upper bound. With pairwise caps or relays, they only
remove options, so the relaxed optimum bounds every set: if they do not bind at the relaxed optimum it is
optimal ("caps slack", "relays slack", "caps and relays slack"); otherwise ``k = 1`` is solved in closed
form and every size ``k >= 2`` whose bound ``min(no-cap bound, Σ_j x̄_j / P)`` beats the incumbent goes to
the MILP as above (with relays, ``x̄_j`` still bounds ``x_j``: rows were only added). Worst case
exponential (it is a MILP), hence the budget of step 5: on ``scripts/bench_lp.py --pairwise --caps-mb
0.05,0.5`` at 64 peers about one group in five runs into it with the default 0.8 s (15 of seeds 0-39 and
1000-1039 on one run), nearly always while proving that larger sizes cannot beat the incumbent: the big-M
rows make the relaxation weak, so those proofs branch a lot (up to 3 s for one size). In all 15 the set
found by then was the optimum (checked with ``time_limit=None``), but the bounds left open are loose, so
the reported gap (up to 0.34 there) is pessimistic. The incumbent alone (``time_limit=0``) was 1-43%
below the optimum on the same groups: the small sizes' MILPs, solved first, are what find the good sets.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from .load_balance_model import Bools, Floats, Problem, comm_bound, max_rates

__all__ = ["Choice", "choose_compute_set"]

Ints = npt.NDArray[np.intp]

REL_TOL = 1e-9
_OBJECTIVE_SCALE = 1e4  # the MILP maximizes ξ / bound · 1e4, so HiGHS's absolute gap (1e-6) is ~1e-10


@dataclass(frozen=True, eq=False)
class Choice:
    """The chosen compute set, its objective ``ξ`` (steps/s), how it was found, and a proven bound.

    ``bound`` is an upper bound on ``ξ`` over every compute set; it equals ``value`` when the choice is
    proven optimal (up to a relative 1e-9).
    """

    compute: Bools
    value: float
    how: str
    bound: float

    @property
    def gap(self) -> float:
        """``1 - value / bound``: the optimum is at most ``value / (1 - gap)``; 0 when proven optimal."""
        if self.bound <= self.value * (1 + REL_TOL) or math.isinf(self.value):
            return 0.0
        return 1.0 - self.value / self.bound


def _value(p: Problem, compute: Bools, rate: float) -> float:
    return min(float(p.s[compute].sum()) / p.batch, rate / p.size)


def _mask(n: int, members: Ints) -> Bools:
    out = np.zeros(n, dtype=bool)
    out[members] = True
    return out


def _small_sets(p: Problem, cand: Ints) -> tuple[float, Bools, float]:
    """Best set of size 1 and 2 by enumeration (no caps); also returns the best size-2 value."""
    w_agg = float(p.w[p.agg].sum())
    one = np.where(p.agg[cand], math.inf, np.minimum(p.w[cand], w_agg))
    v1 = np.minimum(p.s[cand] / p.batch, one / p.size)
    b = int(np.argmax(v1))
    best, best_set = float(v1[b]), _mask(p.n, cand[b : b + 1])
    best2 = -math.inf
    if len(cand) >= 2:
        i, j = np.triu_indices(len(cand), 1)
        a, c = cand[i], cand[j]
        rate = np.minimum(p.w[a], p.w[c])
        rate = np.where(p.agg[a] | p.agg[c], rate, np.minimum(rate, w_agg / 2))
        v2 = np.minimum((p.s[a] + p.s[c]) / p.batch, rate / p.size)
        b = int(np.argmax(v2))
        best2 = float(v2[b])
        if best2 > best:
            best, best_set = best2, _mask(p.n, np.array([a[b], c[b]]))
    return best, best_set, best2


def _cells(p: Problem, cand: Ints) -> tuple[float, Bools | None, Floats]:
    """Incumbent over τ-prefixes (k >= 3) and the cell bounds maximized over τ, by k (-inf below 3)."""
    m = len(cand)
    bound_by_k = np.full(m + 1, -math.inf)
    if m < 3:
        return -math.inf, None, bound_by_k
    order = cand[np.lexsort((-p.w[cand], -p.s[cand]))]
    s, w, agg = p.s[order], p.w[order], p.agg[order]
    taus = np.unique(w)
    eligible = w[None, :] >= taus[:, None]  # (thresholds, candidates in s order)
    w_agg = float(p.w[p.agg].sum())

    # incumbent: prefixes of the eligible candidates in s order
    k = np.cumsum(eligible, axis=1)
    big_s = np.cumsum(eligible * s, axis=1)
    q = np.cumsum(eligible & agg, axis=1)
    w_both = np.cumsum(eligible * (w * agg), axis=1)
    slowest = np.minimum.accumulate(np.where(eligible, w, np.inf), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.where(q > 0, (2 * w_both + (k - 2) * w_agg) / (k * (k - 2 + q)), w_agg / k)
    value = np.minimum(big_s / p.batch, np.minimum(slowest, f) / p.size)
    value = np.where(eligible & (k >= 3), value, -math.inf)
    t, j = np.unravel_index(int(np.argmax(value)), value.shape)
    best = float(value[t, j])
    best_set = _mask(p.n, order[: j + 1][eligible[t, : j + 1]]) if best > -math.inf else None

    # bounds per cell (τ, k): top-k s, top-q w among eligible aggregators, fewest aggregators possible
    kk = np.arange(1, m + 1)[None, :]
    top_s = np.cumsum(-np.sort(-np.where(eligible, s, 0.0), axis=1), axis=1)
    top_w = np.cumsum(-np.sort(-np.where(eligible & agg, w, 0.0), axis=1), axis=1)
    n_agg = (eligible & agg).sum(axis=1)[:, None]
    n_cli = (eligible & ~agg).sum(axis=1)[:, None]
    q_hi = np.minimum(kk, n_agg)
    q_lo = np.maximum(0, kk - n_cli)
    w_hi = np.where(q_hi > 0, np.take_along_axis(top_w, np.maximum(q_hi - 1, 0), axis=1), 0.0)
    denominator = kk * (kk - 2 + q_lo)
    with np.errstate(divide="ignore", invalid="ignore"):
        f_hi = np.where(denominator > 0, (2 * w_hi + (kk - 2) * w_agg) / denominator, np.inf)
    bound = np.minimum(top_s / p.batch, np.minimum(taus[:, None], f_hi) / p.size)
    bound = np.where((kk <= eligible.sum(axis=1)[:, None]) & (kk >= 3), bound, -math.inf)
    bound_by_k[1:] = bound.max(axis=0)
    return best, best_set, bound_by_k


def _pair_limits(p: Problem, cand: Ints) -> Floats:
    """``L[k, j]``: the (k-1)-th largest cap from a candidate sender to aggregator j (inf without caps)."""
    m = len(cand)
    if p.caps is None:
        return np.full((m + 1, 1), math.inf)  # broadcasts over aggregators
    links = p.caps[cand, :].copy()
    links[np.arange(m), cand] = -math.inf  # a peer does not send to itself
    ranked = -np.sort(-links, axis=0)  # ranked[r, j]: (r+1)-th largest
    out = np.full((m + 1, p.n), math.inf)
    out[2:] = np.maximum(ranked[: m - 1], 0.0)  # k >= 2 uses ranked[k-2]
    return out


def _size_bounds(p: Problem, cand: Ints, k: int, limits: Floats) -> tuple[float, Floats]:
    """``(Y, x̄)`` for size ``k >= 2``."""
    top_s = float(np.sort(p.s[cand])[::-1][:k].sum())
    kth_w = float(np.sort(p.w[cand])[::-1][k - 1])
    y = min(p.size * top_s / p.batch, kth_w)
    x_bar = np.where(p.agg, np.minimum(np.minimum(p.w / (k - 1), y), limits[k]), 0.0)
    return y, x_bar


class _Rows:
    """Sparse constraint rows ``lo <= A v <= hi``, added one row or one block of rows at a time."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.parts: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], Floats]] = []
        self.lo: list[Floats] = []
        self.hi: list[Floats] = []
        self.count = 0

    def row(self, cols: npt.ArrayLike, vals: npt.ArrayLike, lo: float, hi: float) -> None:
        cols_ = np.atleast_1d(np.asarray(cols, dtype=np.int64))
        self.parts.append(
            (np.full(len(cols_), self.count), cols_, np.broadcast_to(np.asarray(vals, float), cols_.shape))
        )
        self.lo.append(np.array([lo]))
        self.hi.append(np.array([hi]))
        self.count += 1

    def block(self, terms: list[tuple[npt.ArrayLike, npt.ArrayLike]], hi: Floats) -> None:
        """Rows ``Σ_terms vals[r] · v[cols[r]] <= hi[r]``: one column per term in each row."""
        r = np.arange(self.count, self.count + len(hi))
        for cols, vals in terms:
            c = np.broadcast_to(np.asarray(cols, dtype=np.int64), r.shape)
            self.parts.append((r, c, np.broadcast_to(np.asarray(vals, float), r.shape)))
        self.lo.append(np.full(len(hi), -np.inf))
        self.hi.append(np.asarray(hi, float))
        self.count += len(hi)

    def constraint(self) -> LinearConstraint:
        r, c, v = (np.concatenate(column) for column in zip(*self.parts, strict=True))
        matrix = sparse.csr_array((v, (r, c)), shape=(self.count, self.width))
        return LinearConstraint(matrix, np.concatenate(self.lo), np.concatenate(self.hi))


def _best_of_size(
    p: Problem, cand: Ints, k: int, bound: float, floor: float, limits: Floats, seconds: float | None
) -> tuple[Bools | None, float]:
    """Solve the fixed-``k`` MILP (module docstring) within ``seconds`` (``None``: no limit).

    Returns ``(found, open_bound)``: ``found`` is the best set of ``k`` found that beats ``floor`` (``None``
    if there is none, or none was found in time); ``open_bound`` is ``-inf`` when HiGHS finished (``found``
    is then the best set of this size, or no set of this size beats ``floor``), else an upper bound on ``ξ``
    over every set of ``k`` that HiGHS left unproven: its dual bound when it has one, else ``bound``.

    Variables: ``c`` (n), ``x`` (n), ``X``, and ``r = ξ / bound`` in [0, 1]; rows are scaled so that their
    entries are near 1 (``bound`` is an upper bound on ``ξ`` for this size).
    """
    n = p.n
    y, x_bar = _size_bounds(p, cand, k, limits)
    is_cand = _mask(n, cand)
    x0, ix, ir = n, 2 * n, 2 * n + 1
    rows = _Rows(2 * n + 2 + (n if p.relay is not None else 0))
    aggs = np.flatnonzero(p.agg)
    rows.row(np.append(x0 + aggs, ix), np.append(-np.ones(len(aggs)), 1.0), 0.0, 0.0)  # X = Σ x
    rows.row(np.append(cand, ir), np.append(-p.s[cand] / (p.batch * bound), 1.0), -np.inf, 0.0)  # B ξ <= S
    rows.row([ir, ix], [p.size * bound / y, -1.0 / y], -np.inf, 0.0)  # P ξ <= X
    rows.row(cand, 1.0, k, k)  # Σ c = k
    both = np.flatnonzero(is_cand & p.agg)
    m5 = np.maximum(0.0, y + (k - 2) * x_bar[both] - p.w[both])
    rows.block([(ix, 1.0), (x0 + both, float(k - 2)), (both, m5)], p.w[both] + m5)
    m6 = np.maximum(0.0, k * x_bar[both] - p.w[both])
    rows.block([(x0 + both, float(k)), (both, -m6)], p.w[both])
    cli = np.flatnonzero(is_cand & ~p.agg)
    m7 = np.maximum(0.0, y - p.w[cli])
    rows.block([(ix, 1.0), (cli, m7)], p.w[cli] + m7)
    if p.caps is not None:
        i, j = np.nonzero(is_cand[:, None] & p.agg[None, :] & (p.caps < x_bar[None, :]))
        rows.block([(x0 + j, 1.0), (i, x_bar[j] - p.caps[i, j])], x_bar[j])
        i, j = np.nonzero(np.triu(np.outer(is_cand & p.agg, is_cand & p.agg), 1))
        t = p.caps[i, j]
        keep = t < x_bar[i] + x_bar[j]
        i, j, t = i[keep], j[keep], t[keep]
        m9 = x_bar[i] + x_bar[j] - t
        rows.block([(x0 + i, 1.0), (x0 + j, 1.0), (i, m9), (j, m9)], t + 2 * m9)
    x_up = np.where(is_cand, x_bar, np.minimum(x_bar, p.w / k))
    upper = np.concatenate([is_cand.astype(float), x_up, [y, 1.0]])
    if p.relay is not None:
        upper = np.concatenate([upper, _relay_rows(p, rows, k, y, x_up, is_cand)])
    width = len(upper)
    objective = np.zeros(width)
    objective[ir] = -_OBJECTIVE_SCALE
    lower = np.zeros(width)
    lower[ir] = min(floor / bound, 1.0)
    res = milp(
        objective,
        constraints=rows.constraint(),
        integrality=np.concatenate([np.ones(n), np.zeros(width - n)]),
        bounds=Bounds(lower, upper),
        options={"mip_rel_gap": REL_TOL} | ({} if seconds is None else {"time_limit": seconds}),
    )
    if res.status == 2:  # infeasible: no set of this size beats the floor
        return None, -math.inf
    if res.status == 1:  # time limit: maybe a feasible set, and a dual bound on r if the search got that far
        dual = getattr(res, "mip_dual_bound", None)
        ratio = 1.0 if dual is None or not math.isfinite(dual) else min(1.0, -dual / _OBJECTIVE_SCALE)
        found = None if res.x is None else np.asarray(res.x[:n] > 0.5)
        return found, max(floor, bound * ratio)
    if res.status != 0 or res.x is None:
        # HiGHS gave up (status 4, "Solve error": seen on near-tied links): this size stays open with its
        # upper bound, so the plan is the best set found so far and its gap says how far it may be from
        # the optimum -- a solver hiccup must not fail an averaging round
        return None, max(floor, bound)
    return np.asarray(res.x[:n] > 0.5), -math.inf


def _relay_rows(p: Problem, rows: _Rows, k: int, y: float, x_up: Floats, is_cand: Bools) -> Floats:
    """Add the relay rows of the fixed-``k`` MILP (module docstring); return the upper bounds of ``u``.

    Variables ``u_j = c_j x_j`` (columns ``2n+2 ..``), needed only from above (they enter with a minus sign):
    ``u_j <= x_j`` and ``u_j <= x̄_j c_j``. Each relay ``r`` gets its row once for ``c_r = 1`` and once for
    ``c_r = 0``, each voided by a big-M when ``c_r`` has the other value.
    """
    n = p.n
    x0, ix, u0 = n, 2 * n, 2 * n + 2
    relayed = np.flatnonzero((p.relay >= 0) & is_cand) if p.relay is not None else np.array([], np.intp)
    rows.block([(u0 + relayed, 1.0), (x0 + relayed, -1.0)], np.zeros(len(relayed)))  # u_j <= x_j
    rows.block([(u0 + relayed, 1.0), (relayed, -x_up[relayed])], np.zeros(len(relayed)))  # u_j <= x̄_j c_j
    u_up = np.zeros(n)
    u_up[relayed] = x_up[relayed]
    assert p.relay_cap is not None
    for r, members in p.relays():
        js = np.flatnonzero(members)
        us = u0 + js[is_cand[js]]
        reach = float(x_up[js].sum())
        h = float(p.relay_cap[r])
        for c_r in (1, 0):
            forward = 2.0 * (k - c_r)  # F_r = forward · X_R - 2 Σ_R u
            cols = [x0 + js, us]
            vals = [np.full(len(js), forward), np.full(len(us), -2.0)]
            if c_r:  # traffic_r = X + (k - 2) x_r
                cols += [np.array([ix, x0 + r])]
                vals += [np.array([1.0, k - 2.0])]
                high = y + (k - 2) * x_up[r] + forward * reach
            else:  # traffic_r = k x_r
                cols += [np.array([x0 + r])]
                vals += [np.array([float(k)])]
                high = k * x_up[r] + forward * reach
            limits = [(cols, vals, float(p.w[r]), high)]
            if math.isfinite(h):
                limits.append((cols[:2], vals[:2], h, forward * reach))
            for cs, vs, limit, top in limits:
                big = max(0.0, top - limit)
                # c_r = 1: row + M c_r <= limit + M;  c_r = 0: row - M c_r <= limit; divided by the limit, so
                # HiGHS's absolute feasibility tolerance is a relative one on a slow relay too
                unit = limit if limit > 0 else 1.0
                rows.row(
                    np.concatenate([*cs, [r]]),
                    np.concatenate([*vs, [big if c_r else -big]]) / unit,
                    -np.inf,
                    (limit + big if c_r else limit) / unit,
                )
    return u_up


def choose_compute_set(p: Problem, time_limit: float | None = None) -> Choice:
    """The compute set that maximizes ``ξ``, or the best found in ``time_limit`` seconds (module docstring).

    Exact up to a relative 1e-9 when ``Choice.gap`` is 0 (always, with ``time_limit=None``). The budget
    covers the whole call: the closed-form stages always run; MILP sizes start only while time is left,
    each with the time left as its HiGHS limit. The result is never worse than the closed-form incumbent.
    """
    start = time.perf_counter()
    cand = np.flatnonzero(p.s > 0)
    free = p.relaxed()
    best, best_set, best2 = _small_sets(free, cand)
    inc, inc_set, bound_by_k = _cells(free, cand)
    if inc > best and inc_set is not None:
        best, best_set = inc, inc_set
    if len(cand) >= 2:
        bound_by_k[2] = best2  # sizes 1 and 2 were enumerated: exact
    limits = _pair_limits(p, cand)
    how = "certified"
    if p.constrained:
        # caps and relays only remove options, so the relaxed optimum bounds every set; the relaxed incumbent
        # is that optimum only where no cell bound exceeds it, so the ceiling is the larger of them
        ceiling = max(best, float(bound_by_k.max()))
        best = _value(p, best_set, max_rates(p, best_set)[0])
        if best >= ceiling * (1 - REL_TOL):
            slack = {(True, False): "caps", (False, True): "relays", (True, True): "caps and relays"}[
                (p.caps is not None, p.relay is not None)
            ]
            return Choice(best_set, best, f"certified, {slack} slack", best)
        one, one_set = _best_single_capped(p, cand)
        if one > best:
            best, best_set = one, one_set
        for k in range(2, len(cand) + 1):
            flow = float(_size_bounds(p, cand, k, limits)[1].sum()) / p.size  # X <= Σ_j x̄_j
            bound_by_k[k] = min(bound_by_k[k], flow)
    solved = 0
    unproven = -math.inf  # the largest upper bound on ξ over the sizes the budget left open
    for k in range(2, len(cand) + 1):
        if bound_by_k[k] <= best * (1 + REL_TOL):
            continue
        left = None if time_limit is None else time_limit - (time.perf_counter() - start)
        if left is not None and left <= 0.0:
            unproven = max(unproven, float(bound_by_k[k]))
            continue
        found, open_bound = _best_of_size(
            p, cand, int(k), float(bound_by_k[k]), best * (1 + REL_TOL), limits, left
        )
        solved += 1
        unproven = max(unproven, open_bound)
        if found is None:
            continue
        rate = max_rates(p, found)[0] if p.constrained else comm_bound(p, found)
        value = _value(p, found, rate)
        if value > best:
            best, best_set = value, found
    if solved:
        how = f"milp over {solved} size{'s' if solved > 1 else ''}"
    if unproven <= best * (1 + REL_TOL):
        return Choice(best_set, best, how, best)
    if not solved:
        how = "incumbent"  # the budget ran out before any MILP: the closed-form incumbent, not certified
    return Choice(best_set, best, f"{how}, time limit", unproven)


def _best_single_capped(p: Problem, cand: Ints) -> tuple[float, Bools]:
    """Best lone computing peer under pairwise caps and relays (closed form).

    A lone aggregator needs no traffic. A lone client ``c`` sends to every aggregator ``j`` at most
    ``reach_j = min(w_j, t_cj)``; a relay ``r`` carries ``x_r + 2 X_R <= w_r`` and ``2 X_R <= h_r``
    (``k = 1``, ``c_r = c_j = 0``), and since ``x_r`` costs it half of what a relayed slice does, the best is
    ``x_r = reach_r`` and ``X_R = min(Σ_R reach, (w_r - reach_r) / 2, h_r / 2)``.
    """
    links = np.tile(p.w, (len(cand), 1)) if p.caps is None else np.minimum(p.w[None, :], p.caps[cand, :])
    reach = np.where(p.agg[None, :], links, 0.0)
    reach[np.arange(len(cand)), cand] = 0.0
    total = reach.sum(axis=1)
    for r, members in p.relays():
        assert p.relay_cap is not None
        relayed = reach[:, members].sum(axis=1)
        room = np.minimum((p.w[r] - reach[:, r]) / 2, p.relay_cap[r] / 2)
        total = total - relayed + np.minimum(relayed, room)
    rate = np.where(p.agg[cand], math.inf, np.minimum(p.w[cand], total))
    values = np.minimum(p.s[cand] / p.batch, rate / p.size)
    b = int(np.argmax(values))
    return float(values[b]), _mask(p.n, cand[b : b + 1])
