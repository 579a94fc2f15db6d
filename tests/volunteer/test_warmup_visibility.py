"""A volunteer is in the run from its warm-up's start (volunteer.session, step 3): its progress record is out,
so a peer that finished its own warm-up first does not step alone beside it, and the record claims none
of the warm-up's samples, which are dropped (seen in the demo under load: the first volunteer to finish
its warm-up stepped alone twice while the other measured, and the two disagreed on the run's step)."""

from __future__ import annotations

import trio

from tests.volunteer.test_collab import LinearTask, examples, spec, start_collab, start_nodes
from volunteer.collab.torch_thread import run_torch


async def test_a_volunteer_warming_up_is_in_the_run_and_claims_no_samples(nursery: trio.Nursery) -> None:
    b = 8
    training = spec(2 * b)
    task = LinearTask()
    data = examples(3, 100)
    nodes = await start_nodes(nursery, 2)
    first = await start_collab(nursery, nodes[0], training)
    warming = await start_collab(nursery, nodes[1], training)  # its board runs while it measures
    # a warm-up micro-batch goes straight into the trainer (volunteer.session._measure), as many samples
    # as make the target batch together with the first volunteer's
    await run_torch(warming.trainer.accumulate, task.collate(data[:b]))
    await first.accumulate(task.collate(data[b : 2 * b]))
    with trio.fail_after(20):
        while first.view is None or first.view.peers < 2:
            await first.refresh_view()
            await trio.sleep(0.1)
    view = first.view
    assert view.samples == b and not view.ready  # only ours count toward the target: no round yet
    assert warming.progress().samples == 0
    await first.evidence.read()  # what its background reads see every few seconds while it sees nobody
    verdict = await first.evidence.verdict(first.trainer.step)
    assert not verdict.allowed and "1 other peer(s) in the run" in verdict.why, verdict
