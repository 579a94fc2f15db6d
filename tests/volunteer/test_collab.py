"""The collaborative optimizer through real nodes on loopback: equivalence with one process, churn,
state download, absurd progress."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch
import trio

from protocols.training import PROGRESS_KEY, PROGRESS_TTL, OptimizerSpec, Progress, ScheduleSpec, TrainingSpec
from shared.auth.keys import Identity
from shared.node import Node, open_node
from volunteer.collab.optimizer import CollabConfig, CollaborativeOptimizer
from volunteer.collab.trainer import LocalTrainer

DIM = 8


class LinearTask:
    """y = w·x + noise, squared error: small, exact, deterministic."""

    name = "linear-test"

    def build_model(self) -> torch.nn.Module:
        generator = torch.Generator().manual_seed(0)
        model = torch.nn.Linear(DIM, 1)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
        return model

    def collate(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        return {
            "x": torch.tensor([e["x"] for e in examples], dtype=torch.float32),
            "y": torch.tensor([e["y"] for e in examples], dtype=torch.float32),
        }

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return ((model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()

    def batch_size(self, batch: Mapping[str, torch.Tensor]) -> int:
        return int(batch["x"].shape[0])


def examples(seed: int, count: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    w = np.arange(1, DIM + 1, dtype=np.float64)
    xs = rng.normal(size=(count, DIM))
    return [{"x": x.tolist(), "y": float(x @ w + 0.1 * rng.normal())} for x in xs]


def spec(target: int, *, dpu: bool = False) -> TrainingSpec:
    return TrainingSpec(
        task="linear-test",
        target_batch=target,
        local_batch=target,
        optimizer=OptimizerSpec(name="adamw", lr=0.05),
        schedule=ScheduleSpec(kind="constant"),
        dpu=dpu,
        checkpoint_every=1000,
    )


async def start_nodes(nursery: trio.Nursery, n: int, run_id: str = "collab-test") -> list[Node]:
    nodes: list[Node] = []
    for _ in range(n):

        async def run(task_status: trio.TaskStatus[Node]) -> None:
            initial = [nodes[0].host.listen_addrs[0]] if nodes else []
            async with (
                open_node(
                    Identity.generate(),
                    run_id,
                    "volunteer",
                    listen=["/ip4/127.0.0.1/tcp/0"],
                    initial_peers=initial,
                ) as node,
                trio.open_nursery() as own,
            ):
                own.start_soon(node.publish_presence_forever)  # how peers find each other's addresses
                task_status.started(node)
                await trio.sleep_forever()

        nodes.append(await nursery.start(run))
    return nodes


CONFIG = CollabConfig(poll_period=0.1, publish_period=0.2, matchmaking_window=0.5, sync_patience=5.0)


async def start_collab(nursery: trio.Nursery, node: Node, training: TrainingSpec) -> CollaborativeOptimizer:
    trainer = LocalTrainer(LinearTask(), training, "collab-test")  # type: ignore[arg-type]
    collab = CollaborativeOptimizer(node, trainer, training, config=CONFIG)
    await nursery.start(collab.run)
    return collab


async def test_two_peers_with_batch_b_equal_one_process_with_batch_2b(nursery: trio.Nursery) -> None:
    b, steps = 16, 4
    training = spec(2 * b)
    nodes = await start_nodes(nursery, 2)
    peers = [await start_collab(nursery, node, training) for node in nodes]
    reference = LocalTrainer(LinearTask(), training, "ref")  # type: ignore[arg-type]
    data = examples(1, 2 * b * steps)
    task = LinearTask()
    await trio.sleep(0.5)  # both progress records are out
    for step in range(steps):
        chunk = data[2 * b * step : 2 * b * (step + 1)]
        reference.accumulate(task.collate(chunk))
        reference.apply(reference.take_gradients().mean())

        async def peer_step(i: int, chunk: list[dict[str, Any]] = chunk) -> None:
            await peers[i].accumulate(task.collate(chunk[i * b : (i + 1) * b]))
            await peers[i].refresh_view()
            assert await peers[i].average_and_step()

        async with trio.open_nursery() as group:
            for i in range(2):
                group.start_soon(peer_step, i)
        assert [p.trainer.step for p in peers] == [step + 1, step + 1]
    first, second = (p.trainer.parameter_vector() for p in peers)
    assert np.array_equal(first, second)  # bit-identical across peers
    np.testing.assert_allclose(first, reference.parameter_vector(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(first, LocalTrainer(LinearTask(), training, "x").parameter_vector())  # type: ignore[arg-type]


async def test_a_newcomer_downloads_the_state_and_steps_with_the_others(nursery: trio.Nursery) -> None:
    b = 8
    training = spec(2 * b)
    nodes = await start_nodes(nursery, 3)
    first, second = [await start_collab(nursery, node, training) for node in nodes[:2]]
    task = LinearTask()
    data = examples(2, 200)
    await trio.sleep(0.5)
    for step in range(2):  # two steps without the newcomer

        async def peer_step(peer: CollaborativeOptimizer, offset: int, step: int = step) -> None:
            await peer.accumulate(task.collate(data[offset + 2 * b * step : offset + 2 * b * step + b]))
            await peer.refresh_view()
            assert await peer.average_and_step()

        async with trio.open_nursery() as group:
            group.start_soon(peer_step, first, 0)
            group.start_soon(peer_step, second, b)
    newcomer = await start_collab(nursery, nodes[2], training)
    await newcomer.refresh_view()
    assert newcomer.behind()
    with trio.fail_after(20):
        assert await newcomer.sync_state() == 2
    assert np.array_equal(newcomer.trainer.parameter_vector(), first.trainer.parameter_vector())
    # The newcomer's optimizer state came along: one more step keeps all three identical.

    async def step_with(peer: CollaborativeOptimizer, offset: int) -> None:
        await peer.accumulate(task.collate(data[100 + offset : 100 + offset + b]))
        await peer.refresh_view()
        assert await peer.average_and_step()

    async with trio.open_nursery() as group:
        for i, peer in enumerate((first, second, newcomer)):
            group.start_soon(step_with, peer, i * b)
    vectors = [p.trainer.parameter_vector() for p in (first, second, newcomer)]
    assert all(np.array_equal(vectors[0], v) for v in vectors[1:])
    assert {p.trainer.step for p in (first, second, newcomer)} == {3}


async def test_absurd_progress_is_ignored(nursery: trio.Nursery) -> None:
    training = spec(16)
    nodes = await start_nodes(nursery, 4)
    honest = [await start_collab(nursery, node, training) for node in nodes[:2]]
    far_ahead, greedy = nodes[2], nodes[3]
    claims = [
        (far_ahead, Progress(step=10**9, samples=1, samples_per_second=10.0, time=time.time())),
        (greedy, Progress(step=0, samples=10**9, samples_per_second=10.0, time=time.time())),
    ]
    for liar, claim in claims:
        await liar.dht.store(
            PROGRESS_KEY,
            msgspec.msgpack.encode(claim),
            time.time() + PROGRESS_TTL,
            subkey=liar.peer_id.encode(),
        )
    for peer in honest:
        view = await peer.refresh_view()
        assert set(view.ignored) == {far_ahead.peer_id, greedy.peer_id}
        assert view.step == 0
        assert view.samples == 0
        assert view.peers == 2
        assert not peer.behind()
        assert not peer.ready()
