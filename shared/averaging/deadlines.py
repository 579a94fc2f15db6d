"""How long a round waits for a member that makes no progress, pure (issue 10 item 3; seed 000 §3.2).

A member that dies mid-round is noticed from its connections (:mod:`.allreduce`, "Departures"): a killed
process's TCP connections are reset or closed by its kernel at once, and a dial to it is refused. This
module bounds the other case, a member that stops making progress *without* closing anything (a stopped or
hung process, a member whose round never started), so that the round does not wait for its whole
deadline.

**The rule.** In one round, a member uses the *stall timeout*

    ``T = max(FLOOR, min(ceiling, FACTOR * max(e, m)))``

where

* ``e`` is the plan's **expected time per part** (:func:`expected_part_seconds`): the LP's predicted
  averaging time, which it computed from the members' declared bandwidths, scaled to one part
  (``predicted * part_numel / largest slice``: the largest slice streams its parts one after another for
  the whole predicted time);
* ``m`` is the **measured time per part** in this round (:class:`PartTimes`): the upper median of the gaps
  between successive parts completing, over every exchange this member saw (parts it received as an
  aggregator, parts it pushed and pulled as a member);
* ``FACTOR`` (4) is the headroom a live member's part time gets over the typical one (jitter, a slower
  link: the LP already gave slower links smaller shares), ``FLOOR`` (3 s) covers what no part time
  measures: members start the round when they read the plan, up to a few DHT polls apart, and the first
  part waits for that; ``ceiling`` is the round's deadline (non-finite: :data:`MAX_TIMEOUT`).

Then:

1. *aggregator side*: a sender of our slice that completes no part for ``T`` (counted from our round's
   start, then from its previous part) is dropped from the parts not yet reduced, as if its connection
   had broken ("stalled"); the average renormalizes over the others;
2. *member side*: an aggregator fails for this round (its slice keeps our values, and the round is
   retried without it) when it acknowledges no push of ours for ``T`` while we have parts to send
   (counted from our round's start, then from our previous acknowledged push), or answers no pull for
   ``2 T`` (counted likewise from our previous completed pull).

**Why T for pushes.** A live aggregator acknowledges a part once it has read it (and reduced that part,
if it was the last one missing): it waits for nobody else, so the acknowledgement takes at most a part
time or two after the part went out, well within ``T >= FACTOR * e``; for the first part, the floor
covers the aggregator starting the round a little later than we did (it waits for its plan).

**Why 2 T for pulls.** A live aggregator ``j`` reduces part ``k`` once every sender delivered it
or was dropped. Let ``p`` be when we pulled part ``k - 1`` from ``j``: by then every sender still in the
round had delivered part ``k - 1`` to ``j``, so by rule 1 each delivers part ``k`` or is dropped by
``p + T_j``; ``j`` reduces and serves the part within one part time more, which is at most ``T / FACTOR``.
Our pull therefore completes by ``p + T_j + T / 4``, within ``2 T`` whenever ``T_j <= 1.75 T``: both
timeouts start from the same plan's ``e`` and the same floor, and measured part times of one round differ
between members by much less than that factor. For part 0, ``p`` is our round's start and the members'
starts differ by the plan's propagation, which the floor covers. So a member that waits on a live
aggregator stuck behind a hung sender does not fail it; the aggregator drops the sender and the round
completes without it. A false positive is never worse than a slow round: the slice fails and the round is
retried.

**Bounds** (:func:`stall_timeout`, property-tested): ``FLOOR <= T <= max(FLOOR, min(ceiling,
MAX_TIMEOUT))``, monotone in ``e``, in every measurement and in ``ceiling``; zero, negative, NaN and
infinite inputs (a plan or measurements from strangers) never make it smaller than the floor nor larger
than the ceiling. A liar can thus at most make a round wait its own deadline, as before this rule, or
make honest members give up on it after the floor.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "FACTOR",
    "FLOOR",
    "MAX_TIMEOUT",
    "PartTimes",
    "expected_part_seconds",
    "stall_timeout",
    "upper_median",
]

FACTOR = 4.0
FLOOR = 3.0
#: No stall timeout exceeds this (seconds), whatever the plan says.
MAX_TIMEOUT = 3600.0
#: Measurements a round keeps (the newest).
KEEP = 64


def _finite_nonnegative(value: float) -> float | None:
    return value if math.isfinite(value) and value >= 0 else None


def upper_median(values: Iterable[float]) -> float:
    """Element ``n // 2`` of the sorted finite, non-negative values; 0 for none."""
    ordered = sorted(v for v in values if _finite_nonnegative(v) is not None)
    return ordered[len(ordered) // 2] if ordered else 0.0


def stall_timeout(expected: float, measured: Sequence[float], ceiling: float = MAX_TIMEOUT) -> float:
    """The stall timeout ``T`` of the module docstring.

    Args:
        expected: the plan's expected seconds per part (NaN or negative: unknown, 0; infinite: as large
            as the ceiling allows).
        measured: seconds per part measured in this round (non-finite and negative ones are ignored).
        ceiling: the round's deadline (non-finite or non-positive: :data:`MAX_TIMEOUT`).
    """
    if math.isnan(expected) or expected < 0:
        expected = 0.0
    cap = ceiling if math.isfinite(ceiling) and ceiling > 0 else MAX_TIMEOUT
    cap = min(cap, MAX_TIMEOUT)
    typical = max(expected, upper_median(measured))
    return max(FLOOR, min(cap, FACTOR * typical))


def expected_part_seconds(predicted_seconds: float, part_numel: int, slice_sizes: Sequence[int]) -> float:
    """The plan's expected seconds per part: ``predicted * part_numel / largest slice`` (0 if unknown)."""
    largest = max(slice_sizes, default=0)
    if math.isnan(predicted_seconds) or predicted_seconds <= 0 or largest <= 0 or part_numel <= 0:
        return 0.0
    return predicted_seconds * min(1.0, part_numel / largest)  # inf stays inf: the ceiling bounds it


@dataclass
class PartTimes:
    """The per-part times one member measures in one round (times are any monotonic clock's seconds)."""

    expected: float = 0.0
    ceiling: float = MAX_TIMEOUT
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP))

    def observe(self, since: float, now: float) -> None:
        """A part completed at ``now``; the exchange it belongs to last progressed at ``since``."""
        gap = now - since
        if math.isfinite(gap) and gap >= 0:
            self.gaps.append(gap)

    def timeout(self) -> float:
        return stall_timeout(self.expected, self.gaps, self.ceiling)
