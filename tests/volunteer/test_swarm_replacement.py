"""Re-placement by the scheduler (volunteer.swarm.member, module docstring 4): when a mass departure leaves
the run needing several rebalancing moves at once, the surviving servers wait for the records to settle,
every one of them computes the same scheduler placement in the same period, the ones it names move (no
single rebalancing move meanwhile), every stage is served again and the stages step on."""

from __future__ import annotations

import math

import msgspec
import trio

from protocols.training import TrainingSpec
from shared.errors import PeerUnavailable
from shared.node import Node
from shared.swarm.directory import find_stage_servers
from shared.swarm.placement_cost import Workload
from shared.swarm.replacement import ReplacementConfig
from tests.swarmkit import micro_batches, start_node
from volunteer.collab.optimizer import CollabConfig
from volunteer.swarm.client import SwarmClient, SwarmClientConfig
from volunteer.swarm.formation import read_link_records
from volunteer.swarm.member import SwarmMember, serve_swarm
from volunteer.tasks import make_task

RUN_ID = "swarm-replacement-test"
SEED = 23
STAGES = 3
SERVERS = 7  # one stage has at least 3: enough to serve all three once the other stages' servers die
SPEC = TrainingSpec(
    task_options={"layers": 3, "d_model": 32, "heads": 2, "ffn": 64, "seq_len": 24},
    target_batch=8,  # a step every second micro-batch
    local_batch=4,
)
PERIOD = 1.0
# only moves that double the pipeline's throughput once trainers' traffic gives rates (as in
# test_swarm_rebalance: on a busy machine the measured rates are noisy)
HYSTERESIS = 1.0
# the records of servers that die together expire within one republish interval (a third of a record's
# lifetime, 4 s) of each other: 6 s of a standing basis see the whole burst (the default waits 12 s)
SETTLE = 6.0
WORK = Workload(STAGES, stage_bytes=1e6, activation_bytes=1e4)


async def _counts(reader: Node) -> list[int]:
    return [len(await find_stage_servers(reader.dht, k, STAGES)) for k in range(STAGES)]


async def _start(nursery: trio.Nursery, initial: list[str]) -> tuple[Node, trio.CancelScope]:
    """A node, bootstrapped again if the seed did not answer in time (on a machine with two busy loops
    beside nine nodes the seed's handshake can exceed the bootstrap timeout; a volunteer retries too)."""
    for _ in range(2):
        try:
            return await start_node(nursery, RUN_ID, initial)
        except PeerUnavailable:
            await trio.sleep(1.0)
    return await start_node(nursery, RUN_ID, initial)


async def test_a_mass_departure_is_re_placed_by_the_scheduler_and_the_run_steps_on(
    nursery: trio.Nursery,
) -> None:
    task = make_task(SPEC)
    seed, _ = await start_node(nursery, RUN_ID, [])
    initial = [seed.host.listen_addrs[0]]
    members = [SwarmMember() for _ in range(SERVERS)]
    scopes: list[trio.CancelScope] = []
    peers: list[str] = []
    config = ReplacementConfig(settle=SETTLE, patience=3 * SETTLE, workload=WORK)
    with trio.fail_after(240):  # generous: a server's start takes seconds, tens of them on a busy machine
        for i, member in enumerate(members):  # one at a time: each placed by the records before it
            node, scope = await _start(nursery, initial)
            scopes.append(scope)
            peers.append(str(node.peer_id))
            nursery.start_soon(
                lambda node=node, member=member: serve_swarm(
                    node, task, SPEC, RUN_ID, STAGES, period=PERIOD, member=member, replacement=config,
                    hysteresis=HYSTERESIS, collab_config=CollabConfig(poll_period=0.1),
                )
            )  # fmt: skip
            while sum(await _counts(seed)) <= i:
                await trio.sleep(0.05)
    assert {m.stage for m in members} == set(range(STAGES))
    assert all(m.replacements == [] and m.moves == [] for m in members)  # nothing to re-place yet
    with trio.fail_after(60):  # servers placed as newcomers keep link records too, for the scheduler to read
        while not set(peers) <= set(await read_link_records(seed, STAGES)):
            await trio.sleep(0.05)

    # every server of two stages dies at once: the survivors all serve one stage (at least 3 of them)
    kept = max(range(STAGES), key=lambda k: (sum(m.stage == k for m in members), -k))
    survivors = [i for i, m in enumerate(members) if m.stage == kept]
    assert len(survivors) >= STAGES
    for i, scope in enumerate(scopes):
        if i not in survivors:
            scope.cancel()
    live = [members[i] for i in survivors]
    with trio.fail_after(180):  # records expire (12 s), the basis stands (6 s), the scheduler places
        while not all(m.replacements for m in live):
            await trio.sleep(0.05)
        placed = live[0].replacements[0]
        while [m.stage for m in live] != [placed.stages[peers[i]] for i in survivors]:
            await trio.sleep(0.05)
        while not all(m.service is not None and m.service.server.stage == m.stage for m in live):
            await trio.sleep(0.05)
        while min(await _counts(seed)) == 0:
            await trio.sleep(0.05)

    # every survivor computed the same placement, once, over exactly the survivors
    for m in live:
        assert len(m.replacements) == 1 and dict(m.replacements[0].stages) == dict(placed.stages)
    assert set(placed.stages) == {peers[i] for i in survivors}
    assert sorted(set(placed.stages.values())) == list(range(STAGES))
    assert len(placed.moves) >= 2  # the run needed at least two moves: the scheduler made them at once
    # the named servers moved to the placement's stage (a server whose read came late on a busy machine may
    # have made the rebalancer's single move a period before: the placement then started from it)
    for i in survivors:
        target = placed.stages[peers[i]]
        assert members[i].moves == [] if target == kept else members[i].moves[-1][1] == target
    assert any(placed.stages[peers[i]] == kept for i in survivors)  # the stage kept one of its servers

    client = SwarmClient(seed, STAGES, SwarmClientConfig(refresh_period=0.5, timeout=5.0, patience=10.0))
    with trio.fail_after(180):
        for batch in micro_batches(task, 6, SEED):  # through the re-placed pipeline: every stage steps
            assert math.isfinite(await client.process(batch))
        while not all(any(m.stage == k and m.service and m.service.trainer.step >= 1 for m in live)
                      for k in range(STAGES)):  # fmt: skip
            await trio.sleep(0.05)


def test_the_spec_is_a_valid_swarm_spec() -> None:
    assert msgspec.json.decode(msgspec.json.encode(SPEC), type=TrainingSpec) == SPEC
