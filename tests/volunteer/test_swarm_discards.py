"""A restarted stage server reports the stage steps its stage lost (volunteer.swarm.stage_service,
"Discards"): its report journal says its earlier process took part in steps up to 9 of every stage (it
served them in turn); the run's stages are at an earlier step now (they lost the rest with their servers,
say). Placed in a stage, it downloads that stage's state, and its reporter -- wired as the swarm session
wires it -- holds that stage's steps above the loaded one as discarded, and its next report lists them."""

from __future__ import annotations

import math
import time
from pathlib import Path

import msgspec
import trio

from protocols.ledger import ContributionReport
from protocols.training import SyncSpec, TrainingSpec
from shared.auth.keys import Identity
from shared.node import Node
from shared.swarm.directory import find_stage_servers
from tests.swarmkit import micro_batches, start_node
from volunteer.collab.optimizer import CollabConfig
from volunteer.journal import JournaledStep
from volunteer.reporting import Reporter
from volunteer.swarm.client import SwarmClient, SwarmClientConfig
from volunteer.swarm.member import SwarmMember, serve_swarm
from volunteer.tasks import make_task

RUN_ID = "swarm-discards"
STAGES = 2
SPEC = TrainingSpec(
    task_options={"layers": 2, "d_model": 16, "heads": 2, "ffn": 32, "seq_len": 16},
    target_batch=8,  # a step every second micro-batch
    local_batch=4,
    sync=SyncSpec(mode="swarm", stages=STAGES),
)
PERIOD = 1.0
HYSTERESIS = 1.0  # nobody moves: the newcomer stays where it was placed
EARLIER = 9  # the highest step of each stage the earlier process took part in


async def _counts(reader: Node) -> list[int]:
    return [len(await find_stage_servers(reader.dht, k, STAGES)) for k in range(STAGES)]


async def test_a_restarted_stage_server_reports_the_stage_steps_its_stage_lost(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    task = make_task(SPEC)
    earlier = Reporter(RUN_ID, Identity.generate(), None, tmp_path, interval=1e9)
    for stage in range(STAGES):
        for number in range(1, EARLIER + 1):
            earlier.record(JournaledStep(number, 8, 0.1, 0, time.time()), stage=stage)
    earlier.journal.close()  # the process dies
    reporter = Reporter(RUN_ID, earlier.identity, None, tmp_path, interval=1e9)  # the restart
    assert [reporter.stage_last_step(k) for k in range(STAGES)] == [EARLIER] * STAGES

    seed, _ = await start_node(nursery, RUN_ID, [])
    initial = [seed.host.listen_addrs[0]]
    members = [SwarmMember() for _ in range(STAGES + 1)]

    async def serve(node: Node, member: SwarmMember, restarted: bool) -> None:
        await serve_swarm(
            node, task, SPEC, RUN_ID, STAGES, period=PERIOD, member=member, hysteresis=HYSTERESIS,
            collab_config=CollabConfig(poll_period=0.1),
            on_discard=reporter.discard_stage if restarted else None,
            previous_life=reporter.stage_last_step if restarted else None,
        )  # fmt: skip

    with trio.fail_after(60):  # one server per stage
        for member in members[:STAGES]:
            node, _ = await start_node(nursery, RUN_ID, initial)
            nursery.start_soon(serve, node, member, False)
            while sum(await _counts(seed)) < members.index(member) + 1:
                await trio.sleep(0.05)
    client = SwarmClient(seed, STAGES, SwarmClientConfig(refresh_period=0.5, timeout=5.0))
    batches = iter(micro_batches(task, 12, seed=29))
    with trio.fail_after(180):  # both stages take a few steps, then nothing feeds them
        while min(m.service.trainer.step for m in members[:STAGES] if m.service) < 2:
            assert math.isfinite(await client.process(next(batches)))
        while any(m.service is None or m.service.collab.averaging for m in members[:STAGES]):
            await trio.sleep(0.05)
    steps = {m.stage: m.service.trainer.step for m in members[:STAGES] if m.service is not None}
    assert all(0 < s < EARLIER for s in steps.values())

    newcomer = members[STAGES]
    node, _ = await start_node(nursery, RUN_ID, initial)
    nursery.start_soon(serve, node, newcomer, True)
    with trio.fail_after(120):  # placed in a stage, it downloads the stage's state
        while (
            newcomer.service is None or newcomer.service.trainer.step == 0 or newcomer.service.collab.syncing
        ):
            await trio.sleep(0.05)
    placed = newcomer.stage
    assert placed is not None and newcomer.service.trainer.step == steps[placed]
    assert reporter._stage_discarded == [(placed, steps[placed] + 1, EARLIER)]
    reporter.close_interval()
    [*_, report] = [msgspec.msgpack.decode(s.report, type=ContributionReport) for s, _ in reporter._pending]
    assert [(r.stage, r.first, r.last) for r in report.stage_discarded] == [
        (placed, steps[placed] + 1, EARLIER)
    ]
    # journaled: a restart right now would report them too (they are in the report queued already)
    assert Reporter(RUN_ID, earlier.identity, None, tmp_path)._stage_discarded == []
