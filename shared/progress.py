"""Where the collaboration stands, from the peers' progress records (pure; seed 000 §3.1).

Every peer publishes a :class:`~protocols.training.Progress` (its step, the samples it accumulated toward
the next step, its throughput, a fingerprint of its parameters). :func:`summarize` turns the records a peer
read from the DHT into a :class:`CollabView`:

0. A record saying its writer **left** the run is dropped.
1. **Plausibility.** A record is ignored when it is stale (older than ``PROGRESS_TTL`` plus the allowed
   clock skew, or from the future beyond it), claims more than :data:`MAX_SAMPLES_FACTOR` times the target
   batch (honest peers stop accumulating at the target), or more than :data:`MAX_SAMPLES_PER_SECOND`.
2. **Support.** Honest peers are never more than one step apart for long: a peer that steps is followed
   by every peer of the round within seconds, and laggards download the state. So a step claim ``s`` is
   *credible* only if a peer of *another user* claims at least ``s - 1`` (or we do, once we hold real
   state; a downloading peer vouches for nothing: the step it holds is one it is replacing), or if the
   claimant's user is the only user we know of. Our own claim is judged by the same rule (it decides
   whether we are a member of a collaboration, :mod:`shared.merge`), so every reader of the same records
   believes the same claims. A single user announcing an
   absurd step is ignored, whatever it writes and under however many peer ids. (Two colluding admitted
   users could still fake a step; the allowlist and the ledger are the defence there.)
3. **The collaboration's step** is the highest step of the *surviving collaboration*
   (:mod:`shared.merge`: the credible, anchored, non-syncing peers chain into collaborations of steps
   at most :data:`~shared.merge.CHAIN` apart; the one with the most users survives, then the one with
   the most steps). With one collaboration -- normal operation -- this is the highest credible step, as
   it always was; with several, ``minority`` tells a peer outside the survivor to re-sync to ``step``
   even if that is lower than its own (``collaborations`` counts them, ``survivor`` is the survivor).
   With no such peer at all (only newcomers and downloads), the highest credible step. **Its samples**
   are the credible samples of the peers at that step, each extrapolated by its own throughput since its
   record was written (for at most :data:`MAX_EXTRAPOLATION` seconds), so the target is detected on
   time, not one publishing period late.
4. **Divergence.** A peer in the ``minority`` has diverged (its state is not the survivor's). Peers at
   one step should hold identical parameters; if the fingerprints at our step disagree, the fingerprint
   held by more distinct *users* wins (ties: the smaller fingerprint), and a peer holding another one
   must re-download the state. Votes are counted in users, not peer ids, because
   one admitted user may run many peer ids: each user's peers cast one vote per fingerprint.
5. **Syncing.** ``syncing`` lists the peers downloading the state, so that the peers at the
   collaboration's step announce theirs -- including a peer whose step claim is not credible (a minority
   peer ahead of the survivor): its step is never followed, only answered with the survivor's state.

**Users.** ``users`` maps a peer id to the user it speaks for (``DHTValue.users``, the admitted username
of its DHT records: see ``shared.dht.admission``); a peer missing from it is its own user (open runs).

``ready`` is true when the samples at the collaboration's step reach the target batch, or when any peer
of that step already entered averaging (``entered``: the others follow it into the same round) — never
while nobody there has a sample (a round of zero weight averages nothing).

**Holding a round for a peer that is downloading the state** (:func:`held_for`). A newcomer or laggard
downloads the state of the collaboration's step S and then joins round S with the others. If the others
enter round S the moment the target is reached, a download that takes about as long as a round makes
the newcomer miss every round: it loads S while the others finish S, is behind again, loads S+1, and so
on (seen under load: a joiner stuck at step 0 for minutes while the others stepped). So peers at step S
that see a credible peer flagged ``syncing`` hold their round (before anyone entered it) until that peer
has loaded the state, for at most ``grace`` seconds per *user* (its peer ids together) in any ``window``
seconds: a user that flips its flag forever can slow the run by at most ``grace / window`` of its time,
never stall it.

**Batch accounting: who stops when** (:func:`quotas`, :func:`micro_batch_budget`; issue 11). The run's
global batch is fixed: a step should average ``target_batch`` samples, not the target plus whatever the
peers computed while they learned that it was reached. Measured on loopback (tiny-mlm, target 128, three
volunteers on two cores) steps held a median of 1.44x the target (p90 2.1x): a peer reads the others'
records every few hundred milliseconds through the DHT, the records are up to ``publish_period`` old, a
whole step's compute lasts about as long, and each peer kept computing until it saw the target reached --
so every peer added what it computed during that lag (peers speed up as the first one stops, too).

The rule: **a peer stops adding samples to the current step once its share is done, and waits for the
round** -- it never computes ahead for the next step without DPU, since the parameters change at the step
(a gradient on the old parameters would be one step stale, which only DPU accepts). Its share is known
without any message: every member of round ``s`` adopted the same plan from the same signed tickets, so
each computes the same :func:`quotas` of ``target_batch`` for step ``s + 1``, proportional to the
members' measured throughput (``JoinTicket.samples_per_second``), summing to exactly ``target_batch``
(largest remainder). A member fills its quota exactly: its last micro-batch is cut to what is left
(:func:`micro_batch_budget`; the examples cut off are the next micro-batch's), then it holds until the
collaboration's estimate reaches the target or another peer entered the round, and enters. Waiting is
what a share done early costs; the shares follow measured throughput, so the peers finish together.

What keeps it safe: a peer without a quota (the first step, a newcomer, a lone volunteer) follows the
collaboration's estimate as before, never exceeding ``target_batch`` alone; a peer whose share is not done
when another enters follows it unless the rest of its share takes less than half a matchmaking window (a
round never splits for it); a peer that holds longer than its patience (a member died) goes back to the
estimate. Samples are weighted in averaging, so a step's batch is exactly the sum of its members'
weights whatever the split; each peer reports what it really computed.

**What a step's batch was** (:func:`claimed_batch`). Every member of a round knows the step's global
batch exactly (the plan's weights, which it averaged with) and publishes it with its progress
(``Progress.batch``); a backbone records the value claimed by the most users at that step (ties: the
smaller), never an extrapolation of records read while the peers were still computing (which is what
the ledger showed before: 38 % to 377 % of the target for a lone volunteer whose every step held exactly
the target).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from protocols.auth import MAX_CLOCK_SKEW
from protocols.training import PROGRESS_TTL, Progress

from .merge import Collaboration, collaborations, is_member, survivor

__all__ = [
    "MAX_EXTRAPOLATION",
    "MAX_SAMPLES_FACTOR",
    "MAX_SAMPLES_PER_SECOND",
    "CollabView",
    "claimed_batch",
    "held_for",
    "micro_batch_budget",
    "plausible",
    "quotas",
    "summarize",
]

MAX_SAMPLES_FACTOR = 4
MAX_SAMPLES_PER_SECOND = 1e7
#: Records are extrapolated by their throughput for at most this long (a peer that stalls stops counting).
MAX_EXTRAPOLATION = 3.0


@dataclass(frozen=True)
class CollabView:
    step: int  # the collaboration's step: the surviving collaboration's highest step (rule 3)
    samples: float  # samples accumulated toward step + 1 by the peers at ``step`` (ours included)
    samples_per_second: float  # sum over the peers at ``step``
    peers: int  # credible peers (ourselves included)
    peers_at_step: int
    ready: bool  # the target batch is reached: average now
    #: our parameters are not the collaboration's: they differ from the majority at our step, or we are in
    #: the ``minority`` (re-download the state of ``step``, whatever our own step)
    diverged: bool
    ignored: tuple[str, ...]  # peers whose records were implausible or unsupported
    syncing: tuple[str, ...]  # peers downloading the state (plausible records; their step claim aside)
    loss: float | None  # samples-weighted mean of the losses reported at ``step``
    entered: bool = False  # a peer at ``step`` already entered averaging (its round is under way)
    #: our state is not the surviving collaboration's (we are in another collaboration, or ahead of it):
    #: re-sync to ``step`` even though it may be lower than ours (:mod:`shared.merge`)
    minority: bool = False
    collaborations: int = 1  # how many collaborations the records show (:func:`shared.merge.collaborations`)
    #: the survivor's step when another user stands behind it: what the collaboration credibly showed us
    #: (feeds the high-water mark of :mod:`shared.alone`); None when only our own user is there
    shown: int | None = None
    survivor: Collaboration | None = None  # the surviving collaboration (None: nobody holds a state)
    #: the round's planned samples as most users at ``step`` publish them (``Progress.target``; planned
    #: diloco rounds, :mod:`shared.averaging.round_length`), None when nobody at ``step`` publishes one
    target: int | None = None

    def eta(self, target_batch: int) -> float | None:
        """Seconds until the target batch is reached at the current rate, or None if nobody computes."""
        if self.samples >= target_batch:
            return 0.0
        if self.samples_per_second <= 0:
            return None
        return (target_batch - self.samples) / self.samples_per_second


def plausible(progress: Progress, now: float, target_batch: int) -> bool:
    """Rule 1 of the module docstring."""
    age = now - progress.time
    return (
        -MAX_CLOCK_SKEW <= age <= PROGRESS_TTL + MAX_CLOCK_SKEW
        and progress.samples <= MAX_SAMPLES_FACTOR * target_batch
        and progress.samples_per_second <= MAX_SAMPLES_PER_SECOND
    )


def summarize(
    records: Mapping[str, Progress],
    me: str,
    mine: Progress,
    *,
    now: float,
    target_batch: int,
    anchored: bool = True,
    users: Mapping[str, str] | None = None,
    min_target: int = 1,
) -> CollabView:
    """The collaboration as seen by ``me`` (see the module docstring).

    Args:
        records: progress by peer id, as read from the DHT (ours, if present, is replaced by ``mine``).
        mine: our own current progress.
        anchored: our own step is real (we trained or downloaded state); False for a fresh newcomer, whose
            step 0 supports nobody.
        users: the user of each peer id (see "Users" above); by default every peer is its own user.
        min_target: the shortest planned round; ``Progress.target`` claims outside
            ``[min_target, target_batch]`` are not counted.
    """
    user_of = users or {}

    def user(peer: str) -> str:
        return user_of.get(peer, peer)

    others = {peer: p for peer, p in records.items() if peer != me and not p.left}
    fresh = {peer: p for peer, p in others.items() if plausible(p, now, target_batch)}
    ignored = set(others) - set(fresh)
    # Rule 2 is applied to every claim alike, our own included, so that every reader of the same records
    # finds the same credible claims (shared.merge relies on it): a lone claim far ahead of the others is
    # not believed by its own writer either. The step a downloading peer is replacing vouches for nothing
    # (a losing fork's peers re-syncing must not keep its claims credible); a newcomer's step 0 vouches
    # for steps up to 1 only, as always.
    voters = {peer: p for peer, p in fresh.items() if not p.syncing}
    if anchored and not mine.syncing:
        voters[me] = mine
    known = {user(peer) for peer in voters}

    def supported(peer: str, step: int) -> bool:
        if known <= {user(peer)}:  # the only user we know of: nobody to agree with
            return True
        return any(q.step >= step - 1 for q_peer, q in voters.items() if user(q_peer) != user(peer))

    credible: dict[str, Progress] = {}
    for peer, progress in fresh.items():
        if supported(peer, progress.step):
            credible[peer] = progress
        else:
            ignored.add(peer)
    everyone = {**credible, me: mine}
    members = {peer: p.step for peer, p in credible.items() if is_member(p)}
    if anchored and not mine.syncing and not mine.left and supported(me, mine.step):
        members[me] = mine.step
    found = collaborations(members, user)
    best = survivor(found)
    if best is not None:
        step = best.top
    else:  # nobody holds a state a collaboration continues (newcomers, downloads): the newest claim of a
        # peer that holds its state (a downloading peer's step is the one it is leaving: it never leads)
        step = max((p.step for p in everyone.values() if not p.syncing), default=mine.step)
        holding = [p.step for p in credible.values() if not p.syncing]
        if not anchored and holding:
            step = max(holding)
    # Anyone flagged syncing gets the state announced (rule 5), whatever step it still holds: a peer of a
    # losing collaboration that is ahead of the survivor is not credible, yet must be able to re-sync.
    syncing = {peer for peer, p in fresh.items() if p.syncing}
    at_step = {peer: p for peer, p in everyone.items() if p.step == step and not p.syncing}
    samples = 0.0
    for peer, p in at_step.items():
        extra = (
            0.0
            if peer == me or p.ready
            else p.samples_per_second * min(MAX_EXTRAPOLATION, max(0.0, now - p.time))
        )
        samples += p.samples + extra
    minority = best is not None and not best.spans(mine.step) and (mine.step > best.top or me in members)
    sps = sum(p.samples_per_second for p in at_step.values())
    weights = [(p.loss, p.samples) for p in at_step.values() if p.loss is not None and p.samples > 0]
    total = sum(w for _, w in weights)
    loss = sum(value * w for value, w in weights) / total if total else None
    return CollabView(
        step=step,
        samples=min(samples, float(MAX_SAMPLES_FACTOR * target_batch)),
        samples_per_second=sps,
        peers=len(everyone),
        peers_at_step=len(at_step),
        ready=samples > 0 and (samples >= target_batch or any(p.ready for p in at_step.values())),
        diverged=minority or (_diverged(everyone, mine, user) if anchored else False),
        ignored=tuple(sorted(ignored)),
        syncing=tuple(sorted(syncing)),
        loss=loss if loss is None or math.isfinite(loss) else None,
        entered=any(p.ready for p in at_step.values()),
        minority=minority,
        collaborations=len(found),
        shown=best.top if best is not None and best.users - {user(me)} else None,
        survivor=best,
        target=_voted_target(at_step, user, max(1, min_target), target_batch),
    )


def _voted_target(
    at_step: Mapping[str, Progress], user: Callable[[str], str], low: int, high: int
) -> int | None:
    """The planned round most users at the step publish (one vote per user and value), ties to the larger
    (a longer round never cuts the others' short), claims outside ``[low, high]`` not counted."""
    claims = {(p.target, user(peer)) for peer, p in at_step.items() if low <= p.target <= high}
    votes = Counter(target for target, _ in claims)
    if not votes:
        return None
    return max(votes, key=lambda target: (votes[target], target))


def held_for(
    syncing: tuple[str, ...], since: dict[str, float], now: float, *, grace: float, window: float
) -> tuple[str, ...]:
    """The syncing peers a round is still held for (see the module docstring).

    ``since`` maps a peer to the start of its current hold window and is updated in place: a peer seen
    syncing for the first time, or whose window is over, starts a new window at ``now``. Entries of
    peers whose window is over and that no longer sync are dropped, so ``since`` stays bounded by the
    number of peers that synced within the last ``window`` seconds.
    """
    for peer in [p for p, start in since.items() if now - start >= window and p not in syncing]:
        del since[peer]
    held = []
    for peer in syncing:
        start = since.get(peer)
        if start is None or now - start >= window:
            since[peer] = start = now
        if now - start < grace:
            held.append(peer)
    return tuple(held)


def _diverged(everyone: Mapping[str, Progress], mine: Progress, user: Callable[[str], str]) -> bool:
    if not mine.params:
        return False
    voters = {
        (p.params, user(peer))
        for peer, p in everyone.items()
        if p.step == mine.step and p.params and not p.syncing
    }
    votes = Counter(params for params, _ in voters)
    if not votes:  # we are re-syncing ourselves
        return False
    best = max(votes.items(), key=lambda item: (item[1], [-b for b in item[0]]))[0]
    return best != mine.params


def quotas(rates: Mapping[str, float], target: int) -> dict[str, int]:
    """Each member's share of ``target`` samples, proportional to its rate (module docstring, "Batch
    accounting"): non-negative integers summing to exactly ``target``; members of rate 0 get nothing
    unless every rate is 0 (then equal shares). Deterministic: the same ``rates`` give the same shares on
    every peer (largest remainder, ties to the smaller peer id)."""
    if not rates or target <= 0:
        return dict.fromkeys(rates, 0)
    members = sorted(rates)
    weights = [r if math.isfinite(r) and r > 0 else 0.0 for r in (rates[m] for m in members)]
    if sum(weights) <= 0:
        weights = [1.0] * len(members)
    total = sum(weights)
    exact = [w / total * target for w in weights]
    shares = [math.floor(x) for x in exact]
    left = target - sum(shares)
    by_remainder = sorted(range(len(members)), key=lambda i: (-(exact[i] - shares[i]), members[i]))
    for i in by_remainder[: max(0, left)]:
        shares[i] += 1
    return dict(zip(members, shares, strict=True))


def micro_batch_budget(samples: int, limit: int, local_batch: int) -> int:
    """How many samples our next micro-batch may hold: ``local_batch``, cut to what is left of ``limit``
    (our quota, or the target batch); 0 means stop and wait for the round."""
    return max(0, min(local_batch, limit - samples))


def claimed_batch(
    records: Mapping[str, Progress],
    step: int,
    target_batch: int,
    users: Mapping[str, str] | None = None,
    now: float | None = None,
) -> int | None:
    """The global batch of ``step`` as its peers claim it (module docstring, "What a step's batch was"):
    the value the most users claim among plausible-sized claims of peers still in the run (with ``now``:
    only :func:`plausible` records, as everywhere else), ties going to the claim closest to the target
    (then the smaller), None if nobody at ``step`` claims one. One user's peers count once per value."""
    user_of = users or {}
    claims = {
        (p.batch, user_of.get(peer, peer))
        for peer, p in records.items()
        if p.step == step
        and not p.syncing
        and not p.left
        and 0 < p.batch <= MAX_SAMPLES_FACTOR * target_batch
        and (now is None or plausible(p, now, target_batch))
    }
    votes = Counter(batch for batch, _ in claims)
    if not votes:
        return None
    return min(votes, key=lambda batch: (-votes[batch], abs(batch - target_batch), batch))
