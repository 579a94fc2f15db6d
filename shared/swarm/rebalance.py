"""Adaptive rebalancing: which stage servers move between pipeline stages, and where a newcomer serves
(seed 004 §3.2 and App. D, Algorithm 2; issue 17 item 4; pure: no trio, no torch).

Every ``T`` seconds each stage server publishes a :class:`ServerReport` under its stage's DHT key; every
peer then reads all reports and runs :func:`plan_rebalance` on the same values, so all peers reach the
same decision without a coordinator, and a peer named in a :class:`Move` switches stage, downloads that
stage's state (verified, as any state download) and serves it. Reports that come late are left out of
that period (App. D).

**The model.** Every micro-batch passes through every stage, so in steady state each stage must process
the same sample rate ``λ`` and the pipeline runs at the rate of its slowest stage. A server ``j`` of stage
``s`` reports ``r_j``, the samples it processes per second *of busy time* (samples / seconds spent
computing): its capacity, which does not depend on how much work the trainers happen to send it. The
stage's capacity is ``C_s = Σ_{j∈s} r_j`` and its *load* is ``L_s = 1 / C_s`` (seconds of the stage per
sample; ``λ L_s`` is its utilization). The pipeline's throughput is ``Θ = min_s C_s``. A peer that moves
from stage ``a`` to ``b`` is predicted to run there at ``r_j k_a / k_b``, ``k_s`` the stage's relative
compute cost per sample (:func:`plan_rebalance`'s ``costs``; 1 for the even splits of
:mod:`volunteer.tasks.stages`).

*Why not the paper's raw queue sums.* Algorithm 2 calls the stage with the smallest sum of queue sizes
under-loaded. But every stage behind the bottleneck has near-empty queues whatever its capacity (it is
starved, not idle by choice), so the argmin is a tie among them, and moving a peer out of a stage barely
faster than the bottleneck makes it the new bottleneck: the next period moves a peer back (ping-pong).
Busy-time rates measure capacity directly. Queue sizes are still reported and used as in Algorithm 2 to
choose *which* peer of a stage moves among equals: the one with the shortest queue loses the least work.

**The rule** (one move; repeated up to ``max_moves`` times on the predicted state). Capacity vectors are
compared *leximin*: sorted ascending, then lexicographically, so a larger vector has a larger ``Θ``, or the
same ``Θ`` at fewer stages (with two tied bottlenecks no single move raises ``Θ``, but it frees one of
them, and the next move raises ``Θ``; comparing ``Θ`` alone would stall there).

0. *Refill.* If a stage has no server, the lowest-index such stage is the target, and the best candidate
   of step 2 moves there without the tests of step 3: rates are 0 until measured, and a run whose
   servers all joined one stage at once (newcomers that read the records before any was published)
   measures nothing until every stage is served, so its capacities could never show the gain. A refill
   lowers the number of empty stages and never empties one (step 2), so refills stop after at most
   ``S`` periods and cannot alternate with the moves below.
1. The over-loaded stage ``b`` is the one with the smallest capacity; ties go to the lower stage index.
2. Candidate peers are those of every *other* stage with at least two servers (a move never empties a
   stage). Each candidate's predicted capacities are scored by (leximin vector, ``-L_max'/L_min'``,
   ``-queue``), higher first: the move that helps the slowest stages most, then the one that leaves the
   loads most even, then the paper's shortest queue; remaining ties go to the smaller peer id.
3. The best candidate that passes two tests moves (candidates are tried in their order: one ranked
   lower may pass where the best fails). It must beat the current vector *by the margin*: at some sorted
   position ``i``, ``C'_(i) >= (1 + h) C_(i)`` (the hysteresis margin ``h``, and strictly larger)
   while no earlier position is lower (``C'_(j) >= C_(j)`` for ``j < i``); and it must not increase the
   ratio ``L_max / L_min`` (``inf`` while a stage is empty). A gain below the margin at an earlier position
   does not decide: measured capacities are never exactly tied, so two bottlenecks of (nearly) equal
   capacity differ by noise, and a move into the lower one raises the sorted minimum by only that noise
   (the other bottleneck becomes the minimum). Deciding at the first position that differs would refuse
   every such move for ever (a fast server stayed in a stage with four times the others' capacity, seed
   2 of ``scripts/bench_swarm.py --netns``); the real gain is at the next position, where the freed
   bottleneck's capacity rises.

**No ping-pong.** Under unchanged measurements every accepted move either lowers the number of empty
stages (a refill) or keeps it and makes the leximin vector strictly larger (rule 3: no sorted position
falls before the one that gains, so the first that differs is larger), so the pair (fewer empty
stages, larger vector) only grows: no sequence of moves returns to an earlier assignment and moves stop
after finitely many periods; undoing a move is never accepted. ``h`` (default 10 %) keeps noise between
periods from triggering moves that gain less than it.

The paper's rule moves the least-queued peer of the least-loaded stage. Moving from the stage with the
largest capacity is the usual best move here too, but not always (a fast peer from a stage of many
slow ones may be worth more than a slow peer of the largest stage), so every stage that can spare a peer
is searched: ``O(P (S log S + n + log P))`` for ``P`` reports, ``S`` stages and at most ``n`` servers per
stage (each candidate's two changed sums are recomputed exactly; Algorithm 2: ``O(M S)``).

**What it trusts.** A server that has not measured yet reports rate 0: it keeps its stage non-empty but
adds no capacity, so the service reports a rate only after a full measuring period. Rates are
self-reported (DESIGN D10 (c)), and an inflated one would hold peers away from the stage that needs them:
one stranger claiming 10^9 samples/s makes its stage look served for ever, the others move out of it, and
the run's throughput falls to what that stage's honest servers (or the liar itself) really process. So
every reader first bounds the rates with :func:`bound_rates`, the rule the averaging weights follow
(:mod:`shared.averaging.groups`): no rate counts for more than :data:`RATE_FACTOR` times the *lower*
median of the measured (positive) rates of the run's servers. With a minority of liars the lower median
is an honest server's rate (or below it), so a liar adds at most ``RATE_FACTOR`` honest servers' worth of
capacity to its stage: it can hold that many peers away, never the whole run. An honest server more than
``RATE_FACTOR`` times faster than the median (a large accelerator among small ones) is counted at the cap:
its stage looks weaker than it is and draws more servers than it needs, a loss of balance, not of work.
Under-reporting is not bounded, and needs no bound: a server claiming 0 is an unmeasured one, holding its
slot and adding nothing, which any peer that stops computing does. What trainers observe of a server (its
answers' latency) only bounds its rate from *below* (latency includes the network and its queue), so it
cannot tell an inflated claim apart; bounding a claim by trainers' observations is not done.

**Newcomers** (§3.2: "assigned to the optimal pipeline stage by following the same protocol"):
:func:`place_newcomer` returns a stage no server serves, if there is one (a stage whose servers have not
measured yet has no capacity either, but it is served: capacities alone would send every newcomer of a
starting run to stage 0), else the stage whose capacities after adding one more server of the given speed
are best leximin: (with equal costs) the bottleneck; ties to the lower index, or in an order that starts
at a stage derived from the newcomer's peer id (``tiebreak``). Newcomers that join at once read the same
records and would all take the same stage; with their ids they spread, and the refill rule repairs a
collision within a period.

A server that has not measured yet (rate 0) counts as *typical* for the newcomer's choice
(:func:`with_unmeasured_as_typical`: the lower median of the measured rates, 1 when none is measured).
Counted as 0, every stage whose servers all joined within the last period looks empty of capacity, and
every newcomer of a growing run joins the same one of them, the lowest such index after the tiebreak,
until its servers publish a rate a period later; the refill rule cannot repair that (no stage is empty)
and rule 3 needs several periods to move them back. A newcomer is placed once, from records a period
old at best, so counting a silent server as an average one is the best guess it has; the rebalancer
itself still counts it as 0 (it plans on measurements only).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "RATE_FACTOR",
    "Move",
    "RebalancePlan",
    "ServerReport",
    "bound_rates",
    "load_ratio",
    "place_newcomer",
    "plan_rebalance",
    "with_unmeasured_as_typical",
]

DEFAULT_HYSTERESIS = 0.1
#: No server's rate counts for more than this many times the lower median of the measured rates.
RATE_FACTOR = 8.0


@dataclass(frozen=True)
class ServerReport:
    """What a stage server publishes every period.

    Attributes:
        peer: the server's peer id.
        stage: the stage it serves, ``0 <= stage < S``.
        rate: samples per second of busy time at that stage (finite, ``>= 0``; 0: not measured yet).
        queue: requests waiting in its queue (``>= 0``).
    """

    peer: str
    stage: int
    rate: float
    queue: int = 0


@dataclass(frozen=True)
class Move:
    """``peer`` stops serving ``source`` and serves ``target``."""

    peer: str
    source: int
    target: int


@dataclass(frozen=True)
class RebalancePlan:
    """The moves of one period and what the model predicts.

    Attributes:
        moves: in order; empty when no move clears the hysteresis margin.
        capacities_before: ``C_s`` per stage from the reports.
        capacities_after: ``C_s`` per stage once the moves are made (predicted).
        throughput_before: ``Θ = min_s C_s``.
        throughput_after: ``Θ`` after the moves (predicted).
    """

    moves: tuple[Move, ...]
    capacities_before: tuple[float, ...]
    capacities_after: tuple[float, ...]
    throughput_before: float
    throughput_after: float


def bound_rates(reports: Sequence[ServerReport], factor: float = RATE_FACTOR) -> list[ServerReport]:
    """``reports`` with every rate capped at ``factor`` times the lower median of the positive rates
    (module docstring, "What it trusts"); unchanged when no rate is positive. Order is kept.

    Raises:
        ValueError: ``factor`` is not finite and ``>= 1``.
    """
    if not (math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"factor must be finite and >= 1, got {factor}")
    measured = sorted(r.rate for r in reports if math.isfinite(r.rate) and r.rate > 0.0)
    if not measured:
        return list(reports)
    cap = factor * measured[(len(measured) - 1) // 2]
    return [dataclasses.replace(r, rate=cap) if r.rate > cap else r for r in reports]


def with_unmeasured_as_typical(reports: Sequence[ServerReport]) -> list[ServerReport]:
    """``reports`` with every rate of 0 (not measured yet) replaced by the lower median of the positive
    rates, or by 1 when no rate is positive (module docstring, "Newcomers"). Order is kept."""
    measured = sorted(r.rate for r in reports if r.rate > 0.0)
    typical = measured[(len(measured) - 1) // 2] if measured else 1.0
    return [r if r.rate > 0.0 else dataclasses.replace(r, rate=typical) for r in reports]


def load_ratio(capacities: Sequence[float]) -> float:
    """``L_max / L_min = C_max / C_min`` (``inf`` when a stage has no capacity; 1 when none has any)."""
    low, high = min(capacities), max(capacities)
    if high <= 0.0:
        return 1.0
    return math.inf if low <= 0.0 else high / low


def plan_rebalance(
    reports: Sequence[ServerReport],
    stages: int,
    *,
    costs: Sequence[float] | None = None,
    hysteresis: float = DEFAULT_HYSTERESIS,
    max_moves: int = 1,
) -> RebalancePlan:
    """The moves of one rebalancing period (module docstring).

    Args:
        reports: one per server that reported in time.
        stages: ``S >= 1``.
        costs: ``k_s``, each stage's relative compute cost per sample (finite, ``> 0``); default all 1.
        hysteresis: ``h >= 0``, the relative throughput gain a move must bring.
        max_moves: how many moves at most (Algorithm 2 makes one per period).

    Raises:
        ValueError: a report names a stage outside ``[0, S)``, a peer twice, or has a rate or queue out of
            range; or ``costs``/``hysteresis``/``max_moves`` are out of range.
    """
    weights = _check(reports, stages, costs)
    if not (math.isfinite(hysteresis) and hysteresis >= 0.0):
        raise ValueError(f"hysteresis must be finite and >= 0, got {hysteresis}")
    if max_moves < 0:
        raise ValueError(f"max_moves must be >= 0, got {max_moves}")
    where = {r.peer: r.stage for r in reports}
    rate = {r.peer: r.rate for r in reports}  # at the peer's current stage
    queue = {r.peer: r.queue for r in reports}
    before = _capacities(where, rate, stages)
    moves: list[Move] = []
    capacities = before
    for _ in range(max_moves):
        move = _best_move(where, rate, queue, capacities, weights, hysteresis)
        if move is None:
            break
        moves.append(move)
        speed = rate[move.peer] * weights[move.source]
        rate[move.peer] = speed / weights[move.target]
        where[move.peer] = move.target
        queue[move.peer] = 0
        capacities = _capacities(where, rate, stages)
    return RebalancePlan(
        moves=tuple(moves),
        capacities_before=before,
        capacities_after=capacities,
        throughput_before=min(before),
        throughput_after=min(capacities),
    )


def place_newcomer(
    reports: Sequence[ServerReport],
    stages: int,
    *,
    costs: Sequence[float] | None = None,
    speed: float = 1.0,
    tiebreak: str = "",
) -> int:
    """The stage a new server should serve: the best capacities leximin after it joins (module docstring).

    Args:
        reports: the current servers' reports.
        stages: ``S >= 1``.
        costs: as in :func:`plan_rebalance`.
        speed: the newcomer's expected samples/s at a stage of cost 1 (finite, ``> 0``); it only matters
            with unequal costs.
        tiebreak: the newcomer's peer id: equally good stages are taken in an order that starts at a stage
            derived from it (default: the lower index first). Newcomers that read the same records at
            once then spread over the unserved stages instead of all taking the first.

    Raises:
        ValueError: as :func:`plan_rebalance`, or ``speed`` out of range.
    """
    weights = _check(reports, stages, costs)
    if not (math.isfinite(speed) and speed > 0.0):
        raise ValueError(f"speed must be finite and > 0, got {speed}")
    typical = with_unmeasured_as_typical(reports)
    capacities = _capacities({r.peer: r.stage for r in typical}, {r.peer: r.rate for r in typical}, stages)

    served = {r.stage for r in reports}
    offset = zlib.crc32(tiebreak.encode()) % stages if tiebreak else 0

    def score(stage: int) -> tuple[int, tuple[float, ...], float, int]:
        after = list(capacities)
        after[stage] += speed / weights[stage]
        empty = sum(1 for s in range(stages) if s not in served and s != stage)
        return (-empty, tuple(sorted(after)), -load_ratio(after), -((stage - offset) % stages))

    return max(range(stages), key=score)


def _check(reports: Sequence[ServerReport], stages: int, costs: Sequence[float] | None) -> tuple[float, ...]:
    if stages < 1:
        raise ValueError(f"need at least one stage, got {stages}")
    weights = tuple(float(c) for c in costs) if costs is not None else (1.0,) * stages
    if len(weights) != stages or any(not (math.isfinite(c) and c > 0.0) for c in weights):
        raise ValueError(f"costs must be {stages} finite values > 0, got {costs}")
    seen: set[str] = set()
    for r in reports:
        if not 0 <= r.stage < stages:
            raise ValueError(f"{r.peer!r} reports stage {r.stage}, outside [0, {stages})")
        if not (math.isfinite(r.rate) and r.rate >= 0.0):
            raise ValueError(f"{r.peer!r} reports rate {r.rate}; a rate is finite and >= 0")
        if r.queue < 0:
            raise ValueError(f"{r.peer!r} reports queue {r.queue} < 0")
        if r.peer in seen:
            raise ValueError(f"{r.peer!r} reports twice")
        seen.add(r.peer)
    return weights


def _capacities(where: dict[str, int], rate: dict[str, float], stages: int) -> tuple[float, ...]:
    totals: list[list[float]] = [[] for _ in range(stages)]
    for peer, stage in where.items():
        totals[stage].append(rate[peer])
    return tuple(math.fsum(t) for t in totals)


def _best_move(
    where: dict[str, int],
    rate: dict[str, float],
    queue: dict[str, int],
    capacities: tuple[float, ...],
    weights: tuple[float, ...],
    hysteresis: float,
) -> Move | None:
    members: list[list[str]] = [[] for _ in capacities]
    for peer, stage in where.items():
        members[stage].append(peer)
    empty = [s for s, peers in enumerate(members) if not peers]
    target = empty[0] if empty else min(range(len(capacities)), key=lambda s: (capacities[s], s))
    candidates: list[tuple[tuple[tuple[float, ...], float, int], str, Move, tuple[float, ...]]] = []
    for peer, source in where.items():
        if source == target or len(members[source]) < 2:
            continue
        # each predicted sum is computed afresh, exactly rounded as _capacities does: updating the old
        # sums by one rate is off by an ulp, and with h = 0 an ulp "gain" accepted a move that merely
        # swapped two stages' capacities (and a cycle of such moves could ping-pong)
        after = list(capacities)
        after[source] = math.fsum(rate[p] for p in members[source] if p != peer)
        moved = rate[peer] * weights[source] / weights[target]
        after[target] = math.fsum([*(rate[p] for p in members[target]), moved])
        key = (tuple(sorted(after)), -load_ratio(after), -queue[peer])
        candidates.append((key, peer, Move(peer, source, target), tuple(after)))
    # best first; ties keep the smaller peer id
    candidates.sort(key=lambda c: c[1])
    candidates.sort(key=lambda c: c[0], reverse=True)
    if empty:  # rule 0: a refill is always made (unmeasured servers add no capacity to compare)
        return candidates[0][2] if candidates else None
    for _, _, move, after_t in candidates:  # the best candidate that passes rule 3's tests
        if _improves(capacities, after_t, hysteresis) and load_ratio(after_t) <= load_ratio(capacities):
            return move
    return None


def _improves(before: Sequence[float], after: Sequence[float], hysteresis: float) -> bool:
    """Whether ``after`` beats ``before`` leximin by the margin ``h`` (module docstring, rule 3): at some
    sorted position ``i``, ``C'_(i) >= (1 + h) C_(i)`` and strictly larger, and no earlier position is lower.
    A gain below the margin at an earlier position counts as a tie: measured capacities of tied bottlenecks
    are never exactly equal, and deciding at that noise would refuse every move that frees one of them."""
    for old, new in zip(sorted(before), sorted(after), strict=True):
        if new < old:
            return False
        if new > old and new >= (1.0 + hysteresis) * old:
            return True
    return False
