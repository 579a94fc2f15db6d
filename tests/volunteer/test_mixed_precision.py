"""Mixed precision through real nodes on loopback: bf16 autocast on the CPU keeps two peers bit-identical,
and fp16 loss scaling is collective -- one member's overflow makes every member skip the step together,
with the same scale after, and a claim at the floor of the scale is not believed."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from volunteer.collab.optimizer import CollaborativeOptimizer
from volunteer.collab.trainer import LocalTrainer
from volunteer.precision import FLOOR_EXPONENT, LossScale, Precision

from .test_collab import CONFIG, LinearTask, examples, see_each_other, spec, start_collab, start_nodes
from .test_precision import TEST_SCALE


async def pair(nursery: trio.Nursery, precision: Precision, b: int) -> list[CollaborativeOptimizer]:
    training = spec(2 * b)
    peers = []
    for node in await start_nodes(nursery, 2):
        trainer = LocalTrainer(LinearTask(), training, "collab-test", precision=precision, growth_interval=2)  # type: ignore[arg-type]
        trainer.loss_scale = TEST_SCALE
        collab = CollaborativeOptimizer(node, trainer, training, config=CONFIG)
        await nursery.start(collab.run)
        peers.append(collab)
    await see_each_other(peers)
    return peers


async def step_together(
    peers: list[CollaborativeOptimizer], data: list[dict[str, Any]], poison: int = -1
) -> None:
    """Each peer accumulates its half of ``data`` (peer ``poison`` gets an Inf injected into its
    gradients) and both average and step."""
    task = LinearTask()
    b = len(data) // 2

    async def one(i: int) -> None:
        await peers[i].accumulate(task.collate(data[i * b : (i + 1) * b]))
        if i == poison:
            peers[i].trainer.params[0].grad[0, 0] = float("inf")  # type: ignore[index]
        await peers[i].refresh_view()
        assert await peers[i].average_and_step()

    async with trio.open_nursery() as group:
        for i in range(len(peers)):
            group.start_soon(one, i)


def identical(peers: list[CollaborativeOptimizer]) -> np.ndarray:
    first, second = (p.trainer.parameter_vector() for p in peers)
    assert np.array_equal(first, second)
    assert peers[0].trainer.fingerprint() == peers[1].trainer.fingerprint()
    assert peers[0].trainer.loss_scale == peers[1].trainer.loss_scale
    return first


async def test_bf16_autocast_on_the_cpu_trains_and_keeps_two_peers_bit_identical(
    nursery: trio.Nursery,
) -> None:
    b = 8
    peers = await pair(nursery, "bf16", b)
    start = identical(peers)
    data = examples(3, 2 * b * 3)
    for s in range(3):
        await step_together(peers, data[2 * b * s : 2 * b * (s + 1)])
        assert [p.trainer.step for p in peers] == [s + 1, s + 1]
    assert not np.array_equal(identical(peers), start)


async def test_one_members_overflow_makes_every_member_skip_together_then_they_go_on_bit_identical(
    nursery: trio.Nursery,
) -> None:
    b = 8
    peers = await pair(nursery, "fp16", b)
    peers[1].trainer.precision = "bf16"  # a member without loss scaling follows the same scale
    start = identical(peers)
    data = examples(4, 2 * b * 4)
    await step_together(peers, data[: 2 * b], poison=0)
    assert [p.trainer.step for p in peers] == [1, 1]
    assert np.array_equal(identical(peers), start)  # skipped: the step advanced, the parameters did not
    assert peers[0].trainer.loss_scale == LossScale(TEST_SCALE.exponent - 1, 0)
    assert peers[0].trainer.samples == 0 and peers[1].trainer.samples == 0  # the round's samples are gone
    for s in range(1, 4):  # two clean steps double the scale again (growth interval 2)
        await step_together(peers, data[2 * b * s : 2 * b * (s + 1)])
    assert [p.trainer.step for p in peers] == [4, 4]
    assert not np.array_equal(identical(peers), start)
    assert peers[0].trainer.loss_scale == LossScale(TEST_SCALE.exponent, 1)


async def test_an_overflow_claim_at_the_floor_of_the_scale_is_not_believed(nursery: trio.Nursery) -> None:
    """A member that claims overflow every round (a liar, or fp16 that overflows even at scale 1) costs
    the collaboration nothing once the scale is at its floor: the others' gradients make the step."""
    b = 8
    peers = await pair(nursery, "fp16", b)
    for p in peers:
        p.trainer.loss_scale = LossScale(FLOOR_EXPONENT, 0)
    start = identical(peers)
    await step_together(peers, examples(5, 2 * b), poison=0)
    assert [p.trainer.step for p in peers] == [1, 1]
    assert not np.array_equal(identical(peers), start)  # stepped with peer 1's gradient alone
    assert peers[0].trainer.loss_scale == LossScale(FLOOR_EXPONENT, 1)


async def test_a_lone_peer_never_applies_a_non_finite_gradient(nursery: trio.Nursery) -> None:
    """Regression: a volunteer alone in the run stepped with its own gradient even when it held NaN,
    and its parameters became NaN for good."""
    (node,) = await start_nodes(nursery, 1)
    peer = await start_collab(nursery, node, spec(8))
    start = peer.trainer.parameter_vector().copy()
    await peer.accumulate(LinearTask().collate(examples(6, 8)))
    peer.trainer.params[0].grad[0, 0] = float("nan")  # type: ignore[index]
    await peer.refresh_view()
    assert await peer.average_and_step()
    assert peer.trainer.step == 1
    assert np.array_equal(peer.trainer.parameter_vector(), start)


async def test_a_non_finite_gradient_no_claim_can_use_is_dropped_not_retried_forever(
    nursery: trio.Nursery,
) -> None:
    """Regression: a failed round put a NaN gradient back into the accumulators, so every later round
    saw it again (the member could only ever receive); now it is dropped with its samples."""
    b = 8
    peers = await pair(nursery, "fp32", b)
    data = examples(7, 2 * b)
    task = LinearTask()

    async def one(i: int) -> None:
        await peers[i].accumulate(task.collate(data[i * b : (i + 1) * b]))
        peers[i].trainer.params[0].grad[0, 0] = float("nan")  # type: ignore[index]
        await peers[i].refresh_view()
        assert not await peers[i].average_and_step()  # nobody has a usable gradient: no step

    async with trio.open_nursery() as group:
        for i in range(2):
            group.start_soon(one, i)
    assert [p.trainer.samples for p in peers] == [0, 0]
    assert all(p.grad is None or bool(p.grad.isfinite().all()) for c in peers for p in c.trainer.params)
