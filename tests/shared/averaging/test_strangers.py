"""Issue 9, findings 5-7 and receipts: averaging with group members that lie (real hosts on loopback)."""

from __future__ import annotations

import contextlib
import math
import time

import msgspec
import numpy as np
import pytest
import trio
import trio.testing

from protocols.averaging import (
    MAX_WEIGHT,
    AssemblyMember,
    GroupAssembly,
    JoinTicket,
    PartHeader,
    encode_header,
)
from protocols.codes import ErrorCode
from protocols.peer_id import PeerId
from protocols.receipts import decode_receipt, receipt_payload
from shared.auth.keys import Identity, verify_by_peer_id
from shared.averaging.allreduce import Averager, GroupPlan, Member, RoundResult
from shared.averaging.groups import WeightHistory, bound_weights, leader_of
from shared.averaging.matchmaking import Matchmaker, MatchmakingConfig, PlanRefused, group_id, ticket_digest
from shared.dht.node import DHTNode
from shared.errors import ProjectError, RemoteError
from shared.net.addresses import parse_multiaddr
from shared.net.host import Host

from .test_allreduce import run_round, start_hosts
from .test_matchmaking import start_nodes


def norm(v: np.ndarray) -> float:
    return float(np.linalg.norm(v.astype(np.float64)))


def plan_of(
    peers: list[tuple[Host, Averager]],
    vectors: list[np.ndarray],
    weights: list[float],
    sizes: list[int],
    *,
    round_: int = 1,
    deadline: float = 20.0,
) -> GroupPlan:
    members = tuple(
        Member(h.peer_id, parse_multiaddr(h.listen_addrs[0]), w, norm(v))
        for (h, _), v, w in zip(peers, vectors, weights, strict=True)
    )
    return GroupPlan(b"strangers", round_, members, tuple(sizes), deadline)


# ------------------------------------------------------------------ finding 5: the plan


def tickets_for(n: int, weights: list[float]) -> tuple[list[PeerId], dict[PeerId, JoinTicket]]:
    ids = sorted(Identity.generate().peer_id for _ in range(n))
    tickets = {
        p: JoinTicket(
            addr=f"/ip4/127.0.0.1/tcp/{4001 + i}",
            weight=w,
            norm=10.0,
            samples_per_second=10.0,
            upload_bps=1e7,
            download_bps=1e7,
        )
        for i, (p, w) in enumerate(zip(ids, weights, strict=True))
    }
    return ids, tickets


def test_check_plan_refuses_every_forgery_of_the_leaders_plan() -> None:
    ids, tickets = tickets_for(4, [16.0, 16.0, 64.0, MAX_WEIGHT])
    mm = Matchmaker(None)  # type: ignore[arg-type]  # check_plan and _solve touch no DHT
    key, numel = "avg.7.x", 100_000
    leader = leader_of(key, ids)
    honest = mm._solve(7, key, ids, tickets, numel, [ticket_digest(p.encode()) for p in ids])
    mm.check_plan(7, key, leader, honest, set(ids), tickets, numel)  # the real plan passes
    assert [m.weight for m in honest.members] == [16.0, 16.0, 64.0, 128.0]  # 2**53 capped at 8 x 16

    attacker = next(p for p in ids if p != leader)
    index = ids.index(attacker)
    members = list(honest.members)
    greedy = [msgspec.structs.replace(m, weight=MAX_WEIGHT) if m.peer_id == attacker else m for m in members]
    forgeries: dict[str, tuple[str, GroupAssembly]] = {
        "written by a non-leader": (attacker, honest),
        "weight 2**53": (leader, msgspec.structs.replace(honest, members=greedy)),
        "sole aggregator": (
            leader,
            msgspec.structs.replace(honest, slice_sizes=[numel if i == index else 0 for i in range(4)]),
        ),
        "day-long deadline": (leader, msgspec.structs.replace(honest, deadline=3600.0)),
        "leaves a member out": (
            leader,
            msgspec.structs.replace(
                honest,
                members=[m for m in members if m.peer_id != attacker],
                slice_sizes=[s for i, s in enumerate(honest.slice_sizes) if i != index],
            ),
        ),
        "redirects an address": (
            leader,
            msgspec.structs.replace(
                honest,
                members=[
                    msgspec.structs.replace(m, addr="/ip4/10.0.0.1/tcp/1") if m.peer_id == attacker else m
                    for m in members
                ],
            ),
        ),
        "tiny parts": (leader, msgspec.structs.replace(honest, part_numel=1)),
        "another round": (leader, msgspec.structs.replace(honest, round=8)),
        "the key's old group id": (leader, msgspec.structs.replace(honest, group_id=key.encode()[-32:])),
        "another plan's group id": (
            leader,
            msgspec.structs.replace(honest, tickets=[bytes(16)] * 4, group_id=honest.group_id),
        ),
        "a digest too few": (
            leader,
            msgspec.structs.replace(
                honest, tickets=honest.tickets[:3], group_id=group_id(key, honest.tickets[:3])
            ),
        ),
    }
    for name, (writer, forged) in forgeries.items():
        with pytest.raises(PlanRefused):  # noqa: PT012  # the fail() names the forgery that got through
            mm.check_plan(7, key, writer, forged, set(ids), tickets, numel)
            pytest.fail(f"accepted a plan that {name}")


def pick_key(ids: list[PeerId], leader_wanted: set[PeerId], round_: int) -> str:
    for i in range(1000):
        if leader_of(f"avg.{round_}.k{i}", ids) in leader_wanted:
            return f"k{i}"
    raise AssertionError("no key found")


async def forge_plans(attacker: Host, dht: DHTNode, key: str, ids: list[PeerId], numel: int) -> None:
    """The attacker's plan: itself the only aggregator, weight 2**53, a 3600 s deadline; written under its
    own subkey, as a plain record (the old winner) and under every other member's subkey."""
    forged = GroupAssembly(
        group_id=key.encode()[-32:],
        round=int(key.split(".")[1]),
        members=[
            AssemblyMember(p, attacker.listen_addrs[0] if p == attacker.peer_id else None, MAX_WEIGHT, 1.0)
            for p in ids
        ],
        slice_sizes=[numel if p == attacker.peer_id else 0 for p in ids],
        codec="none",
        part_numel=numel,
        deadline=3600.0,
        predicted_seconds=0.0,
    )
    value = msgspec.msgpack.encode(forged)
    for subkey in [attacker.peer_id.encode(), None, *(p.encode() for p in ids)]:
        with contextlib.suppress(ProjectError):  # a DHT that refuses foreign subkeys is fine too
            await dht.store(f"{key}.plan", value, time.time() + 600, subkey=subkey)


@pytest.mark.parametrize("attacker_leads", [False, True])
async def test_followers_never_adopt_a_forged_plan(nursery: trio.Nursery, attacker_leads: bool) -> None:
    nodes = await start_nodes(nursery, 4)
    honest, attacker = nodes[:3], nodes[3]
    ids = sorted(n.peer_id for n in nodes)
    numel = 20_000
    group = pick_key(ids, {attacker.peer_id} if attacker_leads else {n.peer_id for n in honest}, 5)
    key = f"avg.5.{group}"
    config = MatchmakingConfig(window=1.0, plan_wait=2.0)
    weights = [16.0, 16.0, 64.0]
    ticket = JoinTicket(
        addr=attacker.host.listen_addrs[0],
        weight=MAX_WEIGHT,
        norm=1.0,
        samples_per_second=10.0,
        upload_bps=1e7,
        download_bps=1e7,
    )
    await attacker.dht.store(
        key, msgspec.msgpack.encode(ticket), time.time() + 600, subkey=attacker.peer_id.encode()
    )
    await forge_plans(attacker.host, attacker.dht, key, ids, numel)
    matchmakers = [Matchmaker(n.dht, config=config) for n in honest]
    plans: list[GroupPlan | None] = [None] * 3

    async def member(i: int) -> None:
        t = JoinTicket(
            addr=honest[i].host.listen_addrs[0],
            weight=weights[i],
            norm=1.0,
            samples_per_second=10.0,
            upload_bps=1e7,
            download_bps=1e7,
        )
        plans[i] = await matchmakers[i].assemble(5, t, numel, group)

    async with trio.open_nursery() as group_nursery:
        for i in range(3):
            group_nursery.start_soon(member, i)
    followers = [i for i in range(3) if honest[i].peer_id != leader_of(key, ids)]
    assert all(matchmakers[i].plans_refused >= 1 for i in followers)  # the forged plans were seen, refused
    if attacker_leads:
        assert plans == [None, None, None]  # no acceptable plan: the round fails, nobody adopts the forgery
        return
    assert all(p is not None for p in plans)
    assert len({p.members for p in plans if p is not None}) == 1  # one plan, the real leader's
    plan = plans[0]
    assert plan is not None
    by_peer = {m.peer_id: m for m in plan.members}
    assert by_peer[attacker.peer_id].weight == 128.0  # 2**53 capped at 8 x the lower median (16)
    assert plan.deadline < 3600.0
    assert max(plan.slice_sizes) < numel  # the LP spreads the slices; nobody aggregates everything


def test_weight_bounds_cap_liars_and_spare_honest_heterogeneity() -> None:
    assert bound_weights([16.0, 16.0, 64.0, 4.0]) == [16.0, 16.0, 64.0, 4.0]
    assert bound_weights([16.0, 16.0, 64.0, MAX_WEIGHT]) == [16.0, 16.0, 64.0, 128.0]
    assert bound_weights([16.0, MAX_WEIGHT]) == [16.0, 128.0]  # two senders: the lower median is honest
    assert bound_weights([16.0, 16.0, 64.0, MAX_WEIGHT], max_weight=100.0)[3] == 100.0
    assert bound_weights([0.0, 0.0]) == [0.0, 0.0]
    history = WeightHistory()
    assert history.bound("p", 1e9, 0.0, 16.0) == 1e9  # nothing seen yet: only the plan's bound applies
    for t, w in enumerate([8.0, 8.0, 8.0]):
        history.record("p", w, 10.0 * t)
    assert history.bound("p", 30.0, 30.0, 16.0) == 30.0  # up to 4x its recent weight
    assert history.bound("p", 1e9, 30.0, 16.0) == 32.0  # not the whole batch at once
    assert history.bound("p", 1e9, 70.0, 16.0) == 32.0 * 5  # a longer gap between rounds allows more


# ------------------------------------------------------------------ finding 6: honest runs and bad averages


async def test_honest_unequal_weights_and_speeds_ban_nobody_and_receipts_carry_the_weights(
    nursery: trio.Nursery,
) -> None:
    peers = await start_hosts(nursery, 4)
    numel = 40_000
    rng = np.random.default_rng(3)
    rounds = [[16.0, 16.0, 64.0, 4.0], [16.0, 32.0, 64.0, 4.0], [8.0, 16.0, 64.0, 8.0]]
    for round_, weights in enumerate(rounds):
        vectors = [rng.standard_normal(numel).astype(np.float32) * (1 + i) for i in range(4)]
        stacked = np.stack(vectors).astype(np.float64)
        expected = np.average(stacked, axis=0, weights=weights).astype(np.float32)
        plan = plan_of(peers, vectors, weights, [numel // 4] * 4, round_=round_ + 1)
        results: list[RoundResult | None] = [None] * 4
        step = round_ + 10

        async def one(
            i: int,
            plan: GroupPlan = plan,
            vectors: list[np.ndarray] = vectors,
            results: list[RoundResult | None] = results,
            step: int = step,
        ) -> None:
            if i == 3:
                await trio.sleep(0.2)  # the slow peer
            results[i] = await peers[i][1].all_reduce(plan, vectors[i], i, step=step)

        async with trio.open_nursery() as group:
            for i in range(4):
                group.start_soon(one, i)
        for i, result in enumerate(results):
            assert result is not None and result.outcome.complete and not result.refused
            for c in result.completeness.values():
                assert c.complete  # nobody banned, dropped or late
            assert np.array_equal(vectors[i], vectors[0])
            assert len(result.receipts) == 4  # one per aggregator, ourselves included
            for aggregator, signed in result.receipts:
                assert verify_by_peer_id(aggregator, signed.signature, receipt_payload(signed.receipt))
                receipt = decode_receipt(signed.receipt)
                mine = (peers[i][0].peer_id, step, weights[i])
                assert (receipt.sender, receipt.step, receipt.weight) == mine
                assert receipt.nbytes == 4 * numel // 4
            assert sorted(n for _, n in result.pulled) == [4 * numel // 4] * 3
        assert np.max(np.abs(vectors[0] - expected)) < 1e-5


async def test_a_sudden_weight_jump_is_capped_by_history_and_the_receipt_says_so(
    nursery: trio.Nursery,
) -> None:
    peers = await start_hosts(nursery, 3)
    numel = 30_000
    sizes = [numel // 2, numel - numel // 2, 0]  # peer 2 only sends
    ones = [np.full(numel, 1.0, dtype=np.float32) * (i + 1) for i in range(3)]
    await run_round(peers, plan_of(peers, ones, [16.0, 16.0, 4.0], sizes), [v.copy() for v in ones])
    vectors = [v.copy() for v in ones]
    plan = plan_of(peers, vectors, [16.0, 16.0, 128.0], sizes, round_=2)
    results = await run_round(peers, plan, vectors)
    # both aggregators saw peer 2 weigh 4 one round ago: now at most max(lower median 16, 4 x 4) = 16
    expected = np.float32((16 * 1 + 16 * 2 + 16 * 3) / 48)
    assert np.all(vectors[0] == expected) and np.array_equal(vectors[0], vectors[2])
    receipts = results[2].receipts  # type: ignore[attr-defined]
    assert len(receipts) == 2
    assert all(decode_receipt(r.receipt).weight == 16.0 for _, r in receipts)


class PoisoningAverager(Averager):
    """An aggregator that returns ``poison`` times its honest average (NaN or an absurd scale)."""

    poison = math.nan

    async def _maybe_finalize(self, duty, k):  # type: ignore[no-untyped-def]
        await super()._maybe_finalize(duty, k)
        part = duty.parts[k]
        if part.averaged is not None:
            part.averaged *= np.float32(self.poison)  # codec none: the reply is a view of these values


@pytest.mark.parametrize("poison", [math.nan, 1e30])
async def test_receivers_refuse_a_poisoned_average_and_keep_their_own_values(
    nursery: trio.Nursery, poison: float
) -> None:
    peers = await start_hosts(nursery, 2)
    bad = Host(Identity.generate(), "avg-test")
    await nursery.start(bad.run, ["/ip4/127.0.0.1/tcp/0"])
    evil = PoisoningAverager(bad)
    evil.poison = poison
    peers.append((bad, evil))
    numel = 30_000
    vectors = [np.full(numel, float(i + 1), dtype=np.float32) for i in range(3)]
    plan = plan_of(peers, vectors, [1.0, 1.0, 1.0], [10_000, 10_000, 10_000])
    results = await run_round(peers, plan, vectors, skip=set())
    for i in (0, 1):
        result = results[i]
        assert list(result.refused) == [2]  # type: ignore[attr-defined]
        assert result.outcome.unaveraged() == [(20_000, 30_000)]  # type: ignore[attr-defined]
        assert np.all(vectors[i][20_000:] == np.float32(i + 1))  # kept local, never NaN
        assert np.all(vectors[i][:20_000] == np.float32(2.0))
        assert peers[i][1].statistics().averages_refused == 1
        assert all(a != bad.peer_id for a, _ in results[i].receipts)  # type: ignore[attr-defined]


# ------------------------------------------------------------------ finding 7: headers before payloads


async def test_a_non_member_part_is_refused_before_its_payload_is_read(nursery: trio.Nursery) -> None:
    peers = await start_hosts(nursery, 2)
    ((outsider, _),) = await start_hosts(nursery, 1)
    numel = 100_000
    vectors = [np.full(numel, float(i), dtype=np.float32) for i in range(2)]
    plan = plan_of(peers, vectors, [1.0, 1.0], [numel, 0])
    aggregator = peers[0][1]
    huge = 4 * 1024 * 1024  # elements: a 16 MiB part
    header = PartHeader(
        group_id=plan.group_id,
        round=plan.round,
        part_index=0,
        offset=0,
        numel=huge,
        codec="none",
        weight=1.0,
        nbytes=4 * huge,
    )
    address = parse_multiaddr(peers[0][0].listen_addrs[0])
    results: list[RoundResult] = []

    async def member0() -> None:
        results.append(await aggregator.all_reduce(plan, vectors[0], 0))

    async with trio.open_nursery() as group:
        group.start_soon(member0)
        with pytest.raises(RemoteError) as refused:
            await outsider.send_bulk(address, "avg.push", bytes(4 * huge), encode_header(header))
        assert refused.value.code == ErrorCode.FORBIDDEN
        assert aggregator.statistics().part_bytes_read == 0  # not one payload byte went into a buffer
        assert aggregator.statistics().parts_refused == 1
        # a member whose header breaks the plan (wrong weight) is banned, also before its payload is read
        lying = msgspec.structs.replace(header, weight=2.0, numel=numel, nbytes=4 * numel)
        with pytest.raises(RemoteError):
            await peers[1][0].send_bulk(address, "avg.push", bytes(4 * numel), encode_header(lying))
        assert aggregator.statistics().part_bytes_read == 0
    assert results[0].outcome.complete
    assert np.all(vectors[0] == np.float32(0.0))  # peer 1 banned: the average is peer 0's alone
    assert peers[1][0].peer_id in dict(results[0].completeness[0].dropped)


# ------------------------------------------------------------------ receipts: forged, replayed, inflated


def test_a_member_keeps_only_receipts_the_aggregator_signed_for_it_this_round() -> None:
    from protocols.errors import ProtocolError
    from protocols.receipts import PartReceipt, SignedReceipt, encode_receipt

    me, aggregator, stranger = (Identity.generate() for _ in range(3))
    host = Host(me, "avg-test")
    averager = Averager(host)
    members = (
        Member(me.peer_id, None, 16.0, 1.0),
        Member(aggregator.peer_id, parse_multiaddr("/ip4/127.0.0.1/tcp/4001"), 16.0, 1.0),
    )
    plan = GroupPlan(b"g", 3, members, (0, 100), 10.0)
    honest = PartReceipt(
        run_id="avg-test",
        aggregator=aggregator.peer_id,
        sender=me.peer_id,
        step=4,
        group_id=b"g",
        round=3,
        weight=16.0,
        nbytes=400,
        issued_at=time.time(),
    )

    def signed(receipt: PartReceipt, by: Identity = aggregator) -> SignedReceipt:
        body = encode_receipt(receipt)
        return SignedReceipt(receipt=body, signature=by.sign(receipt_payload(body)))

    assert averager._verify_receipt(plan, 0, 1, 4, signed(honest)) == signed(honest)
    forged = {
        "signed by another peer": signed(honest, by=stranger),
        "replayed from another round": signed(msgspec.structs.replace(honest, round=2)),
        "for another step": signed(msgspec.structs.replace(honest, step=3)),
        "for another sender": signed(msgspec.structs.replace(honest, sender=stranger.peer_id)),
        "of another run": signed(msgspec.structs.replace(honest, run_id="other-run")),
        "above our own weight": signed(msgspec.structs.replace(honest, weight=17.0)),
        "garbage": SignedReceipt(receipt=b"\x81\xa3\xff\xfe\xfd\xc0", signature=b"\0" * 64),
    }
    for name, receipt in forged.items():
        with pytest.raises(ProtocolError):  # noqa: PT012
            averager._verify_receipt(plan, 0, 1, 4, receipt)
            pytest.fail(f"kept a receipt {name}")


async def test_repeated_pulls_of_one_member_do_not_end_the_duty_for_the_others(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    from protocols.averaging import PullRequest
    from shared.averaging import allreduce

    monkeypatch.setattr(allreduce, "EARLY_ARRIVAL_WAIT", 0.5)  # a popped duty answers NOT_FOUND soon
    peers = await start_hosts(nursery, 3)
    numel = 1000
    vectors = [np.full(numel, float(i + 1), dtype=np.float32) for i in range(3)]
    plan = plan_of(peers, vectors, [1.0, 0.0, 1.0], [numel, 0, 0])  # peer 1 only receives, and late
    results = await run_round(peers, plan, vectors, skip={1})
    assert results[0].outcome.complete  # type: ignore[attr-defined]
    address = parse_multiaddr(peers[0][0].listen_addrs[0])
    request = encode_header(PullRequest(group_id=plan.group_id, round=plan.round, part_index=0))
    for _ in range(3):  # peer 2 pulls the same part again and again
        await peers[2][0].send_bulk(
            address, "avg.pull", b"", request, sink=lambda m, n: memoryview(bytearray(n))
        )
    late = await peers[1][1].all_reduce(plan, vectors[1], 1)
    assert late.outcome.complete
    assert np.all(vectors[1] == np.float32(2.0))  # (1 + 3) / 2


async def test_tickets_and_plans_of_invalid_utf8_are_ignored_not_fatal(nursery: trio.Nursery) -> None:
    """``81 a3 ff fe fd c0``-style strings raise UnicodeDecodeError, not msgspec.DecodeError: an admitted
    writer's malformed ticket or plan once ended the matchmaker (and the volunteer) with it."""
    nodes = await start_nodes(nursery, 3)
    ids = sorted(n.peer_id for n in nodes)
    group = pick_key(ids, {nodes[2].peer_id}, 6)
    key = f"avg.6.{group}"
    garbage = b"\x86\xa4addr\xa3\xff\xfe\xfd\xa6weight\xcb" + bytes(8) + b"\xa4norm\x01"
    for suffix in ("", ".plan"):
        await nodes[2].dht.store(key + suffix, garbage, time.time() + 600, subkey=nodes[2].peer_id.encode())
    config = MatchmakingConfig(window=0.5, plan_wait=1.0)
    plans: list[GroupPlan | None] = [None, None]

    async def member(i: int) -> None:
        t = JoinTicket(
            addr=nodes[i].host.listen_addrs[0],
            weight=8.0,
            norm=1.0,
            samples_per_second=10.0,
            upload_bps=1e7,
            download_bps=1e7,
        )
        plans[i] = await Matchmaker(nodes[i].dht, config=config).assemble(6, t, 1000, group)

    async with trio.open_nursery() as group_nursery:
        for i in range(2):
            group_nursery.start_soon(member, i)
    # the garbage writer is no member; the two honest peers form the group, nobody crashed
    assert plans[0] is not None and plans[0] == plans[1]
    assert {m.peer_id for m in plans[0].members} == {nodes[0].peer_id, nodes[1].peer_id}


async def test_one_peer_cannot_fill_the_pending_rounds_of_an_aggregator() -> None:
    """Requests for rounds not started yet wait; one peer may have only a few of them waiting at once."""
    from shared.averaging.allreduce import MAX_EARLY_PER_PEER

    averager = Averager(Host(Identity.generate(), "avg-test"))
    attacker, honest = Identity.generate().peer_id, Identity.generate().peer_id
    async with trio.open_nursery() as nursery:
        for i in range(MAX_EARLY_PER_PEER):
            nursery.start_soon(averager._duty_for, b"made-up", i, attacker)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RemoteError) as refused:
            await averager._duty_for(b"made-up", 99, attacker)
        assert refused.value.code == ErrorCode.OVERLOADED
        with trio.move_on_after(0.05) as waited:  # another peer's early request still waits its turn
            await averager._duty_for(b"real", 1, honest)
        assert waited.cancelled_caught
        nursery.cancel_scope.cancel()
    assert averager._early == {}
