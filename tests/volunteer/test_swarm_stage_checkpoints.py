"""A stage whose only server dies continues from the backbone's checkpoint of the stage, not from step 0
(issue 17: "a departure may cost seconds, never a lost step"; backbone.checkpointer, "Swarm runs";
volunteer.swarm.member, "What a move costs").

Two stages, three servers (one stage has one server), a backbone keeping each stage's checkpoints. The
stages step a few times; once the backbone stored the lone server's stage at its step, that server is
killed (its node stops, as if its process died: nothing is handed over), rebalancing moves a server of
the other stage in, and the refilled stage is at the checkpoint's step with the checkpoint's parameters
and optimizer state, exactly, and trains on. Killed at the checkpoint's step, or a step past it (then
the step past it is lost, and only it)."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np
import pytest
import trio

import backbone.checkpointer as checkpointer_module
import shared.alone
from backbone.checkpointer import keep_scoped_checkpoints, open_stores
from protocols.training import SyncSpec, TrainingSpec
from shared.auth.keys import Identity
from shared.node import Node, open_node
from shared.state.blob import decode_state
from shared.state.transfer import StateServer
from shared.swarm.directory import find_stage_servers
from tests.swarmkit import micro_batches, start_node
from volunteer.collab.optimizer import CollabConfig
from volunteer.swarm.client import SwarmClient, SwarmClientConfig
from volunteer.swarm.member import SwarmMember, serve_swarm
from volunteer.tasks import make_task

RUN_ID = "swarm-stage-checkpoints"
STAGES = 2
SPEC = TrainingSpec(
    task_options={"layers": 2, "d_model": 16, "heads": 2, "ffn": 32, "seq_len": 16},
    target_batch=8,  # a step every second micro-batch
    local_batch=4,
    checkpoint_every=1,  # servers announce, and the backbone stores, every step
    sync=SyncSpec(mode="swarm", stages=STAGES),
)
PERIOD = 1.0
HYSTERESIS = 1.0  # only the refill moves (see test_swarm_rebalance)


async def _backbone(nursery: trio.Nursery) -> Node:
    async def run(task_status: trio.TaskStatus[Node]) -> None:
        async with (
            open_node(Identity.generate(), RUN_ID, "backbone", listen=["/ip4/127.0.0.1/tcp/0"]) as node,
            trio.open_nursery() as own,
        ):
            own.start_soon(node.publish_presence_forever)  # how stage servers find it as a state source
            task_status.started(node)
            await trio.sleep_forever()

    node: Node = await nursery.start(run)
    return node


async def _counts(reader: Node) -> list[int]:
    return [len(await find_stage_servers(reader.dht, k, STAGES)) for k in range(STAGES)]


@pytest.mark.parametrize("ahead", [False, True], ids=["at-the-checkpoint", "a-step-past-it"])
async def test_a_stage_whose_only_server_died_continues_from_the_backbones_checkpoint(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ahead: bool
) -> None:
    """``ahead``: the server dies a step past the stage's last checkpoint (``checkpoint_every = 2``, killed
    at an odd step): its progress record still shows that step for a while, and the refill takes the
    checkpoint once the high-water mark of that step expires (volunteer.swarm.member, "What a move
    costs"); the mark's 120 s are shortened here."""
    monkeypatch.setattr(checkpointer_module, "POLL_PERIOD", 0.5)  # the backbone looks more often
    if ahead:
        monkeypatch.setattr(shared.alone, "HIGH_WATER_TTL", 20.0)
    spec = msgspec.structs.replace(SPEC, checkpoint_every=2 if ahead else 1)
    task = make_task(spec)
    backbone = await _backbone(nursery)
    stores = open_stores(tmp_path / "checkpoints", spec)
    await nursery.start(
        keep_scoped_checkpoints, backbone, StateServer(backbone.host, backbone=True), stores, spec
    )
    initial = [backbone.host.listen_addrs[0]]
    members: list[SwarmMember] = []
    scopes: list[trio.CancelScope] = []
    with trio.fail_after(60):
        for _ in range(STAGES + 1):
            node, scope = await start_node(nursery, RUN_ID, initial)
            member = SwarmMember()

            async def serve(node: Node = node, member: SwarmMember = member) -> None:
                await serve_swarm(
                    node, task, spec, RUN_ID, STAGES, period=PERIOD, member=member, hysteresis=HYSTERESIS,
                    collab_config=CollabConfig(poll_period=0.1),
                )  # fmt: skip

            nursery.start_soon(serve)
            members.append(member)
            scopes.append(scope)
            while sum(await _counts(backbone)) < len(members):
                await trio.sleep(0.05)

    trainer, _ = await start_node(nursery, RUN_ID, initial)
    client = SwarmClient(trainer, STAGES, SwarmClientConfig(refresh_period=0.5, timeout=5.0))
    batches = iter(micro_batches(task, 40, seed=23))
    alone = next(k for k in range(STAGES) if sum(m.stage == k for m in members) == 1)
    victim_index = next(i for i, m in enumerate(members) if m.stage == alone)
    victim = members[victim_index].service
    assert victim is not None
    with trio.fail_after(180):
        for _ in range(12):  # every stage steps a few times (to an odd step, if ``ahead``)
            for _ in range(2):  # a target batch
                assert math.isfinite(await client.process(next(batches)))
            # the stage's last step completes; nothing feeds it any more, so it stays there (samples
            # short of the target batch wait for trainers, and die with the server)
            while victim.collab.averaging or victim.trainer.samples >= spec.target_batch:
                await trio.sleep(0.05)
            step = victim.trainer.step
            if step >= 2 and (step % 2 == 1 or not ahead):
                break
        else:
            raise AssertionError(f"stage {alone} never got to a step to kill it at (at {step})")
    expected = step - step % spec.checkpoint_every  # the stage's last announced state
    store = stores[alone][1]
    with trio.fail_after(60):  # the backbone stored it
        while (newest := store.newest()) is None or newest.step < expected:
            await trio.sleep(0.1)
    assert newest.step == expected > 0 and (expected < step) is ahead
    checkpoint, metadata = decode_state(store.path(newest.digest).read_bytes())
    assert metadata["stage"] == f"{alone}/{STAGES}"

    assert victim.trainer.step == step
    scopes[victim_index].cancel()  # the stage's only server dies: nothing is handed over
    live = [m for i, m in enumerate(members) if i != victim_index]
    with trio.fail_after(120):  # its record expires, the next period refills the stage, the state loads
        while not any(
            m.stage == alone and m.service is not None and m.service.trainer.stage.index == alone
            for m in live
        ):
            await trio.sleep(0.05)
        refill = next(m for m in live if m.stage == alone)
        assert refill.service is not None
        while refill.service.trainer.step == 0 or refill.service.collab.syncing:
            await trio.sleep(0.05)
    assert refill.moves and refill.moves[-1][1] == alone
    assert refill.service.trainer.step == expected  # not restarted at step 0
    loaded, _ = decode_state(refill.service.trainer.state_blob())
    assert loaded.keys() == checkpoint.keys()
    for name, value in checkpoint.items():  # parameters and optimizer state: the checkpoint's, exactly
        assert np.array_equal(loaded[name], value), name
    with trio.fail_after(120):  # and the stage trains on from there (``ahead``: once the mark expired)
        while refill.service.collab.behind():
            await trio.sleep(0.1)
        for _ in range(4):
            assert math.isfinite(await client.process(next(batches)))
        while refill.service.trainer.step <= expected:
            await trio.sleep(0.05)
