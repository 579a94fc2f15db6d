"""What the swarm tests share: loopback nodes in a test's nursery, and micro-batches of a task's data."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import trio

from shared import faults
from shared.auth.keys import Identity
from shared.data.corpus import generate_examples
from shared.node import Node, open_node

if TYPE_CHECKING:
    import torch

    from volunteer.tasks.base import Task


async def start_node(
    nursery: trio.Nursery,
    run_id: str,
    initial: list[str],
    tag: str | None = None,
    identity: Identity | None = None,
) -> tuple[Node, trio.CancelScope]:
    """A volunteer node on 127.0.0.1 running in ``nursery`` (its tasks tagged ``tag`` for fault points), and
    the scope that stops it as if its process died (its connections close). ``identity``: the node's key
    (default: a new one)."""

    async def run(task_status: trio.TaskStatus[tuple[Node, trio.CancelScope]]) -> None:
        with trio.CancelScope() as scope, faults.scope(tag or "none"):
            async with (
                open_node(
                    identity or Identity.generate(),
                    run_id,
                    "volunteer",
                    listen=["/ip4/127.0.0.1/tcp/0"],
                    initial_peers=initial,
                ) as node,
                trio.open_nursery() as own,
            ):
                own.start_soon(node.publish_presence_forever)  # how peers find state sources
                task_status.started((node, scope))
                await trio.sleep_forever()

    started: tuple[Node, trio.CancelScope] = await nursery.start(run)
    return started


def micro_batches(task: Task, count: int, seed: int, size: int = 4) -> list[Mapping[str, torch.Tensor]]:
    """``count`` collated micro-batches of ``size`` samples of the synthetic corpus stream ``seed``."""
    examples = [{"text": text} for text in generate_examples(seed, 50 * count * size)]
    samples = list(task.preprocess(iter(examples)))[: count * size]
    assert len(samples) == count * size, "the corpus prefix is too short for the micro-batches asked"
    return [task.collate(samples[i * size : (i + 1) * size]) for i in range(count)]
