"""The training loop's micro-batch cut (issue 11: a step's share is filled exactly, no example lost) and
its one hand-over per micro-batch (issue 12)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any

import msgspec
import torch
import trio

from tests.volunteer.test_collab import LinearTask, examples, spec, start_collab, start_nodes
from volunteer.collab.optimizer import StepRecord
from volunteer.data import Prefetcher
from volunteer.training import batches, split_batch, train_until_stopped


def test_a_cut_micro_batch_keeps_the_rest_for_the_next_one() -> None:
    ids, labels = torch.arange(16).reshape(8, 2), torch.arange(8)
    batch = {"input_ids": ids, "labels": labels, "scale": torch.tensor(2.0)}
    head, rest = split_batch(batch, 3)
    assert rest is not None
    assert head["input_ids"].tolist() == [[0, 1], [2, 3], [4, 5]] and head["labels"].tolist() == [0, 1, 2]
    assert rest["labels"].tolist() == [3, 4, 5, 6, 7] and rest["input_ids"].shape == (5, 2)
    assert float(head["scale"]) == float(rest["scale"]) == 2.0  # not batch-first: goes to both
    whole, nothing = split_batch(batch, 8)
    assert whole is batch and nothing is None


async def test_a_ready_batch_is_taken_on_the_torch_thread_that_computes_it(nursery: trio.Nursery) -> None:
    """Issue 12: taking each batch in a worker thread cost 14-19 ms per step (the prefetch thread, woken by
    the take, held the GIL while every hand-over after it waited). A ready batch is now taken, cut and
    computed in one call on the torch thread; the cut is unchanged: a lone step holds exactly the target
    batch, and every example taken is computed or held over for the next micro-batch."""
    training = msgspec.structs.replace(spec(20), local_batch=8)  # micro-batches of 8, 8, 4 (cut), 4 + 8…
    (node,) = await start_nodes(nursery, 1)
    peer = await start_collab(nursery, node, training)
    records: list[StepRecord] = []
    peer.on_step = records.append
    task = LinearTask()
    threads: dict[str, set[str]] = {"taken": set(), "waited": set(), "computed": set()}
    taken = [0]
    accumulate = peer.trainer.accumulate

    def computed(batch: Mapping[str, torch.Tensor]) -> tuple[int, float]:
        threads["computed"].add(threading.current_thread().name)
        return accumulate(batch)

    setattr(peer.trainer, "accumulate", computed)  # noqa: B010 (mypy: no assigning to a method)

    with Prefetcher(batches(task.collate, iter(examples(3, 100_000)), training.local_batch), depth=4) as data:

        def source(timeout: float, kind: str) -> dict[str, Any] | None:
            batch = data.get(timeout=timeout)
            if batch is not None:
                threads[kind].add(threading.current_thread().name)
                taken[0] += task.batch_size(batch)
            return batch

        stop = trio.Event()
        async with trio.open_nursery() as own:
            own.start_soon(
                functools.partial(
                    train_until_stopped,
                    peer,
                    lambda: source(0.5, "waited"),
                    stop,
                    ready_batch=lambda: source(0, "taken"),
                )
            )
            with trio.fail_after(60):
                while peer.trainer.step < 4:
                    await trio.sleep(0.02)
            stop.set()
    assert threads["taken"], "no batch was taken ready"
    assert threads["taken"] == threads["computed"] and all(n.startswith("torch") for n in threads["computed"])
    assert not threads["waited"] & threads["computed"]  # waiting for a batch never blocks the torch thread
    assert [r.samples for r in records[:4]] == [20] * 4
    assert 0 <= taken[0] - peer.stats.samples_total < training.local_batch  # the rest: held over


async def test_a_stop_cancels_whatever_is_in_flight_after_the_grace(nursery: trio.Nursery) -> None:
    """Issue 14: a volunteer waiting for something that cannot happen (a round no one can aggregate, a state
    no one serves) took 22 s to leave on SIGTERM. Now whatever is in flight gets STOP_GRACE seconds."""
    from volunteer.training import STOP_GRACE

    (node,) = await start_nodes(nursery, 1)
    peer = await start_collab(nursery, node, spec(20))
    stuck = trio.Event()

    async def wait_forever() -> None:
        stuck.set()
        await trio.sleep_forever()

    setattr(peer, "resume_if_behind", wait_forever)  # noqa: B010 (mypy: no assigning to a method)
    stop = trio.Event()

    async def stop_when_stuck() -> None:
        await stuck.wait()
        stop.set()

    nursery.start_soon(stop_when_stuck)
    started = trio.current_time()
    with trio.fail_after(STOP_GRACE + 5):
        assert await train_until_stopped(peer, lambda: None, stop) == "stopped"
    assert trio.current_time() - started >= STOP_GRACE
