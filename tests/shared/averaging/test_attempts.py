"""shared.averaging.attempts: which key a step's next attempt uses, and the matchmaking reads it rests on."""

from __future__ import annotations

import time

import msgspec
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from protocols.averaging import JoinTicket
from shared.averaging.attempts import RESTART_AFTER, AttemptKeys, attempt_key
from shared.averaging.groups import leader_of
from shared.averaging.matchmaking import Matchmaker, MatchmakingConfig
from shared.node import Node

from .test_matchmaking import start_nodes
from .test_matchmaking import ticket as any_ticket

NUMEL = 1000


def ticket(node: Node, weight: float) -> JoinTicket:
    """A computing member's ticket, stating the vector's length (an auxiliary aggregator adopts it)."""
    return msgspec.structs.replace(any_ticket(node, weight), numel=NUMEL)


@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=40))
def test_a_members_index_only_grows_and_stays_only_after_being_alone(
    attempts: list[tuple[int, bool]],
) -> None:
    keys = AttemptKeys()
    for step, alone in attempts:
        before = keys.index if step == keys.step else 0  # a new step starts at a0
        index = keys.next(step)
        assert index == before
        keys.done(step, index, alone=alone, now=0.0)
        assert keys.index == (index if alone else index + 1)
        keys.done(step + 1, index + 5, alone=False, now=0.0)  # another step's attempt changes nothing
        assert keys.index == (index if alone else index + 1)
    assert AttemptKeys().next(4) == 0 and attempt_key(3) == "a3"
    with pytest.raises(ValueError, match="at least 0"):
        attempt_key(-1)


@given(st.integers(2, 5), st.lists(st.integers(0, 4), max_size=120))
def test_a_member_stays_only_at_a_key_no_other_member_has_passed(members: int, order: list[int]) -> None:
    """The rule on a model of the DHT: every attempt leaves the member's ticket under its key, a member
    stays iff it finds no other member's ticket there. In any interleaving of attempts, a member that
    stays is at least as far as every other (the others walk to it), and once the members behind take
    their attempts, all of them end at one key."""
    keys = [AttemptKeys() for _ in range(members)]
    tickets: dict[int, set[int]] = {}  # key index -> members with a ticket there

    def attempt(m: int) -> bool:
        index = keys[m].next(0)
        tickets.setdefault(index, set()).add(m)
        alone = tickets[index] == {m}
        keys[m].done(0, index, alone=alone, now=0.0)
        return alone

    for m in (m % members for m in order):
        if attempt(m):
            assert all(k.next(0) <= keys[m].index for k in keys), [k.index for k in keys]
    front = max(k.next(0) for k in keys)
    for _ in range(front + 1):  # each member behind moves one key per attempt
        for m in range(members):
            if keys[m].next(0) < front:
                attempt(m)
    assert {k.next(0) for k in keys} == {front}


def test_a_member_alone_at_one_key_for_restart_after_walks_again_from_a0() -> None:
    """Rule 4: alone at one key for RESTART_AFTER seconds, across attempts, the next attempt is at a0;
    being alone at another key, or not alone, starts the count again."""
    keys = AttemptKeys(step=3, index=5)
    keys.done(3, keys.next(3), alone=True, now=1000.0)
    keys.done(3, keys.next(3), alone=True, now=1000.0 + RESTART_AFTER - 1)
    assert keys.next(3) == 5 and keys.restarts == 0
    keys.done(3, keys.next(3), alone=False, now=1000.0 + RESTART_AFTER)  # someone came: count again
    assert keys.next(3) == 6
    keys.done(3, 6, alone=True, now=2000.0)
    keys.done(3, 6, alone=True, now=2000.0 + RESTART_AFTER)
    assert keys.next(3) == 0 and keys.restarts == 1
    keys.done(3, 0, alone=True, now=3000.0)  # alone at a0 now: it waits there as long as it takes
    keys.done(3, 0, alone=True, now=3000.0 + 10 * RESTART_AFTER)
    assert keys.next(3) == 0


@given(st.integers(1, 12))
def test_a_newcomer_meets_a_member_waiting_after_the_tickets_below_it_expired(front: int) -> None:
    """The deadlock rule 4 ends, on a model of the DHT with ticket expiry: a member waited alone at key
    ``front`` for longer than a ticket lives (the others of the step left), so its tickets at the keys
    below are gone; a newcomer finds nobody at a0 and waits there. Without rule 4 both wait for ever; with
    it, the waiting member walks from a0 and meets the newcomer."""
    life = 600.0  # a ticket's life (matchmaking stores them for about ten minutes)
    tickets: dict[int, dict[str, float]] = {}  # key -> member -> stored at
    waiting = AttemptKeys(step=0, index=front)
    newcomer = AttemptKeys()
    now = 0.0
    tickets[front] = {"old": now}
    waiting.alone_at = (front, now)
    now += life + 1  # every ticket below `front` expired; ours at `front` is renewed by lingering

    members = {"old": waiting, "new": newcomer}

    def attempt(name: str) -> bool:
        """One attempt; True if it met the other member: its ticket is live at our key and it waits
        there (both read each other's tickets within the window: a group forms)."""
        keys = members[name]
        index = keys.next(0)
        live = {m for m, at in tickets.get(index, {}).items() if now - at < life}
        tickets.setdefault(index, {})[name] = now
        other = "new" if name == "old" else "old"
        if other in live and members[other].next(0) == index:
            return True
        keys.done(0, index, alone=live <= {name}, now=now)
        return False

    met = False
    for _ in range(200):
        now += 5.0
        if attempt("old") or attempt("new"):
            met = True
            break
    assert met, (waiting.next(0), newcomer.next(0), waiting.restarts)
    assert waiting.restarts == 1
    assert now < life + 1 + RESTART_AFTER + 20  # within about RESTART_AFTER


async def attempts_until_a_plan(
    node: Node, matchmaker: Matchmaker, round_: int, keys: AttemptKeys, limit: int = 6
) -> tuple[int, object]:
    """A member's attempts under the rule (as BatchStep makes them) until one brings a plan."""
    for _ in range(limit):
        index = keys.next(round_)
        plan = await matchmaker.assemble(round_, ticket(node, 1.0), NUMEL, attempt_key(index))
        keys.done(round_, index, alone=plan is None and matchmaker.alone, now=0.0)
        if plan is not None:
            return index, plan
    raise AssertionError(f"no plan in {limit} attempts (at key a{keys.index})")


async def test_consumed_tickets_of_a_plan_whose_member_vanished_move_a_member_on(
    nursery: trio.Nursery,
) -> None:
    """The churn soak's stall under the first fix: a round's plan names a member whose ticket is gone (an
    auxiliary aggregator's short lease ran out; a restarted backbone loses its records). A member that
    comes to the key later finds the others' tickets consumed by that plan: it forms no group, but it is
    not alone there, so it moves on (it used to come back to the key for ever)."""
    nodes = await start_nodes(nursery, 4)
    config = MatchmakingConfig(window=0.4, plan_wait=2.0)
    aux_config = MatchmakingConfig(window=0.4, plan_wait=0.5)  # its lease: window + plan_wait + 5 s
    ids = [n.peer_id for n in nodes]
    key = next(f"a{i}" for i in range(1000) if leader_of(f"avg.7.a{i}", ids[:3]) != ids[0])
    aux = Matchmaker(nodes[0].dht, config=aux_config)
    aux_ticket = JoinTicket(addr=nodes[0].host.listen_addrs[0], weight=0.0, norm=0.0,
                            samples_per_second=0.0, upload_bps=1e9, download_bps=1e9, aux=True)  # fmt: skip
    plans: dict[int, object] = {}

    async def member(i: int) -> None:
        plans[i] = await Matchmaker(nodes[i].dht, config=config).assemble(
            7, ticket(nodes[i], 1.0), NUMEL, key
        )

    async def aggregator() -> None:
        plans[0] = await aux.assemble_auxiliary(7, aux_ticket, key, NUMEL)

    async with trio.open_nursery() as group:
        group.start_soon(aggregator)
        await trio.sleep(0.3)
        for i in (1, 2):
            group.start_soon(member, i)
    assert all(plans[i] is not None and len(plans[i].members) == 3 for i in (0, 1, 2)), plans  # type: ignore[attr-defined]
    with trio.fail_after(30):  # the aggregator's ticket expires: the plan names a member without one
        while (found := await nodes[3].dht.get(f"avg.7.{key}", latest=True)) is not None and (
            ids[0].encode() in found.entries
        ):
            await trio.sleep(0.5)
    late = Matchmaker(nodes[3].dht, config=config)
    keys = AttemptKeys(step=7, index=int(key[1:]))  # it comes to the round's key after the round
    index = keys.next(7)
    assert await late.assemble(7, ticket(nodes[3], 1.0), NUMEL, attempt_key(index)) is None
    assert not late.alone  # two computing tickets were there, consumed or not
    keys.done(7, index, alone=late.alone, now=0.0)
    assert keys.next(7) == index + 1


async def test_a_member_alone_lingers_with_one_ticket_and_the_next_member_meets_it(
    nursery: trio.Nursery,
) -> None:
    """A member alone at its key waits there with the ticket it stored (no new record the other could
    read too late), and forms the group with the member that comes next: both adopt one plan made from
    that very ticket."""
    nodes = await start_nodes(nursery, 2)
    config = MatchmakingConfig(window=0.4, plan_wait=3.0, linger=8.0)
    matchmakers = [Matchmaker(n.dht, config=config) for n in nodes]
    plans: list[object] = [None, None]
    stored: list[bytes] = []

    async def first() -> None:
        plans[0] = await matchmakers[0].assemble(2, ticket(nodes[0], 1.0), NUMEL, "a0")

    async def second() -> None:
        await trio.sleep(3.0)  # well after the first one's window: it lingers
        record = nodes[0].dht.own_record("avg.2.a0", nodes[0].peer_id.encode())
        assert record is not None
        stored.append(record.signature)
        plans[1] = await matchmakers[1].assemble(2, ticket(nodes[1], 1.0), NUMEL, "a0")

    with trio.fail_after(20):
        async with trio.open_nursery() as group:
            group.start_soon(first)
            group.start_soon(second)
    assert plans[0] is not None and plans[1] is not None
    assert plans[0].group_id == plans[1].group_id  # type: ignore[attr-defined]
    after = nodes[0].dht.own_record("avg.2.a0", nodes[0].peer_id.encode())
    assert after is not None and after.signature == stored[0]  # one ticket record all along
    assert not matchmakers[0].alone


async def test_a_strangers_group_written_ahead_makes_honest_members_pass_that_key_together(
    nursery: trio.Nursery,
) -> None:
    """D10: a stranger with two identities fills ``a0`` with a whole group (two tickets and the plan of
    their leader) before anybody comes. Rule 1 says the group formed without us, so both honest members
    pass ``a0``, the same key, and meet under ``a1``. A plan alone written ahead (no second ticket) moves
    nobody: the honest members meet under that key."""
    nodes = await start_nodes(nursery, 4)
    honest, sybils = nodes[:2], nodes[2:]
    config = MatchmakingConfig(window=0.4, plan_wait=3.0, linger=4.0)
    formed: list[object] = [None, None]

    async def sybil(i: int) -> None:
        formed[i] = await Matchmaker(sybils[i].dht, config=config).assemble(
            3, ticket(sybils[i], 1.0), NUMEL, "a0"
        )

    async with trio.open_nursery() as group:
        for i in range(2):
            group.start_soon(sybil, i)
    assert all(p is not None for p in formed)  # their plan is under a0, their tickets live

    met: list[tuple[int, object]] = []

    async def member(i: int) -> None:
        met.append(await attempts_until_a_plan(honest[i], Matchmaker(honest[i].dht, config=config), 3,
                                               AttemptKeys()))  # fmt: skip

    with trio.fail_after(40):
        async with trio.open_nursery() as group:
            for i in range(2):
                group.start_soon(member, i)
    assert [index for index, _ in met] == [1, 1]
    assert met[0][1].group_id == met[1][1].group_id  # type: ignore[attr-defined]

    # a plan alone under a key of the next round (its writer re-stores the sybils' plan there): no
    # ticket of its members is there, so rule 1 does not apply, and it lists no honest ticket (none
    # existed): the honest members meet under a0 (its followers refuse the stranger's plan)
    found = await sybils[0].dht.get("avg.3.a0.plan", latest=True)
    assert found is not None
    for record in found.entries.values():
        writer = next(n for n in sybils if n.peer_id == record.writer)
        await writer.dht.store(
            "avg.4.a0.plan", record.value, time.time() + 600, subkey=writer.peer_id.encode()
        )
    again: list[tuple[int, object]] = []

    async def member_again(i: int) -> None:
        again.append(await attempts_until_a_plan(honest[i], Matchmaker(honest[i].dht, config=config), 4,
                                                 AttemptKeys()))  # fmt: skip

    with trio.fail_after(40):
        async with trio.open_nursery() as group:
            for i in range(2):
                group.start_soon(member_again, i)
    assert [index for index, _ in again] == [0, 0]
