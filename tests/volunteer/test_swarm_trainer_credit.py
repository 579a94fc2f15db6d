"""A swarm run's trainers are credited the stage-samples they carried (backbone.ledger.accounting, "Swarm
trainers"; issue 17 item 6): a real pinned backbone API with its ledger, the backbone's step tracker over
the stages' records, two stages of two servers each, and a trainer whose contribution reports
(volunteer.reporting.Reporter) carry the receipts the servers signed for its backwards. A trainer of a
third user, served by two users' servers, is credited more than 0 and at most what it carried; a trainer
of the user whose machines are the only servers is credited 0. The pipeline bytes (accounting, "Swarm
bytes") likewise: the trainer's bytes sent are credited from the servers' receipts, at most what the
servers received from it; each server's from the trainer's received records, at most what it sent; all 0
when the trainer and the servers are one user's."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import trio

from backbone.steps import record_steps_forever
from protocols.receipts import SignedReceipt, decode_receipt
from protocols.training import SyncSpec, TrainingSpec
from shared.swarm.directory import find_stage_servers
from tests.backbone.pinned_api import member_client, serve_pinned_api
from tests.swarmkit import micro_batches, start_node
from volunteer.collab.optimizer import CollabConfig
from volunteer.swarm.client import SwarmClient, micro_batch_samples
from volunteer.swarm.session import CarriedBatch
from volunteer.swarm.stage_service import StageService, serve_stage
from volunteer.swarm.traffic import TrafficReader
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


@pytest.mark.parametrize(
    ("servers", "trainer_user"),
    [(("alice", "bob"), "carol"), (("alice", "alice"), "alice")],
    ids=["third-user", "same-user"],
)
async def test_a_trainer_is_credited_what_other_users_servers_saw_it_carry(
    tmp_path: Path, servers: tuple[str, str], trainer_user: str
) -> None:
    async with (
        serve_pinned_api(tmp_path / "bb", run_id="swarm-trainer-credit") as api,
        trio.open_nursery() as nursery,
    ):
        run = api.run_id
        task = make_task(SPEC)
        batches = micro_batches(task, 4 * STEPS, seed=7)
        backbone, _ = await start_node(nursery, run, [])
        initial = [backbone.host.listen_addrs[0]]
        nursery.start_soon(record_steps_forever, backbone, api.store, SPEC, 0.1)
        config = CollabConfig()
        services: list[StageService] = []
        server_members = []
        for k in range(STAGES):
            for name in servers:  # every server a machine of its user, admitted in the ledger
                server_members.append((name, member_client(api, name)))
                identity = server_members[-1][1].identity
                node, _ = await start_node(nursery, run, initial, identity=identity)
                services.append(
                    await nursery.start(
                        lambda node=node, k=k, task_status=trio.TASK_STATUS_IGNORED: serve_stage(
                            node, task, SPEC, run, k, STAGES, collab_config=config, task_status=task_status
                        )
                    )
                )
        member = member_client(api, trainer_user)
        trainer, _ = await start_node(nursery, run, initial, identity=member.identity)
        (tmp_path / "trainer").mkdir()
        reporter = Reporter(run, member.identity, member, tmp_path / "trainer", 3600.0)

        def book(stage: int, step: int, server: str, receipt: SignedReceipt) -> None:
            reporter.book.add(step, [(server, receipt)], stage=stage)  # as the swarm session does

        carried = 0

        async def feed(client: SwarmClient, chunk: list[Mapping[str, torch.Tensor]]) -> None:
            nonlocal carried
            for batch in chunk:
                await client.process(batch)
                samples = micro_batch_samples(batch) * STAGES
                carried += samples
                reporter.record(CarriedBatch(0, samples, time.time()))  # the claim (session._carried)

        with trio.fail_after(30):
            for k in range(STAGES):
                while len(await find_stage_servers(trainer.dht, k, STAGES)) < 2:
                    await trio.sleep(0.05)
        clients = [SwarmClient(trainer, STAGES, on_carried=book) for _ in range(2)]
        reporter.swarm_traffic = TrafficReader(lambda: None, clients)  # as the session sets it
        with trio.fail_after(300):
            for step in range(STEPS):
                async with trio.open_nursery() as inner:
                    for i, client in enumerate(clients):
                        inner.start_soon(feed, client, batches[4 * step + i : 4 * step + 4 : 2])
                while not all(s.trainer.step > step for s in services):
                    await trio.sleep(0.05)

        assert carried == 16 * STEPS * STAGES
        assert sum(c.stats.receipts for c in clients) == 4 * STEPS * STAGES  # one per backward
        assert not any(c.stats.bad_receipts or c.stats.missing_receipts for c in clients)
        assert sum(s.server.stats.receipts for s in services) == 4 * STEPS * STAGES
        reporter.close_interval()
        reports = [r for _, r in reporter._pending]
        bodies = [decode_receipt(s.receipt) for r in reports for s in r.receipts]
        assert bodies and all(b.carried and b.sender == member.identity.peer_id for b in bodies)
        assert {b.stage for b in bodies} == set(range(STAGES))
        await reporter.flush()
        assert reporter.pending == 0
        claimed_sent = sum(r.bytes_sent for r in reports)  # the trainer's claim: its requests' bytes
        assert claimed_sent == sum(c.stats.bytes_sent for c in clients) > 0
        received: dict[str, int] = {}  # per server peer id, the answer bytes the trainer accepted
        for client in clients:
            for server, nbytes in client.stats.received.items():
                received[server] = received.get(server, 0) + nbytes
        reported: dict[str, int] = {}
        for r in reports:
            for record in r.received_from:
                reported[record.server] = reported.get(record.server, 0) + record.nbytes
        assert reported == received
        assert len(received) == len(services)
        for i, ((_, server_member), service) in enumerate(zip(server_members, services, strict=True)):
            (tmp_path / f"server{i}").mkdir()
            server_reporter = Reporter(
                run,
                server_member.identity,
                server_member,
                tmp_path / f"server{i}",
                3600.0,
                swarm_traffic=TrafficReader(lambda service=service: service.server.stats, []),
            )
            server_reporter.close_interval()  # a server's claim: the bytes its answers carried
            await server_reporter.flush()
            assert server_reporter.pending == 0
        with trio.fail_after(60):  # the tracker records each stage's steps within a poll
            while any(len(api.store.stage_steps(k)) < 1 for k in range(STAGES)):
                await trio.sleep(0.1)
        credited: dict[str, int] = {}
        with trio.move_on_after(10):  # late evidence is settled as the steps are recorded
            while credited.get(trainer_user, 0) < carried:
                credited = {row.username: row.samples for row in api.store.leaderboard()}
                await trio.sleep(0.2)
        credited = {row.username: row.samples for row in api.store.leaderboard()}
        sent = {row.username: row.bytes_sent for row in api.store.leaderboard()}
        notes = " ".join(r.notes or "" for r in api.store.peer_reports(member.identity.peer_id))
        if trainer_user in servers:  # its own user's servers vouch for nothing
            assert credited.get(trainer_user, 0) == 0, credited
            assert "trainer_receipt_same_user" in notes
            assert sent.get(trainer_user, 0) == 0, sent  # neither side's bytes: one user vouches nothing
            assert "received_same_user" in notes
        else:
            assert 0 < credited[trainer_user] <= carried, (credited, carried)
            assert "same_user" not in notes and "unknown" not in notes
            assert all(credited.get(name, 0) == 0 for name in servers)  # servers claim no samples here
            # the trainer's bytes: bounded by what the servers received from it (their receipts say so)
            servers_received = sum(s.server.stats.bytes_received for s in services)
            assert 0 < sent[trainer_user] <= min(claimed_sent, servers_received), sent
            # each server user's bytes: what the trainer received from its servers, within their claims
            for name in servers:
                peers = {m.identity.peer_id for n, m in server_members if n == name}
                got = sum(n for server, n in received.items() if server in peers)
                claimed = sum(
                    s.server.stats.bytes_sent
                    for (n, _), s in zip(server_members, services, strict=True)
                    if n == name
                )
                assert 0 < sent[name] == got <= claimed, (name, sent, got, claimed)
        nursery.cancel_scope.cancel()
