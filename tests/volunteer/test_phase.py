"""The optimizer's explicit phase (volunteer.collab.phase) and what it forbids (issue 10, items 4 and 6)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from shared.alone import HIGH_WATER_TTL, HighWater, save_high_water
from volunteer.collab.optimizer import CollaborativeOptimizer
from volunteer.collab.phase import _ALLOWED, PeerState, Phase, PhaseError
from volunteer.collab.trainer import LocalTrainer

from .test_collab import CONFIG, LinearTask, examples, see_each_other, spec, start_collab, start_nodes


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
    while fresh, after the download it publishes the collaboration's fingerprint, and it reports as
    discarded the steps its killed process had taken past the state it came back to."""
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
    # it took part in step 3 before it was killed, with peers whose state died with them too
    discarded: list[tuple[int, int]] = []
    trainer = LocalTrainer(LinearTask(), training, "collab-test")  # type: ignore[arg-type]
    rejoined = CollaborativeOptimizer(
        nodes[2],
        trainer,
        training,
        config=CONFIG,
        previous_life=3,
        on_discard=lambda first, last: discarded.append((first, last)),
    )
    await nursery.start(rejoined.run)
    view = await rejoined.refresh_view()
    assert rejoined.peer.phase is Phase.FRESH and not rejoined.anchored
    assert view.step == 1 and rejoined.behind()
    assert not rejoined.ready()  # fresh: never a round, whatever the view says
    assert rejoined.progress().params == b""  # publishes no fingerprint: it vouches for nothing
    with trio.fail_after(30):
        assert await rejoined.sync_state() == 1
    assert rejoined.peer.phase is Phase.TRAINING and rejoined.anchored
    assert rejoined.progress().params == first.progress().params != b""
    assert discarded == [(2, 3)]  # the steps its earlier process took past the state it came back to


async def test_a_lone_volunteer_does_not_train_on_a_state_older_than_its_high_water_mark(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Restarted alone after the collaboration showed it step 5 a moment ago (the issue's split DHT: it
    sees nobody), a volunteer re-syncs instead of forking from step 0; once the mark expired, the run goes
    on from what there is."""
    training = spec(8)
    (node,) = await start_nodes(nursery, 1)
    save_high_water(tmp_path, HighWater(run_id="collab-test", step=5, seen=time.time()))
    trainer = LocalTrainer(LinearTask(), training, "collab-test")  # type: ignore[arg-type]
    collab = CollaborativeOptimizer(node, trainer, training, data_dir=tmp_path, config=CONFIG)
    await nursery.start(collab.run)
    await collab.refresh_view()
    assert collab.behind()  # fresh, alone, and the collaboration was at step 5
    await collab.accumulate(LinearTask().collate(examples(1, 8)))
    assert not await collab.average_and_step()  # no lone step on step 0
    assert "older than step 5" in (collab.stats.waiting or "")
    assert collab.trainer.step == 0
    # the mark expired (the collaboration was last seen long ago): the lone step is taken
    collab.evidence.mark = HighWater(run_id="collab-test", step=5, seen=time.time() - 2 * HIGH_WATER_TTL)
    assert not collab.behind()
    assert await collab.average_and_step()
    assert collab.trainer.step == 1


def test_replaced_steps_are_those_the_collaboration_never_took() -> None:
    from volunteer.collab.sync import _replaced

    assert _replaced(None, 0, 7, minority_seen=True) is None  # a fresh peer replaced nothing of the run's
    assert (
        _replaced(40, 40, 50, minority_seen=False) is None
    )  # an honest laggard: its last step was a group's
    assert _replaced(100, 90, 110, minority_seen=False) == (91, 100)  # a lone fork that fell behind
    assert _replaced(120, 120, 90, minority_seen=True) == (90, 120)  # a group fork ahead of the survivor
    assert _replaced(60, 60, 60, minority_seen=True) == (60, 60)  # diverged at the same step
    assert _replaced(5, 0, 3, minority_seen=True) == (1, 5)  # never below step 1


async def test_a_partial_read_does_not_lower_the_high_water_mark(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    from shared.progress import CollabView

    (node,) = await start_nodes(nursery, 1)
    save_high_water(tmp_path, HighWater(run_id="collab-test", step=50, seen=time.time()))
    trainer = LocalTrainer(LinearTask(), spec(8), "collab-test")  # type: ignore[arg-type]
    collab = CollaborativeOptimizer(node, trainer, spec(8), data_dir=tmp_path, config=CONFIG)
    view = CollabView(
        step=20, samples=0.0, samples_per_second=0.0, peers=3, peers_at_step=2, ready=False,
        diverged=False, ignored=(), syncing=(), loss=None, shown=20, collaborations=1,
    )  # fmt: skip
    await collab.evidence.observe(view)
    assert collab.evidence.mark is not None and collab.evidence.mark.step == 50  # a lagging group only
    await collab.evidence.observe(dataclasses.replace(view, collaborations=2))
    assert collab.evidence.mark.step == 20  # a merge sent the run back: the survivor is what was shown


async def test_a_peer_one_step_behind_reports_its_own_step_discarded_when_it_was_a_fork(
    nursery: trio.Nursery,
) -> None:
    """The soak's split round: a round completed for some members and failed for others, who retried and
    took their own step 1; the first went on to step 2. One step behind, the retried peer downloads step 2
    and, from the state's lineage, reports its step 1 discarded (it was credited before: it had stepped
    with a group, so it looked like an honest laggard); an honest laggard reports nothing."""
    b = 8
    training = spec(2 * b)
    nodes = await start_nodes(nursery, 4)
    first = await start_collab(nursery, nodes[0], training)
    second = await start_collab(nursery, nodes[1], training)
    task = LinearTask()
    data = examples(5, 8 * b)
    await see_each_other([first, second])

    async def step(peer: CollaborativeOptimizer, offset: int) -> None:
        await peer.accumulate(task.collate(data[offset : offset + b]))
        await peer.refresh_view()
        assert await peer.average_and_step()

    def joined(node_index: int) -> tuple[CollaborativeOptimizer, list[tuple[int, int]]]:
        discarded: list[tuple[int, int]] = []
        trainer = LocalTrainer(LinearTask(), training, "collab-test")  # type: ignore[arg-type]
        peer = CollaborativeOptimizer(
            nodes[node_index],
            trainer,
            training,
            config=CONFIG,
            on_discard=lambda first, last: discarded.append((first, last)),
        )
        return peer, discarded

    forked, forked_discards = joined(2)
    laggard, laggard_discards = joined(3)
    await nursery.start(forked.run)
    await nursery.start(laggard.run)

    async with trio.open_nursery() as group:
        group.start_soon(step, first, 0)
        group.start_soon(step, second, b)
    # the laggard holds the collaboration's step 1 (downloaded), the forked peer its own step 1 (as if it
    # had stepped with the retried group: the same step number, other gradients)
    with trio.fail_after(30):
        assert await laggard.sync_state() == 1
    forked.trainer.apply(np.full(forked.trainer.numel, 0.5, dtype=np.float32))
    forked.peer.fingerprint = forked.trainer.fingerprint()
    forked.peer.anchored = True
    forked.peer.agreed_step = 1
    assert forked.trainer.lineage[1] != first.trainer.lineage[1] == laggard.trainer.lineage[1]

    async with trio.open_nursery() as group:
        group.start_soon(step, first, 2 * b)
        group.start_soon(step, second, 3 * b)
    with trio.fail_after(30):
        while (await forked.refresh_view()).step != 2 or (await laggard.refresh_view()).step != 2:
            await trio.sleep(0.05)  # both see the collaboration at step 2, one step ahead of them
        assert await forked.sync_state() == 2
        assert await laggard.sync_state() == 2
    assert forked_discards == [(1, 1)]
    assert laggard_discards == []
    assert forked.progress().params == first.progress().params
