"""A swarm run's steps (volunteer.swarm.stage_service): 3 stages served by 2 peers each, fed by 2
trainers, take the same optimizer steps as one process training the (untied) staged model at the same
global batch on the same data: every server of a stage holds bit-identical parameters, equal to the
reference within float tolerance."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import trio

from protocols.training import TrainingSpec
from shared.swarm.directory import find_stage_servers
from tests.swarmkit import micro_batches, start_node
from volunteer.collab.optimizer import CollabConfig
from volunteer.collab.trainer import make_optimizer
from volunteer.swarm.client import SwarmClient
from volunteer.swarm.stage_service import StageService, serve_stage
from volunteer.tasks import make_task
from volunteer.tasks.base import Task
from volunteer.tasks.stages import run_stages, split_model

RUN_ID = "swarm-steps-test"
SEED = 13  # of the corpus stream the micro-batches come from
STAGES = 3
SPEC = TrainingSpec(
    task_options={"layers": 4, "d_model": 32, "heads": 2, "ffn": 64, "seq_len": 24},
    target_batch=16,
    local_batch=4,
)
STEPS = 3


def _reference(task: Task, steps: list[list[Mapping[str, torch.Tensor]]]) -> list[list[torch.Tensor]]:
    """Per stage, the parameters after one process trained the untied staged model on ``steps``."""
    staged = split_model(task, task.build_model(), STAGES)
    params = [[p for p in stage.parameters() if p.requires_grad] for stage in staged.stages]
    optimizers = [make_optimizer(SPEC.optimizer, ps) for ps in params]
    for step, batches in enumerate(steps):
        samples = sum(len(b["input_ids"]) for b in batches)
        for batch in batches:
            (run_stages(staged.stages, batch) * len(batch["input_ids"])).backward()
        lr = SPEC.optimizer.lr * SPEC.schedule.factor(step)
        for ps, optimizer in zip(params, optimizers, strict=True):
            for p in ps:
                assert p.grad is not None
                p.grad /= samples
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return [[p.detach().clone() for p in ps] for ps in params]


async def test_three_stages_of_two_servers_step_as_one_process(nursery: trio.Nursery) -> None:
    task = make_task(SPEC)
    batches = micro_batches(task, 4 * STEPS, SEED)
    seed, _ = await start_node(nursery, RUN_ID, [])
    initial = [seed.host.listen_addrs[0]]
    config = CollabConfig()
    services: dict[tuple[int, int], StageService] = {}
    for k in range(STAGES):
        for j in range(2):
            node, _ = await start_node(nursery, RUN_ID, initial)
            services[k, j] = await nursery.start(
                lambda task_status, node=node, k=k: serve_stage(
                    node, task, SPEC, RUN_ID, k, STAGES, collab_config=config, task_status=task_status
                )
            )
    trainer = seed  # two trainers on the seed node (fewer nodes in one process keep the test light)
    with trio.fail_after(30):
        for k in range(STAGES):
            while len(await find_stage_servers(trainer.dht, k, STAGES)) < 2:
                await trio.sleep(0.05)
    clients = [SwarmClient(trainer, STAGES) for _ in range(2)]

    plan = [batches[4 * s : 4 * s + 4] for s in range(STEPS)]
    with trio.fail_after(120):
        for step, step_batches in enumerate(plan):
            async with trio.open_nursery() as inner:
                for i, client in enumerate(clients):
                    inner.start_soon(_feed, client, step_batches[i::2])
            while not all(s.trainer.step > step for s in services.values()):
                await trio.sleep(0.05)

    expected = _reference(task, plan)
    for k in range(STAGES):
        first, second = (services[k, j].trainer for j in range(2))
        assert first.step == second.step == STEPS
        assert first.fingerprint() == second.fingerprint()  # one collaboration per stage: bit-identical
        for got, want in zip(first.params, expected[k], strict=True):
            torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=1e-5)
        assert first.samples == second.samples == 0  # every sample went into a step
    assert sum(c.stats.samples for c in clients) == 16 * STEPS


async def _feed(client: SwarmClient, batches: list[Mapping[str, torch.Tensor]]) -> None:
    for batch in batches:
        await client.process(batch)
