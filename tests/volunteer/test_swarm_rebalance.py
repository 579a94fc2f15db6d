"""Rebalancing a swarm run (volunteer.swarm.member): newcomers fill the emptiest stage; when a stage loses
its only server, a server of a stage that can spare one moves there within a rebalancing period, serves
it, and trainers' micro-batches flow through the pipeline again."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import trio

from protocols.training import TrainingSpec
from shared.auth.keys import Identity
from shared.node import Node, open_node
from shared.swarm.directory import find_stage_servers
from volunteer.collab.optimizer import CollabConfig
from volunteer.swarm.client import SwarmClient, SwarmClientConfig
from volunteer.swarm.member import SwarmMember, serve_swarm
from volunteer.tasks import make_task
from volunteer.tasks.base import Task

RUN_ID = "swarm-rebalance-test"
STAGES = 3
# a target batch no test reaches: the stages never step, so every stage's state stays the initial one
SPEC = TrainingSpec(
    task_options={"layers": 4, "d_model": 32, "heads": 2, "ffn": 64, "seq_len": 24},
    target_batch=1 << 20,
    local_batch=4,
)
PERIOD = 1.0


def _micro_batches(task: Task, count: int, size: int = 4) -> list[Mapping[str, torch.Tensor]]:
    from shared.data.corpus import generate_examples

    examples = [{"text": text} for text in generate_examples(17, 400)]
    samples = list(task.preprocess(iter(examples)))[: count * size]
    return [task.collate(samples[i * size : (i + 1) * size]) for i in range(count)]


async def _node(nursery: trio.Nursery, initial: list[str]) -> tuple[Node, trio.CancelScope]:
    async def run(task_status: trio.TaskStatus[tuple[Node, trio.CancelScope]]) -> None:
        with trio.CancelScope() as scope:
            async with open_node(
                Identity.generate(),
                RUN_ID,
                "volunteer",
                listen=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=initial,
            ) as node:
                task_status.started((node, scope))
                await trio.sleep_forever()

    result: tuple[Node, trio.CancelScope] = await nursery.start(run)
    return result


async def _counts(reader: Node) -> list[int]:
    return [len(await find_stage_servers(reader.dht, k, STAGES)) for k in range(STAGES)]


async def test_a_stage_that_loses_its_server_is_refilled_by_rebalancing(nursery: trio.Nursery) -> None:
    task = make_task(SPEC)
    seed, _ = await _node(nursery, [])
    initial = [seed.host.listen_addrs[0]]
    reader, _ = await _node(nursery, initial)
    members: list[SwarmMember] = []
    scopes: list[trio.CancelScope] = []
    with trio.fail_after(60):
        for expected in ([1, 0, 0], [1, 1, 0], [1, 1, 1], [2, 1, 1]):  # each newcomer fills the emptiest
            node, scope = await _node(nursery, initial)
            member = SwarmMember()
            nursery.start_soon(
                lambda node=node, member=member: serve_swarm(
                    node, task, SPEC, RUN_ID, STAGES, period=PERIOD, member=member,
                    collab_config=CollabConfig(poll_period=0.1),
                )
            )  # fmt: skip
            members.append(member)
            scopes.append(scope)
            while await _counts(reader) != expected:
                await trio.sleep(0.05)
    assert [m.stage for m in members] == [0, 1, 2, 0]

    trainer, _ = await _node(nursery, initial)
    client = SwarmClient(trainer, STAGES, SwarmClientConfig(refresh_period=0.5, timeout=5.0))
    batches = _micro_batches(task, 12)
    with trio.fail_after(60):
        for batch in batches[:6]:  # every server measures its speed (the rates rebalancing weighs)
            await client.process(batch)
        while not all(m.service and m.service.trainer.seconds_per_sample > 0 for m in members):
            await client.process(batches[0])
    assert not any(m.moves for m in members)  # balanced enough: nobody moved

    scopes[2].cancel()  # stage 2's only server is gone
    with trio.fail_after(60):
        while not any(m.moves for i, m in enumerate(members) if i != 2):
            await trio.sleep(0.05)
    movers = [m for i, m in enumerate(members) if i != 2 and m.moves]
    assert len(movers) == 1 and movers[0].moves == [(0, 2)]  # one of stage 0's two servers moved
    with trio.fail_after(60):
        while (await _counts(reader))[2] < 1 or not (movers[0].service and movers[0].stage == 2):
            await trio.sleep(0.05)
        for batch in batches[6:]:  # the pipeline works again, through the refilled stage
            assert torch.isfinite(torch.tensor(await client.process(batch)))
    assert movers[0].service is not None and movers[0].service.server.stats.backwards > 0
