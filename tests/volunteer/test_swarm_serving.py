"""Stage servers and trainers over the real bulk lane (volunteer.swarm; protocols.swarm): micro-batches
routed through 3 stages of 2 servers each accumulate exactly the gradients of one process running the
stages; a server that hangs mid-forward or mid-backward, or lies, is left and the micro-batch rerouted
with no sample lost; a full queue answers busy; malformed and hostile requests are refused without
harming the server."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import numpy as np
import pytest
import torch
import trio

from protocols.codes import ErrorCode
from protocols.errors import ProtocolError
from protocols.swarm import STAGE_TOPIC, StageRequest, TensorSpec, decode_stage_answer
from protocols.training import TrainingSpec
from shared import faults
from shared.errors import RemoteError, StateError
from shared.net.addresses import parse_multiaddr
from shared.node import Node
from shared.swarm.directory import find_stage_servers
from tests.swarmkit import micro_batches, start_node
from volunteer.swarm.client import NoStageServer, SwarmClient, SwarmClientConfig, field_specs
from volunteer.swarm.server import StageServer, StageServerConfig, announce_forever
from volunteer.swarm.stage_trainer import StageInputError, StageTrainer
from volunteer.tasks import make_task
from volunteer.tasks.base import Task
from volunteer.tasks.stages import run_stages, split_model

RUN_ID = "swarm-serving-test"
SEED = 11  # of the corpus stream the micro-batches come from
STAGES = 3
SPEC = TrainingSpec(task_options={"layers": 4, "d_model": 32, "heads": 2, "ffn": 64, "seq_len": 24})


@pytest.fixture(autouse=True)
def _disarm() -> None:
    yield
    faults.disarm()


def _task() -> Task:
    return make_task(SPEC)


def _reference(task: Task, batches: list[Mapping[str, torch.Tensor]]) -> list[np.ndarray]:
    """Per stage, the flat gradient sums one process gets running the stages on every micro-batch."""
    staged = split_model(task, task.build_model(), STAGES)
    for batch in batches:
        loss = run_stages(staged.stages, batch)
        (loss * len(batch["input_ids"])).backward()
    return [
        np.concatenate([p.grad.reshape(-1).numpy() for p in stage.parameters()]) for stage in staged.stages
    ]


class Swarm:
    def __init__(self) -> None:
        self.servers: dict[str, StageServer] = {}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.trainers: list[Node] = []


async def _swarm(
    nursery: trio.Nursery, task: Task, per_stage: int = 2, trainers: int = 2, max_queue: int = 8
) -> Swarm:
    seed, _ = await start_node(nursery, RUN_ID, [])
    initial = [seed.host.listen_addrs[0]]
    swarm = Swarm()
    for k in range(STAGES):
        for j in range(per_stage):
            tag = f"s{k}.{j}"
            node, scope = await start_node(nursery, RUN_ID, initial, tag)
            trainer = StageTrainer(task, SPEC, RUN_ID, k, STAGES)
            server = StageServer(node, trainer, StageServerConfig(max_queue=max_queue))
            nursery.start_soon(announce_forever, node, server)
            swarm.servers[tag], swarm.scopes[tag] = server, scope
    for _ in range(trainers):
        node, _ = await start_node(nursery, RUN_ID, initial)
        swarm.trainers.append(node)
    with trio.fail_after(30):  # every server announced, so the trainers' first read sees them all
        for k in range(STAGES):
            while len(await find_stage_servers(swarm.trainers[0].dht, k, STAGES)) < per_stage:
                await trio.sleep(0.05)
    return swarm


def _sums(swarm: Swarm, alive: set[str] | None = None) -> list[np.ndarray]:
    out = []
    for k in range(STAGES):
        taken = [
            s.trainer.take_gradients() for tag, s in sorted(swarm.servers.items())
            if tag.startswith(f"s{k}.") and (alive is None or tag in alive)
        ]  # fmt: skip
        out.append(sum(t.gradient_sum for t in taken))
    return out


async def _train(clients: list[SwarmClient], batches: list[Mapping[str, torch.Tensor]]) -> list[float]:
    losses: list[float] = [0.0] * len(batches)

    async def worker(i: int) -> None:
        for j in range(i, len(batches), len(clients)):
            losses[j] = await clients[i].process(batches[j])

    async with trio.open_nursery() as nursery:
        for i in range(len(clients)):
            nursery.start_soon(worker, i)
    return losses


async def test_three_stages_of_two_servers_accumulate_one_processs_gradients(nursery: trio.Nursery) -> None:
    task = _task()
    batches = micro_batches(task, 8, SEED)
    swarm = await _swarm(nursery, task)
    clients = [SwarmClient(node, STAGES) for node in swarm.trainers]
    with trio.fail_after(180):
        losses = await _train(clients, batches)

    expected = _reference(task, batches)
    staged = split_model(task, task.build_model(), STAGES)
    for batch, loss in zip(batches, losses, strict=True):
        assert loss == pytest.approx(float(run_stages(staged.stages, batch).detach()), rel=1e-5)
    samples = {
        k: sum(s.trainer.samples for t, s in swarm.servers.items() if t.startswith(f"s{k}."))
        for k in range(3)
    }
    assert samples == {0: 32, 1: 32, 2: 32}  # every sample counted once at every stage
    for k, (got, want) in enumerate(zip(_sums(swarm), expected, strict=True)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"stage {k}")
    # nothing failed; which server took what is timing (the wiring's own tests pin its shares)
    assert sum(c.stats.failures for c in clients) == 0


@pytest.mark.parametrize("op", ["forward", "backward"])
async def test_a_server_that_dies_mid_request_loses_no_sample(nursery: trio.Nursery, op: str) -> None:
    task = _task()
    batches = micro_batches(task, 6, SEED)
    swarm = await _swarm(nursery, task, trainers=1)
    faults.arm(f"swarm.{op}.1", "hang")  # the first such request to stage 1 hangs, at whichever server
    client = SwarmClient(swarm.trainers[0], STAGES)
    hung: list[str] = []

    async def kill_when_hung() -> None:
        while not faults.hits(f"swarm.{op}.1"):
            await trio.sleep(0.01)
        hung.extend(t for t in ("s1.0", "s1.1") if swarm.servers[t].queued)  # one trainer: one request
        await trio.sleep(0.1)
        swarm.scopes[hung[0]].cancel()  # the process is gone: its connections close

    with trio.fail_after(60):
        async with trio.open_nursery() as inner:
            inner.start_soon(kill_when_hung)
            await _train([client], batches)

    assert client.stats.failures >= 1 and client.stats.samples == 24
    assert len(hung) == 1
    victim = hung[0]
    alive = set(swarm.servers) - {victim}
    assert swarm.servers[victim].trainer.samples == 0  # its first request of stage 1 hung
    samples = [
        sum(swarm.servers[t].trainer.samples for t in alive if t.startswith(f"s{k}.")) for k in range(3)
    ]
    assert samples == [24, 24, 24]  # the survivors hold every sample, once
    for k, (got, want) in enumerate(zip(_sums(swarm, alive), _reference(task, batches), strict=True)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"stage {k}")


async def test_a_lying_server_is_banned_and_its_micro_batches_rerouted(nursery: trio.Nursery) -> None:
    task = _task()
    batches = micro_batches(task, 6, SEED)
    swarm = await _swarm(nursery, task, trainers=1)
    liar = swarm.servers["s0.1"].trainer
    honest_forward = liar.forward
    liar.forward = lambda hidden, batch: honest_forward(hidden, batch) * 1e7  # type: ignore[method-assign]
    client = SwarmClient(swarm.trainers[0], STAGES)
    with trio.fail_after(60):
        await _train([client], batches)
    assert client.stats.refused_answers >= 1
    assert client.stats.samples == 24
    samples = [
        sum(s.trainer.samples for t, s in swarm.servers.items() if t.startswith(f"s{k}.")) for k in range(3)
    ]
    assert samples == [24, 24, 24]
    np.testing.assert_allclose(_sums(swarm)[2], _reference(task, batches)[2], rtol=1e-4, atol=1e-5)


async def test_a_full_queue_answers_busy_and_the_trainer_goes_elsewhere(nursery: trio.Nursery) -> None:
    task = _task()
    batches = micro_batches(task, 8, SEED)
    swarm = await _swarm(nursery, task, trainers=3, max_queue=1)
    slow = swarm.servers["s1.0"].trainer
    honest = slow.forward

    def slowly(hidden: torch.Tensor | None, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        import time

        time.sleep(0.3)
        return honest(hidden, batch)

    slow.forward = slowly  # type: ignore[method-assign]
    clients = [SwarmClient(node, STAGES) for node in swarm.trainers]
    with trio.fail_after(60):
        await _train(clients, batches)
    assert swarm.servers["s1.0"].stats.busy + swarm.servers["s1.1"].stats.busy >= 1
    assert sum(c.stats.busy for c in clients) >= 1 and sum(c.stats.failures for c in clients) == 0
    samples = [
        sum(s.trainer.samples for t, s in swarm.servers.items() if t.startswith(f"s{k}.")) for k in range(3)
    ]
    assert samples == [32, 32, 32]


async def _raw(client: Node, server: StageServer, request: StageRequest, payload: bytes) -> object:
    address = parse_multiaddr(server.node.host.listen_addrs[0]).with_peer(server.node.peer_id)
    try:
        ack = await client.host.send_bulk(
            address,
            STAGE_TOPIC,
            payload,
            msgspec.msgpack.encode(request),
            lambda m, n: memoryview(bytearray(n)),
        )
    except RemoteError as exc:
        return exc.code
    return decode_stage_answer(ack)


async def test_hostile_requests_are_refused_and_the_server_keeps_serving(nursery: trio.Nursery) -> None:
    task = _task()
    batches = micro_batches(task, 2, SEED)
    swarm = await _swarm(nursery, task, per_stage=1, trainers=1)
    trainer = swarm.trainers[0]
    first, middle = swarm.servers["s0.0"], swarm.servers["s1.0"]
    batch = batches[0]
    fields = field_specs(batch)
    raw = b"".join(v.numpy().tobytes() for v in batch.values())
    hidden = TensorSpec(shape=[4, 24, 32])

    async def refused(server: StageServer, request: StageRequest, payload: bytes) -> object:
        code = await _raw(trainer, server, request, payload)
        assert isinstance(code, ErrorCode), code
        return code

    ok = StageRequest(stage=0, op="forward", samples=4, fields=fields)
    # sizes that do not add up, the wrong stage, a hidden state the first stage takes none of
    assert await refused(first, ok, raw + b"x") == ErrorCode.BAD_REQUEST
    assert await refused(first, msgspec.structs.replace(ok, stage=1), raw) == ErrorCode.WRONG_RUN
    with_hidden = msgspec.structs.replace(ok, hidden=hidden)
    assert await refused(first, with_hidden, bytes(4 * 4 * 24 * 32) + raw) == ErrorCode.BAD_REQUEST
    # a huge declared tensor is refused before anything is read
    huge = StageRequest(
        stage=1, op="forward", samples=4, hidden=TensorSpec(shape=[4, 4096, 4096]), fields=fields
    )
    assert await refused(middle, huge, b"") == ErrorCode.BAD_REQUEST  # declared != sent, checked first
    # token ids outside the vocabulary; a hidden state of the wrong width; NaN inputs; int8 with a NaN scale
    bad_ids = dict(batch, input_ids=batch["input_ids"] + 10**6)
    assert (
        await refused(first, ok, b"".join(v.numpy().tobytes() for v in bad_ids.values()))
        == ErrorCode.BAD_REQUEST
    )
    narrow = StageRequest(
        stage=1, op="forward", samples=4, hidden=TensorSpec(shape=[4, 24, 16]), fields=fields
    )
    assert await refused(middle, narrow, bytes(4 * 4 * 24 * 16) + raw) == ErrorCode.BAD_REQUEST
    nan = np.full(4 * 24 * 32, np.nan, dtype=np.float32).tobytes()
    assert (
        await refused(middle, msgspec.structs.replace(narrow, hidden=hidden), nan + raw)
        == ErrorCode.BAD_REQUEST
    )
    int8 = TensorSpec(shape=[4, 24, 32], codec="int8-blockwise")
    scale = np.array([np.nan], dtype="<f4").tobytes()
    assert (
        await refused(middle, msgspec.structs.replace(narrow, hidden=int8), scale + bytes(3072) + raw)
        == ErrorCode.BAD_REQUEST
    )
    assert first.stats.refused + middle.stats.refused >= 7
    # a malformed header is refused too (the lane's decoder), and the servers still serve
    client = SwarmClient(trainer, STAGES, SwarmClientConfig(codec="int8-blockwise"))
    with trio.fail_after(30):
        loss = await client.process(batches[1])
    assert np.isfinite(loss) and client.stats.failures == 0
    assert first.trainer.samples == middle.trainer.samples == 4


def test_a_stage_trainer_refuses_non_finite_gradients_and_accumulates_nothing() -> None:
    task = _task()
    batch = micro_batches(task, 1, SEED)[0]
    staged = split_model(task, task.build_model(), STAGES)
    middle = StageTrainer(task, SPEC, RUN_ID, 1, STAGES)
    hidden = staged.stages[0](None, batch).detach()
    grad = torch.ones_like(hidden)
    grad[0, 0, 0] = float("inf")
    with pytest.raises(StageInputError):
        middle.backward(hidden, batch, grad, 4)
    assert middle.samples == 0 and all(p.grad is None for p in middle.params)
    last = StageTrainer(task, SPEC, RUN_ID, 2, STAGES)
    with pytest.raises(StageInputError):
        last.forward(hidden, batch)  # the last stage runs only in a backward
    _, loss = last.backward(hidden, batch, None, 4)
    assert loss is not None and np.isfinite(loss)


def test_a_stage_state_loads_into_its_stage_only() -> None:
    task = _task()
    first, second = (StageTrainer(task, SPEC, RUN_ID, k, 4) for k in (1, 2))  # equal shapes and names
    blob = first.state_blob()
    with pytest.raises(StateError):
        second.load_state_blob(blob)
    assert StageTrainer(task, SPEC, RUN_ID, 1, 4).load_state_blob(blob) == 0


def test_requests_that_do_not_add_up_are_refused_by_the_decoder() -> None:
    from protocols.swarm import decode_stage_request

    spec = TensorSpec(shape=[4, 8, 8])
    with pytest.raises(ProtocolError):
        decode_stage_request(
            msgspec.msgpack.encode(StageRequest(stage=1, op="forward", samples=3, hidden=spec))
        )
    with pytest.raises(ProtocolError):
        decode_stage_request(
            msgspec.msgpack.encode(StageRequest(stage=1, op="forward", samples=4, hidden=spec, grad=spec))
        )
    with pytest.raises(ProtocolError):
        decode_stage_request(b"\x93garbage")
    with pytest.raises(ProtocolError):
        decode_stage_request(msgspec.msgpack.encode({"stage": 99, "op": "forward", "samples": 1}))


async def test_a_trainers_absurd_gradient_is_refused_once_honest_ones_set_the_scale(
    nursery: trio.Nursery,
) -> None:
    task = _task()
    batches = micro_batches(task, 9, SEED)
    swarm = await _swarm(nursery, task, per_stage=1, trainers=1)
    middle = swarm.servers["s1.0"]
    client = SwarmClient(swarm.trainers[0], STAGES)
    with trio.fail_after(60):
        await _train([client], batches[:8])  # 8 honest backwards: the warm-up of the bound
    before = middle.trainer.samples
    staged = split_model(task, task.build_model(), STAGES)
    batch = batches[8]
    with torch.no_grad():
        hidden = staged.stages[0](None, batch)
        out = staged.stages[1](hidden, batch)
    spec = TensorSpec(shape=list(hidden.shape))
    request = StageRequest(
        stage=1, op="backward", samples=4, hidden=spec, grad=spec, fields=field_specs(batch)
    )
    raw = b"".join(v.numpy().tobytes() for v in batch.values())

    def payload(scale: float) -> bytes:
        return hidden.numpy().tobytes() + (torch.full_like(out, scale)).numpy().tobytes() + raw

    assert await _raw(swarm.trainers[0], middle, request, payload(1e3)) == ErrorCode.BAD_REQUEST
    assert middle.trainer.samples == before and middle.stats.refusals
    answer = await _raw(swarm.trainers[0], middle, request, payload(1e-3))  # an honest scale passes
    assert getattr(answer, "status", None) == "ok" and middle.trainer.samples == before + 4


async def test_a_stage_that_only_answers_busy_runs_out_the_trainers_patience(nursery: trio.Nursery) -> None:
    # a stage whose servers never accept a backward (a stage stuck re-syncing, say) must not hold its
    # trainers for ever: they give up after their patience and say why (the volunteer retries and logs it)
    task = _task()
    swarm = await _swarm(nursery, task, per_stage=1, trainers=1)
    swarm.servers["s0.0"].accepting = lambda: False  # stage 0 answers every backward "busy"
    client = SwarmClient(swarm.trainers[0], STAGES, SwarmClientConfig(patience=2.0))
    with trio.fail_after(30), pytest.raises(NoStageServer, match="stage 0 answered busy for 2 s"):
        await client.process(micro_batches(task, 1, SEED)[0])
    assert client.stats.busy >= 1 and client.stats.failures == 0
