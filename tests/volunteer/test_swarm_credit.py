"""A swarm run's stage servers are credited their stage-samples (backbone.ledger.accounting, "Swarm
runs"; issue 17 item 6): a real pinned backbone API with its ledger, the backbone's step tracker over the
stages' records (backbone.steps), two stages of two servers each, stage 0 served by machines of two
users (alice, bob) whose contribution reports (volunteer.reporting.Reporter) carry the receipts the
stage's rounds left. Each is credited more than 0 and at most the stage-samples it computed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import trio

from backbone.steps import record_steps_forever
from protocols.receipts import decode_receipt
from protocols.training import SyncSpec, TrainingSpec
from shared.node import Node
from shared.swarm.directory import find_stage_servers
from tests.backbone.pinned_api import member_client, serve_pinned_api
from tests.swarmkit import micro_batches, start_node
from volunteer.collab.optimizer import CollabConfig, StepRecord
from volunteer.swarm.client import SwarmClient
from volunteer.swarm.stage_service import StageService, serve_stage
from volunteer.tasks import make_task
from volunteer.training import Reporter

STAGES = 2
SPEC = TrainingSpec(
    task_options={"layers": 2, "d_model": 16, "heads": 2, "ffn": 32, "seq_len": 16},
    target_batch=16,
    local_batch=4,
    sync=SyncSpec(mode="swarm", stages=STAGES),
)
STEPS = 3


async def _feed(client: SwarmClient, batches: list[Mapping[str, torch.Tensor]]) -> None:
    for batch in batches:
        await client.process(batch)


async def test_two_users_serving_one_stage_are_credited_their_stage_samples(tmp_path: Path) -> None:
    async with (
        serve_pinned_api(tmp_path / "bb", run_id="swarm-credit") as api,
        trio.open_nursery() as nursery,
    ):
        run = api.run_id
        task = make_task(SPEC)
        batches = micro_batches(task, 4 * STEPS, seed=5)
        backbone, _ = await start_node(nursery, run, [])  # the backbone's node: it tracks the stages
        initial = [backbone.host.listen_addrs[0]]
        nursery.start_soon(record_steps_forever, backbone, api.store, SPEC, 0.1)
        config = CollabConfig()
        users = {"alice": member_client(api, "alice"), "bob": member_client(api, "bob")}
        reporters: dict[str, Reporter] = {}
        claimed: dict[str, int] = {"alice": 0, "bob": 0}
        services: dict[tuple[int, str], StageService] = {}

        async def serve(
            node: Node,
            k: int,
            name: str,
            reporter: Reporter | None,
            task_status: trio.TaskStatus[StageService],
        ) -> None:
            def on_step(record: StepRecord) -> None:  # what the swarm session does (volunteer.swarm.session)
                if reporter is not None:
                    claimed[name] += record.samples
                    reporter.record(record)

            await serve_stage(
                node, task, SPEC, run, k, STAGES, collab_config=config, on_step=on_step,
                receipts=None if reporter is None else reporter.book, task_status=task_status,
            )  # fmt: skip

        for k in range(STAGES):
            for name, client in users.items():
                identity = client.identity if k == 0 else None  # stage 1: two anonymous servers
                node, _ = await start_node(nursery, run, initial, identity=identity)
                reporter = None
                if identity is not None:
                    (tmp_path / name).mkdir()
                    reporter = reporters[name] = Reporter(run, identity, client, tmp_path / name, 3600.0)
                services[k, name] = await nursery.start(serve, node, k, name, reporter)
        trainer, _ = await start_node(nursery, run, initial)
        with trio.fail_after(30):
            for k in range(STAGES):
                while len(await find_stage_servers(trainer.dht, k, STAGES)) < 2:
                    await trio.sleep(0.05)
        clients = [SwarmClient(trainer, STAGES) for _ in range(2)]
        with trio.fail_after(120):
            for step in range(STEPS):
                async with trio.open_nursery() as inner:
                    for i, client in enumerate(clients):
                        inner.start_soon(_feed, client, batches[4 * step + i : 4 * step + 4 : 2])
                while not all(s.trainer.step > step for s in services.values()):
                    await trio.sleep(0.05)

        for reporter in reporters.values():
            reporter.close_interval()
            reports = [r for _, r in reporter._pending]
            stages = {decode_receipt(s.receipt).stage for r in reports for s in r.receipts}
            assert stages == {0}  # stage receipts, signed by the other user's server
            await reporter.flush()
            assert reporter.pending == 0
        with trio.fail_after(30):  # late evidence: the tracker records each stage's steps within a poll
            while len({s for k, s, *_ in api.store.stage_steps(0)}) < STEPS:
                await trio.sleep(0.1)
        computed = {name: services[0, name].server.stats.samples for name in users}
        assert claimed == computed  # a server claims the stage-samples it computed
        # the last steps' evidence is settled just after their rows are written: wait for it a little
        credited: dict[str, int] = {}
        with trio.move_on_after(15):
            while credited != claimed:
                credited = {row.username: row.samples for row in api.store.leaderboard()}
                await trio.sleep(0.1)
        assert sum(computed.values()) == 16 * STEPS  # every stage-sample of stage 0, once
        for name in users:
            assert 0 < credited[name] <= min(claimed[name], computed[name]), (credited, claimed, computed)
        # the backbone tracked stage 1 too (a step taken within one of its polls may pass unseen)
        tracked = api.store.stage_steps(1)
        assert tracked and all(1 <= s <= STEPS and source == "tracker" for _, s, _, _, source in tracked)
        nursery.cancel_scope.cancel()
