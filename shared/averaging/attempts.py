"""Which matchmaking key a step's next averaging attempt uses: keys are spent, never reused.

A step's round may take several attempts (a member died, a plan was refused, a slice failed); each
attempt matchmakes under its own group key ``a<n>`` of the step (:mod:`.matchmaking`). The rule:

1. the keys of a step are ``a0, a1, a2, ...``, without end: no key is used again after it is spent;
2. a key is **spent** once a plausible plan is stored under it
   (:meth:`~.matchmaking.Matchmaker.spent`: the leader of its members wrote it, and they have tickets
   under the key), or once *we* failed an attempt under it;
3. every member keeps an index per step, which only grows (0 at a new step); an attempt goes to the
   lowest key at or above the index that holds no plausible plan (:meth:`AttemptKeys.next`), and
   afterwards the index moves past that key, unless the attempt found nobody else's live ticket there
   (``alone``): then the member comes back to the same key, where the others will look for it.

**Why** (the livelock seen in ``test_nat_training`` under heavy CPU load, round 26 for 240 s). Members
used to cycle through ``a0 .. a<max_attempts - 1>`` and start again at ``a0`` on the next call: the keys
were reused, and members whose cycles were out of phase never met again. A member (alice) that found
nobody under a key left its ticket there, alive for minutes; the others came to that key later, read
the ticket, and made a plan naming her, then waited for her push in vain (3 s) and moved on. She, coming
to that key after their plan, found their tickets consumed by it (the stale-ticket rule of
:mod:`.matchmaking`, which must stay: it keeps an earlier round's tickets from being counted twice) and
was alone again; and her short attempts (one window) kept her ahead of their long ones (window + the
push deadline), so every key they came to held a ticket of hers that nobody would ever answer.

Under rule 1-3 the members meet again:

* a plan under a key ends that key for everyone, whatever became of the round: the members of a failed
  round, and a member that comes to the key after its plan, all go to the next unspent key, the same one
  for all of them (they skip the same plans);
* a member alone at a key stays there (its ticket is live while it waits), so a member that is ahead
  waits for the others at the lowest key nobody has spent, instead of scattering tickets over keys the
  others will reach after it has left them;
* a member that failed under a key without a plan there (the leader vanished, no acceptable plan in
  time) moves on by itself; the ticket it leaves makes any member that comes to the key later fail there
  too and move on, so nobody stays behind, alone, at a key the others have passed.

Each member thus follows a sequence of keys that only grows, and two live members part only at a key
where one of them made or saw a plan: the next unspent key is common to both. What is left: a member
between two attempts (taking its gradient back, reading progress) leaves a ticket that looks live; a
group that reads it in that gap plans with it and loses one attempt (the key is then spent, and all
meet at the next one), never a fork and never for ever. A stranger that writes plausible plans ahead
only makes the members skip keys (each plan needs a second member's signed ticket, and the DHT's quotas
bound what one user writes); :data:`MAX_SKIP` bounds the reads one attempt spends on skipping.

**Cost.** One more read of ``<key>.plan`` per attempt (and one per key skipped). Each attempt under a
new key stores a new ticket record (alive ~10 minutes) where a cycle of three keys overwrote its own:
a step stuck for those 10 minutes, one attempt every few seconds, holds some hundred records per
member, far below the DHT's per-user quota (:class:`shared.dht.storage.StoreLimits`, 4096); an attempt
alone under a key overwrites its own ticket there.

No clock is shared (hivemind derives its keys from wall-clock windows): volunteers' clocks and their
attempts' lengths differ by seconds under load, and the plans themselves are what all members read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["MAX_SKIP", "AttemptKeys", "attempt_key", "next_index"]

#: The most spent keys one attempt skips; the next attempt goes on from there.
MAX_SKIP = 64


def attempt_key(index: int) -> str:
    """The group key of a step's attempt ``index`` (under ``<prefix>.<step>.``)."""
    return f"a{index}"


async def next_index(start: int, spent: Callable[[str], Awaitable[bool]], max_skip: int = MAX_SKIP) -> int:
    """The lowest index at or above ``start`` whose key is not ``spent``, looking at most ``max_skip``
    keys past ``start`` (rule 3 of the module docstring)."""
    index = start
    while index < start + max_skip and await spent(attempt_key(index)):
        index += 1
    return index


@dataclass
class AttemptKeys:
    """One member's attempt index for the step it averages (module docstring)."""

    step: int | None = None
    index: int = 0

    async def next(self, step: int, spent: Callable[[str], Awaitable[bool]]) -> int:
        """The index of ``step``'s next attempt (its key: :func:`attempt_key`)."""
        if step != self.step:
            self.step, self.index = step, 0
        self.index = await next_index(self.index, spent)
        return self.index

    def done(self, step: int, index: int, *, alone: bool) -> None:
        """The attempt under ``index`` of ``step`` ended without a step: move past it, unless we were
        alone there (we come back to it)."""
        if step == self.step:
            self.index = max(self.index, index if alone else index + 1)
