"""Publishing our progress and reading everyone's (seed 000 §3.1): the collaborative optimizer's view of
the run.

Our :class:`~protocols.training.Progress` goes to the DHT under our own subkey after every change worth
telling (at most every ``publish_period``; at once when :meth:`ProgressBoard.publish_soon` is called, e.g.
when we enter a round or start a download), and at least once per ``publish_period`` so it never ages
past :data:`~protocols.training.PROGRESS_TTL`. Everyone's records are read every ``poll_period`` (more
often as the target batch nears, so peers enter a round together) and summarized by
:func:`shared.progress.summarize` into :attr:`ProgressBoard.view`. After each read, ``after_read`` runs
(the state sync answers peers that ask for a state there).

**A peer that failed us is out of the view until it publishes again** (:meth:`ProgressBoard.gone`). When
a state download from a peer fails (refused, reset, stalled), the state sync tells the board; the board
leaves that peer's record out of the view until it reads a *newer* record of it (a ``time`` later than
the one it held at the failure: the writer's own clock against itself, so clock skew does not matter). A
live peer republishes every ``publish_period`` and is back within a few seconds; a dead one's last
record no longer keeps it in the view -- at the step it held, as a holder of a state nobody can serve --
for the ``PROGRESS_TTL`` it takes that record to expire (:mod:`shared.alone`, rule (d)). At most
:data:`MAX_GONE` such peers are remembered (oldest forgotten first).

**Long rounds read less** (:func:`poll_interval`). The next read comes half the time to the target from
now (``eta / 2``, never sooner than :data:`MIN_POLL`), and at the latest after ``poll_period`` -- or,
with ``longest_poll`` above ``poll_period``, after ``longest_poll``. The DiLoCo mode sets both
``longest_poll`` and ``publish_period`` to :data:`~shared.progress.MAX_EXTRAPOLATION` (3 s) at least
(:func:`periods`): its rounds last many batch-mode steps, and reading everyone's records every 0.3 s and
publishing ours every second made the DHT traffic of a round several times the averaging's own bytes
(issue 16's benchmark: about 19 KB/s per peer against a round's 170 KB). Reading or publishing more often
than every 3 s tells little more: a reader extrapolates each record by its throughput for 3 s after it was
written (:func:`shared.progress.summarize`), so records published every 3 s are counted in full, and read
every 3 s the estimate never stalls; near the round's end ``eta / 2`` takes over, so the round is entered as
promptly as before, though never more often than every :data:`LONG_ROUND_MIN_POLL` (0.25 s; the batch mode
goes down to :data:`MIN_POLL`): a peer decides to enter from the last view extrapolated by everyone's
throughput since (:meth:`volunteer.collab.step.BatchStep.ready`), not from the read itself, so a read 0.25 s
apart makes it enter a fraction of that late, well inside a matchmaking window (1 s by default), and the reads
every 50 ms down to the target were a third of a round's reads; events worth telling at once (a share done, a
round entered, a download) are still published at once (:meth:`ProgressBoard.publish_soon`). What waits
longer: a peer's state request is seen (and answered) up to 3 s after it was published instead of 0.3 s, well
inside a downloader's patience.

**A round under way reads what it needs itself** (the DiLoCo mode). Once the view shows the target
reached at our step (``eta`` 0), the next read waits ``longest_poll`` (3 s): the averaging reads the records
itself when it needs them (each attempt, each failure), and reading every :data:`MIN_POLL` through the
round, as ``eta / 2`` would, was most of the DiLoCo mode's DHT bytes (issue 16's benchmark: 57 of 125 reads
of a run). The batch mode keeps reading every :data:`MIN_POLL` then: its rounds are short, and the rule was
measured only in the DiLoCo mode. When the round ends, our step moves on;
:meth:`ProgressBoard.publish_soon` (called as it ends) wakes the poller, which reads at once when our step
is not the one of its last read, since a view taken at a past step cannot say whether the next round's
target is near. (Once per change of our step: a peer whose step the view never shows, say one ahead of
the collaboration, is not read every 50 ms for it.)

The board knows nothing of states: what we publish (our step among it) comes from the ``own`` callable,
whether our state is the run's from ``anchored``. Failed stores and reads are tolerated -- the next period
retries -- and counted (:class:`~shared.tolerated.Tolerated`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import trio

from protocols.training import PROGRESS_KEY, PROGRESS_TTL, Progress, TrainingSpec
from shared.node import Node
from shared.progress import MAX_EXTRAPOLATION, CollabView, summarize
from shared.progress_records import read_progress_with_users
from shared.tolerated import Tolerated

__all__ = ["Periods", "ProgressBoard", "periods", "poll_interval"]

LEAVE_DEADLINE = 3.0  # seconds to tell the others we left (best effort)
MIN_POLL = 0.05
MAX_GONE = 1024  # peers left out of the view after a failed download, remembered at most
#: the DiLoCo mode's longest poll and shortest publishing period (module docstring, "Long rounds")
LONG_ROUND_PERIOD = MAX_EXTRAPOLATION
#: ... and its shortest poll near a round's end (module docstring, "Long rounds read less")
LONG_ROUND_MIN_POLL = 0.25


def poll_interval(
    poll_period: float, eta: float | None, longest_poll: float = 0.0, shortest_poll: float = MIN_POLL
) -> float:
    """Seconds until the next read of everyone's records: ``poll_period`` while nobody computes (``eta``
    None); with a ``longest_poll`` above ``poll_period`` (the DiLoCo mode), ``longest_poll`` once the
    target is reached (``eta`` 0: the round is under way and reads what it needs itself); else half the
    time to the target, at least ``shortest_poll`` and at most the larger of the two periods (module
    docstring, "Long rounds read less")."""
    if eta is None:
        return poll_period
    if eta <= 0.0 and longest_poll > poll_period:
        return longest_poll
    return min(max(poll_period, longest_poll), max(shortest_poll, eta / 2))


class Periods(NamedTuple):
    longest_poll: float
    publish_period: float
    shortest_poll: float


def periods(spec: TrainingSpec, poll_period: float, publish_period: float) -> Periods:
    """The board's periods in a run of ``spec``, whose volunteer configured these: the DiLoCo mode reads
    and publishes at most every :data:`LONG_ROUND_PERIOD` seconds while a round's end is far, and at most
    every :data:`LONG_ROUND_MIN_POLL` near it (module docstring, "Long rounds read less"); the batch mode
    as configured, down to :data:`MIN_POLL`."""
    if spec.sync.mode == "diloco":
        return Periods(
            max(poll_period, LONG_ROUND_PERIOD),
            max(publish_period, LONG_ROUND_PERIOD),
            LONG_ROUND_MIN_POLL,
        )
    return Periods(poll_period, publish_period, MIN_POLL)


@dataclass
class ProgressBoard:
    node: Node
    spec: TrainingSpec
    own: Callable[[], Progress]  # our current record
    anchored: Callable[[], bool]  # our state is the run's (or the run is at our step 0)
    tolerated: Tolerated
    poll_period: float = 0.3
    publish_period: float = 1.0
    #: with an eta, polls may be this far apart (0: ``poll_period``; :func:`poll_interval`) ...
    longest_poll: float = 0.0
    #: ... and must be at least this far apart
    shortest_poll: float = MIN_POLL
    key: str = PROGRESS_KEY  # where this collaboration's records live (TrainingKeys.progress)
    view: CollabView | None = None
    #: peer id -> the user it speaks for, from the last read (shared.progress "Users")
    users: dict[str, str] = field(default_factory=dict)
    #: the records the view was summarized from (those of peers that failed us left out)
    records: dict[str, Progress] = field(default_factory=dict)
    view_at: float = 0.0  # when the view was taken (time.time())
    view_own_samples: int = 0  # our samples then (to extrapolate between reads)
    _changed: trio.Event = field(default_factory=trio.Event)
    _wake: trio.Event = field(default_factory=trio.Event)
    _read_step: int = -1  # our step at the last read
    _quiet: bool = False
    _read: dict[str, float] = field(default_factory=dict)  # peer -> ``time`` of its record we last read
    _gone: dict[str, float] = field(default_factory=dict)  # peer -> ``time`` of its record when it failed us

    async def run(
        self,
        after_read: Callable[[], Awaitable[None]] | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Publish and poll until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._publish_forever)
            nursery.start_soon(self._poll_forever, after_read)
            task_status.started()

    def publish_soon(self) -> None:
        self._changed.set()
        self._wake.set()  # the poller re-checks its wait: our step may have moved past the view's

    async def refresh(self) -> CollabView:
        """Read everyone's records now and summarize them (raises the DHT's CALL_FAILURES)."""
        records, users = await read_progress_with_users(self.node.dht, self.key)
        self._read = {peer: progress.time for peer, progress in records.items()}
        for peer, progress in records.items():
            if peer in self._gone and progress.time > self._gone[peer]:
                del self._gone[peer]  # it published since it failed us: alive
        records = {peer: progress for peer, progress in records.items() if peer not in self._gone}
        self.records = records
        mine = self.own()
        self._read_step = mine.step
        self.users = users
        self.view_at, self.view_own_samples = time.time(), mine.samples
        self.view = summarize(
            records,
            self.node.peer_id,
            mine,
            now=time.time(),
            target_batch=self.spec.target_batch,
            anchored=self.anchored(),
            users=users,
            min_target=self.spec.sync.min_round,
        )
        return self.view

    def gone(self, peer: str) -> None:
        """A state download from ``peer`` failed: leave its record out of the view until it publishes a
        newer one (see the module docstring). A peer whose record we never read is not in the view anyway."""
        at = self._read.get(peer)
        if at is None or peer == self.node.peer_id:
            return
        self._gone.pop(peer, None)
        self._gone[peer] = at  # newest last
        while len(self._gone) > MAX_GONE:
            del self._gone[next(iter(self._gone))]

    async def try_refresh(self) -> CollabView | None:
        """:meth:`refresh`, tolerating (and counting) a failed read; returns the view we have."""
        with self.tolerated.around("progress.read"):
            await self.refresh()
        return self.view

    async def leave(self, final: Progress) -> None:
        """Publish ``final`` (flagged ``left``) and stop publishing: the others stop waiting for us."""
        self._quiet = True
        with trio.move_on_after(LEAVE_DEADLINE), self.tolerated.around("progress.leave"):
            await self._store(final)

    async def _store(self, progress: Progress) -> None:
        await self.node.dht.store(
            self.key,
            msgspec.msgpack.encode(progress),
            time.time() + PROGRESS_TTL,
            subkey=self.node.peer_id.encode(),
        )

    async def _publish_forever(self) -> None:
        while not self._quiet:
            with self.tolerated.around("progress.publish"):
                await self._store(self.own())
            with trio.move_on_after(self.publish_period):
                await self._changed.wait()
            self._changed = trio.Event()

    async def _poll_forever(self, after_read: Callable[[], Awaitable[None]] | None) -> None:
        while True:
            await self._until_next_read()
            await self.try_refresh()
            if after_read is not None:
                await after_read()

    def _interval(self) -> float:
        """Seconds from the last read to the next (module docstring, "Long rounds read less")."""
        view = self.view
        if view is not None and self.own().step != self._read_step:
            return MIN_POLL  # our step moved since the read (a round ended, a state loaded): read it anew
        # Read more often as the target nears, so peers enter the round together, close to the target.
        eta = view.eta(self.spec.target_batch) if view is not None else None
        return poll_interval(self.poll_period, eta, self.longest_poll, self.shortest_poll)

    async def _until_next_read(self) -> None:
        """Sleep until the next read is due; :meth:`publish_soon` (a round entered or ended, a download
        started) makes the wait be re-judged from the same start."""
        began = trio.current_time()
        while True:
            self._wake = trio.Event()
            left = began + self._interval() - trio.current_time()
            if left <= 0:
                return
            with trio.move_on_after(left):
                await self._wake.wait()
