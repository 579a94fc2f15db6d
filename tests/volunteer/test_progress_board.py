"""The progress board's periods (``volunteer/collab/progress_board.py``, "Long rounds read less"): the rule
(pure), the modes' periods, and a DiLoCo collaboration far from its round's end reading and publishing its
records at most every 3 s through real nodes."""

from __future__ import annotations

import trio
from hypothesis import given
from hypothesis import strategies as st

from protocols.training import SyncSpec
from shared.progress import MAX_EXTRAPOLATION
from volunteer.collab.progress_board import MIN_POLL, periods, poll_interval

from .test_collab import see_each_other, spec, start_nodes
from .test_diloco_collab import diloco_spec, start_diloco

periods_s = st.floats(0.01, 5.0)
etas = st.none() | st.floats(0.0, 1e6)


@given(periods_s, etas)
def test_without_a_longer_poll_the_interval_is_the_batch_modes_rule(poll: float, eta: float | None) -> None:
    old = poll if eta is None else min(poll, max(MIN_POLL, eta / 2))
    assert poll_interval(poll, eta) == old
    assert poll_interval(poll, eta, longest_poll=poll / 2) == old


@given(periods_s, etas, st.floats(0.0, 30.0))
def test_a_longer_poll_waits_half_the_time_to_the_target_at_most_that_long(
    poll: float, eta: float | None, longest: float
) -> None:
    interval = poll_interval(poll, eta, longest)
    if eta is None:  # nobody computes: no target to wait for
        assert interval == poll
        return
    assert min(MIN_POLL, poll) <= interval <= max(poll, longest)
    assert interval <= max(MIN_POLL, eta / 2)  # never past the middle of what is left: a round is entered
    if eta / 2 >= max(poll, longest):
        assert interval == max(poll, longest)  # far from the target: one read per longest poll


def test_diloco_reads_and_publishes_at_most_every_3_s_the_batch_mode_as_configured() -> None:
    diloco, batch = diloco_spec(64), spec(64)
    assert periods(diloco, 0.3, 1.0) == (MAX_EXTRAPOLATION, MAX_EXTRAPOLATION) == (3.0, 3.0)
    assert periods(diloco, 5.0, 7.0) == (5.0, 7.0)  # a volunteer's slower periods stay
    assert periods(batch, 0.3, 1.0) == (0.3, 1.0)
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
