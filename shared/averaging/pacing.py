"""The order a member's pushes leave in: every aggregator's slice advances at the same pace (issue 13).

**Why.** In a round a member pushes its copy of every aggregator's slice concurrently, one connection per
aggregator (:mod:`.allreduce`). An aggregator reduces its part ``k`` only once *every* sender delivered part
``k``, and members pull averaged parts as they are reduced. The LP of :mod:`.load_balance` assumes a fluid
schedule: each member's upload is shared among the aggregators in proportion to their slices, so all
aggregators receive part ``k`` from everyone at about the same time and averaged parts stream back while
later parts still go out. TCP does not share a link that way: the flows of one member through its upload
(the bottleneck of a home link) progress unevenly, one by seconds ahead of another (traced on emulated
20 Mbit/s links: a member's part 0 reached one aggregator after 0.26 s and another after 1.8 s). Part
``k`` of each aggregator then waits for whichever member's flow to it was slowest, the averages come back
late, and the downloads that the LP scheduled alongside the uploads run after them instead
(``scripts/bench_strategies.py --trace``).

**The rule.** A member keeps its pushes in step: with ``n_j`` parts in aggregator ``j``'s slice and
``d_j`` of them acknowledged, the push of part ``k`` to ``j`` may start only when every other aggregator
``i`` still being pushed to is at most one part behind in proportion::

    (d_i + 1) / n_i  >=  k / n_j        for every active i != j      (in integers: (d_i + 1) n_j >= k n_i)

So with equal part counts a member never sends part ``k + 1`` anywhere before part ``k`` reached every
aggregator, while up to one push per aggregator is in flight (no link idles for want of a concurrent
flow); with unequal slices each aggregator's bytes come at a rate proportional to its slice, the LP's
``x_j``. Properties (``tests/shared/averaging/test_pacing.py``):

* *no deadlock*: the aggregator with the least progress ``(d_i / n_i)`` can always start its next part
  (for it, ``k = d_i`` and every other ``(d_m + 1) / n_m > d_m / n_m >= d_i / n_i``);
* *bounded spread*: two active aggregators' progress differs by at most one part of each;
* an aggregator whose exchange ended (done, failed, departed, refused) leaves the gate at once and holds
  nobody back.

A push that waits at the gate is not stalled: its aggregator's push clock (:mod:`.deadlines`) stops while
it waits and restarts when the push starts.

**A laggard holds nobody back for long.** An aggregator whose pushes made no progress for ``hold``
seconds (no push acknowledged since the last one, the gate's start, or since its own wait at the gate
ended) no longer counts in the rule until it acknowledges again: the others go on at their own pace. The
member passes ``hold = T / 2``, half its stall timeout ``T`` (:mod:`.deadlines`). Why not ``T``, the
moment the laggard's exchange fails and it leaves the gate anyway: each healthy aggregator drops a sender
whose parts stop for *its* ``T`` (rule 1 of :mod:`.deadlines`), counted from the sender's last part it
received, which left at about the time of the laggard's unacknowledged push. Holding for ``T`` made those
two timeouts race: a live member held behind a hung aggregator was dropped from healthy slices whenever
its next part took longer to arrive than the milliseconds between its round's start and its previous
part (seen under CPU load: a healthy slice averaged over three of four members in some parts). With
``T / 2`` the held part has ``T / 2`` (at least the 1.5-s half floor) to arrive; and a live aggregator
acknowledges within a part time or two, at most ``T / FACTOR`` each, so ``T / 2`` (two of them at least)
never unpaces a merely slow flow for long: pacing is for throughput, the stall timeouts for correctness.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import trio

__all__ = ["PushGate", "may_start"]


def may_start(parts: Mapping[int, int], done: Mapping[int, int], j: int, k: int) -> bool:
    """Whether part ``k`` of aggregator ``j``'s slice may be pushed now (the rule of the module docstring).

    ``parts``: the active aggregators and their part counts (``>= 1``); ``done``: acknowledged parts of each.
    """
    n_j = parts[j]
    return all((done[i] + 1) * n_j >= k * n_i for i, n_i in parts.items() if i != j)


class PushGate:
    """One round's pacing of our pushes (module docstring); one per member per round.

    ``hold()``: the seconds an aggregator whose pushes make no progress may hold the others back
    (module docstring, "A laggard"; read whenever the gate decides, so it may grow with the stall timeout).
    """

    def __init__(self, parts: Mapping[int, int], hold: Callable[[], float] = lambda: math.inf) -> None:
        if any(n < 1 for n in parts.values()):
            raise ValueError(f"every aggregator in the gate needs at least one part, got {dict(parts)}")
        self.parts = dict(parts)
        self.done = dict.fromkeys(self.parts, 0)
        self.hold = hold
        now = trio.current_time() if self.parts else 0.0
        self._progress = dict.fromkeys(self.parts, now)  # when each one's pushes last progressed
        self._waiting: set[int] = set()  # aggregators whose next push waits at the gate: not laggards
        self._changed = trio.Event()

    def lagging(self, i: int) -> bool:
        """Whether ``i``'s pushes made no progress for ``hold()`` seconds while it waited for nobody."""
        if i not in self.parts or i in self._waiting:
            return False
        return trio.current_time() - self._progress[i] >= self.hold()

    def ready(self, j: int, k: int) -> bool:
        if j not in self.parts:
            return True
        pacing = {i: n for i, n in self.parts.items() if i == j or not self.lagging(i)}
        return may_start(pacing, self.done, j, k)

    async def wait(self, j: int, k: int) -> None:
        """Return once part ``k`` to aggregator ``j`` may start."""
        self._waiting.add(j)
        try:
            while not self.ready(j, k):
                changed = self._changed
                # wake when the next aggregator still in step would become a laggard
                with trio.move_on_at(self._next_lag()):
                    await changed.wait()
        finally:
            self._waiting.discard(j)
            if j in self._progress:  # its push starts now: its own clock restarts
                self._progress[j] = trio.current_time()

    def _next_lag(self) -> float:
        hold, now = self.hold(), trio.current_time()
        due = [at + hold for i, at in self._progress.items() if i not in self._waiting]
        return min((t for t in due if t > now), default=math.inf)  # the laggards already count for none

    def completed(self, j: int) -> None:
        """A push to ``j`` was acknowledged."""
        if j in self.done:
            self.done[j] += 1
            self._progress[j] = trio.current_time()
            self._notify()

    def leave(self, j: int) -> None:
        """Our exchange with ``j`` ended (all pushed, failed or refused): it holds nobody back."""
        if self.parts.pop(j, None) is not None:
            del self.done[j]
            del self._progress[j]
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
