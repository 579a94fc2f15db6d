"""A volunteer's state sync against strangers' claims (issue 9, findings 2 and 8), through real nodes on
loopback: an announcement sized 2**40 or far above the run's model is refused before anything is
allocated, remembered, and the honest state is still taken."""

from __future__ import annotations

import time

import msgspec
import pytest
import trio

from protocols.training import (
    PROGRESS_KEY,
    PROGRESS_TTL,
    OptimizerSpec,
    ScheduleSpec,
    StateAnnouncement,
    TrainingSpec,
)
from shared.data.corpus import generate_examples
from shared.node import Node
from shared.state.blob import decode_state, encode_state
from shared.state.lineage import extend_lineage
from shared.state.transfer import StateServer, announce_state
from tests.volunteer.test_collab import (
    LinearTask,
    examples,
    see_each_other,
    spec,
    start_collab,
    start_nodes,
)
from volunteer.collab.optimizer import CollaborativeOptimizer
from volunteer.collab.sync import _state_bound
from volunteer.collab.trainer import LocalTrainer
from volunteer.tasks import make_task


async def claim(node: Node, step: int, nbytes: int) -> None:
    await announce_state(node.dht, StateAnnouncement(step, b"\x66" * 32, nbytes, time.time()))


async def test_sync_refuses_a_huge_claim_by_many_identities_and_takes_the_honest_state(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    b = 8
    training = spec(2 * b)
    nodes = await start_nodes(nursery, 6)
    first, second = [await start_collab(nursery, node, training) for node in nodes[:2]]
    task = LinearTask()
    data = examples(3, 4 * b)
    await see_each_other([first, second])

    async def peer_step(peer: CollaborativeOptimizer, offset: int) -> None:
        await peer.accumulate(task.collate(data[offset : offset + b]))
        await peer.refresh_view()
        assert await peer.average_and_step()

    async with trio.open_nursery() as group:
        group.start_soon(peer_step, first, 0)
        group.start_soon(peer_step, second, b)
    # three identities (an open run: three "users") outvote the two honest peers, so their claim is tried
    # first; it once made the newcomer allocate bytearray(2**40)
    liars = nodes[2:5]
    liar_servers = [StateServer(node.host) for node in liars]
    for node in liars:
        await claim(node, 1, 1 << 40)
        # ... and they pose as members of the collaboration (step 1, its fingerprint), so their states
        # are candidates at all: announcers outside the surviving collaboration are not even tried
        pose = msgspec.structs.replace(first.progress(), time=time.time() + 20.0)
        await node.dht.store(
            PROGRESS_KEY,
            msgspec.msgpack.encode(pose),
            time.time() + PROGRESS_TTL,
            subkey=node.peer_id.encode(),
        )
    newcomer = await start_collab(nursery, nodes[5], training)
    await newcomer.refresh_view()
    assert newcomer.behind()

    with caplog.at_level("INFO"), trio.fail_after(30):
        assert await newcomer.sync_state() == 1
        assert newcomer.trainer.parameter_vector().tobytes() == first.trainer.parameter_vector().tobytes()
        assert newcomer.state_sources.statistics().refused == 3

        # far above this model's state, though far below the wire's ceiling: refused the same way
        assert newcomer.sync._max_state_bytes is not None
        for node in liars:
            await claim(node, 1, newcomer.sync._max_state_bytes + 1)
        assert await newcomer.sync_state() == 1
        assert newcomer.state_sources.statistics().refused == 6
        assert await newcomer.sync_state() == 1  # remembered: not refused (nor logged) again
        assert newcomer.state_sources.statistics().refused == 6
        assert all(server.statistics().refused == 0 for server in liar_servers)  # never asked

        # a well-formed state of this model, announced as step 1, whose header says step 1000: it once
        # moved the newcomer to step 1000 with the liars' parameters
        tensors, metadata = decode_state(first.trainer.state_blob())
        tensors = {k: v + 1 if k.startswith("model/") else v for k, v in tensors.items()}
        forged = encode_state(tensors, {**metadata, "step": "1000"})
        for node, server in zip(liars, liar_servers, strict=True):
            await announce_state(node.dht, server.offer(1, forged))
        assert await newcomer.sync_state() == 1
        assert newcomer.trainer.parameter_vector().tobytes() == first.trainer.parameter_vector().tobytes()
        assert newcomer.state_sources.statistics().refused == 9
    assert sum("refusing the state announced by" in r.getMessage() for r in caplog.records) == 9


def test_state_bound_holds_the_run_models_state_at_every_step_and_is_tight() -> None:
    training = TrainingSpec(
        task="tiny-mlm",
        task_options={"d_model": 32, "layers": 1, "heads": 2, "ffn": 64, "seq_len": 32},
        target_batch=8,
        local_batch=8,
        optimizer=OptimizerSpec(name="adamw", lr=1e-3),
        schedule=ScheduleSpec(kind="constant"),
    )
    task = make_task(training)
    trainer = LocalTrainer(task, training, "bound-test")
    bound = _state_bound(trainer)
    empty = len(trainer.state_blob())  # step 0: no optimizer moments yet
    trainer.accumulate(task.collate([{"text": t} for t in generate_examples(1, 8)]))
    trainer.apply(trainer.take_gradients().mean())
    full = len(trainer.state_blob())
    assert empty < full <= bound <= full + full // 10
    # the longest lineage there can be: 32 steps of 20 digits each
    for step in range(10**19, 10**19 + 40):
        trainer.lineage = extend_lineage(trainer.lineage, step, bytes(8))
    assert full < len(trainer.state_blob()) <= bound
