"""Pacing of a member's pushes (shared.averaging.pacing): no deadlock, bounded spread, departures release."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from shared.averaging.pacing import PushGate, may_start

part_counts = st.dictionaries(st.integers(0, 30), st.integers(1, 40), min_size=1, max_size=12)


@st.composite
def progress(draw: st.DrawFn) -> tuple[dict[int, int], dict[int, int]]:
    """Part counts and a reachable state of acknowledged parts (built by running the rule)."""
    parts = draw(part_counts)
    done = dict.fromkeys(parts, 0)
    for _ in range(draw(st.integers(0, 200))):
        open_ = [j for j in parts if done[j] < parts[j] and may_start(parts, done, j, done[j])]
        if not open_:
            break
        done[draw(st.sampled_from(sorted(open_)))] += 1
    return parts, done


@given(progress())
def test_the_least_advanced_aggregator_may_always_go_on(state: tuple[dict[int, int], dict[int, int]]) -> None:
    parts, done = state
    active = {j: n for j, n in parts.items() if done[j] < n}  # the finished ones have left the gate
    if not active:
        return
    slowest = min(active, key=lambda j: done[j] / active[j])
    assert may_start(active, done, slowest, done[slowest])


@given(progress())
def test_no_aggregator_gets_more_than_one_part_ahead(state: tuple[dict[int, int], dict[int, int]]) -> None:
    parts, done = state
    active = {j: n for j, n in parts.items() if done[j] < n}
    for i in active:
        for j in active:
            # in proportion: j's progress exceeds i's by at most one part of each
            assert done[j] / active[j] <= (done[i] + 1) / active[i] + 1 / active[j] + 1e-12


def test_equal_slices_go_part_by_part() -> None:
    parts = {0: 4, 1: 4, 2: 4}
    assert may_start(parts, {0: 0, 1: 0, 2: 0}, 0, 1)  # one part ahead is allowed
    assert not may_start(parts, {0: 1, 1: 0, 2: 0}, 0, 2)  # two parts ahead of 1 and 2 is not
    assert may_start(parts, {0: 1, 1: 1, 2: 1}, 0, 2)


def test_a_twice_larger_slice_gets_twice_the_parts() -> None:
    parts = {0: 8, 1: 4}
    # aggregator 1 has one part acknowledged (a quarter): aggregator 0 may go up to its part 4 (half)
    assert may_start(parts, {0: 3, 1: 1}, 0, 4)
    assert not may_start(parts, {0: 4, 1: 1}, 0, 5)


def test_a_gate_with_an_empty_slice_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one part"):
        PushGate({0: 0})


async def test_a_waiting_push_starts_when_the_others_catch_up() -> None:
    gate = PushGate({0: 2, 1: 2})
    gate.completed(0)
    started = trio.Event()

    async def second_part_of_0() -> None:
        await gate.wait(0, 2)
        started.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second_part_of_0)
        await trio.testing.wait_all_tasks_blocked()
        assert not started.is_set()
        gate.completed(1)  # aggregator 1 caught up: 0 may send its next part
        await trio.testing.wait_all_tasks_blocked()
        assert started.is_set()


async def test_an_aggregator_that_leaves_holds_nobody_back() -> None:
    gate = PushGate({0: 3, 1: 3, 2: 3})
    gate.completed(0)
    gate.completed(2)
    released = trio.Event()

    async def next_part_of_0() -> None:
        await gate.wait(0, 2)
        released.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_part_of_0)
        await trio.testing.wait_all_tasks_blocked()
        assert not released.is_set()
        gate.leave(1)  # its exchange failed (departed, refused): it no longer paces us
        await trio.testing.wait_all_tasks_blocked()
        assert released.is_set()
    assert gate.ready(1, 99)  # a push to a member that left is never held


async def test_a_laggard_holds_the_others_only_for_the_hold_time(autojump_clock: trio.abc.Clock) -> None:
    """An aggregator that acknowledges nothing stops pacing the others after ``hold`` seconds, well before
    its stall timeout, so the healthy aggregators get our next parts before their own sender timeouts
    drop us (holding until the laggard's exchange failed raced those timeouts under load)."""
    gate = PushGate({0: 3, 1: 3}, hold=lambda: 1.5)
    start = trio.current_time()
    gate.completed(0)  # aggregator 0 acknowledged part 0; 1 acknowledges nothing
    await gate.wait(0, 1)  # one part ahead: not held
    assert not gate.ready(0, 2)
    await gate.wait(0, 2)
    assert trio.current_time() - start == pytest.approx(1.5)  # held exactly until 1 became a laggard
    assert gate.lagging(1) and not gate.lagging(0)
    gate.completed(1)  # the laggard acknowledged: back in step, it paces the others again
    assert not gate.lagging(1)
    gate.completed(0)
    gate.completed(0)
    assert not gate.ready(0, 3)


async def test_a_push_waiting_at_the_gate_is_no_laggard(autojump_clock: trio.abc.Clock) -> None:
    """Waiting for the others is not lagging: only an aggregator whose own pushes stopped is left out."""
    gate = PushGate({0: 3, 1: 3}, hold=lambda: 1.0)
    start = trio.current_time()
    gate.completed(0)
    gate.completed(0)  # 0 is two parts ahead of 1: its part 3 waits until 1 acknowledged part 1
    released: list[float] = []

    async def part_3_of_0() -> None:
        await gate.wait(0, 3)
        released.append(trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(part_3_of_0)
        await trio.sleep(0.6)
        gate.completed(1)  # 1 progresses once, then stops
        await trio.sleep(0.6)
        assert not released and not gate.lagging(0)  # 0 progressed 1.2 s ago, but it is waiting
        assert not gate.lagging(1)
    assert released == [pytest.approx(1.6)]  # 1.0 s after 1's last acknowledgement


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)
