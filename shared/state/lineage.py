"""A training state's lineage: the parameter fingerprints of its last steps, carried inside the state (pure).

**Why.** Step numbers alone cannot tell a peer whether its own last steps were the collaboration's. A
round can complete for some of its members and fail for others (an aggregator that dies after sending
its averaged slice to some members only); the members that failed retry, possibly with a restarted peer
at the same step, and take *the same step number* with different parameters. When such a peer later
downloads the survivor's state one step ahead, it looks like an honest laggard, and it would keep the
credit of a step that did not survive (issue 10: only real steps are credited). The downloaded state's
lineage says which parameters the collaboration had at each of its last steps; the peer compares them
with its own.

**What.** Every peer keeps, beside its state, ``{step: fingerprint}`` of its last :data:`LINEAGE_STEPS`
states (the fingerprint is the trainer's 8-byte hash of the parameters *and* the step, identical on
every peer of a round because their parameters are bit-identical). A step taken appends its new
fingerprint; a state loaded brings the lineage it carries, plus its own fingerprint. The state blob's
metadata holds it under ``"lineage"`` as ``"step:hex,step:hex,…"`` in ascending steps.

**The rule** (:func:`replaced_steps`). Let ``ours`` be our lineage before a load and ``theirs`` the
loaded state's, at step ``L``, and ``s`` our step before the load. Our steps that did not survive are
``d..s``, where ``d`` is the first step both lineages know at which the fingerprints differ, or, if they
agree wherever both know a step, ``L + 1`` (our steps beyond the loaded state: a fork ahead of it);
nothing when ``d > s``. If they differ already at the first step both know and ours reaches further back
(the loaded state is ahead, its window starts later), our history forked at or before that step and
none of our steps can be shown to be the collaboration's: ``d`` is our lineage's first step, and the
caller also applies its older rule (:func:`fork_start_known` is False), taking the earlier of the two.
If the two lineages share no step (a state from before this format, or a gap of more than
:data:`LINEAGE_STEPS` steps), they are not :func:`comparable` and the caller falls back to what it knew
before (who it stepped with).

**An earlier life** (:func:`earlier_life_replaced`). A restarted volunteer starts fresh: it has no state
to compare, but its report journal kept the lineage of the steps its earlier process reported (the last
:data:`LINEAGE_STEPS`, :mod:`volunteer.journal`), and the highest of them, ``last``. When it loads a state
at step ``L`` (or first steps from its own initial state: ``L`` is 0, its lineage empty), the same rule
applies with that journaled lineage as ``ours`` and ``last`` as ``s``: its earlier steps from the first
one whose fingerprint differs from the loaded lineage's (or, forked before the loaded lineage begins,
from the first it journaled) up to ``last`` are not the collaboration's, and so are those above ``L``
(the loaded lineage cannot vouch for a step it does not reach). Steps both lineages agree on are kept.
With no journaled lineage (a journal of an older version) or none in common with the loaded one (a gap
of more than :data:`LINEAGE_STEPS` steps), only the steps above ``L`` are (what the step numbers alone
show): a long absence is not evidence of a fork.

*Proof sketch.* The fingerprint covers the step and a fixed sample of every parameter, so two states with
equal fingerprints at the same step are the same state up to an 8-byte hash collision. Parameters at step
``k + 1`` are a deterministic function of those at ``k`` and the round's average; once two histories differ
at ``d`` they differ at every later step (they can only meet again by a collision). So the steps
``d..s`` of ours are exactly the ones not in the loaded history, and steps before ``d`` are (they agree).

**Trust.** The lineage is inside the blob, whose SHA-256 a majority of admitted users vouched for before
it was downloaded (:mod:`shared.state.trust`), so it is as credible as the parameters themselves. A
malformed or oversized lineage is ignored (treated as absent), never fatal: it is bounded before parsing
(:data:`MAX_TEXT`).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "FINGERPRINT_BYTES",
    "LINEAGE_STEPS",
    "MAX_TEXT",
    "comparable",
    "decode_lineage",
    "earlier_life_replaced",
    "encode_lineage",
    "extend_lineage",
    "fork_start_known",
    "replaced_steps",
]

#: How many steps a lineage remembers: the merge rule's chain length (``shared.merge``), so that any two
#: states the merge rule counts as one collaboration can be compared.
LINEAGE_STEPS = 32
FINGERPRINT_BYTES = 8
#: The longest lineage text parsed: ``LINEAGE_STEPS`` entries of a 20-digit step, ':' and 16 hex digits.
MAX_TEXT = LINEAGE_STEPS * (20 + 1 + 2 * FINGERPRINT_BYTES + 1)


def extend_lineage(lineage: Mapping[int, bytes], step: int, fingerprint: bytes) -> dict[int, bytes]:
    """``lineage`` with ``step``'s fingerprint, keeping the last :data:`LINEAGE_STEPS` steps up to ``step``
    (an entry above ``step`` belongs to another history and is dropped)."""
    kept = {s: f for s, f in lineage.items() if step - LINEAGE_STEPS < s < step}
    kept[step] = fingerprint
    return dict(sorted(kept.items()))


def encode_lineage(lineage: Mapping[int, bytes]) -> str:
    return ",".join(f"{step}:{fingerprint.hex()}" for step, fingerprint in sorted(lineage.items()))


def decode_lineage(text: str) -> dict[int, bytes]:
    """The lineage ``encode_lineage`` wrote; ``{}`` for anything malformed or oversized (never raises)."""
    if not text or len(text) > MAX_TEXT:
        return {}
    lineage: dict[int, bytes] = {}
    for entry in text.split(",")[:LINEAGE_STEPS]:
        step_text, _, hex_text = entry.partition(":")
        if not step_text.isdecimal() or len(step_text) > 20 or len(hex_text) != 2 * FINGERPRINT_BYTES:
            return {}
        try:
            lineage[int(step_text)] = bytes.fromhex(hex_text)
        except ValueError:
            return {}
    return lineage


def comparable(ours: Mapping[int, bytes], theirs: Mapping[int, bytes]) -> bool:
    """Whether the two lineages share a step, so that :func:`replaced_steps` can decide."""
    return any(step in theirs for step in ours)


def replaced_steps(
    ours: Mapping[int, bytes], our_step: int, theirs: Mapping[int, bytes], loaded_step: int
) -> tuple[int, int] | None:
    """Our steps ``(first, last)`` a loaded state replaced that did not survive, or None when none were
    lost (see the module docstring; only meaningful when the lineages are :func:`comparable`)."""
    common = [step for step in ours if step in theirs]
    diverged = [step for step in common if ours[step] != theirs[step]]
    first = min(diverged) if diverged else loaded_step + 1
    if not fork_start_known(ours, theirs):
        first = min(ours)  # ours forked at or before the first step both know: none of ours is shown theirs
    first = max(1, first)
    return (first, our_step) if our_step >= first else None


def fork_start_known(ours: Mapping[int, bytes], theirs: Mapping[int, bytes]) -> bool:
    """False when the lineages already differ at the first step both know while ours reaches further
    back: our history forked at or before that step, somewhere the loaded lineage does not cover."""
    common = [step for step in ours if step in theirs]
    if not common:
        return False
    first = min(common)
    return ours[first] == theirs[first] or min(ours) == first


def earlier_life_replaced(
    life: Mapping[int, bytes], last: int, theirs: Mapping[int, bytes], loaded_step: int
) -> tuple[int, int] | None:
    """The steps ``(first, last)`` of a restarted peer's earlier process (journaled lineage ``life``,
    highest step ``last``) that a loaded state at ``loaded_step`` with lineage ``theirs`` did not keep,
    or None (module docstring, "An earlier life")."""
    if life and comparable(life, theirs):
        return replaced_steps(life, last, theirs, loaded_step)
    return (loaded_step + 1, last) if last > loaded_step else None
