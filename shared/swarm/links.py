"""Measured links among a swarm run's servers, and the placement a forming run computes from them
(issue 17 item 5; seed 002 §2-3; pure: no trio, no sockets, no torch).

The protocol that produces the inputs is :mod:`volunteer.swarm.formation`; the records are
:class:`protocols.swarm.LinkRecord`. This module holds the rules every server applies to the same records,
so that servers that read the same records compute the same placement without a coordinator.

**Sampling** (:func:`sample_peers`). A server measures the round trip to ``k`` other servers, not all
``n - 1``: the ``k`` whose ``sha256(me | peer)`` is smallest (rendezvous hashing). The choice depends only on
the pair, so it is stable as servers join (a pair sampled stays sampled while fewer than ``k`` others rank
before it), spread evenly (every pair is sampled by each end with probability ``k / (n - 1)``, so measured
by at least one end with ``1 - (1 - k/(n-1))²``), and nobody can steer which servers measure it.

**Bounds** (:func:`bounded_links`, DESIGN D10). A record is its writer's claim about its own links. The
reader keeps only samples that name a server of the formation other than the writer, the first per
peer, at most :data:`~protocols.swarm.MAX_LINK_SAMPLES` of them, with a finite round trip clamped to
``[0, MAX_LINK_RTT]`` (the wire type refuses values outside it already; the clamp holds for values built
in memory too). Records of writers outside the formation are never read (the caller builds the member
set from records whose subkey is their writer, and the run's validator stores nothing an unadmitted
writer says).

**Filling the matrix** (:func:`round_trips`). ``r[a][b]`` is what ``a`` measured to ``b``. For each pair:

1. *Measured.* Both directions: their mean (the paper's communication graph labels each edge with the
   mean of both directions, seed 002 §2); one direction: that one.
2. *Triangle.* Otherwise, from the servers ``m`` both ends have a measured link to (step 1's values ``D``):
   round trips roughly obey the triangle inequality, so ``L = max_m |D[a,m] - D[b,m]| <= r <= U =
   min_m (D[a,m] + D[m,b])``, and the estimate is ``(L + U) / 2`` (when noise makes ``L > U`` this still lies
   between them). Two servers of one site (both near ``m``, both far from another site's ``m'``) get
   ``U`` small: the fill keeps a site's structure without measuring all of it.
3. *Median.* Otherwise the median of step 1's values; with nothing measured at all, :data:`DEFAULT_RTT`
   (every pair alike: every placement then costs the same, and the scheduler's tie-breaks decide).

Every value is symmetric, finite and in ``[0, MAX_LINK_RTT]`` (property-tested). The cost model's delay
``alpha`` is the one-way time, ``rtt / 2``.

**Bandwidth** (:func:`bandwidths`). A pair's bandwidth is not measured pairwise (a bulk transfer per pair
costs seconds and megabytes on links that are slow to begin with); it reuses what the capability probe
already published (:data:`protocols.probe.CAPABILITIES_KEY`: each peer's upload and download against a
backbone): ``a -> b`` moves at most ``min(up_a, down_b)``, and the edge is the mean of both directions.
Pairs with an end that published nothing get the median of the known edges, or
:data:`DEFAULT_BANDWIDTH`; all clamped to ``[MIN_BANDWIDTH, MAX_BANDWIDTH]``.

**The placement** (:func:`formation_placement`). Inputs: the formation's servers with their join times,
the two matrices, the :class:`~shared.swarm.placement_cost.Workload`, the run id. The scheduler needs
balanced groups (``S`` divides the device count, seed 002 §2), so:

* the *scheduled* servers are the first ``m = S * floor(n / S)`` in the order (join time, peer id): the
  earliest ones, a set every reader derives alike;
* they are placed by :func:`~shared.swarm.scheduler.schedule` with ``SearchConfig(time_limit=None,
  generations=G)`` and the seed ``sha256(run id, sorted peer ids)``: deterministic, so equal inputs give
  equal placements on every server; ``placement.stages[k]`` (pipeline order) serves stage ``k``;
* the ``n - m`` *leftovers* (and every server when ``n < S``) are placed one by one in the same order by
  :func:`~shared.swarm.rebalance.place_newcomer`, as if the servers placed so far reported a rate (the
  scheduled ones ``0``, which a newcomer counts as typical, leftovers ``1``: every stage holds as many
  scheduled servers as the next, so leftovers spread over distinct stages first). With ``n >= S``
  every stage gets at least one scheduled server; with ``n < S``, ``n`` distinct stages are served and
  the rest wait for newcomers.

Servers that read slightly different records (a record stored a moment late, a server that joined at the
close) can compute different placements. Nobody waits on anybody's placement: each serves the stage it
computed for itself, and the rebalancing rule (:mod:`shared.swarm.rebalance`, rule 0) refills a stage
left without a server within a period; nothing deadlocks and no stage stays empty.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protocols.swarm import MAX_LINK_RTT, MAX_LINK_SAMPLES

from .placement_cost import Network, Workload
from .rebalance import ServerReport, place_newcomer
from .scheduler import Placement, SearchConfig, schedule

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_GENERATIONS",
    "DEFAULT_RTT",
    "MAX_BANDWIDTH",
    "MIN_BANDWIDTH",
    "FormationPlacement",
    "bandwidths",
    "bounded_links",
    "formation_placement",
    "formation_seed",
    "network",
    "round_trips",
    "sample_peers",
]

Floats = npt.NDArray[np.float64]

#: A pair's round trip when nothing was measured at all (seconds).
DEFAULT_RTT = 0.05
#: A pair's bandwidth when no peer published one (bytes/s: 100 Mbit/s).
DEFAULT_BANDWIDTH = 12.5e6
#: Bandwidths are clamped to this range (bytes/s: 8 kbit/s to 800 Gbit/s).
MIN_BANDWIDTH = 1e3
MAX_BANDWIDTH = 1e11
#: Offspring the formation's genetic search makes (no time limit: the result depends on the seed only).
DEFAULT_GENERATIONS = 100


def sample_peers(me: str, peers: Iterable[str], k: int) -> list[str]:
    """The ``k`` peers ``me`` measures (module docstring, "Sampling"): the smallest ``sha256(me|peer)``."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    others = sorted({p for p in peers if p != me})
    return sorted(others, key=lambda p: (hashlib.sha256(f"{me}|{p}".encode()).digest(), p))[:k]


def bounded_links(
    writer: str, samples: Iterable[tuple[str, float]], members: Iterable[str]
) -> dict[str, float]:
    """What the reader keeps of ``writer``'s claimed round trips (module docstring, "Bounds")."""
    allowed = set(members)
    kept: dict[str, float] = {}
    for peer, rtt in samples:
        if len(kept) >= MAX_LINK_SAMPLES:
            break
        if peer == writer or peer not in allowed or peer in kept or not math.isfinite(rtt):
            continue
        kept[peer] = min(max(float(rtt), 0.0), MAX_LINK_RTT)
    return kept


def round_trips(peers: Sequence[str], measured: Mapping[str, Mapping[str, float]]) -> Floats:
    """The symmetric round-trip matrix over ``peers`` (in that order) from the directed measurements
    ``measured[a][b]`` (module docstring, "Filling the matrix"; entries are bounded first). Diagonal 0."""
    n = len(peers)
    index = {p: i for i, p in enumerate(peers)}
    if len(index) != n:
        raise ValueError("peers repeat")
    directed = np.full((n, n), np.nan)
    for writer, row in measured.items():
        if writer not in index:
            continue
        for peer, rtt in bounded_links(writer, row.items(), peers).items():
            directed[index[writer], index[peer]] = rtt
    both = np.stack([directed, directed.T])
    known = ~np.isnan(both)
    direct = np.where(known.any(axis=0), np.nansum(both, axis=0) / np.maximum(known.sum(axis=0), 1), np.nan)
    np.fill_diagonal(direct, np.nan)
    out = direct.copy()
    values = direct[~np.isnan(direct)]
    fallback = float(np.median(values)) if values.size else DEFAULT_RTT
    for a in range(n):
        for b in range(a + 1, n):
            if not np.isnan(direct[a, b]):
                continue
            common = ~np.isnan(direct[a]) & ~np.isnan(direct[b])
            if common.any():
                low = float(np.abs(direct[a, common] - direct[b, common]).max())
                high = float((direct[a, common] + direct[b, common]).min())
                value = (low + high) / 2
            else:
                value = fallback
            out[a, b] = out[b, a] = value
    np.fill_diagonal(out, 0.0)
    return np.asarray(np.clip(out, 0.0, MAX_LINK_RTT), dtype=np.float64)


def bandwidths(peers: Sequence[str], capacities: Mapping[str, tuple[float, float]]) -> Floats:
    """The symmetric bandwidth matrix (bytes/s) from each peer's ``(upload, download)`` (module docstring,
    "Bandwidth"; non-finite or non-positive values count as unknown). Diagonal ``inf``."""
    n = len(peers)

    def usable(x: float) -> float | None:
        return min(max(float(x), MIN_BANDWIDTH), MAX_BANDWIDTH) if math.isfinite(x) and x > 0 else None

    caps = [capacities.get(p, (math.nan, math.nan)) for p in peers]
    up = [usable(c[0]) for c in caps]
    down = [usable(c[1]) for c in caps]
    edges: dict[tuple[int, int], float] = {}
    for a in range(n):
        for b in range(a + 1, n):
            known = [
                min(u, d) for u, d in ((up[a], down[b]), (up[b], down[a])) if u is not None and d is not None
            ]
            if known:
                edges[a, b] = sum(known) / len(known)
    fallback = statistics.median(edges.values()) if edges else DEFAULT_BANDWIDTH
    out = np.full((n, n), fallback)
    for (a, b), value in edges.items():
        out[a, b] = out[b, a] = value
    np.fill_diagonal(out, math.inf)
    return out


def network(rtt: Floats, bandwidth: Floats) -> Network:
    """The cost model's graph: delay ``rtt / 2`` (one way) and the bandwidths."""
    return Network(rtt / 2.0, bandwidth)


def formation_seed(run_id: str, peers: Iterable[str]) -> int:
    """The genetic search's seed: the same for every server that sees the same formation."""
    text = "\n".join([run_id, *sorted(peers)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


@dataclass(frozen=True)
class FormationPlacement:
    """Who serves which stage when the run forms (module docstring, "The placement").

    Attributes:
        stages: ``stages[peer]`` the stage each server of the formation serves.
        scheduled: the servers the scheduler placed, in (join time, peer id) order.
        leftovers: the servers placed by :func:`~shared.swarm.rebalance.place_newcomer` after them.
        placement: the scheduler's answer over ``scheduled`` (indices into it), or None when ``n < S``.
    """

    stages: Mapping[str, int]
    scheduled: tuple[str, ...]
    leftovers: tuple[str, ...]
    placement: Placement | None


def formation_placement(
    joined: Mapping[str, float],
    rtt: Floats,
    bandwidth: Floats,
    work: Workload,
    run_id: str,
    *,
    generations: int = DEFAULT_GENERATIONS,
) -> FormationPlacement:
    """Place a forming run's servers (module docstring, "The placement").

    Args:
        joined: every server of the formation and when it joined (unix time).
        rtt: round trips (:func:`round_trips`) over ``sorted(joined)``.
        bandwidth: bandwidths (:func:`bandwidths`) over ``sorted(joined)``.
        work: the stage count and bytes of the cost model.
        run_id: seeds the search with the peer set.
        generations: the search's offspring.

    Raises:
        ValueError: no server, or matrices of another size.
    """
    peers = sorted(joined)
    n, s = len(peers), work.stages
    if n == 0:
        raise ValueError("a formation has at least one server")
    if rtt.shape != (n, n) or bandwidth.shape != (n, n):
        raise ValueError(f"matrices of shape {rtt.shape} and {bandwidth.shape} for {n} servers")
    order = sorted(peers, key=lambda p: (joined[p], p))
    m = s * (n // s)
    scheduled, leftovers = tuple(order[:m]), tuple(order[m:])
    stages: dict[str, int] = {}
    placement: Placement | None = None
    if m:
        index = [peers.index(p) for p in scheduled]
        sub = np.ix_(index, index)
        config = SearchConfig(generations=generations, time_limit=None)
        seed = formation_seed(run_id, peers)
        placement = schedule(network(rtt[sub], bandwidth[sub]), work, seed=seed, config=config)
        for k, group in enumerate(placement.stages):
            for i in group:
                stages[scheduled[i]] = k
    reports = [ServerReport(p, k, 0.0) for p, k in stages.items()]
    for peer in leftovers:
        stage = place_newcomer(reports, s, tiebreak=peer)
        stages[peer] = stage
        reports.append(ServerReport(peer, stage, 1.0))
    return FormationPlacement(stages, scheduled, leftovers, placement)
