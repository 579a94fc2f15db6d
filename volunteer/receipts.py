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
its own), so the reporter's journal replays them exactly (:mod:`volunteer.journal`). Only data-parallel
discards do this so far: a swarm server's *stage* discards (``Reporter.discard_stage``) neither drop nor
hold its stage or trainers' receipts, which keep the under-credit this fixes for data-parallel steps
(a stage step taken again before the stage discard's report went out is marked discarded). Stage
receipts need more thought: the bytes of a trainer's discarded receipts stay evidence of its sending, so
the fork's cannot simply be dropped.

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
    PulledSlice,
    SignedReceipt,
    decode_receipt,
)

__all__ = ["CARRIED_PER_STEP", "MAX_HELD_STEPS", "ReceiptBook", "in_ranges"]

#: Steps whose receipts a volunteer holds before dropping the oldest (hours of steps at 1 step/s).
MAX_HELD_STEPS = 4096
#: Servers whose trainer's receipts the book keeps per ``(stage, step)`` (module docstring).
CARRIED_PER_STEP = 8


def in_ranges(signed: SignedReceipt, ranges: Sequence[tuple[int, int]]) -> bool:
    """``signed`` is a data-parallel part receipt of a step in one of ``ranges`` (``(first, last)``, both
    included): one a discard of those steps covers (module docstring). Not a stage's or a trainer's
    receipt (a stage discard covers those: not handled here yet), nor bytes that do not decode (the
    ledger refuses those wherever they go)."""
    if not ranges:
        return False
    try:
        receipt = decode_receipt(signed.receipt)
    except ProtocolError:
        return False
    return receipt.stage is None and any(first <= receipt.step <= last for first, last in ranges)


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
        for _, receipt in [*others, *own]:
            if len(entry.receipts) >= RECEIPTS_PER_STEP:
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
    ) -> tuple[list[SignedReceipt], list[PulledSlice]]:
        """Remove and return the oldest receipts and pull records, at most one report's worth, less the
        data-parallel part receipts of steps in ``hold`` (the ranges the report discards: module
        docstring), which stay in the book in their order."""
        receipts: list[SignedReceipt] = []
        pulled: list[PulledSlice] = []
        for key, entry in list(self._steps.items()):
            room_r, room_p = max_receipts - len(receipts), max_pulled - len(pulled)
            if room_r <= 0 and room_p <= 0:
                break
            left: list[SignedReceipt] = []  # what stays, in order
            no_room = False
            for receipt in entry.receipts:
                if in_ranges(receipt, hold):
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
            for server in list(entry.carried)[: max(0, max_receipts - len(receipts))]:
                receipts.append(entry.carried.pop(server)[1])
            if no_room or entry.pulled or entry.carried:
                break
            if not entry.receipts:  # else only held receipts are left: on to the next step
                del self._steps[key]
        return receipts, pulled

    def drop_steps(self, first: int, last: int) -> int:
        """Remove the data-parallel part receipts of steps ``first..last`` (a fork's: module docstring;
        pull records, trainers' and stage receipts stay); returns how many."""
        dropped = 0
        for key, entry in list(self._steps.items()):
            kept = [r for r in entry.receipts if not in_ranges(r, [(first, last)])]
            dropped += len(entry.receipts) - len(kept)
            entry.receipts = kept
            if not (entry.receipts or entry.pulled or entry.carried):
                del self._steps[key]
        return dropped

    def put_back(self, step: int, receipts: list[SignedReceipt], pulled: list[PulledSlice]) -> None:
        """Return what a report that failed to reach any backbone carried (it goes out again later; held
        under ``(None, step)``: the receipts say their stages themselves)."""
        entry = self._steps.setdefault((None, step), _Step())
        entry.receipts[:0] = receipts
        entry.pulled[:0] = pulled
        self._steps.move_to_end((None, step), last=False)

    def held(self) -> list[tuple[int, list[SignedReceipt], list[PulledSlice]]]:
        """Everything held, oldest step first: ``(step, receipts, pull records)``."""
        return [(step, e.all_receipts(), list(e.pulled)) for (_, step), e in self._steps.items()]

    def held_by_stage(self) -> list[tuple[int | None, int, list[SignedReceipt], list[PulledSlice]]]:
        """Everything held, oldest first: ``(stage, step, receipts, pull records)``."""
        return [(stage, step, e.all_receipts(), list(e.pulled)) for (stage, step), e in self._steps.items()]

    def __len__(self) -> int:
        return sum(len(e.receipts) + len(e.pulled) + len(e.carried) for e in self._steps.values())
