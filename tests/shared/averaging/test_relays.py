"""An aggregator that dies after serving its slice to some members but not others (the 600-s churn soak:
v1 and v5 stepped, v3 and v4 retried as a pair and forked for a step): the others get the slice from the
members that hold it, verified by the aggregator's signature, so every survivor ends the round the same
(module docstring of :mod:`shared.averaging.allreduce`, "Relayed slices").

Several hosts in one trio run on loopback. The dying aggregator serves its averaged parts to the members
it is told to; the first pull of any other member waits until those members have verified every part,
then the aggregator's host is aborted (what a SIGKILL does to the others: every connection reset, no
dial answered) and its round is cancelled. Nothing is timed: every wait is on a condition.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import trio

from protocols.averaging import (
    AveragedHeader,
    RelayRequest,
    averaged_payload,
    decode_averaged_header,
    decode_relay_request,
    encode_header,
    part_digest,
    statement_of,
)
from protocols.codes import ErrorCode
from protocols.peer_id import PeerId
from shared.auth.keys import Identity, verify_by_peer_id
from shared.averaging.allreduce import RELAY, Averager, GroupPlan, RoundResult
from shared.errors import PeerUnavailable, RemoteError
from shared.net.addresses import parse_multiaddr
from shared.net.bulk import BulkReply
from shared.net.host import Host, HostConfig

from .test_allreduce import plan_for

RUN = "avg-test"
NUMEL = 50_000
PART = 5_000  # 10_000-element slices of 5 members: 2 parts each


class Recording(Averager):
    """An honest member that notes every averaged part it pulled and verified (so the test knows when the
    aggregator may die), and every relay request asked again after it answered NOT_FOUND (final)."""

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self.verified: set[tuple[int, int]] = set()  # (aggregator index, part index)
        self.answers: dict[tuple[PeerId, int, int], list[str]] = {}  # (asker, aggregator, part) -> codes
        self.pending_asked = trio.Event()

    async def _pull_part(self, address, plan, me, j, k, *rest):  # type: ignore[no-untyped-def]
        await super()._pull_part(address, plan, me, j, k, *rest)
        self.verified.add((j, k))

    async def _on_relay(self, ctx, header, reader):  # type: ignore[no-untyped-def]
        request = decode_relay_request(header.meta)
        answers = self.answers.setdefault((ctx.peer_id, request.aggregator, request.part_index), [])
        try:
            reply = await super()._on_relay(ctx, header, reader)
        except RemoteError as exc:
            answers.append(ErrorCode(exc.code).name)
            if exc.code == ErrorCode.PENDING:
                self.pending_asked.set()
            raise
        answers.append("part")
        return reply

    def asked_again_after_not_found(self) -> list[tuple[PeerId, int, int]]:
        return [key for key, seq in self.answers.items() if "NOT_FOUND" in seq[:-1]]


class Late(Recording):
    """Receives the last part of aggregator ``late_from``'s slice but holds it back (as if still verifying
    it) until some member asked it for a relay and was answered PENDING."""

    late_from = -1

    async def _fetch_part(self, address, kind, request, plan, j, k, *rest):  # type: ignore[no-untyped-def]
        header = await super()._fetch_part(address, kind, request, plan, j, k, *rest)
        last = -(-plan.slice_sizes[j] // plan.part_numel) - 1
        if (kind, j, k) != ("avg.pull", self.late_from, last) or self.pending_asked.is_set():
            return header
        held = self._held[(plan.group_id, plan.round)]
        entry = held.parts.pop((j, k))
        self.verified.add((j, k))  # the aggregator may die now
        await self.pending_asked.wait()
        held.parts[(j, k)] = entry
        return header


class Dying(Recording):
    """Serves its averaged slice to ``serve`` only; the first pull of anyone else kills it (or, with
    ``hang``, is never answered while every connection stays open), once every member of ``serve``
    verified the whole slice."""

    hang = False
    serve: frozenset[PeerId] = frozenset()
    holders: tuple[Recording, ...] = ()
    me = -1
    parts = 0

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self.died = trio.Event()

    async def _on_pull(self, ctx, header, reader):  # type: ignore[no-untyped-def]
        if ctx.peer_id in self.serve:
            return await super()._on_pull(ctx, header, reader)
        wanted = {(self.me, k) for k in range(self.parts)}
        while not all(wanted <= h.verified for h in self.holders):
            await trio.sleep(0.01)
        if self.hang:
            await trio.sleep_forever()
        self.host.abort()
        self.died.set()
        raise PeerUnavailable("killed")


class LyingRelay(Recording):
    """Relays what it holds, tampered with (``tamper``)."""

    tamper = "payload"

    async def _on_relay(self, ctx, header, reader):  # type: ignore[no-untyped-def]
        reply = await super()._on_relay(ctx, header, reader)
        meta = decode_averaged_header(reply.meta)
        if self.tamper == "payload":
            data = bytearray(reply.data)
            data[:4] = np.float32(1e3).tobytes()  # a plausible value: only the digest can tell
            return BulkReply(reply.meta, memoryview(data))
        if self.tamper == "signature":
            forged = msgspec.structs.replace(meta, signature=bytes(64))
            return BulkReply(encode_header(forged), reply.data)
        # "another part": the other part's genuine payload and signature, relabelled as the one asked for
        (key,) = [key for key in self._held if key[0] == b"g"]
        other = 1 if meta.part_index == 0 else 0  # parts 0 and 1 have the same size
        other_meta, other_data = self._held[key].parts[(self._aggregator, other)]
        theirs = decode_averaged_header(other_meta)
        relabelled = msgspec.structs.replace(theirs, part_index=meta.part_index, offset=meta.offset)
        return BulkReply(encode_header(relabelled), other_data)

    _aggregator = -1


async def start(nursery: trio.Nursery, kinds: list[type[Recording]]) -> list[tuple[Host, Recording]]:
    out = []
    for kind in kinds:
        host = Host(Identity.generate(), RUN, HostConfig(dial_deadline=3, bulk_stall=5))
        averager = kind(host)
        await nursery.start(host.run, ["/ip4/127.0.0.1/tcp/0"])
        out.append((host, averager))
    return out


async def round_with_a_death(
    peers: list[tuple[Host, Recording]], plan: GroupPlan, victim: int, serve: set[int]
) -> tuple[list[RoundResult | None], list[np.ndarray]]:
    """Every member averages; the victim serves its slice to ``serve`` and dies at the first other pull."""
    dying = peers[victim][1]
    assert isinstance(dying, Dying)
    dying.serve = frozenset(peers[i][0].peer_id for i in serve)
    dying.holders = tuple(peers[i][1] for i in serve)
    dying.me, dying.parts = victim, -(-plan.slice_sizes[victim] // plan.part_numel)
    rng = np.random.default_rng(7)
    vectors = [rng.standard_normal(NUMEL).astype(np.float32) for _ in peers]
    originals = [v.copy() for v in vectors]
    results: list[RoundResult | None] = [None] * len(peers)

    async def one(i: int) -> None:
        results[i] = await peers[i][1].all_reduce(plan, vectors[i], i)

    async def victim_round() -> None:
        with trio.CancelScope() as scope:

            async def cancel_on_death() -> None:
                await dying.died.wait()
                scope.cancel()

            async with trio.open_nursery() as inner:
                inner.start_soon(cancel_on_death)
                await one(victim)  # its own round cannot end: it waits for the pulls it never serves

    with trio.fail_after(60):  # generous: the round takes a second, or the stall timeouts of a hang
        async with trio.open_nursery() as nursery:
            nursery.start_soon(victim_round)
            async with trio.open_nursery() as survivors:
                for i in range(len(peers)):
                    if i != victim:
                        survivors.start_soon(one, i)
            nursery.cancel_scope.cancel()  # a hung victim's round would wait for its deadline
    return results, [v if i != victim else originals[i] for i, v in enumerate(vectors)]


def victim_range(plan: GroupPlan, victim: int) -> tuple[int, int]:
    start = sum(plan.slice_sizes[:victim])
    return start, start + plan.slice_sizes[victim]


async def test_an_aggregator_that_died_after_serving_some_members_reaches_every_survivor(
    nursery: trio.Nursery,
) -> None:
    """The soak's case: 5 members, aggregator 2 served members 0 and 4, then died."""
    peers = await start(nursery, [Recording, Recording, Dying, Recording, Recording])
    plan = plan_for(peers, NUMEL, part_numel=PART)  # type: ignore[arg-type]
    results, vectors = await round_with_a_death(peers, plan, victim=2, serve={0, 4})
    survivors = [0, 1, 3, 4]
    dead = peers[2][0].peer_id
    for i in survivors:
        result = results[i]
        assert result is not None and result.outcome.complete, result  # nobody failed slice 2
        assert np.array_equal(vectors[i], vectors[0])  # bit-identical on every survivor
    for i in (1, 3):
        result = results[i]
        assert result is not None and result.relayed == {dead: 2}, result.relayed
        assert dead in result.departed
        assert all(aggregator != dead for aggregator, _ in result.receipts)  # no receipt through a relay
        assert peers[i][1].statistics().relays_received == 2
    assert sum(peers[i][1].statistics().relays_served for i in (0, 4)) == 4  # 2 parts to 2 members
    assert all(peers[i][1].statistics().relays_refused == 0 for i in survivors)
    # what a holder keeps for relaying ends with the grace, and is released, not kept while idle
    holder = peers[0][1]
    assert holder._held and all(held.expires_at < float("inf") for held in holder._held.values())
    holder.release_expired()
    assert holder._held  # the grace has not passed yet
    for held in holder._held.values():
        held.expires_at = trio.current_time()  # as if it had
    holder.release_expired()
    assert not holder._held


async def test_a_hung_aggregator_is_relayed_after_the_stall_timeout(nursery: trio.Nursery) -> None:
    """It stops answering with every connection open: the members it did not serve notice from the pull
    stall timeout (2 T), later than a kill, and the ones it served still hold the parts (grace 3 T)."""
    peers = await start(nursery, [Recording, Recording, Dying])
    victim = peers[2][1]
    assert isinstance(victim, Dying)
    victim.hang = True
    plan = plan_for(peers, 30_000, part_numel=PART)  # type: ignore[arg-type]
    rng = np.random.default_rng(3)
    vectors = [rng.standard_normal(30_000).astype(np.float32) for _ in peers]
    victim.serve, victim.holders = frozenset({peers[0][0].peer_id}), (peers[0][1],)
    victim.me, victim.parts = 2, 2
    results: list[RoundResult | None] = [None, None]

    async def one(i: int) -> None:
        results[i] = await peers[i][1].all_reduce(plan, vectors[i], i)

    with trio.fail_after(60):
        async with trio.open_nursery() as outer:
            outer.start_soon(victim.all_reduce, plan, vectors[2], 2)
            async with trio.open_nursery() as survivors:
                survivors.start_soon(one, 0)
                survivors.start_soon(one, 1)
            outer.cancel_scope.cancel()
    dead = peers[2][0].peer_id
    assert results[0] is not None and results[0].outcome.complete
    assert results[1] is not None and results[1].outcome.complete, results[1]
    assert "stalled" in results[1].departed[dead] and results[1].relayed == {dead: 2}
    assert np.array_equal(vectors[0], vectors[1])


async def test_nobody_got_the_slice_so_every_survivor_fails_it_together(nursery: trio.Nursery) -> None:
    peers = await start(nursery, [Recording, Recording, Dying, Recording])
    plan = plan_for(peers, NUMEL, part_numel=PART)  # type: ignore[arg-type]
    # 4 members: slices of 12_500, parts of 5_000 -> the victim's slice has 3 parts
    results, vectors = await round_with_a_death(peers, plan, victim=2, serve=set())
    lo, hi = victim_range(plan, 2)
    for i in (0, 1, 3):
        result = results[i]
        assert result is not None and result.outcome.unaveraged() == [(lo, hi)], result
        assert not result.relayed
        assert peers[i][1].statistics().relays_received == 0
        assert np.array_equal(vectors[i][:lo], vectors[0][:lo])  # the rest averaged alike
        assert np.array_equal(vectors[i][hi:], vectors[0][hi:])


async def test_a_member_still_pulling_answers_pending_and_is_asked_again(nursery: trio.Nursery) -> None:
    """The churn test's fork under load: the aggregator died while member 0 was still receiving its last
    part; member 1, asking first, is answered PENDING (not "not held"), asks again, and gets the part, so
    both step with the same vector instead of member 1 retrying alone."""
    peers = await start(nursery, [Late, Recording, Dying])
    late = peers[0][1]
    assert isinstance(late, Late)
    late.late_from = 2
    plan = plan_for(peers, NUMEL, part_numel=PART)  # type: ignore[arg-type]
    results, vectors = await round_with_a_death(peers, plan, victim=2, serve={0})
    dead = peers[2][0].peer_id
    for i in (0, 1):
        result = results[i]
        assert result is not None and result.outcome.complete, result
    parts = -(-plan.slice_sizes[2] // PART)
    assert results[1] is not None and results[1].relayed == {dead: parts}
    assert np.array_equal(vectors[0], vectors[1])
    asked = late.answers[(peers[1][0].peer_id, 2, parts - 1)]
    assert asked[0] == "PENDING" and asked[-1] == "part", asked


async def test_not_held_is_final_so_nobody_asks_again(nursery: trio.Nursery) -> None:
    """Nobody got the slice: each survivor's pull of it ends, and from then on it answers NOT_FOUND, which
    the others never ask again (asking on every "not held" until 2 T stalled the soak's survivors)."""
    peers = await start(nursery, [Recording, Recording, Dying, Recording])
    plan = plan_for(peers, NUMEL, part_numel=PART)  # type: ignore[arg-type]
    results, _ = await round_with_a_death(peers, plan, victim=2, serve=set())
    for i in (0, 1, 3):
        assert results[i] is not None and not results[i].relayed  # type: ignore[union-attr]
        assert peers[i][1].answers, "the survivors asked each other"
        assert peers[i][1].asked_again_after_not_found() == []
        assert all(seq[-1] == "NOT_FOUND" for seq in peers[i][1].answers.values())


@pytest.mark.parametrize("tamper", ["payload", "signature", "another part"])
@pytest.mark.parametrize("honest_holder", [True, False])
async def test_a_lying_relay_is_refused_and_never_applied(
    nursery: trio.Nursery, tamper: str, honest_holder: bool
) -> None:
    """Member 1 lies, and is asked first (plan order); member 2 holds the slice honestly, or nothing."""
    peers = await start(nursery, [Recording, LyingRelay, Recording, Dying])
    liar = peers[1][1]
    assert isinstance(liar, LyingRelay)
    liar.tamper, liar._aggregator = tamper, 3
    plan = plan_for(peers, NUMEL, part_numel=PART)  # type: ignore[arg-type]
    rng = np.random.default_rng(7)  # the vectors round_with_a_death draws
    own = [rng.standard_normal(NUMEL).astype(np.float32) for _ in peers]
    results, vectors = await round_with_a_death(peers, plan, 3, serve={1, 2} if honest_holder else {1})
    lo, hi = victim_range(plan, 3)
    askers = (0,) if honest_holder else (0, 2)
    for i in askers:
        result = results[i]
        assert result is not None
        assert peers[i][1].statistics().relays_refused == 1  # refused, then never asked again
        if honest_holder:
            assert result.outcome.complete and result.relayed == {peers[3][0].peer_id: 3}
            assert np.array_equal(vectors[i], vectors[2])  # the honest holder's copy
        else:
            assert result.outcome.unaveraged() == [(lo, hi)]
            assert np.array_equal(vectors[i][lo:hi], own[i][lo:hi])  # its own values, never the forgery
    if not honest_holder:
        assert np.array_equal(vectors[0][:lo], vectors[2][:lo])


def test_the_aggregators_signature_binds_run_step_round_group_part_and_payload() -> None:
    """What a member checks of every averaged part, from whoever it came (the pure rule)."""
    aggregator, stranger = Identity.generate(), Identity.generate()
    payload = np.arange(8, dtype=np.float32).tobytes()
    header = AveragedHeader(
        group_id=b"g", round=3, part_index=1, offset=8, numel=8, codec="none", nbytes=32,
        total_weight=2.0, contributors=2, digest=part_digest(payload), signature=bytes(64),
    )  # fmt: skip
    where = {"run_id": RUN, "aggregator": aggregator.peer_id, "step": 4}
    signed = msgspec.structs.replace(
        header, signature=aggregator.sign(averaged_payload(statement_of(header, **where)))
    )

    def verifies(h: AveragedHeader, **expected: object) -> bool:
        statement = statement_of(h, **(where | expected))  # type: ignore[arg-type]
        return verify_by_peer_id(aggregator.peer_id, h.signature, averaged_payload(statement))

    assert verifies(signed)
    assert not verifies(signed, run_id="other-run")
    assert not verifies(signed, step=3)
    assert not verifies(signed, aggregator=stranger.peer_id)
    for change in (
        {"round": 2},
        {"group_id": b"h"},
        {"part_index": 0},
        {"offset": 0},
        {"total_weight": 3.0},
        {"contributors": 3},
        {"digest": part_digest(payload[:-4] + b"\0\0\0\0")},
        {"signature": stranger.sign(averaged_payload(statement_of(header, **where)))},
    ):
        assert not verifies(msgspec.structs.replace(signed, **change)), change  # type: ignore[arg-type]


async def test_a_member_still_matchmaking_for_the_round_answers_pending(nursery: trio.Nursery) -> None:
    """The churn test's second fork: a member whose pull of a restarted backbone failed at once (its own
    dial back-off) asked the others before one of them had even adopted the plan; that one answered "not
    held", final, then completed the round with the backbone's slice while the asker retried without it.
    A member still matchmaking for a round of that number answers PENDING (ask again), and NOT_FOUND
    only once it is not."""
    (asker, _), (late, averager) = await start(nursery, [Recording, Recording])
    request = encode_header(RelayRequest(group_id=b"g" * 32, round=7, aggregator=2, part_index=0))
    address = parse_multiaddr(late.listen_addrs[0]).with_peer(late.peer_id)

    async def ask() -> ErrorCode:
        def sink(meta: bytes, nbytes: int) -> memoryview:
            raise AssertionError("nothing is held, so nothing may be sent")

        with pytest.raises(RemoteError) as refused:
            await asker.send_bulk(address, RELAY, b"", request, sink=sink)
        return refused.value.code

    with averager.joining(7):
        assert await ask() == ErrorCode.PENDING
        with averager.joining(7):  # nested (a retry while the first attempt still runs): still joining
            pass
        assert await ask() == ErrorCode.PENDING
    assert await ask() == ErrorCode.NOT_FOUND
    with averager.joining(8):  # another round number is no reason to wait
        assert await ask() == ErrorCode.NOT_FOUND
