"""A step's averaging attempts across members whose attempts are out of phase (shared.averaging.attempts).

The livelock of ``test_nat_training`` under heavy CPU load (round 26 for 240 s): alice's attempts found
nobody and left tickets under keys the others reached later; they planned with those tickets and waited
for her push in vain, while she, coming to each key after their plan, found their tickets consumed by it.
The keys were ``a0 .. a2`` again on every call, so this went on for ever.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

from protocols.averaging import JoinTicket
from shared.auth.keys import Identity
from shared.averaging.groups import leader_of
from shared.averaging.matchmaking import Matchmaker
from shared.dht.node import DHTNode
from shared.node import Node, open_node
from volunteer.collab.optimizer import CollaborativeOptimizer

from .test_collab import LinearTask, examples, see_each_other, spec, start_collab

PREFIX = "train.avg"  # the run's averaging prefix (TrainingKeys.averaging)
B = 8  # samples per peer


def three_identities(keys: int = 8) -> list[Identity]:
    """alice, bob and carol, such that alice leads none of the three's groups under the step's first
    ``keys`` keys: the others always make the plan (with alice as leader they would wait for her plan
    instead, and she, once she came, would store one they adopt: a meeting by luck of the hash)."""
    while True:
        trio_ = [Identity.generate() for _ in range(3)]
        ids = [i.peer_id for i in trio_]
        if all(leader_of(f"{PREFIX}.0.a{k}", ids) != ids[0] for k in range(keys)):
            return trio_


async def start_nodes(nursery: trio.Nursery, identities: Sequence[Identity]) -> list[Node]:
    nodes: list[Node] = []
    for identity in identities:

        async def run(task_status: trio.TaskStatus[Node], identity: Identity = identity) -> None:
            initial = [nodes[0].host.listen_addrs[0]] if nodes else []
            async with (
                open_node(
                    identity,
                    "collab-test",
                    "volunteer",
                    listen=["/ip4/127.0.0.1/tcp/0"],
                    initial_peers=initial,
                ) as node,
                trio.open_nursery() as own,
            ):
                own.start_soon(node.publish_presence_forever)
                task_status.started(node)
                await trio.sleep_forever()

        nodes.append(await nursery.start(run))
    return nodes


Assemble = Callable[..., Awaitable[object]]


async def plan_signatures(dht: DHTNode, key: str) -> set[bytes]:
    found = await dht.get(key, latest=True)
    return set() if found is None else {record.signature for record in found.entries.values()}


def late(matchmaker: Matchmaker, hold: float, times: int | None = None) -> None:
    """Make ``matchmaker``'s member come to a key only after a new plan is stored under it (at most
    ``hold`` s late), on its next ``times`` attempts (None: all): the phase offset a member starved of
    CPU had, made exact."""
    assemble: Assemble = matchmaker.assemble
    left = [times]

    async def gated(round_: int, ticket: JoinTicket, numel: int, group_key: str = "") -> object:
        if left[0] is None or left[0] > 0:
            left[0] = None if left[0] is None else left[0] - 1
            key = f"{matchmaker.prefix}.{round_}.{group_key}.plan"
            before = await plan_signatures(matchmaker.dht, key)
            with trio.move_on_after(hold):
                while not (await plan_signatures(matchmaker.dht, key)) - before:
                    await trio.sleep(0.05)
        return await assemble(round_, ticket, numel, group_key)

    matchmaker.assemble = gated  # type: ignore[method-assign,assignment]


async def three_peers(nursery: trio.Nursery) -> list[CollaborativeOptimizer]:
    training = spec(3 * B)
    peers = [
        await start_collab(nursery, node, training) for node in await start_nodes(nursery, three_identities())
    ]
    assert all(p.batch.matchmaker.prefix == PREFIX for p in peers)
    await see_each_other(peers)
    task = LinearTask()
    for i, peer in enumerate(peers):
        await peer.accumulate(task.collate(examples(i, B)))
    return peers


async def keep_trying(peers: Sequence[CollaborativeOptimizer], done: Callable[[], bool]) -> None:
    """Every peer calls ``average_and_step`` again and again, as its training loop does, until it
    stepped or ``done()``."""

    async def one(peer: CollaborativeOptimizer) -> None:
        while peer.trainer.step == 0 and not done():
            await peer.average_and_step()

    async with trio.open_nursery() as group:
        for peer in peers:
            group.start_soon(one, peer)


async def test_members_out_of_phase_step_instead_of_failing_one_round_for_ever(nursery: trio.Nursery) -> None:
    """alice found nobody in one call of her own (her tickets stay under the keys she tried), then comes
    to every key the others try only after they planned there. Before, bob and carol planned with
    alice's stale ticket under every key, for ever (the keys a0 .. a2 came round again on every call);
    now every member's keys only move forward, they move past the key where her stale ticket failed
    them, meet under a key she left no ticket under, and step (she follows by the state sync, as a late
    member does)."""
    alice, bob, carol = await three_peers(nursery)
    with trio.fail_after(30):
        assert not await alice.average_and_step()  # nobody else averages: no group, no step
    late(alice.batch.matchmaker, hold=6.0)
    others = (bob, carol)

    def stepped() -> bool:
        return all(p.trainer.step >= 1 for p in others)

    with trio.move_on_after(60):
        await keep_trying((alice, bob, carol), stepped)
    assert stepped(), (
        f"bob and carol at steps {[p.trainer.step for p in others]} after 60 s: "
        f"{[p.batch.stats.failed_rounds for p in others]} failed rounds"
    )
    assert bob.trainer.parameter_vector().tolist() == carol.trainer.parameter_vector().tolist()


async def test_a_member_late_to_a_failed_round_meets_the_others_under_the_next_key(
    nursery: trio.Nursery,
) -> None:
    """The same start, but alice is late once only: the others' plan under the first key names her stale
    ticket and fails; she, late to it, finds their tickets there and moves on to the next key, where she
    waits (lingers) and the others come after their failure: she is in the group that steps (before,
    whether they met was luck of timing). A member whose failure ended later than the other's may find the
    group formed without it (it follows by the state sync), so the test asks for alice and one other."""
    peers = await three_peers(nursery)
    alice = peers[0]
    with trio.fail_after(30):
        assert not await alice.average_and_step()
    late(alice.batch.matchmaker, hold=6.0, times=1)

    def stepped() -> list[CollaborativeOptimizer]:
        return [p for p in peers if p.trainer.step >= 1]

    with trio.move_on_after(60):
        await keep_trying(peers, lambda: alice.trainer.step >= 1 and len(stepped()) >= 2)
    assert alice.trainer.step == 1 and len(stepped()) >= 2, [
        (p.trainer.step, p.batch.stats.failed_rounds) for p in peers
    ]
    vectors = [p.trainer.parameter_vector().tolist() for p in stepped()]
    assert all(v == vectors[0] for v in vectors)  # one step, taken together
