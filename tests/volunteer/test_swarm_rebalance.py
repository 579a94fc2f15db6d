"""Rebalancing a swarm run (volunteer.swarm.member): newcomers fill the emptiest stage; when a stage loses
its only server, a server of a stage that can spare one moves there within a rebalancing period, serves
it, and trainers' micro-batches flow through the pipeline again."""

from __future__ import annotations

import math
import time

import msgspec
import pytest
import trio

from protocols.swarm import STAGE_RECORD_TTL, StageRecord, stage_key
from protocols.training import TrainingSpec
from shared.node import Node
from shared.swarm.directory import find_stage_servers
from tests.swarmkit import micro_batches, start_node
from volunteer.collab.optimizer import CollabConfig
from volunteer.swarm.client import SwarmClient, SwarmClientConfig
from volunteer.swarm.member import SwarmMember, serve_swarm
from volunteer.tasks import make_task
from volunteer.tasks.base import Task

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


async def _serving(
    nursery: trio.Nursery, task: Task, spec: TrainingSpec, count: int, leave: list[trio.Event] | None = None
) -> tuple[Node, list[SwarmMember], list[int]]:
    """A seed node and ``count`` servers joined one at a time (each placed by the records of the ones
    before); the list that the index of each server whose ``serve_swarm`` returned is appended to."""
    seed, _ = await start_node(nursery, RUN_ID, [])
    initial = [seed.host.listen_addrs[0]]
    members = [SwarmMember() for _ in range(count)]
    returned: list[int] = []
    with trio.fail_after(60):
        for i, member in enumerate(members):
            node, _ = await start_node(nursery, RUN_ID, initial)

            async def serve(node: Node = node, member: SwarmMember = member, i: int = i) -> None:
                await serve_swarm(
                    node, task, spec, RUN_ID, STAGES, period=PERIOD, member=member, hysteresis=HYSTERESIS,
                    collab_config=CollabConfig(poll_period=0.1), leave=None if leave is None else leave[i],
                )  # fmt: skip
                returned.append(i)

            nursery.start_soon(serve)
            while sum(await _counts(seed)) <= i:
                await trio.sleep(0.05)
    return seed, members, returned


async def test_a_stage_that_loses_its_server_is_refilled_by_rebalancing(nursery: trio.Nursery) -> None:
    task = make_task(SPEC)
    seed, _ = await start_node(nursery, RUN_ID, [])
    initial = [seed.host.listen_addrs[0]]
    reader, _ = await start_node(nursery, RUN_ID, initial)
    members: list[SwarmMember] = []
    scopes: list[trio.CancelScope] = []
    with trio.fail_after(60):
        for expected in (1, 2, 3, 3):  # each newcomer serves an unserved stage while there is one
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
            while sum(await _counts(reader)) < len(members):  # its record is out
                await trio.sleep(0.05)
            assert sum(count > 0 for count in await _counts(reader)) == expected
    assert sorted(m.stage for m in members[:3]) == [0, 1, 2]  # which one first: by their peer ids

    trainer, _ = await start_node(nursery, RUN_ID, initial)
    client = SwarmClient(trainer, STAGES, SwarmClientConfig(refresh_period=0.5, timeout=20.0))
    batches = micro_batches(task, 12, SEED)
    with trio.fail_after(120):
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
    assert refill.periods["moved"] == len(refill.moves) and refill.plan is not None  # each period counted
    assert sorted(m.stage for m in live) == [0, 1, 2]  # every stage served (and no move can empty one)
    assert refill.service is not None and refill.service.server.stats.backwards > 0


@pytest.mark.parametrize("liar", [False, True], ids=["honest", "a-lying-record"])
async def test_a_leaving_last_server_hands_its_stage_over_without_losing_its_steps(
    nursery: trio.Nursery, liar: bool
) -> None:
    """With ``liar``, a stranger's record claims the stage at a step far beyond the leaver's, holding none
    of its state: the leaver waits for a server it saw take the state (member.py, "Leaving")."""
    spec = msgspec.structs.replace(SPEC, target_batch=8)  # a step every second micro-batch
    task = make_task(spec)
    leave = [trio.Event() for _ in range(STAGES + 1)]
    seed, members, returned = await _serving(nursery, task, spec, STAGES + 1, leave)
    client = SwarmClient(seed, STAGES, SwarmClientConfig(refresh_period=0.5, timeout=20.0))
    batches = micro_batches(task, 8, SEED)
    with trio.fail_after(120):
        for batch in batches[:6]:  # every stage takes steps: its state is no longer the initial one
            await client.process(batch)
    alone = next(k for k in range(STAGES) if sum(m.stage == k for m in members) == 1)
    leaver = next(i for i, m in enumerate(members) if m.stage == alone)
    service = members[leaver].service
    assert service is not None
    if liar:  # once, not renewed: after its TTL the stage shows no server and is refilled
        record = StageRecord(stage=alone, stages=STAGES, addrs=seed.host.listen_addrs[:1], step=1 << 30)
        await seed.dht.store(
            stage_key(alone),
            msgspec.msgpack.encode(record),
            time.time() + STAGE_RECORD_TTL,
            subkey=seed.peer_id.encode(),
        )
        with trio.fail_after(30):
            while seed.peer_id not in await find_stage_servers(seed.dht, alone, STAGES):
                await trio.sleep(0.05)
    leave[leaver].set()
    with trio.fail_after(90):  # our record expires, a server moves in and downloads the stage's state
        while leaver not in returned:
            await trio.sleep(0.05)
    step = service.trainer.step
    assert step >= 2
    with trio.fail_after(90):  # (a leaver that left too early: the stage is refilled later, from scratch)
        while not any(i != leaver and m.stage == alone and m.service for i, m in enumerate(members)):
            await trio.sleep(0.05)
    taker = next(m for i, m in enumerate(members) if i != leaver and m.stage == alone)
    assert taker.service is not None and taker.moves and taker.moves[-1][1] == alone
    assert taker.service.trainer.step >= step  # not restarted from the initial parameters
    if taker.service.trainer.step == step:
        assert taker.service.trainer.fingerprint() == service.trainer.fingerprint()
    with trio.fail_after(60):
        for batch in batches[6:]:  # the pipeline works on through the stage's new server
            assert math.isfinite(await client.process(batch))


async def test_every_server_returns_once_its_stage_reaches_the_step_limit(nursery: trio.Nursery) -> None:
    spec = msgspec.structs.replace(SPEC, target_batch=8, max_steps=2)
    task = make_task(spec)
    seed, members, returned = await _serving(nursery, task, spec, STAGES)
    client = SwarmClient(seed, STAGES, SwarmClientConfig(refresh_period=0.5, timeout=5.0, patience=5.0))
    with trio.fail_after(90):
        for batch in micro_batches(task, 4, SEED):  # 2 steps of 8 samples: every stage reaches the limit
            await client.process(batch)
        while len(returned) < STAGES:
            await trio.sleep(0.05)
    assert sorted(m.stage for m in members) == [0, 1, 2]
    assert all(m.service is not None and m.service.trainer.step == 2 for m in members)
