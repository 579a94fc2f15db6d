"""Weighted butterfly all-reduce of one group over the engine's bulk lane (DESIGN §2; seed 000 §3.2).

A :class:`GroupPlan` names the members (in order), each member's weight (its sample count; 0 for an
auxiliary peer that only helps and receives), and the integer slice of the flat gradient each member
aggregates (the LP's apportionment; client-mode peers own none). Every member ``m`` then, for every
aggregator ``j`` with a non-empty slice, concurrently:

1. **push** — sends its copy of slice ``j`` part by part (``avg.push``, a :class:`PartHeader` and the
   encoded part; skipped for weight 0), its pushes to all aggregators kept in step by a
   :class:`~.pacing.PushGate` (no aggregator more than one part ahead of another, in proportion to their
   slices), so that every aggregator can reduce part ``k`` at about the same time;
2. **pull** — asks for each averaged part (``avg.pull``); the aggregator answers once its slice is
   averaged, with an :class:`AveragedHeader` and the encoded average as the reply payload, over the
   connection the member opened (so client-mode members, which accept no connections, take part).

**Auxiliary members** (``Member.aux``; seed 000 §3.2): an auxiliary aggregator (a backbone, ``volunteer
join --aux``) computes nothing, so it pushes nothing (weight 0) and pulls nothing but its own slice's
average, which it holds: its slices of the others are left out of its outcome ("not pulled"), it is not
counted among the pullers of its own slice (``pulls_left``), a pull from it is refused (the LP budgets no
upload for it), and nobody asks it to relay (it holds no other part). A weight-0 member *without* ``aux``
(an fp16 overflow) still pulls every slice: it steps with the group.

Aggregator ``j`` feeds the parts into a :class:`SliceReducer` (validation, bans, deterministic float64
sum in sorted peer order) and finalizes when every expected sender is complete, or at the round's
deadline after dropping the missing ones (renormalized over who delivered). A sender whose connection
breaks mid-part is dropped at once. The average is encoded once and the *aggregator keeps
decode(encode(avg))* for itself, so every member ends with bit-identical values.

**Faults.** An aggregator that fails (unreachable, refuses, or misses the deadline) leaves its slice
un-averaged: each member keeps its own values there, and the :class:`RoundResult` lists exactly those
ranges. Averaged slices are written into the caller's vector only after the round, slice by slice and
whole (``apply_outcome``), so no member ends with a half-updated buffer. An aggregator keeps serving pulls
until every member has fetched its slice or the deadline passes.

**Strangers** (issue 9). Every member may be lying, so:

* *before reading a part's payload* the aggregator checks, from the bulk and part headers alone, that the
  sender is a sender of this plan (a member with weight > 0, not excluded), that the round, codec, part
  index, offset, ``numel`` and ``nbytes`` are the plan's canonical layout and that the weight is the
  plan's for that sender; a non-member is refused without a ban, a member breaking a rule is banned for the
  round; no payload byte is read into a buffer in either case (``statistics().part_bytes_read``);
* each sender's weight is the plan's (already bounded by the group, :func:`.groups.bound_weights`), bounded
  once more by what this aggregator saw the sender weigh in earlier rounds (:class:`.groups.WeightHistory`);
* a part whose L2 norm exceeds its sender's ticket ``norm`` claim (widened by the codec's error) bans the
  sender: an honest sender's part is a piece of the vector it measured;
* receivers check every averaged part they pull: finite, the announced layout, and an L2 norm within
  :func:`.groups.average_norm_bound` of the senders' claims. An invalid part fails the aggregator's whole
  slice for this member (it keeps its own values there, as for a dead aggregator), nothing more is pulled
  from it this round, and ``RoundResult.refused`` names it;
* once the whole slice is averaged, the aggregator signs a :class:`~protocols.receipts.PartReceipt` for
  every sender it averaged in (the weight it used, the encoded bytes it accepted) and returns it with each
  averaged part that sender pulls (``AveragedHeader.receipt``). The member verifies signature and fields
  (signer = the aggregator, sender = itself, this run, step, group and round, the averager's pipeline
  ``stage`` in a swarm run (None otherwise), weight at most its plan weight) and keeps it in
  ``RoundResult.receipts``; a bad receipt is logged and counted, never kept.

**Departures** (issue 10; seed 000 §3.2). A member that leaves mid-round must cost the others seconds,
not the round's deadline, and the round's result names it (``RoundResult.departed``) so the caller
retries at once without it (the optimizer retries under a new matchmaking key per attempt, on which the
departed member has no ticket):

* *from its connections*: a killed process's TCP connections are reset or closed by its kernel at once,
  and a dial to it is refused. So when an exchange with aggregator ``j`` fails with
  :class:`~shared.errors.PeerUnavailable` (refused, reset, closed), ``j`` has departed: its slice fails
  for us, and if our own slice still waits for parts of ``j`` we drop ``j`` from it at once (parts it
  delivered whole are kept); a sender whose connection breaks mid-part is dropped as well. Every member
  with a slice exchanges with every aggregator, so all of them see a departed aggregator within a round
  trip, and all drop it as a sender together;
* *from a stall*: a member that stops without closing anything (a hung process, a member whose round
  never started) is caught by the stall timeouts of :mod:`.deadlines`, derived from the plan's expected
  part time and the part times measured in this round: a sender of our slice with no part for ``T`` is
  dropped ("stalled"); an aggregator fails for this round when it acknowledges no push of ours for ``T``
  while we have parts to send (it acknowledges a part once read, waiting for nobody), or answers no pull
  for ``2 T`` (an average waits for every sender, a stalled one up to the aggregator's own ``T``).
  The plan's deadline still bounds the whole round (at 90 % of it, missing senders are dropped).

A member with no slice that dies before it pushed anything is only caught by the stall timeout (nobody
dials it); one that dies after its parts arrived costs nothing: the others average with its parts.

*Relayed slices: one outcome for every survivor.* An aggregator ``j`` that dies after it served its
averaged slice to some members but not to others would split the round: the served ones complete it and
step, the others fail slice ``j`` and retry among themselves, a one-step fork (seen in the 600-s churn
soak). So a member whose exchange with ``j`` ends because ``j`` departed (``PeerUnavailable`` or the
stall timeout; not a refused average) asks the *other members* for each part of ``j``'s slice it lacks,
before it fails the slice (``avg.relay``, a :class:`~protocols.averaging.RelayRequest`):

* *who answers*: every member keeps, for each round, the encoded averaged parts it received and
  verified (from the aggregator or through a relay) with their headers, and answers a relay request from a
  member of that round's plan at once: the part and the aggregator's header (its ``receipt`` stripped), or
  ``NOT_FOUND`` ("not held"; ``PENDING`` while its own pull of that slice runs, or while it is still
  matchmaking for a round of that number, :meth:`Averager.joining`), never waiting for anything. A
  separate kind, not a flag of ``avg.pull``: a pull waits for an average and counts towards the
  aggregator's duty (``pulls_left``), a relay waits for nothing, needs no duty and is served by members
  that aggregate nothing;
* *asking again*: a member still pulling ``j``'s slice itself (its own exchange with ``j`` not ended
  yet) answers ``PENDING`` instead of ``NOT_FOUND``: it may hold the part a moment later. While one
  does, the asker asks again (every 0.25 s) until ``2 T`` after it started asking (the pull stall
  timeout: by then the other's pull has either completed or failed); otherwise a member that got the
  part a moment after the others gave up would step with the full group while they retried among
  themselves (a fork, seen in the churn test when an aggregating backbone was killed mid-round).
  Likewise a member that has not started the round yet (it adopted the plan later than the asker, whose
  pull of a restarted backbone failed at once in its own dial back-off) answers ``PENDING`` while it is
  still matchmaking for that round number: it is about to pull the slice itself (seen in the churn
  test: the late member completed the round with the backbone's slice while the asker retried without it).
  ``NOT_FOUND`` is final: the member's pull from ``j`` ended without the part, or it does not know the
  round (a restarted process); asking it again would only stall the round (asking on every
  ``NOT_FOUND`` held a soak's survivors up to ``2 T`` per departed aggregator). A member that is itself
  asking others for ``j``'s parts answers ``NOT_FOUND``, so two askers never wait on each other;
* *how long*: from the round's start until its end plus a grace of ``3 T`` (``T`` the round's stall
  timeout at its end, :mod:`.deadlines`): a member that failed a pull asks once its pull failed, at the
  latest ``2 T`` after its previous pull completed (the pull stall timeout), and a relay answer takes a
  part time, well within ``T``. No constant: ``T`` derives from the plan's and the measured part times;
* *memory*: what is kept is the member's own buffer of ``j``'s slice (codec none: the array the payload
  was read into; other codecs: the encoded bytes it was read into), no copy. It is dropped once the
  grace has passed at the next averaging event (a round started, a push, a pull or a relay request
  reaching this host, or :meth:`Averager.release_expired`, which the volunteer calls whenever it polls
  for its next round), or when a member starts a round while it holds :data:`MAX_HELD_ROUNDS` (2: the
  one it runs and the previous one): so a member holds at most one vector beyond its round's own
  buffers (measured with ``scripts/bench_allreduce.py --numel 5000000``, rounds back to back: peak RSS
  +26 to +37 MB per peer with 2 kept rounds, +45 to +60 MB with 4);
* *whom to ask, when*: the parts in order, for each part the members in the plan's order (not ``j``, not
  ourselves, not client-mode members, which accept no connections), one at a time, each bounded by the
  pull stall timeout ``2 T``; the first valid answer wins. "Not held" costs a round trip; an unreachable
  member or one that answered with a forgery is not asked again this round;
* *trust*: the relaying member may lie, so the aggregator signs each averaged part it produces: the
  header's ``signature`` covers the run id, global step, group, round (what a receipt binds), the part's
  index, offset, ``numel``, codec and ``nbytes``, ``total_weight`` and ``contributors``, and the
  SHA-256 digest of the encoded payload (:class:`~protocols.averaging.AveragedStatement`; signed once
  per part when it is reduced, the digest hashed once). A member verifies, for every part, whoever sent
  it: the header's fields against the request, the signature against ``j``'s peer id over the statement
  it rebuilds with the run, step and aggregator *it expects*, then the payload's digest before decoding,
  then the usual checks (finite, norm bound). A relayed part is thus exactly a part ``j`` produced for
  this round, so a forgery is refused (``statistics().relays_refused``), and the relaying member is not
  asked again this round; the next member is asked. A liar can only withhold (answer "not held"), which
  costs what ``j``'s death cost before, or answer ``PENDING`` for ever, which holds the askers until
  ``2 T`` after they started asking (what a hung aggregator costs them) and no longer;
* *outcome*: if any live member holds all parts of ``j``'s slice, every member that asks gets them, and
  every survivor ends with the same vector (bit-identical, as from ``j`` itself). If a part reached
  nobody alive, every survivor fails slice ``j`` and the round, as before, and they retry together.
  Client-mode members cannot relay: a part only they hold is not recoverable by the others. What is
  left: a member asked while the part is still in its hands but not verified yet (the milliseconds of
  its digest and norm check, when ``j`` died mid-reply to both) answers "not held", and the round still
  splits as before this rule; and the grace assumes the members' stall timeouts ``T`` differ by less
  than a third (all derive from the same plan, with the 3 s floor in common);
* *credit*: a relayed part carries no receipt for the puller (``j`` signed receipts per sender and gave
  them only to their senders), and its bytes are not a pull record of ``j`` (``RoundResult.pulled``): the
  puller lacks that evidence, less credit, never false credit. ``RoundResult.relayed`` counts the parts
  each aggregator's slice took through relays; ``j`` is still named in ``RoundResult.departed``.

Fault points (:mod:`shared.faults`): ``allreduce.after_push`` (once per round, when all our parts went
out), ``allreduce.after_serve`` (an averaged part of our slice was written to a member's connection, or
writing it failed; it runs in the host's bulk lane, outside any member's scope tag: arm it process-wide
with ``kill`` or ``exit``, e.g. ``DEDLOC_FAULTS=allreduce.after_serve=kill@2`` in a child process)
and ``allreduce.before_result`` (every exchange ended, before the averages are
written back).

Blocking numpy work (decoding, the reduction, checks, writing back) runs in worker threads (``COMPUTE``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import numpy.typing as npt
import trio

from protocols.averaging import (
    AveragedHeader,
    AveragedStatement,
    CodecName,
    PartHeader,
    PullRequest,
    RelayRequest,
    averaged_payload,
    decode_averaged_header,
    decode_part_header,
    decode_pull_request,
    decode_relay_request,
    encode_header,
    encoded_nbytes,
    part_digest,
    statement_of,
)
from protocols.bulk import BulkHeader
from protocols.codes import ErrorCode
from protocols.errors import ProtocolError
from protocols.peer_id import PeerId
from protocols.receipts import PartReceipt, SignedReceipt, decode_receipt, receipt_payload, sign_receipt
from protocols.training import AveragingSpec

from .. import faults
from ..auth.keys import verify_by_peer_id
from ..errors import PeerUnavailable, ProjectError, RemoteError
from ..net.addresses import PeerAddress
from ..net.bulk import BulkReader, BulkReply
from ..net.host import CALL_FAILURES, Host
from ..net.rpc import RequestContext
from .compression import codec_by_name
from .deadlines import PartTimes, expected_part_seconds
from .groups import WeightHistory, average_norm_bound, codec_norm_slack, lower_median
from .pacing import PushGate
from .partition import Slice, auto_part_numel, make_slices, num_parts, part_bounds
from .reducer import Completeness, NothingToAverage, PartRejected, RoundOutcome, SliceReducer, apply_outcome

__all__ = ["COMPUTE", "AveragerStatistics", "Averager", "BadAverage", "GroupPlan", "Member", "RoundResult"]

logger = logging.getLogger(__name__)
DEFAULT_AVERAGING = AveragingSpec()
Float32Array = npt.NDArray[np.float32]
#: Worker threads for decoding, reducing and writing back (numpy releases the GIL).
COMPUTE = trio.CapacityLimiter(2)
PUSH, PULL, RELAY = "avg.push", "avg.pull", "avg.relay"
#: Rounds whose received averaged parts a member keeps for relaying at once (module docstring, "Relayed
#: slices"): the one it runs and the one before, whose slower members may still ask during its grace.
MAX_HELD_ROUNDS = 2
#: The relay grace after a round's end, in stall timeouts T (a failed pull is noticed <= 2 T after the
#: previous one completed, a relay answer takes about a part time < T).
RELAY_GRACE_TIMEOUTS = 3.0
#: How long a push or pull for a round this node has not started yet waits for it to start.
EARLY_ARRIVAL_WAIT = 10.0
MAX_PENDING_ROUNDS = 64
#: Early pushes/pulls one peer may have waiting at once (for rounds this node has not started): without
#: it, one peer naming 64 made-up rounds every 10 s would fill MAX_PENDING_ROUNDS for everyone.
MAX_EARLY_PER_PEER = 4


@dataclass(frozen=True)
class Member:
    peer_id: PeerId
    address: PeerAddress | None  # None: accepts no connections (then it must own no slice)
    weight: float  # samples behind its gradient this round; 0 for auxiliary peers
    norm: float = math.inf  # L2 norm of its whole vector, as its ticket claims (inf: not claimed)
    overflow: bool = False  # its fp16 gradient overflowed (it sends nothing; volunteer.precision)
    aux: bool = False  # an auxiliary aggregator: weight 0 and it pulls no other slice (module docstring)


@dataclass(frozen=True)
class GroupPlan:
    group_id: bytes
    round: int
    members: tuple[Member, ...]
    slice_sizes: tuple[int, ...]  # per member, summing to the vector's length
    deadline: float  # seconds for the whole round, from its start
    codec: CodecName = "none"
    part_numel: int = 0  # elements per part; 0: chosen from the slice sizes (auto_part_numel)
    max_norm: float = math.inf  # largest L2 norm of one part an aggregator accepts
    #: the LP's predicted averaging seconds (0: unknown), the base of the stall timeouts (.deadlines)
    predicted_seconds: float = 0.0
    #: how aggregators combine the parts (norm bound, robust rule): each aggregator's *own* run manifest,
    #: never a field of the plan it received, so the plan's writer cannot switch the defences off
    averaging: AveragingSpec = DEFAULT_AVERAGING

    def __post_init__(self) -> None:
        if len(self.members) != len(self.slice_sizes) or not self.members:
            raise ValueError("a plan needs one slice size per member and at least one member")
        if any(size < 0 for size in self.slice_sizes):
            raise ValueError(f"negative slice size in {self.slice_sizes}")
        for member, size in zip(self.members, self.slice_sizes, strict=True):
            if size and member.address is None:
                raise ValueError(f"{member.peer_id} accepts no connections but owns a slice")
        if not self.deadline > 0:
            raise ValueError(f"deadline must be positive, got {self.deadline}")
        if self.part_numel < 0:
            raise ValueError(f"part_numel must be >= 0, got {self.part_numel}")
        if self.part_numel == 0:  # every member derives the same value from the same plan
            object.__setattr__(self, "part_numel", auto_part_numel(self.slice_sizes))

    @property
    def numel(self) -> int:
        return sum(self.slice_sizes)

    def average_bound(self, numel: int) -> float:
        """Largest L2 norm an honest aggregator can return for a part of ``numel`` elements."""
        return average_norm_bound([m.norm for m in self.members if m.weight > 0], self.codec, numel)


@dataclass(frozen=True)
class RoundResult:
    outcome: RoundOutcome  # which ranges were averaged; un-averaged ones kept local values
    completeness: dict[int, Completeness]  # per aggregator index whose slice was averaged
    seconds: float
    #: verified receipts for our parts, (aggregator, receipt), one per aggregator that gave one
    receipts: tuple[tuple[PeerId, SignedReceipt], ...] = ()
    #: encoded averaged bytes we pulled, (aggregator, bytes), per aggregator whose slice we applied
    pulled: tuple[tuple[PeerId, int], ...] = ()
    #: aggregators whose averaged values we refused (index -> why); their slices stayed local
    refused: dict[int, str] = field(default_factory=dict)
    #: members that left this round (unreachable, connection lost, or stalled: peer -> why); the caller
    #: retries without them (module docstring, "Departures")
    departed: dict[PeerId, str] = field(default_factory=dict)
    #: aggregator -> parts of its slice we got from other members because it departed ("Relayed slices")
    relayed: dict[PeerId, int] = field(default_factory=dict)


@dataclass
class AveragerStatistics:
    part_bytes_read: int = 0  # payload bytes of gradient parts read into buffers (aggregator side)
    parts_refused: int = 0  # parts refused from their headers, before any payload byte was read
    averages_refused: int = 0  # averaged parts refused by us as a receiver (NaN, too large, bad layout)
    receipts_issued: int = 0
    receipts_invalid: int = 0  # receipts we got that failed verification (dropped)
    relays_served: int = 0  # averaged parts of other aggregators we served to members that lacked them
    relays_received: int = 0  # averaged parts we got from a member, not from their departed aggregator
    relays_refused: int = 0  # relayed parts refused (bad signature, digest, layout or values)


class BadAverage(ProjectError):
    """An aggregator returned an averaged part that no honest aggregator could have produced."""


class _Stalled(ProjectError):
    """No push or pull with an aggregator completed within the stall timeout (module docstring)."""


@dataclass
class _Exchange:
    """The stall clock of our exchange with one remote aggregator."""

    scope: trio.CancelScope
    pushed: float  # when our last push to it completed (or the exchange began)
    pulled: float  # when our last pull from it completed (or the exchange began)
    pushing: bool  # pushes remain
    paced: bool = False  # our next push to it waits at the round's PushGate (.pacing): no push clock


@dataclass
class _Watch:
    """One round's stall timeouts (module docstring, "Departures"; :mod:`.deadlines`): the part times
    measured so far, and the cancel scope of each exchange with a remote aggregator, whose deadline is
    ``T`` after our last completed push while pushes remain (an aggregator acknowledges a part once it
    read it, waiting for nobody), and ``2 T`` after our last completed pull (an average waits for every
    sender: for a stalled one, up to the aggregator's own ``T``)."""

    times: PartTimes
    exchanges: dict[int, _Exchange] = field(default_factory=dict)

    def open(self, j: int, scope: trio.CancelScope, since: float, pushing: bool) -> None:
        self.exchanges[j] = _Exchange(scope, since, since, pushing)
        self.refresh()

    def pushed(self, j: int) -> None:
        """A push of a part to aggregator ``j`` completed."""
        exchange, now = self.exchanges[j], trio.current_time()
        self.times.observe(exchange.pushed, now)
        exchange.pushed = now
        self.refresh()

    def pushes_done(self, j: int) -> None:
        self.exchanges[j].pushing = False
        self.refresh()

    def paced(self, j: int) -> None:
        """Our next push to ``j`` waits for our pushes to the others (:mod:`.pacing`): not a stall."""
        self.exchanges[j].paced = True
        self.refresh()

    def unpaced(self, j: int) -> None:
        """Our next push to ``j`` starts now: its push clock restarts."""
        exchange = self.exchanges[j]
        exchange.paced, exchange.pushed = False, trio.current_time()
        self.refresh()

    def pulled(self, j: int) -> None:
        """A pull of an averaged part from aggregator ``j`` completed."""
        exchange, now = self.exchanges[j], trio.current_time()
        self.times.observe(exchange.pulled, now)
        exchange.pulled = now
        self.refresh()

    def refresh(self) -> None:
        limit = self.times.timeout()
        for e in self.exchanges.values():
            pushing = e.pushing and not e.paced
            e.scope.deadline = min(e.pushed + limit if pushing else math.inf, e.pulled + 2 * limit)


@dataclass
class _Part:
    """One part of the slice this node aggregates: reduced and served as soon as its senders delivered."""

    reducer: SliceReducer
    lo: int  # element range within the slice
    hi: int
    done: trio.Event = field(default_factory=trio.Event)
    finalizing: bool = False
    averaged: Float32Array | None = None
    encoded: bytes | memoryview | None = None  # a view of ``averaged`` for codec none
    error: str | None = None
    # fixed once reduced: what the signed header states (module docstring, "Relayed slices")
    total_weight: float = 0.0
    contributors: int = 0
    digest: bytes = b""
    signature: bytes = b""


@dataclass
class _Aggregation:
    """This node's duty as aggregator of one slice in one round: one reducer per part, so averaged parts
    flow back while later parts are still arriving. A sender banned (or lost) on any part is excluded
    from every part not yet reduced; parts already reduced keep its earlier, valid contributions."""

    plan: GroupPlan
    slice: Slice
    parts: list[_Part]
    me: PeerId
    step: int
    weights: dict[PeerId, float]  # senders and the weight this aggregator uses for each
    expires_at: float = math.inf  # set when the local round ends: serve pulls until the round's deadline
    pulls_left: int = 0  # parts the other members have yet to fetch; at 0 the duty is dropped at once
    excluded: dict[PeerId, str] = field(default_factory=dict)
    accepted_bytes: dict[PeerId, int] = field(default_factory=dict)
    served: set[tuple[PeerId, int]] = field(default_factory=set)  # (member, part) pulls answered
    receipts: dict[PeerId, SignedReceipt] | None = None  # once the whole slice is averaged
    watch: _Watch | None = None  # the local round's stall timeouts, while it runs
    last_part: dict[PeerId, float] = field(default_factory=dict)  # sender -> when its last part arrived
    departed: dict[PeerId, str] = field(default_factory=dict)  # senders dropped for leaving, and why

    def depart(self, peer: PeerId, reason: str) -> bool:
        """Drop ``peer`` for having left the round, if we still wait for any part of it; True if so."""
        if not any(peer in part.reducer.missing() for part in self.parts if not part.finalizing):
            return False
        self.departed.setdefault(peer, reason)
        self.exclude(peer, reason)
        return True

    def part_arrived(self, peer: PeerId) -> None:
        now = trio.current_time()
        if self.watch is not None:
            self.watch.times.observe(self.last_part.get(peer, now), now)
            self.watch.refresh()
        self.last_part[peer] = now

    def exclude(self, peer: PeerId, reason: str) -> None:
        self.excluded.setdefault(peer, reason)
        for part in self.parts:
            if not part.finalizing:
                with contextlib.suppress(ValueError):  # weight-0 members are not senders
                    part.reducer.drop_sender(peer, reason)

    def completeness(self) -> Completeness:
        """Who made it into every part (and who was dropped or banned anywhere, with why)."""
        reports = [p.reducer.completeness() for p in self.parts]
        contributors = set(reports[0].contributors).intersection(*(r.contributors for r in reports[1:]))
        banned = {peer: reason for r in reports for peer, reason in r.banned}
        dropped = {peer: why for r in reports for peer, why in r.dropped if peer not in banned}
        incomplete = (
            {peer for r in reports for peer in r.incomplete} - contributors - banned.keys() - dropped.keys()
        )
        return Completeness(
            contributors=tuple(sorted(contributors)),
            total_weight=min(r.total_weight for r in reports),
            incomplete=tuple(sorted(incomplete)),
            dropped=tuple(sorted(dropped.items())),
            banned=tuple(sorted(banned.items())),
        )


@dataclass
class _Held:
    """The averaged parts a member received in one round, kept to relay them (module docstring,
    "Relayed slices"): ``(aggregator index, part index) -> (encoded header, encoded payload)``; the payload
    is a view of the member's own buffer, never a copy."""

    members: frozenset[PeerId]
    parts: dict[tuple[int, int], tuple[bytes, memoryview]] = field(default_factory=dict)
    pulling: set[int] = field(default_factory=set)  # aggregators whose slice we are still pulling
    expires_at: float = math.inf  # set when the local round ends


class Averager:
    """Runs all-reduce rounds for this node and serves its aggregator duties (one per host)."""

    def __init__(self, host: Host, *, stage: int | None = None) -> None:
        self.host = host
        #: the swarm run's pipeline stage whose collaboration this averager's rounds belong to (None: a
        #: data-parallel run): stated in the receipts we sign and expected in those we get
        self.stage = stage
        self.history = WeightHistory()
        self.stats = AveragerStatistics()
        self._duties: dict[tuple[bytes, int], _Aggregation] = {}
        self._started: dict[tuple[bytes, int], trio.Event] = {}
        self._early: dict[str, int] = {}  # peer -> its requests waiting for a round to start
        self._held: dict[tuple[bytes, int], _Held] = {}
        self._joining: Counter[int] = Counter()  # rounds we are matchmaking for, not started yet
        host.bulk_handlers[PUSH] = self._on_push
        host.bulk_handlers[PULL] = self._on_pull
        host.bulk_handlers[RELAY] = self._on_relay

    def statistics(self) -> AveragerStatistics:
        return AveragerStatistics(**vars(self.stats))

    @contextlib.contextmanager
    def joining(self, round_: int) -> Iterator[None]:
        """While this is open we are matchmaking for ``round_`` (or about to start it): a relay request for
        a round of that number we have not started is answered ``PENDING``, not ``NOT_FOUND`` (module
        docstring, "Relayed slices": a member that adopted the plan later than the asker)."""
        self._joining[round_] += 1
        try:
            yield
        finally:
            self._joining[round_] -= 1
            if self._joining[round_] <= 0:
                del self._joining[round_]

    # ---------------------------------------------------------------- member side

    async def all_reduce(
        self, plan: GroupPlan, vector: Float32Array, me: int, *, step: int | None = None
    ) -> RoundResult:
        """Average ``vector`` (1-D float32, modified in place) with the group; see the module docstring.

        Args:
            step: the global step this round averages for, stated in the receipts we sign and expected in
                those we get (default: the plan's round).

        Raises:
            ValueError: ``vector`` does not fit the plan, or ``me`` is not this host's index.
        """
        if vector.dtype != np.float32 or vector.ndim != 1 or vector.size != plan.numel:
            raise ValueError(f"vector must be 1-D float32 of {plan.numel} elements")
        if plan.members[me].peer_id != self.host.peer_id:
            raise ValueError(f"member {me} of the plan is not this host")
        started = trio.current_time()
        key = (plan.group_id, plan.round)
        self._forget_expired(started)
        step = plan.round if step is None else step
        slices = make_slices(plan.slice_sizes)
        duty = self._take_duty(plan, slices[me], me, step) if slices[me].numel else None
        averaged: dict[int, Float32Array] = {}
        failed: dict[int, str] = {}
        # an auxiliary aggregator needs no average but its own (module docstring, "Auxiliary members")
        skipped = {
            j: "not pulled: an auxiliary member needs no other slice"
            for j, s in enumerate(slices)
            if plan.members[me].aux and j != me and s.numel
        }
        expected = expected_part_seconds(plan.predicted_seconds, plan.part_numel, plan.slice_sizes)
        got = _Got(step, _Watch(PartTimes(expected, plan.deadline)))
        targets = [j for j, s in enumerate(slices) if j != me and s.numel and plan.members[me].weight > 0]
        got.pushes_left = len(targets)
        # a laggard holds our other pushes for half the stall timeout at most (.pacing, "A laggard")
        got.gate = PushGate(
            {j: num_parts(slices[j].numel, plan.part_numel) for j in targets},
            hold=lambda: got.watch.times.timeout() / 2,
        )
        if duty is not None:
            duty.watch = got.watch
        held = got.held = self._hold_round(plan, started)
        # every slice we will pull counts as being pulled from now on (relays answer PENDING), not only
        # once its exchange task runs: under load that can be a while after a member asks
        held.pulling.update(j for j, s in enumerate(slices) if s.numel and j != me and j not in skipped)
        try:
            if not got.pushes_left:
                await faults.point("allreduce.after_push")
            with trio.move_on_after(plan.deadline):
                async with trio.open_nursery() as watchdog:
                    if duty is not None:
                        watchdog.start_soon(self._watch_senders, duty, started, started + plan.deadline)
                    async with trio.open_nursery() as nursery:
                        for j, slice_j in enumerate(slices):
                            if j in skipped:
                                continue
                            if slice_j.numel:
                                nursery.start_soon(
                                    self._exchange, plan, me, j, slice_j, vector, averaged, failed, got
                                )
                            else:
                                averaged[j] = np.empty(0, dtype=np.float32)
                    watchdog.cancel_scope.cancel()  # every exchange ended, our own slice included
            for j, slice_j in enumerate(slices):
                if slice_j.numel and j not in averaged and j not in skipped:
                    failed.setdefault(j, "deadline passed")
            await faults.point("allreduce.before_result")
            outcome = RoundOutcome.of(slices, {**failed, **skipped})
            await trio.to_thread.run_sync(apply_outcome, vector, averaged, outcome, limiter=COMPUTE)
        finally:
            held.expires_at = trio.current_time() + RELAY_GRACE_TIMEOUTS * got.watch.times.timeout()
            if duty is not None and duty.pulls_left > 0:  # keep serving slower members until the deadline
                duty.expires_at = started + plan.deadline
            else:
                self._duties.pop(key, None)
                self._started.pop(key, None)
        for j, reason in failed.items():
            logger.warning(
                "round %d: slice of %s not averaged: %s", plan.round, plan.members[j].peer_id, reason
            )
        departed = dict(got.departed)
        if duty is not None:
            departed.update((peer, why) for peer, why in duty.departed.items() if peer not in departed)
        if departed:
            logger.warning(
                "round %d: %d member(s) left: %s",
                plan.round,
                len(departed),
                "; ".join(f"{peer}: {why}" for peer, why in sorted(departed.items())),
            )
        completeness = {j: c for j, c in self._completeness(plan, duty, me).items() if j in averaged}
        if duty is not None and duty.receipts and me in averaged and (own := duty.receipts.get(duty.me)):
            got.receipts[me] = own
        return RoundResult(
            outcome,
            completeness,
            trio.current_time() - started,
            receipts=tuple((plan.members[j].peer_id, r) for j, r in sorted(got.receipts.items())),
            pulled=tuple(
                (plan.members[j].peer_id, n) for j, n in sorted(got.pulled.items()) if j in averaged
            ),
            refused=dict(got.refused),
            departed=departed,
            relayed={plan.members[j].peer_id: n for j, n in sorted(got.relayed.items()) if j in averaged},
        )

    def _hold_round(self, plan: GroupPlan, now: float) -> _Held:
        """Start keeping this round's received parts for relaying (dropping expired and surplus rounds)."""
        for key, held in list(self._held.items()):
            if held.expires_at <= now:
                del self._held[key]
        while len(self._held) >= MAX_HELD_ROUNDS:
            del self._held[next(iter(self._held))]  # the oldest
        held = _Held(frozenset(m.peer_id for m in plan.members))
        self._held[(plan.group_id, plan.round)] = held
        return held

    def _completeness(self, plan: GroupPlan, duty: _Aggregation | None, me: int) -> dict[int, Completeness]:
        if duty is None or any(part.error for part in duty.parts):
            return {}
        return {me: duty.completeness()}

    def _take_duty(self, plan: GroupPlan, slice_: Slice, me: int, step: int) -> _Aggregation:
        now = trio.current_time()
        floor = lower_median(m.weight for m in plan.members if m.weight > 0)
        own = plan.members[me].peer_id
        senders = {
            m.peer_id: m.weight if m.peer_id == own else self.history.bound(m.peer_id, m.weight, now, floor)
            for m in plan.members
            if m.weight > 0
        }
        for peer, weight in senders.items():
            claimed = next(m.weight for m in plan.members if m.peer_id == peer)
            if weight < claimed:
                logger.info(
                    "round %d: %s weighs %g, not %g: its earlier rounds here support no more",
                    plan.round,
                    peer,
                    weight,
                    claimed,
                )
        parts = []
        for k in range(num_parts(slice_.numel, plan.part_numel)):
            lo, hi = part_bounds(slice_.numel, plan.part_numel, k)
            parts.append(
                _Part(
                    SliceReducer(
                        hi - lo, senders, plan.max_norm, part_numel=max(1, hi - lo), rule=plan.averaging
                    ),
                    lo,
                    hi,
                )
            )
        duty = _Aggregation(plan, slice_, parts, own, step, senders, last_part={p: now for p in senders})
        pullers = sum(1 for i, m in enumerate(plan.members) if i != me and not m.aux)  # aux: pulls nothing
        duty.pulls_left = pullers * num_parts(slice_.numel, plan.part_numel)
        key = (plan.group_id, plan.round)
        self._duties[key] = duty
        self._started.setdefault(key, trio.Event()).set()
        return duty

    async def _exchange(
        self,
        plan: GroupPlan,
        me: int,
        j: int,
        slice_j: Slice,
        vector: Float32Array,
        averaged: dict[int, Float32Array],
        failed: dict[int, str],
        got: _Got,
    ) -> None:
        local = vector[slice_j.start : slice_j.stop]
        weight = plan.members[me].weight
        result = np.empty(slice_j.numel if j != me else 0, dtype=np.float32)
        have: set[int] = set()  # parts of j's slice received and verified
        try:
            if j == me:
                duty = self._duties[(plan.group_id, plan.round)]
                if weight > 0:
                    for k, part in enumerate(duty.parts):
                        header = _part_header(plan, 0, 0, part.hi - part.lo, weight)
                        part.reducer.add_part(self.host.peer_id, header, local[part.lo : part.hi])
                        duty.accepted_bytes[duty.me] = duty.accepted_bytes.get(duty.me, 0) + header.nbytes
                        await self._maybe_finalize(duty, k)
                result = np.empty(slice_j.numel, dtype=np.float32)
                for part in duty.parts:
                    await part.done.wait()
                    if part.averaged is None:
                        raise NothingToAverage(part.reducer.completeness())
                    result[part.lo : part.hi] = part.averaged
                averaged[j] = result
                return
            address = plan.members[j].address
            assert address is not None  # checked by GroupPlan
            errors: list[Exception] = []
            watch = got.watch

            async def guarded(work: Callable[[], Awaitable[None]], scope: trio.CancelScope) -> None:
                try:
                    await work()
                except (*CALL_FAILURES, NothingToAverage, PartRejected, BadAverage) as exc:
                    errors.append(exc)
                    scope.cancel()

            async def pull_all() -> None:
                pulling = got.held.pulling if got.held is not None else set()
                pulling.add(j)  # relay requests for j's parts are answered PENDING meanwhile
                try:
                    for k in range(num_parts(slice_j.numel, plan.part_numel)):
                        await self._pull_part(address, plan, me, j, k, slice_j, result, got)
                        have.add(k)
                        watch.pulled(j)
                finally:
                    pulling.discard(j)

            async def push_all() -> None:
                try:
                    await self._push_slice(address, plan, j, slice_j, local, weight, got)
                finally:
                    got.gate.leave(j)
                watch.pushes_done(j)
                got.pushes_left -= 1
                if not got.pushes_left:
                    await faults.point("allreduce.after_push")

            # Pushing and pulling run side by side (on separate pooled connections): part k comes back
            # as soon as every sender delivered it, while our later parts are still going out. Both end
            # when no push or pull completes within the stall timeout (module docstring, "Departures").
            with trio.CancelScope() as stall:
                watch.open(j, stall, trio.current_time(), pushing=weight > 0)
                async with trio.open_nursery() as both:
                    if weight > 0:
                        both.start_soon(guarded, push_all, both.cancel_scope)
                    both.start_soon(guarded, pull_all, both.cancel_scope)
            watch.exchanges.pop(j, None)
            limit = watch.times.timeout()
            if stall.cancelled_caught:
                raise _Stalled(f"stalled: no push within {limit:.1f} s or pull within {2 * limit:.1f} s")
            if errors:
                raise errors[0]
            averaged[j] = result
        except BadAverage as exc:
            if got.held is not None:
                got.held.pulling.discard(j)
            self.stats.averages_refused += 1
            got.refused[j] = failed[j] = f"refused its average: {exc}"
            got.receipts.pop(j, None)
        except (*CALL_FAILURES, NothingToAverage, PartRejected, _Stalled) as exc:
            if got.held is not None:  # from now on a final "not held" for anyone asking us (docstring)
                got.held.pulling.discard(j)
            reason = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, PeerUnavailable | _Stalled):
                await self._departed(plan, j, reason, got)
                if j != me and await self._relay_slice(plan, me, j, slice_j, result, have, got):
                    logger.info(
                        "round %d: %s left (%s); its slice came through other members (%d parts)",
                        plan.round,
                        plan.members[j].peer_id,
                        reason,
                        got.relayed.get(j, 0),
                    )
                    averaged[j] = result
                    return
            failed[j] = reason

    async def _departed(self, plan: GroupPlan, j: int, reason: str, got: _Got) -> None:
        """Aggregator ``j`` left the round: remember it, and stop waiting for its parts of our slice."""
        peer = plan.members[j].peer_id
        got.departed.setdefault(peer, reason)
        duty = self._duties.get((plan.group_id, plan.round))
        if duty is not None and duty.depart(peer, reason):
            await self._finalize_ready(duty)

    async def _push_slice(
        self,
        address: PeerAddress,
        plan: GroupPlan,
        j: int,
        slice_j: Slice,
        local: Float32Array,
        weight: float,
        got: _Got,
    ) -> None:
        """Send our copy of aggregator ``j``'s slice, each part when the round's :class:`.PushGate` lets
        it go. A refused part is logged, not fatal: we still pull the average (made without us), so every
        member ends with the same values."""
        codec = codec_by_name(plan.codec)
        for k in range(num_parts(slice_j.numel, plan.part_numel)):
            if not got.gate.ready(j, k):
                got.watch.paced(j)
                await got.gate.wait(j, k)
                got.watch.unpaced(j)
            lo, hi = part_bounds(slice_j.numel, plan.part_numel, k)
            view = local[lo:hi]
            data = (
                view.data.cast("B")
                if plan.codec == "none"
                else await trio.to_thread.run_sync(codec.encode, view, limiter=COMPUTE)
            )
            meta = encode_header(_part_header(plan, k, lo, hi, weight))
            try:
                await self.host.send_bulk(address, PUSH, data, meta)
            except RemoteError as exc:
                if exc.code != ErrorCode.BAD_REQUEST:
                    raise
                logger.warning("round %d: our part %d was refused: %s", plan.round, k, exc)
                return
            got.watch.pushed(j)
            got.gate.completed(j)

    async def _pull_part(
        self,
        address: PeerAddress,
        plan: GroupPlan,
        me: int,
        j: int,
        k: int,
        slice_j: Slice,
        result: Float32Array,
        got: _Got,
    ) -> None:
        request = encode_header(PullRequest(group_id=plan.group_id, round=plan.round, part_index=k))
        header = await self._fetch_part(address, PULL, request, plan, j, k, slice_j, result, got)
        got.pulled[j] = got.pulled.get(j, 0) + header.nbytes
        if header.receipt is not None and plan.members[me].weight > 0:
            try:
                got.receipts[j] = self._verify_receipt(plan, me, j, got.step, header.receipt)
            except ProtocolError as exc:
                self.stats.receipts_invalid += 1
                logger.warning("round %d: dropping a bad receipt from %s: %s", plan.round, address, exc)

    async def _fetch_part(
        self,
        address: PeerAddress,
        kind: str,
        request: bytes,
        plan: GroupPlan,
        j: int,
        k: int,
        slice_j: Slice,
        result: Float32Array,
        got: _Got,
    ) -> AveragedHeader:
        """Get part ``k`` of aggregator ``j``'s averaged slice from ``address`` (``j`` itself, or a member
        relaying it) into ``result``, verified as the module docstring says ("Strangers", "Relayed
        slices"), and keep it for relaying; returns its header.

        Raises:
            BadAverage: anything that ``j`` could not have produced for this round and part.
        """
        lo, hi = part_bounds(slice_j.numel, plan.part_numel, k)
        raw = bytearray(codec_by_name(plan.codec).encoded_size(hi - lo)) if plan.codec != "none" else None
        target = memoryview(raw) if raw is not None else result[lo:hi].data.cast("B")
        aggregator = plan.members[j].peer_id
        headers: list[AveragedHeader] = []

        def sink(meta: bytes, nbytes: int) -> memoryview:
            header = decode_averaged_header(meta)
            if (header.group_id, header.round) != (plan.group_id, plan.round) or (
                header.part_index,
                header.offset,
                header.numel,
                header.codec,
            ) != (k, lo, hi - lo, plan.codec):
                raise BadAverage(f"averaged part {header.part_index} does not match the request for part {k}")
            if nbytes != target.nbytes:
                raise BadAverage(f"averaged part of {nbytes} bytes, expected {target.nbytes}")
            statement = statement_of(header, run_id=self.host.run_id, aggregator=aggregator, step=got.step)
            if not verify_by_peer_id(aggregator, header.signature, averaged_payload(statement)):
                raise BadAverage("the aggregator's signature does not cover this part of this round")
            headers.append(header)
            return target

        try:
            await self.host.send_bulk(address, kind, b"", request, sink=sink)
        except ProtocolError as exc:  # a reply that broke the wire rules: as bad as a bad average
            raise BadAverage(str(exc)) from exc
        if not headers:  # cannot happen: a reply without a header is a ProtocolError
            raise BadAverage("no averaged header")
        header = headers[0]
        bound = plan.average_bound(hi - lo)
        out = result[lo:hi]

        def check() -> None:
            if part_digest(target) != header.digest:  # before decoding a byte of it
                raise BadAverage("the payload does not match the digest the aggregator signed")
            if raw is not None:
                codec_by_name(plan.codec).decode(bytes(raw), hi - lo, out=out)
            _check_average(out, bound)

        await trio.to_thread.run_sync(check, limiter=COMPUTE)
        if got.held is not None:
            kept = msgspec.structs.replace(header, receipt=None) if header.receipt is not None else header
            got.held.parts[(j, k)] = (encode_header(kept), target)
        return header

    async def _relay_slice(
        self,
        plan: GroupPlan,
        me: int,
        j: int,
        slice_j: Slice,
        result: Float32Array,
        have: set[int],
        got: _Got,
    ) -> bool:
        """Aggregator ``j`` departed: get the parts of its slice we lack from the other members (module
        docstring, "Relayed slices"). True when every part is here, verified."""
        limit = 2 * got.watch.times.timeout()
        # A member that answers PENDING is still pulling from j (its pull fails at most 2 T after its
        # last progress): ask again until then, or a member that gets it later steps alone (a fork, seen
        # in the churn test when an aggregating backbone was killed mid-round). "Not held" is final.
        deadline = trio.current_time() + limit
        for k in range(num_parts(slice_j.numel, plan.part_numel)):
            while k not in have:
                pending = await self._relay_part(plan, me, j, k, slice_j, result, have, got, limit)
                if k in have:
                    break
                if not pending or trio.current_time() >= deadline:
                    return False  # nobody alive holds part k: the slice fails for us, as for the others
                await trio.sleep(min(0.25, max(0.0, deadline - trio.current_time())))
        return True

    async def _relay_part(
        self,
        plan: GroupPlan,
        me: int,
        j: int,
        k: int,
        slice_j: Slice,
        result: Float32Array,
        have: set[int],
        got: _Got,
        limit: float,
    ) -> bool:
        """Ask each other member once for part ``k`` of departed ``j``'s slice (added to ``have`` when one
        relays it); True if some member answered ``PENDING`` (still pulling ``j``'s slice itself)."""
        pending = False
        request = encode_header(
            RelayRequest(group_id=plan.group_id, round=plan.round, aggregator=j, part_index=k)
        )
        for i, member in enumerate(plan.members):
            if i in (j, me) or member.address is None or member.aux or member.peer_id in got.not_asked:
                continue
            try:
                with trio.fail_after(limit):
                    await self._fetch_part(member.address, RELAY, request, plan, j, k, slice_j, result, got)
            except BadAverage as exc:
                self.stats.relays_refused += 1
                got.not_asked.add(member.peer_id)
                logger.warning(
                    "round %d: refused part %d of %s relayed by %s: %s",
                    plan.round,
                    k,
                    plan.members[j].peer_id,
                    member.peer_id,
                    exc,
                )
                continue
            except CALL_FAILURES as exc:
                if isinstance(exc, RemoteError) and exc.code == ErrorCode.PENDING:
                    pending = True  # it is still pulling from j: it may hold the part in a moment
                elif not (isinstance(exc, RemoteError) and exc.code == ErrorCode.NOT_FOUND):
                    got.not_asked.add(member.peer_id)  # unreachable or broken: not again this round
                continue
            self.stats.relays_received += 1
            got.relayed[j] = got.relayed.get(j, 0) + 1
            have.add(k)
            break
        return pending

    def _verify_receipt(
        self, plan: GroupPlan, me: int, j: int, step: int, signed: SignedReceipt
    ) -> SignedReceipt:
        """The receipt if it is aggregator ``j``'s signed statement about our parts in this round.

        Raises:
            ProtocolError: bad signature, malformed, or a field that does not match.
        """
        aggregator = plan.members[j].peer_id
        if not verify_by_peer_id(aggregator, signed.signature, receipt_payload(signed.receipt)):
            raise ProtocolError("receipt signature does not verify against the aggregator")
        receipt = decode_receipt(signed.receipt)
        expected = (
            self.host.run_id,
            aggregator,
            self.host.peer_id,
            step,
            plan.group_id,
            plan.round,
            self.stage,
        )
        actual = (
            receipt.run_id,
            receipt.aggregator,
            receipt.sender,
            receipt.step,
            receipt.group_id,
            receipt.round,
            receipt.stage,
        )
        if actual != expected:
            raise ProtocolError(f"receipt is for {actual}, not {expected}")
        if receipt.weight > plan.members[me].weight:
            raise ProtocolError(f"receipt weight {receipt.weight} exceeds ours ({plan.members[me].weight})")
        return signed

    # ---------------------------------------------------------------- aggregator side

    def _forget_expired(self, now: float) -> None:
        for key, duty in list(self._duties.items()):
            if duty.expires_at <= now:
                del self._duties[key]
                self._started.pop(key, None)
        for key, held in list(self._held.items()):
            if held.expires_at <= now:
                del self._held[key]  # the parts kept for relaying: their grace is over

    def release_expired(self) -> None:
        """Drop what expired rounds still hold (duties, parts kept for relaying): for a caller about to
        stop averaging for a while (the run ended, a state download), so idle memory is not kept."""
        self._forget_expired(trio.current_time())

    async def _duty_for(self, group_id: bytes, round_: int, peer: str) -> _Aggregation:
        self._forget_expired(trio.current_time())
        key = (group_id, round_)
        duty = self._duties.get(key)
        if duty is None:
            if key not in self._started and len(self._started) >= MAX_PENDING_ROUNDS:
                raise RemoteError(ErrorCode.OVERLOADED, "too many rounds pending")
            if self._early.get(peer, 0) >= MAX_EARLY_PER_PEER:
                raise RemoteError(ErrorCode.OVERLOADED, "too many requests for rounds not started yet")
            self._early[peer] = self._early.get(peer, 0) + 1
            try:
                with trio.move_on_after(EARLY_ARRIVAL_WAIT):
                    await self._started.setdefault(key, trio.Event()).wait()
            finally:
                self._early[peer] -= 1
                if not self._early[peer]:
                    del self._early[peer]
            duty = self._duties.get(key)
        if duty is None:
            self._started.pop(key, None)
            raise RemoteError(ErrorCode.NOT_FOUND, f"this node aggregates nothing in round {round_}")
        return duty

    async def _on_push(self, ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
        part = decode_part_header(header.meta)
        duty = await self._duty_for(part.group_id, part.round, ctx.peer_id)
        plan = duty.plan
        sender = ctx.peer_id
        # Everything below up to read_into is decided from the headers: no payload byte is read before.
        if sender == duty.me or sender not in duty.weights:
            self.stats.parts_refused += 1
            raise RemoteError(ErrorCode.FORBIDDEN, "not a sender of this slice")
        if sender in duty.excluded:  # BAD_REQUEST: it stops pushing, still pulls the average made without it
            self.stats.parts_refused += 1
            raise ProtocolError(f"excluded from this round: {duty.excluded[sender]}")
        claimed = next(m for m in plan.members if m.peer_id == sender)
        problem = ""
        if part.codec != plan.codec or header.nbytes != part.nbytes:
            problem = f"part of codec {part.codec} and {header.nbytes} bytes does not fit the round"
        elif not 0 <= part.part_index < len(duty.parts):
            problem = f"part {part.part_index} is outside the slice"
        elif (part.offset, part.numel) != (
            duty.parts[part.part_index].lo,
            duty.parts[part.part_index].hi - duty.parts[part.part_index].lo,
        ):
            problem = f"part {part.part_index} at [{part.offset}, +{part.numel}) is not the plan's layout"
        elif part.weight != claimed.weight:
            problem = f"weight {part.weight} is not the plan's {claimed.weight}"
        if problem:
            self.stats.parts_refused += 1
            logger.warning("round %d: banning %s before reading its part: %s", plan.round, sender, problem)
            duty.exclude(sender, f"banned: {problem}")
            await self._finalize_ready(duty)
            raise ProtocolError(problem)
        values = np.empty(part.numel, dtype=np.float32)
        try:
            if plan.codec == "none":
                await reader.read_into(values.data.cast("B"))
            else:
                raw = bytearray(header.nbytes)
                await reader.read_into(memoryview(raw))
            self.stats.part_bytes_read += header.nbytes
            limit = _norm_limit(claimed.norm, plan.codec, part.numel)

            def decode_and_measure() -> float:
                if plan.codec != "none":
                    codec_by_name(plan.codec).decode(bytes(raw), part.numel, out=values)
                return _norm(values)

            norm = await trio.to_thread.run_sync(decode_and_measure, limiter=COMPUTE)
        except PeerUnavailable:
            duty.depart(sender, "connection lost mid-part")
            await self._finalize_ready(duty)
            raise
        if norm > limit:  # NaN compares false: the reducer bans non-finite parts itself
            problem = f"part norm {norm:.3g} exceeds the sender's own claim {claimed.norm:.3g}"
            logger.warning("round %d: banning %s: %s", plan.round, sender, problem)
            duty.exclude(sender, f"banned: {problem}")
            await self._finalize_ready(duty)
            raise ProtocolError(problem)
        target = duty.parts[part.part_index]
        local = msgspec.structs.replace(
            part, part_index=0, offset=part.offset - target.lo, weight=duty.weights[sender]
        )
        try:
            target.reducer.add_part(sender, local, values)
        except PartRejected as exc:
            logger.warning("round %d: rejected a part from %s: %s", plan.round, sender, exc)
            if exc.reason.bans:
                duty.exclude(sender, f"banned: {exc.reason.value}")
            await self._finalize_ready(duty)
            raise ProtocolError(f"part rejected: {exc}") from exc
        duty.accepted_bytes[sender] = duty.accepted_bytes.get(sender, 0) + header.nbytes
        duty.part_arrived(sender)
        await self._maybe_finalize(duty, part.part_index)
        return b""

    async def _on_pull(self, ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> BulkReply:
        request = decode_pull_request(header.meta)
        duty = await self._duty_for(request.group_id, request.round, ctx.peer_id)
        member = next((m for m in duty.plan.members if m.peer_id == ctx.peer_id), None)
        if member is None:
            raise RemoteError(ErrorCode.FORBIDDEN, "not a member of this group")
        if member.aux:  # its ticket said it needs no average: the plan budgets no upload for it
            raise RemoteError(ErrorCode.FORBIDDEN, "an auxiliary member pulls no average")
        if not 0 <= request.part_index < len(duty.parts):
            raise ProtocolError(f"part {request.part_index} out of range")
        part = duty.parts[request.part_index]
        if not part.done.is_set():
            await self._await_part(duty, part, ctx.peer_id, reader)
        if part.error is not None or part.encoded is None:
            raise RemoteError(ErrorCode.NOT_FOUND, f"part not averaged: {part.error}")
        lo, hi = part.lo, part.hi
        meta = encode_header(
            AveragedHeader(
                group_id=duty.plan.group_id,
                round=duty.plan.round,
                part_index=request.part_index,
                offset=lo,
                numel=hi - lo,
                codec=duty.plan.codec,
                nbytes=len(part.encoded),
                total_weight=part.total_weight,
                contributors=part.contributors,
                digest=part.digest,
                signature=part.signature,
                receipt=duty.receipts.get(ctx.peer_id) if duty.receipts else None,
            )
        )

        reply = BulkReply(meta, memoryview(part.encoded), on_sent=_served)
        if (ctx.peer_id, request.part_index) not in duty.served:  # a repeated pull must not end the duty
            duty.served.add((ctx.peer_id, request.part_index))
            duty.pulls_left -= 1
        if duty.pulls_left <= 0 and duty.expires_at < math.inf:  # our round is over and all have pulled
            key = (duty.plan.group_id, duty.plan.round)
            self._duties.pop(key, None)
            self._started.pop(key, None)
        return reply

    async def _on_relay(self, ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> BulkReply:
        """A member asks for a part of another aggregator's slice that we received (module docstring,
        "Relayed slices"): answered at once, the part as we got it, or NOT_FOUND."""
        request = decode_relay_request(header.meta)
        self._forget_expired(trio.current_time())
        held = self._held.get((request.group_id, request.round))
        if held is None:
            if request.round in self._joining:  # we may be about to start it: ask again
                raise RemoteError(ErrorCode.PENDING, f"round {request.round} not started here yet")
            raise RemoteError(ErrorCode.NOT_FOUND, f"no parts of round {request.round} held here")
        if ctx.peer_id not in held.members:
            raise RemoteError(ErrorCode.FORBIDDEN, "not a member of this group")
        entry = held.parts.get((request.aggregator, request.part_index))
        if entry is None and request.aggregator in held.pulling:
            raise RemoteError(ErrorCode.PENDING, "still pulling that slice")
        if entry is None:
            raise RemoteError(ErrorCode.NOT_FOUND, "part not held")
        self.stats.relays_served += 1
        meta, payload = entry
        return BulkReply(meta, payload)

    async def _await_part(self, duty: _Aggregation, part: _Part, puller: PeerId, reader: BulkReader) -> None:
        """Wait until ``part`` is averaged; if ``puller`` closes its connection meanwhile, it has left the
        round (a killed process's connections close at once): stop waiting for its parts too."""
        async with trio.open_nursery() as nursery:

            async def averaged() -> None:
                await part.done.wait()
                nursery.cancel_scope.cancel()

            async def left() -> None:
                await reader.peer_closed()
                nursery.cancel_scope.cancel()

            nursery.start_soon(averaged)
            nursery.start_soon(left)
        if not part.done.is_set():
            if duty.depart(puller, "closed its connection while waiting for an average"):
                await self._finalize_ready(duty)
            raise PeerUnavailable(f"{puller} closed the connection of its pull")

    async def _maybe_finalize(self, duty: _Aggregation, k: int) -> None:
        """Reduce part ``k`` once every sender still in the round has delivered it."""
        part = duty.parts[k]
        if part.finalizing or part.reducer.missing():
            return
        part.finalizing = True
        codec = codec_by_name(duty.plan.codec)

        def reduce() -> tuple[Float32Array, bytes | memoryview, bytes]:
            average = part.reducer.finalize()
            if duty.plan.codec == "none":  # the average itself is the wire format: no copy
                view = average.data.cast("B")
                return average, view, part_digest(view)
            encoded = codec.encode(average)
            # what every other member will decode
            return codec.decode(encoded, average.size), encoded, part_digest(encoded)

        try:
            with trio.CancelScope(shield=True):
                part.averaged, part.encoded, part.digest = await trio.to_thread.run_sync(
                    reduce, limiter=COMPUTE
                )
            self._sign_part(duty, k)
        except NothingToAverage as exc:
            part.error = f"nothing to average: {exc}"
        finally:
            others_done = all(p.done.is_set() for p in duty.parts if p is not part)
            if others_done and duty.receipts is None and not any(p.error for p in duty.parts):
                self._issue_receipts(duty)  # before the last part is served, so its pullers get theirs
            part.done.set()

    def _sign_part(self, duty: _Aggregation, k: int) -> None:
        """Sign what part ``k`` of our slice is, once, so that any member can relay it (module docstring,
        "Relayed slices"). A reduced part's senders no longer change (``exclude`` spares it)."""
        part, plan = duty.parts[k], duty.plan
        assert part.encoded is not None
        completeness = part.reducer.completeness()
        part.total_weight, part.contributors = completeness.total_weight, len(completeness.contributors)
        statement = AveragedStatement(
            run_id=self.host.run_id,
            aggregator=duty.me,
            step=duty.step,
            group_id=plan.group_id,
            round=plan.round,
            part_index=k,
            offset=part.lo,
            numel=part.hi - part.lo,
            codec=plan.codec,
            nbytes=len(part.encoded),
            total_weight=part.total_weight,
            contributors=part.contributors,
            digest=part.digest,
        )
        part.signature = self.host.endpoint.identity.sign(averaged_payload(statement))

    def _issue_receipts(self, duty: _Aggregation) -> None:
        """Sign a receipt for every sender averaged into the whole slice; remember their weights."""
        plan, now = duty.plan, trio.current_time()
        identity = self.host.endpoint.identity
        duty.receipts = {}
        for peer in duty.completeness().contributors:
            weight = duty.weights.get(peer, 0.0)
            if weight <= 0:
                continue
            if peer != duty.me:
                self.history.record(peer, weight, now)
            receipt = PartReceipt(
                run_id=self.host.run_id,
                aggregator=duty.me,
                sender=peer,
                step=duty.step,
                group_id=plan.group_id,
                round=plan.round,
                weight=weight,
                nbytes=duty.accepted_bytes.get(peer, 0),
                issued_at=time.time(),
                stage=self.stage,
            )
            duty.receipts[peer] = sign_receipt(receipt, identity.sign)
            self.stats.receipts_issued += 1

    async def _finalize_ready(self, duty: _Aggregation) -> None:
        for k in range(len(duty.parts)):
            await self._maybe_finalize(duty, k)

    async def _watch_senders(self, duty: _Aggregation, start: float, deadline: float) -> None:
        """Drop a sender that completes no part within the stall timeout (module docstring,
        "Departures"); at 90 % of the round's time, drop every missing sender, so members can still pull
        in time."""
        cutoff = start + 0.9 * (deadline - start)
        watch = duty.watch
        assert watch is not None  # set by all_reduce before this task starts
        while not all(part.finalizing for part in duty.parts):
            now = trio.current_time()
            missing = {p for part in duty.parts if not part.finalizing for p in part.reducer.missing()}
            missing.discard(duty.me)  # our own parts go in at once
            if now >= cutoff:
                for peer in missing:
                    duty.exclude(peer, "missed the deadline")
                await self._finalize_ready(duty)
                return
            limit = watch.times.timeout()
            due = {p: duty.last_part.get(p, start) + limit for p in missing}
            stalled = [p for p, at in due.items() if at <= now]
            for peer in stalled:
                duty.depart(peer, f"stalled: no part within {limit:.1f} s")
            if stalled:
                await self._finalize_ready(duty)
                continue
            # progress only moves a sender's due time later: waking at the earliest one and looking
            # again is exact (a timeout that shrank meanwhile takes effect at that wake-up)
            await trio.sleep_until(min([*due.values(), cutoff]))


def _served() -> None:
    faults.hit("allreduce.after_serve")


def _part_header(plan: GroupPlan, k: int, lo: int, hi: int, weight: float) -> PartHeader:
    return PartHeader(
        group_id=plan.group_id,
        round=plan.round,
        part_index=k,
        offset=lo,
        numel=hi - lo,
        codec=plan.codec,
        weight=weight,
        nbytes=encoded_nbytes(plan.codec, hi - lo),
    )


@dataclass
class _Got:
    """What a member collects during one round, per aggregator index."""

    step: int
    watch: _Watch
    receipts: dict[int, SignedReceipt] = field(default_factory=dict)
    pulled: dict[int, int] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    departed: dict[PeerId, str] = field(default_factory=dict)
    pushes_left: int = 0  # remote aggregators we have yet to send our whole slice to
    gate: PushGate = field(default_factory=lambda: PushGate({}))  # the pace of our pushes (.pacing)
    held: _Held | None = None  # where verified parts are kept for relaying
    relayed: dict[int, int] = field(default_factory=dict)  # aggregator index -> parts got through relays
    not_asked: set[PeerId] = field(default_factory=set)  # relays unreachable or caught lying this round


def _norm(values: Float32Array) -> float:
    """L2 norm in float64 (float32 squares overflow long before a finite norm does); NaN for NaN/Inf."""
    with np.errstate(over="ignore", invalid="ignore"):
        square = float(np.dot(values, values))
    if math.isfinite(square):
        return math.sqrt(square)
    if values.size and not (np.isfinite(values.min()) and np.isfinite(values.max())):
        return math.nan
    return float(np.linalg.norm(values.astype(np.float64)))


def _norm_limit(claim: float, codec: str, numel: int) -> float:
    """Largest norm a part of an honest sender that claimed ``claim`` can have after ``codec``."""
    factor, absolute = codec_norm_slack(codec, numel)
    return claim * factor + absolute


def _check_average(values: Float32Array, bound: float) -> None:
    """Raise :class:`BadAverage` unless ``values`` could come from an honest aggregator."""
    norm = _norm(values)
    if not math.isfinite(norm):
        raise BadAverage("values hold NaN or Inf")
    if norm > bound:
        raise BadAverage(f"norm {norm:.3g} exceeds {bound:.3g}, the most the senders' parts allow")
