"""A stage server emulating a slower device (volunteer.swarm.server, "Emulating a slower device"; what
scripts/bench_swarm.py builds its heterogeneous peers from): a sample costs each stage at least the emulated
time, a server runs one request at a time, and the rate it publishes is the emulated device's at every
stage, the last one included."""

from __future__ import annotations

import math

import pytest
import trio

from protocols.training import TrainingSpec
from shared.swarm.directory import find_stage_servers
from tests.swarmkit import micro_batches, start_node
from volunteer.swarm.client import SwarmClient
from volunteer.swarm.server import StageServer, StageServerConfig, announce_forever
from volunteer.swarm.stage_trainer import StageTrainer
from volunteer.tasks import make_task

RUN_ID = "swarm-emulation-test"
STAGES = 3
SPEC = TrainingSpec(task_options={"layers": 3, "d_model": 16, "heads": 2, "ffn": 32, "seq_len": 16})
EMULATED = 0.15  # device seconds per sample at each stage
SAMPLES = 4  # per micro-batch


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf])
def test_an_emulated_time_must_be_finite_and_not_negative(value: float) -> None:
    with pytest.raises(ValueError, match="emulated_seconds_per_sample"):
        StageServerConfig(emulated_seconds_per_sample=value)


async def test_emulated_servers_take_their_time_one_request_at_a_time(nursery: trio.Nursery) -> None:
    task = make_task(SPEC)
    seed, _ = await start_node(nursery, RUN_ID, [])
    initial = [seed.host.listen_addrs[0]]
    servers = []
    for k in range(STAGES):
        node, _ = await start_node(nursery, RUN_ID, initial)
        trainer = StageTrainer(task, SPEC, RUN_ID, k, STAGES)
        server = StageServer(node, trainer, StageServerConfig(emulated_seconds_per_sample=EMULATED))
        nursery.start_soon(announce_forever, node, server)
        servers.append(server)
    with trio.fail_after(30):
        for k in range(STAGES):
            while not await find_stage_servers(seed.dht, k, STAGES):
                await trio.sleep(0.05)
    clients = [SwarmClient(seed, STAGES) for _ in range(2)]
    a, b = micro_batches(task, 2, seed=5, size=SAMPLES)
    with trio.fail_after(60):
        for client in clients:  # the first requests dial (not what is timed)
            await client.process(a)

        # one micro-batch: two forwards of e/3 and three backwards of 2e/3 (the last stage's: e) per sample
        started = trio.current_time()
        await clients[0].process(b)
        single = trio.current_time() - started
        assert single >= (1 / 3 + 1 / 3 + 1 + 2 / 3 + 2 / 3) * EMULATED * SAMPLES * 0.99

        # two at once: each server runs one request at a time, so the second micro-batch waits at every
        # stage (2.4 s at best here; the two would overlap into one micro-batch's 1.8 s otherwise)
        started = trio.current_time()
        async with trio.open_nursery() as inner:
            inner.start_soon(clients[0].process, a)
            inner.start_soon(clients[1].process, b)
        both = trio.current_time() - started
        assert both >= (4 / 3 + 1 + 1 + 2 / 3) * EMULATED * SAMPLES * 0.99

    for server in servers:  # every stage, the last included, publishes the emulated device's rate
        rate = server.record().samples_per_second
        assert 0 < rate <= 1 / EMULATED * (1 + 1e-9)
        assert server.trainer.seconds_per_sample == pytest.approx(EMULATED, rel=0.5)


async def test_an_emulated_server_never_publishes_a_rate_above_its_device_s(nursery: trio.Nursery) -> None:
    """While a request waits out its emulated time, the trainer's averages hold the bare computation's
    (faster) time; the record must still say the emulated device's rate (rebalancing weighs it)."""
    for k in range(STAGES):
        node, _ = await start_node(nursery, RUN_ID, [])
        trainer = StageTrainer(make_task(SPEC), SPEC, RUN_ID, k, STAGES)
        server = StageServer(node, trainer, StageServerConfig(emulated_seconds_per_sample=EMULATED))
        assert server.record().samples_per_second == 0.0  # not measured yet
        trainer.forward_seconds, trainer.backward_seconds = 0.001, 0.002  # as just after a fast computation
        assert server.record().samples_per_second == pytest.approx(1 / EMULATED)
        trainer.forward_seconds, trainer.backward_seconds = EMULATED, 2 * EMULATED  # slower than emulated
        assert server.record().samples_per_second < 1 / EMULATED
