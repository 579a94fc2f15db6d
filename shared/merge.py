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
:data:`CHAIN` apart belong to one collaboration, a larger gap starts another. So a collaboration is a
maximal chain of steps, and two collaborations never share a step. Its ``top`` is its highest step, its
*support* the number of distinct **users** among its members (``users`` of :mod:`shared.progress`: one
user's many peer ids count once, as issue 9 counts votes).

*Why a chain of* :data:`CHAIN` *(32) steps, not 1.* Within a chain, the top step leads and the members
below it are laggards that download the state -- exactly what an honest collaboration needs: a peer that
just stepped is one ahead; a peer that missed a round is one or two behind; a peer whose download gave up
waiting for the newest state loads the newest *announced* one, which peers and backbones publish every
``checkpoint_every`` steps, so it lands up to a few tens of steps behind and shows up, for a moment,
holding that older state. Were such honest laggards a collaboration of their own, several of them could
outnumber the peers that stepped on and be named the survivor -- the faster peers would then discard real
steps (seen under load: peers loading step 18 while one was at 20). Chains of 32 steps keep every honest
laggard inside its collaboration; groups that trained apart drift further apart than that within
seconds to minutes, and closer ones simply follow the higher step.

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
  picks the same survivor (property-tested with permutations and with every member as the reader). For
  the members to be the same for every reader, rule 2 of :mod:`shared.progress` judges the reader's own
  claim like anyone's.
* *An honest collaboration is never split.* In one honest collaboration every member's step lies within
  :data:`CHAIN` of the next member's (see above: one ahead after a step, laggards a round or a stale
  download behind); newcomers at step 0 and syncing peers are no members. So the members form one chain:
  one collaboration, nobody in the minority, nothing discarded (property-tested).
* *A lone user never beats two users.* Support counts users; a collaboration of one user has support 1,
  whatever its steps or peer ids, and loses to any collaboration of two users further than :data:`CHAIN`
  from it. Within :data:`CHAIN` it is in their chain: if it is behind, it is their laggard; if it is ahead
  by two or more, its claim has no other user within one step and is not credible (rule 2), so it is no
  member at all and is told to go back; only a claim one step ahead -- a peer that just stepped -- leads.
  Lone steps are prevented before they happen by :mod:`shared.alone`.
* *Partitions heal into one.* Once every peer reads the records of both groups, all of them name the same
  survivor; the minority flags ``syncing`` (so it stops being a member and cannot tip the count back),
  downloads the survivor's state and joins it: one collaboration. Between the two, the survivor changes
  only when a collaboration gains or loses users or the groups come within :data:`CHAIN` steps, not by
  a group stepping faster.

**What it does not decide.** Which *state* to download (:func:`shared.state.trust.usable_states`), and
whether a peer may step alone (:mod:`shared.alone`).

**Residual risks, stated.** (1) Honest laggards further than :data:`CHAIN` behind (a download that fell
back to a backbone checkpoint far older than the collaboration) that outnumber the peers ahead, none
flagged ``syncing``, would be named the survivor; the volunteer's wiring closes this: a peer stays flagged
``syncing`` after loading a state until a view taken after the load confirms it is not behind (a peer
flagged ``syncing`` is nobody's member). (2) Rule 2 of :mod:`shared.progress` counts a newcomer that has
not downloaded anything yet (step 0, no fingerprint, not syncing) as a user who does not vouch for a step
above 1 -- that is what keeps one admitted liar from moving a fresh run to step 10**9. So a collaboration
of a *single* user is not credible to two newcomers that appear in the same second before either flags
``syncing``; if they then trained from step 0 they would become a collaboration of two users and win.
Before issue 10 this was a permanent split; the wiring closes it: a newcomer downloads before it trains
whenever a credible backbone announces a state above its own (``resume_if_behind``), and stays flagged
``syncing`` as above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from protocols.training import Progress

__all__ = ["CHAIN", "Collaboration", "collaborations", "is_member", "survivor"]

#: Steps at most this far apart chain into one collaboration (see "Why a chain of 32 steps").
CHAIN = 32


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


def collaborations(
    steps: Mapping[str, int], user: Callable[[str], str], *, gap: int = CHAIN
) -> list[Collaboration]:
    """The collaborations of the members ``steps`` (peer id -> step), lowest first.

    Args:
        steps: each member's step (members only: see :func:`is_member`).
        user: the user a peer id speaks for.
        gap: steps at most this far apart chain (every reader must use the same).
    """
    by_step: dict[int, list[str]] = {}
    for peer, step in steps.items():
        by_step.setdefault(step, []).append(peer)
    found: list[Collaboration] = []
    chain: list[int] = []
    for step in sorted(by_step):
        if chain and step - chain[-1] > gap:
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
