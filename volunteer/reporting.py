"""The volunteer's contribution reports, their journal and its session (no torch: a killed process's
successor and the tests load it fast).

:class:`Reporter` turns each step we took part in into a signed
:class:`~protocols.ledger.ContributionReport` (consecutive, non-overlapping intervals of at most
``MAX_INTERVAL_S``; ``seq`` persisted in the data dir so a restart never reuses one) and posts it to the
backbone's API, retrying later when no backbone answers. Nothing is lost while the queue (bounded) has
room. The ledger credits a report only up to the receipts other peers signed for our work
(:mod:`protocols.receipts`): the reporter owns this peer's :class:`~volunteer.receipts.ReceiptBook`
(the averaging side fills it), takes one report's worth of receipts and pull records into each report,
closes a report early when the book holds a full report's worth, and puts back what a report carried
when that report is given up (queue overflow, or refused by the backbone), so the next one carries it.
When the queue overflows, the report given up is the oldest that lists no discard (the oldest of all
only when every queued one lists one, :func:`volunteer.journal.overflow_victim`): a discard given up is
lost for good (below: it is not put back), and the fork's receipts delivered before it would stay
credited, while a report without one loses nothing that does not go back into the book.
Everything the reporter holds is journaled as it happens (:mod:`volunteer.journal`, ``reports.journal``
in the data dir): a process killed without warning loses no step whose round completed, and the next
process in the same data dir reports it. The reporter also owns this process's *session* in the ledger:
a heartbeat every quarter of the backbone's session timeout (the first opens it) and a leave notice
after the last report when leaving (:meth:`Reporter.close_all`, then :meth:`Reporter.flush`). It
journals the fingerprint of each data-parallel step it records and keeps their :attr:`Reporter.lineage`
(bounded, less the steps discarded since): after a restart, the earlier process's, which
:mod:`volunteer.collab.sync` compares with the first state loaded to discard the earlier steps the
collaboration took again differently.

**Stage discards** (swarm runs; the ledger's rule: :mod:`backbone.ledger.accounting`, "Swarm runs").
A stage server's collaboration reports the stage steps a stage state it loaded replaced through
:meth:`Reporter.discard_stage` (a fork's steps after a partition, or a restarted process's steps the
stage lost: :mod:`volunteer.swarm.stage_service`); they are journaled at once, merged per stage, and the
next reports list them in ``stage_discarded`` (at most ``MAX_STAGE_DISCARDED_PER_REPORT`` per report, the
rest in the next), exactly as data-parallel discards go into ``discarded``. A report given up does not put
them back (as data-parallel discards: one refused by a backbone older than the field would have every
later report refused too). Their receipts follow the rule of "Discards" below per stage
(:mod:`volunteer.receipts`, "Stage discards"): at the discard the fork's stage receipts still in the book
are dropped (counted in :attr:`Reporter.fork_receipts`) and its trainer's receipts *sealed*: every report
carries the sealed ones first, and no report lists a stage discard while the book holds one (their bytes
stay evidence, so they go out in the discard's report or before it, never after). Every report holds back
the stage and trainer's receipts of the pending stage discards' steps (listed by it or left to a later
report), booked after the discard: the stage steps taken again, carried after the report listing it.
Steps of the stage we record carry its index (``record(..., stage=k)``), so the journal knows the highest
step of each stage this data dir took part in (:meth:`Reporter.stage_last_step`).

**Discards** (:meth:`Reporter.discard`; the ledger's rule: :mod:`backbone.ledger.accounting`,
"discarded steps", unchanged). The report that lists a discard of our steps ``first..last`` (seq ``d``)
has the ledger mark discarded our receipts of those steps in our reports of seq ``<= d``, and credit those
of later reports as the steps taken again. So no receipt of a step taken again may go out in report ``d``
or before, and none of the fork's after it (:mod:`volunteer.receipts`, "Discards"): at the discard the
fork's receipts of those steps still in the book are dropped (counted in :attr:`Reporter.fork_receipts`;
pull records stay), and the report that lists the discards holds back the receipts of their steps the
book holds then, which were booked after the discard: the steps taken again, carried by the next report.
A report given up (queue overflow, refused) puts back no receipt of steps a discard since covers (the
fork's, which it would have delivered to be marked discarded).
Several discards before a report still go out in that one report (merged), and the steps taken again
may be *claimed* in it (a discard covers receipts, not claims). The journal replays both, so a process
killed between the discard and its report neither loses the receipts of the steps taken again nor sends
them with the discard; stage discards likewise (above, the sealed receipts included).

**Relayed bytes** (issue 14; the ledger's rule is in :mod:`backbone.ledger.accounting`). Two optional
delta-readable sources, each returning what accumulated since its previous call: ``relay_traffic``, the
bytes we received through each relay (``host.relay_traffic.take``, :mod:`shared.net.relaytraffic`: the
evidence of *their* relaying, ``relayed_through``), and ``relayed``, the bytes our own relay service
spliced (``relayed_since(service)``: our claim, ``bytes_relayed``; None: we relay nothing). Both can be set
after construction (:attr:`Reporter.relay_traffic`, :attr:`Reporter.relayed`). They are read when a step
is recorded, when an interval closes and every :data:`REPORT_RETRY` seconds, and what they return is
journaled at once (``relayed`` entries), so a SIGKILL loses only bytes since the last read. A report
carries everything read so far (the evidence of at most ``MAX_RELAYED_PER_REPORT`` relays, the busiest;
the rest waits for the next report). A relay that takes no steps still reports: with relayed bytes and
no step, an interval closes after ``interval`` seconds. A report given up because the queue overflowed
puts its claim and evidence back; one the backbone *refused* puts back the claim only, since its
evidence may be what an older backbone refuses (``relayed_through`` is newer), and resending it would
have every later report refused as well.

**Swarm bytes** (issue 17 item 6; the ledger's rule: :mod:`backbone.ledger.accounting`, "Swarm bytes"). A
third delta-readable source, ``swarm_traffic`` (:attr:`Reporter.swarm_traffic`, set by the swarm session),
returns the pipeline bytes this process sent since its previous call (our claim, ``bytes_sent``) and the
answer bytes our trainers received from each stage server (the evidence of *their* sending,
``received_from``). It is read, journaled, carried (the busiest ``MAX_RECEIVED_PER_REPORT`` servers per
report) and put back exactly as the relay sources.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import msgspec
import trio

from protocols.ledger import (
    MAX_COUNT,
    MAX_DISCARDED_PER_REPORT,
    MAX_INTERVAL_S,
    MAX_RECEIVED_PER_REPORT,
    MAX_RELAYED_PER_REPORT,
    MAX_STAGE_DISCARDED_PER_REPORT,
    ContributionReport,
    ReceivedBytes,
    RelayedBytes,
    SignedReport,
    StageStepRange,
    StepRange,
    report_payload,
)
from protocols.receipts import MAX_PULLED_PER_REPORT, MAX_RECEIPTS_PER_REPORT, PulledSlice, SignedReceipt
from shared.auth.keys import Identity
from shared.errors import AdmissionError, PeerUnavailable, ProtocolError
from shared.tolerated import Tolerated

from . import journal
from .api_client import ApiClient
from .journal import JOURNAL_FILE, JournaledStep, ReportJournal
from .receipts import ReceiptBook

__all__ = ["MAX_PENDING_REPORTS", "REPORT_RETRY", "FinishedStep", "Reporter"]

logger = logging.getLogger(__name__)
MAX_PENDING_REPORTS = 10_000
REPORT_RETRY = 5.0
#: the backbone's session timeout until its first answer says (backbone.api.SESSION_TIMEOUT)
SESSION_TIMEOUT_GUESS = 90.0


class FinishedStep(Protocol):
    """What the reporter reads of one step we took part in (``volunteer.collab``'s StepRecord)."""

    @property
    def step(self) -> int: ...
    @property
    def samples(self) -> int: ...
    @property
    def compute_seconds(self) -> float: ...
    @property
    def bytes_aggregated(self) -> int: ...
    @property
    def finished_at(self) -> float: ...


class Reporter:
    """Signed contribution reports to the backbone's API, a journal that survives a SIGKILL, and this
    process's session (see the module docstring and :mod:`volunteer.journal`).

    Steps are credited in intervals of at least ``interval`` seconds (one report may cover several
    steps): fewer rows. The ledger bounds each report by its interval's length (compute time, and
    samples at a physical ceiling), never by the throughput this peer measured, which its real speed
    leaves behind whenever a co-located job ends (see :mod:`backbone.ledger.accounting`).

    On construction the journal of an earlier process in ``data_dir`` is replayed: its queued reports are
    queued again (the same signed reports: the ledger credits each once), its steps that were never put in
    a report go into one report now, and its receipt book is restored.
    """

    def __init__(
        self,
        run_id: str,
        identity: Identity,
        client: ApiClient | None,
        data_dir: Path,
        interval: float = 10.0,
        *,
        relay_traffic: Callable[[], Mapping[str, int]] | None = None,
        relayed: Callable[[], int] | None = None,
        swarm_traffic: Callable[[], tuple[int, Mapping[str, int]]] | None = None,
    ) -> None:
        self.run_id = run_id
        self.identity = identity
        self.client = client
        self.interval = interval
        #: bytes received through each relay since the previous call (module docstring), or None
        self.relay_traffic = relay_traffic
        #: bytes our relay service spliced since the previous call, or None (we relay nothing)
        self.relayed = relayed
        #: swarm bytes sent, and answer bytes received per stage server, since the previous call, or None
        self.swarm_traffic = swarm_traffic
        self._seq_path = data_dir / "report.seq"
        self._pending: deque[tuple[SignedReport, ContributionReport]] = deque()
        self._open: list[JournaledStep] = []  # steps not in a report yet
        self._discarded: list[tuple[int, int]] = []  # step ranges not in a report yet
        self._stage_discarded: list[tuple[int, int, int]] = []  # stage step ranges not in a report yet
        self._wakeup = trio.Event()
        self._sending = trio.Lock()
        self.sent = 0
        self.credited = 0
        #: receipts of discarded steps dropped from the book at a discard or a give-up (module docstring,
        #: "Discards" and "Stage discards")
        self.fork_receipts = 0
        #: this process's session: opened by the first heartbeat, ended by the leave notice
        self.session = secrets.token_hex(16)
        self.session_timeout = SESSION_TIMEOUT_GUESS
        self._last_heartbeat = -math.inf
        self._leaving = False
        self._left = False
        self.tolerated = Tolerated(logger)
        self.journal = ReportJournal(data_dir / JOURNAL_FILE)
        self.book = ReceiptBook(identity.peer_id)
        state = self.journal.replay(self.book)
        self.book.on_add = self._journal_booked
        self._seq = max(self._load_seq(), state.seq)
        self._last_step = state.last_step
        self._pending.extend(state.unsent)
        self._discarded = list(state.discarded)
        self._stage_discarded = list(state.stage_discarded)
        self._stage_steps = dict(state.stage_steps)  # the highest step of each stage we took part in
        self._open = list(state.open_steps)
        self._lineage = state.lineage  # of the steps recorded with a fingerprint (volunteer.journal)
        self._relay_claim = state.relay_claim  # read from the sources, not in a report yet
        self._relay_through: Counter[str] = Counter(state.relay_through)
        self._sent_claim = state.sent_claim  # swarm bytes sent, not in a report yet
        self._received: Counter[str] = Counter(state.received)
        self._last_end = state.last_end if state.last_end is not None else time.time()
        self.recovered = len(state.unsent), len(state.open_steps)
        self._compact()
        if self._open or self._discarded or self._stage_discarded or self._has_relayed():
            self.close_interval()  # the steps (and relayed bytes) a killed process never reported
        if any(self.recovered):
            logger.info(
                "resuming from the report journal: %d unsent reports, %d unreported steps",
                *self.recovered,
            )
        self._last_end = max(self._last_end, time.time())
        self.journal.append(journal.opened(self._last_end))

    def _load_seq(self) -> int:
        with contextlib.suppress(OSError, ValueError):
            return int(self._seq_path.read_text().strip())
        return 0

    def _save_seq(self) -> None:
        tmp = self._seq_path.with_suffix(".tmp")
        with self.tolerated.around("saving report.seq", OSError):
            tmp.write_text(f"{self._seq}\n")
            tmp.replace(self._seq_path)

    def _journal_booked(
        self,
        step: int,
        receipts: list[tuple[str, SignedReceipt]],
        pulled: list[PulledSlice],
        stage: int | None = None,
    ) -> None:
        self.journal.append(journal.booked(step, receipts, pulled, stage))

    def _compact(self) -> None:
        self.journal.rewrite(
            journal.compacted(
                self._seq,
                self._last_end,
                self._last_step,
                self.book,
                list(self._pending),
                self._open,
                self._discarded,
                self._relay_claim,
                dict(self._relay_through),
                self._sent_claim,
                dict(self._received),
                self._lineage,
                self._stage_discarded,
                self._stage_steps,
            )
        )

    def poll_relays(self) -> None:
        """Read the relay sources (module docstring) and journal what they returned."""
        claim = self.relayed() if self.relayed is not None else 0
        through = {r: n for r, n in (self.relay_traffic() if self.relay_traffic else {}).items() if n > 0}
        sent, received = self.swarm_traffic() if self.swarm_traffic is not None else (0, {})
        received = {s: n for s, n in received.items() if n > 0}
        if claim <= 0 and not through and sent <= 0 and not received:
            return
        self.journal.append(journal.relayed(max(0, claim), through, max(0, sent), received))
        self._relay_claim += max(0, claim)
        self._relay_through.update(through)
        self._sent_claim += max(0, sent)
        self._received.update(received)

    def record(self, step: FinishedStep, fingerprint: bytes | None = None, stage: int | None = None) -> None:
        """Note one step we took part in (called from the optimizer after the step is applied: its round
        completed; never blocks). Journaled at once, so a SIGKILL right after loses nothing. With the
        ``fingerprint`` of the parameters after it (a data-parallel step), it joins :attr:`lineage`; with
        a ``stage`` (a swarm run's stage step), it is that stage's (:meth:`stage_last_step`)."""
        entry = JournaledStep(
            step.step,
            step.samples,
            step.compute_seconds,
            step.bytes_aggregated,
            step.finished_at,
            fingerprint,
            stage,
        )
        self.poll_relays()
        self.journal.append(entry)
        self._open.append(entry)
        self._lineage = journal.with_step(self._lineage, entry)
        journal.note_stage_step(self._stage_steps, entry)
        if step.finished_at - self._last_end >= self.interval or self._book_full():
            self.close_interval()

    def discard(self, first: int, last: int) -> None:
        """Our steps ``first..last`` were replaced by a state we loaded (we had diverged: a fork that did not
        survive); the next report lists them so the ledger does not credit them as run progress.
        Steps noted but not yet reported in that range are dropped from the claim, and so are the fork's
        receipts of them still in the book (module docstring, "Discards": the steps taken again before
        that report are claimed in it, their receipts go out in a later one)."""
        if last < first:
            return
        dropped = self.book.drop_steps(first, last)  # the journal's discard entry replays it
        if dropped:
            self.fork_receipts += dropped
            logger.info("dropped %d unsent receipts of the discarded steps %d-%d", dropped, first, last)
        self._open = [s for s in self._open if not first <= s.step <= last]
        self._lineage = journal.without_range(self._lineage, first, last)  # reported once
        self._discarded = journal.merge_ranges([*self._discarded, (first, last)], MAX_DISCARDED_PER_REPORT)
        self.journal.append(journal.discarded_steps(first, last))
        self._wakeup.set()

    def discard_stage(self, stage: int, first: int, last: int) -> None:
        """Our steps ``first..last`` of pipeline stage ``stage`` were replaced by a stage state we loaded
        (module docstring, "Stage discards"): the next report that carries no sealed receipt lists them;
        steps of that stage noted but not yet reported in that range are dropped from the claim, the
        fork's stage receipts of them still in the book are dropped and its trainer's receipts sealed."""
        if last < first:
            return
        dropped, sealed = self.book.drop_stage_steps(stage, first, last)  # the journal's entry replays it
        if dropped or sealed:
            self.fork_receipts += dropped
            logger.info(
                "stage %d steps %d-%d discarded: dropped %d unsent stage receipts, sealed %d trainer's",
                stage,
                first,
                last,
                dropped,
                sealed,
            )
        self._open = journal.without_stage_steps(self._open, stage, first, last)
        self._stage_discarded = journal.merge_stage_ranges(
            [*self._stage_discarded, (stage, first, last)], MAX_STAGE_DISCARDED_PER_REPORT
        )
        self.journal.append(journal.discarded_stage_steps(stage, first, last))
        self._wakeup.set()

    def stage_last_step(self, stage: int) -> int | None:
        """The highest step of pipeline ``stage`` this data dir took part in (journaled, reported or not),
        or None: what a restarted stage server lost if that stage's state it loads is older."""
        return self._stage_steps.get(stage)

    def _book_full(self) -> bool:
        """The book holds a report's worth of receipts and pull records (a little early at worst)."""
        return len(self.book) >= min(MAX_RECEIPTS_PER_REPORT, MAX_PULLED_PER_REPORT)

    def close_interval(self) -> None:
        """Turn the steps noted so far, and one report's worth of the receipt book, into one signed
        report, queued for sending. With no step but receipts (the last round's, arriving after its
        step was noted), the report claims nothing and carries them."""
        self.poll_relays()
        if (
            not self._open
            and not len(self.book)
            and not self._discarded
            and not self._stage_discarded
            and not self._has_relayed()
        ):
            return
        steps, self._open = self._open, []
        end = max([s.finished_at for s in steps] or [time.time()])
        end = max(end, self._last_end)
        # The ledger flags intervals longer than MAX_INTERVAL_S: a first report after a long wait (a
        # state download, no peers) covers only the last hour of it, which holds all of its compute.
        self._last_end = max(self._last_end, end - MAX_INTERVAL_S)
        # receipts of the discarded steps in the book now are the steps taken again: a later report's
        # (as the journal's replay takes them; the sealed ones first)
        receipts, pulled = self.book.take(hold=self._discarded, hold_stages=self._stage_discarded)
        discarded, self._discarded = self._discarded, []
        # the rest, and all while sealed receipts are left: a later report (module docstring)
        stage_discarded = [] if self.book.sealed else self._stage_discarded[:MAX_STAGE_DISCARDED_PER_REPORT]
        claim = min(self._relay_claim, MAX_COUNT)
        through = [
            RelayedBytes(relay, min(n, MAX_COUNT))
            for relay, n in self._relay_through.most_common(MAX_RELAYED_PER_REPORT)
        ]
        sent = min(self._sent_claim, MAX_COUNT)
        received = [
            ReceivedBytes(server, min(n, MAX_COUNT))
            for server, n in self._received.most_common(MAX_RECEIVED_PER_REPORT)
        ]
        report = ContributionReport(
            run_id=self.run_id,
            peer_id=self.identity.peer_id,
            seq=self._seq,
            global_step=max([s.step for s in steps] or [self._last_step]),
            samples=sum(s.samples for s in steps),
            compute_seconds=min(sum(s.compute_seconds for s in steps), end - self._last_end),
            bytes_aggregated=sum(s.bytes_aggregated for s in steps),
            bytes_relayed=claim,
            interval_start=self._last_end,
            interval_end=end,
            receipts=receipts,
            pulled=pulled,
            discarded=[StepRange(a, b) for a, b in discarded],
            relayed_through=through,
            bytes_sent=sent,
            received_from=received,
            stage_discarded=[StageStepRange(*r) for r in stage_discarded],
        )
        self._stage_discarded = journal.take_stage_discarded(self._stage_discarded, report)
        self._relay_claim -= claim
        journal.take_relayed(self._relay_through, report)
        self._sent_claim -= sent
        journal.take_received(self._received, report)
        self._last_end = end
        self._last_step = report.global_step
        self._seq += 1
        data = msgspec.msgpack.encode(report)
        signed = SignedReport(report=data, signature=self.identity.sign(report_payload(data)))
        # Journal first, seq file second: a crash between them leaves a journal that knows the seq.
        self.journal.append(journal.queued(signed))
        self._save_seq()
        # queued before the oldest is given up, as the journal replays it: the discards this report
        # lists cover the receipts the oldest puts back (journal.receipts_to_put_back)
        self._pending.append((signed, report))
        if len(self._pending) > MAX_PENDING_REPORTS:
            victim = journal.overflow_victim([queued for _, queued in self._pending])
            given_up = self._pending[victim][1]
            del self._pending[victim]
            logger.warning("report queue full: dropping unsent report %d (its receipts stay)", given_up.seq)
            self._give_up(given_up)
        if self.journal.wants_compaction():
            self._compact()
        self._wakeup.set()

    def _has_relayed(self) -> bool:
        return (
            self._relay_claim > 0 or bool(self._relay_through) or self._sent_claim > 0 or bool(self._received)
        )

    def _give_up(self, report: ContributionReport, *, refused: bool = False) -> None:
        """A report that will never be credited: its receipts and pull records go out with a later one
        (less the receipts of steps discarded since, a trainer's of a pending stage discard sealed again:
        module docstring, "Discards" and "Stage discards"), and so does its
        relayed bytes claim; its relay evidence too unless the backbone ``refused`` it
        (module docstring)."""
        self.journal.append(journal.done(report.seq, put_back=True, evidence_back=not refused))
        if report.receipts or report.pulled:
            later = (queued for _, queued in self._pending)
            receipts, sealed, dropped = journal.receipts_to_put_back(
                report, later, self._discarded, self._stage_discarded
            )
            self.fork_receipts += dropped  # a discard since covers them: never to be credited
            self.book.put_back(report.global_step, receipts, list(report.pulled), sealed)
        self._relay_claim += report.bytes_relayed
        self._sent_claim += report.bytes_sent
        if not refused:
            self._relay_through.update({r.relay: r.nbytes for r in report.relayed_through})
            self._received.update({r.server: r.nbytes for r in report.received_from})
        elif report.relayed_through:
            logger.info("report %s refused: its relay evidence is not sent again", report.seq)

    def close_all(self) -> None:
        """Before leaving: report the open steps and everything the receipt book holds; the flush that
        empties the queue then ends with this process's leave notice (its session closes)."""
        self._leaving = True
        self.close_interval()
        # Bounded: with the pending queue full, each report evicts an older one whose receipts return
        # to the book, so "until the book is empty" could loop forever on the trio thread.
        for _ in range(1 + len(self.book) + len(self._stage_discarded)):
            if not len(self.book) and not self._stage_discarded:
                break
            self.close_interval()
        self._wakeup.set()

    async def send_forever(self) -> None:
        while True:
            self.poll_relays()
            if not self._open and self._has_relayed() and time.time() - self._last_end >= self.interval:
                self.close_interval()  # a relay that takes no steps reports its relaying too
            await self.heartbeat()
            await self.flush()
            await trio.to_thread.run_sync(self.journal.sync)
            with trio.move_on_after(REPORT_RETRY):
                await self._wakeup.wait()
            self._wakeup = trio.Event()

    async def heartbeat(self) -> None:
        """Tell the backbone this process is alive, if a quarter of its session timeout has passed
        (the first call opens the session). Failures are counted and retried at the next call."""
        now = trio.current_time()
        if self.client is None or self._leaving or now - self._last_heartbeat < self.session_timeout / 4:
            return
        with self.tolerated.around("session heartbeat", PeerUnavailable, ProtocolError, AdmissionError):
            state = await self.client.session(self.session, "alive")
            self._last_heartbeat = now
            self.session_timeout = max(4 * REPORT_RETRY, state.timeout_s)

    async def flush(self) -> None:
        """Send what is queued; stops at the first failure (the rest waits for the next try). When
        leaving and the queue is empty, says so to the backbone (once)."""
        async with self._sending:
            if self.client is None:  # an open run: no ledger to send to
                for _, report in self._pending:
                    self.journal.append(journal.done(report.seq))
                self._pending.clear()
                return
            while self._pending:
                signed, report = self._pending[0]
                try:
                    receipt = await self.client.report(signed)
                except (PeerUnavailable, ProtocolError) as exc:  # a garbled answer: try again later
                    logger.info("contribution report not sent yet: %s", exc)
                    return
                except AdmissionError as exc:
                    logger.warning("contribution report refused: %s", exc)
                    self._give_up(report, refused=True)
                else:
                    self.journal.append(journal.done(report.seq))
                    self.sent += 1
                    self.credited += receipt.credited
                    if receipt.notes:
                        logger.info("report %s: evidence not counted: %s", report.seq, receipt.notes)
                    if not receipt.credited:
                        logger.warning("contribution report flagged: %s", receipt.reason)
                self._pending.popleft()
            if self._leaving and not self._left:
                with self.tolerated.around("leave notice", PeerUnavailable, ProtocolError, AdmissionError):
                    await self.client.session(self.session, "leave")
                    self._left = True

    @property
    def last_step(self) -> int:
        """The highest step this data dir ever took part in (reported, or journaled and not yet reported)."""
        return max([self._last_step, *(s.step for s in self._open)])

    @property
    def lineage(self) -> dict[int, bytes]:
        """The fingerprints of the last steps recorded with one and not discarded (``volunteer.journal``):
        after a restart, the earlier process's, for :class:`volunteer.collab.sync.StateSync`."""
        return dict(self._lineage)

    @property
    def pending(self) -> int:
        return len(self._pending)
