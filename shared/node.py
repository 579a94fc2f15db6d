"""A node of a run: the engine's :class:`Host` plus the :class:`DHTNode`, started and stopped in order.

Both roles (volunteer and backbone) are built on :func:`open_node`. Leaving is ordered: the DHT leaves
first (hand-off and LEAVE notices need live connections), then the host closes every connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import trio

from protocols.auth import REVOCATIONS_KEY, SignedRevocation
from protocols.dht import PingRequest
from protocols.presence import PRESENCE_KEY, PRESENCE_TTL, Presence, Role
from protocols.probe import CAPABILITIES_KEY
from protocols.relay import RELAYS_KEY
from protocols.swarm import MAX_STAGES, stage_key, stage_training_keys
from protocols.training import CHECKPOINT_KEY, PROGRESS_KEY

from .auth.guard import Authenticator, RunAuthenticator
from .auth.keys import Identity
from .auth.revocations import decode_revocation
from .dht.admission import AdmissionValidator, TokenlessValidator
from .dht.contacts import CONTACTS_FILE
from .dht.keys import key_id
from .dht.node import DHTConfig, DHTNode
from .dht.records import (
    CompositeValidator,
    ExpiryValidator,
    RecordValidator,
    SignatureValidator,
    SubkeyOwnerValidator,
)
from .errors import AuthError, ConfigError, RecordRejected
from .net.addresses import PeerAddress, parse_multiaddr
from .net.host import CALL_FAILURES, Host, HostConfig
from .net.reachability import Reachability
from .net.reachability import verify_reachability as check_and_advertise
from .net.relay import RelayService
from .tolerated import Tolerated

__all__ = [
    "PER_PEER_KEYS",
    "Node",
    "NodeStatus",
    "open_node",
    "run_dht_config",
    "run_validator",
    "watch_revocations",
]

MEMBERS_REFRESH = 3.0  # seconds between counts of the presence entries
REVOCATION_POLL = 2.0  # seconds between polls of the revocation records (how fast a removal bites)
REVOCATION_TTL = 23 * 3600.0  # revocation records are re-published well before this
logger = logging.getLogger(__name__)


PER_PEER_KEYS = (
    PRESENCE_KEY,
    PROGRESS_KEY,
    CHECKPOINT_KEY,
    CAPABILITIES_KEY,
    RELAYS_KEY,
    # the pipeline's stage servers, and each stage's own collaboration (protocols.swarm)
    *(stage_key(k) for k in range(MAX_STAGES)),
    *(
        key
        for k in range(MAX_STAGES)
        for key in (stage_training_keys(k).progress, stage_training_keys(k).state)
    ),
)


def run_validator(authenticator: Authenticator | None = None) -> CompositeValidator:
    """Record validation for a run (the rules of :mod:`shared.dht.admission`), cheapest checks first.

    Every run: sane expiry, subkeys only the writer's own (per-peer keys: presence, progress, state,
    capabilities, relays, stage servers take no plain record), the writer's signature. Pinned runs: the
    writer is admitted and unrevoked (its token, carried in the record), and the revocations key holds
    authority revocations only (from any carrier). Open runs: records carry no token.
    """
    per_peer = [key_id(key) for key in PER_PEER_KEYS]
    if isinstance(authenticator, RunAuthenticator):
        admission: RecordValidator = AdmissionValidator(
            authenticator.run_id, authenticator.authority, authenticator.revoked
        )
        owners = SubkeyOwnerValidator(per_peer, exempt_keys=[key_id(REVOCATIONS_KEY)])
    else:
        admission, owners = TokenlessValidator(), SubkeyOwnerValidator(per_peer)
    return CompositeValidator([ExpiryValidator(), owners, admission, SignatureValidator()])


def run_dht_config(config: DHTConfig | None, authenticator: Authenticator | None) -> DHTConfig:
    """``config`` with what the run requires: in a pinned run, revocations stored outside every quota."""
    config = config or DHTConfig()
    if not isinstance(authenticator, RunAuthenticator):
        return config
    exempt = config.store.exempt_keys | {key_id(REVOCATIONS_KEY)}
    return dataclasses.replace(config, store=dataclasses.replace(config.store, exempt_keys=exempt))


async def watch_revocations(
    dht: DHTNode,
    auth: RunAuthenticator,
    period: float = REVOCATION_POLL,
    tolerated: Tolerated | None = None,
    *,
    name_users: bool = True,
) -> None:
    """Poll the run's revocation records and cut revoked users off (they stay revoked); drop the stored
    DHT records of every revoked user, however the user got into ``auth.revoked`` (a backbone adds users
    removed from its ledger directly). Failed polls are counted in ``tolerated`` (default: the DHT's).

    Who was removed is the organizers' business: with ``name_users`` False (volunteers) only our own
    user's removal is logged by name (WARNING); other users' removals and their dropped records are
    logged as counts at DEBUG, so one volunteer's log never tells who else takes part in the run."""
    tolerated = tolerated or dht.tolerated
    while True:
        others = 0
        with tolerated.around("revocations poll"):
            found = await dht.get(REVOCATIONS_KEY, latest=True)
            for record in found.entries.values() if found is not None else ():
                try:
                    username = decode_revocation(record, auth.run_id, auth.authority)
                except RecordRejected as exc:
                    logger.warning("ignoring a revocation record: %s", exc)
                    continue
                if username not in auth.revoked:
                    auth.revoked.add(username)
                    if name_users or username == _own_username(auth):
                        logger.warning("user %s has been removed from the run", username)
                    else:
                        others += 1
        if others:
            logger.debug("%d other user(s) removed from the run", others)
        dropped = 0
        for username in auth.revoked:
            count = dht.drop_user(username)
            dropped += count
            if count and name_users:
                logger.warning("dropped %d stored records of removed user %s", count, username)
        if dropped and not name_users:
            logger.debug("dropped %d stored records of removed users", dropped)
        await trio.sleep(period)


def _own_username(auth: RunAuthenticator) -> str | None:
    token = auth.token
    if token is None:
        return None
    try:
        return auth.authority.verify_token(token).username
    except AuthError:
        return None


@dataclass(frozen=True)
class NodeStatus:
    """A snapshot for panels and ``status.json``."""

    run_id: str
    peer_id: str
    role: str
    listen_addrs: list[str]  # where we are bound
    routing_table_size: int
    connected_peers: int
    dht_size_estimate: int
    members_online: int
    rpc_latency_ms: float | None
    bytes_sent: int
    bytes_received: int
    uptime_s: float
    updated_at: float
    tolerated: dict[str, int] = field(default_factory=dict)  # failures survived, by site (node and DHT)
    advertised_addrs: list[str] = field(default_factory=list)  # what we tell others (empty: client mode)
    reachability: str = ""  # "direct", "relayed", "client", "unchecked" (shared.net.reachability); "": none
    reachability_note: str = ""  # the same for people: why, and what would change it
    links: dict[str, int] = field(
        default_factory=dict
    )  # our RPC connections by kind: direct, relayed, punched
    activity: str = ""  # a volunteer's "training" or "paused: <why>" (volunteer.activity); "": not told
    relay_slots: int = 0  # reservations we offer others as a relay (0: not relaying; shared.relays)
    relay_reservations: int = 0  # of which held now
    #: bytes of the RPC frames we sent, by message kind (Host.statistics; the rest of bytes_sent is bulk)
    rpc_sent_by_kind: dict[str, int] = field(default_factory=dict)


@dataclass
class Node:
    role: Role
    host: Host
    dht: DHTNode
    started_at: float = field(default_factory=time.monotonic)
    _rtts: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    _members: int = 0
    tolerated: Tolerated = field(default_factory=lambda: Tolerated(logger))
    reachability: Reachability | None = None  # the check's result (nodes opened with verify_reachability)
    activity: str = ""  # what the daemon does now, for status.json (volunteer.activity)
    relay: RelayService | None = None  # the relay slots we serve others, if we do (shared.relays)

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    async def publish_presence_forever(self) -> None:
        """Keep our entry under the run's presence key fresh; also count who else is online."""
        published: list[str] | None = None
        next_publish = trio.current_time()
        while True:
            addrs = self.host.advertised_addrs[:8]
            if trio.current_time() >= next_publish or addrs != published:  # at once when they changed
                published = addrs
                presence = Presence(role=self.role, agent=self.host.endpoint.agent, addrs=addrs)
                value = msgspec.msgpack.encode(presence)
                with self.tolerated.around("presence publish"):
                    await self.dht.store(
                        PRESENCE_KEY, value, time.time() + PRESENCE_TTL, subkey=self.peer_id.encode()
                    )
                next_publish = trio.current_time() + PRESENCE_TTL / 3
            await self.refresh_members()
            await trio.sleep(MEMBERS_REFRESH)

    async def refresh_members(self) -> int:
        found = await self.dht.get(PRESENCE_KEY, latest=True)
        self._members = len(found.entries) if found is not None else 0
        return self._members

    async def publish_revocation(self, username: str, signed: SignedRevocation) -> int:
        """Store an authority revocation in the DHT (backbones re-publish them before they expire)."""
        value = msgspec.msgpack.encode(signed)
        return await self.dht.store(
            REVOCATIONS_KEY, value, time.time() + REVOCATION_TTL, subkey=username.encode()
        )

    async def measure_latency_forever(self, period: float = 2.0) -> None:
        """Ping a few known contacts now and then; the median round-trip is the panel's RPC latency."""
        while True:
            for contact in self.dht.routing.nearest(self.dht.node_id, 3):
                started = trio.current_time()
                with self.tolerated.around("latency ping", *CALL_FAILURES, ConfigError):
                    address = parse_multiaddr(contact.addrs[0]).with_peer(contact.peer_id)
                    with trio.fail_after(self.dht.config.rpc_deadline):
                        await self.host.call(address, PingRequest())
                    self._rtts.append(trio.current_time() - started)
            await trio.sleep(period)

    def status(self) -> NodeStatus:
        host = self.host
        host_stats = host.statistics()
        dht_stats = self.dht.statistics()
        return NodeStatus(
            run_id=self.host.run_id,
            peer_id=self.peer_id,
            role=self.role,
            listen_addrs=list(self.host.listen_addrs),
            routing_table_size=dht_stats.routing_table_size,
            connected_peers=host_stats.peers_connected,
            dht_size_estimate=dht_stats.estimated_network_size,
            members_online=self._members,
            rpc_latency_ms=statistics.median(self._rtts) * 1e3 if self._rtts else None,
            bytes_sent=host_stats.bytes_sent,
            bytes_received=host_stats.bytes_received,
            uptime_s=time.monotonic() - self.started_at,
            updated_at=time.time(),
            advertised_addrs=self.host.advertised_addrs,
            reachability="" if self.reachability is None else self.reachability.mode,
            reachability_note="" if self.reachability is None else self.reachability.describe(),
            links=dict(
                Counter(self.host.connection_kind(p) or "direct" for p in self.host.connected_peers())
            ),
            tolerated=dict(Counter(self.tolerated.snapshot()) + Counter(dht_stats.tolerated)),
            activity=self.activity,
            relay_slots=0 if self.relay is None else self.relay.limits.max_reservations,
            relay_reservations=0 if self.relay is None else self.relay.reservations_connected(),
            rpc_sent_by_kind=host_stats.rpc_sent_by_kind,
        )

    def write_status(self, data_dir: Path) -> None:
        """Atomically write ``status.json`` into ``data_dir`` (read by ``scripts/demo`` and monitors)."""
        path = data_dir / "status.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self.status()))
        tmp.replace(path)


@contextlib.asynccontextmanager
async def open_node(
    identity: Identity,
    run_id: str,
    role: Role,
    *,
    listen: Sequence[PeerAddress | str],
    initial_peers: Sequence[PeerAddress | str] = (),
    host_config: HostConfig | None = None,
    dht_config: DHTConfig | None = None,
    authenticator: Authenticator | None = None,
    data_dir: Path | None = None,
    verify_reachability: bool = False,
) -> AsyncIterator[Node]:
    """Start a node, join the DHT through ``initial_peers``, and leave in order on exit.

    With ``verify_reachability`` the node advertises nothing until one of ``initial_peers`` (a backbone)
    dialed it back, and then only the addresses it reached (:mod:`shared.net.reachability`); this happens
    before it joins the DHT, so that its first connections already tell peers the right addresses.

    With a ``data_dir`` the DHT saves its contacts there (``dht-contacts.json``, see
    :mod:`shared.dht.contacts`) and pings them again when started on the same data dir.

    Raises:
        ConfigError: a listen address cannot be used.
        PeerUnavailable: initial peers were given and none answered.
        HandshakeError: the initial peer is not who its address says, or serves another run.
    """
    host = Host(identity, run_id, host_config, authenticator)
    credentials = (lambda: authenticator.token) if isinstance(authenticator, RunAuthenticator) else None
    dht = DHTNode(
        host,
        run_dht_config(dht_config, authenticator),
        validator=run_validator(authenticator),
        credentials=credentials,
        contacts_path=None if data_dir is None else data_dir / CONTACTS_FILE,
    )
    # The host is shielded from whatever cancels this node, so that the DHT can still say goodbye
    # through it; it is stopped explicitly once the DHT has left (bounded by the DHT's leave deadline).
    host_scope = trio.CancelScope(shield=True)

    async def run_host(task_status: trio.TaskStatus[None]) -> None:
        with host_scope:
            await host.run(listen, task_status=task_status)

    if verify_reachability:
        host.advertise([])  # nothing until proven
    reachability: Reachability | None = None
    async with trio.open_nursery() as host_nursery:
        try:
            await host_nursery.start(run_host)
            if verify_reachability:
                reachability = await check_and_advertise(host, initial_peers)
                for peer in host.connected_peers():
                    host.disconnect(peer)  # redialed with the addresses we advertise now
            async with trio.open_nursery() as dht_nursery:
                await dht_nursery.start(dht.run, initial_peers)
                if isinstance(authenticator, RunAuthenticator):
                    dht_nursery.start_soon(
                        functools.partial(watch_revocations, name_users=role == "backbone"),
                        dht,
                        authenticator,
                    )
                try:
                    yield Node(role, host, dht, reachability=reachability)
                finally:
                    dht_nursery.cancel_scope.cancel()
        finally:
            host_scope.cancel()
