"""What this volunteer knows about being alone: the readings behind a lone step and the high-water mark
(the rule is :mod:`shared.alone`'s; this module gathers its inputs and keeps the mark on disk).

* **Readings.** While our view shows nobody else (``view.peers <= 1``), :meth:`Evidence.refresh_forever`
  reads the progress records every :data:`READ_PERIOD` seconds through our DHT and through a lookup seeded
  at each known backbone (:func:`shared.progress_records.read_progress_everywhere`); a step that finds
  the readings older than :data:`~shared.alone.EVIDENCE_MAX_AGE` reads once more before deciding. With
  company the readings are not needed (the step matchmakes), so a collaboration pays nothing.
* **The mark** is loaded from the data dir at start, moved by every view that shows another user in the
  surviving collaboration (:func:`shared.alone.observe`) and saved when worth it, in a worker thread.
* :meth:`Evidence.holds_back` says whether the mark forbids training on our state: it binds and our step
  is below it. The optimizer then treats us as behind (we re-sync, flagged ``syncing``, and never announce
  our state as current). :meth:`Evidence.give_up_mark` drops a mark that expired while no state could be
  had: the run then goes on from what there is (the run resumed from an older checkpoint, or from scratch).
  :meth:`Evidence.lose_mark` forgets it at once, on disk too, when its state died with its holders
  (:mod:`shared.alone`, rule (d); the state sync judges it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from protocols.training import PROGRESS_KEY
from shared.alone import (
    EVIDENCE_MAX_AGE,
    HIGH_WATER_FILE,
    HighWater,
    LoneStep,
    Reading,
    binding,
    load_high_water,
    lone_step,
    observe,
    save_high_water,
    worth_saving,
)
from shared.errors import ConfigError
from shared.net.addresses import PeerAddress, parse_multiaddr
from shared.node import Node
from shared.progress import CollabView
from shared.progress_records import known_backbones, read_progress_everywhere, read_progress_seeded
from shared.tolerated import Tolerated

__all__ = ["READ_PERIOD", "Evidence"]

logger = logging.getLogger(__name__)
READ_PERIOD = 2.0  # seconds between reads while we see nobody
READ_DEADLINE = 5.0  # one round of reads, at most


@dataclass
class Evidence:
    node: Node
    run_id: str
    target_batch: int
    tolerated: Tolerated
    backbones: Sequence[str] = ()  # the backbones we were given (multiaddrs), to seed the reads
    data_dir: Path | None = None
    key: str = PROGRESS_KEY  # the collaboration's progress records (TrainingKeys.progress)
    readings: list[Reading] = field(default_factory=list)
    read_at: float = 0.0  # unix time the latest readings started
    mark: HighWater | None = None
    #: the surviving collaboration's members when the mark was last set from a view (shared.alone, rule
    #: (d), witness (B)); in memory only: a mark read back from disk has none
    holders: frozenset[str] = frozenset()
    #: a peer that downloaded our state within JOINING_GRACE seconds (shared.alone, rule (c)), if any
    joining: Callable[[], str | None] = lambda: None

    def __post_init__(self) -> None:
        if self.data_dir is not None:
            self.mark = load_high_water(self.data_dir, self.run_id)
        self._saved = self.mark
        self._reading = trio.Lock()

    async def read(self) -> None:
        """Read the progress records everywhere now (failures counted; the readings say who answered)."""
        async with self._reading:
            started = time.time()
            seeds = _listed(self.backbones)
            with trio.move_on_after(READ_DEADLINE), self.tolerated.around("evidence.seeds"):
                seeds = await known_backbones(self.node.dht, self.backbones)
            # each source bounded on its own: one blackholed backbone must not void the others' answers
            readings: list[Reading] = []

            async def one(seed: PeerAddress | None) -> None:
                with trio.move_on_after(READ_DEADLINE) as scope:
                    if seed is None:  # through our own DHT
                        readings.extend(await read_progress_everywhere(self.node, [], self.key))
                    else:
                        readings.append(await read_progress_seeded(self.node, seed, self.key))
                if scope.cancelled_caught:
                    self.tolerated.note(
                        "evidence.read", TimeoutError(f"no answer within {READ_DEADLINE:g} s")
                    )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, None)
                for seed in seeds:
                    if seed.peer_id is not None and seed.peer_id != self.node.peer_id:
                        nursery.start_soon(one, seed)
            if any(r.answered for r in readings):
                self.readings, self.read_at = readings, started

    async def refresh_forever(self, view: Callable[[], CollabView | None]) -> None:
        while True:
            current = view()
            if current is not None and current.peers <= 1:
                await self.read()
            await trio.sleep(READ_PERIOD)

    async def verdict(self, step: int) -> LoneStep:
        """May we step alone at ``step`` now? Reads first when the readings are too old to tell."""
        if time.time() - self.read_at > EVIDENCE_MAX_AGE * 0.8:
            await self.read()
        return lone_step(
            self.readings,
            self.node.peer_id,
            step,
            self.mark,
            now=time.time(),
            read_at=self.read_at,
            target_batch=self.target_batch,
            joining=self.joining(),
        )

    async def observe(self, view: CollabView) -> None:
        """Move the mark by what ``view`` showed; save it when worth it. The mark is lowered only by a
        view that saw several collaborations (a merge sent the run back to a lower survivor): a partial
        read while the DHT heals, showing only a lagging group, must not lift the protection."""
        shown = view.shown
        if (
            shown is not None
            and self.mark is not None
            and shown < self.mark.step
            and view.collaborations <= 1
        ):
            shown = self.mark.step  # confirmed, not lowered
        elif shown is not None and view.survivor is not None:
            self.holders = view.survivor.peers
        self.mark = observe(self.mark, shown, self.run_id, time.time())
        if self.data_dir is not None and self.mark is not None and worth_saving(self._saved, self.mark):
            mark, data_dir = self.mark, self.data_dir
            try:
                await trio.to_thread.run_sync(save_high_water, data_dir, mark)
            except OSError as exc:
                self.tolerated.note("evidence.save", exc)
            else:
                self._saved = mark

    def holds_back(self, step: int) -> bool:
        """The mark binds and our state is older than it: do not train on it, re-sync."""
        return self.mark is not None and binding(self.mark, time.time()) and step < self.mark.step

    def above(self, step: int) -> int | None:
        """The mark's step if it is above ``step`` (binding or not), else None."""
        return self.mark.step if self.mark is not None and step < self.mark.step else None

    def give_up_mark(self) -> None:
        """Forget an expired mark (no state of its step could be had: the run goes on from what there is)."""
        if self.mark is not None and not binding(self.mark, time.time()):
            logger.warning(
                "step %d, last shown by the collaboration %.0f s ago, is gone: going on from the newest",
                self.mark.step,
                time.time() - self.mark.seen,
            )
            self.mark = None

    async def lose_mark(self) -> None:
        """Forget the mark now, on disk too: its state died with its holders (:mod:`shared.alone`, rule
        (d)). A restart must not bring it back; the next view that shows another user sets a new one."""
        if self.mark is None:
            return
        logger.warning(
            "the state of step %d died with its holders (they failed us or restarted; nobody we see has it): "
            "going on from the newest state there is",
            self.mark.step,
        )
        self.mark = self._saved = None
        self.holders = frozenset()
        if self.data_dir is not None:
            path = self.data_dir / HIGH_WATER_FILE
            try:
                await trio.to_thread.run_sync(path.unlink, True)  # missing_ok
            except OSError as exc:
                self.tolerated.note("evidence.save", exc)


def _listed(backbones: Sequence[str]) -> list[PeerAddress]:
    """The backbones we were given, as addresses (unusable ones skipped): the seeds when the presence
    records that name the others cannot be read."""
    out = []
    for text in backbones:
        try:
            address = parse_multiaddr(text)
        except ConfigError:
            continue
        if address.peer_id is not None:
            out.append(address)
    return out
