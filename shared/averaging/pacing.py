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
it waits and restarts when the push starts. The gate waits only for other pushes to complete, each bounded
by its own stall timeout, so a hung aggregator delays the others by at most one timeout before its
exchange fails and it leaves.
"""

from __future__ import annotations

from collections.abc import Mapping

import trio

__all__ = ["PushGate", "may_start"]


def may_start(parts: Mapping[int, int], done: Mapping[int, int], j: int, k: int) -> bool:
    """Whether part ``k`` of aggregator ``j``'s slice may be pushed now (the rule of the module docstring).

    ``parts``: the active aggregators and their part counts (``>= 1``); ``done``: acknowledged parts of each.
    """
    n_j = parts[j]
    return all((done[i] + 1) * n_j >= k * n_i for i, n_i in parts.items() if i != j)


class PushGate:
    """One round's pacing of our pushes (module docstring); one per member per round."""

    def __init__(self, parts: Mapping[int, int]) -> None:
        if any(n < 1 for n in parts.values()):
            raise ValueError(f"every aggregator in the gate needs at least one part, got {dict(parts)}")
        self.parts = dict(parts)
        self.done = dict.fromkeys(self.parts, 0)
        self._changed = trio.Event()

    def ready(self, j: int, k: int) -> bool:
        return j not in self.parts or may_start(self.parts, self.done, j, k)

    async def wait(self, j: int, k: int) -> None:
        """Return once part ``k`` to aggregator ``j`` may start."""
        while not self.ready(j, k):
            changed = self._changed
            await changed.wait()

    def completed(self, j: int) -> None:
        """A push to ``j`` was acknowledged."""
        if j in self.done:
            self.done[j] += 1
            self._notify()

    def leave(self, j: int) -> None:
        """Our exchange with ``j`` ended (all pushed, failed or refused): it holds nobody back."""
        if self.parts.pop(j, None) is not None:
            del self.done[j]
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
