"""The progress board's periods (``volunteer/collab/progress_board.py``, "Long rounds read less" and "A round
under way reads what it needs itself"): the rule (pure), the modes' periods, a DiLoCo collaboration far
from its round's end reading and publishing its records at most every 3 s through real nodes, and a board
whose round is under way reading only at its longest period until its step moves past the view's."""

from __future__ import annotations

import logging
import time

import trio
from hypothesis import given
from hypothesis import strategies as st

from protocols.training import Progress, SyncSpec
from shared.progress import MAX_EXTRAPOLATION
from shared.tolerated import Tolerated
from volunteer.collab.progress_board import (
    LONG_ROUND_MIN_POLL,
    MIN_POLL,
    Periods,
    ProgressBoard,
    periods,
    poll_interval,
)

from .test_collab import see_each_other, spec, start_nodes
from .test_diloco_collab import diloco_spec, start_diloco

periods_s = st.floats(0.01, 5.0)
etas = st.none() | st.floats(0.0, 1e6)


@given(periods_s, etas)
def test_without_a_longer_poll_the_interval_is_the_batch_modes_rule(poll: float, eta: float | None) -> None:
    old = poll if eta is None else min(poll, max(MIN_POLL, eta / 2))
    assert poll_interval(poll, eta) == old
    assert poll_interval(poll, eta, longest_poll=poll / 2) == old


@given(periods_s, etas, st.floats(0.0, 30.0), st.sampled_from([MIN_POLL, LONG_ROUND_MIN_POLL]))
def test_a_longer_poll_waits_half_the_time_to_the_target_at_most_that_long(
    poll: float, eta: float | None, longest: float, shortest: float
) -> None:
    interval = poll_interval(poll, eta, longest, shortest)
    if eta is None:  # nobody computes: no target to wait for
        assert interval == poll
        return
    if eta == 0 and longest > poll:  # the target is reached: the round under way reads for itself
        assert interval == longest
        return
    assert min(shortest, poll) <= interval <= max(poll, longest)
    assert interval <= max(shortest, eta / 2)  # never past the middle of what is left: a round is entered
    if eta / 2 >= max(poll, longest):
        assert interval == max(poll, longest)  # far from the target: one read per longest poll


def test_diloco_reads_and_publishes_at_most_every_3_s_the_batch_mode_as_configured() -> None:
    diloco, batch = diloco_spec(64), spec(64)
    assert periods(diloco, 0.3, 1.0) == Periods(MAX_EXTRAPOLATION, MAX_EXTRAPOLATION, 0.25)
    assert (MAX_EXTRAPOLATION, LONG_ROUND_MIN_POLL) == (3.0, 0.25)
    assert periods(diloco, 5.0, 7.0) == (5.0, 7.0, 0.25)  # a volunteer's slower periods stay
    assert periods(diloco, 0.1, 0.2).shortest_poll == 0.25  # near a round's end, 4 reads a second at most
    assert periods(batch, 0.3, 1.0) == (0.3, 1.0, MIN_POLL)
    assert batch.sync == SyncSpec() and diloco.sync.mode == "diloco"


async def test_a_diloco_collaboration_far_from_its_round_end_reads_and_publishes_every_3_s(
    nursery: trio.Nursery,
) -> None:
    """Issue 16's bytes: with the test periods (read every 0.1 s, publish every 0.2 s) a board would read
    about 65 times and publish about 33 times in 6.5 s; far from its round's end the DiLoCo mode does each
    at most every 3 s (3 times in 6.5 s, whatever the load: a busy machine only makes it fewer)."""
    nodes = await start_nodes(nursery, 2)
    long_round = diloco_spec(10**6)  # a round no one ends during the test
    peers = [await start_diloco(nursery, node, long_round) for node in nodes]
    await see_each_other(peers)
    reads, stores = [0, 0], [0, 0]
    for i, peer in enumerate(peers):
        board = peer.board
        try_refresh, store = board.try_refresh, board._store

        async def counted_read(i: int = i, try_refresh: object = try_refresh) -> object:
            reads[i] += 1
            return await try_refresh()  # type: ignore[operator]

        async def counted_store(progress: object, i: int = i, store: object = store) -> None:
            stores[i] += 1
            await store(progress)  # type: ignore[operator]

        board.try_refresh = counted_read  # type: ignore[method-assign]
        board._store = counted_store  # type: ignore[method-assign]
        peer.counted(10, 1.0, 1.0)  # computing at 10 samples/s: the view has an eta (a day away)
        peer.publish_soon()
    await trio.sleep(6.5)  # the window the reads are counted in, not a synchronisation
    assert all(peer.board.view is not None and peer.board.view.peers == 2 for peer in peers)
    assert all(1 <= n <= 4 for n in reads), reads  # 3 s apart: at most 3 in 6.5 s (+1: the one under way)
    assert all(1 <= n <= 4 for n in stores), stores  # the publish_soon above, then every 3 s


async def test_a_round_under_way_reads_at_the_longest_period_until_our_step_moves_past_the_view(
    nursery: trio.Nursery,
) -> None:
    """Issue 16's bytes: once the view shows the target reached at our step, ``eta / 2`` would read every
    50 ms through the whole round (57 of 125 reads of a benchmark run). Now the board waits its longest
    period (60 s here); when our step moves past the view's, :meth:`ProgressBoard.publish_soon` (a round
    ending) makes it read at once. Without the rule it reads about 40 times in the 2 s watched."""
    nodes = await start_nodes(nursery, 2)
    steps = [0, 0]

    def own(i: int) -> Progress:  # computing, the target of 64 reached at our step
        return Progress(step=steps[i], samples=64, samples_per_second=10.0, time=time.time())

    boards = [
        ProgressBoard(
            node,
            spec(64),
            own=lambda i=i: own(i),
            anchored=lambda: True,
            tolerated=Tolerated(logging.getLogger(__name__)),
            poll_period=0.1,
            publish_period=0.2,
            longest_poll=60.0,
        )
        for i, node in enumerate(nodes)
    ]
    reads = [0, 0]
    uncounted = [board.refresh for board in boards]
    for i, board in enumerate(boards):
        refresh = board.refresh

        async def counted(i: int = i, refresh: object = refresh) -> object:
            reads[i] += 1
            return await refresh()  # type: ignore[operator]

        board.refresh = counted  # type: ignore[method-assign]
        await uncounted[i]()  # a view before the poller starts: eta 0 (our 64 samples), so it waits 60 s
        await nursery.start(board.run)
    with trio.fail_after(20):  # the boards' own first reads may come before the other published
        while [(await read()).peers for read in uncounted] != [2, 2]:
            await trio.sleep(0.05)
    assert all(b.view is not None and b.view.eta(64) == 0 for b in boards)
    before = list(reads)
    await trio.sleep(2.0)  # the window the reads are counted in, not a synchronisation
    assert reads == before, (before, reads)  # the next read is 60 s away
    steps[0] = 1  # board 0's round ended: its view is of a past step
    boards[0].publish_soon()
    with trio.fail_after(20):  # at once (MIN_POLL), not in 60 s; generous for a busy machine
        while reads[0] == before[0]:
            await trio.sleep(0.01)
    assert reads[1] == before[1]  # the other's round goes on
    await trio.sleep(1.0)  # once per change of our step: its new round is under way (eta 0) too
    assert reads[0] == before[0] + 1, (before, reads)
