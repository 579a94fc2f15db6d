"""The only holder of the newest state dies while the others download it (shared.alone, rule (d)): the
survivors resume together from the newest state still announced -- a backbone's older checkpoint --
within seconds, not after the high-water mark's TTL, and nothing forks.

What the two-backbone soak hit under load: restarted volunteers downloaded step 9 from the only peer that
held it; it was SIGKILLed; its progress record expired while they waited for a state of step 9, and from
then on they saw only each other, all downloading, and asked for "a state of step 0" (their own step) that
nobody announces -- for the rest of the run, beside a backbone that held the checkpoint of step 1.

Deterministic: the holder's state server hangs at the named fault point ``state.serve`` on the first
chunk request (the download is under way), and the test then kills the holder (its host aborted: every
connection reset, dials refused; its tasks cancelled, so it publishes nothing more). The survivors' sync
patience is longer than a progress record lives (as on a busy machine, where the holder's last record
was near its end when it died), so no patience runs out before the record is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import trio

from shared import faults
from shared.auth.keys import Identity
from shared.node import Node, open_node
from shared.state.transfer import StateServer, announce_state
from tests.volunteer.test_collab import CONFIG, LinearTask, examples, spec, start_nodes
from volunteer.collab.optimizer import CollabConfig, CollaborativeOptimizer
from volunteer.collab.torch_thread import run_torch
from volunteer.collab.trainer import LocalTrainer

RUN = "collab-test"
#: longer than a progress record lives (PROGRESS_TTL): only rule (d) can end the wait in time
PATIENT = CollabConfig(poll_period=0.1, publish_period=0.2, matchmaking_window=0.5, sync_patience=90.0)
#: the survivors resume within this many seconds of the kill (in a few seconds unloaded); far below the
#: high-water mark's TTL (120 s) and the patience, so nothing but rule (d) can make it
RESUMED_WITHIN = 45.0


@pytest.fixture(autouse=True)
def _disarm() -> None:
    faults.disarm()


@dataclass
class Member:
    node: Node
    collab: CollaborativeOptimizer
    scope: trio.CancelScope

    def kill(self) -> None:
        """What a SIGKILL does to the others: every connection ends at once, nothing answers or publishes."""
        self.node.host.abort()
        self.scope.cancel()


async def start_member(nursery: trio.Nursery, seed: Node, tag: str, config: CollabConfig) -> Member:
    training = spec(8)

    async def run(task_status: trio.TaskStatus[Member]) -> None:
        with trio.CancelScope() as scope, faults.scope(tag):
            async with (
                open_node(
                    Identity.generate(),
                    RUN,
                    "volunteer",
                    listen=["/ip4/127.0.0.1/tcp/0"],
                    initial_peers=[seed.host.listen_addrs[0]],
                ) as node,
                trio.open_nursery() as own,
            ):
                own.start_soon(node.publish_presence_forever)
                trainer = LocalTrainer(LinearTask(), training, RUN)  # type: ignore[arg-type]
                collab = CollaborativeOptimizer(node, trainer, training, config=config)
                await own.start(collab.run)
                task_status.started(Member(node, collab, scope))
                await trio.sleep_forever()

    member: Member = await nursery.start(run)
    return member


async def sees_the_holder_at(member: Member, step: int) -> None:
    """Wait until ``member`` sees the run at ``step`` and its high-water mark says so."""
    with trio.fail_after(30):
        while True:
            view = await member.collab.refresh_view()
            mark = member.collab.evidence.mark
            if view.step == step and mark is not None and mark.step == step:
                return
            await trio.sleep(0.05)


async def test_survivors_resume_from_the_checkpoint_when_the_only_holder_of_the_newest_state_dies(
    nursery: trio.Nursery,
) -> None:
    b = 8
    task, data = LinearTask(), examples(7, 10 * b)
    (backbone,) = await start_nodes(nursery, 1)  # the DHT's entry point, as a backbone is
    holder = await start_member(nursery, backbone, "holder", CONFIG)

    async def lone_step(i: int) -> None:
        await holder.collab.accumulate(task.collate(data[i * b : (i + 1) * b]))
        await holder.collab.refresh_view()
        assert await holder.collab.average_and_step()

    await lone_step(0)
    checkpoint = await run_torch(holder.collab.trainer.state_blob)  # the backbone stores step 1
    server = StateServer(backbone.host, backbone=True)
    announcement = server.offer(1, checkpoint)

    async def announce_forever() -> None:  # as a backbone keeps its newest checkpoint announced
        while True:
            await announce_state(backbone.dht, announcement)
            await trio.sleep(10)

    nursery.start_soon(announce_forever)
    for i in range(1, 3):
        await lone_step(i)
    assert holder.collab.trainer.step == 3  # the newest state: only the holder has it

    faults.arm("state.serve", "hang", where="holder")  # the first chunk request: a download under way
    first = await start_member(nursery, backbone, "first", PATIENT)
    await sees_the_holder_at(first, 3)
    loaded: dict[str, int] = {}

    async def sync(name: str, member: Member) -> None:
        loaded[name] = await member.collab.sync_state()

    nursery.start_soon(sync, "first", first)
    with trio.fail_after(30):
        while faults.hits("state.serve") < 1:
            await trio.sleep(0.02)
    holder.kill()  # the only holder of step 3 dies while the first downloads from it
    killed_at = trio.current_time()

    second = await start_member(nursery, backbone, "second", PATIENT)  # restarted meanwhile
    await sees_the_holder_at(second, 3)  # its last record still says step 3
    nursery.start_soon(sync, "second", second)
    with trio.fail_after(RESUMED_WITHIN):
        while len(loaded) < 2:
            await trio.sleep(0.05)
    print(f"the survivors resumed {trio.current_time() - killed_at:.1f} s after the holder died")

    assert loaded == {"first": 1, "second": 1}  # the checkpoint: not step 0, not a fork of their own
    reference = LocalTrainer(LinearTask(), spec(b), RUN)  # type: ignore[arg-type]
    reference.load_state_blob(checkpoint)
    survivors = [first.collab, second.collab]
    for peer in survivors:
        assert np.array_equal(peer.trainer.parameter_vector(), reference.parameter_vector())
        assert peer.peer.fingerprint == reference.lineage[1]
        assert peer.evidence.mark is None or peer.evidence.mark.step <= 1  # step 3 is forgotten

    async def step_together(peer: CollaborativeOptimizer, offset: int) -> None:
        await peer.accumulate(task.collate(data[offset : offset + b // 2]))
        await peer.refresh_view()
        assert await peer.average_and_step()

    with trio.fail_after(60):  # one collaboration: the next step is both survivors'
        async with trio.open_nursery() as group:
            for j, peer in enumerate(survivors):
                group.start_soon(step_together, peer, 6 * b + j * (b // 2))
    vectors = [peer.trainer.parameter_vector() for peer in survivors]
    assert np.array_equal(vectors[0], vectors[1])
    assert [peer.trainer.step for peer in survivors] == [2, 2]
    for peer in survivors:
        view = await peer.refresh_view()
        assert view.collaborations == 1 and not view.diverged
