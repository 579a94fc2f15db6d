"""May a volunteer step without matchmaking? (pure, plus one small persisted record; issue 10: no lone forks)

The failure this prevents: after a backbone restart split the DHT, a restarted volunteer joined through the
restarted backbone, saw nobody, loaded the backbone's checkpoint of step 90 while the collaboration was at
step 124, and took 406 steps alone in 51 s -- a fork that the backbone checkpointed and later volunteers
joined. Two things were missing: evidence that it was alone, and a memory of where the collaboration was.

**The rule** (:func:`lone_step`). A volunteer steps with its own gradient, without a group, only when both
hold:

(a) *Evidence that it is alone.* It read the progress records through its own DHT lookup **and** through a
    lookup that starts at each backbone it knows (:func:`shared.progress_records.read_progress_everywhere`:
    after a restart the DHT may be split, and the lookup through our own routing table only sees our side;
    a lookup seeded at a backbone walks that backbone's side). At least one read answered, every read is
    at most :data:`EVIDENCE_MAX_AGE` seconds old, and no read that answered shows a plausible record
    (:func:`shared.progress.plausible`: fresh within ``PROGRESS_TTL`` plus the clock skew, sane numbers)
    of any other peer id that has not left. A backbone that cannot be reached at all adds no evidence
    either way (a backbone lost for good must not stop a lone volunteer forever); an unreachable one is
    also no proof of absence, which is why (b) exists.

(b) *Its state is not older than the collaboration has credibly shown it* -- the **high-water mark**
    ``H = (step, seen)``: the surviving collaboration's step the last time a view showed another user in
    it (:attr:`shared.progress.CollabView.shown`), and when. It is *set* (not maxed) from every such view:
    a merge that sends us back to a lower survivor lowers it too (the survivor's step is, from then on,
    what the collaboration has shown). Our own lone steps never raise it. It is persisted in the data dir
    (:data:`HIGH_WATER_FILE`, written atomically, any damage read as "no mark"), so a restart remembers
    it. While ``H`` is *binding*, a state of a step below ``H.step`` is not trained on alone.

(c) *Nobody is joining from its state*: no peer downloaded a chunk of our state in the last
    :data:`JOINING_GRACE` seconds. Such a peer is joining the run from the state we hold and publishes
    its record only once it has loaded it; a lone step meanwhile puts us a step ahead of the state it
    loads, and two lone steps make our claim not credible to it (:mod:`shared.progress`, rule 2): we
    are sent back to the step it holds, which nobody announces while its high-water mark still shows
    our later step (seen in the churn test under load: a newcomer loaded step 13 while we stepped to 15
    alone, and the run stood still for two minutes).

**When truly everyone left.** ``H`` binds for :data:`HIGH_WATER_TTL` seconds after ``seen`` (wall-clock,
persisted: a restart does not reset the wait, and a mark dated more than the allowed clock skew in the
future -- a clock set back, a damaged file -- binds nothing). After that the collaboration has not been
seen for far longer than its records live (``PROGRESS_TTL``) and a healing DHT needs (seconds), so the
state at ``H`` is taken to be gone with its holders, and a run resuming from an older backbone checkpoint
resumes -- after at most :data:`HIGH_WATER_TTL` seconds. If the others were alive after all (a partition
longer than that), the fork this starts is one user's, and the merge rule (:mod:`shared.merge`) sends it
back to the others when they meet. Where the survivors saw the holders of ``H`` fail, rule (d) ends the
wait within seconds instead.

**When the mark's state died with its holders** (rule (d), :func:`state_lost`). The peers that held
the state of ``H`` may all die while the others are downloading it (the two-backbone soak under load: the
only holder of step 9 was SIGKILLed while two restarted volunteers downloaded from it, a backbone held the
checkpoint of step 1). Nobody can serve that state again, and waiting :data:`HIGH_WATER_TTL` for it
stalls the run for minutes. The mark's state is **lost** -- the mark stops binding at once and is
forgotten, on disk too -- when all of these hold:

1. *Nobody we see holds it*: no peer in our view is at ``H`` or later. (A peer whose state download failed
   and that has not published a record since is not in the view: :mod:`volunteer.collab.progress_board`.
   Its last record would otherwise keep it "at ``H``" for ``PROGRESS_TTL`` after its death.)
2. *Its holders are gone, and we saw them go* -- a witness, not an absence of news. Nobody serves it:
   every writer of every announced state of step ``H`` or later failed the last download we tried from
   it (connection refused or reset, stalled); and either (A) at least one such state is announced (its
   holders failed us), or (B) every peer that held ``H`` when the collaboration last showed it to us
   (the surviving collaboration's members then, kept with the mark in memory) failed us, or is in our
   view holding an older state (it restarted: its state died with its process) or has left; we count
   ourselves among those when our own state is older. A peer on the other half of a split DHT reads no
   announcement of ``H`` and does not see the holders at all, so it never concludes that ``H`` is lost
   and rule (b) keeps it waiting; a holder that is alive serves the download (a split DHT does not stop
   a direct connection). A mark read back from disk after a restart has no holders: only (A) applies.
3. *We are not alone*: another peer is in our view (the survivors see each other). A peer that sees
   nobody keeps rule (b) whatever it witnessed: it may be the one that is cut off, and one peer must not
   train alone on an old state.

Before loading an older state because of (d), the caller sees the verdict hold for :data:`LOSS_CONFIRM`
seconds (a live holder that merely failed one download republishes its record well within that, and is
in the view again). The survivors then take the newest state that is still announced (a backbone's
checkpoint); :func:`shared.state.trust.trusted_state`'s order makes it the same state for all of them,
and whoever loads it first becomes the member that the others follow (:mod:`shared.merge`). What could
still fork: two peers on one half of a split that each witnessed every announced holder fail; the
holders are then unreachable for them too, and the merge rule (most users) decides when the halves meet.

**Cost.** The reads are the caller's, at most every few seconds in the background (they are valid
:data:`EVIDENCE_MAX_AGE` seconds), never one per step: the lone path stays as cheap as before.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from protocols.auth import MAX_CLOCK_SKEW
from protocols.errors import DECODE_FAILURES
from protocols.training import PROGRESS_TTL, Progress

from .progress import plausible

__all__ = [
    "EVIDENCE_MAX_AGE",
    "HIGH_WATER_FILE",
    "HIGH_WATER_TTL",
    "JOINING_GRACE",
    "LOSS_CONFIRM",
    "SAVE_PERIOD",
    "HighWater",
    "LoneStep",
    "Reading",
    "binding",
    "load_high_water",
    "lone_step",
    "observe",
    "save_high_water",
    "state_lost",
    "worth_saving",
]

logger = logging.getLogger(__name__)

#: Seconds a high-water mark binds after the collaboration was last seen (4 record lifetimes).
HIGH_WATER_TTL = 4 * PROGRESS_TTL
#: Reads of the progress records older than this are no evidence of anything.
EVIDENCE_MAX_AGE = 5.0
#: Seconds after a peer downloaded our state during which we do not step alone (rule (c)).
JOINING_GRACE = 30.0
#: Seconds rule (d)'s verdict must hold before an older state is loaded (a live peer republishes its
#: progress record every second or so, so a holder that failed one download is back in view well before).
LOSS_CONFIRM = 5.0
#: The mark's file in the volunteer's data dir.
HIGH_WATER_FILE = "high-water.json"
#: A confirmation of an unchanged mark is written at most this often.
SAVE_PERIOD = 10.0


class HighWater(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The surviving collaboration's step when another user was last seen in it, and when (unix time)."""

    run_id: Annotated[str, msgspec.Meta(max_length=256)]
    step: Annotated[int, msgspec.Meta(ge=0, le=2**40)]
    seen: float


@dataclass(frozen=True)
class Reading:
    """One read of the progress records: through our DHT (``source`` "dht") or seeded at a backbone."""

    source: str
    answered: bool  # False: the source could not be reached (no evidence either way)
    records: Mapping[str, Progress]
    users: Mapping[str, str]


@dataclass(frozen=True)
class LoneStep:
    """The verdict of :func:`lone_step`; ``why`` says what is missing (for logs and the panel)."""

    allowed: bool
    why: str


def binding(mark: HighWater | None, now: float) -> bool:
    """The mark still forbids lone steps on older states (see "When truly everyone left")."""
    return mark is not None and -MAX_CLOCK_SKEW <= now - mark.seen < HIGH_WATER_TTL


def observe(mark: HighWater | None, shown: int | None, run_id: str, now: float) -> HighWater | None:
    """The mark after a view: set to ``shown`` (:attr:`~shared.progress.CollabView.shown`) when the view
    showed another user in the surviving collaboration, else unchanged."""
    if shown is None:
        return mark
    return HighWater(run_id=run_id, step=shown, seen=now)


def worth_saving(saved: HighWater | None, mark: HighWater | None) -> bool:
    """Whether ``mark`` should be written over ``saved``: its step changed, or it was confirmed
    :data:`SAVE_PERIOD` seconds after the saved one (the wait after a restart is then at most that much
    longer than :data:`HIGH_WATER_TTL`, and the file is written at most every few seconds)."""
    if mark is None:
        return False
    return saved is None or mark.step != saved.step or mark.seen - saved.seen >= SAVE_PERIOD


def lone_step(
    readings: Sequence[Reading],
    me: str,
    step: int,
    mark: HighWater | None,
    *,
    now: float,
    read_at: float,
    target_batch: int,
    joining: str | None = None,
) -> LoneStep:
    """May we step alone now, at ``step``? (the rule of the module docstring)

    Args:
        readings: the latest reads (our DHT's and one seeded at each known backbone).
        me: our peer id (our own record is no company).
        step: the step of the state we would train on.
        mark: our high-water mark, if any.
        now: unix time.
        read_at: unix time of the oldest of ``readings``.
        target_batch: the run's target batch (for plausibility).
        joining: a peer that downloaded our state within :data:`JOINING_GRACE` seconds, if any.
    """
    if joining is not None:
        return LoneStep(False, f"{joining} is joining from our state (it downloaded it)")
    answered = [r for r in readings if r.answered]
    if not answered:
        return LoneStep(False, "no read of the progress records answered")
    if now - read_at > EVIDENCE_MAX_AGE:
        return LoneStep(False, f"the last read of the progress records is {now - read_at:.0f} s old")
    others = sorted(
        {
            peer
            for reading in answered
            for peer, progress in reading.records.items()
            if peer != me and not progress.left and plausible(progress, now, target_batch)
        }
    )
    if others:
        return LoneStep(False, f"{len(others)} other peer(s) in the run ({', '.join(others[:3])})")
    if mark is not None and binding(mark, now) and step < mark.step:
        wait = HIGH_WATER_TTL - (now - mark.seen)
        return LoneStep(
            False,
            f"our state (step {step}) is older than step {mark.step}, which the collaboration showed us "
            f"{now - mark.seen:.0f} s ago; waiting for it (at most {wait:.0f} s more)",
        )
    return LoneStep(True, f"alone in {len(answered)} read(s)")


def state_lost(
    mark_step: int,
    announced: Iterable[tuple[int, Iterable[str]]],
    failing: Callable[[str], bool],
    *,
    company: bool,
    holders: Iterable[str] = (),
    gone: Callable[[str], bool] = lambda _: False,
) -> bool:
    """Rule (d): the state of ``mark_step`` died with its holders (see the module docstring).

    The caller has already found nobody in its view at ``mark_step`` or later (condition 1).

    Args:
        mark_step: the high-water mark's step.
        announced: ``(step, writers)`` of every state announced now.
        failing: whether the last download we tried from a peer failed.
        company: another peer is in our view (condition 3).
        holders: the peers that held the mark's step when it was last shown to us (witness (B)).
        gone: whether a holder is in our view holding an older state, or left (or is us, behind it).
    """
    if not company:
        return False
    writers = [w for step, ws in announced if step >= mark_step for w in ws]
    if not all(failing(w) for w in writers):
        return False  # someone may still serve it
    if writers:
        return True  # (A): its announced holders failed us
    known = list(holders)
    return bool(known) and all(failing(h) or gone(h) for h in known)  # (B)


_DECODER = msgspec.json.Decoder(HighWater)


def load_high_water(data_dir: Path, run_id: str) -> HighWater | None:
    """The persisted mark of ``run_id``, or None (missing, damaged, another run's: logged once here)."""
    path = data_dir / HIGH_WATER_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("cannot read %s: %s", path, exc)
        return None
    if len(raw) > 4096:
        logger.warning("ignoring %s: %d bytes is not a high-water mark", path, len(raw))
        return None
    try:
        mark = _DECODER.decode(raw)
    except DECODE_FAILURES as exc:
        logger.warning("ignoring a damaged %s: %s", path, exc)
        return None
    if mark.run_id != run_id or not math.isfinite(mark.seen):
        return None
    return mark


def save_high_water(data_dir: Path, mark: HighWater) -> None:
    """Write the mark atomically (a temporary file, fsync, rename): a crash leaves the old or the new one.

    Raises:
        OSError: the disk refused.
    """
    path = data_dir / HIGH_WATER_FILE
    tmp = path.with_name(f".{HIGH_WATER_FILE}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(msgspec.json.encode(mark))
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
