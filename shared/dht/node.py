"""``DHTNode``: the Kademlia DHT as a trio service over the engine's RPC (DESIGN D3).

The pure parts live beside this module (routing table, lookup state machine, record store, record
validation); this module only does I/O and time:

* **serving** — PING, FIND_NODE, FIND_VALUE, STORE and LEAVE handlers. Every authenticated request or
  notification the host serves, the DHT's or any other service's (averaging, state transfer, ...),
  teaches us its sender (a proven, admitted peer id plus the addresses it says it listens on), which
  goes into the routing table (§2.2; App. B: contacts are learned from every message). Frames that fail
  authentication teach nothing. A full bucket asks us to ping its least-recently-seen contact; that
  ping runs in our nursery and the stale contact is evicted only if it fails.
* **lookups** — the iterative lookup (§2.3) with ``alpha`` queries in flight. A value lookup stops as
  soon as ``quorum`` nodes returned records (default 1), or runs to convergence with ``latest=True``,
  merging every record seen (newest per subkey wins).
* **admission and quotas** — every record a STORE brings or a lookup returns goes through the node's
  validator (in a pinned run: admitted, unrevoked writer, own subkeys only; see :mod:`.admission`), and
  the store holds each writer to its quota (:mod:`.storage`); refusals are counted
  (:meth:`DHTNode.statistics`) and logged one line per STORE. Records we sign carry our access token
  (``credentials``). :attr:`DHTValue.users` names the user each returned record speaks for, so that
  callers count majorities in users, not peer ids.
* **store** — sign the record, validate it as any receiver would (so a bad expiry fails *here*, with a
  clear message), find the ``num_replicas`` nodes closest to the key (ourselves included) and store on
  all of them in parallel. Our own records are re-published every ``republish_interval`` until expiry.
* **maintenance** — bucket refresh (§2.3: a lookup of a random id in every bucket not touched for
  ``refresh_interval``), expiry of stored records.
* **healing after restarts** — with a ``contacts_path`` (``dht-contacts.json`` in the data dir, see
  :mod:`.contacts`) the routing table's contacts are saved every ``contacts_save_interval`` when they
  changed (never an empty table) and pinged again at start, so a node restarted on its data dir finds
  the network by itself. While the table holds fewer than ``k`` contacts, initial peers missing from it
  or not connected are pinged again every ``rejoin_interval`` (and the saved contacts too while it is
  empty), followed by a lookup of our own id: a backbone that came back with nothing is found again by
  the volunteers that joined through it. A contact that *comes back* (the first authenticated message
  over a new connection from a peer we knew, :mod:`.healing`) is sent the records we hold or own for
  which it is now among the ``num_replicas`` closest, at most once per ``reannounce_interval`` per
  contact, at most ``max_reannounces`` at once, at most ``max_handoff_records`` records each.
* **graceful leave** — on cancellation, hand every record we hold to the closest other node we know for
  its key and tell connected peers we are leaving (LEAVE), all within ``leave_deadline``.

A node with no listen addresses is a *client-mode* node: it can look up and store but is never added to
routing tables (it has nowhere to be dialed).
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from protocols.auth import SignedToken
from protocols.dht import (
    MAX_NODES_PER_REPLY,
    FindNodeRequest,
    FindNodeResponse,
    FindValueRequest,
    FindValueResponse,
    LeaveNotice,
    NodeInfo,
    PingRequest,
    PingResponse,
    SignedRecord,
    StoreRequest,
    StoreResponse,
)
from protocols.envelope import Message, Request
from protocols.peer_id import PeerId

from ..errors import ConfigError, PeerUnavailable, RecordRejected, RemoteError
from ..net.addresses import PeerAddress, parse_multiaddr
from ..net.host import CALL_FAILURES, Host
from ..net.rpc import RequestContext, RpcChannel
from ..tolerated import Tolerated
from .admission import record_user
from .contacts import load_contacts, save_contacts
from .healing import ComebackDetector, ReannounceLimiter, is_replica_for
from .keys import KEY_BITS, id_bytes, key_id, key_int, node_id_of
from .lookup import Lookup
from .records import RecordValidator, default_validator, newer, sign_record
from .routing import Contact, RoutingTable, random_id_in
from .storage import PutResult, RecordStore, StoreLimits, record_cost

__all__ = ["DHTConfig", "DHTNode", "DHTStatistics", "DHTValue"]

logger = logging.getLogger(__name__)
_CALL_ERRORS = CALL_FAILURES
_CAPACITY_REFUSALS = (PutResult.OWNER_QUOTA, PutResult.KEY_FULL, PutResult.STORE_FULL)


@dataclass(frozen=True)
class DHTConfig:
    k: int = 20  # bucket size, and the width of node lookups
    alpha: int = 3  # queries in flight per lookup
    num_replicas: int = 8  # nodes each record is stored on (8 of 32 crashing loses a key with p ~ 1e-7)
    rpc_deadline: float = 3.0  # one DHT request, dial included
    refresh_interval: float = 600.0
    republish_interval: float = 1800.0
    expiry_sweep_interval: float = 60.0
    leave_deadline: float = 2.0
    max_handoff_records: int = 10_000
    contacts_save_interval: float = 2.0  # how often the routing table is saved (only when it changed)
    rejoin_interval: float = 2.0  # initial (or saved) peers missing from a small table are pinged again
    reannounce_interval: float = 30.0  # at most one re-announce to a contact that comes back per this
    max_reannounces: int = 4  # re-announces running at once; contacts coming back beyond it are skipped
    store: StoreLimits = field(default_factory=StoreLimits)  # per-writer quotas and global caps


@dataclass(frozen=True)
class DHTValue:
    """What a key holds: its plain record (if any) and its dictionary entries by subkey."""

    plain: SignedRecord | None
    entries: dict[bytes, SignedRecord]

    @property
    def value(self) -> bytes | None:
        return self.plain.value if self.plain is not None else None

    @functools.cached_property
    def users(self) -> dict[bytes | None, str]:
        """The user each record speaks for, by subkey (``None``: the plain record): in a pinned run the
        admitted username from the writer's verified token, in an open run the writer's peer id. Count
        majorities over these, not over peer ids (one user may hold several peer ids)."""
        records = ([] if self.plain is None else [(None, self.plain)]) + list(self.entries.items())
        return {subkey: record_user(record) for subkey, record in records}


@dataclass(frozen=True)
class DHTStatistics:
    routing_table_size: int
    estimated_network_size: int
    stored_records: int
    own_records: int
    lookups: int
    rpc_failures: int
    rejected_records: int = 0  # refused by the validator (not admitted, revoked, foreign subkey, forged...)
    refused_records: int = 0  # valid, but refused by the store (over quota, store or key full)
    contacts_restored: int = 0  # saved contacts that answered when we started
    comebacks: int = 0  # contacts seen coming back (a new connection from a peer we knew)
    reannounces: int = 0  # re-announces sent to contacts that came back
    reannounced_records: int = 0
    reannounces_skipped: int = 0  # contacts that came back while max_reannounces were running
    tolerated: dict[str, int] = field(default_factory=dict)  # failures survived, by site


class DHTNode:
    """A Kademlia node. Start with ``await nursery.start(node.run, initial_peers)``."""

    def __init__(
        self,
        host: Host,
        config: DHTConfig | None = None,
        *,
        validator: RecordValidator | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        credentials: Callable[[], SignedToken | None] | None = None,
        contacts_path: Path | None = None,
    ) -> None:
        self.host = host
        self.config = config or DHTConfig()
        self.validator = validator or default_validator()
        self._clock = clock
        self._rng = rng or random.Random()
        self.node_id = node_id_of(host.peer_id)
        self.routing = RoutingTable(self.node_id, k=self.config.k)
        self.storage = RecordStore(self.config.store)
        self._credentials = credentials or (lambda: None)
        self._rejected = 0
        self._own: dict[tuple[bytes, bytes | None], SignedRecord] = {}
        self._pinging: set[int] = set()
        self._nursery: trio.Nursery | None = None
        self._lookups = 0
        self._rpc_failures = 0
        self.contacts_path = contacts_path
        self.tolerated = Tolerated(logger)
        self._initial: list[PeerAddress] = []
        self._initial_ids: dict[PeerAddress, PeerId] = {}
        self._saved: list[Contact] = []
        self._restored = 0
        self._comebacks = ComebackDetector()
        self._reannounce_limiter = ReannounceLimiter(self.config.reannounce_interval)
        self._reannouncing = 0
        self._counts = {"comebacks": 0, "reannounces": 0, "reannounced_records": 0, "reannounces_skipped": 0}
        host.connection_observers.append(self._comebacks.connection_opened)
        registry = host.registry
        registry.observe(self._learn_from)
        registry.add(PingRequest, self._on_ping)
        registry.add(FindNodeRequest, self._on_find_node)
        registry.add(FindValueRequest, self._on_find_value)
        registry.add(StoreRequest, self._on_store)
        registry.add_notification(LeaveNotice, self._on_leave)

    # ---------------------------------------------------------------- lifecycle

    async def run(
        self,
        initial_peers: Sequence[PeerAddress | str] = (),
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Join through ``initial_peers``, serve, maintain; leave gracefully when cancelled.

        Raises:
            PeerUnavailable: initial peers were given and none of them could be reached (the message
                lists why each failed).
        """
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                if self.contacts_path is not None:
                    self._saved = await trio.to_thread.run_sync(load_contacts, self.contacts_path)
                if initial_peers or self._saved:
                    await self.bootstrap(initial_peers)
                nursery.start_soon(self._maintain)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None
                with trio.CancelScope(shield=True), trio.move_on_after(self.config.leave_deadline):
                    await self._leave()

    async def bootstrap(self, initial_peers: Sequence[PeerAddress | str]) -> int:
        """Contact ``initial_peers`` and the saved contacts, and fill the routing table with a lookup of
        our own id. The initial peers are remembered and pinged again whenever they are missing from a
        small table (see the module docstring).

        Raises:
            PeerUnavailable: initial peers were given and nobody (initial peer or saved contact) answered.
        """
        self._initial = [parse_multiaddr(p) if isinstance(p, str) else p for p in initial_peers]
        errors: list[str] = []
        await self._reach_all(self._initial, self._saved, errors)
        self._restored = sum(1 for c in self._saved if c.node_id in self.routing)
        if self._saved:
            logger.info("%d of %d saved DHT contacts answered", self._restored, len(self._saved))
        if len(self.routing) == 0:
            if initial_peers:
                raise PeerUnavailable("no initial peer could be reached: " + "; ".join(errors))
            return 0
        await self._find_nodes(self.node_id, self.config.k)
        return len(self.routing)

    async def _reach_all(
        self, addresses: Sequence[PeerAddress], contacts: Sequence[Contact], errors: list[str]
    ) -> None:
        """Ping ``addresses`` and ``contacts`` in parallel, learning each one that answers."""

        async def reach(address: PeerAddress) -> None:
            try:
                with trio.fail_after(self.config.rpc_deadline):
                    channel = await self.host.channel_to(address)
                    await channel.call(PingRequest())
            except _CALL_ERRORS as exc:
                errors.append(f"{address}: {exc or type(exc).__name__}")
                return
            self._initial_ids[address] = channel.peer_id
            known = node_id_of(channel.peer_id) in self.routing
            self._learn(Contact.of(channel.peer_id, (str(address.with_peer(channel.peer_id)),)))
            self._heard_from(channel.peer_id, known=known)

        async def ping(contact: Contact) -> None:
            if await self._call(contact, PingRequest()) is not None:
                self._learn(contact)

        limit = trio.CapacityLimiter(16)  # a saved file holds up to 256 contacts: dial them in waves

        async def limited(job: Callable[[], Awaitable[None]]) -> None:
            async with limit:
                await job()

        async with trio.open_nursery() as nursery:
            for address in addresses:
                nursery.start_soon(limited, functools.partial(reach, address))
            for contact in contacts:
                nursery.start_soon(limited, functools.partial(ping, contact))

    async def _rejoin(self) -> None:
        """Ping the initial peers missing from a small table (and the saved contacts while it is empty);
        if that taught us anyone, look up our own id to find their neighbours."""
        if len(self.routing) >= self.config.k:
            return
        missing = [a for a in self._initial if not self._holds_initial(a)]
        saved = [c for c in self._saved if c.node_id not in self.routing] if len(self.routing) == 0 else []
        if not missing and not saved:
            return
        before = len(self.routing)
        await self._reach_all(missing, saved, [])
        if len(self.routing) > before:
            logger.info("rejoined the DHT: %d contacts (was %d)", len(self.routing), before)
            await self._find_nodes(self.node_id, self.config.k)

    def _holds_initial(self, address: PeerAddress) -> bool:
        """True if the initial peer at ``address`` is in our table and connected: a restarted peer we
        did not call while it was down is still in the table, but its connection broke."""
        peer = self._initial_ids.get(address)
        return (
            peer is not None and node_id_of(peer) in self.routing and self.host.channel_for(peer) is not None
        )

    async def _maintain(self) -> None:
        next_sweep = next_refresh = next_republish = next_rejoin = next_save = trio.current_time()
        saved: frozenset[Contact] = frozenset(self._saved)
        while True:
            now = trio.current_time()
            if now >= next_rejoin:
                await self._rejoin()
                next_rejoin = now + self.config.rejoin_interval
            if now >= next_save and self.contacts_path is not None:
                saved = await self._save_contacts(saved)
                next_save = now + self.config.contacts_save_interval
            if now >= next_sweep:
                self.storage.remove_expired(self._clock())
                next_sweep = now + self.config.expiry_sweep_interval
            if now >= next_refresh:
                await self._refresh_buckets()
                next_refresh = now + self.config.refresh_interval / 4
            if now >= next_republish and self._own:
                await self._republish()
                next_republish = now + self.config.republish_interval
            elif not self._own:
                next_republish = now + self.config.republish_interval
            wake = min(next_sweep, next_refresh, next_republish, next_rejoin)
            if self.contacts_path is not None:
                wake = min(wake, next_save)
            await trio.sleep(max(0.0, wake - trio.current_time()))

    async def _save_contacts(self, saved: frozenset[Contact]) -> frozenset[Contact]:
        """Save the routing table if it changed since ``saved`` (never an empty one); return what the
        file now holds."""
        contacts = self.routing.contacts()
        if not contacts or frozenset(contacts) == saved or self.contacts_path is None:
            return saved
        contacts.sort(key=lambda c: self.routing.last_seen(c.node_id) or 0.0, reverse=True)
        try:
            await trio.to_thread.run_sync(save_contacts, self.contacts_path, contacts)
        except OSError as exc:
            self.tolerated.note("save contacts", exc)
            return saved
        return frozenset(contacts)

    async def _refresh_buckets(self) -> None:
        wall = self._clock()
        for lo, hi in self.routing.buckets_needing_refresh(wall, self.config.refresh_interval):
            target = random_id_in(lo, hi, self._rng)
            await self._find_nodes(target, self.config.k)

    async def _republish(self) -> None:
        now = self._clock()
        token = self._credentials()
        for slot, record in list(self._own.items()):
            if record.expiration <= now:
                del self._own[slot]
                continue
            if record.token != token:  # our token was refreshed: vouch for the record with the fresh one
                record = sign_record(
                    self.host.endpoint.identity,
                    record.key,
                    record.value,
                    record.expiration,
                    record.subkey,
                    token,
                )
                self._own[slot] = record
            await self._store_record(record)

    async def _leave(self) -> None:
        handoff: dict[PeerId, list[SignedRecord]] = defaultdict(list)
        contacts: dict[PeerId, Contact] = {}
        for i, record in enumerate(self.storage.records()):
            if i >= self.config.max_handoff_records:
                break
            for contact in self.routing.nearest(key_int(record.key), 1):
                handoff[contact.peer_id].append(record)
                contacts[contact.peer_id] = contact

        async def hand_off(contact: Contact, records: list[SignedRecord]) -> None:
            for start in range(0, len(records), 64):
                await self._call(contact, StoreRequest(records=records[start : start + 64]))

        async with trio.open_nursery() as nursery:
            for peer, records in handoff.items():
                nursery.start_soon(hand_off, contacts[peer], records)
        async with trio.open_nursery() as nursery:  # only after the hand-off: LEAVE ends conversations
            for peer in self.host.connected_peers():
                channel = self.host.channel_for(peer)
                if channel is not None:
                    nursery.start_soon(self._notify_leave, channel)

    async def _notify_leave(self, channel: RpcChannel) -> None:
        with self.tolerated.around("leave notice"):
            await channel.notify(LeaveNotice())

    # ---------------------------------------------------------------- routing table upkeep

    def _learn(self, contact: Contact) -> None:
        if contact.node_id == self.node_id:
            return
        stale = self.routing.add_or_update(contact, self._clock())
        if stale is not None and stale.node_id not in self._pinging and self._nursery is not None:
            self._pinging.add(stale.node_id)
            self._nursery.start_soon(self._ping_stale, stale)

    async def _ping_stale(self, contact: Contact) -> None:
        try:
            if await self._call(contact, PingRequest()) is None:
                self.routing.remove(contact.node_id)
        finally:
            self._pinging.discard(contact.node_id)

    def _learn_from(self, ctx: RequestContext) -> None:
        """Learn the sender of an authenticated request or notification (any service's)."""
        known = node_id_of(ctx.peer_id) in self.routing
        if ctx.listen_addrs:
            try:
                self._learn(Contact.of(ctx.peer_id, tuple(ctx.listen_addrs[:8])))
            except ValueError:
                logger.debug("ignoring contact %s with unusable addresses", ctx.peer_id)
        self._heard_from(ctx.peer_id, known=known)

    def _heard_from(self, peer: PeerId, *, known: bool = False) -> None:
        """An authenticated message from ``peer``: if it comes back, re-announce to it (bounded)."""
        if not self._comebacks.authenticated(peer, known=known):
            return
        self._counts["comebacks"] += 1
        now = trio.current_time()
        if self._nursery is None:
            return
        if self._reannouncing >= self.config.max_reannounces:
            self._counts["reannounces_skipped"] += 1
            logger.debug("not re-announcing to %s: %d re-announces running", peer, self._reannouncing)
            return
        if not self._reannounce_limiter.allow(peer, now):
            return
        self._reannouncing += 1
        self._nursery.start_soon(self._reannounce, peer)

    async def _reannounce(self, peer: PeerId) -> None:
        """Store on ``peer`` the records we hold or own for which it is among the closest nodes."""
        try:
            await trio.lowlevel.checkpoint()  # let the request that told us finish teaching its sender
            contact = self.routing.get(node_id_of(peer))
            if contact is None:
                return  # a client-mode peer, or a full bucket: it is no replica of anything we know
            known = [c.node_id for c in self.routing.contacts() if c.node_id != contact.node_id]
            now = self._clock()
            chosen: dict[tuple[bytes, bytes | None, str], SignedRecord] = {}
            replica: dict[bytes, bool] = {}  # by key: a key holds many records (one per subkey)
            for record in [*self.storage.records(), *self._own.values()]:
                if len(chosen) >= self.config.max_handoff_records:
                    break
                if record.key not in replica:
                    if len(replica) % 256 == 255:  # each new key scans the table: let others run
                        await trio.lowlevel.checkpoint()
                    replica[record.key] = is_replica_for(
                        key_int(record.key), contact.node_id, self.node_id, known, self.config.num_replicas
                    )
                if replica[record.key] and record.expiration > now:
                    chosen[(record.key, record.subkey, record.writer)] = record
            if not chosen:
                return
            records = list(chosen.values())
            self._counts["reannounces"] += 1
            logger.info("re-announcing %d records to %s, which came back", len(records), peer)
            for start in range(0, len(records), 64):
                batch = records[start : start + 64]
                if await self._call(contact, StoreRequest(records=batch)) is None:
                    return
                self._counts["reannounced_records"] += len(batch)
        finally:
            self._reannouncing -= 1

    # ---------------------------------------------------------------- handlers

    async def _on_ping(self, ctx: RequestContext, request: PingRequest) -> Message:
        return PingResponse()

    async def _on_find_node(self, ctx: RequestContext, request: FindNodeRequest) -> Message:
        nodes = self._nearest_infos(key_int(request.target), exclude=node_id_of(ctx.peer_id))
        return FindNodeResponse(nodes=nodes)

    async def _on_find_value(self, ctx: RequestContext, request: FindValueRequest) -> Message:
        records = self.storage.get(request.key, self._clock())
        nodes = self._nearest_infos(key_int(request.key), exclude=node_id_of(ctx.peer_id))
        return FindValueResponse(records=_fit(records), nodes=nodes)

    async def _on_store(self, ctx: RequestContext, request: StoreRequest) -> Message:
        accepted = []
        reasons: list[str] = []
        for i, record in enumerate(request.records):
            if i and i % 32 == 0:  # a signature check is ~0.1 ms: let other tasks run between batches
                await trio.lowlevel.checkpoint()
            now = self._clock()
            try:
                self.validator.validate(record, now)
            except RecordRejected as exc:
                self._rejected += 1
                reasons.append(str(exc))
                accepted.append(False)
                continue
            result = self.storage.put(record, now)
            held = bool(result) or self._holds(record)
            if not held:
                reasons.append(f"{result.value}: record of {record_user(record)} ({record.writer})")
            accepted.append(held)
        if reasons:
            logger.warning(
                "refused %d of %d records stored by %s; first: %s",
                len(reasons),
                len(request.records),
                ctx.peer_id,
                reasons[0],
            )
        return StoreResponse(accepted=accepted)

    async def _on_leave(self, ctx: RequestContext, message: LeaveNotice) -> None:
        self.routing.remove(node_id_of(ctx.peer_id))

    def _holds(self, record: SignedRecord) -> bool:
        """True if the store already has this record or a newer one (storing it again is a success)."""
        return any(
            r.subkey == record.subkey and not newer(record, r)
            for r in self.storage.get(record.key, self._clock())
        )

    def _nearest_infos(self, target: int, exclude: int) -> list[NodeInfo]:
        contacts = self.routing.nearest(target, min(self.config.k, MAX_NODES_PER_REPLY), exclude=exclude)
        return [c.to_info() for c in contacts]

    # ---------------------------------------------------------------- client side

    async def _call(self, contact: Contact, request: Request) -> Message | None:
        """One DHT request; ``None`` if the contact failed (it is then dropped from the routing table)."""
        last: Exception | None = None
        for text in contact.addrs:
            try:
                address = parse_multiaddr(text)
            except (ValueError, ConfigError) as exc:  # ConfigError is no ValueError
                last = exc
                continue
            if address.peer_id is None:
                address = address.with_peer(contact.peer_id)
            try:
                with trio.fail_after(self.config.rpc_deadline):
                    reply = await self.host.call(address, request)
            except _CALL_ERRORS as exc:
                last = exc
                if isinstance(exc, RemoteError):
                    break  # it answered: another address would give the same answer
                continue
            self._heard_from(contact.peer_id, known=contact.node_id in self.routing)
            self.routing.mark_seen(contact.node_id, self._clock())
            return reply
        self._rpc_failures += 1
        logger.debug("%s failed for %s: %s", request.kind, contact.peer_id, last)
        if not isinstance(last, RemoteError):
            self.routing.remove(contact.node_id)
        return None

    async def _find_nodes(self, target: int, width: int) -> list[Contact]:
        closest, _ = await self._lookup(target, width, None, quorum=0)
        return closest

    async def _lookup(
        self, target: int, width: int, value_key: bytes | None, quorum: int
    ) -> tuple[list[Contact], list[SignedRecord]]:
        """Run one iterative lookup; for a value lookup also return every record seen."""
        self._lookups += 1
        self.routing.touch(target, self._clock())
        lookup = Lookup(
            target, self.routing.nearest(target, width), k=width, alpha=self.config.alpha, own_id=self.node_id
        )
        found: list[SignedRecord] = []
        holders = 0
        send, receive = trio.open_memory_channel[tuple[Contact, Message | None]](self.config.alpha + width)
        request: Request = (
            FindNodeRequest(target=id_bytes(target)) if value_key is None else FindValueRequest(key=value_key)
        )

        async def query(contact: Contact) -> None:
            reply = await self._call(contact, request)
            await send.send((contact, reply))

        async with trio.open_nursery() as nursery:
            while True:
                for contact in lookup.next_queries():
                    nursery.start_soon(query, contact)
                if lookup.finished or lookup.in_flight == 0 or (quorum and holders >= quorum):
                    break
                contact, reply = await receive.receive()
                if reply is None:
                    lookup.on_failure(contact)
                    continue
                nodes = reply.nodes if isinstance(reply, FindNodeResponse | FindValueResponse) else []
                learned = []
                for info in nodes:
                    try:
                        learned.append(Contact.from_info(info))
                    except ValueError:
                        continue
                lookup.on_response(contact, learned)
                self._learn(contact)
                if isinstance(reply, FindValueResponse) and reply.records:
                    valid = [r for r in reply.records if r.key == value_key and self._acceptable(r)]
                    found.extend(valid)
                    holders += 1 if valid else 0
            nursery.cancel_scope.cancel()
        return lookup.closest(width), found

    def _acceptable(self, record: SignedRecord) -> bool:
        try:
            self.validator.validate(record, self._clock())
        except RecordRejected as exc:
            self._rejected += 1
            logger.warning("ignoring an invalid record in a lookup: %s", exc)
            return False
        return True

    async def store(
        self, key: str | bytes, value: bytes, expiration: float, subkey: bytes | None = None
    ) -> int:
        """Sign and store ``value`` under ``key`` (and ``subkey``) until ``expiration`` (unix time).

        Returns:
            On how many nodes (ourselves included) the record is now stored; 0 means nowhere.

        Raises:
            RecordRejected: the record would be refused by any node (expiry in the past or too far ahead).
            ValueError: the value or subkey exceeds the wire limits.
        """
        record = sign_record(
            self.host.endpoint.identity, key_id(key), value, expiration, subkey, self._credentials()
        )
        self.validator.validate(record, self._clock())
        self._own[(record.key, record.subkey)] = record
        return await self._store_record(record)

    def own_record(self, key: str | bytes, subkey: bytes | None = None) -> SignedRecord | None:
        """The record we last stored under ``key`` (and ``subkey``) and still republish, if any."""
        return self._own.get((key_id(key), subkey))

    async def _store_record(self, record: SignedRecord) -> int:
        target = key_int(record.key)
        replicas = self.config.num_replicas
        closest = await self._find_nodes(target, replicas)
        stored = 0
        ours = sorted([c.node_id ^ target for c in closest] + [self.node_id ^ target])
        if self.node_id ^ target in ours[:replicas] and (
            self.storage.put(record, self._clock()) or self._holds(record)
        ):
            stored += 1
        remote = closest[: replicas - stored] if stored else closest[:replicas]

        async def store_on(contact: Contact) -> None:
            nonlocal stored
            reply = await self._call(contact, StoreRequest(records=[record]))
            if isinstance(reply, StoreResponse) and reply.accepted and reply.accepted[0]:
                stored += 1

        async with trio.open_nursery() as nursery:
            for contact in remote:
                nursery.start_soon(store_on, contact)
        return stored

    async def get(self, key: str | bytes, *, latest: bool = False) -> DHTValue | None:
        """Find what ``key`` holds, or ``None``.

        Args:
            latest: keep searching until the lookup converges and merge every replica's records (slower,
                complete); by default stop at the first node that holds the key.
        """
        kid = key_id(key)
        now = self._clock()
        records = list(self.storage.get(kid, now))
        if not records or latest:
            _, found = await self._lookup(
                key_int(kid), self.config.num_replicas, kid, quorum=0 if latest else 1
            )
            records.extend(found)
        return _merge(records)

    def drop_user(self, user: str) -> int:
        """Forget every stored record charged to ``user`` (a revoked user); return how many were dropped
        (the caller logs them: whether a node names other users is its role's business)."""
        return self.storage.drop_owner(user)

    # ---------------------------------------------------------------- metrics

    def estimated_network_size(self) -> int:
        """Estimate the number of DHT nodes from the density of ids near our own (ourselves included)."""
        nearest = self.routing.nearest(self.node_id, self.config.k)
        if len(nearest) < self.config.k:
            return len(self.routing) + 1
        estimates = [
            (i + 1) * (1 << KEY_BITS) / max(1, c.node_id ^ self.node_id) for i, c in enumerate(nearest)
        ]
        return max(len(self.routing) + 1, round(sum(estimates) / len(estimates)))

    def statistics(self) -> DHTStatistics:
        return DHTStatistics(
            routing_table_size=len(self.routing),
            estimated_network_size=self.estimated_network_size(),
            stored_records=len(self.storage),
            own_records=len(self._own),
            lookups=self._lookups,
            rpc_failures=self._rpc_failures,
            rejected_records=self._rejected,
            refused_records=sum(self.storage.refusals[r] for r in _CAPACITY_REFUSALS),
            contacts_restored=self._restored,
            comebacks=self._counts["comebacks"],
            reannounces=self._counts["reannounces"],
            reannounced_records=self._counts["reannounced_records"],
            reannounces_skipped=self._counts["reannounces_skipped"],
            tolerated=self.tolerated.snapshot(),
        )


def _merge(records: Iterable[SignedRecord]) -> DHTValue | None:
    plain: SignedRecord | None = None
    entries: dict[bytes, SignedRecord] = {}
    for record in records:
        if record.subkey is None:
            if plain is None or newer(record, plain):
                plain = record
        else:
            current = entries.get(record.subkey)
            if current is None or newer(record, current):
                entries[record.subkey] = record
    if plain is None and not entries:
        return None
    return DHTValue(plain, dict(sorted(entries.items())))


def _fit(records: list[SignedRecord]) -> list[SignedRecord]:
    """Trim a reply's records to the wire limits (count and bytes), newest-expiring first."""
    budget = FindValueResponse.max_bytes - 64 * 1024
    out = []
    for record in sorted(records, key=lambda r: r.expiration, reverse=True)[:256]:
        budget -= record_cost(record)
        if budget < 0:
            break
        out.append(record)
    return out
