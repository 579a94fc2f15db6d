"""Which announced training state to believe: majorities of admitted *users* (DESIGN D4, D10; issue 9,
finding 8).

Peers announce the state they can serve under :data:`~protocols.training.CHECKPOINT_KEY`, one record per
writer (peer id). A person may run many machines, and an admitted user may make up more peer ids than
they run machines, so a count of writers measures nothing. **Support counts users**:

* every writer is mapped to the admitted user behind it (the username in the access token the DHT
  checked when it stored the record; a writer whose user is unknown -- an open run, which admits
  nobody, or a node that does not report usernames -- stands for itself);
* announcements are grouped by ``(step, digest, nbytes)``; a group's *support* is the number of distinct
  users among its writers. One user with ``k`` identities adds 1 to every group it announces, never ``k``;
  so a state two other users agree on always ranks before anything that user announces alone at that step
  (property-tested).

**Order.** Newest step first (a peer behind the collaboration needs the newest state; whether a step is
*credible* is the caller's question: the volunteer bounds it by the collaboration's credible progress).
Within a step: most support first; then, on a tie, a group announced by a *credible* backbone (an
announcement flagged ``backbone`` whose writer is the user :data:`BACKBONE_USER`, or -- with no user known --
stands for itself, as in an open run where nothing is credible anyway); then by digest and size, so the
order never depends on the mapping's order.

**The lone peer.** A state only one user announces (support 1) is still a candidate: a run with one
volunteer, or the first peer at a new step, has nobody to agree with. It is never preferred over a state
of the same step that more users announce, and callers decide whether to take a lone claim at all (the
volunteer refuses a state beyond the collaboration's credible step while others train).

**Which of them a peer that re-syncs may load** (:func:`usable_states`, the filter of the volunteer's
state sync). ``target`` is the collaboration's step (:attr:`shared.progress.CollabView.step`: the
*surviving* collaboration's, :mod:`shared.merge`, which may be *below* the step of a peer in the minority).
While others train, a state is usable only at exactly ``target`` and only if a member of the surviving
collaboration is among its announcers -- a state announced only by peers outside it (a losing fork's,
even one that passed through ``target`` on its way) is never loaded; past the caller's patience, any state
up to ``target`` that a survivor member or a credible backbone announces (backbones store only the
survivor's states). With nobody else training (``alone``), the newest state at or above ``target``, and
past patience any: that is how a run resumes from a backbone checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from protocols.training import StateAnnouncement

__all__ = ["BACKBONE_USER", "Announced", "support_of", "trusted_state", "usable_states"]

#: The username the authority issues to its backbones (backbone/service.py); reserved for them.
BACKBONE_USER = "backbone"


@dataclass(frozen=True)
class Announced:
    """One writer's current announcement and the admitted user behind the writer (the writer's own peer id
    when no user is known)."""

    announcement: StateAnnouncement
    user: str


def trusted_state(
    announced: Mapping[str, Announced], *, min_step: int = 0
) -> list[tuple[StateAnnouncement, list[str]]]:
    """Rank the announced states, most trustworthy first (see the module docstring), with their writers.

    Args:
        announced: each writer's (peer id's) current announcement and user.
        min_step: the oldest step of interest; older announcements are left out.

    Returns:
        ``(announcement, writers)`` per group: the announcement carries the newest ``time`` of the group
        and ``backbone=True`` if a credible backbone is among its writers; ``writers`` (where to download
        from) lists credible backbones first, then the most recent announcers.
    """
    groups: dict[tuple[int, bytes, int], list[tuple[str, Announced]]] = {}
    for writer, entry in announced.items():
        a = entry.announcement
        if a.step >= min_step:
            groups.setdefault((a.step, a.digest, a.nbytes), []).append((writer, entry))
    ranked: list[tuple[int, StateAnnouncement, list[str]]] = []
    for (step, digest, nbytes), members in groups.items():
        members.sort(key=lambda m: (not _credible_backbone(*m), -m[1].announcement.time, m[0]))
        summary = StateAnnouncement(
            step=step,
            digest=digest,
            nbytes=nbytes,
            time=max(e.announcement.time for _, e in members),
            backbone=any(_credible_backbone(w, e) for w, e in members),
        )
        support = len({e.user for _, e in members})
        ranked.append((support, summary, [writer for writer, _ in members]))
    ranked.sort(key=lambda r: (-r[1].step, -r[0], not r[1].backbone, r[1].digest, r[1].nbytes))
    return [(summary, writers) for _, summary, writers in ranked]


def support_of(announced: Mapping[str, Announced], writers: list[str]) -> int:
    """How many distinct users stand behind ``writers`` (a group :func:`trusted_state` returned)."""
    return len({announced[w].user for w in writers if w in announced})


def usable_states(
    ranked: Sequence[tuple[StateAnnouncement, list[str]]],
    *,
    target: int,
    alone: bool,
    patient: bool,
    survivor: Set[str] | None = None,
) -> list[tuple[StateAnnouncement, list[str]]]:
    """The states of ``ranked`` (:func:`trusted_state`'s order, kept) a re-syncing peer may load (see the
    module docstring).

    Args:
        target: the collaboration's step (the survivor's; may be below our own).
        alone: nobody else trains (no credible peer but us).
        patient: still within the caller's patience for a state at ``target``.
        survivor: the peer ids of the surviving collaboration (:attr:`shared.progress.CollabView.survivor`),
            if known; without it, announcers are not checked (the filter of before issue 10).
    """
    usable = []
    for announcement, writers in ranked:
        step = announcement.step
        if alone:
            ok = step >= target or not patient
        else:
            ok = step == target if patient else step <= target
            if ok and survivor is not None and not any(w in survivor for w in writers):
                ok = not patient and announcement.backbone
        if ok:
            usable.append((announcement, writers))
    return usable


def _credible_backbone(writer: str, entry: Announced) -> bool:
    return entry.announcement.backbone and entry.user in (BACKBONE_USER, writer)
