"""Pausing and resuming (volunteer.activity) with fake sessions and fake /proc trees: sessions one after
another, a pause ends the current one as a shutdown would, the rules pause and resume by themselves."""

from __future__ import annotations

import datetime
from pathlib import Path

import trio

from shared.lifecycle import Shutdown
from volunteer.activity import Activity, SessionStop, train_with_pauses, watch_policy
from volunteer.policy import Debounce, Rules, parse_window
from volunteer.sources import CpuMeter, Sources


class FakeSessions:
    def __init__(self, ends_by_itself_at: int | None = None) -> None:
        self.started = 0
        self.stopped = 0
        self.paused_shown = 0
        self.ends_by_itself_at = ends_by_itself_at

    async def run(self, stop: Shutdown) -> bool:
        self.started += 1
        stop.ready()
        if self.started == self.ends_by_itself_at:
            return False  # the run's step limit
        await stop.requested.wait()
        self.stopped += 1
        return True

    async def show_paused(self) -> None:
        self.paused_shown += 1
        await trio.sleep_forever()


async def wait_until(condition: object, within: float = 10.0) -> None:
    with trio.fail_after(within):
        while not condition():  # type: ignore[operator]
            await trio.sleep(0.01)


async def test_pause_ends_the_session_and_resume_starts_a_new_one() -> None:
    activity, shutdown, fake = Activity(), Shutdown(), FakeSessions()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(train_with_pauses, activity, fake.run, fake.show_paused, shutdown)
        await wait_until(lambda: fake.started == 1 and activity.state == "training")
        assert shutdown.graceful  # the session's ready() made the process's shutdown graceful
        activity.handle("pause")
        await wait_until(lambda: activity.state == "paused")
        assert fake.stopped == 1 and fake.paused_shown == 1
        activity.handle("pause")  # pausing twice is harmless
        activity.handle("resume")
        await wait_until(lambda: fake.started == 2 and activity.state == "training")
        shutdown.requested.set()
    assert fake.stopped == 2 and activity.state == "stopping"


async def test_a_shutdown_while_paused_just_stops() -> None:
    activity, shutdown, fake = Activity(), Shutdown(), FakeSessions()
    activity.handle("pause")  # paused before the first session
    async with trio.open_nursery() as nursery:
        nursery.start_soon(train_with_pauses, activity, fake.run, fake.show_paused, shutdown)
        await wait_until(lambda: activity.state == "paused")
        assert shutdown.graceful
        shutdown.requested.set()
    assert fake.started == 0


async def test_a_session_that_ends_by_itself_ends_the_loop() -> None:
    activity, shutdown, fake = Activity(), Shutdown(), FakeSessions(ends_by_itself_at=1)
    with trio.fail_after(10):
        await train_with_pauses(activity, fake.run, fake.show_paused, shutdown)
    assert fake.started == 1


def test_session_stop_makes_the_outer_shutdown_graceful() -> None:
    outer = Shutdown()
    stop = SessionStop(outer=outer)
    stop.ready()
    assert stop.graceful and outer.graceful and not outer.requested.is_set()


async def test_the_rules_pause_and_resume_by_themselves(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    comm = proc / "42" / "comm"
    comm.write_text("bash\n")
    activity = Activity()
    rules = Rules(pause_while=("steam",))
    sources = Sources(dev=tmp_path / "dev", proc=proc, cpu=CpuMeter(proc, pid=1))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: watch_policy(activity, rules, sources, period=0.02, debounce=Debounce(2, 3))
        )
        await wait_until(lambda: activity.policy.reason == "every rule allows training")
        comm.write_text("steam\n")
        await wait_until(lambda: activity.paused)
        assert activity.reason == "steam is running"
        comm.write_text("bash\n")
        await wait_until(lambda: not activity.paused)
        nursery.cancel_scope.cancel()


async def test_active_hours_follow_the_clock(tmp_path: Path) -> None:
    now = [datetime.datetime(2026, 11, 27, 12, 0)]
    activity = Activity()
    rules = Rules(active_hours=parse_window("22:00-07:00"))
    sources = Sources(dev=tmp_path, proc=tmp_path)
    async with trio.open_nursery() as nursery:

        async def watch(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            await watch_policy(
                activity, rules, sources, period=0.02, clock=lambda: now[0], task_status=task_status
            )

        await nursery.start(watch)
        assert activity.paused  # the first decision applies before the daemon trains at all
        assert activity.reason == "outside the active hours 22:00-07:00"
        now[0] = datetime.datetime(2026, 11, 27, 23, 30)
        await wait_until(lambda: not activity.paused)  # after the debounce's 3 readings
        nursery.cancel_scope.cancel()


async def test_an_unreadable_idle_rule_never_pauses(tmp_path: Path) -> None:
    activity = Activity()
    sources = Sources(dev=tmp_path / "no-dev", proc=tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: watch_policy(
                activity, Rules(idle_after=60), sources, period=0.02, debounce=Debounce(1, 1)
            )
        )
        await wait_until(lambda: "cannot tell" in activity.policy.reason)
        assert not activity.paused
        nursery.cancel_scope.cancel()
