"""Rebalancing a swarm run (volunteer.swarm.member): newcomers fill the emptiest stage; when a stage loses
its only server, a server of a stage that can spare one moves there within a rebalancing period, serves
it, and trainers' micro-batches flow through the pipeline again."""

from __future__ import annotations

import math

import trio

from protocols.training import TrainingSpec
from shared.node import Node
from shared.swarm.directory import find_stage_servers
from tests.swarmkit import micro_batches, start_node
from volunteer.collab.optimizer import CollabConfig
from volunteer.swarm.client import SwarmClient, SwarmClientConfig
from volunteer.swarm.member import SwarmMember, serve_swarm
from volunteer.tasks import make_task

RUN_ID = "swarm-rebalance-test"
SEED = 17  # of the corpus stream the micro-batches come from
STAGES = 3
# a target batch no test reaches: the stages never step, so every stage's state stays the initial one
SPEC = TrainingSpec(
    task_options={"layers": 4, "d_model": 32, "heads": 2, "ffn": 64, "seq_len": 24},
    target_batch=1 << 20,
    local_batch=4,
)
PERIOD = 1.0
# only moves that double the pipeline's throughput (refilling an empty stage: infinitely): on a busy
# machine the measured rates are noisy, and a small margin moves servers back and forth
HYSTERESIS = 1.0


async def _counts(reader: Node) -> list[int]:
    return [len(await find_stage_servers(reader.dht, k, STAGES)) for k in range(STAGES)]


async def test_a_stage_that_loses_its_server_is_refilled_by_rebalancing(nursery: trio.Nursery) -> None:
    task = make_task(SPEC)
    seed, _ = await start_node(nursery, RUN_ID, [])
    initial = [seed.host.listen_addrs[0]]
    reader, _ = await start_node(nursery, RUN_ID, initial)
    members: list[SwarmMember] = []
    scopes: list[trio.CancelScope] = []
    with trio.fail_after(60):
        for expected in ([1, 0, 0], [1, 1, 0], [1, 1, 1], [2, 1, 1]):  # each newcomer fills the emptiest
            node, scope = await start_node(nursery, RUN_ID, initial)
            member = SwarmMember()
            nursery.start_soon(
                lambda node=node, member=member: serve_swarm(
                    node, task, SPEC, RUN_ID, STAGES, period=PERIOD, member=member, hysteresis=HYSTERESIS,
                    collab_config=CollabConfig(poll_period=0.1),
                )
            )  # fmt: skip
            members.append(member)
            scopes.append(scope)
            while await _counts(reader) != expected:
                await trio.sleep(0.05)
    assert [m.stage for m in members] == [0, 1, 2, 0]

    trainer, _ = await start_node(nursery, RUN_ID, initial)
    client = SwarmClient(trainer, STAGES, SwarmClientConfig(refresh_period=0.5, timeout=5.0))
    batches = micro_batches(task, 12, SEED)
    with trio.fail_after(60):
        for batch in batches[:6]:  # every server measures its speed (the rates rebalancing weighs)
            await client.process(batch)
        while not all(m.service and m.service.trainer.seconds_per_sample > 0 for m in members):
            await client.process(batches[0])
    # (the rule may already have moved a server: the last stage, with the output layer, is the slowest)

    alone = next(k for k in range(STAGES) if sum(m.stage == k for m in members) == 1)
    victim = next(i for i, m in enumerate(members) if m.stage == alone)
    scopes[victim].cancel()  # a stage's only server is gone
    live = [m for i, m in enumerate(members) if i != victim]
    with trio.fail_after(90):  # its record expires, and the next period refills the stage
        while not any(m.service is not None and m.service.trainer.stage.index == alone for m in live):
            await trio.sleep(0.05)
        refill = next(m for m in live if m.stage == alone)
        for batch in batches[6:]:  # the pipeline works again, through the refilled stage
            assert math.isfinite(await client.process(batch))
    assert refill.moves and refill.moves[-1][1] == alone
    assert sorted(m.stage for m in live) == [0, 1, 2]  # every stage served (and no move can empty one)
    assert refill.service is not None and refill.service.server.stats.backwards > 0
