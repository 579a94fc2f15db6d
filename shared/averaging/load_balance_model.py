"""The traffic model of :mod:`shared.averaging.load_balance` for one fixed compute set (math there).

Everything here works on a :class:`Problem`: the validated inputs as numpy arrays, with every bandwidth and
the gradient size divided by one scale so that the LPs HiGHS sees have entries near 1. Three things are
computed for a compute set ``C``:

* :func:`comm_bound` — the closed form of ``X*(C)`` without pairwise caps or relays (used by the search,
  O(n); with them it is an upper bound, since their rows only remove options);
* :func:`max_rates` — the LP ``max X`` for ``C`` solved by HiGHS (``linprog(method="highs")``), with or
  without pairwise caps and relay rows, plus a canonical split of ``X*`` among the aggregators;
* :func:`forced_rate` — the largest ``X`` for *given* slice fractions (the all-reduce and parameter-server
  baselines), from the same rows (:func:`overload`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import sparse
from scipy.optimize import linprog

__all__ = [
    "Bools",
    "Floats",
    "Ints",
    "Problem",
    "comm_bound",
    "forced_rate",
    "max_rates",
    "overload",
    "relay_coefficients",
    "relay_load",
]

Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]
Ints = npt.NDArray[np.intp]

# Phase 2 keeps X within this relative distance of the phase-1 optimum while it balances the split.
_PHASE2_SLACK = 1e-9


@dataclass(frozen=True, eq=False)
class Problem:
    """Validated inputs in solver units (bandwidths and ``size`` divided by ``scale`` bytes/s).

    Attributes:
        s: samples/s of each peer.
        w: ``min(download, upload)`` of each peer, in units of ``scale``.
        agg: whether the peer may aggregate (it is not in client mode).
        batch: target batch ``B`` in samples.
        size: gradient size ``P`` in bytes divided by ``scale``.
        caps: symmetric matrix ``min(t_ij, t_ji) / scale``, ``inf`` where uncapped and on the diagonal;
            ``None`` when no pairwise caps were given.
        scale: the bytes/s that one solver unit stands for.
        relay: ``r(i)``, the index of the member that relays peer ``i``, or -1 (direct or client mode);
            ``None`` when nobody is relayed.
        relay_cap: ``h_r``, the relayed bytes/s peer ``r`` forwards at most, in units of ``scale`` (``inf``:
            only its link bounds it); ``None`` when nobody is relayed.
    """

    s: Floats
    w: Floats
    agg: Bools
    batch: float
    size: float
    caps: Floats | None
    scale: float
    relay: Ints | None = None
    relay_cap: Floats | None = None

    @property
    def n(self) -> int:
        return len(self.s)

    @property
    def constrained(self) -> bool:
        """Pairwise caps or relay rows: the closed form is then only an upper bound."""
        return self.caps is not None or self.relay is not None

    def relays(self) -> list[tuple[int, Bools]]:
        """``(r, R(r))`` for every relay ``r`` in index order, ``R(r)`` the mask of the peers it relays."""
        if self.relay is None:
            return []
        return [(int(r), self.relay == r) for r in np.unique(self.relay[self.relay >= 0])]

    def relaxed(self) -> Problem:
        """The same peers without pairwise caps and relay rows (every row dropped only loosens)."""
        return Problem(self.s, self.w, self.agg, self.batch, self.size, None, self.scale)


def comm_bound(p: Problem, compute: Bools) -> float:
    """``X*(C)`` without pairwise caps or relays, in solver units (``inf``: one aggregator computes alone).

    With caps or relays in ``p`` they are ignored, so the result is an upper bound on the LP's ``X*``.

    Raises:
        ValueError: ``compute`` is empty.
    """
    k = int(compute.sum())
    if k == 0:
        raise ValueError("the compute set is empty")
    both = compute & p.agg
    q = int(both.sum())
    w_agg = float(p.w[p.agg].sum())
    if k == 1:
        return math.inf if q == 1 else min(float(p.w[compute].min()), w_agg)
    slowest = float(p.w[compute].min())
    if q == 0:
        return min(slowest, w_agg / k)
    return min(slowest, (2.0 * float(p.w[both].sum()) + (k - 2) * w_agg) / (k * (k - 2 + q)))


def _capacities(p: Problem, compute: Bools, total: float) -> Floats:
    """Each aggregator's own ceiling on ``x_j`` when the whole rate is ``total`` (no pairwise caps)."""
    k = int(compute.sum())
    cap = np.zeros(p.n)
    both = compute & p.agg
    aux = p.agg & ~compute
    cap[aux] = p.w[aux] / k
    if k >= 3:
        cap[both] = np.maximum(p.w[both] - total, 0.0) / (k - 2)
    else:  # k <= 2: a computing aggregator's rows do not bound its own slice; share by bandwidth
        cap[both] = p.w[both]
    return cap


def relay_load(p: Problem, compute: Bools, x: Floats) -> Floats:
    """``F_r``: the bytes/s each peer forwards as a relay at aggregator rates ``x`` (0 if it relays nobody).

    Written connection by connection (``load_balance``, "Relays"): every computing peer ``a`` other than ``r``
    and ``j`` dials each aggregator ``j`` relayed by ``r`` through ``r``, pushes ``x_j`` of parts and pulls
    ``x_j`` of averages, so ``F_r = Σ_{j ∈ R(r)} Σ_{a ∈ C, a ∉ {j, r}} 2 x_j``.
    """
    out = np.zeros(p.n)
    if p.relay is None:
        return out
    own = np.where(p.agg, x, 0.0)
    for r, members in p.relays():
        for j in np.flatnonzero(members):
            dialers = int(compute.sum()) - int(compute[j]) - int(compute[r])
            out[r] += 2.0 * dialers * float(own[j])
    return out


def overload(p: Problem, compute: Bools, x: Floats) -> float:
    """The largest ``traffic / limit`` over every peer, capped pair and relay cap, at aggregator rates ``x``.

    Relays add ``F_r`` (:func:`relay_load`) to the relay's traffic and check it against ``h_r``.
    """
    k = int(compute.sum())
    total = float(x.sum())
    own = np.where(p.agg, x, 0.0)
    traffic = np.where(compute, total - own, 0.0) + np.where(p.agg, (k - compute) * own, 0.0)
    ratio = 0.0
    if p.relay is not None:
        assert p.relay_cap is not None
        forwarded = relay_load(p, compute, x)
        traffic = traffic + forwarded
        busy = forwarded > 0
        if busy.any():
            with np.errstate(divide="ignore"):
                ratio = float((forwarded[busy] / p.relay_cap[busy]).max())
    ratio = max(ratio, float((traffic / p.w).max()))
    if p.caps is not None:
        pair = np.outer(compute, own) + np.outer(own, compute)  # c_i x_j + c_j x_i, both directions
        np.fill_diagonal(pair, 0.0)
        used = (pair > 0) & np.isfinite(p.caps)
        if used.any():
            with np.errstate(divide="ignore"):
                ratio = max(ratio, float((pair[used] / p.caps[used]).max()))
    return ratio


def forced_rate(p: Problem, compute: Bools, fractions: Floats) -> float:
    """The largest ``X`` (solver units) at which the given slice fractions fit every row of the model."""
    ratio = overload(p, compute, fractions)
    return math.inf if ratio == 0.0 else 1.0 / ratio


def max_rates(p: Problem, compute: Bools) -> tuple[float, Floats]:
    """Solve ``max X`` for the compute set by HiGHS; return ``(X*, x)`` in solver units.

    ``x`` is a canonical optimal split: among the optimal ``x`` it maximizes ``λ`` with
    ``x_j ≥ λ · cap_j``, where ``cap_j`` is aggregator ``j``'s own ceiling at ``X*``. Without pairwise caps
    this has the unique answer ``x_j = X* · cap_j / Σ cap`` (slices proportional to each aggregator's
    capacity, so equal peers get equal slices and spare capacity is spread evenly); with caps a second LP
    finds it, unless the no-cap split already fits them (then it is optimal, and the plan is exactly the
    one without caps and relays). A lone computing aggregator needs no traffic: ``(inf, e_i)``.

    The LP is posed with every row divided by its limit and ``x`` in units of the no-cap optimum, so
    HiGHS's absolute tolerances are relative ones; the answer is then scaled down by its own overload, if
    any, so the plan never exceeds a limit by more than rounding.
    """
    k = int(compute.sum())
    if k == 1 and bool((compute & p.agg).any()):
        alone = np.zeros(p.n)
        alone[compute] = 1.0
        return math.inf, alone
    unit = comm_bound(p.relaxed(), compute)
    if p.constrained:  # the relaxed optimum's canonical split may already fit the caps and relay rows
        cap = _capacities(p, compute, unit)
        x = unit * cap / cap.sum()
        if overload(p, compute, x) <= max(1.0, overload(p.relaxed(), compute, x)):
            return _fit(p, compute, x)
    aggs = np.flatnonzero(p.agg)
    na = len(aggs)
    col = np.full(p.n, -1)
    col[aggs] = np.arange(na)
    ix = na  # variables (in units of ``unit``): x_j for j in aggs, then X
    both = np.flatnonzero(compute & p.agg)
    aux = p.agg & ~compute
    x_ub = np.full(na, np.inf)
    x_ub[col[aux]] = p.w[aux] / k / unit
    clients_in = compute & ~p.agg
    X_ub = float(p.w[clients_in].min()) / unit if clients_in.any() else math.inf

    # (X + (k-2) x_i) / w_i <= 1 for computing aggregators
    r = np.arange(len(both))
    rows = [r, r]
    cols = [np.full(len(both), ix), col[both]]
    vals = [unit / p.w[both], (k - 2) * unit / p.w[both]]
    nrows = len(both)
    if p.caps is not None:
        # pair {i, j}: (c_i x_j + c_j x_i) / min(t_ij, t_ji) <= 1; the coefficient is 0 unless the peer sends
        i, j = np.triu_indices(p.n, 1)
        t = p.caps[i, j]
        a_j = compute[i] & p.agg[j]  # i sends its part of slice j to j
        a_i = compute[j] & p.agg[i]  # j sends its part of slice i to i
        keep = np.isfinite(t) & (a_j | a_i)
        i, j, t, a_j, a_i = i[keep], j[keep], t[keep], a_j[keep], a_i[keep]
        cut = t <= 0.0  # a zero cap: the aggregators on it get nothing
        x_ub[col[j[cut & a_j]]] = 0.0
        x_ub[col[i[cut & a_i]]] = 0.0
        i, j, t, a_j, a_i = i[~cut], j[~cut], t[~cut], a_j[~cut], a_i[~cut]
        r = nrows + np.arange(len(t))
        rows += [r[a_j], r[a_i]]
        cols += [col[j[a_j]], col[i[a_i]]]
        vals += [(unit / t)[a_j], (unit / t)[a_i]]
        nrows += len(t)
    for hub, members in p.relays():
        # relay r = hub: (c_r X + (k - 2 c_r) x_r + F_r) / w_r <= 1 and F_r / h_r <= 1 ("Relays")
        forward = relay_coefficients(p, compute, hub, members)[aggs]
        link = forward.copy()
        link[col[hub]] += k - 2 * float(compute[hub])
        used = np.flatnonzero(link)
        rows += [np.full(len(used) + 1, nrows)]
        cols += [np.append(used, ix)]
        vals += [np.append(link[used], float(compute[hub])) * unit / p.w[hub]]
        nrows += 1
        assert p.relay_cap is not None
        h = float(p.relay_cap[hub])
        used = np.flatnonzero(forward)
        if h <= 0.0:  # relays nothing: every slice it would forward is 0
            x_ub[used] = 0.0
        elif math.isfinite(h) and len(used):
            rows += [np.full(len(used), nrows)]
            cols += [used]
            vals += [forward[used] * unit / h]
            nrows += 1
    a_ub = sparse.csr_array(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(nrows, na + 1)
    )
    b_ub = np.ones(nrows)
    a_eq = sparse.csr_array(np.concatenate([-np.ones(na), [1.0]])[None, :])
    bounds = np.column_stack([np.zeros(na + 1), np.concatenate([x_ub, [X_ub]])])
    objective = np.zeros(na + 1)
    objective[ix] = -1.0
    res = linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[0.0], bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"HiGHS could not solve the rate LP: {res.message}")
    total = float(res.x[ix]) * unit
    if total <= 0.0:
        return 0.0, np.zeros(p.n)

    cap = _capacities(p, compute, total)  # Σ cap >= X* > 0: the LP's own rows bound each x_j by cap_j
    if not p.constrained:
        return _fit(p, compute, total * cap / cap.sum())
    # Phase 2 (pairwise caps or relays): hold X at X*, maximize λ subject to x_j >= λ cap_j.
    lam = na + 1
    ca = cap[aggs] / unit
    balance = sparse.csr_array(
        (
            np.concatenate([-np.ones(na), ca]),
            (np.tile(np.arange(na), 2), np.concatenate([np.arange(na), np.full(na, lam)])),
        ),
        shape=(na, na + 2),
    )
    a_ub2 = sparse.vstack([sparse.hstack([a_ub, sparse.csr_array((nrows, 1))]), balance], format="csr")
    a_eq2 = sparse.hstack([a_eq, sparse.csr_array((1, 1))], format="csr")
    bounds2 = np.vstack([bounds, [0.0, total / unit / ca.sum()]])
    bounds2[ix] = [res.x[ix] * (1.0 - _PHASE2_SLACK), res.x[ix]]
    objective2 = np.zeros(na + 2)
    objective2[lam] = -1.0
    res2 = linprog(
        objective2,
        A_ub=a_ub2,
        b_ub=np.concatenate([b_ub, np.zeros(na)]),
        A_eq=a_eq2,
        b_eq=[0.0],
        bounds=bounds2,
        method="highs",
    )
    x = np.zeros(p.n)
    x[aggs] = np.clip((res2.x if res2.status == 0 else res.x)[:na], 0.0, None)
    return _fit(p, compute, x * (total / x.sum()))  # phase 2 may give back up to its slack: restore X*


def relay_coefficients(p: Problem, compute: Bools, r: int, members: Bools) -> Floats:
    """``∂F_r/∂x_j`` for every ``j`` (``load_balance``, "Relays"): ``2 (k - c_r - c_j)`` for ``j`` relayed by
    ``r`` (every other computing peer but ``r`` pushes its part of slice ``j`` through ``r`` and pulls the
    average back through ``r``), 0 for every other peer (their slices do not pass ``r``)."""
    k = float(compute.sum())
    return np.where(members & p.agg, 2.0 * (k - float(compute[r]) - compute), 0.0)


def _fit(p: Problem, compute: Bools, x: Floats) -> tuple[float, Floats]:
    """Scale ``x`` down by its overload (solver tolerance), if any; return ``(Σ x, x)``."""
    ratio = overload(p, compute, x)
    if ratio > 1.0:
        x = x / ratio
    return float(x.sum()), x
