"""Pure rules of the contribution ledger: is a report authentic (:func:`verify_report`), within bounds
(:func:`assess`), which of its receipts count (:func:`verify_receipt`), how much of it is credited
(:func:`credit_due`), and which capabilities are believed (:func:`check_capabilities`,
:func:`cap_capabilities`). No SQL, no I/O, no clock: the caller passes ``now`` and what it looked up.

**Authenticity.** A :class:`~protocols.ledger.SignedReport` is accepted only if its bytes decode to a
valid :class:`~protocols.ledger.ContributionReport` of this run and ``signature`` verifies (Ed25519) over
``report_payload(report_bytes)`` with the key inside the report's own ``peer_id``. Anything else is
:class:`ReportRejected` and is not stored.

**Bounds (flags).** An authentic report is *flagged* (kept as evidence, credited nothing, its claims not
counted) when it breaks one of these rules; each has a stable code, and ``reason`` is
``"code: detail; code: detail"`` so ``backbone ledger`` can count flags per code (``--flags`` lists
them). With the backbone's clock t, the time j the peer was admitted (it redeemed its invite), the end p
of the peer's latest unflagged report, L = end - start, and R = MAX_SAMPLES_PER_SECOND (1e6):

    future        r.end <= t + 300 s                         (clock skew allowance)
    before_join   r.start >= j - 300 s                       (nobody works for a run before joining it)
    too_long      L <= 1 h + 1 s                             (MAX_INTERVAL_S)
    overlap       p is None  or  r.start >= p - 1 s          (no second claim on the same time)
    compute       r.compute_seconds <= L + 1 s
    rate          r.samples <= R * (L + 1 s)                 (no device computes faster)

Every rule bounds a claim by *time* and by the physical ceiling R, never by the throughput a peer
measured: that measurement is a snapshot (taken while a co-located peer shared the machine, before a
driver warmed up, ...), and an honest peer runs faster than it whenever that peer leaves (issue 11:
5 of 66 reports of a clean run were flagged "samples exceed the measured throughput"). What a peer did
is bounded by what *others* saw instead: credit follows receipts (below), and the collaboration ignores
progress claims beyond 4 target batches per step and caps averaging weights at 8x the group's median
(:mod:`shared.progress`, :mod:`shared.averaging`). So an honest report (its intervals consecutive,
each at most an hour, its compute and samples done within it at any rate a device reaches) is never
flagged, whatever its throughput did, however long it queued (a backlog sent after a day offline, or
replayed from the journal after a restart: its intervals began after the peer joined), and a report
that claims more time, or more samples, than its interval holds still is.

``too_long`` bounds what one report can claim, whatever else it carries (finding 9: an interval begun
1e9 s ago; the 1 s slack covers a volunteer's float arithmetic when it clips a long wait to the last
hour). ``before_join`` replaces version 4's ``too_old`` (start >= t - 24 h), which flagged an honest
backlog older than a day; together with ``overlap`` it keeps a peer from back-dating claims before it
was in the run. Older reports flagged ``too_old`` keep that code.

**Credit follows receipts** (DESIGN D5, D10 (e); wire types in :mod:`protocols.receipts`). A report's
*claims* (samples, compute seconds, bytes aggregated) are never credited on their own. Evidence is:

* **part receipts** the report carries. One counts iff (:func:`verify_receipt`) its bytes decode, its
  ``run_id`` is this run's, its ``sender`` is the reporting peer, its ``aggregator`` is not the sender and
  signed it (Ed25519, key inside the aggregator's peer id), and (looked up by the store) the aggregator
  is an admitted peer of *another user* than the reporter's (unknown aggregator: not counted; same user:
  not counted — one person cannot vouch for themself). Each ``(sender, step)`` is stored once
  (``receipts`` table, primary key ``(sender, step)``): its weight is the largest weight among the valid
  receipts of that step in the first report that brought one; later receipts of that pair are
  duplicates, except one that no discard covers arriving for a stored receipt a discard covers (the
  step taken again, see below): it replaces the discarded one. The weight is capped by the larger of
  the step's recorded batch and its target batch: one member's part is at most the step's batch, which
  its members claim exactly (``Progress.batch``) and which the backbone otherwise records as a lower
  bound (what the progress records said), while a step's members fill the target and then wait
  (:mod:`shared.progress`, "Batch accounting"). An honest part of a step whose batch exceeded its
  target and was recorded only as a lower bound may be credited less, never a colluding aggregator's
  receipt more. A step recorded without a target (schema version <= 4) caps by its recorded samples;
  one only receipts evidence, by the largest cap of a recorded step.
* a receipt's step must be one the run took: a row of ``steps``. :mod:`backbone.steps` writes the steps a
  backbone saw taken (``tracker``); a step it jumped over is recorded by the ledger itself once a
  counting receipt evidences it (two users averaged for it) and the step is at or below the highest step
  a backbone saw taken (the collaboration went past it): ``source = 'receipts'``. A receipt for a step
  beyond that frontier is *held*: stored, not counted, and counted from the first report after the step
  is recorded (a report can race the step recorder by a second). One for a step the run never reaches
  stays held forever: it never becomes credit. No placeholder rows: a claimed step is never taken on
  its own say-so.
* **discarded steps**: a report lists ranges of its sender's steps that a state it loaded replaced (it
  had diverged: a fork that did not survive, see :mod:`protocols.ledger`). A discard applies only to
  work reported *before* it: listed by the sender's report of seq d, it covers the sender's receipts of
  those steps carried by its reports of seq <= d, stored already or arriving later (a report sent
  before the discard may be delivered after it). Those are marked discarded and count as no evidence:
  they are not run progress. What they were credited is *taken back* by the discarding report (its
  credited samples and compute are negative: a debit), so the totals stay ``min(claims, evidence)`` of
  the surviving history. The work is not forgotten: the leaderboard shows it as ``discarded_samples``
  (not in ``samples`` nor ``compute_hours``). Judgement: a fork's minority did real work in good
  faith, but crediting it as run progress rewards forking (the lone fork of issue 10 topped the
  leaderboard), so it is shown apart and left to the organizer. A sender that hides its discards gains
  nothing beyond one batch per step per receipt, as for any colluding pair (see Limits).

  The discarding report's *own* receipts are covered (seq <= d): a volunteer discards when it loads
  the state and lists the discard in its next report (``volunteer.reporting.Reporter.discard``), which
  carries no receipt of those steps: the reporter drops the fork's receipts of them still unsent when
  it discards, and holds back for a later report those booked after the discard (the steps taken again
  before the discarding report went out; :mod:`volunteer.receipts`, "Discards"). An older reporter sent
  those with the discard, so they were marked discarded (under-credit, never over-credit). Receipts of
  those steps in reports of seq > d are the steps taken *again* with the survivors (the merge rule lets
  a peer that was ahead load a lower step): new work, credited as any other. Each replaces the stored
  discarded receipt of its step (note ``receipt_retaken``; the fork's receipt then leaves
  ``discarded_samples``) instead of being refused as a duplicate; a receipt that is covered itself never
  replaces anything. A later discard of the same steps (a second fork) covers the receipts taken again as
  well. The ledger cannot tell a fork's receipt re-sent after the discard from one of the step taken again
  (same sender and step number), so a sender that does so gains what it would by hiding the discard: one
  batch per step per receipt.
* **pull records** about aggregator A in reports of peers of *other users* than A's (each
  ``(puller, aggregator, step)`` once, only for recorded steps) are the evidence of A's aggregation work.

Per peer, with sums over its unflagged reports (this one included) and over its counted evidence:

    credited samples  S = min(claimed samples, receipt weights)
    credited bytes    B = min(claimed bytes_aggregated, bytes others pulled from it)
    (and relayed bytes Y, swarm bytes sent X: below)
    credited compute  C = claimed compute seconds * S / claimed samples     (0 if nothing claimed)

and a report is credited the increase of (S, C, B) over what the peer's earlier reports were credited
(:func:`credit_due`; never negative, except for a report that discards steps). A duplicate or replayed
receipt adds nothing, and no peer is ever credited more than both it claimed and others observed.

**Swarm runs** (issue 17 item 6; DESIGN D10). In a swarm run (``[sync] mode = "swarm"``) each pipeline
stage ``k`` is a data-parallel collaboration of its own among the servers of that stage
(:mod:`volunteer.swarm.stage_service`), under its own DHT keys (``swarm.s<k>.progress``, ...) and with its
own step counter; the run has no global step. The unit of a stage server's work is the **stage-sample**:
one sample whose activations went forward and gradients backward through one stage (a sample through a
3-stage pipeline is 3 stage-samples, one for each stage's server). The rules above apply per stage:

* *claims*: a stage server reports, as ``samples``, the samples its stage steps accumulated (the
  collaboration's own count, from the backwards trainers sent it): stage-samples. Claim and evidence are
  in the same unit; the leaderboard's samples of a swarm run are stage-samples.
* *receipts*: the stage's aggregators sign part receipts with ``stage = k``
  and the stage's step; the server's :class:`~volunteer.receipts.ReceiptBook` keeps them per
  ``(stage, step)`` (a server that moved keeps both stages' receipts of one step number) and its reports
  carry them. One counts by :func:`verify_receipt`'s rules (this run, about the sender, signed by an
  aggregator other than it) and the store's (the aggregator an admitted peer of another user). Each
  ``(sender, stage, step)`` is stored once (table ``stage_receipts``), with the largest weight among the
  report's valid receipts of it, apart from data-parallel receipts: a receipt's ``stage`` is signed, so
  neither a data-parallel receipt nor one stage's receipt can be counted as another stage's.
* *steps*: the backbone's tracker (:mod:`backbone.steps`) watches each stage's progress records as it
  watches the data-parallel ones and records the steps each stage took (table ``stage_steps``: stage,
  step, its batch and the target). A stage receipt counts only for a recorded ``(stage, step)``; one of a
  step the tracker jumped over records it (``source = 'receipts'``) when the step is at or below the
  highest step of *that stage* a backbone saw taken (the frontier is per stage: stages step at their
  own pace); beyond it, it is held, and counted once the stage's step is recorded.
* *caps*: the weight is capped by the larger of the stage step's recorded batch and its target, exactly
  as a data-parallel step's; a stage step only receipts evidence, by the largest cap of a step of that
  stage a backbone recorded.
* *credit*: the receipt weights ``S`` of the rules above sum the peer's data-parallel *and* stage
  receipts (a peer takes part in one run, so in practice one kind), so ``S = min(claimed samples, receipt
  weights)`` holds over both, and late evidence (a stage step recorded after the receipt arrived) is
  credited as for data-parallel steps.
* *discards*: a server whose stage's state is replaced *because it is behind* (it downloads the
  stage's state, or moves to another stage and downloads that one) loses nothing of its own: the steps
  it took are a prefix of the stage's history, or another stage's. A *fork* of a stage (steps only its
  minority took, replaced when it re-syncs: after a partition) and a restart's lost steps (its earlier
  process's steps of the stage above the state it loads) are discarded exactly as data-parallel steps
  are (above, "discarded steps"), per stage: the server's report lists them in ``stage_discarded``
  (``(stage, first, last)`` ranges, :class:`~protocols.ledger.StageStepRange`; a stage counts its own
  steps, so a ``StepRange`` cannot name them), table ``stage_discards`` (schema 12). A stage discard
  listed by the sender's report of seq d covers the sender's ``stage_receipts`` of those stage steps
  *and* its ``trainer_receipts`` of them (a volunteer that serves and trains: its trainers' micro-batches
  of the forked stage steps went into the fork, on its side of the partition), carried by its reports of
  seq <= d, stored already or arriving later; they are marked ``discarded``, count as no evidence (also
  not toward recording a stage step from receipts), and what they were credited is taken back by the
  discarding report (a debit), as for data-parallel discards. A receipt of a later report replaces a
  discarded one of its key (the stage step taken again; note ``stage_receipt_retaken``,
  ``trainer_receipt_retaken``). The leaderboard's ``discarded_samples`` includes their weights. The
  bytes of discarded carried receipts stay evidence of the trainer's sending (bytes really sent, as
  pull records of a data-parallel fork's steps stay evidence of aggregation), until a receipt of the
  stage step taken again from the same server replaces the row (one row per key; what they were
  credited stays). The reporter keeps the two histories apart per stage as for data-parallel steps
  (:mod:`volunteer.receipts`, "Stage discards"): the discarding report and those before it carry no
  receipt of a stage step taken again after the discard, the fork's stage receipts still unsent at the
  discard are dropped, and its trainer's receipts still unsent go out in the discarding report or
  before it (the discard waits for them), never after, so their bytes reach the ledger and their
  samples are never credited as a step taken again. *Bounds*: a range is two
  integers (stage below ``MAX_STAGES``, steps at most ``MAX_COUNT``; at most
  ``MAX_STAGE_DISCARDED_PER_REPORT`` per report, checked when the report decodes), stored as two
  numbers and applied by a range comparison, never expanded into steps: a lying or huge range costs the
  ledger nothing, and it discards only receipts *others* signed for *its sender*: it can lower only its
  sender's own credit, never another peer's (exactly the bounds of ``step_discards``). A sender that
  hides its stage discards gains what a data-parallel sender hiding its discards gains (Limits).
* *not credited yet*: the bytes stage aggregators serve (stage rounds' pull records are not put in
  reports: a ``PulledSlice`` has no stage, and a stage step's pull would be matched against the
  data-parallel steps). The bytes servers and trainers send each other over the bulk lane are credited
  (below, "Swarm bytes").

**Swarm trainers** (issue 17 item 6). A trainer (:mod:`volunteer.swarm.client`) holds no parameters and
averages with nobody; its work is carrying micro-batches forward and backward through one server per
stage. The evidence is what those servers saw:

* *receipts*: a trainer asks (``StageRequest.receipt``) and a stage server that completes a *backward*
  for it (the micro-batch's work at that stage is done and counted toward the stage's step) answers with
  a signed :class:`~protocols.receipts.PartReceipt` with ``carried = True`` (:mod:`protocols.receipts`,
  "Trainers' receipts"): the server, the trainer, the stage, the stage step the samples were counted
  toward, the samples and the bytes received from that trainer, *cumulative* per ``(server, trainer,
  stage, step)``, so the trainer's book keeps only the latest per key and a lost or replayed receipt is
  superseded by the next. The trainer verifies it (signed by the server it called, about itself, of the
  request's stage, ``carried``) and drops a bad one, counting it.
* *unit*: **stage-samples carried**: a micro-batch of ``b`` samples carried through ``S`` stages is
  ``b * S``, evidenced by one receipt per stage. Chosen over "samples, credited once from stage 0's
  backward receipts" (a sample's journey ends there) because (1) a swarm run's leaderboard is in
  stage-samples already (the servers'), so a trainer's and a server's numbers add up in one column and
  a volunteer that does both (the ``auto`` role) reports one ``samples`` claim in one unit; (2) a trainer
  that skips stages (sends stage 0 a made-up gradient) is evidenced only for the stages it engaged, where
  the stage-0 design would credit the whole journey for one request. The cost is a signature per
  backward at every stage and ``S`` receipts per stage step in the trainer's book (bounded, below).
* *claims*: the trainer claims ``b * S`` stage-samples per micro-batch it carried to the end, in the
  existing ``samples`` field (:meth:`volunteer.reporting.Reporter.record`, compute 0: a trainer's device
  does no training work worth timing). No new report field: an older backbone still accepts its reports
  and refuses the carried receipts alone as malformed (``forbid_unknown_fields`` on ``PartReceipt``), so it
  credits the trainer nothing, as before. Credit is ``min(claims, evidence)`` as everywhere.
* *ledger* (table ``trainer_receipts``, schema 10): a carried receipt counts iff :func:`verify_receipt`
  passes (this run, about the reporter, signed by a server other than it) and the server is an admitted
  peer of *another user* than the trainer's (``trainer_receipt_same_user``: in a demo each volunteer both
  serves and trains, and its own server's receipts must not count; ``trainer_receipt_unknown_server``).
  Each ``(trainer, server, stage, step)`` is stored once; a later receipt of the key replaces it only with
  a larger weight (the cumulative value grew), so a replay adds nothing (``trainer_receipt_duplicate``).
  It is credited only for a recorded stage step (``stage_steps``; until then it is stored and counted from
  the moment the step is recorded, ``trainer_receipt_held``, and the trainer is settled then like a
  server with late evidence); carried receipts never *record* a step themselves (a trainer and one
  server would otherwise invent steps). Capped: per ``(trainer, stage, step)`` the weights of all servers'
  receipts together are at most the stage step's cap (the larger of its batch and target; a step only
  receipts evidence: the largest cap of its stage), since one trainer's samples of a stage step are part of
  that step's batch.
* *one claim, two kinds of evidence*: a volunteer that serves and trains claims its stage steps' and its
  micro-batches' stage-samples in one ``samples`` total, and ``S`` sums its stage and carried receipts; a
  surplus of one kind (a backward sent again after a lost answer is counted by two servers) can then
  cover a shortfall of the other. What it can cover is bounded by the caps above, so no peer is credited
  more than its claims nor more than the capped evidence others signed.
* *the wire*: the trainer's ``receipt`` flag and the server's ``StageAnswer.receipt`` are omitted at
  their defaults, so a trainer that does not ask and a server that signs nothing exchange the same bytes
  as before; a server older than the flag refuses a request that asks (``forbid_unknown_fields``) and is
  banned by that trainer like a failing one. The swarm mode has no released version (issue 17 is open),
  so every peer of a swarm run runs one version; :attr:`volunteer.swarm.client.SwarmClientConfig
  .receipts` turns asking off.
* *the book*: a trainer's receipts wait in the reporter's :class:`~volunteer.receipts.ReceiptBook`
  (at most :data:`~volunteer.receipts.CARRIED_PER_STEP` servers per ``(stage, step)``, the latest
  receipt of each; the book's step bound as for all receipts), journaled with the others
  (:mod:`volunteer.journal`) and put back when a report fails.

**Swarm bytes** (issue 17 item 6; wire: :mod:`protocols.ledger`, "Swarm bytes"). A swarm run's traffic
is the pipeline's: a trainer sends a stage server inputs, activations and output gradients, the server
answers with activations (forward) and input gradients (backward). A peer claims in ``bytes_sent`` the
payload bytes it sent (a server: its answers; a trainer: its requests a server answered). The evidence is
what the *receiving* side signed, so a peer is never credited more bytes than a counterpart of another
user says it received from it:

* *a server's sending*: each trainer lists in its own signed report (``received_from``) the answer
  bytes it received from and accepted of each server in the report's interval. A record counts
  (:func:`received_evidence`) iff the report is not flagged (``received_flagged``: its interval is not
  believed), the server is an admitted peer of *another user* than the reporter's (``received_same_user``,
  ``received_unknown_server``), and it is capped at what a link carries in the interval,
  ``MAX_BANDWIDTH_BPS * (L + 1 s)`` (``received_capped``), exactly as relay records. Stored once per
  ``(reporter, seq, server)`` (table ``swarm_received``, schema 11), and the report once per
  ``(peer_id, seq)``: a replayed report, or the same record twice, adds nothing.
* *a trainer's sending*: the carried receipts servers sign (above, "Swarm trainers") state, in
  ``nbytes``, the request bytes the server received from the trainer toward the stage step (forwards and
  backwards, cumulative per ``(server, trainer, stage, step)``). The stored receipt of each key (the
  largest weight seen, with its bytes; ``trainer_receipts``) counts with the same rules as its samples:
  signed by an admitted peer of another user, and only while its stage step is recorded. A replayed or
  older receipt of a key is not stored again, so its bytes count once.

Per peer, over its unflagged reports and its counted evidence:

    credited sent  X = min(claimed bytes_sent, received_from records naming it + its carried receipts' nbytes)

credited as B and Y (the increase over what its earlier reports were credited), with late evidence: a
trainer's report naming a server, and a stage step recorded after the carried receipts of it arrived,
settle the peer at once (``_settle``). A volunteer that serves and trains claims both directions in one
``bytes_sent`` and its evidence sums both kinds, as for samples. What a liar gains: a peer claiming more
than it sent gets no more than others signed; a trainer inventing received bytes credits nothing by
itself (the server must claim them too) and only a server of another user. A colluding pair can credit
each other as many bytes as their records and receipts say (records within a link's ceiling per second of
interval; a carried receipt's bytes are not bounded by the model's size, which the ledger does not know),
as aggregation and relayed bytes (Limits).

**Late evidence** (a receipt held until its step is recorded, a pull of this peer's slice in another
peer's report) is credited as soon as it counts, not with the peer's next report: when a step is
recorded (by the tracker, or from receipts) and when a report brings pull records, the store credits
each peer whose evidence grew the same increase of (S, C, B), added to its latest unflagged report
(``LedgerStore._settle``, one transaction per peer under its row lock). A peer's *last* report, sent
as it leaves, carries receipts of steps the tracker records a second later, and its aggregation is
pulled by peers that report after it: version 4 waited for a next report that never came, so a
volunteer that left showed "aggregated 0.0 MB" and lost its last steps (issue 11).

**Relayed bytes** (issue 14). A relay ``R`` (a reachable volunteer running a relay service,
:mod:`shared.net.relay`) claims in ``bytes_relayed`` what it spliced for others in its report's interval.
Relays sign nothing, so the evidence is, as for aggregation, what the *other* ends saw: each peer whose
connections went through a relay's circuits (the dialer through ``R`` and the target behind ``R``) lists in
``relayed_through`` the bytes it *received* over them in its own report's interval, per relay peer id
(:class:`~protocols.ledger.RelayedBytes`). Received, not sent: each direction of a circuit is then
attested once, by the end it was delivered to, so the two ends of one circuit do not double it. A record
counts (:func:`relay_evidence`) iff its relay is an admitted peer of *another user* than the reporter's
(``relay_same_user``: not counted; ``relay_unknown``: not counted), the report is not flagged
(``relay_flagged``: its interval is not believed, so neither is what it says went through it), and it is
capped at what a link carries in the report's interval, ``MAX_BANDWIDTH_BPS * (L + 1 s)`` bytes
(``relay_capped``). Each report's records are
stored once, keyed ``(reporter, seq, relay)``, and the report itself once per ``(peer_id, seq)``: a
duplicate or replayed report adds nothing. Then, per relay, over its unflagged reports and the counted
records naming it:

    credited relayed  Y = min(claimed bytes_relayed, bytes peers of other users received through it)

credited the same way as B (the increase over what its earlier reports were credited), with late
evidence: a client's report that arrives after the relay's settles the relay at once (``_settle``).
The evidence is TLS plaintext, a little less than the ciphertext the relay spliced (TLS's framing, under
1% of a bulk transfer, and the handshakes; 99.8% of the spliced bytes reach the ledger in
``tests/volunteer/test_report_relayed.py``'s 1 MiB transfer): an honest relay is credited slightly less
than it claims.
What a liar gains: a relay claiming more than it relayed gets no more than others received through it; a
client inventing relayed bytes credits nothing by itself (the relay must claim them too), and only a
relay of another user. A colluding pair (a relay's user and a client's user) can credit the relay as many
bytes as the client's records say, at most ``MAX_BANDWIDTH_BPS`` bytes per second of the client's
unflagged intervals (which do not overlap), as aggregation bytes are bounded only by pull records.

**Limits.** Receipts stop a peer from vouching for itself, not two *users* from vouching for each other:
colluding users can credit each other at most one recorded batch per sender and step (samples; in a
swarm run per sender, stage and step, in stage-samples; a trainer per stage and step whatever the number
of colluding servers, so at most the stage-samples the run recorded: ``sum over recorded stage steps of
their caps``), and
aggregation bytes as large as their pull records say (the ledger does not know the model's size), and
relayed bytes as large as their relay records say (within a link's ceiling per second of interval).
Catching that needs the cross-checks between groups of the robust-averaging work (``shared.averaging``).

**A lone volunteer** (no peer of another user in its rounds) gets no receipts it can use, so its work is
recorded and credited 0. That is not a false negative of a check but the rule itself: nobody else saw
that work, and work that only its author vouches for is exactly the claim finding 9 exploited. It counts
as soon as someone else averages with it.

**Capabilities** (:func:`check_capabilities`) are refused beyond sane ceilings (1e6 samples/s, 1e11 B/s
each way) and are then bounded by what the peer was seen to do (:func:`cap_capabilities`): once its
unflagged reports cover at least 60 s of compute and some credited samples, its stored samples/s is at
most 2 x (credited samples / claimed compute seconds) — the rate its receipts support, with room for a
machine that got faster (a co-located job ended). Capabilities no longer decide credit (receipts do),
so a peer whose speed changed is never flagged for it (issue 11's false flags).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from protocols.errors import ProtocolError
from protocols.ledger import (
    MAX_INTERVAL_S,
    MAX_REPORT_BYTES,
    Capabilities,
    ContributionReport,
    SignedReport,
    report_payload,
)
from protocols.receipts import PartReceipt, SignedReceipt, decode_receipt, receipt_payload
from shared.auth.keys import verify_by_peer_id
from shared.errors import ProjectError
from shared.progress import MAX_SAMPLES_FACTOR

__all__ = [
    "CAPABILITY_HISTORY_S",
    "CLOCK_SKEW_S",
    "COMPUTE_TOLERANCE_S",
    "CREDITED",
    "MAX_BANDWIDTH_BPS",
    "INTERVAL_TOLERANCE_S",
    "MAX_INTERVAL_S",
    "MAX_SAMPLES_FACTOR",
    "MAX_SAMPLES_PER_SECOND",
    "OBSERVED_RATE_ALLOWANCE",
    "OVERLAP_TOLERANCE_S",
    "Assessment",
    "CapabilitiesRejected",
    "Credit",
    "ReceivedEvidence",
    "RelayEvidence",
    "ReceiptRejected",
    "ReportRejected",
    "SortedReceipts",
    "assess",
    "cap_capabilities",
    "check_capabilities",
    "credit_due",
    "credited_relayed",
    "relay_cap",
    "relay_evidence",
    "reason_codes",
    "received_evidence",
    "sorted_receipts",
    "split_receipts",
    "valid_receipts",
    "verify_receipt",
    "verify_report",
]

CLOCK_SKEW_S = 300.0
OVERLAP_TOLERANCE_S = 1.0
COMPUTE_TOLERANCE_S = 1.0
INTERVAL_TOLERANCE_S = 1.0
MAX_SAMPLES_PER_SECOND = 1e6
MAX_BANDWIDTH_BPS = 1e11
CAPABILITY_HISTORY_S = 60.0
OBSERVED_RATE_ALLOWANCE = 2.0

_REPORT_DECODER = msgspec.msgpack.Decoder(ContributionReport)


class ReportRejected(ProjectError):
    """A signed report is not authentic or not for this run: undecodable or invalid bytes, another run
    id, or a signature that does not verify with the key inside the report's peer id. Rejected reports
    are not stored; answer the sender with the message."""


class ReceiptRejected(ProjectError):
    """One receipt of a report does not count; ``code`` says why (``receipt_malformed``,
    ``receipt_wrong_run``, ``receipt_wrong_sender``, ``receipt_own``, ``receipt_bad_signature``). The
    report itself is still recorded."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class CapabilitiesRejected(ProjectError):
    """Claimed capabilities beyond the sane ceilings of the module docstring."""


@dataclass(frozen=True)
class Assessment:
    """The bounds verdict on one authentic report: within bounds, or flagged with the broken rules."""

    credited: bool
    reason: str | None = None


CREDITED = Assessment(credited=True)


@dataclass(frozen=True)
class Credit:
    """Samples, compute seconds, bytes aggregated, bytes relayed and swarm bytes sent (claimed,
    evidence, or credited)."""

    samples: float = 0.0
    compute_seconds: float = 0.0
    bytes_aggregated: float = 0.0
    bytes_relayed: float = 0.0
    bytes_sent: float = 0.0


@dataclass(frozen=True)
class RelayEvidence:
    """One counted record: ``reporter`` received ``nbytes`` through ``relay`` in its report ``seq``."""

    reporter: str
    seq: int
    relay: str
    nbytes: int


@dataclass(frozen=True)
class ReceivedEvidence:
    """One counted record: ``reporter`` received ``nbytes`` from stage server ``server`` in its report
    ``seq`` (module docstring, "Swarm bytes")."""

    reporter: str
    seq: int
    server: str
    nbytes: int


def verify_report(signed: SignedReport, run_id: str) -> ContributionReport:
    """Decode and authenticate a signed report.

    Returns:
        The report, guaranteed to be written and signed by ``report.peer_id`` for ``run_id``.

    Raises:
        ReportRejected: too large, malformed, another run's, or a bad signature.
    """
    if len(signed.report) > MAX_REPORT_BYTES:
        raise ReportRejected(f"report has {len(signed.report)} bytes, the limit is {MAX_REPORT_BYTES}")
    try:
        report = _REPORT_DECODER.decode(signed.report)
    except (msgspec.MsgspecError, RecursionError, UnicodeDecodeError) as exc:  # msgspec: bad UTF-8 too
        raise ReportRejected(f"malformed report: {exc}") from exc
    if report.run_id != run_id:
        raise ReportRejected(f"report is for run {report.run_id!r}, not {run_id!r}")
    if not verify_by_peer_id(report.peer_id, signed.signature, report_payload(signed.report)):
        raise ReportRejected(f"signature does not verify with the key of peer {report.peer_id}")
    return report


def assess(
    report: ContributionReport, previous_end: float | None, now: float, joined_at: float | None = None
) -> Assessment:
    """Apply the bounds of the module docstring.

    Args:
        report: an authentic report (see :func:`verify_report`).
        previous_end: ``interval_end`` of the peer's latest unflagged report, if any.
        now: the backbone's clock, unix seconds.
        joined_at: when the peer was admitted (its ``first_seen``); None: not checked.
    """
    reasons: list[str] = []
    length = report.interval_end - report.interval_start
    if report.interval_end > now + CLOCK_SKEW_S:
        reasons.append(f"future: the interval ends {report.interval_end - now:.0f} s ahead of our clock")
    if joined_at is not None and report.interval_start < joined_at - CLOCK_SKEW_S:
        early = joined_at - report.interval_start
        reasons.append(f"before_join: the interval began {early:.0f} s before the peer joined the run")
    if length > MAX_INTERVAL_S + INTERVAL_TOLERANCE_S:
        reasons.append(f"too_long: an interval of {length:.0f} s (at most {MAX_INTERVAL_S:.0f} s)")
    if previous_end is not None and report.interval_start < previous_end - OVERLAP_TOLERANCE_S:
        reasons.append(f"overlap: the interval overlaps the previous report (ended {previous_end:.3f})")
    if report.compute_seconds > length + COMPUTE_TOLERANCE_S:
        reasons.append(f"compute: {report.compute_seconds:.1f} s of compute in a {length:.1f} s interval")
    if report.samples > MAX_SAMPLES_PER_SECOND * (length + COMPUTE_TOLERANCE_S):
        reasons.append(
            f"rate: {report.samples} samples in a {length:.1f} s interval, beyond any device "
            f"({MAX_SAMPLES_PER_SECOND:g} samples/s)"
        )
    return Assessment(credited=False, reason="; ".join(reasons)) if reasons else CREDITED


def reason_codes(reason: str | None) -> list[str]:
    """The codes of a ``"code: detail; code: detail"`` reason (older free-text reasons: ``other``)."""
    if not reason:
        return []
    codes = []
    for part in reason.split("; "):
        code, sep, _ = part.partition(":")
        codes.append(code if sep and code.replace("_", "").isalpha() else "other")
    return codes


def verify_receipt(signed: SignedReceipt, run_id: str, sender: str) -> PartReceipt:
    """Decode one receipt of ``sender``'s report and check everything that needs no database.

    Raises:
        ReceiptRejected: malformed, another run's, about another sender, the sender's own, or a bad
            signature (the code says which).
    """
    try:
        receipt = decode_receipt(signed.receipt)
    except ProtocolError as exc:
        raise ReceiptRejected("receipt_malformed", str(exc)) from exc
    if receipt.run_id != run_id:
        raise ReceiptRejected("receipt_wrong_run", f"a receipt of run {receipt.run_id!r}")
    if receipt.sender != sender:
        raise ReceiptRejected("receipt_wrong_sender", f"a receipt about peer {receipt.sender}")
    if receipt.aggregator == sender:
        raise ReceiptRejected("receipt_own", "a receipt signed by the reporting peer itself")
    if not verify_by_peer_id(receipt.aggregator, signed.signature, receipt_payload(signed.receipt)):
        raise ReceiptRejected("receipt_bad_signature", f"not signed by aggregator {receipt.aggregator}")
    return receipt


def valid_receipts(
    report: ContributionReport, run_id: str
) -> tuple[dict[int, list[PartReceipt]], Counter[str]]:
    """The report's data-parallel receipts that pass :func:`verify_receipt`, by step, and how many of all
    its receipts did not, by code. (Whose peer signed them is the store's to check; it then keeps the
    largest weight per step.) Stage receipts: :func:`sorted_receipts`."""
    steps, _stages, rejected = sorted_receipts(report, run_id)
    return steps, rejected


def sorted_receipts(
    report: ContributionReport, run_id: str
) -> tuple[dict[int, list[PartReceipt]], dict[tuple[int, int], list[PartReceipt]], Counter[str]]:
    """The report's receipts that pass :func:`verify_receipt`: the data-parallel ones by step, those of a
    swarm run's stages by ``(stage, step)`` (module docstring, "Swarm runs"), and how many did not, by
    code. A trainer's receipts (``carried``) are in neither: :func:`split_receipts`."""
    sorted_ = split_receipts(report, run_id)
    return sorted_.steps, sorted_.stages, sorted_.rejected


@dataclass(frozen=True)
class SortedReceipts:
    """A report's receipts that pass :func:`verify_receipt`, by kind, and how many did not, by code."""

    #: data-parallel part receipts, by global step
    steps: dict[int, list[PartReceipt]]
    #: stage aggregators' part receipts, by ``(stage, step)``
    stages: dict[tuple[int, int], list[PartReceipt]]
    #: stage servers' receipts for this peer as a trainer (``carried``), by ``(stage, step)``
    carried: dict[tuple[int, int], list[PartReceipt]]
    rejected: Counter[str]


def split_receipts(report: ContributionReport, run_id: str) -> SortedReceipts:
    """:func:`sorted_receipts` with the trainer's receipts too (module docstring, "Swarm trainers")."""
    steps: dict[int, list[PartReceipt]] = {}
    stages: dict[tuple[int, int], list[PartReceipt]] = {}
    carried: dict[tuple[int, int], list[PartReceipt]] = {}
    rejected: Counter[str] = Counter()
    for signed in report.receipts:
        try:
            receipt = verify_receipt(signed, run_id, report.peer_id)
        except ReceiptRejected as exc:
            rejected[exc.code] += 1
            continue
        if receipt.stage is None:
            steps.setdefault(receipt.step, []).append(receipt)
        elif receipt.carried:
            carried.setdefault((receipt.stage, receipt.step), []).append(receipt)
        else:
            stages.setdefault((receipt.stage, receipt.step), []).append(receipt)
    return SortedReceipts(steps, stages, carried, rejected)


def credit_due(claimed: Credit, evidence: Credit, credited: Credit, *, debit: bool = False) -> Credit:
    """What a report adds: the peer's creditable totals (module docstring) less what it was credited.

    Args:
        claimed: the peer's claims summed over its unflagged reports, the new one included.
        evidence: receipt weights (``samples``), bytes others pulled (``bytes_aggregated``), relayed
            through it (``bytes_relayed``) and received from it (``bytes_sent``).
        credited: what its earlier reports were credited.
        debit: the report discards steps, so evidence may have shrunk: samples and compute may come out
            negative (taking back what the discarded steps were credited). Otherwise never negative.
    """
    samples = min(claimed.samples, evidence.samples)
    compute = claimed.compute_seconds * samples / claimed.samples if claimed.samples > 0 else 0.0
    aggregated = min(claimed.bytes_aggregated, evidence.bytes_aggregated)
    relayed = min(claimed.bytes_relayed, evidence.bytes_relayed)
    sent = min(claimed.bytes_sent, evidence.bytes_sent)
    floor = -math.inf if debit else 0.0
    return Credit(
        samples=max(floor, samples - credited.samples),
        compute_seconds=max(floor, compute - credited.compute_seconds),
        bytes_aggregated=max(0.0, aggregated - credited.bytes_aggregated),
        bytes_relayed=max(0.0, relayed - credited.bytes_relayed),
        bytes_sent=max(0.0, sent - credited.bytes_sent),
    )


def relay_cap(interval_seconds: float) -> int:
    """The most bytes one record of a report covering ``interval_seconds`` may count: a link's ceiling
    (:data:`MAX_BANDWIDTH_BPS`, bytes per second) over the interval plus the tolerance."""
    return int(MAX_BANDWIDTH_BPS * (max(0.0, interval_seconds) + INTERVAL_TOLERANCE_S))


def relay_evidence(
    report: ContributionReport, reporter_user: int, users: Mapping[str, int]
) -> tuple[list[RelayEvidence], Counter[str]]:
    """The report's ``relayed_through`` records that count (module docstring: the relay is an admitted
    peer of another user; capped by :func:`relay_cap`), and how many did not or were capped, by code.

    Args:
        reporter_user: the user of the reporting peer.
        users: the user of each admitted peer the records name (unknown peers are absent).
    """
    counted: list[RelayEvidence] = []
    notes: Counter[str] = Counter()
    cap = relay_cap(report.interval_end - report.interval_start)
    for record in report.relayed_through:
        relay_user = users.get(record.relay)
        if record.relay == report.peer_id or relay_user == reporter_user:
            notes["relay_same_user"] += 1
        elif relay_user is None:
            notes["relay_unknown"] += 1
        elif record.nbytes > 0:
            if record.nbytes > cap:
                notes["relay_capped"] += 1
            counted.append(RelayEvidence(report.peer_id, report.seq, record.relay, min(record.nbytes, cap)))
    return counted, notes


def received_evidence(
    report: ContributionReport, reporter_user: int, users: Mapping[str, int]
) -> tuple[list[ReceivedEvidence], Counter[str]]:
    """The report's ``received_from`` records that count (module docstring, "Swarm bytes": the server is
    an admitted peer of another user; capped by :func:`relay_cap`), and how many did not or were capped,
    by code. The caller passes no records of a flagged report (``received_flagged``).

    Args:
        reporter_user: the user of the reporting peer.
        users: the user of each admitted peer the records name (unknown peers are absent).
    """
    counted: list[ReceivedEvidence] = []
    notes: Counter[str] = Counter()
    cap = relay_cap(report.interval_end - report.interval_start)
    for record in report.received_from:
        server_user = users.get(record.server)
        if record.server == report.peer_id or server_user == reporter_user:
            notes["received_same_user"] += 1
        elif server_user is None:
            notes["received_unknown_server"] += 1
        elif record.nbytes > 0:
            if record.nbytes > cap:
                notes["received_capped"] += 1
            counted.append(
                ReceivedEvidence(report.peer_id, report.seq, record.server, min(record.nbytes, cap))
            )
    return counted, notes


def credited_relayed(claimed: float, evidence: Iterable[RelayEvidence]) -> float:
    """Y of the module docstring for one relay: ``min(claimed, evidence)``, each ``(reporter, seq,
    relay)`` counted once however often it is seen (``evidence``: counted records naming this relay)."""
    once: dict[tuple[str, int, str], int] = {}
    for record in evidence:
        once.setdefault((record.reporter, record.seq, record.relay), record.nbytes)
    return min(claimed, float(sum(once.values())))


def check_capabilities(capabilities: Capabilities) -> None:
    """Raises CapabilitiesRejected beyond :data:`MAX_SAMPLES_PER_SECOND` / :data:`MAX_BANDWIDTH_BPS`."""
    if capabilities.samples_per_second > MAX_SAMPLES_PER_SECOND:
        raise CapabilitiesRejected(
            f"{capabilities.samples_per_second:g} samples/s is beyond {MAX_SAMPLES_PER_SECOND:g}"
        )
    for name in ("upload_bps", "download_bps"):
        if getattr(capabilities, name) > MAX_BANDWIDTH_BPS:
            raise CapabilitiesRejected(
                f"{name} {getattr(capabilities, name):g} is beyond {MAX_BANDWIDTH_BPS:g}"
            )


def cap_capabilities(
    capabilities: Capabilities, credited_samples: float, compute_seconds: float
) -> Capabilities:
    """``capabilities`` with samples/s bounded by what the peer was seen to do (module docstring).

    Args:
        credited_samples: samples credited to the peer (receipt-backed), over its unflagged reports.
        compute_seconds: compute seconds it claimed over the same reports.
    """
    if compute_seconds < CAPABILITY_HISTORY_S or credited_samples <= 0:
        return capabilities
    observed = credited_samples / compute_seconds
    cap = OBSERVED_RATE_ALLOWANCE * observed
    if not math.isfinite(cap) or capabilities.samples_per_second <= cap:
        return capabilities
    return msgspec.structs.replace(capabilities, samples_per_second=cap)
