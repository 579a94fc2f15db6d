"""Initial placement of a swarm run: which peers serve each stage, and the pipeline order (seed 002 §3).

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
  ``Placement.exact_order`` says which).
- Lower bound (``lower_bound``; the property tests hold every cost to it). Every device ``d`` sits in some
  group, whose ``DATAP`` is at least ``d``'s own sum, itself at least the sum of ``d``'s ``D - 1`` cheapest
  data-parallel pairs; so ``DATAP >= max_d`` of that. The path has ``S - 1`` edges; each is a matching
  pair's cost, hence ``>= min w_PP``, and the edge that serves the device whose cheapest partner is the
  dearest is ``>= max_d min_{d'} w_PP(d, d')``; so ``PIPELINEP >= max_d min_d' w_PP + (S - 2) min w_PP``
  (``0`` for ``S = 1``).

The search (§3.4): a hybrid genetic algorithm over balanced partitions. The population starts as random
balanced partitions plus, for one start device per 8 members, two structured ones from a nearest-neighbour
tour over ``w_PP`` (cut into ``D`` pipelines of ``S`` consecutive devices, or into ``S`` groups of ``D``
consecutive devices: the extremes "fast pipelines" and "fast data-parallel groups" when devices sit in
clusters; the paper does not say how its population starts). Each generation picks two parents at random
and makes an offspring by taking each device's group from one parent or the other at random (after
relabelling the second parent's groups to overlap the first's most, by an assignment on the overlap
counts), repairing the balance by moving random devices from oversized groups to undersized ones (the
node-swapping crossover the paper follows from Bui & Moon), then swapping ``0..SearchConfig.mutations``
random pairs (mutation). The offspring is improved by local search and replaces the worst member if it is
better and not already in the population. Local search uses the paper's move, in the circular
Kernighan-Lin form the paper extends it to: for every pair of groups ``(C_j, C_j')`` take the fastest link
inside each, ``d1 ↔ d2`` and ``d1' ↔ d2'`` (cheapest ``w_PP`` among links with an end not yet moved in this
pass), and consider the (up to) four swaps of their unmoved ends, ``d1↔d1'``, ``d1↔d2'``, ``d2↔d1'``,
``d2↔d2'``, scored by the paper's gain (for ``d1↔d1'``)::

    GAIN = mean_{d'' ∈ C_j'} w_PP(d1, d'') - w_PP(d1, d2) + mean_{d'' ∈ C_j} w_PP(d1', d'') - w_PP(d1', d2').

The paper's gain only looks at ``w_PP``: it protects the data-parallel cost (observation 1 of §3.4) but never
proposes a move that lowers it, which left the search no better than the best of 200 random placements on
instances where eq. 2 dominates. So each step also proposes a second swap (our addition): the slowest
unlocked device ``x`` of the slowest group ``C_j`` (largest eq. 2 sum) with the unlocked device ``y`` of
another group ``C_k`` of highest Kernighan-Lin gain on the eq. 2 pair costs ``w_DP``::

    GAIN_DP = Σ_{C_j} w_DP(x, ·) - Σ_{C_k} w_DP(x, ·) + Σ_{C_k} w_DP(y, ·) - Σ_{C_j} w_DP(y, ·)
              + 2 w_DP(x, y),

and the step applies it instead of the paper's proposal only if its true cost is strictly lower (on a tie
the paper's move and the plateau tie-breaker below steer). A pass applies the chosen swap, locks both
devices, and repeats while unlocked candidates remain (as KL, even when the cost rises); the pass keeps the
prefix of swaps whose partition has the lowest *true* ``COMM-COST`` (the gains only propose moves; the
paper notes that a gain alone need not lower the cost, so the cost model decides), and passes repeat while
they improve. Both costs are maxima
(slowest device, slowest matched pair), so most swaps leave them unchanged: ties are broken by the same
model with means for maxima (mean device sum per group averaged over groups, plus the min-sum matching's
mean pair along the chosen path), which moves the search across plateaus, e.g. when all links between
machines are equal (seed 002 §4.1 case 2). This tie-breaker is our choice, not the paper's; it also ranks
the population. The search stops after ``SearchConfig.generations`` offspring or ``time_limit`` seconds,
whichever comes first; with the same seed and a limit on generations only, the result is deterministic.

Not exact: on instances of <= 8 devices it finds the exhaustive optimum in nearly all cases and stays within
a measured bound otherwise (``tests/shared/swarm/test_scheduler.py`` states and checks it).

This module is pure (numpy and scipy; no trio, no sockets, no torch): the capability probe supplies the
matrices, the swarm mode applies the placement (DESIGN D9).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
import numpy.typing as npt
from scipy.optimize import linear_sum_assignment

__all__ = [
    "IterationCost",
    "Network",
    "Placement",
    "SearchConfig",
    "Workload",
    "best_order",
    "data_parallel_cost",
    "iteration_cost",
    "lower_bound",
    "pipeline_cost",
    "pipeline_edge_cost",
    "random_placement",
    "schedule",
]

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.intp]
Groups = tuple[tuple[int, ...], ...]

EXACT_TSP_MAX_STAGES = 12
_REL_TOL = 1e-12


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


@dataclass(frozen=True)
class Placement:
    """The scheduler's answer: ``stages[k]`` are the devices serving stage ``k`` (pipeline order).

    ``exact_order`` is False when the pipeline order came from the 2-opt heuristic (``S > 12``);
    ``best_found_s`` is when (seconds into the search) the returned cost was first reached.
    """

    stages: Groups
    cost: IterationCost
    generations: int
    seconds: float
    exact_order: bool
    best_found_s: float


@dataclass(frozen=True)
class SearchConfig:
    """Budget and shape of the genetic search (§3.4).

    Attributes:
        population: number of partitions kept.
        generations: most offspring produced.
        mutations: each offspring then swaps the groups of ``0..mutations`` random pairs of devices.
        tour_seeds: start the population with the nearest-neighbour tour partitions (else random only).
        time_limit: seconds after which no new offspring is started (``None``: no limit). The result then
            depends on the machine's speed; with ``None`` it depends on the seed only.
    """

    population: int = 16
    generations: int = 200
    mutations: int = 2
    time_limit: float | None = 30.0
    tour_seeds: bool = True

    def __post_init__(self) -> None:
        if self.population < 2:
            raise ValueError(f"population must be >= 2, got {self.population}")
        if self.generations < 0:
            raise ValueError(f"generations must be >= 0, got {self.generations}")
        if self.mutations < 0:
            raise ValueError(f"mutations must be >= 0, got {self.mutations}")
        if self.time_limit is not None and not self.time_limit >= 0:
            raise ValueError(f"time_limit must be >= 0 or None, got {self.time_limit}")


# -- the cost model ----------------------------------------------------------------------------------------


class _Model:
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
    model = _Model(net, work)
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
    model = _Model(net, work)
    ga, gb = np.asarray(a, dtype=np.intp), np.asarray(b, dtype=np.intp)
    if len(ga) != len(gb) or len(ga) == 0 or set(ga.tolist()) & set(gb.tolist()):
        raise ValueError("adjacent groups must be disjoint, non-empty and of equal size")
    return model.edge(ga, gb)


def pipeline_cost(net: Network, work: Workload, stages: Sequence[Sequence[int]]) -> float:
    """``PIPELINEP`` of the given order: the sum of eq. 3 over consecutive groups (no reordering)."""
    model, groups = _Model(net, work), _check_groups(net, work, stages)
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
    model, groups = _Model(net, work), _check_groups(net, work, stages)
    dp = max(model.group_dp(g) for g in groups)
    pp = sum((model.edge(groups[k], groups[k + 1]) for k in range(len(groups) - 1)), 0.0)
    return IterationCost(dp, pp)


def best_order(net: Network, work: Workload, stages: Sequence[Sequence[int]]) -> tuple[Groups, IterationCost]:
    """The cheapest pipeline order of given groups (eq. 4, open-loop TSP) and the resulting cost."""
    model, groups = _Model(net, work), _check_groups(net, work, stages)
    coarse = _coarse(model, groups)
    order, pp, _ = _open_tsp(coarse)
    dp = max(model.group_dp(g) for g in groups)
    return tuple(tuple(int(x) for x in groups[k]) for k in order), IterationCost(dp, pp)


def lower_bound(net: Network, work: Workload) -> float:
    """A bound below the ``COMM-COST`` of every balanced placement (module docstring, "Lower bound")."""
    model = _Model(net, work)
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


def _coarse(model: _Model, groups: Sequence[Ints], *, mean: bool = False) -> Floats:
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


def _open_tsp(w: Floats) -> tuple[list[int], float, bool]:
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


# -- the search --------------------------------------------------------------------------------------------


class _Partition:
    """A balanced partition with its cached group costs, coarsened graph and best order."""

    def __init__(self, model: _Model, labels: Ints) -> None:
        self.model = model
        self.labels = labels.copy()
        self.groups = [np.flatnonzero(labels == j) for j in range(model.s)]
        self.dp = np.array([model.group_dp(g) for g in self.groups])
        self.dp_mean = np.array([model.group_dp_mean(g) for g in self.groups])
        self.coarse = _coarse(model, self.groups)
        self.coarse_mean = _coarse(model, self.groups, mean=True)
        self._solve_order()

    def _solve_order(self) -> None:
        self.order, self.pp, self.exact = _open_tsp(self.coarse)
        self.total = float(self.dp.max()) + self.pp
        path = sum(self.coarse_mean[self.order[k], self.order[k + 1]] for k in range(len(self.order) - 1))
        self.smooth = float(self.dp_mean.mean()) + float(path)

    def better(self, other: _Partition) -> bool:
        """Lower cost; on a tie (max-type costs have plateaus), lower mean-instead-of-max cost."""
        if self.total < other.total * (1 - _REL_TOL):
            return True
        return self.total <= other.total * (1 + _REL_TOL) and self.smooth < other.smooth * (1 - _REL_TOL)

    def copy(self) -> _Partition:
        other = object.__new__(_Partition)
        other.model, other.labels = self.model, self.labels.copy()
        other.groups = [g.copy() for g in self.groups]
        other.dp, other.coarse = self.dp.copy(), self.coarse.copy()
        other.dp_mean, other.coarse_mean = self.dp_mean.copy(), self.coarse_mean.copy()
        other.order, other.pp, other.exact, other.total = list(self.order), self.pp, self.exact, self.total
        other.smooth = self.smooth
        return other

    def swap(self, a: int, b: int) -> None:
        ja, jb = int(self.labels[a]), int(self.labels[b])
        self.labels[a], self.labels[b] = jb, ja
        for j in (ja, jb):
            self.groups[j] = np.flatnonzero(self.labels == j)
            self.dp[j] = self.model.group_dp(self.groups[j])
            self.dp_mean[j] = self.model.group_dp_mean(self.groups[j])
            for k in range(self.model.s):
                if k != j:
                    ga, gb = self.groups[j], self.groups[k]
                    self.coarse[j, k] = self.coarse[k, j] = self.model.edge(ga, gb)
                    self.coarse_mean[j, k] = self.coarse_mean[k, j] = self.model.edge_mean(ga, gb)
        self._solve_order()

    def key(self) -> tuple[frozenset[int], ...]:
        return tuple(sorted((frozenset(g.tolist()) for g in self.groups), key=min))


def _best_move(model: _Model, part: _Partition, locked: npt.NDArray[np.bool_]) -> tuple[int, int] | None:
    """The swap of highest paper gain (§3.4) among the fastest links' endpoints, or None."""
    s = model.s
    onehot = np.zeros((model.n, s))
    onehot[np.arange(model.n), part.labels] = 1.0
    mean_to = (model.pp @ onehot) / model.d  # mean_to[d, j]: mean w_PP from d to C_j (w_PP(d, d) = 0)
    # per group: its fastest link with at least one unlocked end, as (end that may move, its mate) pairs
    ends: list[list[tuple[int, int]]] = []
    for g in part.groups:
        sub = model.pp[g][:, g] + np.diag(np.full(len(g), math.inf))
        sub[np.ix_(locked[g], locked[g])] = math.inf
        if len(g) < 2 or not np.isfinite(sub).any():
            ends.append([])
            continue
        r, c = np.unravel_index(int(sub.argmin()), sub.shape)
        a, b = int(g[r]), int(g[c])
        ends.append([(x, y) for x, y in ((a, b), (b, a)) if not locked[x]])
    best, best_gain = None, -math.inf
    for j in range(s):
        for k in range(j + 1, s):
            for x, x_mate in ends[j]:
                for y, y_mate in ends[k]:
                    gain = mean_to[x, k] - model.pp[x, x_mate] + mean_to[y, j] - model.pp[y, y_mate]
                    if gain > best_gain:
                        best, best_gain = (x, y), gain
    return best


def _slowest_device_move(
    model: _Model, part: _Partition, locked: npt.NDArray[np.bool_]
) -> tuple[int, int] | None:
    """Our second move: the slowest unlocked device of the slowest data-parallel group, swapped with the
    unlocked device of another group of highest Kernighan-Lin gain on the eq. 2 pair costs, or None."""
    j = int(part.dp.argmax())
    g = part.groups[j]
    free = g[~locked[g]]
    if len(free) == 0:
        return None
    onehot = np.zeros((model.n, model.s))
    onehot[np.arange(model.n), part.labels] = 1.0
    to = model.dp @ onehot  # to[d, k]: sum of eq. 2 pair costs from d to C_k
    x = int(free[to[free, j].argmax()])
    ys = np.flatnonzero((part.labels != j) & ~locked)
    if len(ys) == 0:
        return None
    ks = part.labels[ys]
    gain = to[x, j] - to[x, ks] + to[ys, ks] - to[ys, j] + 2 * model.dp[x, ys]
    return x, int(ys[gain.argmax()])


def _local_search(model: _Model, part: _Partition) -> _Partition:
    while True:
        current, best = part.copy(), part
        locked = np.zeros(model.n, dtype=bool)
        while True:
            moves = [
                m
                for m in (_best_move(model, current, locked), _slowest_device_move(model, current, locked))
                if m
            ]
            if not moves:
                break
            trials = []
            for move in dict.fromkeys(moves):  # the two moves may coincide
                trial = current.copy()
                trial.swap(*move)
                trials.append((trial, move))
            # the paper's proposal unless the data-parallel one lowers the true cost itself (ties: paper's)
            pick = 1 if len(trials) == 2 and trials[1][0].total < trials[0][0].total * (1 - _REL_TOL) else 0
            current, move = trials[pick]
            locked[list(move)] = True
            if current.better(best):
                best = current.copy()
        if best is part:
            return part
        part = best


def _random_labels(model: _Model, rng: np.random.Generator) -> Ints:
    return np.asarray(np.repeat(np.arange(model.s), model.d)[rng.permutation(model.n)], dtype=np.intp)


def _tour_partitions(model: _Model, start: int) -> tuple[Ints, Ints]:
    """Two structured seeds from a nearest-neighbour tour over ``w_PP``: cut into ``D`` pipelines of ``S``
    consecutive devices (stage = position in its piece), and cut into ``S`` groups of ``D`` consecutive
    devices (in tour order)."""
    tour, left = [start], np.ones(model.n, dtype=bool)
    left[start] = False
    for _ in range(model.n - 1):
        row = np.where(left, model.pp[tour[-1]], math.inf)
        tour.append(int(row.argmin()))
        left[tour[-1]] = False
    position = np.empty(model.n, dtype=np.intp)
    position[tour] = np.arange(model.n)
    return position % model.s, position // model.d


def _crossover(model: _Model, p1: Ints, p2: Ints, rng: np.random.Generator, mutations: int) -> Ints:
    overlap = np.zeros((model.s, model.s))
    np.add.at(overlap, (p1, p2), 1.0)
    rows, cols = linear_sum_assignment(-overlap)  # p2's group cols[r] becomes p1's group rows[r]
    relabel = np.empty(model.s, dtype=np.intp)
    relabel[cols] = rows
    child = np.where(rng.random(model.n) < 0.5, p1, relabel[p2]).astype(np.intp)
    counts = np.bincount(child, minlength=model.s)
    excess = [
        d
        for j in range(model.s)
        if counts[j] > model.d
        for d in rng.permutation(np.flatnonzero(child == j))[: counts[j] - model.d]
    ]
    deficit = [j for j in range(model.s) for _ in range(max(0, model.d - int(counts[j])))]
    for d, j in zip(rng.permutation(np.array(excess, dtype=np.intp)), deficit, strict=True):
        child[d] = j
    for _ in range(int(rng.integers(0, mutations + 1))):  # mutation: swap two random devices' groups
        a, b = rng.choice(model.n, size=2, replace=False)
        child[a], child[b] = child[b], child[a]
    return child


def schedule(net: Network, work: Workload, *, seed: int = 0, config: SearchConfig | None = None) -> Placement:
    """Place ``N`` devices into ``S`` stage groups and order them, minimizing seed 002 eq. 1 (§3.4).

    Args:
        net: the communication graph (symmetric delay and bandwidth).
        work: stage count and bytes; ``S`` must divide ``N``.
        seed: seeds the genetic search's random choices.
        config: population and budget (``SearchConfig()`` by default).

    Returns:
        The best placement found, its predicted cost, how many offspring were made and how long it took.

    Raises:
        ValueError: if ``S`` does not divide the number of devices.
    """
    config = config or SearchConfig()
    model = _Model(net, work)
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    population: list[_Partition] = []
    seen: set[tuple[frozenset[int], ...]] = set()
    starts = rng.choice(model.n, size=min(model.n, max(1, config.population // 8)), replace=False)
    seeded = (
        [labels for start in starts for labels in _tour_partitions(model, int(start))]
        if config.tour_seeds
        else []
    )
    randoms = [_random_labels(model, rng) for _ in range(config.population - len(seeded))]
    for labels in [*seeded, *randoms][: config.population]:
        p = _Partition(model, labels)
        if p.key() not in seen:
            seen.add(p.key())
            population.append(p)
    generations = 0
    best_total, best_found = min(p.total for p in population), time.perf_counter() - start
    if model.s > 1 and model.d > 1:  # otherwise every partition is the same up to order
        while generations < config.generations and (
            config.time_limit is None or time.perf_counter() - start < config.time_limit
        ):
            generations += 1
            i, k = rng.choice(len(population), size=2, replace=False) if len(population) > 1 else (0, 0)
            child = _Partition(
                model, _crossover(model, population[i].labels, population[k].labels, rng, config.mutations)
            )
            child = _local_search(model, child)
            worst = max(range(len(population)), key=lambda x: (population[x].total, population[x].smooth))
            if child.better(population[worst]) and child.key() not in seen:
                seen.discard(population[worst].key())
                seen.add(child.key())
                population[worst] = child
                if child.total < best_total * (1 - _REL_TOL):
                    best_total, best_found = child.total, time.perf_counter() - start
    best = min(population, key=lambda p: (p.total, p.smooth))
    stages = tuple(tuple(int(x) for x in best.groups[k]) for k in best.order)
    cost = IterationCost(float(best.dp.max()), best.pp)
    return Placement(stages, cost, generations, time.perf_counter() - start, best.exact, best_found)
