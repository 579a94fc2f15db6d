"""Matchmaking through the DHT: who averages together this round, and with which plan (DESIGN §2).

For round ``r`` and group key ``g`` (see :mod:`.groups`) the key is ``<prefix>.<r>.<g>``:

1. a peer first looks at ``<key>.plan``: if a plan is already there whose writer leads the members it
   lists, all of them with tickets under the key (at least two), and this peer is not among them, the
   group has formed without this peer, and it does not join (its late ticket would only make members that
   saw it refuse the plan, rule 4 below). A plan stored before any honest ticket cannot pass this test, so
   nobody can keep peers out of a round by writing plans ahead of it; a plan naming this peer is its own
   failed earlier attempt under the same key, and it joins again;
2. every peer that wants to average stores its signed :class:`JoinTicket` under the key (subkey = its peer
   id, so nobody can write another's ticket), then waits ``window`` seconds;
3. every peer reads the key (merging all replicas). The members are the tickets present, ordered by peer
   id; the **leader** is :func:`.groups.leader_of` of those members (a hash of key and peer id: nobody
   declares itself leader). The leader solves the adaptive-averaging LP for exactly those members from
   their tickets and stores the :class:`GroupAssembly` under ``<key>.plan`` with *its own peer id as
   subkey* (so no other writer can replace it; the newest-record-wins rule applies per writer only);
4. every other member (a *follower*) polls ``<key>.plan`` and adopts a plan only if it passes every rule
   below, recomputed by the follower itself from the signed tickets; otherwise the plan is refused, logged
   and counted (``plans_refused``), and the follower waits for another or sits the round out.

**Acceptance rules** (issue 9 finding 5). A plan stored under subkey ``W`` is adopted only if:

* its record's writer is ``W`` and ``W`` is ``leader_of(key, plan members)``;
* ``group_id`` is :func:`group_id` of the key and the plan's ``tickets`` (one per member), and ``round``
  and ``codec`` are this round's and the run's;
* its members are unique, sorted, and a **superset of every ticket the follower read** (a leader cannot
  leave out peers to shrink the group; the follower itself is in it); a member whose ticket the follower has
  not read is looked up again, and a member without a signed ticket refuses the plan;
* each member's ``addr``, ``norm``, ``overflow`` and ``aux`` claims are its ticket's, and the weights are
  exactly :func:`.groups.bound_weights` of the tickets' claims (the 8x-median and ``max_weight`` caps);
* the slices match the follower's own LP solution for the same members and tickets within
  :data:`SLICE_TOLERANCE` of the vector per member (the LP is deterministic; the tolerance covers other
  solver builds), sum to the vector's length and give nothing to a peer that cannot accept connections;
  ``part_numel`` is the configured one or :func:`.partition.auto_part_numel` of the plan's slices;
* the deadline is positive and at most :data:`.groups.DEADLINE_SLACK` times the deadline the follower
  computes from its own LP prediction and its own measured round times.

Because the plan is the leader's, members that read slightly different ticket sets still run one
consistent plan; a late ticket (stored after the leader read the key) merely misses the round, and a
follower that read one refuses the plan (the round fails for the group and is retried with a new key).
A group of fewer than two computing (non-``aux``) peers does not average.

**Auxiliary aggregators** (issue 14; seed 000 §3.2). A ticket with ``aux`` is a peer that computes
nothing (weight, norm and samples/s 0) and receives no average but its own slice's: the LP sees it with no
compute, so it only aggregates, in proportion to its bandwidth (a client-mode computing peer sends every
part and receives every average; an aux peer takes ``k x_j`` each way, :mod:`.load_balance`). Tickets state
the vector's length (``numel``): a ticket whose stated length is not ours is ignored (another model), so
a follower's plan check and the leader's solve see the same members. An aux peer states none; it joins
with :meth:`Matchmaker.assemble_auxiliary`, which adopts the length that at least two computing members'
tickets state (never one stranger's claim) and at most ``max_numel``, before anything is sized by it.

**Which key an attempt uses** (:mod:`.attempts`). A member's keys of a step only move forward, one by
one: after an attempt it stays at the key only if it read no other peer's ticket there
(:attr:`Matchmaker.alone`; while alone it lingers with the same ticket, ``linger``), and otherwise moves
on to the next. Keys are no longer reused by a cycle of attempts, but the two rules below still matter: a
member that comes to a key after a round ran there (late, or behind the others) finds that round's plan
and tickets, and one that stays at a key after lingering stores a new ticket beside plans made from its
old one.

**Stale plans.** A key's stored plan may be an earlier round's (see above; before keys only moved
forward, a member came back to a finished round's key after its last attempt). A member whose own
earlier ticket a stored plan names joins again (rule 1) but never adopts that very record: its round
already ran for the others (its aggregators may even still serve their averages of it), and joining it
alone would average our own slice with nobody and fork the step (seen in the churn test when a restarted
backbone aggregated: one member failed the backbone's slice, the others had stepped). The leader's new
plan is a new record (a new expiry and signature), adopted as usual.

**Stale tickets and group ids.** Coming to such a key also finds the earlier round's *tickets* under it,
alive for minutes: members that finished that round stepped and moved on, but their tickets still name
them. Counted as members, they made a group of one live peer and several absent ones; with no slices of
their own (client mode) the absent members only "left", the round completed with the live peer's gradient
alone, and it stepped a fork (seen in the churn test: a member failed the restarting backbone's slice at
once, cycled back to the first key and joined the others' finished tickets). And because the group id was
the key's, the backbone, a member of both rounds, could serve the earlier round's averages to the later
one. So:

* a plan lists, per member, a digest of the ticket record it was made from (``tickets``: 16 bytes of
  SHA-256 of the record's signature), and its ``group_id`` is SHA-256 of the key and those digests: two
  plans under one key never share a group id, so nothing of one round (duties, held averages, relays,
  receipts, all keyed by group id and round) is ever served to another;
* a ticket is *consumed* once a plausible plan under the key (stored under its writer's subkey, the writer
  ``leader_of`` its members) lists its digest at its writer's position, unless that plan also lists *our*
  current ticket (then it is the plan of the round we are forming, not an earlier one). Consumed tickets
  are not members: a peer that wants to average again under the key stores a new ticket (a new signature),
  which no earlier plan lists. Every reader applies the rule to the records it read, so readers of the
  same records agree; one that missed the earlier plan counts the stale ticket, refuses a plan without it
  (rule 3) and the group retries: a lost attempt, never a fork. A leader that lies in ``tickets`` can only
  drop peers from its own round, which it could always refuse to plan for.

**Departures before the plan** (issue 10). A follower waiting for the plan pings the leader every
:data:`LEADER_PROBE_PERIOD`; a leader that cannot be reached (a refused dial or reset connection: it died)
or does not answer within :data:`.deadlines.FLOOR` (it hangs) ends the wait after one last read of the
plan (it may have stored one just before it died), so the caller retries under its next key instead of
waiting ``plan_wait``. A member other than the leader that dies after its ticket was read is in the
plan; the all-reduce notices it from its connections or its stall (:mod:`.allreduce`, "Departures") and
the round fails fast, naming it. Fault point: ``matchmaking.joined`` (after our ticket is stored, before
the plan).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import trio

from protocols.averaging import MAX_WEIGHT, AssemblyMember, CodecName, GroupAssembly, JoinTicket
from protocols.dht import PingRequest
from protocols.errors import DECODE_FAILURES
from protocols.peer_id import PeerId
from protocols.training import AveragingSpec

from .. import faults
from ..dht.node import DHTNode
from ..errors import ConfigError
from ..net.addresses import PeerAddress, parse_multiaddr
from ..net.host import CALL_FAILURES
from .allreduce import GroupPlan, Member
from .deadlines import FLOOR
from .groups import adaptive_deadline, bound_weights, deadline_acceptable, leader_of
from .load_balance import PeerSpec, plan_averaging
from .partition import auto_part_numel

__all__ = [
    "SLICE_TOLERANCE",
    "Matchmaker",
    "MatchmakingConfig",
    "PlanRefused",
    "agreed_numel",
    "group_id",
    "ticket_digest",
]

logger = logging.getLogger(__name__)
_TICKET = msgspec.msgpack.Decoder(JoinTicket)
_ASSEMBLY = msgspec.msgpack.Decoder(GroupAssembly)
#: How far (as a share of the vector) a member's slice may differ from the follower's own LP solution.
SLICE_TOLERANCE = 0.05
#: Seconds between a follower's pings of the leader while it waits for the plan.
LEADER_PROBE_PERIOD = 0.25
#: Seconds between an auxiliary aggregator's looks for the first other ticket of a round it joined.
AUX_POLL_PERIOD = 0.2
#: An auxiliary ticket lives ``window + plan_wait`` plus this many seconds past its last renewal.
AUX_TICKET_MARGIN = 5.0


class PlanRefused(ValueError):
    """A plan broke an acceptance rule (module docstring); the message says which."""


@dataclass(frozen=True)
class MatchmakingConfig:
    window: float = 2.0  # seconds between publishing a ticket and reading the others
    plan_wait: float = 10.0  # how long members wait for the leader's plan
    codec: CodecName = "none"
    part_numel: int = 0  # 0: chosen from the plan's slices (auto_part_numel)
    max_weight: float = MAX_WEIGHT  # no member weighs more (the run's target batch + one micro-batch)
    #: seconds a member that found no other peer's ticket under its key waits there with the same ticket
    #: for one to appear (:mod:`.attempts`, "Lingering"); 0: it returns at once
    linger: float = 0.0
    averaging: AveragingSpec = field(default_factory=AveragingSpec)  # from our own manifest


@dataclass
class Matchmaker:
    dht: DHTNode
    prefix: str = "avg"
    config: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    observed_ratios: list[float] = field(default_factory=list)  # measured / predicted round times
    plans_refused: int = 0
    tickets_ignored: int = 0  # tickets dropped as malformed, unusable, or for another vector length
    #: the members of the last plan we adopted and the throughput their signed tickets claim (identical on
    #: every member: the next step's shares of the target batch, shared.progress.quotas); empty if unknown
    last_rates: dict[str, float] = field(default_factory=dict)
    #: the last attempt's read of its key showed fewer than two computing tickets, ours included, consumed
    #: or not (also while it lingered): the next attempt stays at that key (:mod:`.attempts`, rule 2)
    alone: bool = False

    def record_round(self, predicted: float, measured: float) -> None:
        """Feed a finished round's timing back into the deadlines of the next ones."""
        if predicted > 0:
            self.observed_ratios = [*self.observed_ratios[-31:], measured / predicted]

    async def assemble(
        self, round_: int, ticket: JoinTicket, numel: int, group_key: str = ""
    ) -> GroupPlan | None:
        """Find this round's group and its plan; ``None`` if there is nobody to average with, the group
        formed without us, or no acceptable plan arrived in time.

        Raises:
            ValueError: the LP has no solution for the members' capabilities (the leader; every member
                when all the tickets it read, once more a window later for a late auxiliary aggregator, are
                from client-mode peers: nobody can aggregate, and waiting for a plan that cannot come would
                only hold the round).
        """
        key = f"{self.prefix}.{round_}.{group_key}"
        me = self.dht.host.peer_id
        self.alone = False
        stale: set[bytes] = set()
        if await self._formed(key, me, stale):
            logger.info("round %d: the group under %s already formed; not joining it", round_, key)
            return None
        expiry = time.time() + self.config.window + self.config.plan_wait + self.config.linger + 600
        await self.dht.store(key, msgspec.msgpack.encode(ticket), expiry, subkey=me.encode())
        mine = self._own_signature(key)
        await faults.point("matchmaking.joined")
        await trio.sleep(self.config.window)
        signed = await self._signed_tickets(key, numel)
        if _computing(signed, me) == 0 and await self._linger(key, numel):
            await trio.sleep(self.config.window)  # as after our own ticket: the others' come in meanwhile
            signed = await self._signed_tickets(key, numel)
        self.alone = _computing(signed, me) == 0
        signed[me] = (ticket, mine)  # our own store may not be readable yet; we certainly joined
        return await self._form(
            round_, key, await self._unconsumed(round_, key, signed), numel, expiry, stale
        )

    async def assemble_auxiliary(
        self,
        round_: int,
        ticket: JoinTicket,
        group_key: str,
        max_numel: int,
        stop_waiting: Callable[[], Awaitable[None]] | None = None,
        rejoin: bool = False,
    ) -> GroupPlan | None:
        """Join a round as an auxiliary aggregator (module docstring): store ``ticket`` (``aux``), wait
        until a computing peer's ticket is there (or ``stop_waiting`` returns, e.g. once the collaboration
        moved past the round; ``None``: wait as long as it takes), then, one window later, read the group
        and its plan as :meth:`assemble` does, with the vector length its computing members agree on.
        With ``rejoin`` (we joined this key before: the computing peers retry the step under it), only a
        ticket stored after ours counts: the ones already there are the earlier attempt's.

        Returns ``None`` without a group, an agreed length of at most ``max_numel`` elements, or a plan.

        Raises:
            ValueError: ``ticket`` is not auxiliary, or the LP has no solution (leader only).
        """
        if not ticket.aux:
            raise ValueError("assemble_auxiliary takes an auxiliary ticket")
        key = f"{self.prefix}.{round_}.{group_key}"
        me = self.dht.host.peer_id
        self.alone = False
        stale: set[bytes] = set()
        if await self._formed(key, me, stale):
            return None
        # A short lease, renewed while we wait: the ticket of an aggregator that died (a backbone lost for
        # good) must not name it in every later attempt under this key: the computing peers cycle back to
        # it, and a plan giving a dead member a slice fails for the whole group (seen in the soak test).
        lease = self.config.window + self.config.plan_wait + AUX_TICKET_MARGIN
        expiry = time.time() + lease
        earlier = {sig for _, sig in (await self._signed_tickets(key)).values()} if rejoin else set()
        await self.dht.store(key, msgspec.msgpack.encode(ticket), expiry, subkey=me.encode())
        async with trio.open_nursery() as nursery:

            async def arrived() -> None:
                nonlocal expiry
                renew_at = time.time() + lease / 3
                while True:
                    found = await self._signed_tickets(key)
                    if any(p != me and not t.aux and s not in earlier for p, (t, s) in found.items()):
                        break
                    if time.time() >= renew_at:
                        expiry, renew_at = time.time() + lease, time.time() + lease / 3
                        await self.dht.store(key, msgspec.msgpack.encode(ticket), expiry, subkey=me.encode())
                    await trio.sleep(AUX_POLL_PERIOD)
                nursery.cancel_scope.cancel()

            async def gave_up() -> None:
                if stop_waiting is not None:
                    await stop_waiting()
                else:
                    await trio.sleep_forever()
                found.append(False)
                nursery.cancel_scope.cancel()

            found: list[bool] = []
            nursery.start_soon(arrived)
            nursery.start_soon(gave_up)
        if found:  # no (new) computing ticket came before the step moved on
            self.alone = True
            return None
        expiry = time.time() + lease  # the round forms now: a full lease for it
        await self.dht.store(key, msgspec.msgpack.encode(ticket), expiry, subkey=me.encode())
        mine = self._own_signature(key)
        await trio.sleep(self.config.window)
        signed = await self._signed_tickets(key)
        self.alone = _computing(signed, me) < 2  # we stay for a second computing member (attempts, rule 2)
        signed[me] = (ticket, mine)
        everyone = {p: t for p, (t, _) in (await self._unconsumed(round_, key, signed)).items()}
        numel = agreed_numel(everyone.values())
        if numel is None:
            logger.info("round %d: no vector length stated by two computing peers; not joining", round_)
            return None
        if numel > max_numel:
            logger.warning(
                "round %d: the group averages %d elements, more than the %d this aggregator takes",
                round_,
                numel,
                max_numel,
            )
            return None
        kept = {p: signed[p] for p, t in everyone.items() if t.numel in (0, numel)}
        return await self._form(round_, key, kept, numel, expiry, stale)

    async def _linger(self, key: str, numel: int) -> bool:
        """Wait up to ``linger`` seconds for another peer's ticket under ``key`` (ours stays as it is:
        :mod:`.attempts`, "Lingering"); True once one is there."""
        me = self.dht.host.peer_id
        with trio.move_on_after(self.config.linger):
            while True:
                if _computing(await self._signed_tickets(key, numel), me):
                    return True
                await trio.sleep(AUX_POLL_PERIOD)
        return False

    async def _form(
        self,
        round_: int,
        key: str,
        signed: dict[PeerId, tuple[JoinTicket, bytes]],
        numel: int,
        expiry: float,
        stale: set[bytes],
    ) -> GroupPlan | None:
        """Steps 3 and 4 of the module docstring, from the unconsumed tickets (with their records'
        signatures) read one window after ours; ``stale``: signatures of plan records that named us before
        we joined (never adopted)."""
        me = self.dht.host.peer_id
        tickets = {p: t for p, (t, _) in signed.items()}
        if sum(1 for t in tickets.values() if not t.aux) < 2:
            return None
        if all(t.client_mode for t in tickets.values()):
            # an auxiliary aggregator joins once it sees a computing ticket: give it one more window
            await trio.sleep(self.config.window)
            again = await self._unconsumed(
                round_, key, {**await self._signed_tickets(key, numel), me: signed[me]}
            )
            signed, tickets = again, {p: t for p, (t, _) in again.items()}
            if all(t.client_mode for t in tickets.values()):
                raise ValueError(f"all {len(tickets)} peers are in client mode: nobody can aggregate")
        leader = leader_of(key, tickets)
        if leader == me:
            members = sorted(tickets)
            digests = [ticket_digest(signed[m][1]) for m in members]
            assembly = self._solve(round_, key, members, tickets, numel, digests)
            await self.dht.store(f"{key}.plan", msgspec.msgpack.encode(assembly), expiry, subkey=me.encode())
        else:
            found = await self._await_plan(round_, key, tickets, numel, stale)
            if found is None:
                logger.warning("round %d: no acceptable plan (leader %s) in time", round_, leader)
                return None
            assembly = found
        if me not in [m.peer_id for m in assembly.members]:
            logger.info("round %d: the leader's plan leaves us out; sitting this round out", round_)
            return None
        known = {m.peer_id: tickets[PeerId(m.peer_id)] for m in assembly.members if m.peer_id in tickets}
        self.last_rates = (
            {peer: t.samples_per_second for peer, t in known.items() if not t.aux}  # aux: no compute
            if len(known) == len(assembly.members)
            else {}
        )
        return _to_plan(assembly, self.config.averaging)

    async def _formed(self, key: str, me: PeerId, stale: set[bytes]) -> bool:
        """Rule 1 of the module docstring: a plausible plan that leaves us out is already stored under
        ``<key>.plan``. A plan naming us is stale (a failed earlier attempt of ours at this step, under the
        same key): we join, and the leader's new plan replaces it; the stale record's signature goes into
        ``stale``, so that we never adopt it (its round already ran: module docstring, "Stale plans")."""
        found = await self.dht.get(f"{key}.plan")
        if found is None or not found.entries:
            return False
        tickets = await self._tickets(key)
        for subkey, record in found.entries.items():
            try:
                members = [m.peer_id for m in _ASSEMBLY.decode(record.value).members]
            except DECODE_FAILURES:
                continue
            if me in members:
                stale.add(record.signature)
            if (
                subkey == record.writer.encode()
                and me not in members
                and len(members) >= 2
                and all(m in tickets for m in members)
                and record.writer == leader_of(key, members)
            ):
                return True
        return False

    def _own_signature(self, key: str) -> bytes:
        """The signature of the ticket we just stored under ``key``."""
        record = self.dht.own_record(key, self.dht.host.peer_id.encode())
        assert record is not None, "a ticket we stored is ours until it expires"
        return record.signature

    async def _unconsumed(
        self, round_: int, key: str, signed: dict[PeerId, tuple[JoinTicket, bytes]]
    ) -> dict[PeerId, tuple[JoinTicket, bytes]]:
        """``signed`` without the tickets an earlier plan under ``key`` was made from (module docstring,
        "Stale tickets and group ids"); ours is never dropped (we just stored it)."""
        me = self.dht.host.peer_id
        mine = ticket_digest(signed[me][1])
        found = await self.dht.get(f"{key}.plan", latest=True)
        used: dict[PeerId, set[bytes]] = {}
        for subkey, record in found.entries.items() if found is not None else ():
            try:
                assembly = _ASSEMBLY.decode(record.value)
            except DECODE_FAILURES:
                continue
            names = [m.peer_id for m in assembly.members]
            if (
                subkey != record.writer.encode()
                or record.writer != leader_of(key, names)
                or len(assembly.tickets) != len(names)
                or mine in assembly.tickets  # the plan of the round we are forming
            ):
                continue
            for name, digest in zip(names, assembly.tickets, strict=True):
                used.setdefault(PeerId(name), set()).add(digest)
        kept = {
            p: (t, sig)
            for p, (t, sig) in signed.items()
            if p == me or ticket_digest(sig) not in used.get(p, ())
        }
        if len(kept) < len(signed):
            logger.info(
                "round %d: %d ticket(s) under %s were an earlier plan's; not counting them",
                round_,
                len(signed) - len(kept),
                key,
            )
        return kept

    async def _tickets(self, key: str, numel: int | None = None) -> dict[PeerId, JoinTicket]:
        """The signed tickets under ``key``; with ``numel``, only those stating no length or that one."""
        return {peer: ticket for peer, (ticket, _) in (await self._signed_tickets(key, numel)).items()}

    async def _signed_tickets(
        self, key: str, numel: int | None = None
    ) -> dict[PeerId, tuple[JoinTicket, bytes]]:
        """:meth:`_tickets` with each record's signature (which tells two stores of one ticket apart)."""
        found = await self.dht.get(key, latest=True)
        tickets: dict[PeerId, tuple[JoinTicket, bytes]] = {}
        for subkey, record in found.entries.items() if found is not None else ():
            try:
                ticket = _TICKET.decode(record.value)
            except DECODE_FAILURES:  # includes validation errors
                logger.debug("ignoring a malformed ticket from %s", record.writer)
                self.tickets_ignored += 1
                continue
            if subkey != record.writer.encode():
                continue
            if numel is not None and ticket.numel not in (0, numel):
                logger.info(
                    "ignoring the ticket of %s: it averages %d elements, not %d",
                    record.writer,
                    ticket.numel,
                    numel,
                )
                self.tickets_ignored += 1
                continue
            try:
                if ticket.addr is not None:
                    parse_multiaddr(ticket.addr)
            except ConfigError:
                logger.info("ignoring the ticket of %s: unusable address %r", record.writer, ticket.addr)
                self.tickets_ignored += 1
                continue
            tickets[PeerId(record.writer)] = (ticket, record.signature)
        return tickets

    def _solve(
        self,
        round_: int,
        key: str,
        members: Sequence[PeerId],
        tickets: dict[PeerId, JoinTicket],
        numel: int,
        digests: Sequence[bytes] = (),
    ) -> GroupAssembly:
        """The leader's plan for ``members`` (``digests``: of the ticket records read, one per member)."""
        weights = bound_weights([tickets[m].weight for m in members], self.config.max_weight)
        aux = [tickets[m].aux for m in members]
        specs = member_specs(members, tickets)
        if not any(s.samples_per_second > 0 for s in specs):  # nobody measured compute yet: weights say
            specs = [
                dataclasses.replace(s, samples_per_second=0.0 if a else max(w, 1.0))
                for w, a, s in zip(weights, aux, specs, strict=True)
            ]
        # no time budget: every member recomputes this plan from the same tickets and refuses one whose
        # slices differ from its own, so the search must not depend on how fast each machine is (without
        # pairwise caps it is proven optimal within milliseconds anyway: scripts/bench_lp.py)
        plan = plan_averaging(specs, max(1.0, sum(weights)), 4.0 * numel, numel=numel, time_limit=None)
        deadline = adaptive_deadline(plan.averaging_seconds, self.observed_ratios)
        return GroupAssembly(
            group_id=group_id(key, digests),
            round=round_,
            members=[
                AssemblyMember(m, tickets[m].addr, w, tickets[m].norm, tickets[m].overflow, tickets[m].aux)
                for m, w in zip(members, weights, strict=True)
            ],
            slice_sizes=list(plan.slices),
            codec=self.config.codec,
            part_numel=self.config.part_numel or auto_part_numel(plan.slices),
            deadline=deadline,
            predicted_seconds=plan.averaging_seconds,
            tickets=list(digests),
        )

    async def _await_plan(
        self,
        round_: int,
        key: str,
        tickets: dict[PeerId, JoinTicket],
        numel: int,
        stale: Container[bytes] = frozenset(),
    ) -> GroupAssembly | None:
        leader = PeerId(leader_of(key, tickets))
        judged: dict[tuple[str, bytes], GroupAssembly | None] = {}  # (writer, value) -> verdict
        found: list[GroupAssembly | None] = []
        gone: list[str] = []
        async with trio.open_nursery() as nursery:

            async def poll() -> None:
                with trio.move_on_after(self.config.plan_wait):
                    while True:  # polled: the plan arrives through the DHT, not as an event
                        if (
                            plan := await self._read_plan(round_, key, tickets, numel, judged, stale)
                        ) is not None:
                            found.append(plan)
                            break
                        await trio.sleep(0.05)
                nursery.cancel_scope.cancel()

            async def probe(address: PeerAddress) -> None:
                gone.append(await self._unreachable(address))
                nursery.cancel_scope.cancel()

            nursery.start_soon(poll)
            addr = tickets[leader].addr
            if addr is not None:
                nursery.start_soon(probe, parse_multiaddr(addr).with_peer(leader))
        if not found and gone:  # it may have stored the plan just before it died: one last look
            found.append(await self._read_plan(round_, key, tickets, numel, judged, stale))
            if found[0] is None:
                logger.warning(
                    "round %d: the leader %s is gone (%s); not waiting for its plan", round_, leader, gone[0]
                )
        return found[0] if found else None

    async def _unreachable(self, address: PeerAddress) -> str:
        """Return why, once the peer at ``address`` is no longer reachable (never, while it answers).

        A refused or broken connection is a departure at once; a ping that merely takes longer than
        :data:`~.deadlines.FLOOR` counts only the second time in a row (one slow answer on a loaded
        machine must not make a follower drop a live leader, failing the attempt for the whole group)."""
        slow = 0
        while True:
            await trio.sleep(LEADER_PROBE_PERIOD)
            try:
                with trio.fail_after(FLOOR):
                    channel = await self.dht.host.channel_to(address)
                    await channel.call(PingRequest())
            except trio.TooSlowError:
                slow += 1
                if slow >= 2:
                    return f"no answer to two pings of {FLOOR:g} s each"
            except CALL_FAILURES as exc:
                return str(exc) or type(exc).__name__
            else:
                slow = 0

    async def _read_plan(
        self,
        round_: int,
        key: str,
        tickets: dict[PeerId, JoinTicket],
        numel: int,
        judged: dict[tuple[str, bytes], GroupAssembly | None],
        stale: Container[bytes] = frozenset(),
    ) -> GroupAssembly | None:
        """The acceptable plan stored under ``<key>.plan`` now, if any (``judged`` caches verdicts), never
        a ``stale`` record (by signature)."""
        found = await self.dht.get(f"{key}.plan", latest=True)
        accepted: list[tuple[str, GroupAssembly]] = []
        for subkey, record in found.entries.items() if found is not None else ():
            verdict_key = (record.writer, record.value)
            if verdict_key not in judged:  # a stale record is judged too: a forgery is counted as refused
                judged[verdict_key] = await self._judge(
                    round_, key, subkey, record.writer, record.value, tickets, numel
                )
            if (assembly := judged[verdict_key]) is not None and record.signature not in stale:
                accepted.append((record.writer, assembly))
        if accepted:  # several acceptable plans: the one whose writer ``leader_of`` ranks first
            ranked = leader_of(key, [w for w, _ in accepted])
            return next(a for w, a in accepted if w == ranked)
        return None

    async def _judge(
        self,
        round_: int,
        key: str,
        subkey: bytes,
        writer: str,
        value: bytes,
        tickets: dict[PeerId, JoinTicket],
        numel: int,
    ) -> GroupAssembly | None:
        try:
            if subkey != writer.encode():
                raise PlanRefused("stored under another peer's subkey")
            try:
                assembly = _ASSEMBLY.decode(value)
            except DECODE_FAILURES as exc:
                raise PlanRefused(f"malformed: {exc}") from exc
            known = dict(tickets)
            if any(PeerId(m.peer_id) not in known for m in assembly.members):  # not read yet: read again
                known = {**await self._tickets(key, numel), **tickets}
            self.check_plan(round_, key, writer, assembly, set(tickets), known, numel)
        except PlanRefused as exc:
            self.plans_refused += 1
            logger.warning("round %d: refusing the plan of %s under %s: %s", round_, writer, key, exc)
            return None
        return assembly

    def check_plan(
        self,
        round_: int,
        key: str,
        writer: str,
        assembly: GroupAssembly,
        seen: set[PeerId],
        tickets: dict[PeerId, JoinTicket],
        numel: int,
    ) -> None:
        """Apply the acceptance rules of the module docstring to ``writer``'s ``assembly``: ``seen`` are
        the peers whose tickets this follower read before the plan (itself included), ``tickets`` every
        signed ticket it knows.

        Raises:
            PlanRefused: a rule is broken (the message names it).
        """
        names = [PeerId(m.peer_id) for m in assembly.members]
        if writer != leader_of(key, names):
            raise PlanRefused(f"{writer} is not the leader of the members it lists")
        if len(assembly.tickets) != len(names) or assembly.group_id != group_id(key, assembly.tickets):
            raise PlanRefused("group id is not derived from the key and one ticket digest per member")
        if (assembly.round, assembly.codec) != (round_, self.config.codec):
            raise PlanRefused("round or codec is not this group's")
        if names != sorted(set(names)):
            raise PlanRefused("members are not unique and sorted")
        if missing := seen - set(names):
            raise PlanRefused(f"leaves out {len(missing)} peer(s) whose tickets we read")
        if unknown := [n for n in names if n not in tickets]:
            raise PlanRefused(f"names {len(unknown)} peer(s) without a ticket")
        for member in assembly.members:
            ticket = tickets[PeerId(member.peer_id)]
            claims = (ticket.addr, ticket.norm, ticket.overflow, ticket.aux)
            if (member.addr, member.norm, member.overflow, member.aux) != claims:
                raise PlanRefused(
                    f"address, norm, overflow or aux claim of {member.peer_id} is not its ticket's"
                )
        try:
            own = self._solve(round_, key, names, tickets, numel)
        except ValueError as exc:
            raise PlanRefused(f"its members' tickets have no LP solution: {exc}") from exc
        if [m.weight for m in assembly.members] != [m.weight for m in own.members]:
            raise PlanRefused("weights are not the members' bounded ticket claims")
        slices = assembly.slice_sizes
        if len(slices) != len(names) or sum(slices) != numel:
            raise PlanRefused(f"slices do not tile the {numel}-element vector")
        for member, size, expected in zip(assembly.members, slices, own.slice_sizes, strict=True):
            if size and member.addr is None:
                raise PlanRefused(f"gives a slice to {member.peer_id}, which accepts no connections")
            if abs(size - expected) > SLICE_TOLERANCE * numel + 1:
                raise PlanRefused(f"slice of {member.peer_id} is {size}, the LP gives {expected}")
        if assembly.part_numel != (self.config.part_numel or auto_part_numel(slices)):
            raise PlanRefused(f"part size {assembly.part_numel} is not the run's")
        if not deadline_acceptable(assembly.deadline, own.deadline):
            raise PlanRefused(
                f"deadline {assembly.deadline:.1f} s exceeds the bound from {own.deadline:.1f} s"
            )


def _computing(signed: Mapping[PeerId, tuple[JoinTicket, bytes]], me: PeerId) -> int:
    """How many computing (non-``aux``) tickets of peers other than ``me`` a read found, consumed or not
    (:mod:`.attempts`, rule 2)."""
    return sum(1 for peer, (ticket, _) in signed.items() if peer != me and not ticket.aux)


def agreed_numel(tickets: Iterable[JoinTicket]) -> int | None:
    """The vector length an auxiliary aggregator adopts from a group's tickets: the one most computing
    (non-``aux``) tickets state, if at least two state it and no other length is stated as often;
    ``None`` otherwise (module docstring, "Auxiliary aggregators")."""
    counts = Counter(t.numel for t in tickets if not t.aux and t.numel > 0)
    ranked = counts.most_common(2)
    if not ranked or ranked[0][1] < 2 or (len(ranked) > 1 and ranked[1][1] == ranked[0][1]):
        return None
    return ranked[0][0]


def ticket_digest(signature: bytes) -> bytes:
    """What a plan lists of a member's ticket record (module docstring, "Stale tickets and group ids")."""
    return hashlib.sha256(signature).digest()[:16]


def group_id(key: str, digests: Iterable[bytes]) -> bytes:
    """A plan's group id: SHA-256 of its key and its members' ticket digests (32 bytes; never shared by
    two plans, since a later plan under a key is made from at least one new ticket)."""
    h = hashlib.sha256(key.encode())
    for digest in digests:
        h.update(len(digest).to_bytes(1, "big") + digest)
    return h.digest()


def _to_plan(assembly: GroupAssembly, averaging: AveragingSpec) -> GroupPlan:
    members = tuple(
        Member(
            PeerId(m.peer_id),
            parse_multiaddr(m.addr).with_peer(PeerId(m.peer_id)) if m.addr else None,
            m.weight,
            m.norm,
            m.overflow,
            m.aux,
        )
        for m in assembly.members
    )
    return GroupPlan(
        assembly.group_id,
        assembly.round,
        members,
        tuple(assembly.slice_sizes),
        assembly.deadline,
        codec=assembly.codec,
        part_numel=assembly.part_numel,
        predicted_seconds=assembly.predicted_seconds,
        averaging=averaging,
    )


def member_specs(members: Sequence[PeerId], tickets: Mapping[PeerId, JoinTicket]) -> list[PeerSpec]:
    """The LP's view of each member, from its ticket alone (so every member computes the same plan).

    A member whose address is relayed (``…/p2p/<relay>/p2p-circuit/p2p/<member>``) through another member
    that is itself directly reachable is planned as relayed by it (its slice's traffic loads the relay,
    :mod:`.load_balance`, "Relays"). Through a relay outside the group, or one that is itself relayed or
    in client mode, it is planned as a client-mode member: no slice, since the LP cannot see what the
    relay can carry.
    """
    index = {peer: i for i, peer in enumerate(members)}

    def relay_of(ticket: JoinTicket) -> PeerId | None:
        return None if ticket.client_mode or ticket.addr is None else _relay_of(ticket.addr)

    def direct(peer: PeerId) -> bool:
        ticket = tickets[peer]
        return not ticket.client_mode and ticket.addr is not None and relay_of(ticket) is None

    specs = []
    for m in members:
        t = tickets[m]
        through = relay_of(t)
        relay: int | None = None
        if through is not None and through != m and through in index and direct(through):
            relay = index[through]
        client = t.client_mode or t.addr is None or (through is not None and relay is None)
        specs.append(PeerSpec(t.samples_per_second, t.download_bps, t.upload_bps, client, relay=relay))
    return specs


def _relay_of(addr: str) -> PeerId | None:
    """The relay's peer id in a relayed address; None for a direct (or unparseable) one."""
    try:
        relay = parse_multiaddr(addr).relay
    except ConfigError:
        return None
    return None if relay is None else relay.peer_id
