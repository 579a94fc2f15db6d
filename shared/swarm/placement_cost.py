"""The communication cost of a pipeline placement (seed 002 §2-3.3): pure, for ``scheduler``.

Notation (seed 002 §2). ``N`` devices; ``alpha[d, d']`` delay (s) and ``β[d, d']`` bandwidth (bytes/s) of each
pair. Measured links are directed; the paper's communication graph ``G`` labels each edge with the mean of
both directions, ``((alpha[d,d'] + alpha[d',d]) / 2, (β[d,d'] + β[d',d]) / 2)``, because every exchange
moves as many bytes each way (``Network.from_directed``); every function here takes the symmetric ``G``.
The model has ``S = D_PP`` consecutive stages, each served by a data-parallel group of ``D = D_DP = N / S``
devices (the paper's balance constraint ``D_DP · D_PP = N``). ``c_DP`` is the bytes of one stage's parameters
(= its gradients), ``c_PP`` the bytes of activations of one micro-batch crossing a stage boundary (the
paper's micro-batch ``i ∈ [D_DP]`` is one of the ``D`` batch partitions, so ``c_PP`` is the activations of
``batch / D`` samples).

Data-parallel cost (§3.2, eq. 2). A sharded parameter server inside each group: every device owns
``c_DP / D`` bytes, scatters its shards of the gradient and gathers the reduced shards, so the slowest
device bounds the group, and the slowest group bounds the iteration (groups run in parallel)::

    DATAP(C_j) = max_{d ∈ C_j} Σ_{d' ∈ C_j, d' ≠ d} 2 (alpha[d,d'] + c_DP / (D β[d,d'])),
    DATAP(C_1..C_S) = max_j DATAP(C_j).

Pipeline cost (§3.3, eqs. 3-4). Two groups adjacent in the pipeline are joined by a perfect matching ``M``
(each device of one passes activations of its micro-batch to one device of the other, and gradients
back); the edge of the coarsened graph ``Ĝ`` between groups is the best matching's slowest pair::

    w_PP(d, d') = 2 (alpha[d,d'] + c_PP / β[d,d']),
    Ĝ[C_j, C_j'] = min_M max_{(d,d') ∈ M} w_PP(d, d')          (bottleneck assignment, PTIME),
    PIPELINEP(C_1..C_S) = OPENLOOPTSP(Ĝ),

the cheapest Hamiltonian path through the groups, whose order is the pipeline order (group at position
``k`` serves stage ``k``). Iteration cost (§3.1, eq. 1): ``COMM-COST = DATAP + PIPELINEP``, minimized over
balanced partitions ``C_1..C_S`` of the devices (disjoint, covering, all of size ``D``).

How each piece is computed here:

- Bottleneck assignment: a perfect matching with every pair at most ``t`` exists iff the 0/1 matrix
  ``[w_PP > t]`` has an assignment of cost 0 (``scipy.optimize.linear_sum_assignment``); ``t`` is searched
  over the distinct pair costs, starting from the bound ``max(max row minimum, max column minimum)``
  (every device needs a partner), which is usually already feasible.
- Open-loop TSP: exact by Held-Karp over subsets for ``S <= 12`` (``O(2^S S²)``, vectorized by subset
  size); beyond that nearest-neighbour paths from every start improved by 2-opt (not exact;
  ``scheduler.Placement.exact_order`` says which).
- Lower bound (``lower_bound``; the property tests hold every cost to it). Every device ``d`` sits in some
  group, whose ``DATAP`` is at least ``d``'s own sum, itself at least the sum of ``d``'s ``D - 1`` cheapest
  data-parallel pairs; so ``DATAP >= max_d`` of that. The path has ``S - 1`` edges; each is a matching
  pair's cost, hence ``>= min w_PP``, and the edge that serves the device whose cheapest partner is the
  dearest is ``>= max_d min_{d'} w_PP(d, d')``; so ``PIPELINEP >= max_d min_d' w_PP + (S - 2) min w_PP``
  (``0`` for ``S = 1``).

This module is pure (numpy and scipy; no trio, no sockets, no torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
import numpy.typing as npt
from scipy.optimize import linear_sum_assignment

__all__ = [
    "EXACT_TSP_MAX_STAGES",
    "IterationCost",
    "Network",
    "PairCosts",
    "Workload",
    "best_order",
    "coarsened",
    "data_parallel_cost",
    "iteration_cost",
    "lower_bound",
    "open_path",
    "pipeline_cost",
    "pipeline_edge_cost",
    "random_placement",
]

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.intp]
Groups = tuple[tuple[int, ...], ...]

EXACT_TSP_MAX_STAGES = 12


def _square(name: str, value: npt.ArrayLike) -> Floats:
    array = np.array(value, dtype=np.float64)
    if array.ndim != 2 or array.shape[0] != array.shape[1] or array.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty square matrix, got shape {array.shape}")
    return array


@dataclass(frozen=True, eq=False)
class Network:
    """The symmetric communication graph ``G`` of seed 002 §2: pairwise delay (s) and bandwidth (bytes/s).

    The diagonal is ignored (a device does not talk to itself). Off the diagonal, delays must be finite and
    ``>= 0`` and bandwidths ``> 0`` (``inf`` allowed), and both matrices symmetric; for directed
    measurements use ``from_directed``.

    Raises:
        ValueError: on a shape mismatch, a negative, non-finite or zero value, or an asymmetric matrix.
    """

    delay: Floats
    bandwidth: Floats

    def __post_init__(self) -> None:
        delay = _square("delay", self.delay)
        bandwidth = _square("bandwidth", self.bandwidth)
        if delay.shape != bandwidth.shape:
            raise ValueError(f"delay {delay.shape} and bandwidth {bandwidth.shape} differ in shape")
        off = ~np.eye(delay.shape[0], dtype=bool)
        if not np.all(np.isfinite(delay[off])) or np.any(delay[off] < 0):
            raise ValueError("delays must be finite and >= 0")
        if np.any(np.isnan(bandwidth[off])) or np.any(bandwidth[off] <= 0):
            raise ValueError("bandwidths must be > 0")
        for name, m in (("delay", delay), ("bandwidth", bandwidth)):
            if not np.allclose(m[off], m.T[off], rtol=1e-9, atol=0.0):
                raise ValueError(
                    f"{name} must be symmetric; average directed measurements with from_directed"
                )
        np.fill_diagonal(delay, 0.0)
        np.fill_diagonal(bandwidth, math.inf)
        delay.flags.writeable = False
        bandwidth.flags.writeable = False
        object.__setattr__(self, "delay", delay)
        object.__setattr__(self, "bandwidth", bandwidth)

    @classmethod
    def from_directed(cls, delay: npt.ArrayLike, bandwidth: npt.ArrayLike) -> Network:
        """The graph ``G`` from directed measurements: each edge the mean of its two directions (§2)."""
        a, b = _square("delay", delay), _square("bandwidth", bandwidth)
        if a.shape != b.shape:
            raise ValueError(f"delay {a.shape} and bandwidth {b.shape} differ in shape")
        return cls((a + a.T) / 2, (b + b.T) / 2)

    @property
    def size(self) -> int:
        return int(self.delay.shape[0])


@dataclass(frozen=True)
class Workload:
    """What crosses the network per iteration (seed 002 §2).

    Attributes:
        stages: ``S = D_PP``, the number of pipeline stages; it must divide the number of devices.
        stage_bytes: ``c_DP``, bytes of one stage's gradients (= its parameters) averaged in its group.
        activation_bytes: ``c_PP``, bytes of one micro-batch's activations crossing a stage boundary.
    """

    stages: int
    stage_bytes: float
    activation_bytes: float

    def __post_init__(self) -> None:
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"stages must be an int >= 1, got {self.stages!r}")
        for name in ("stage_bytes", "activation_bytes"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True)
class IterationCost:
    """Predicted communication seconds of one iteration: ``DATAP`` (eq. 2) and ``PIPELINEP`` (eq. 4)."""

    data_parallel: float
    pipeline: float

    @property
    def total(self) -> float:
        return self.data_parallel + self.pipeline


# -- the cost model ----------------------------------------------------------------------------------------


class PairCosts:
    """Pair costs of one (network, workload): ``dp[d, d']`` (eq. 2 summand) and ``pp[d, d']`` (eq. 3)."""

    def __init__(self, net: Network, work: Workload) -> None:
        n, s = net.size, work.stages
        if n % s:
            raise ValueError(f"{s} stages do not divide {n} devices into equal groups (seed 002 §2)")
        self.n, self.s, self.d = n, s, n // s
        with np.errstate(divide="ignore"):
            self.dp = 2 * (net.delay + work.stage_bytes / (self.d * net.bandwidth))
            self.pp = 2 * (net.delay + work.activation_bytes / net.bandwidth)
        np.fill_diagonal(self.dp, 0.0)
        np.fill_diagonal(self.pp, 0.0)

    def group_dp(self, group: Ints) -> float:
        return float(self.dp[group][:, group].sum(axis=1).max())

    def edge(self, a: Ints, b: Ints) -> float:
        return _bottleneck(self.pp[a][:, b])

    def edge_mean(self, a: Ints, b: Ints) -> float:
        """The search's tie-breaker: mean pair cost of the min-sum matching (eq. 3 with sum for max)."""
        m = self.pp[a][:, b]
        rows, cols = linear_sum_assignment(m)
        return float(m[rows, cols].mean())

    def group_dp_mean(self, group: Ints) -> float:
        return float(self.dp[group][:, group].sum(axis=1).mean())


def _bottleneck(m: Floats) -> float:
    """``min_M max_{(i,j) ∈ M} m[i, j]`` over perfect matchings of the square matrix ``m``."""
    lo = max(float(m.min(axis=1).max()), float(m.min(axis=0).max()))
    if _feasible(m, lo):
        return lo
    rows, cols = linear_sum_assignment(m)  # the min-sum matching's slowest pair bounds from above
    hi = float(m[rows, cols].max())
    values = np.unique(m[(m > lo) & (m <= hi)])
    low, high = 0, len(values) - 1  # values[high] = hi is feasible
    while low < high:
        mid = (low + high) // 2
        if _feasible(m, float(values[mid])):
            high = mid
        else:
            low = mid + 1
    return float(values[low])


def _feasible(m: Floats, t: float) -> bool:
    over = (m > t).astype(np.float64)
    rows, cols = linear_sum_assignment(over)
    return bool(over[rows, cols].sum() == 0)


def _check_groups(net: Network, work: Workload, stages: Sequence[Sequence[int]]) -> list[Ints]:
    if len(stages) != work.stages:
        raise ValueError(f"{len(stages)} groups given for {work.stages} stages")
    groups = [np.asarray(g, dtype=np.intp) for g in stages]
    size = net.size // work.stages if net.size % work.stages == 0 else -1
    if any(g.ndim != 1 or len(g) != size for g in groups):
        raise ValueError(f"every group must hold N / S = {net.size} / {work.stages} devices")
    every = np.concatenate(groups)
    if sorted(every.tolist()) != list(range(net.size)):
        raise ValueError(f"the groups must place every device 0..{net.size - 1} exactly once")
    return groups


def data_parallel_cost(net: Network, work: Workload, group: Sequence[int]) -> float:
    """``DATAP(C_j)`` of seed 002 eq. 2 for one stage group of ``N / S`` devices."""
    model = PairCosts(net, work)
    g = np.asarray(group, dtype=np.intp)
    if (
        g.ndim != 1
        or len(g) != model.d
        or len(set(g.tolist())) != model.d
        or g.min() < 0
        or g.max() >= model.n
    ):
        raise ValueError(f"a group is {model.d} distinct devices in 0..{model.n - 1}, got {list(group)}")
    return model.group_dp(g)


def pipeline_edge_cost(net: Network, work: Workload, a: Sequence[int], b: Sequence[int]) -> float:
    """``Ĝ[a, b]`` of seed 002 eq. 3: the best matching's slowest pair between two adjacent groups."""
    model = PairCosts(net, work)
    ga, gb = np.asarray(a, dtype=np.intp), np.asarray(b, dtype=np.intp)
    if len(ga) != len(gb) or len(ga) == 0 or set(ga.tolist()) & set(gb.tolist()):
        raise ValueError("adjacent groups must be disjoint, non-empty and of equal size")
    return model.edge(ga, gb)


def pipeline_cost(net: Network, work: Workload, stages: Sequence[Sequence[int]]) -> float:
    """``PIPELINEP`` of the given order: the sum of eq. 3 over consecutive groups (no reordering)."""
    model, groups = PairCosts(net, work), _check_groups(net, work, stages)
    return sum((model.edge(groups[k], groups[k + 1]) for k in range(len(groups) - 1)), 0.0)


def iteration_cost(net: Network, work: Workload, stages: Sequence[Sequence[int]]) -> IterationCost:
    """``DATAP + PIPELINEP`` (seed 002 eq. 1) of a placement with its pipeline order as given.

    Args:
        net: the communication graph.
        work: stage count and bytes.
        stages: ``stages[k]`` the devices serving stage ``k``; all of size ``N / S``, every device once.

    Raises:
        ValueError: if ``stages`` is not a balanced partition of the devices into ``S`` groups.
    """
    model, groups = PairCosts(net, work), _check_groups(net, work, stages)
    dp = max(model.group_dp(g) for g in groups)
    pp = sum((model.edge(groups[k], groups[k + 1]) for k in range(len(groups) - 1)), 0.0)
    return IterationCost(dp, pp)


def best_order(net: Network, work: Workload, stages: Sequence[Sequence[int]]) -> tuple[Groups, IterationCost]:
    """The cheapest pipeline order of given groups (eq. 4, open-loop TSP) and the resulting cost."""
    model, groups = PairCosts(net, work), _check_groups(net, work, stages)
    coarse = coarsened(model, groups)
    order, pp, _ = open_path(coarse)
    dp = max(model.group_dp(g) for g in groups)
    return tuple(tuple(int(x) for x in groups[k]) for k in order), IterationCost(dp, pp)


def lower_bound(net: Network, work: Workload) -> float:
    """A bound below the ``COMM-COST`` of every balanced placement (module docstring, "Lower bound")."""
    model = PairCosts(net, work)
    dp_sorted = np.sort(model.dp + np.diag(np.full(model.n, math.inf)), axis=1)
    dp = float(dp_sorted[:, : model.d - 1].sum(axis=1).max()) if model.d > 1 else 0.0
    if model.s == 1:
        return dp
    pp_off = model.pp + np.diag(np.full(model.n, math.inf))
    nearest = pp_off.min(axis=1)
    return dp + float(nearest.max()) + (model.s - 2) * float(nearest.min())


def random_placement(n: int, stages: int, rng: np.random.Generator) -> Groups:
    """A uniformly random balanced placement with a random pipeline order (the paper's "no scheduler")."""
    if stages < 1 or n % stages:
        raise ValueError(f"{stages} stages do not divide {n} devices into equal groups")
    perm = rng.permutation(n)
    size = n // stages
    return tuple(tuple(int(x) for x in perm[k * size : (k + 1) * size]) for k in range(stages))


def coarsened(model: PairCosts, groups: Sequence[Ints], *, mean: bool = False) -> Floats:
    """The coarsened graph ``Ĝ`` over the groups: eq. 3 per pair (``mean``: the min-sum matching's mean)."""
    s = len(groups)
    out = np.zeros((s, s))
    edge = model.edge_mean if mean else model.edge
    for j in range(s):
        for k in range(j + 1, s):
            out[j, k] = out[k, j] = edge(groups[j], groups[k])
    return out


@cache
def _held_karp_layers(s: int) -> tuple[tuple[Ints, Ints, Ints], ...]:
    """Per subset size ``k >= 2``: each (subset, last node in it) pair, and the subset without that node."""
    masks = np.arange(1 << s)
    sizes = np.array([bin(m).count("1") for m in range(1 << s)])
    layers = []
    for k in range(2, s + 1):
        subset = np.repeat(masks[sizes == k], s)
        last = np.tile(np.arange(s), int((sizes == k).sum()))
        keep = (subset >> last) & 1 == 1
        subset, last = subset[keep], last[keep]
        layers.append((subset, last, subset ^ (1 << last)))
    return tuple(layers)


def open_path(w: Floats) -> tuple[list[int], float, bool]:
    """Cheapest Hamiltonian path over ``w`` (symmetric): order, cost, and whether it is proven optimal."""
    s = len(w)
    if s <= 2:
        return list(range(s)), float(w[0, 1]) if s == 2 else 0.0, True
    if s > EXACT_TSP_MAX_STAGES:
        return *_two_opt(w), False
    full = (1 << s) - 1
    best = np.full((1 << s, s), math.inf)
    parent = np.full((1 << s, s), -1, dtype=np.intp)
    best[1 << np.arange(s), np.arange(s)] = 0.0
    for subset, last, rest in _held_karp_layers(s):
        arrive = best[rest] + w[:, last].T  # arrive[p, i]: path over rest ending at i, then i -> last
        i = arrive.argmin(axis=1)
        best[subset, last] = arrive[np.arange(len(i)), i]
        parent[subset, last] = i
    end = int(best[full].argmin())
    cost = float(best[full, end])
    order, mask = [end], full
    while len(order) < s:
        prev_node = int(parent[mask, order[-1]])
        mask ^= 1 << order[-1]
        order.append(prev_node)
    return order[::-1], cost, True


def _path_cost(w: Floats, order: Sequence[int]) -> float:
    return float(sum(w[order[k], order[k + 1]] for k in range(len(order) - 1)))


def _two_opt(w: Floats) -> tuple[list[int], float]:
    s = len(w)
    best_order: list[int] = []
    best_cost = math.inf
    for start in range(s):
        order, left = [start], set(range(s)) - {start}
        while left:
            nxt = min(left, key=lambda x: (w[order[-1], x], x))
            order.append(nxt)
            left.remove(nxt)
        improved = True
        while improved:
            improved = False
            for i in range(s - 1):
                for j in range(i + 1, s):
                    # reverse order[i..j]; open path: the ends have no wrap-around edge
                    before = (w[order[i - 1], order[i]] if i > 0 else 0.0) + (
                        w[order[j], order[j + 1]] if j < s - 1 else 0.0
                    )
                    after = (w[order[i - 1], order[j]] if i > 0 else 0.0) + (
                        w[order[i], order[j + 1]] if j < s - 1 else 0.0
                    )
                    if after < before * (1 - 1e-12):
                        order[i : j + 1] = order[i : j + 1][::-1]
                        improved = True
        cost = _path_cost(w, order)
        if cost < best_cost:
            best_order, best_cost = order, cost
    return best_order, best_cost
