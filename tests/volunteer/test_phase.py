"""The optimizer's explicit phase (volunteer.collab.phase) and what it forbids (issue 10, items 4 and 6)."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from volunteer.collab.optimizer import CollaborativeOptimizer
from volunteer.collab.phase import _ALLOWED, PeerState, Phase, PhaseError

from .test_collab import LinearTask, examples, see_each_other, spec, start_collab, start_nodes


@given(st.lists(st.sampled_from(list(Phase)), max_size=30))
def test_transitions_follow_the_diagram_and_rounds_end_outside_averaging(walk: list[Phase]) -> None:
    peer = PeerState()
    for target in walk:
        before = peer.phase
        if target is before or target in _ALLOWED[before]:
            peer.round_step, peer.round_samples = 7, 3
            assert peer.enter(target) is before
            assert peer.phase is target
            if target is not Phase.AVERAGING:
                assert (peer.round_step, peer.round_samples) == (-1, 0)
        else:
            with pytest.raises(PhaseError):
                peer.enter(target)
            assert peer.phase is before
    assert not _ALLOWED[Phase.LEFT]  # leaving is final


def test_a_fresh_peer_cannot_enter_a_round_directly() -> None:
    with pytest.raises(PhaseError, match="fresh -> averaging"):
        PeerState().enter(Phase.AVERAGING)


async def test_a_rejoining_peer_downloads_the_state_before_any_round(nursery: trio.Nursery) -> None:
    """Two peers took a step; a restarted third (fresh parameters) is behind, is never ready for a round
    while fresh, and after the download it publishes the collaboration's fingerprint."""
    b = 8
    training = spec(2 * b)
    nodes = await start_nodes(nursery, 3)
    first = await start_collab(nursery, nodes[0], training)
    second = await start_collab(nursery, nodes[1], training)
    task = LinearTask()
    data = examples(3, 4 * b)
    await see_each_other([first, second])

    async def step(peer: CollaborativeOptimizer, offset: int) -> None:
        await peer.accumulate(task.collate(data[offset : offset + b]))
        await peer.refresh_view()
        assert await peer.average_and_step()

    async with trio.open_nursery() as group:
        group.start_soon(step, first, 0)
        group.start_soon(step, second, b)
    rejoined = await start_collab(nursery, nodes[2], training)
    view = await rejoined.refresh_view()
    assert rejoined.peer.phase is Phase.FRESH and not rejoined.anchored
    assert view.step == 1 and rejoined.behind()
    assert not rejoined.ready()  # fresh: never a round, whatever the view says
    assert rejoined.progress().params == b""  # publishes no fingerprint: it vouches for nothing
    with trio.fail_after(30):
        assert await rejoined.sync_state() == 1
    assert rejoined.peer.phase is Phase.TRAINING and rejoined.anchored
    assert rejoined.progress().params == first.progress().params != b""
