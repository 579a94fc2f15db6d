"""The receipts a volunteer holds until its next contribution report carries them (protocols.receipts).

The averaging side (``volunteer.collab``) adds what each finished round left: the part receipts
aggregators signed for this peer, and what this peer pulled from each aggregator. The reporting side
(``volunteer.session``) takes at most one report's worth at a time. The book is bounded: it keeps at most
:data:`RECEIPTS_PER_STEP` receipts per step (preferring aggregators other than this peer) and at most
:data:`MAX_HELD_STEPS` steps' worth; the oldest go first when it overflows (counted in ``dropped``), so a
backbone that is unreachable for hours cannot make a volunteer grow without bound.

A step is a ``(stage, step)`` pair: in a swarm run each pipeline stage counts its own steps
(``stage``: the stage whose collaboration took the step; None: a data-parallel run's global step), and a
server that moved between stages holds receipts of one step number of two stages, each bounded apart.

A swarm *trainer*'s receipts (``carried``: :mod:`protocols.receipts`, "Trainers' receipts") are
cumulative per ``(server, stage, step)``: for each ``(stage, step)`` the book keeps the latest (largest)
of each server, apart from the part receipts of that step, for at most :data:`CARRIED_PER_STEP` servers
(later servers' are dropped and counted in ``dropped_carried``). A trainer sends a backward to any server
of a stage, so a stage step of a busy stage can see a few; the step bound above applies to both kinds.

**Discards** (the ledger's rule: :mod:`backbone.ledger.accounting`, "discarded steps"). When the
volunteer re-syncs and discards its steps ``first..last`` (a fork that did not survive), the report that
lists the discard (seq ``d``) has the ledger mark discarded every receipt of those steps carried by the
sender's reports of seq ``<= d``, while those of later reports count (the steps taken again). So the book
must put no receipt of those steps of *either* history in a report after the discard's, and none of the
steps taken again in the discard's report or before:

* :meth:`ReceiptBook.drop_steps`, at the discard: the fork's data-parallel part receipts of those steps
  still held are dropped (counted by the reporter). Sent, they could only ever be marked discarded (in a
  report of seq ``<= d``) or credited as steps taken again (in a later one: false credit), and kept they
  would fill the step's :data:`RECEIPTS_PER_STEP` before the receipts of the step taken again. What is
  lost is their line in the leaderboard's ``discarded_samples`` (work shown apart, never credited).
  Pull records stay: the ledger never discards them (they are the evidence of *another* user's
  aggregation work, counted once per ``(puller, aggregator, step)`` for a step the run recorded).
* :meth:`ReceiptBook.take` with ``hold``, for the report that lists the discards ``hold``: receipts of
  those steps in the book then were booked after the discard (the steps taken again), so they stay in
  the book for a later report.

Both are decided by the step each receipt signs (a receipt put back under its report's step is judged by
its own), so the reporter's journal replays them exactly (:mod:`volunteer.journal`).

**Stage discards** (a swarm server's, ``Reporter.discard_stage``; the ledger's rule:
:mod:`backbone.ledger.accounting`, "Swarm runs", *discards*). A stage discard of ``(stage, first, last)``
listed by the report of seq ``d`` has the ledger mark discarded the sender's *stage* receipts of those
stage steps and its *trainer's* receipts of them (``carried``: a volunteer that serves and trains) in its
reports of seq ``<= d``, and credit those of later reports as the stage steps taken again. The same two
rules apply per stage, except that a trainer's receipts of the fork are never dropped:

* :meth:`ReceiptBook.drop_stage_steps`, at the discard: the fork's stage part receipts of those steps
  still held are dropped, exactly as data-parallel ones (only their line in ``discarded_samples`` is
  lost). The fork's trainer's receipts of them are *sealed* instead: taken out of their ``(stage, step)``
  slot into a set of their own (the larger per ``(stage, step, server)``) that every :meth:`take` empties
  first, and the reporter lists no stage discard while one is sealed, so all of them go out in the
  discard's report or before it. Their ``nbytes`` are evidence of the trainer's sending even discarded
  (the ledger counts the bytes of a discarded trainer's receipt: bytes really sent): dropped, that
  evidence would be lost; sent after the discard's report, their samples would be credited as a stage
  step taken again (false credit). Freeing the slot also lets the step taken again be booked at all: a
  server's cumulative tally of a step it took again may restart below the fork's receipt, which the slot
  (the larger per server) would otherwise keep.
* :meth:`ReceiptBook.take` with ``hold_stages``, the *pending* stage discards (all of them: also those the
  report leaves to a later one, whose listing covers this report too): the stage and trainer's receipts
  of those stage steps in the book then (sealed ones aside) were booked after the discard (the stage
  steps taken again), so they stay in the book for a report after the one listing it.

A report given up (:func:`volunteer.journal.receipts_to_put_back`) puts back no receipt a discard listed
since (by a later queued report, or its own) covers: it can no longer go out before that discard's
report; of those only a pending stage discard covers, a trainer's receipt is sealed again and a stage
part receipt dropped. The ledger stores one trainer's receipt per ``(trainer, server, stage, step)``: a
receipt of the stage step taken again from the same server replaces the fork's row, bytes included (a
limit of the ledger's evidence, not of the book).

Plain Python, no trio, no locks: every call runs on the trio thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from protocols.errors import ProtocolError
from protocols.receipts import (
    MAX_PULLED_PER_REPORT,
    MAX_RECEIPTS_PER_REPORT,
    RECEIPTS_PER_STEP,
    PartReceipt,
    PulledSlice,
    SignedReceipt,
    decode_receipt,
)

__all__ = ["CARRIED_PER_STEP", "MAX_HELD_STEPS", "ReceiptBook", "in_ranges"]

#: Steps whose receipts a volunteer holds before dropping the oldest (hours of steps at 1 step/s).
MAX_HELD_STEPS = 4096
#: Servers whose trainer's receipts the book keeps per ``(stage, step)`` (module docstring).
CARRIED_PER_STEP = 8


def in_ranges(
    signed: SignedReceipt,
    ranges: Sequence[tuple[int, int]],
    stage_ranges: Sequence[tuple[int, int, int]] = (),
) -> bool:
    """A discard covers ``signed`` (module docstring): a data-parallel discard of one of ``ranges``
    (``(first, last)``, both included) covers a data-parallel part receipt of a step in it, and a stage
    discard of one of ``stage_ranges`` (``(stage, first, last)``) a stage's part receipt or a trainer's
    receipt of a step of that stage in it. Bytes that do not decode are covered by none (the ledger
    refuses those wherever they go)."""
    if not ranges and not stage_ranges:
        return False
    receipt = _decoded(signed)
    return receipt is not None and _covers(receipt, ranges, stage_ranges)


def _covers(
    receipt: PartReceipt, ranges: Sequence[tuple[int, int]], stage_ranges: Sequence[tuple[int, int, int]]
) -> bool:
    if receipt.stage is None:
        return not receipt.carried and any(first <= receipt.step <= last for first, last in ranges)
    return any(k == receipt.stage and first <= receipt.step <= last for k, first, last in stage_ranges)


@dataclass
class _Step:
    receipts: list[SignedReceipt] = field(default_factory=list)
    pulled: list[PulledSlice] = field(default_factory=list)
    #: a trainer's receipts: per server, the latest (weight, receipt)
    carried: dict[str, tuple[float, SignedReceipt]] = field(default_factory=dict)

    def all_receipts(self) -> list[SignedReceipt]:
        return [*self.receipts, *(r for _, r in self.carried.values())]


@dataclass
class ReceiptBook:
    peer_id: str
    max_steps: int = MAX_HELD_STEPS
    dropped: int = 0  # steps dropped on overflow
    dropped_carried: int = 0  # trainer's receipts of servers beyond CARRIED_PER_STEP
    _steps: OrderedDict[tuple[int | None, int], _Step] = field(default_factory=OrderedDict)
    #: a stage discard's sealed trainer's receipts (module docstring), by (stage, step, server): the
    #: larger (weight, receipt); every take empties them first
    _sealed: OrderedDict[tuple[int, int, str], tuple[float, SignedReceipt]] = field(
        default_factory=OrderedDict
    )
    #: called with each :meth:`add`'s arguments first (the reporter journals them: volunteer.journal)
    on_add: Callable[[int, list[tuple[str, SignedReceipt]], list[PulledSlice], int | None], None] | None = (
        None
    )

    def add(
        self,
        step: int,
        receipts: Iterable[tuple[str, SignedReceipt]],
        pulled: Iterable[PulledSlice] = (),
        *,
        stage: int | None = None,
    ) -> None:
        """Hold what one round of ``step`` (of pipeline stage ``stage``; None: data-parallel) left.
        ``receipts``: (aggregator peer id, signed receipt)."""
        receipts, pulled = list(receipts), list(pulled)
        if self.on_add is not None:
            self.on_add(step, receipts, pulled, stage)
        entry = self._steps.setdefault((stage, step), _Step())
        receipts = self._keep_carried(entry, receipts)
        others = [(a, r) for a, r in receipts if a != self.peer_id]
        own = [(a, r) for a, r in receipts if a == self.peer_id]
        self._hold(entry, [r for _, r in [*others, *own]], pulled, RECEIPTS_PER_STEP)

    def _hold(
        self, entry: _Step, receipts: list[SignedReceipt], pulled: list[PulledSlice], cap: int | None
    ) -> None:
        """Append to ``entry`` the ``receipts`` it lacks (up to ``cap`` in all) and ``pulled``; drop the
        oldest steps beyond :attr:`max_steps`."""
        for receipt in receipts:
            if cap is not None and len(entry.receipts) >= cap:
                break
            if receipt not in entry.receipts:
                entry.receipts.append(receipt)
        entry.pulled.extend(pulled)
        while len(self._steps) > self.max_steps:
            self._steps.popitem(last=False)
            self.dropped += 1

    def _keep_carried(
        self, entry: _Step, receipts: list[tuple[str, SignedReceipt]]
    ) -> list[tuple[str, SignedReceipt]]:
        """Hold the trainer's receipts among ``receipts`` in ``entry.carried`` (the larger per server);
        return the others (part receipts, and bytes that do not decode: the ledger judges those)."""
        rest = []
        for aggregator, signed in receipts:
            try:
                receipt = decode_receipt(signed.receipt)
            except ProtocolError:
                rest.append((aggregator, signed))
                continue
            if not receipt.carried:
                rest.append((aggregator, signed))
                continue
            held = entry.carried.get(receipt.aggregator)
            if held is None and len(entry.carried) >= CARRIED_PER_STEP:
                self.dropped_carried += 1
            elif held is None or receipt.weight > held[0]:
                entry.carried[receipt.aggregator] = (receipt.weight, signed)
        return rest

    def take(
        self,
        max_receipts: int = MAX_RECEIPTS_PER_REPORT,
        max_pulled: int = MAX_PULLED_PER_REPORT,
        *,
        hold: Sequence[tuple[int, int]] = (),
        hold_stages: Sequence[tuple[int, int, int]] = (),
    ) -> tuple[list[SignedReceipt], list[PulledSlice]]:
        """Remove and return the sealed receipts first, then the oldest receipts and pull records, at most
        one report's worth, less the receipts of steps the pending discards cover (data-parallel ``hold``,
        stage ``hold_stages``: module docstring), which stay in the book in their order."""
        receipts: list[SignedReceipt] = []
        pulled: list[PulledSlice] = []
        while self._sealed and len(receipts) < max_receipts:
            receipts.append(self._sealed.popitem(last=False)[1][1])
        for key, entry in list(self._steps.items()):
            room_r, room_p = max_receipts - len(receipts), max_pulled - len(pulled)
            if room_r <= 0 and room_p <= 0:
                break
            left: list[SignedReceipt] = []  # what stays, in order
            no_room = False
            for receipt in entry.receipts:
                if in_ranges(receipt, hold, hold_stages):
                    left.append(receipt)
                elif room_r > 0:
                    receipts.append(receipt)
                    room_r -= 1
                else:
                    left.append(receipt)
                    no_room = True
            entry.receipts = left
            pulled += entry.pulled[:room_p]
            entry.pulled = entry.pulled[room_p:]
            for server, (_, receipt) in list(entry.carried.items()):
                if in_ranges(receipt, (), hold_stages):
                    continue
                if room_r > 0:
                    receipts.append(entry.carried.pop(server)[1])
                    room_r -= 1
                else:
                    no_room = True
            if no_room or entry.pulled:
                break
            if not entry.receipts and not entry.carried:  # else only held ones are left: on to the next
                del self._steps[key]
        return receipts, pulled

    def drop_steps(self, first: int, last: int) -> int:
        """Remove the data-parallel part receipts of steps ``first..last`` (a fork's: module docstring;
        pull records, trainers' and stage receipts stay); returns how many."""
        return self._drop([(first, last)], ())[0]

    def drop_stage_steps(self, stage: int, first: int, last: int) -> tuple[int, int]:
        """At a stage discard of ``stage``'s steps ``first..last`` (module docstring, "Stage discards"):
        remove the stage part receipts of those steps and seal the trainer's receipts of them; returns
        how many of each (pull records and other receipts stay)."""
        return self._drop((), [(stage, first, last)])

    def _drop(
        self, ranges: Sequence[tuple[int, int]], stage_ranges: Sequence[tuple[int, int, int]]
    ) -> tuple[int, int]:
        dropped = sealed = 0
        for key, entry in list(self._steps.items()):
            kept: list[SignedReceipt] = []
            for signed in entry.receipts:  # part receipts, and any put back (a trainer's too)
                receipt = _decoded(signed)
                if receipt is None or not _covers(receipt, ranges, stage_ranges):
                    kept.append(signed)
                elif receipt.carried:
                    self._seal(receipt, signed)
                    sealed += 1
                else:
                    dropped += 1
            entry.receipts = kept
            for server, (_, signed) in list(entry.carried.items()):
                receipt = _decoded(signed)
                if receipt is not None and _covers(receipt, ranges, stage_ranges):
                    self._seal(receipt, entry.carried.pop(server)[1])
                    sealed += 1
            if not (entry.receipts or entry.pulled or entry.carried):
                del self._steps[key]
        return dropped, sealed

    def seal(self, receipts: Iterable[SignedReceipt]) -> None:
        """Hold ``receipts`` (a trainer's, of a pending stage discard's steps) sealed: the next reports
        carry them first (module docstring, "Stage discards"). Bytes that do not decode as a stage's
        trainer's receipt are not held (the ledger refuses those wherever they go)."""
        for signed in receipts:
            receipt = _decoded(signed)
            if receipt is not None and receipt.carried and receipt.stage is not None:
                self._seal(receipt, signed)

    def _seal(self, receipt: PartReceipt, signed: SignedReceipt) -> None:
        assert receipt.stage is not None
        key = (receipt.stage, receipt.step, receipt.aggregator)
        held = self._sealed.get(key)
        if held is None or receipt.weight > held[0]:
            self._sealed[key] = (receipt.weight, signed)

    @property
    def sealed(self) -> list[SignedReceipt]:
        """The sealed trainer's receipts, in the order the next reports take them."""
        return [signed for _, signed in self._sealed.values()]

    def put_back(
        self,
        step: int,
        receipts: list[SignedReceipt],
        pulled: list[PulledSlice],
        sealed: Iterable[SignedReceipt] = (),
    ) -> None:
        """Return what a report that failed to reach any backbone carried (it goes out again later; held
        under ``(None, step)``: the receipts say their stages themselves), and ``sealed``: those of its
        trainer's receipts a pending stage discard covers (module docstring, "Stage discards")."""
        self.seal(sealed)
        if not receipts and not pulled:
            return
        entry = self._steps.setdefault((None, step), _Step())
        entry.receipts[:0] = receipts
        entry.pulled[:0] = pulled
        self._steps.move_to_end((None, step), last=False)

    def restore(
        self,
        step: int,
        receipts: Iterable[SignedReceipt],
        pulled: Iterable[PulledSlice] = (),
        *,
        stage: int | None = None,
    ) -> None:
        """Hold ``receipts`` and ``pulled`` under ``(stage, step)`` as a book held them (a compacted journal's
        replay, :mod:`volunteer.journal`): every one kept, in order. Unlike :meth:`add` there is no
        per-step cap: a given-up report's receipts of many steps were put back under one step, beyond what
        a round books for a step. The trainer's receipts still go to the step's carried ones (the larger
        per server), and the book's :attr:`max_steps` bound holds."""
        entry = self._steps.setdefault((stage, step), _Step())
        rest = self._keep_carried(entry, [("", r) for r in receipts])
        self._hold(entry, [r for _, r in rest], list(pulled), None)

    def held(self) -> list[tuple[int, list[SignedReceipt], list[PulledSlice]]]:
        """Everything held but the :attr:`sealed` receipts, oldest step first: ``(step, receipts, pull
        records)``."""
        return [(step, e.all_receipts(), list(e.pulled)) for (_, step), e in self._steps.items()]

    def held_by_stage(self) -> list[tuple[int | None, int, list[SignedReceipt], list[PulledSlice]]]:
        """Everything held but the :attr:`sealed` receipts, oldest first: ``(stage, step, receipts, pull
        records)``."""
        return [(stage, step, e.all_receipts(), list(e.pulled)) for (stage, step), e in self._steps.items()]

    def __len__(self) -> int:
        held = sum(len(e.receipts) + len(e.pulled) + len(e.carried) for e in self._steps.values())
        return held + len(self._sealed)


def _decoded(signed: SignedReceipt) -> PartReceipt | None:
    try:
        return decode_receipt(signed.receipt)
    except ProtocolError:
        return None
