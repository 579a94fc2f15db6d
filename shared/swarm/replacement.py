"""Re-placing a running swarm with the scheduler when rebalancing would move many servers at once
(issue 17 item 5, second half; seed 002 §3.2-3.4, seed 004 App. D; pure: no trio, no sockets, no torch).

The rebalancer (:mod:`.rebalance`) moves one server per period, blind to links. After a mass departure
(several servers of a stage, or whole stages, gone together) or a burst of newcomers it would take many
periods to repair, one blind move at a time; the issue asks that the heterogeneous scheduler decide that
placement instead, as it does when the run forms (:mod:`.links`). This module holds the two rules every
stage server applies to the same records, so that all of them reach one re-placement without a
coordinator: *whether* to re-place (:func:`gate`) and *which* placement (:func:`replacement`).

**"Many"** (:func:`rebalance_moves`, :func:`is_many`). The rebalancer's plan iterated until stable on its
own predictions (:func:`~.rebalance.plan_rebalance` with ``max_moves = n + S``, the same hysteresis) is
what one-move-per-period rebalancing would do over the next periods. It is *many* when it holds at least
``max(min_moves, ceil(fraction * n))`` moves (defaults 2 and a quarter of the ``n`` servers): two stages
emptied at once (two refills), a stage starved beyond one move, a burst of measured newcomers in one
stage. One move stays the rebalancer's.

**When** (:func:`gate`; the service calls it once per period). Periods are aligned to the wall clock: the
servers read the stage records right after each multiple of ``T`` (slot ``t // T``), so servers that read
the same records decide in the same slot. The *basis* of a read is the set of (server, stage) pairs; it
*stood* from slot ``a`` when it was read at every slot since ``a``, and the current slot is later than
``a`` by at least ``settle`` seconds (default :data:`~protocols.swarm.STAGE_RECORD_TTL`). A *departure*
is a read that misses a server of the read before. The verdict is, in this order:

0. ``wait`` until ``settle`` seconds after our last re-placement (its moves are under way: a stage the
   movers go to can look empty until their records are out, and must not draw a refill meanwhile);
1. ``replace`` when the plan is *many* and the basis stood, unless fewer than ``cooldown_periods`` slots
   passed since our last re-placement. The records of servers that died in one burst expire one by one,
   within one republish interval (a third of a record's lifetime) of each other: a basis that stood
   longer than that holds none of them (the default waits a whole lifetime, a margin for DHT delays), and
   a lookup that missed records once cannot trigger a re-placement;
2. ``rebalance`` (the rebalancer's single move, as without this module) when the plan is not *many* (or
   we are cooling down) and no departure happened in the last ``settle`` seconds. After a departure the
   rebalancer waits too: the first expired record of a burst shows one empty stage, one refill, and a
   single move then would change the basis, so the burst would be repaired one blind move at a time;
3. ``rebalance`` when we have been waiting for ``patience`` seconds (default 3 ``settle``): a stranger
   whose record comes and goes at every period would otherwise hold rebalancing back for ever; it can
   delay single moves by ``patience`` at most;
4. ``wait`` otherwise: no single move meanwhile (the scheduler, not the rebalancer, is to place these
   servers).

What it costs the rebalancer: after a departure, its refill waits until the basis stood (one period when
``T >= settle``, else ``settle`` seconds); joins and its own moves do not make it wait.

At most one re-placement per ``cooldown_periods`` periods (default 10) per server; the rule below makes
its result stable under the rebalancer, so under unchanged measurements the next periods move nobody.

**Which placement** (:func:`replacement`), from the basis's servers, their (bounded) rates, the link and
bandwidth matrices (:func:`.links.round_trips`, :func:`.links.bandwidths`: the link records servers
published, missing or expired pairs filled by the same rule as at formation), the workload and the run id:

1. :func:`.links.formation_placement` with the servers ordered by ``sha256(run id | peer)`` in place of
   join times: the first ``S floor(n / S)`` placed by the scheduler with the formation's deterministic seed,
   the rest spread by :func:`~.rebalance.place_newcomer`; same inputs, same answer on every server;
2. the pipeline read forwards or backwards (the same cost: the open path is symmetric), whichever keeps
   more servers at their stage (ties: forwards);
3. the rebalancer iterated until stable on that placement with the measured rates (a moved server is
   predicted at its rate, as the service's rebalancing assumes: every stage costs alike), so that the
   result does not itself call for many moves at the next period (no oscillation between the
   scheduler's balanced groups and the rebalancer's rate balance);
4. *keepers*: every stage served now keeps one of its current servers (the one with the smallest id among
   them is swapped with the smallest-id server placed into that stage from elsewhere). A stage's state
   lives only in its servers (and backbones' checkpoints); a rebalancing move never empties a stage for
   that reason, and a re-placement must not either: the servers moving in download the stage's state
   from its keeper as any moved server does. The swap keeps every stage's server count and every other
   stage's keeper.

**Disagreement.** Servers whose reads differ (a record stored late, a clock a period off) can decide in
different slots or compute different placements. Nobody waits on anybody's decision: each serves the stage
its own placement names, and the next periods repair what differs (the rebalancer's refill and single
moves; after ``cooldown_periods``, another re-placement if still *many*). Rates enter only the trigger and
step 3, so two readers of the same basis agree unless their rates differ enough to change a hysteresis test.

**What a stranger can do** (DESIGN D10). Nothing it cannot do today: its rate is bounded by
:func:`~.rebalance.bound_rates` before either rule sees it, its link claims by :func:`.links.bounded_links`,
the order of step 1 does not depend on anything it claims, and it can serve any stage it likes (against
the plan or not) as it can without re-placements. It can make re-placements more frequent by coming and
going, at most one per ``cooldown_periods`` periods, each costing the moved servers a state download.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from protocols.swarm import STAGE_RECORD_TTL

from .links import DEFAULT_GENERATIONS, FormationPlacement, formation_placement
from .placement_cost import Workload
from .rebalance import DEFAULT_HYSTERESIS, Move, ServerReport, plan_rebalance

__all__ = [
    "GateState",
    "Replacement",
    "ReplacementConfig",
    "Verdict",
    "basis",
    "gate",
    "is_many",
    "rebalance_moves",
    "replacement",
    "replacement_order",
]

Verdict = Literal["rebalance", "wait", "replace"]


@dataclass(frozen=True)
class ReplacementConfig:
    """When the scheduler re-places a running swarm (module docstring).

    Attributes:
        fraction: *many* is at least this share of the servers (and at least ``min_moves``).
        min_moves: *many* is at least this many moves.
        settle: seconds the same basis must stand while *many* before a re-placement.
        patience: seconds of *many* without a settled basis after which single moves resume.
        cooldown_periods: periods after a re-placement before the next one.
        generations: the scheduler's offspring (no time limit: deterministic).
        workload: the cost model's bytes (None: the service estimates it from the task).
    """

    fraction: float = 0.25
    min_moves: int = 2
    settle: float = STAGE_RECORD_TTL
    patience: float = 3 * STAGE_RECORD_TTL
    cooldown_periods: int = 10
    generations: int = DEFAULT_GENERATIONS
    workload: Workload | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fraction) and 0.0 <= self.fraction <= 1.0):
            raise ValueError(f"fraction must be in [0, 1], got {self.fraction}")
        if self.min_moves < 2:
            raise ValueError(f"min_moves must be >= 2 (one move is the rebalancer's), got {self.min_moves}")
        if not (math.isfinite(self.settle) and self.settle >= 0.0):
            raise ValueError(f"settle must be finite and >= 0, got {self.settle}")
        if not (math.isfinite(self.patience) and self.patience >= self.settle):
            raise ValueError(f"patience must be finite and >= settle, got {self.patience}")
        if self.cooldown_periods < 1:
            raise ValueError(f"cooldown_periods must be >= 1, got {self.cooldown_periods}")


@dataclass(frozen=True)
class GateState:
    """What :func:`gate` remembers between periods (start with ``GateState()``).

    Attributes:
        basis: the basis of the last read, or None.
        since: the slot that basis was first seen in (consecutively).
        held: the slot since which we have been waiting, or None.
        last: the slot of our last re-placement, or None.
        peers: the servers of the last read, or None.
        departed: the last slot whose read missed a server of the read before, or None.
    """

    basis: frozenset[tuple[str, int]] | None = None
    since: int = 0
    held: int | None = None
    last: int | None = None
    peers: frozenset[str] | None = None
    departed: int | None = None


@dataclass(frozen=True)
class Replacement:
    """A re-placement (module docstring, "Which placement").

    Attributes:
        stages: the stage each server of the basis serves.
        moves: the servers whose stage changes, by peer id.
        formation: step 1's placement (before steps 2-4).
    """

    stages: Mapping[str, int]
    moves: tuple[Move, ...]
    formation: FormationPlacement


def basis(reports: Sequence[ServerReport]) -> frozenset[tuple[str, int]]:
    """The (server, stage) pairs of a read (module docstring, "When")."""
    return frozenset((r.peer, r.stage) for r in reports)


def rebalance_moves(
    reports: Sequence[ServerReport], stages: int, *, hysteresis: float = DEFAULT_HYSTERESIS
) -> tuple[Move, ...]:
    """The rebalancer's plan iterated until stable (module docstring, "Many")."""
    return plan_rebalance(reports, stages, hysteresis=hysteresis, max_moves=len(reports) + stages).moves


def is_many(moves: int, servers: int, config: ReplacementConfig) -> bool:
    """Whether ``moves`` rebalancing moves among ``servers`` servers are *many* (module docstring)."""
    return moves >= max(config.min_moves, math.ceil(config.fraction * servers))


def gate(
    state: GateState,
    slot: int,
    period: float,
    reports: Sequence[ServerReport],
    stages: int,
    config: ReplacementConfig,
    *,
    hysteresis: float = DEFAULT_HYSTERESIS,
) -> tuple[Verdict, GateState]:
    """This period's verdict and the state for the next (module docstring, "When"). ``slot``: the
    period's index on the wall clock (``time // period``); ``period``: ``T`` in seconds. A ``replace``
    verdict records ``slot`` as the last re-placement.

    Raises:
        ValueError: as :func:`~.rebalance.plan_rebalance`, or ``period`` is not finite and ``> 0``.
    """
    if not (math.isfinite(period) and period > 0.0):
        raise ValueError(f"period must be finite and > 0, got {period}")

    def stood(start: int | None) -> bool:
        return start is not None and slot > start and (slot - start) * period >= config.settle

    seen = basis(reports)
    peers = frozenset(r.peer for r in reports)
    since = state.since if seen == state.basis else slot
    gone = state.peers is not None and not state.peers <= peers
    departed = slot if gone else state.departed
    if state.last is not None and not stood(state.last):  # our re-placement's moves are under way
        return "wait", GateState(seen, since, None, state.last, peers, departed)
    cooling = state.last is not None and slot - state.last < config.cooldown_periods
    many = not cooling and is_many(
        len(rebalance_moves(reports, stages, hysteresis=hysteresis)), len(reports), config
    )
    if many and stood(since):
        return "replace", GateState(seen, since, None, slot, peers, departed)
    if not many and (departed is None or stood(departed)):
        return "rebalance", GateState(seen, since, None, state.last, peers, departed)
    held = slot if state.held is None else state.held
    following = GateState(seen, since, held, state.last, peers, departed)
    if (slot - held) * period >= config.patience:
        return "rebalance", following
    return "wait", following


def replacement_order(run_id: str, peers: Sequence[str]) -> dict[str, float]:
    """Step 1's order, as the "join times" :func:`.links.formation_placement` sorts by: the rank of
    ``sha256(run id | peer)``."""
    ranked = sorted(peers, key=lambda p: (hashlib.sha256(f"{run_id}|{p}".encode()).digest(), p))
    return {p: float(i) for i, p in enumerate(ranked)}


def replacement(
    reports: Sequence[ServerReport],
    rtt: npt.NDArray[np.float64],
    bandwidth: npt.NDArray[np.float64],
    work: Workload,
    run_id: str,
    *,
    hysteresis: float = DEFAULT_HYSTERESIS,
    generations: int = DEFAULT_GENERATIONS,
) -> Replacement:
    """The scheduler's re-placement of the servers of ``reports`` (module docstring, "Which placement").

    Args:
        reports: one per server (rates already bounded), at the stage it serves now.
        rtt: round trips (:func:`.links.round_trips`) over the sorted peer ids of ``reports``.
        bandwidth: bandwidths (:func:`.links.bandwidths`) over the same order.
        work: the stage count and bytes of the cost model.
        run_id: orders the servers and seeds the search.
        hysteresis: the rebalancer's margin (step 3).
        generations: the search's offspring.

    Raises:
        ValueError: no server, matrices of another size, or a report out of range.
    """
    stages = work.stages
    current = {r.peer: r.stage for r in reports}
    rate = {r.peer: r.rate for r in reports}
    if len(current) != len(reports):
        raise ValueError("a server reports twice")
    formed = formation_placement(
        replacement_order(run_id, list(current)), rtt, bandwidth, work, run_id, generations=generations
    )
    forwards = dict(formed.stages)
    backwards = {p: stages - 1 - k for p, k in forwards.items()}

    def stays(placed: Mapping[str, int]) -> int:
        return sum(placed[p] == current[p] for p in current)

    placed = backwards if stays(backwards) > stays(forwards) else forwards
    predicted = [ServerReport(p, placed[p], rate[p]) for p in sorted(placed)]
    for move in rebalance_moves(predicted, stages, hysteresis=hysteresis):
        placed[move.peer] = move.target
    for k in range(stages):
        mine = sorted(p for p, s in current.items() if s == k)
        if not mine or any(placed[p] == k for p in mine):
            continue
        keeper = mine[0]
        incoming = sorted(p for p, s in placed.items() if s == k)
        if incoming:
            placed[incoming[0]] = placed[keeper]
        placed[keeper] = k
    moves = tuple(Move(p, current[p], placed[p]) for p in sorted(placed) if placed[p] != current[p])
    return Replacement(placed, moves, formed)
