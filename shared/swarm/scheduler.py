"""Initial placement of a swarm run: which peers serve each stage, and the pipeline order (seed 002 §3.4).

The cost it minimizes (seed 002 eq. 1: data-parallel plus pipeline communication of one iteration, over
balanced partitions of the devices into stage groups) and its notation are in ``placement_cost``.

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
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.optimize import linear_sum_assignment

from .placement_cost import Groups, Ints, IterationCost, Network, PairCosts, Workload, coarsened, open_path

__all__ = ["Placement", "SearchConfig", "schedule"]

_REL_TOL = 1e-12


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


# -- the search --------------------------------------------------------------------------------------------


class _Partition:
    """A balanced partition with its cached group costs, coarsened graph and best order."""

    def __init__(self, model: PairCosts, labels: Ints) -> None:
        self.model = model
        self.labels = labels.copy()
        self.groups = [np.flatnonzero(labels == j) for j in range(model.s)]
        self.dp = np.array([model.group_dp(g) for g in self.groups])
        self.dp_mean = np.array([model.group_dp_mean(g) for g in self.groups])
        self.coarse = coarsened(model, self.groups)
        self.coarse_mean = coarsened(model, self.groups, mean=True)
        self._solve_order()

    def _solve_order(self) -> None:
        self.order, self.pp, self.exact = open_path(self.coarse)
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


def _best_move(model: PairCosts, part: _Partition, locked: npt.NDArray[np.bool_]) -> tuple[int, int] | None:
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
    model: PairCosts, part: _Partition, locked: npt.NDArray[np.bool_]
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


def _local_search(model: PairCosts, part: _Partition) -> _Partition:
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


def _random_labels(model: PairCosts, rng: np.random.Generator) -> Ints:
    return np.asarray(np.repeat(np.arange(model.s), model.d)[rng.permutation(model.n)], dtype=np.intp)


def _tour_partitions(model: PairCosts, start: int) -> tuple[Ints, Ints]:
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


def _crossover(model: PairCosts, p1: Ints, p2: Ints, rng: np.random.Generator, mutations: int) -> Ints:
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
    model = PairCosts(net, work)
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
