"""Group formation, pure: how big groups are, who averages with whom, and how long a round may take.

**Group size** (seed 000 §3.2 "Node failures"). A failure spoils only its own group's round. If each peer
fails during a round with probability ``f``, a group of ``m`` peers completes with probability
``(1 - f)^m``. :func:`choose_group_size` picks the largest ``m <= max_size`` with
``(1 - f)^m >= 1 - max_spoil`` (at least ``min_size``, at most the number of peers): reliable swarms
average in big groups (fewer rounds to mix), flaky ones in small groups (fewer spoiled rounds).

**Moshpit groups** (Ryabinin et al., 2021). Peers sit on a virtual ``d``-dimensional grid with ``m`` cells
per side, ``d = ceil(log_m n)``; in round ``r`` a peer averages with the peers sharing all its coordinates
except coordinate ``r mod d``. On a full grid (``n = m^d``) every peer holds the exact global mean after
``d`` rounds; with gaps or failures the spread still shrinks geometrically. A peer's coordinates are the
base-``m`` digits of a hash of (peer id, epoch), so cells are balanced in expectation and change every epoch
(alternating membership).

**Deadlines** adapt to what rounds really took: :func:`adaptive_deadline` scales the LP's predicted
averaging time by the worst recent ratio of measured to predicted time (with headroom), so nobody tunes a
constant by hand, yet a round that hangs is still bounded. A follower accepts a leader's deadline only up to
:data:`DEADLINE_SLACK` times the deadline it computes itself from its own LP solution and its own measured
history (:func:`deadline_acceptable`): leaders and followers of one group lived through the same rounds, so
an honest leader's deadline is within that factor, while 86,400 s is not.

**Leaders** (:func:`leader_of`): the member whose ``sha256("leader", group key, peer id)`` is smallest.
Nobody declares itself leader, every member computes the same leader from the same tickets, and since the
group key changes every round and attempt, an admitted peer cannot grind a peer id that leads often.

**Weights** (issue 9; DESIGN D10 (c)). A weight is a peer's own claim of the samples behind its gradient.
Two bounds, both from what *others* can check:

1. *In the plan* (:func:`bound_weights`, deterministic, so every member verifies it): a claim is capped at
   :data:`WEIGHT_CAP_MULTIPLE` (8) times the group's **lower median** of positive claims, and at the run's
   ``max_weight`` (the target batch plus one micro-batch: nobody accumulates more before the step). A peer
   cannot raise the median by writing its own progress or tickets: with an honest majority of senders, at
   least half of the claims at or above the lower median are honest, so the lower median lies between the
   smallest and the largest honest claim (with 2 senders it is the smaller claim). A liar therefore weighs
   at most 8 honest medians. 8 because honest weights are proportional to device speed, and volunteer
   accelerators differ up to about that much; slower peers (a newcomer's first micro-batch, a CPU) are
   below the median and never capped.
2. *At each aggregator* (:class:`WeightHistory`): the aggregator remembers the weights it used for each
   sender in earlier rounds (the weights its receipts state) and when. A sender gets at most
   ``max(plan's lower median, GROWTH · largest recent weight · max(1, elapsed / typical interval))``:
   a rate grows at most :data:`GROWTH` (4) times per round it is observed, so a peer that behaved modestly
   cannot suddenly claim the whole batch. This bound is per aggregator (its own history): each slice is
   reduced by one aggregator, so members still end bit-identical, but slices may weigh a capped sender
   differently.

**Capping vs large-batch equivalence.** Without a binding cap the all-reduce is ``Σ w_i g_i / Σ w_i`` with
``w_i`` the true sample counts: exactly the large-batch gradient. When a cap binds, the capped peer's
samples count ``w'/w < 1`` each: still an average of honest per-sample gradients, but not the large-batch
one (more weight on the other peers' samples) for that round. Receipts carry the capped weight, so the
ledger credits what was used. Honest runs with speeds within 8x of the median (and growing at most 4x per
round) never hit a cap.

**Averaged slices** are checked by their receivers (:func:`average_norm_bound`): finite, and with an L2 norm
per part of at most ``sqrt(S) · min(max claim, NORM_CAP_MULTIPLE · upper median claim)`` over the ``S``
senders' ticket ``norm`` claims, widened by the codec's error. An aggregator bans a sender whose part is
larger than its own claim, so a weighted mean of accepted parts is no larger than the largest claim (a
convex combination); ``sqrt(S)`` covers robust rules whose output stays within the inputs' coordinate-wise
range (trimmed mean, CenteredClip started there). The cap keeps a liar's claim from opening the bound: with
an honest majority of senders the *upper* median (element ``S // 2``) is at most the largest honest claim.
The upper, not the lower, median, so that honest senders with tiny norms (zero gradients, huge batches)
cannot close the bound on an honest mean; the cap only binds an honest round when more than half of the
senders claim less than 1/16 of another honest sender's norm and that sender's parts dominate the mean. With
two senders the cap is the larger claim (no honest majority to lean on).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEADLINE_SLACK",
    "GROWTH",
    "NORM_CAP_MULTIPLE",
    "WEIGHT_CAP_MULTIPLE",
    "WeightHistory",
    "adaptive_deadline",
    "average_norm_bound",
    "bound_weights",
    "choose_group_size",
    "codec_norm_slack",
    "deadline_acceptable",
    "grid_coordinates",
    "grid_dims",
    "group_key",
    "leader_of",
    "lower_median",
]

WEIGHT_CAP_MULTIPLE = 8.0
NORM_CAP_MULTIPLE = 16.0
GROWTH = 4.0
DEADLINE_SLACK = 4.0


def choose_group_size(
    n_peers: int, failure_rate: float, *, max_size: int = 32, min_size: int = 2, max_spoil: float = 0.1
) -> int:
    """The group size for ``n_peers`` peers that fail with probability ``failure_rate`` per round.

    Raises:
        ValueError: an argument is out of range.
    """
    if (
        n_peers < 1
        or not 0.0 <= failure_rate < 1.0
        or not 0.0 < max_spoil < 1.0
        or not 2 <= min_size <= max_size
    ):
        raise ValueError(
            f"invalid group sizing: n={n_peers}, f={failure_rate}, sizes [{min_size}, {max_size}], "
            f"max_spoil={max_spoil}"
        )
    # (1 - f)^m >= 1 - s  <=>  m <= log(1 - s) / log(1 - f)   (infinite for f = 0 or a subnormal f)
    with_f = math.log1p(-failure_rate)
    limit = math.log1p(-max_spoil) / with_f if with_f < 0 else math.inf
    best = max_size if limit >= max_size else math.floor(limit)
    return max(1, min(n_peers, max(min_size, min(max_size, best))))


def grid_dims(n_peers: int, group_size: int) -> int:
    """``d = ceil(log_m n)``: dimensions of a grid with ``m`` cells per side holding ``n`` peers."""
    if n_peers < 1 or group_size < 1:
        raise ValueError(f"need n_peers >= 1 and group_size >= 1, got {n_peers}, {group_size}")
    if group_size == 1 or n_peers <= group_size:
        return 1
    dims = 1
    while group_size**dims < n_peers:
        dims += 1
    return dims


def grid_coordinates(peer_id: str, epoch: int, dims: int, group_size: int) -> tuple[int, ...]:
    """The peer's cell for ``epoch``: base-``group_size`` digits of sha256(peer id, epoch)."""
    value = int.from_bytes(hashlib.sha256(f"moshpit:{epoch}:{peer_id}".encode()).digest(), "big")
    digits = []
    for _ in range(dims):
        value, digit = divmod(value, group_size)
        digits.append(digit)
    return tuple(digits)


def group_key(peer_id: str, epoch: int, round_: int, dims: int, group_size: int) -> str:
    """Peers with the same key average together in ``round_``: all coordinates but ``round_ mod dims``."""
    coords = grid_coordinates(peer_id, epoch, dims, group_size)
    free = round_ % dims
    return ".".join("*" if i == free else str(c) for i, c in enumerate(coords))


def adaptive_deadline(
    predicted_seconds: float,
    observed_ratios: Sequence[float],
    *,
    floor: float = 15.0,
    ceiling: float = 3600.0,
) -> float:
    """A round's deadline from the LP's prediction and recent ``measured / predicted`` ratios.

    ``deadline = floor + predicted * max(3, 2 * worst recent ratio)``, clamped to ``ceiling``; with no
    history the factor is 3. Non-finite predictions (a forced plan that cannot move data) give the ceiling.
    """
    if not math.isfinite(predicted_seconds) or predicted_seconds < 0:
        return ceiling
    recent = [r for r in observed_ratios[-16:] if math.isfinite(r) and r > 0]
    factor = max(3.0, 2.0 * max(recent)) if recent else 3.0
    return min(ceiling, floor + predicted_seconds * factor)


def deadline_acceptable(deadline: float, own_deadline: float) -> bool:
    """A leader's ``deadline`` is acceptable to a follower whose own computation gives ``own_deadline``."""
    return math.isfinite(deadline) and 0.0 < deadline <= DEADLINE_SLACK * own_deadline


def leader_of(key: str, members: Iterable[str]) -> str:
    """The group's leader: the member with the smallest ``sha256("leader", key, peer id)`` (ties: the id).

    Raises:
        ValueError: no members.
    """
    ranked = sorted((hashlib.sha256(f"leader:{key}:{m}".encode()).digest(), m) for m in members)
    if not ranked:
        raise ValueError("a group without members has no leader")
    return ranked[0][1]


def lower_median(values: Iterable[float]) -> float:
    """The lower median (element ``(n - 1) // 2`` of the sorted values); 0 for none."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def bound_weights(claims: Sequence[float], max_weight: float = math.inf) -> list[float]:
    """The plan's weights from the members' claims (module docstring, "Weights" 1)."""
    cap = min(max_weight, WEIGHT_CAP_MULTIPLE * lower_median(w for w in claims if w > 0))
    return [min(w, cap) for w in claims]


def codec_norm_slack(codec: str, numel: int) -> tuple[float, float]:
    """``(factor, absolute)``: how much larger a vector's norm may get through ``codec``'s encode/decode.

    fp16 rounds each element by at most 2**-11 relative (plus 2**-25 absolute in the subnormal range);
    int8-blockwise by at most absmax/254 per element of a 4,096-element block, i.e. at most 64/254 < 0.26 of
    the block's norm.
    """
    if codec == "fp16":
        return 1.0 + 2.0**-10, 2.0**-24 * math.sqrt(numel)
    if codec == "int8-blockwise":
        return 1.27, 0.0
    return 1.0 + 1e-5, 0.0  # float32 summation order only


def average_norm_bound(norms: Sequence[float], codec: str, numel: int) -> float:
    """Largest L2 norm an honest aggregator can return for a part of ``numel`` elements, given the senders'
    ticket ``norms`` (module docstring, "Averaged slices"). ``inf`` without senders or with unknown norms."""
    if not norms or any(not math.isfinite(n) for n in norms):
        return math.inf
    base = min(max(norms), NORM_CAP_MULTIPLE * sorted(norms)[len(norms) // 2])
    factor, absolute = codec_norm_slack(codec, numel)
    # the sender's encoding and the aggregator's re-encoding each widen by the codec's slack
    return math.sqrt(len(norms)) * (base * factor + absolute) * factor + absolute


@dataclass
class _Seen:
    times: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)


@dataclass
class WeightHistory:
    """What one aggregator saw each sender weigh, and when (module docstring, "Weights" 2).

    Bounded: ``keep`` observations per peer, ``max_peers`` peers (least recently seen forgotten first).
    Times are any monotonic clock's seconds.
    """

    keep: int = 8
    max_peers: int = 4096
    _peers: OrderedDict[str, _Seen] = field(default_factory=OrderedDict)

    def bound(self, peer: str, claim: float, now: float, floor: float) -> float:
        """The weight this aggregator uses for ``peer``'s ``claim`` (never above the claim)."""
        seen = self._peers.get(peer)
        if seen is None or not seen.weights:
            return claim
        intervals = [b - a for a, b in zip(seen.times, seen.times[1:], strict=False) if b > a]
        typical = lower_median(intervals)
        elapsed = now - seen.times[-1]
        stretch = max(1.0, elapsed / typical) if typical > 0 else 1.0
        allowed = max(floor, GROWTH * max(seen.weights) * stretch)
        return min(claim, allowed)

    def record(self, peer: str, weight: float, now: float) -> None:
        """Remember that ``peer``'s parts were averaged with ``weight`` at ``now``."""
        seen = self._peers.pop(peer, None) or _Seen()
        seen.times = [*seen.times[-(self.keep - 1) :], now]
        seen.weights = [*seen.weights[-(self.keep - 1) :], weight]
        self._peers[peer] = seen
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
