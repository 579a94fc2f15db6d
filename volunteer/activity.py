"""Pausing and resuming a running volunteer: by hand (``volunteer pause`` / ``resume``, over
:mod:`volunteer.control`) or by the owner's rules (:mod:`volunteer.policy`).

**What a pause is.** The daemon keeps its process, its node (DHT presence, identity, admission, relay
slot) and so its peer id; only the training session ends, the way Ctrl+C ends it: the round in flight is
left cleanly (the others are told at once), open contribution reports are sent, the ledger session closes.
Credit already earned stays in the ledger (it belongs to the user, not to a session). While paused the
panel, the status line and ``status.json`` (``activity``) say ``paused: <reason>``.

**What a resume is.** A new :class:`volunteer.session.TrainingSession` on the same node: it rebuilds the
model and re-syncs the run's state from the peers like a newcomer (the state it had is stale after a
pause), measures again and trains. Its handlers replace the old session's on the host (the bulk handlers
the old session left are removed at the pause, so nobody downloads a stale state from a paused peer).

**Who decides** (:class:`Activity`): a manual pause wins over every rule until ``volunteer resume``; then
the rules' (debounced) decision applies again, so a resume inside a rule's pause stays paused and says why.
The rules are read every :data:`POLICY_PERIOD` seconds by :func:`watch_policy`.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from shared.errors import ConfigError
from shared.lifecycle import Shutdown

from .policy import Debounce, Decision, Readings, Rules, decide
from .sources import Sources, idle_seconds, running_programs

__all__ = ["POLICY_PERIOD", "Activity", "SessionStop", "train_with_pauses", "watch_policy"]

logger = logging.getLogger("volunteer")
POLICY_PERIOD = 5.0
MANUAL = "paused by `volunteer pause`"


@dataclass
class SessionStop(Shutdown):
    """One training session's stop: set by the process's shutdown or by a pause. The session's
    ``ready()`` also makes the process's shutdown graceful."""

    outer: Shutdown | None = None

    def ready(self) -> None:
        super().ready()
        if self.outer is not None:
            self.outer.ready()


@dataclass
class Activity:
    """Whether this volunteer should train now, and why (module docstring)."""

    can_pause: bool = True  # False for a peer that does not train (--aux, a plain member)
    manual: bool = False
    policy: Decision = field(default_factory=lambda: Decision(True, "no rules: always training"))
    state: str = "starting"  # what the daemon does: starting, training, pausing, paused, resuming, stopping
    details: Callable[[], dict[str, Any]] = field(default=lambda: {})
    _changed: trio.Event = field(default_factory=trio.Event)

    @property
    def paused(self) -> bool:
        return self.manual or not self.policy.run

    @property
    def reason(self) -> str:
        if self.manual:
            return MANUAL
        return self.policy.reason

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def changed(self) -> None:
        await self._changed.wait()

    def set_policy(self, decision: Decision) -> None:
        if decision != self.policy:
            if decision.run != self.policy.run:
                logger.info("policy: %s (%s)", "train" if decision.run else "pause", decision.reason)
            self.policy = decision
            self._notify()

    def handle(self, command: str) -> dict[str, Any]:
        """A control request (:mod:`volunteer.control`): the reply's fields."""
        if command == "pause":
            if not self.can_pause:
                raise ConfigError(
                    "this volunteer does not train (--aux or no training spec): nothing to pause"
                )
            self.manual = True
            self._notify()
        elif command == "resume":
            self.manual = False
            self._notify()
        return self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "paused": self.paused,
            "manual": self.manual,
            "reason": self.reason,
            "policy": {"run": self.policy.run, "reason": self.policy.reason},
            "pid": os.getpid(),
            **self.details(),
        }


async def train_with_pauses(
    activity: Activity,
    run_session: Callable[[Shutdown], Awaitable[bool]],
    show_paused: Callable[[], Awaitable[None]],
    shutdown: Shutdown,
) -> None:
    """Training sessions one after another, with pauses between them, until ``shutdown`` or a session
    that ends by itself (the run's step limit). ``run_session(stop)`` runs one session until ``stop`` is
    requested and returns whether it was stopped (rather than ending by itself); ``show_paused()`` shows
    the paused state until cancelled."""
    while not shutdown.requested.is_set():
        if activity.paused:
            activity.state = "paused"
            logger.info("paused: %s", activity.reason)
            shutdown.ready()  # nothing to finish while paused: a signal just stops
            async with trio.open_nursery() as nursery:
                nursery.start_soon(show_paused)
                while activity.paused and not shutdown.requested.is_set():
                    with trio.move_on_after(1.0):  # the shutdown is an event of its own: poll it too
                        await activity.changed()
                nursery.cancel_scope.cancel()
            if shutdown.requested.is_set():
                break
            activity.state = "resuming"
            logger.info("resuming: training again, re-syncing with the run")
            continue
        stop = SessionStop(outer=shutdown)
        activity.state = "training"

        async def stop_when_asked(stop: SessionStop = stop) -> None:
            while not (shutdown.requested.is_set() or activity.paused):
                with trio.move_on_after(1.0):
                    await activity.changed()
            if activity.paused and not shutdown.requested.is_set():
                activity.state = "pausing"
                logger.info("pausing: %s; leaving the round cleanly", activity.reason)
            else:
                activity.state = "stopping"
            stop.requested.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_when_asked)
            stopped = await run_session(stop)
            nursery.cancel_scope.cancel()
        if not stopped:
            return
    activity.state = "stopping"


async def watch_policy(
    activity: Activity,
    rules: Rules,
    sources: Sources | None = None,
    *,
    period: float = POLICY_PERIOD,
    debounce: Debounce | None = None,
    clock: Callable[[], datetime.datetime] = datetime.datetime.now,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Apply the rules' debounced decision to ``activity`` every ``period`` seconds, forever; started
    once the first decision is applied."""
    sources = sources or Sources()
    debounce = debounce or Debounce()
    cpu = sources.cpu
    warned: set[str] = set()
    while True:
        now = clock()

        def read(now: datetime.datetime = now) -> Readings:
            return Readings(
                minute_of_day=now.hour * 60 + now.minute,
                idle_seconds=idle_seconds(sources.dev, now.timestamp()) if rules.needs_idle else None,
                other_cpu=cpu.read() if rules.needs_cpu and cpu is not None else None,
                programs=running_programs(sources.proc) if rules.needs_programs else frozenset(),
            )

        readings = await trio.to_thread.run_sync(read)
        raw = decide(readings, rules)
        for note in (
            "cannot tell whether the machine is idle here",
            "cannot tell other programs' CPU use here",
        ):
            if note in raw.reason and note not in warned:
                warned.add(note)
                logger.warning("policy: %s; that rule does not pause this volunteer", note)
        activity.set_policy(debounce.update(raw))
        task_status.started()
        task_status = trio.TASK_STATUS_IGNORED
        await trio.sleep(period)
