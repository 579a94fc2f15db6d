"""Issue 10's split brain with the real collaborative optimizer: a volunteer that stepped alone on its
half of a split DHT meets the collaboration again, is told it is the minority (through ``diverged``, which
the optimizer already re-syncs on), downloads the collaboration's *lower* step and steps with it."""

from __future__ import annotations

import numpy as np
import trio

from tests.volunteer.test_collab import LinearTask, examples, spec, start_collab, start_nodes
from volunteer.collab.optimizer import CollaborativeOptimizer


async def test_a_lone_fork_re_syncs_down_to_the_collaboration_when_the_halves_meet(
    nursery: trio.Nursery,
) -> None:
    b = 8
    training = spec(2 * b)
    task = LinearTask()
    data = examples(3, 400)
    west_nodes = await start_nodes(nursery, 2)
    (east_node,) = await start_nodes(nursery, 1)  # its own DHT: the other half of the split
    west = [await start_collab(nursery, node, training) for node in west_nodes]
    east = await start_collab(nursery, east_node, training)

    async def step(peer: CollaborativeOptimizer, offset: int, samples: int = b) -> None:
        await peer.accumulate(task.collate(data[offset : offset + samples]))
        await peer.refresh_view()
        assert await peer.average_and_step()

    for i in range(2):  # the collaboration: two users, two steps
        async with trio.open_nursery() as group:
            for j, peer in enumerate(west):
                group.start_soon(step, peer, 2 * b * i + j * b)
    for i in range(5):  # the fork: alone (nobody else in its half), five steps of its own
        await step(east, 100 + 2 * b * i, 2 * b)
    assert (west[0].trainer.step, east.trainer.step) == (2, 5)

    await east_node.dht.bootstrap([west_nodes[0].host.listen_addrs[0]])  # the halves meet
    with trio.fail_after(20):
        while not east.behind():
            await east.refresh_view()
            await trio.sleep(0.1)
    assert east.view is not None and (east.view.step, east.view.minority) == (2, True)
    assert not any(peer.behind() for peer in west)  # the collaboration discards nothing

    with trio.fail_after(30):
        assert await east.sync_state() == 2
    assert np.array_equal(east.trainer.parameter_vector(), west[0].trainer.parameter_vector())

    async with trio.open_nursery() as group:  # one collaboration again: the next step is everyone's
        for j, peer in enumerate([*west, east]):
            group.start_soon(step, peer, 300 + j * 5, 5)
    vectors = [p.trainer.parameter_vector() for p in [*west, east]]
    assert all(np.array_equal(vectors[0], v) for v in vectors[1:])
    assert {p.trainer.step for p in [*west, east]} == {3}
