"""Which collaboration survives when the progress records show more than one (pure; issue 10: no lone forks).

After a partition (a backbone restart that split the DHT, a volunteer that stepped alone) two groups of peers
may each have kept training: their records, once both are readable, show e.g. one group at step 250 and
another at step 568 with unrelated parameters. Every peer, and every backbone, evaluates the rule below on
the records it read; the losers re-sync to the survivor, even when that means loading a *lower* step.

**Members.** A record stands for a state a collaboration continues (:func:`is_member`) when it is
credible (rules 1 and 2 of :mod:`shared.progress`), its writer did not leave, is not downloading the
state (``syncing``: the step it holds is one it is replacing), and is *anchored*: it carries a parameter
fingerprint or a step above 0 (a newcomer at step 0 holds the initial parameters and continues nothing).
The reader itself is a member on the same terms.

**Collaborations** (:func:`collaborations`). Sort the members' distinct steps; consecutive steps at most
:data:`CHAIN` (1) apart belong to one collaboration, a gap of 2 or more starts another. So a
collaboration is a maximal chain of steps, and two collaborations never share a step. Its ``top`` is its
highest step, its *support* the number of distinct **users** among its members (``users`` of
:mod:`shared.progress`: one user's many peer ids count once, as issue 9 counts votes).

**The survivor** (:func:`survivor`) is the collaboration with the most support; among equal support the
one with the highest ``top`` (more steps: more samples trained, since every step is one target batch).
Two collaborations never share a step, so this key is a total order and needs no further tie-break.
Samples accumulated toward the next step are deliberately *not* part of the key: they change every
second, and two readers a second apart must not disagree.

Within the survivor, the ``top`` step leads (the collaboration's step of :func:`shared.progress.summarize`,
where the fingerprint majority at that step decides divergence as before); a member below ``top`` is a
laggard and downloads the state; a peer outside the survivor's steps holding a state the survivor does not
continue -- a member of another collaboration, or anyone *ahead* of the survivor -- is in the **minority**
and re-syncs to the survivor's step.

**Proof sketch.**

* *Determinism.* The clusters are a function of the multiset of (step, user) pairs of the members, and the
  survivor a maximum under a total order, so every reader holding the same records -- in any order --
  picks the same survivor (property-tested with permutations and with every member as the reader). The
  reader's own record is one of the records: a reader evaluates what it publishes.
* *An honest collaboration is never split.* In one honest collaboration every member is within one step
  of the collaboration's step ``S``: a member that stepped ``S -> S + 1`` did so in a round the others
  were in, and they apply the same step within seconds; a peer left out of a round sees ``S + 1`` and
  flags ``syncing`` (then it is no member). Newcomers at step 0 and syncing peers are no members. So the
  members' steps lie in ``{S - 1, S, S + 1}``, one chain: one collaboration, nobody in the minority,
  nothing discarded (property-tested).
* *A lone user never beats two users.* Support counts users; a collaboration of one user has support 1,
  whatever its steps or peer ids, and loses to any collaboration of two users that is not within one step
  of it (within one step they are one collaboration: the higher step leads, as it must for a peer that
  just stepped; lone steps are prevented before they happen by :mod:`shared.alone`).
* *Partitions heal into one.* Once every peer reads the records of both groups, all of them name the same
  survivor; the minority flags ``syncing`` (so it stops being a member and cannot tip the count back),
  downloads the survivor's state and joins it: one collaboration. Between the two, the survivor can only
  change when a collaboration gains or loses users, not by stepping faster.

**What it does not decide.** Which *state* to download (``shared.state.trust`` ranks announcements by
users), and whether a peer may step alone (:mod:`shared.alone`).

**Residual risks, stated.** (1) A group of laggards of more users than the group that stepped on, all at least
two steps behind it and none flagged ``syncing``, would win and make the faster group re-sync down a few
steps. Laggards flag ``syncing`` within one poll period of seeing a higher step in their chain, while the
faster group needs a full round (target batch plus a matchmaking window) per step, so this takes peers
stalled for a whole round; it ends in one collaboration either way, with the discarded steps in the ledger.
(2) Rule 2 of :mod:`shared.progress` counts a newcomer that has not downloaded anything yet (step 0, no
fingerprint, not syncing) as a user who does not vouch for a step above 1 -- that is what keeps one admitted
liar from moving a fresh run to step 10**9. So a collaboration of a *single* user is not credible to two
newcomers that appear in the same second before either flags ``syncing``; if they then train from step 0
they become a collaboration of two users and win. Before issue 10 this was a permanent split; the
volunteer's wiring closes it: a newcomer downloads before it trains whenever a credible backbone announces
a state above its own (``resume_if_behind``), and stays flagged ``syncing`` until a view taken after the
download confirms it is in the survivor -- a peer flagged ``syncing`` vouches for nothing and is nobody's
rival, so the single user's claim is credible again.
(3) Two collaborations that meet within one step of each other are one chain: the higher step leads, whoever
is behind it. Partitions that trained apart are rarely that close, and lone steps are gated by
:mod:`shared.alone`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from protocols.training import Progress

__all__ = ["CHAIN", "Collaboration", "collaborations", "is_member", "survivor"]

#: Steps at most this far apart chain into one collaboration (a laggard, a peer that just stepped).
CHAIN = 1


@dataclass(frozen=True)
class Collaboration:
    """A maximal chain of member steps (see the module docstring)."""

    low: int  # lowest member step
    top: int  # highest member step: where the collaboration is
    peers: frozenset[str]
    users: frozenset[str]

    @property
    def support(self) -> int:
        """Distinct users among the members."""
        return len(self.users)

    def spans(self, step: int) -> bool:
        """``step`` lies within the collaboration's steps (a member there continues it)."""
        return self.low <= step <= self.top


def is_member(progress: Progress) -> bool:
    """The record stands for a state a collaboration continues (credibility is the caller's check)."""
    return not progress.left and not progress.syncing and (bool(progress.params) or progress.step > 0)


def collaborations(steps: Mapping[str, int], user: Callable[[str], str]) -> list[Collaboration]:
    """The collaborations of the members ``steps`` (peer id -> step), lowest first.

    Args:
        steps: each member's step (members only: see :func:`is_member`).
        user: the user a peer id speaks for.
    """
    by_step: dict[int, list[str]] = {}
    for peer, step in steps.items():
        by_step.setdefault(step, []).append(peer)
    found: list[Collaboration] = []
    chain: list[int] = []
    for step in sorted(by_step):
        if chain and step - chain[-1] > CHAIN:
            found.append(_collaboration(chain, by_step, user))
            chain = []
        chain.append(step)
    if chain:
        found.append(_collaboration(chain, by_step, user))
    return found


def survivor(found: Sequence[Collaboration]) -> Collaboration | None:
    """The collaboration that survives: most users, then highest step (``None`` when there is none)."""
    return max(found, key=lambda c: (c.support, c.top), default=None)


def _collaboration(
    chain: list[int], by_step: Mapping[int, list[str]], user: Callable[[str], str]
) -> Collaboration:
    peers = frozenset(peer for step in chain for peer in by_step[step])
    return Collaboration(chain[0], chain[-1], peers, frozenset(user(peer) for peer in peers))
