"""Which matchmaking key a step's next averaging attempt uses: a member's keys only move forward.

A step's round may take several attempts (a member died, a plan was refused, a slice failed); each
attempt matchmakes under its own group key ``a<n>`` of the step (:mod:`.matchmaking`). The rule, the same
for computing members (:class:`volunteer.collab.step.BatchStep`) and auxiliary aggregators
(:class:`.auxiliary.AuxiliaryAggregator`):

1. the keys of a step are ``a0, a1, a2, ...``, without end; every member starts a step at ``a0`` and
   keeps one index per step, across its calls (a key is never revisited after the member left it);
2. after an attempt under ``a<n>`` the member **stays** at ``a<n>`` if, and only if, its read of the key
   (one window after its ticket, and while it lingered: :class:`.matchmaking.MatchmakingConfig`
   ``linger``) showed fewer than two computing (non-``aux``) ticket records, its own included, consumed
   by an earlier plan or not (:attr:`.matchmaking.Matchmaker.alone`); otherwise it **moves on** to
   ``a<n+1>``, whatever came of the attempt (a plan that failed, a plan without it, a group formed without
   it, tickets an earlier plan had consumed, no plan in time, an error): another computing member has
   been at that key. An auxiliary aggregator's ticket does not count (it waits at the key for computing
   members, and a computing member alone with it has nobody to average with), and the aggregator follows
   the same rule: it stays while it read at most one computing ticket;
3. no key is skipped: a member visits its step's keys one by one, leaving a ticket under each (alive
   for minutes, :meth:`.matchmaking.Matchmaker.assemble`);
4. **restart**: a member that stayed alone at one key for :data:`RESTART_AFTER` seconds (its attempts
   there all read no other computing ticket) starts the step's keys again at ``a0`` and walks them by
   rule 2, as a newcomer would.

*Why rule 4.* Rules 1-3 let a member behind catch up only while the tickets of the members ahead are alive
at the keys they passed (about ten minutes). A member waiting alone at ``a<n>`` longer than that (the
others left mid-step) leaves ``a0 .. a<n-1>`` empty behind it: a member that joins the step then finds
nobody at ``a0``, stays there (rule 2), and the two wait for ever at two keys. With rule 4 a member waits
alone at most ``RESTART_AFTER`` (well below a ticket's life) before walking from ``a0`` again, renewing a
ticket at every key up to where it stops, so the tickets below a waiting member are always alive: a
newcomer walks to it, or it comes back to the newcomer waiting at ``a0``. A restart forms no group by
itself (the matchmaking rules are unchanged), and a member that restarts while another walks towards its
old key meets it further on: that one moves past the old key (our ticket is still there) and waits at the
next, which our walk reaches. A restart costs an alone member nothing (it had nobody to average with),
and a member that passes others' stale tickets on its walk spends one attempt at each.

There is no second judgement beside rule 2: whether a ticket was *consumed* by an earlier plan
(:mod:`.matchmaking`, "Stale tickets and group ids") decides who is in a group, never which key is next.
The first fix of the livelock below also skipped keys holding a *plausible* plan (all its members'
tickets live); after the churn soak's backbone restart a plan was implausible (the backbone's ticket was
gone: aux tickets live seconds, and a restarted backbone loses what it stored), so its key was "not spent"
for one member, while its tickets still counted as consumed: that member was "alone" there and came back
for ever, while the others waited at the next key. Under rule 2 the consumed tickets are tickets of other
peers: that member moves on.

**Why members meet.** Every computing member that moved past ``a<n>`` attempted there and left a live ticket,
so a member that comes to ``a<n>`` later finds it and moves on too (rule 2); a member stays only at a key no
other computing member has reached yet. So the members behind walk forward, one attempt per key, to the key
where the foremost member waits, and meet it there: every live member's sequence of keys ends at the lowest
key that nobody else has visited. Keys used to be ``a0 .. a<max_attempts - 1>`` again on every call of
``average_and_step``; members whose cycles were out of phase then never met (the livelock seen in
``test_nat_training`` under heavy CPU load, round 26 for 240 s): a member (alice) whose short attempts found
nobody left tickets under keys the others came to after she had left; they planned with those tickets and
waited 3 s for her push in vain, while she, coming back to each key after their plan, found their tickets
consumed by it and was "alone" again. Now a key she left is one she never comes back to, and the key she waits
at is the one the others come to next.

**Lingering** (:class:`.matchmaking.MatchmakingConfig` ``linger``). A member alone at a key (no other
computing ticket) does not store a new ticket every window: it waits there with the same ticket record for
``linger`` seconds, polling the key, and forms the group one window after another peer's ticket appears. A new
record every window would leave a gap between two records in which the others read the old one and plan with
it; the plan would name a ticket the member already replaced, which it must not adopt (:mod:`.matchmaking`,
"Stale plans"), so the group would fail, move on, and meet the member alone at the next key, where the same
gap could recur on a member starved of CPU. With lingering the gap opens once per ``linger`` seconds, not once
per window.

**Strangers** (D10). What a stranger can write under a key is tickets and plans under its own subkeys. A plan
moves nobody to another key by itself (rule 2 looks at tickets) and consumes only tickets it lists at their
writers' positions: written ahead of the honest tickets, it can list none of them (a ticket's digest is its
record's signature, unknown before the record exists), so the honest peers meet and plan under that key as if
it were not there (followers refuse it: it leaves them out). A stranger's computing *ticket* under a key
counts for rule 2 like anybody's: an honest member that finds one there is not alone, attempts a group with
it, and moves on; the other honest members walk the same keys and find the same tickets, so they still meet.
With two identities a stranger can write a whole "group" (two tickets and the plan of the one that
``leader_of`` ranks first) under a key ahead of everybody: rule 1 of :mod:`.matchmaking` then says the group
formed without us, and every honest member passes that key alike (two DHT reads each, no ticket stored). So at
worst a stranger makes the rounds that include it fail, which it could always do by joining them, and makes
honest members pass the keys it filled, all of them the same keys, at the cost of three records per key
against its per-writer DHT quota (:class:`shared.dht.storage.StoreLimits`). It cannot make honest members wait
at different keys, nor keep them from a key it has not filled. (With keys reused by a cycle, two identities
filling ``a0 .. a2`` of coming steps kept every honest member out of every round.)

**Cost.** Each attempt under a new key stores a new ticket record (alive ~10 minutes) where a cycle of
three keys overwrote its own: a step stuck for those 10 minutes, one attempt every few seconds, holds some
hundred records per member, far below the per-writer quota. A member behind spends one attempt (about a
window, or a plan's wait when it forms a group with another member's ticket left there) per key it
catches up on. No clock is shared (hivemind derives its keys from wall-clock windows): volunteers' clocks
and their attempts' lengths differ by seconds under load; the tickets themselves are what all members read.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RESTART_AFTER", "AttemptKeys", "attempt_key"]

#: Seconds a member stays alone at one key before walking the step's keys again from ``a0`` (rule 4):
#: far below a ticket's life (about ten minutes), far above a window or a plan's wait.
RESTART_AFTER = 120.0


def attempt_key(index: int) -> str:
    """The group key of a step's attempt ``index`` (under ``<prefix>.<step>.``)."""
    if index < 0:
        raise ValueError(f"attempt index must be at least 0, got {index}")
    return f"a{index}"


@dataclass
class AttemptKeys:
    """One member's attempt index for the step it averages (module docstring, rules 1, 2 and 4)."""

    step: int | None = None
    index: int = 0
    restart_after: float = RESTART_AFTER
    #: (index, since when) of the key we have been alone at, across attempts (rule 4)
    alone_at: tuple[int, float] | None = None
    restarts: int = 0

    def next(self, step: int) -> int:
        """The index of ``step``'s next attempt (its key: :func:`attempt_key`); 0 at a new step."""
        if step != self.step:
            self.step, self.index, self.alone_at = step, 0, None
        return self.index

    def done(self, step: int, index: int, *, alone: bool, now: float) -> None:
        """The attempt under ``index`` of ``step`` ended without a step at time ``now`` (any monotonic
        clock): move past it, unless its read showed no other peer's ticket (rule 2); back to ``a0`` after
        ``restart_after`` seconds alone at one key (rule 4). An attempt of another step changes nothing."""
        if step != self.step:
            return
        if not alone:
            self.alone_at = None
            self.index = max(self.index, index + 1)
            return
        if self.alone_at is None or self.alone_at[0] != index:
            self.alone_at = (index, now)
        elif now - self.alone_at[1] >= self.restart_after:
            self.index, self.alone_at = 0, None
            self.restarts += 1
            return
        self.index = max(self.index, index)
