"""The reporter's journal: what a volunteer contributed survives a SIGKILL (``reports.journal``).

The contribution reporter (:class:`volunteer.training.Reporter`) keeps its work in memory until it is
reported: the steps of the current interval (~10 s), the receipt book, and the queue of signed reports
no backbone has acknowledged yet. A process killed without warning (SIGKILL, out of memory, a pulled
plug) lost all of that. The journal is an append-only log of everything that changes that state, one
entry per line, in the volunteer's data dir; a new process replays it, resends what was queued, reports
the steps that were never reported, and carries on. What is journaled:

=============  ============================================================================================
``opened``     a reporter started at ``t`` (its first report's interval begins there)
``stepped``    one step we took part in, recorded *after* its round completed and the step was applied:
               samples accumulated but never averaged are not run progress and are never journaled;
               with the step's ``fingerprint`` when the caller gave one (the step's parameters: see below),
               and in a swarm run the pipeline ``stage`` whose step it is
``booked``     one round's receipts and pull records, as the averaging side put them in the receipt book
               (``held``: written by compaction, one step as the book held it, restored whole, every
               put-back receipt included, :meth:`~volunteer.receipts.ReceiptBook.restore`)
``queued``     a report was closed: its signed bytes and signature (it took the open steps, the pending
               discards and one report's worth of the book less the receipts of the pending discards'
               steps, exactly as replaying ``take(hold=discards, hold_stages=stage discards)`` on the
               replayed book does; the stage discards it lists are those it carries)
``done``       a queued report was acknowledged (recorded or a duplicate) or given up (``put_back``: its
               receipts and relayed bytes claim went back into the book, less the receipts of steps
               discarded since, a trainer's of a pending stage discard sealed again,
               :func:`receipts_to_put_back`; ``evidence_back``: its relay evidence too)
``discarded``  our steps ``first..last`` were replaced by a state we loaded (a fork that did not survive):
               replayed as :meth:`~volunteer.reporting.Reporter.discard` does, it drops them from the
               open steps and the lineage, and the fork's receipts of them from the book (see below)
``stage_discarded``
               in a swarm run, our steps ``first..last`` of pipeline stage ``stage`` were replaced by a
               stage state we loaded: replayed as ``Reporter.discard_stage`` does, it drops them from the
               open steps and the fork's stage receipts of them from the book, and seals its trainer's
               receipts of them (:mod:`volunteer.receipts`, "Stage discards")
``sealed``     written by compaction: the book's sealed trainer's receipts (``ReceiptBook.sealed``)
``relayed``    bytes our relay service spliced (``claim``) and bytes we received through each relay
               (``through``) since the previous such entry: what the next report claims and evidences;
               in a swarm run also the pipeline bytes we sent (``sent``) and the answer bytes our
               trainers received from each stage server (``received``; ``Reporter.swarm_traffic``)
``state``      written by compaction: the next seq, where the next interval begins, the lineage, and
               the highest step of each pipeline stage we served (``stages``)
=============  ============================================================================================

**Stage steps** (swarm runs): the highest step of each stage this data dir took part in
(:attr:`Replayed.stage_steps`, from the ``stepped`` entries with a ``stage`` and the ``state`` entry) is
what a restarted stage server compares with the first state of that stage it loads, to report the
earlier process's stage steps it lost (:mod:`volunteer.swarm.stage_service`, "Discards"). Pending stage
discards are merged per stage (:func:`merge_stage_ranges`, at most ``MAX_STAGE_DISCARDED_PER_REPORT``
ranges per stage); a report carries the first ``MAX_STAGE_DISCARDED_PER_REPORT`` of them and the rest
waits for the next (a ``queued`` entry takes back exactly what its report carried). The ``stage`` fields
are omitted when absent and ``stage_discarded`` is a tag of its own, so a journal of a data-parallel run
has the bytes of the version before them, and a version before them skips (counting it damaged) a stage
discard rather than reading it as a data-parallel one.

**Lineage** (:attr:`Replayed.lineage`): the fingerprints of the last
:data:`~shared.state.lineage.LINEAGE_STEPS` steps journaled with one, minus those discarded since
(``extend_lineage`` as each step is journaled; a ``discarded`` entry drops its range; compaction keeps
it in the ``state`` entry as ``encode_lineage`` text, at most :data:`~shared.state.lineage.MAX_TEXT`
characters, anything malformed read as none). A restarted volunteer compares it with the lineage of the
first state it loads, so that its earlier process's steps that were taken again differently after a
rollback are reported discarded (:mod:`volunteer.collab.sync`). Journals of older versions have no
fingerprints and no lineage: they load, with an empty lineage (the step numbers alone then decide).

**Discards and the book** (:mod:`volunteer.receipts`, "Discards" and "Stage discards"): entries replay
in the order they happened, so a ``discarded`` or ``stage_discarded`` entry drops (or seals) only the
receipts booked before it (the fork's), and a ``queued`` entry holds back those booked after it (the
steps taken again, for a report after the discard's). A compacted journal writes the pending discards
*before* the held book and the open steps, which are all that is left after the discard (what it dropped
or sealed is gone from them, what it did not is the steps taken again), and the sealed receipts in a
``sealed`` entry of their own (a version before it skips the entry, counting it damaged: the fork's
trainer's receipts are lost, never sent after the discard). A compacted journal of the version before
the stage rules wrote its pending stage discards before a book that may still hold the fork's receipts of
them: replayed now, those are held as steps taken again (the swarm mode has no released version).
A compacted journal of an older version wrote them after the book: replayed now, its receipts of the
discarded steps are dropped (the older reporter would have sent them with the discard, marked
discarded by the ledger: no credit lost compared with it).

**Line format**: ``<crc32 of the JSON, 8 hex digits> <JSON>\\n``. Replay reads line by line and skips
(counting them) lines whose checksum or JSON does not check out: a torn last line after SIGKILL, or
garbage, never stops a volunteer. The file is rewritten on open (compacted, so a torn tail is gone
before the first append) and whenever it grows past twice its compacted size and
:data:`COMPACT_BYTES`; a compacted journal holding more than :data:`MAX_JOURNAL_BYTES` drops its oldest
queued reports (logged; they stay queued in memory), so the file stays below about twice that however
long no backbone answers (16 MiB hold over a thousand full reports: hours of work).

**Durability**: every entry is written with one ``write`` to the kernel as it happens, which a killed
*process* cannot lose; ``fdatasync`` runs off the event loop at most every few seconds
(:meth:`ReportJournal.sync`), so an OS crash or power loss loses at most those seconds. Compaction
writes a temporary file, syncs it and renames it over the journal.

**Sequence numbers**: replay yields the next seq as one more than the largest seq ever queued, and the
reporter takes the larger of that and ``report.seq`` (kept for data dirs of older versions): a restart
never reuses a seq. A queued report resent after a restart is the *same* signed report (same seq), which
the ledger credits once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import zlib
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from protocols.ledger import (
    MAX_DISCARDED_PER_REPORT,
    MAX_STAGE_DISCARDED_PER_REPORT,
    ContributionReport,
    SignedReport,
)
from protocols.receipts import PulledSlice, SignedReceipt, decode_receipt
from shared.errors import ProtocolError
from shared.portable import fdatasync
from shared.state.lineage import FINGERPRINT_BYTES, decode_lineage, encode_lineage, extend_lineage

from .receipts import ReceiptBook, in_ranges

__all__ = [
    "COMPACT_BYTES",
    "JOURNAL_FILE",
    "MAX_JOURNAL_BYTES",
    "JournaledStep",
    "Replayed",
    "ReportJournal",
    "merge_ranges",
    "merge_stage_ranges",
    "overflow_victim",
    "receipts_to_put_back",
    "take_received",
    "take_relayed",
]

logger = logging.getLogger(__name__)
JOURNAL_FILE = "reports.journal"
COMPACT_BYTES = 1 << 20
MAX_JOURNAL_BYTES = 16 << 20
_REPORT_DECODER = msgspec.msgpack.Decoder(ContributionReport)


class JournaledStep(msgspec.Struct, frozen=True, tag="stepped", tag_field="k", omit_defaults=True):
    """What a report needs of one step (``volunteer.collab``'s StepRecord without loss and timing)."""

    step: int
    samples: int
    compute_seconds: float
    bytes_aggregated: int
    finished_at: float
    fingerprint: bytes | None = None  # of the parameters after the step (module docstring, "Lineage")
    #: a swarm run's pipeline stage whose step it is (module docstring, "Stage steps")
    stage: int | None = None


class _Opened(msgspec.Struct, frozen=True, tag="opened", tag_field="k"):
    t: float


class _Booked(msgspec.Struct, frozen=True, tag="booked", tag_field="k", omit_defaults=True):
    step: int
    receipts: list[tuple[str, SignedReceipt]]
    pulled: list[PulledSlice]
    stage: int | None = None  # a swarm run's pipeline stage (volunteer.receipts); omitted when None
    #: written by compaction: the step as the book held it, restored whole (ReceiptBook.restore), not
    #: booked again (add's per-step cap would drop most of a given-up report's put-back receipts)
    held: bool = False


class _Queued(msgspec.Struct, frozen=True, tag="queued", tag_field="k"):
    report: bytes
    signature: bytes


class _Done(msgspec.Struct, frozen=True, tag="done", tag_field="k"):
    seq: int
    put_back: bool = False
    evidence_back: bool = False


class _Relayed(msgspec.Struct, frozen=True, tag="relayed", tag_field="k"):
    claim: int = 0
    through: dict[str, int] = {}
    sent: int = 0  # swarm bytes sent (our claim, ``bytes_sent``)
    received: dict[str, int] = {}  # swarm answer bytes received per server (``received_from``)


class _Discarded(msgspec.Struct, frozen=True, tag="discarded", tag_field="k"):
    first: int
    last: int


class _StageDiscarded(msgspec.Struct, frozen=True, tag="stage_discarded", tag_field="k"):
    stage: int
    first: int
    last: int


class _Sealed(msgspec.Struct, frozen=True, tag="sealed", tag_field="k"):
    receipts: list[SignedReceipt]


class _State(msgspec.Struct, frozen=True, tag="state", tag_field="k", omit_defaults=True):
    seq: int
    last_end: float
    last_step: int
    lineage: str = ""  # encode_lineage of Replayed.lineage (absent in journals of older versions)
    stages: dict[int, int] = {}  # Replayed.stage_steps (absent in journals of older versions)


Entry = (
    _Opened
    | JournaledStep
    | _Booked
    | _Queued
    | _Done
    | _Discarded
    | _StageDiscarded
    | _Sealed
    | _State
    | _Relayed
)
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Entry)


@dataclass
class Replayed:
    """The reporter's state as the journal left it."""

    book: ReceiptBook
    seq: int = 0
    last_end: float | None = None  # where the next interval begins (None: nothing journaled)
    last_step: int = 0
    open_steps: list[JournaledStep] = field(default_factory=list)
    #: queued reports not acknowledged, oldest first: (signed, decoded)
    unsent: deque[tuple[SignedReport, ContributionReport]] = field(default_factory=deque)
    discarded: list[tuple[int, int]] = field(default_factory=list)
    #: swarm runs: ``(stage, first, last)`` ranges of our stage steps discarded, not in a report yet
    stage_discarded: list[tuple[int, int, int]] = field(default_factory=list)
    #: swarm runs: per pipeline stage, the highest step of it we took part in (module docstring)
    stage_steps: dict[int, int] = field(default_factory=dict)
    #: bytes our relay spliced, and bytes received through each relay, not in a report yet
    relay_claim: int = 0
    relay_through: Counter[str] = field(default_factory=Counter)
    #: swarm bytes we sent, and answer bytes received from each stage server, not in a report yet
    sent_claim: int = 0
    received: Counter[str] = field(default_factory=Counter)
    #: fingerprints of the last steps journaled with one, not discarded since (module docstring)
    lineage: dict[int, bytes] = field(default_factory=dict)
    damaged: int = 0  # lines skipped


def replay_into(entries: list[Entry], book: ReceiptBook) -> Replayed:
    """Apply ``entries`` in order (pure: no I/O). ``book`` is filled as the live one was."""
    state = Replayed(book)
    for entry in entries:
        if isinstance(entry, _Opened):
            if not state.open_steps:
                state.last_end = max(state.last_end or entry.t, entry.t)
        elif isinstance(entry, JournaledStep):
            state.open_steps.append(entry)
            state.lineage = with_step(state.lineage, entry)
            note_stage_step(state.stage_steps, entry)
        elif isinstance(entry, _Booked) and entry.held:
            book.restore(entry.step, [r for _, r in entry.receipts], entry.pulled, stage=entry.stage)
        elif isinstance(entry, _Booked):
            book.add(entry.step, entry.receipts, entry.pulled, stage=entry.stage)
        elif isinstance(entry, _Relayed):
            state.relay_claim += entry.claim
            state.relay_through.update(entry.through)
            state.sent_claim += entry.sent
            state.received.update(entry.received)
        elif isinstance(entry, _Discarded):  # as Reporter.discard does
            first, last = entry.first, entry.last
            state.open_steps = [s for s in state.open_steps if not first <= s.step <= last]
            book.drop_steps(first, last)
            state.discarded = merge_ranges([*state.discarded, (first, last)], MAX_DISCARDED_PER_REPORT)
            state.lineage = without_range(state.lineage, first, last)
        elif isinstance(entry, _StageDiscarded):  # as Reporter.discard_stage does
            state.open_steps = without_stage_steps(state.open_steps, entry.stage, entry.first, entry.last)
            book.drop_stage_steps(entry.stage, entry.first, entry.last)
            state.stage_discarded = merge_stage_ranges(
                [*state.stage_discarded, (entry.stage, entry.first, entry.last)],
                MAX_STAGE_DISCARDED_PER_REPORT,
            )
        elif isinstance(entry, _Sealed):
            book.seal(entry.receipts)
        elif isinstance(entry, _State):
            state.seq = max(state.seq, entry.seq)
            state.last_end = max(state.last_end or entry.last_end, entry.last_end)
            state.last_step = entry.last_step
            state.lineage = decode_lineage(entry.lineage)
            for stage, step in entry.stages.items():
                state.stage_steps[stage] = max(state.stage_steps.get(stage, step), step)
        elif isinstance(entry, _Queued):
            try:
                report = _REPORT_DECODER.decode(entry.report)
            except (msgspec.MsgspecError, ValueError):
                state.damaged += 1
                continue
            # what close_interval took from the live book
            book.take(hold=state.discarded, hold_stages=state.stage_discarded)
            state.open_steps.clear()
            state.discarded.clear()  # close_interval takes them all
            state.stage_discarded = take_stage_discarded(state.stage_discarded, report)
            take_relayed(state.relay_through, report)  # and what the report carried of these
            state.relay_claim = max(0, state.relay_claim - report.bytes_relayed)
            take_received(state.received, report)
            state.sent_claim = max(0, state.sent_claim - report.bytes_sent)
            state.seq = max(state.seq, report.seq + 1)
            state.last_end = report.interval_end
            state.last_step = report.global_step
            state.unsent.append((SignedReport(report=entry.report, signature=entry.signature), report))
        elif isinstance(entry, _Done):
            for i, (_, report) in enumerate(state.unsent):
                if report.seq == entry.seq:
                    del state.unsent[i]
                    if entry.put_back and (report.receipts or report.pulled):
                        later = (queued for _, queued in state.unsent)
                        receipts, sealed, _ = receipts_to_put_back(
                            report, later, state.discarded, state.stage_discarded
                        )
                        book.put_back(report.global_step, receipts, list(report.pulled), sealed)
                    if entry.put_back:
                        state.relay_claim += report.bytes_relayed
                        state.sent_claim += report.bytes_sent
                    if entry.evidence_back:
                        state.relay_through.update({r.relay: r.nbytes for r in report.relayed_through})
                        state.received.update({r.server: r.nbytes for r in report.received_from})
                    break
    return state


def with_step(lineage: dict[int, bytes], step: JournaledStep) -> dict[int, bytes]:
    """``lineage`` with ``step``'s fingerprint (unchanged for a step journaled without one)."""
    if step.fingerprint is None or len(step.fingerprint) != FINGERPRINT_BYTES:
        return lineage
    return extend_lineage(lineage, step.step, step.fingerprint)


def without_range(lineage: dict[int, bytes], first: int, last: int) -> dict[int, bytes]:
    """``lineage`` without the steps ``first..last`` (discarded: reported once, never compared again)."""
    return {s: f for s, f in lineage.items() if not first <= s <= last}


def note_stage_step(stage_steps: dict[int, int], step: JournaledStep) -> None:
    """Raise ``stage_steps[stage]`` to ``step``'s step, for a step of a pipeline stage."""
    if step.stage is not None:
        stage_steps[step.stage] = max(stage_steps.get(step.stage, step.step), step.step)


def without_stage_steps(steps: list[JournaledStep], stage: int, first: int, last: int) -> list[JournaledStep]:
    """``steps`` without those of ``stage`` in ``first..last`` (discarded: not claimed)."""
    return [s for s in steps if not (s.stage == stage and first <= s.step <= last)]


def take_stage_discarded(
    pending: list[tuple[int, int, int]], report: ContributionReport
) -> list[tuple[int, int, int]]:
    """``pending`` without the stage discards ``report`` carried (as the reporter took them)."""
    carried = {(r.stage, r.first, r.last) for r in report.stage_discarded}
    return [r for r in pending if r not in carried]


def receipts_to_put_back(
    report: ContributionReport,
    queued: Iterable[ContributionReport],
    pending: Iterable[tuple[int, int]],
    pending_stages: Iterable[tuple[int, int, int]] = (),
) -> tuple[list[SignedReceipt], list[SignedReceipt], int]:
    """What becomes of the receipts of the given-up ``report`` (:mod:`volunteer.receipts`, "Discards" and
    "Stage discards"): those that go back into the book, those sealed again, and how many neither. A
    receipt a discard made since covers (one listed by a ``queued`` report of a larger seq, or
    ``report``'s own, or ``pending``: not in a report yet) would have been marked discarded, delivered in
    ``report``; sent again after that discard's report it would be credited as a step taken again, which
    it is not. So it is not put back, except a trainer's receipt that only a pending stage discard
    (``pending_stages``) covers: it can still go out before that discard's report, sealed, and its bytes
    stay evidence."""
    later = [r for r in queued if r.seq > report.seq]
    listed = [
        *((r.first, r.last) for q in later for r in q.discarded),
        *((r.first, r.last) for r in report.discarded),
    ]
    listed_stages = [
        *((r.stage, r.first, r.last) for q in later for r in q.stage_discarded),
        *((r.stage, r.first, r.last) for r in report.stage_discarded),
    ]
    ranges, stage_ranges = [*pending, *listed], list(pending_stages)
    kept: list[SignedReceipt] = []
    sealed: list[SignedReceipt] = []
    for signed in report.receipts:
        if in_ranges(signed, ranges, listed_stages):
            continue
        if not in_ranges(signed, (), stage_ranges):
            kept.append(signed)
        elif decode_receipt(signed.receipt).carried:  # covered: it decodes
            sealed.append(signed)
    return kept, sealed, len(report.receipts) - len(kept) - len(sealed)


def overflow_victim(queued: Sequence[ContributionReport]) -> int:
    """Which of the ``queued`` reports (oldest first, at least one) an overflowing queue gives up: the
    oldest that lists no discard, data-parallel or stage; the oldest of all if each lists one
    (:mod:`volunteer.reporting`: a given-up discard is lost, its fork's delivered receipts stay credited)."""
    if not queued:
        raise ValueError("no queued report to give up")
    return next((i for i, r in enumerate(queued) if not r.discarded and not r.stage_discarded), 0)


def take_relayed(through: Counter[str], report: ContributionReport) -> None:
    """Remove what ``report`` carried of the relay evidence ``through`` (as the reporter took it)."""
    _take(through, ((r.relay, r.nbytes) for r in report.relayed_through))


def take_received(received: Counter[str], report: ContributionReport) -> None:
    """Remove what ``report`` carried of the swarm evidence ``received`` (as the reporter took it)."""
    _take(received, ((r.server, r.nbytes) for r in report.received_from))


def _take(counts: Counter[str], carried: Iterable[tuple[str, int]]) -> None:
    """Subtract each carried ``(peer, bytes)`` from ``counts``, dropping peers that reach zero."""
    for peer, nbytes in carried:
        left = counts[peer] - nbytes
        if left > 0:
            counts[peer] = left
        else:
            del counts[peer]


def merge_ranges(ranges: list[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """Sorted, overlapping or adjacent ranges merged; beyond ``limit`` ranges the closest ones are joined
    (a wider range discards more of our own steps, never fewer)."""
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    while len(merged) > limit:
        gaps = [merged[i + 1][0] - merged[i][1] for i in range(len(merged) - 1)]
        i = gaps.index(min(gaps))
        merged[i : i + 2] = [(merged[i][0], merged[i + 1][1])]
    return merged


def merge_stage_ranges(ranges: list[tuple[int, int, int]], limit: int) -> list[tuple[int, int, int]]:
    """``(stage, first, last)`` ranges merged per stage as :func:`merge_ranges` merges (at most ``limit``
    per stage, the closest joined: more of our own steps, never fewer), sorted by stage and first step.
    Ranges with ``last < first`` are dropped."""
    by_stage: dict[int, list[tuple[int, int]]] = {}
    for stage, first, last in ranges:
        if first <= last:
            by_stage.setdefault(stage, []).append((first, last))
    return [
        (stage, first, last)
        for stage in sorted(by_stage)
        for first, last in merge_ranges(by_stage[stage], limit)
    ]


def encode_line(entry: Entry) -> bytes:
    body = _ENCODER.encode(entry)
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def decode_lines(data: bytes) -> tuple[list[Entry], int]:
    """The entries of a journal's bytes and how many lines were skipped (torn, garbage, bad checksum)."""
    entries: list[Entry] = []
    damaged = 0
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        lines.pop()  # a torn last line (no newline: the process died mid-write)
        damaged += 1
    for line in lines:
        crc, _, body = line.partition(b" ")
        try:
            if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
                raise ValueError("checksum")
            entries.append(_DECODER.decode(body))
        except (ValueError, msgspec.MsgspecError):
            damaged += 1
    return entries, damaged


class ReportJournal:
    """The append-only journal file of the module docstring (synchronous; the reporter calls
    :meth:`append` on the trio thread — one small ``write`` — and :meth:`sync` in a worker thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._size = 0
        self._compacted = 0
        self.failures = 0  # writes that failed (disk full...): counted, logged, never raised

    def replay(self, book: ReceiptBook) -> Replayed:
        """Read and apply the journal (missing: an empty state). Never raises for damaged content."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            logger.warning("cannot read %s (%s): starting without it", self.path, exc)
            data = b""
        entries, damaged = decode_lines(data)
        state = replay_into(entries, book)
        state.damaged += damaged
        if state.damaged:
            logger.warning("%s: skipped %d damaged lines (a torn write after a crash?)", self.path, damaged)
        return state

    def rewrite(self, entries: list[Entry]) -> None:
        """Replace the journal by ``entries`` (compaction): write, sync, rename, reopen for appending."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = b"".join(encode_line(e) for e in entries)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, data)
                fdatasync(fd)
            finally:
                os.close(fd)
            tmp.replace(self.path)
            with contextlib.suppress(OSError):  # the rename's durability; not available everywhere
                dir_fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            self.close()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            self._failed("rewrite", exc)
            return
        self._size = self._compacted = len(data)

    def append(self, entry: Entry) -> None:
        if self._fd is None:
            return
        line = encode_line(entry)
        try:
            os.write(self._fd, line)
        except OSError as exc:
            self._failed("append to", exc)
            return
        self._size += len(line)

    def wants_compaction(self) -> bool:
        return self._size > max(COMPACT_BYTES, 2 * self._compacted)

    def sync(self) -> None:
        """``fdatasync`` the journal (blocking: call it in a worker thread)."""
        fd = self._fd
        if fd is not None:
            try:
                fdatasync(fd)
            except OSError as exc:
                self._failed("sync", exc)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _failed(self, what: str, exc: OSError) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            logger.warning("could not %s %s (%d failures): %s", what, self.path, self.failures, exc)


def compacted(
    seq: int,
    last_end: float,
    last_step: int,
    book: ReceiptBook,
    unsent: list[tuple[SignedReport, ContributionReport]],
    open_steps: list[JournaledStep],
    discarded: list[tuple[int, int]],
    relay_claim: int = 0,
    relay_through: dict[str, int] | None = None,
    sent_claim: int = 0,
    received: dict[str, int] | None = None,
    lineage: dict[int, bytes] | None = None,
    stage_discarded: list[tuple[int, int, int]] | None = None,
    stage_steps: dict[int, int] | None = None,
) -> list[Entry]:
    """The entries that replay to this state, oldest queued reports dropped beyond the size bound."""
    held: list[Entry] = [_Sealed(book.sealed)] if book.sealed else []
    for stage, step, receipts, pulled in book.held_by_stage():
        pairs = []
        for signed in receipts:
            try:
                pairs.append((decode_receipt(signed.receipt).aggregator, signed))
            except ProtocolError:
                continue
        held.append(_Booked(step, pairs, pulled, stage, held=True))
    queued: list[Entry] = [_Queued(s.report, s.signature) for s, _ in unsent]
    budget = MAX_JOURNAL_BYTES - sum(len(encode_line(e)) for e in held)
    sizes = [len(encode_line(e)) for e in queued]
    dropped = 0
    while queued and sum(sizes) > budget:
        queued.pop(0)
        sizes.pop(0)
        dropped += 1
    if dropped:
        logger.warning("report journal full: %d oldest unsent reports are kept in memory only", dropped)
    # A queued entry replays take() on the book: with the queue first, take() meets an empty book (a
    # no-op), then the held steps are booked; the state after the queue overrides what it set.
    return [
        *queued,
        _State(seq, last_end, last_step, encode_lineage(lineage or {}), dict(stage_steps or {})),
        # discards before the book and the open steps: a receipt or an open step of a pending discard's
        # steps is that step taken again after the discard (replayed after it, it would be dropped)
        *(_Discarded(a, b) for a, b in discarded),
        *(_StageDiscarded(k, a, b) for k, a, b in stage_discarded or []),
        *held,
        *open_steps,
        *(
            [_Relayed(relay_claim, dict(relay_through or {}), sent_claim, dict(received or {}))]
            if relay_claim or relay_through or sent_claim or received
            else []
        ),
    ]


def opened(t: float) -> Entry:
    return _Opened(t)


def queued(signed: SignedReport) -> Entry:
    return _Queued(signed.report, signed.signature)


def done(seq: int, put_back: bool = False, evidence_back: bool = False) -> Entry:
    return _Done(seq, put_back, evidence_back)


def relayed(
    claim: int, through: dict[str, int], sent: int = 0, received: dict[str, int] | None = None
) -> Entry:
    return _Relayed(claim, through, sent, dict(received or {}))


def booked(
    step: int,
    receipts: list[tuple[str, SignedReceipt]],
    pulled: list[PulledSlice],
    stage: int | None = None,
) -> Entry:
    return _Booked(step, receipts, pulled, stage)


def discarded_steps(first: int, last: int) -> Entry:
    return _Discarded(first, last)


def discarded_stage_steps(stage: int, first: int, last: int) -> Entry:
    return _StageDiscarded(stage, first, last)
