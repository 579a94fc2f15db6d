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

Plain Python, no trio, no locks: every call runs on the trio thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
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

__all__ = ["CARRIED_PER_STEP", "MAX_HELD_STEPS", "ReceiptBook"]

#: Steps whose receipts a volunteer holds before dropping the oldest (hours of steps at 1 step/s).
MAX_HELD_STEPS = 4096
#: Servers whose trainer's receipts the book keeps per ``(stage, step)`` (module docstring).
CARRIED_PER_STEP = 8


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
        self, max_receipts: int = MAX_RECEIPTS_PER_REPORT, max_pulled: int = MAX_PULLED_PER_REPORT
    ) -> tuple[list[SignedReceipt], list[PulledSlice]]:
        """Remove and return the oldest receipts and pull records, at most one report's worth."""
        receipts: list[SignedReceipt] = []
        pulled: list[PulledSlice] = []
        while self._steps:
            key, entry = next(iter(self._steps.items()))
            room_r, room_p = max_receipts - len(receipts), max_pulled - len(pulled)
            if room_r <= 0 and room_p <= 0:
                break
            receipts += entry.receipts[:room_r]
            pulled += entry.pulled[:room_p]
            entry.receipts = entry.receipts[room_r:]
            entry.pulled = entry.pulled[room_p:]
            for server in list(entry.carried)[: max(0, max_receipts - len(receipts))]:
                receipts.append(entry.carried.pop(server)[1])
            if entry.receipts or entry.pulled or entry.carried:
                break
            del self._steps[key]
        return receipts, pulled

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
