"""Matchmaking through the DHT: who averages together this round, and with which plan (DESIGN §2).

For round ``r`` and group key ``g`` (see :mod:`.groups`) the key is ``<prefix>.<r>.<g>``:

1. every peer that wants to average stores its signed :class:`JoinTicket` under that key (subkey = its
   peer id, so nobody can write another's ticket), then waits ``window`` seconds;
2. every peer reads the key (merging all replicas): the members are the tickets present, ordered by peer
   id; the **leader** is the first. The leader solves the adaptive-averaging LP for exactly those members
   from their published capabilities and stores the :class:`GroupAssembly` under ``<key>.plan``;
3. the others poll ``<key>.plan`` and accept it only if it is signed by its own first member (the leader
   of the member list it carries) and lists them; a peer the plan leaves out sits this round out.

Because the plan is the leader's, members that read slightly different ticket sets still run one
consistent plan; a late ticket merely misses the round. A group of fewer than two peers does not average.
The round's deadline comes from the LP's predicted averaging time and the measured history
(:func:`.groups.adaptive_deadline`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import trio

from protocols.averaging import AssemblyMember, CodecName, GroupAssembly, JoinTicket
from protocols.peer_id import PeerId

from ..dht.node import DHTNode
from ..net.addresses import parse_multiaddr
from .allreduce import GroupPlan, Member
from .groups import adaptive_deadline
from .load_balance import PeerSpec, plan_averaging
from .partition import auto_part_numel

__all__ = ["Matchmaker", "MatchmakingConfig"]

logger = logging.getLogger(__name__)
_TICKET = msgspec.msgpack.Decoder(JoinTicket)
_ASSEMBLY = msgspec.msgpack.Decoder(GroupAssembly)


@dataclass(frozen=True)
class MatchmakingConfig:
    window: float = 2.0  # seconds between publishing a ticket and reading the others
    plan_wait: float = 10.0  # how long members wait for the leader's plan
    codec: CodecName = "none"
    part_numel: int = 0  # 0: chosen from the plan's slices (auto_part_numel)


@dataclass
class Matchmaker:
    dht: DHTNode
    prefix: str = "avg"
    config: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    observed_ratios: list[float] = field(default_factory=list)  # measured / predicted round times

    def record_round(self, predicted: float, measured: float) -> None:
        """Feed a finished round's timing back into the deadlines of the next ones."""
        if predicted > 0:
            self.observed_ratios = [*self.observed_ratios[-31:], measured / predicted]

    async def assemble(
        self, round_: int, ticket: JoinTicket, numel: int, group_key: str = ""
    ) -> GroupPlan | None:
        """Find this round's group and its plan; ``None`` if there is nobody to average with.

        Raises:
            ValueError: the LP has no solution for the members' capabilities (leader only).
        """
        key = f"{self.prefix}.{round_}.{group_key}"
        me = self.dht.host.peer_id
        expiry = time.time() + self.config.window + self.config.plan_wait + 600
        await self.dht.store(key, msgspec.msgpack.encode(ticket), expiry, subkey=me.encode())
        await trio.sleep(self.config.window)
        tickets = await self._tickets(key)
        if me not in tickets:
            tickets[me] = ticket  # our own store may not be readable yet; we certainly joined
        if len(tickets) < 2:
            return None
        members = sorted(tickets)
        if members[0] == me:
            assembly = self._solve(round_, key, members, tickets, numel)
            await self.dht.store(f"{key}.plan", msgspec.msgpack.encode(assembly), expiry)
        else:
            found = await self._await_plan(f"{key}.plan")
            if found is None:
                logger.warning("round %d: no plan from leader %s in time", round_, members[0])
                return None
            assembly = found
        if me not in [m.peer_id for m in assembly.members]:
            logger.info("round %d: the leader's plan leaves us out; sitting this round out", round_)
            return None
        return _to_plan(assembly)

    async def _tickets(self, key: str) -> dict[PeerId, JoinTicket]:
        found = await self.dht.get(key, latest=True)
        tickets: dict[PeerId, JoinTicket] = {}
        for subkey, record in found.entries.items() if found is not None else ():
            try:
                ticket = _TICKET.decode(record.value)
            except msgspec.DecodeError:  # includes validation errors
                logger.debug("ignoring a malformed ticket from %s", record.writer)
                continue
            if subkey == record.writer.encode():
                tickets[PeerId(record.writer)] = ticket
        return tickets

    def _solve(
        self, round_: int, key: str, members: Sequence[PeerId], tickets: dict[PeerId, JoinTicket], numel: int
    ) -> GroupAssembly:
        specs = [
            PeerSpec(t.samples_per_second, t.download_bps, t.upload_bps, t.client_mode or t.addr is None)
            for t in (tickets[m] for m in members)
        ]
        if not any(s.samples_per_second > 0 for s in specs):  # nobody measured compute yet: weights say
            specs = [
                PeerSpec(max(tickets[m].weight, 1.0), s.download_bps, s.upload_bps, s.client_mode)
                for m, s in zip(members, specs, strict=True)
            ]
        weights = [tickets[m].weight for m in members]
        plan = plan_averaging(specs, max(1.0, sum(weights)), 4.0 * numel, numel=numel)
        deadline = adaptive_deadline(plan.averaging_seconds, self.observed_ratios)
        return GroupAssembly(
            group_id=key.encode()[-32:],
            round=round_,
            members=[AssemblyMember(m, tickets[m].addr, tickets[m].weight) for m in members],
            slice_sizes=list(plan.slices),
            codec=self.config.codec,
            part_numel=self.config.part_numel or auto_part_numel(plan.slices),
            deadline=deadline,
            predicted_seconds=plan.averaging_seconds,
        )

    async def _await_plan(self, key: str) -> GroupAssembly | None:
        with trio.move_on_after(self.config.plan_wait):
            while True:
                found = await self.dht.get(key, latest=True)
                if found is not None and found.plain is not None:
                    try:
                        assembly = _ASSEMBLY.decode(found.plain.value)
                    except msgspec.DecodeError:
                        assembly = None
                    if assembly is not None and assembly.members[0].peer_id == found.plain.writer:
                        return assembly
                    logger.warning("ignoring a plan under %s not written by its leader", key)
                await trio.sleep(0.05)
        return None


def _to_plan(assembly: GroupAssembly) -> GroupPlan:
    members = tuple(
        Member(
            PeerId(m.peer_id),
            parse_multiaddr(m.addr).with_peer(PeerId(m.peer_id)) if m.addr else None,
            m.weight,
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
    )
