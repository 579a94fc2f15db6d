"""The backbone's dashboard and its Prometheus metrics, served by the backbone's own HTTP app (issue 15).

Routes (mounted by :func:`backbone.api.build_app` from :func:`routes`):

``GET /dashboard``            the page (``backbone/static/dashboard.html``); its script and style are
                              ``GET /dashboard/static/{dashboard.js,dashboard.css}``: no CDN, no build step
``GET /dashboard/data.json``  everything the page shows (:func:`dashboard_data`); the page polls it
``GET /metrics``              Prometheus text format 0.0.4 (:mod:`shared.prometheus`, :func:`metric_families`)

**What is public.** The run-level view needs no credential: the loss curve and samples/s over global
steps, the newest checkpoints, the counts of active peers, users and sessions by role and reachability,
their summed throughput, and health (DHT size, connections, the aggregator's rounds and failures, the
relay's circuits, reports by status). Per-user rows -- the peers table (user, device, throughput,
bandwidth, reachability) and the contribution leaderboard -- are only in the answer to a request with the
admin token (``Authorization: Bearer <data dir>/admin.token``, checked as every admin endpoint checks it),
or for everyone when the organizer started the backbone with ``--public-leaderboard``. A wrong token is a
401, never a silent downgrade. No address of anyone is ever shown, not even to the admin (the ledger's
sessions keep them for the organizer's own queries). ``/metrics`` is run-level only (no username, peer
id or address in a label), so it is public too: a Prometheus server scrapes it without the admin token.

**Escaping.** Usernames, device names and every other string are user input: the page builds its DOM
with ``textContent`` and ``createElementNS`` only (never ``innerHTML``), and every response carries a
Content-Security-Policy allowing scripts, styles and fetches from the backbone itself only (no inline
script, so an injected ``onerror`` attribute would not run even if markup got through).

**Where the numbers come from.** Steps from the ledger's step log (:meth:`LedgerStore.recent_steps`,
what :mod:`backbone.steps` records); a step's samples/s is its batch over the time since the step before
it, for consecutive steps only (:func:`step_rates`: across a gap the time covers steps not recorded).
Active peers are the peers with an open session heard from within the session timeout
(:mod:`backbone.sessions`), with the capabilities the ledger holds for them (bounded by what they were
seen to do) and the reachability they publish in the DHT (:class:`protocols.probe.CapabilityRecord`,
read at most every :data:`LIVE_TTL_S` seconds however many browsers poll). Their roles
(:func:`peer_roles`): every volunteer computes; a reachable one (not in client mode) can take
aggregation slices; one in client mode dials out only; this backbone aggregates and relays unless
started with ``--no-aggregate`` / ``--no-relay``. Health comes from the running node, aggregator and
relay (:class:`LiveSources`, filled in by :mod:`backbone.service` as it starts them; absent in tests that
build the app alone, where the page says "unknown").

**Cost.** ``data.json`` is public, so anyone may ask it as often as they like: each view's answer is
computed at most once per :data:`ANSWER_TTL_S` and shared by every request meanwhile
(:class:`_SharedAnswer`; concurrent requests wait for the one computation under way).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as serve_http
from sqlalchemy import func, select
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from protocols.api import ApiError
from protocols.probe import CAPABILITIES_KEY, CapabilityRecord, decode_capability_record
from shared.errors import ProtocolError
from shared.net.addresses import expand_unspecified
from shared.net.host import CALL_FAILURES
from shared.prometheus import CONTENT_TYPE, Family, Sample, render

from .api import DB_READ, ApiState, HttpError, _check_admin
from .ledger import BACKBONE_USERNAME, LedgerStore, StepRow
from .ledger.schema import Peer, PeerSession, User
from .live import LiveSources

__all__ = [
    "LIVE_TTL_S",
    "STEPS_SHOWN",
    "ActivePeer",
    "dashboard_data",
    "metric_families",
    "peer_roles",
    "routes",
    "serve_dashboard",
    "step_rates",
]

logger = logging.getLogger("backbone.dashboard")
#: the most steps the page plots (the newest ones)
STEPS_SHOWN = 500
#: the DHT's capability records are read at most this often (every browser's poll shares one read)
LIVE_TTL_S = 5.0
#: a view's answer (public, or with per-user rows) is computed at most once per this many seconds, however
#: many browsers poll or strangers ask: a flood of requests costs one ledger read a second, never the
#: API's read slots (DB_READ) that admission and reports need
ANSWER_TTL_S = 1.0
#: a DHT read that takes longer is given up (the page shows the last one)
DHT_READ_TIMEOUT_S = 3.0
ROLES = ("compute", "aggregate", "relay", "client")
_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "content-security-policy": _CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


@dataclass(frozen=True)
class ActivePeer:
    """A volunteer process with an open session heard from recently, and what the ledger holds of it."""

    peer_id: str
    username: str
    started_at: float
    last_seen_at: float
    device: str | None
    samples_per_second: float | None
    upload_bps: float | None
    download_bps: float | None


# ------------------------------------------------------------------------------------------- pure parts


def step_rates(steps: Sequence[StepRow]) -> list[float | None]:
    """Samples/s of each step of ``steps`` (oldest first): its samples over the time since the step
    before it, when that step is recorded and earlier in time; None otherwise (the first step, a gap)."""
    rates: list[float | None] = [None] * len(steps)
    for i in range(1, len(steps)):
        before, step = steps[i - 1], steps[i]
        elapsed = step.finished_at - before.finished_at
        if step.global_step == before.global_step + 1 and elapsed > 0:
            rates[i] = step.samples / elapsed
    return rates


def peer_roles(record: CapabilityRecord | None) -> list[str]:
    """A volunteer's roles from the capability record it publishes (None: none read yet): it computes;
    reachable (not client mode) it can aggregate; in client mode it dials out only."""
    if record is None or record.connectivity == "unchecked":
        return ["compute"]
    return ["compute", "client"] if record.client_mode else ["compute", "aggregate"]


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


# ------------------------------------------------------------------------------------------ the ledger


def active_peers(store: LedgerStore, *, since: float) -> list[ActivePeer]:
    """The peers with an open session heard from since ``since``, one row each (its newest session),
    most recently started first. Read-only query over the store's tables (the store keeps its writes)."""
    last = func.coalesce(PeerSession.last_seen_at, PeerSession.started_at)
    query = (
        select(
            PeerSession.peer_id,
            User.username,
            PeerSession.started_at,
            last.label("last_seen_at"),
            Peer.device,
            Peer.samples_per_second,
            Peer.upload_bps,
            Peer.download_bps,
        )
        .join(Peer, Peer.peer_id == PeerSession.peer_id)
        .join(User, User.id == Peer.user_id)
        .where(PeerSession.ended_at.is_(None), last >= since, User.revoked_at.is_(None))
        .order_by(PeerSession.started_at.desc(), PeerSession.id.desc())
    )
    with store._tx(write=False) as conn:  # the store's own transaction helper: LedgerError on failure
        rows = conn.execute(query).all()
    newest: dict[str, ActivePeer] = {}
    for r in rows:
        newest.setdefault(
            r.peer_id,
            ActivePeer(
                r.peer_id,
                r.username,
                r.started_at,
                r.last_seen_at,
                r.device,
                _finite(r.samples_per_second),
                _finite(r.upload_bps),
                _finite(r.download_bps),
            ),
        )
    return list(newest.values())


def ledger_counts(store: LedgerStore) -> dict[str, int]:
    """Run-level counts: active users (not the backbones), peers ever admitted, open sessions."""
    with store._tx(write=False) as conn:
        users = conn.execute(
            select(func.count())
            .select_from(User)
            .where(User.revoked_at.is_(None), User.username != BACKBONE_USERNAME)
        ).scalar_one()
        peers = conn.execute(
            select(func.count())
            .select_from(Peer)
            .join(User, User.id == Peer.user_id)
            .where(User.username != BACKBONE_USERNAME)
        ).scalar_one()
        sessions = conn.execute(
            select(func.count()).select_from(PeerSession).where(PeerSession.ended_at.is_(None))
        ).scalar_one()
    return {"users": int(users), "peers": int(peers), "open_sessions": int(sessions)}


@dataclass(frozen=True)
class _Snapshot:
    """One read of the ledger for a dashboard answer or a scrape (in a worker thread)."""

    steps: list[StepRow]  # oldest first
    active: list[ActivePeer]
    counts: dict[str, int]
    reports: dict[str, int]
    leaderboard: list[Any] | None


def _snapshot(store: LedgerStore, *, since: float, leaderboard: bool, steps: int) -> _Snapshot:
    return _Snapshot(
        steps=list(reversed(store.recent_steps(steps))) if steps else [],
        active=active_peers(store, since=since),
        counts=ledger_counts(store),
        reports=store.report_counts(),
        leaderboard=store.leaderboard() if leaderboard else None,
    )


class _SharedAnswer:
    """The newest answer per key, recomputed at most once per ``ttl`` seconds (module docstring, "Cost")."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.computed = 0  # how many answers were computed (the rest were shared)
        self._answers: dict[bool, tuple[float, bytes]] = {}
        self._locks: dict[bool, trio.Lock] = {}

    async def get(self, key: bool, compute: Callable[[], Awaitable[bytes]]) -> bytes:
        async with self._locks.setdefault(key, trio.Lock()):
            cached = self._answers.get(key)
            if cached is not None and trio.current_time() - cached[0] < self.ttl:
                return cached[1]
            answer = await compute()
            self.computed += 1
            self._answers[key] = (trio.current_time(), answer)
            return answer


# ---------------------------------------------------------------------------------------- live sources


async def _capability_records(live: LiveSources) -> dict[str, CapabilityRecord]:
    """The capability records in the DHT by peer id, read at most every :data:`LIVE_TTL_S` seconds."""
    node = live.node
    if node is None or trio.current_time() - live.records_at < LIVE_TTL_S:
        return live.records
    live.records_at = trio.current_time()
    found = None
    with trio.move_on_after(DHT_READ_TIMEOUT_S):
        try:
            found = await node.dht.get(CAPABILITIES_KEY, latest=True)
        except CALL_FAILURES as exc:
            logger.debug("reading the capability records failed: %s", exc)
            return live.records
    records: dict[str, CapabilityRecord] = {}
    for subkey, signed in found.entries.items() if found is not None else ():
        if subkey != signed.writer.encode():
            continue
        try:
            records[signed.writer] = decode_capability_record(signed.value)
        except ProtocolError:
            continue
    live.records = records
    return records


def _health(live: LiveSources) -> dict[str, Any]:
    node = live.node
    status = node.status() if node is not None else None
    return {
        "dht_size": status.dht_size_estimate if status else None,
        "routing_table": status.routing_table_size if status else None,
        "connected_peers": status.connected_peers if status else None,
        "rpc_latency_ms": status.rpc_latency_ms if status else None,
        "bytes_sent": status.bytes_sent if status else None,
        "bytes_received": status.bytes_received if status else None,
        "reachability": status.reachability if status else None,
        "tolerated": dict(status.tolerated) if status else {},
        # without ``last_error``: its text may name a peer's address (the backbone's log has it)
        "aggregator": (
            {k: v for k, v in dataclasses.asdict(live.aggregator.statistics()).items() if k != "last_error"}
            if live.aggregator is not None
            else None
        ),
        "relay": dataclasses.asdict(live.relay.statistics()) if live.relay is not None else None,
    }


def _checkpoints(live: LiveSources) -> list[dict[str, Any]]:
    if live.checkpoints is None:
        return []
    entries = sorted(live.checkpoints.entries(), key=lambda e: e.step, reverse=True)
    return [
        {"step": e.step, "time": e.time, "bytes": e.nbytes, "digest": e.digest.hex()[:16]} for e in entries
    ]


# ------------------------------------------------------------------------------------------- answers


async def dashboard_data(state: ApiState, live: LiveSources, *, per_user: bool) -> dict[str, Any]:
    """What ``/dashboard/data.json`` answers (module docstring); ``per_user``: include the peers table and
    the leaderboard."""
    now = state.clock()
    snap: _Snapshot = await trio.to_thread.run_sync(
        lambda: _snapshot(
            state.store, since=now - state.session_timeout, leaderboard=per_user, steps=STEPS_SHOWN
        ),
        limiter=DB_READ,
    )
    records = await _capability_records(live)
    rates = step_rates(snap.steps)
    steps = [
        {
            "step": s.global_step,
            "time": s.finished_at,
            "loss": _finite(s.loss),
            "samples": s.samples,
            "peers": s.peers,
            "samples_per_second": rate,
            "eval_loss": _finite(s.eval_loss),
        }
        for s, rate in zip(snap.steps, rates, strict=True)
    ]
    roles: Counter[str] = Counter({role: 0 for role in ROLES})
    connectivity: Counter[str] = Counter()
    peers = []
    for peer in snap.active:
        record = records.get(peer.peer_id)
        peer_role = peer_roles(record)
        roles.update(peer_role)
        reach = record.connectivity if record is not None else "unknown"
        connectivity[reach] += 1
        peers.append(
            {
                "user": peer.username,
                "peer_id": peer.peer_id,
                "roles": peer_role,
                "device": peer.device,
                "memory_bytes": record.capabilities.memory_bytes if record is not None else None,
                "samples_per_second": peer.samples_per_second,
                "upload_bps": peer.upload_bps,
                "download_bps": peer.download_bps,
                "reachability": reach,
                "since": peer.started_at,
                "last_seen": peer.last_seen_at,
            }
        )
    if live.aggregator is not None:
        roles["aggregate"] += 1
    if live.relay is not None:
        roles["relay"] += 1
    newest = snap.steps[-1] if snap.steps else None
    spec = state.manifest().training
    recent_rates = [r for r in rates[-20:] if r is not None]
    return {
        "run": {
            "run_id": state.run_id,
            "backbone": state.peer_id,
            "uptime_s": now - state.started_at,
            "now": now,
            "target_batch": spec.target_batch if spec is not None else None,
            "max_steps": spec.max_steps if spec is not None else None,
        },
        "access": {"per_user": per_user, "public_leaderboard": state.public_leaderboard},
        "summary": {
            "global_step": newest.global_step if newest else None,
            "loss": _finite(newest.loss) if newest else None,
            "samples_per_second": sum(recent_rates) / len(recent_rates) if recent_rates else None,
            "active_peers": len(snap.active),
            "active_users": len({p.username for p in snap.active}),
            "measured_samples_per_second": sum(p.samples_per_second or 0.0 for p in snap.active),
            "roles": dict(roles),
            "reachability": dict(connectivity),
            **snap.counts,
            "reports": snap.reports,
        },
        "steps": steps,
        "checkpoints": await trio.to_thread.run_sync(_checkpoints, live),
        "health": _health(live),
        "peers": peers if per_user else None,
        "leaderboard": (
            [_leader(row) for row in snap.leaderboard] if per_user and snap.leaderboard is not None else None
        ),
    }


def _leader(row: Any) -> dict[str, Any]:
    return {
        "user": row.username,
        "samples": row.samples,
        "compute_hours": row.compute_hours,
        "online_hours": row.online_hours,
        "bytes_aggregated": row.bytes_aggregated,
        "bytes_relayed": row.bytes_relayed,
        "peers": row.peers,
        "last_seen": row.last_seen,
        "flagged_reports": row.flagged_reports,
    }


async def metric_families(state: ApiState, live: LiveSources) -> list[Family]:
    """The run-level metrics (:mod:`shared.prometheus`): the ledger's counts and newest step, this
    backbone's node, aggregator, relay and checkpoints."""
    now = state.clock()
    snap: _Snapshot = await trio.to_thread.run_sync(
        lambda: _snapshot(state.store, since=now - state.session_timeout, leaderboard=False, steps=2),
        limiter=DB_READ,
    )

    def gauge(name: str, help: str, value: float | None, **labels: str) -> Family:
        return Family(name, "gauge", help, [Sample(value, labels)] if value is not None else [])

    def counter(name: str, help: str, values: dict[str, float] | float | None, label: str = "") -> Family:
        if values is None:
            return Family(name, "counter", help, [])
        if isinstance(values, dict):
            return Family(name, "counter", help, [Sample(v, {label: k}) for k, v in sorted(values.items())])
        return Family(name, "counter", help, [Sample(values)])

    newest = snap.steps[-1] if snap.steps else None
    rate = step_rates(snap.steps)[-1] if snap.steps else None
    families = [
        gauge(
            "dedloc_backbone_info",
            "This backbone's run and peer id (value 1).",
            1,
            run_id=state.run_id,
            peer_id=state.peer_id,
        ),
        gauge(
            "dedloc_backbone_uptime_seconds",
            "Seconds since this backbone's API started.",
            now - state.started_at,
        ),
        gauge(
            "dedloc_global_step",
            "The newest global step in the ledger's step log.",
            newest.global_step if newest else None,
        ),
        gauge(
            "dedloc_step_loss",
            "The training loss reported for the newest recorded step.",
            _finite(newest.loss) if newest else None,
        ),
        gauge(
            "dedloc_step_samples",
            "The global batch of the newest recorded step, in samples.",
            newest.samples if newest else None,
        ),
        gauge(
            "dedloc_step_samples_per_second",
            "Samples/s of the newest step (its batch over the time "
            "since the step before it; absent across a gap).",
            rate,
        ),
        gauge(
            "dedloc_users", "Allowlisted users not removed (the backbones not counted).", snap.counts["users"]
        ),
        gauge("dedloc_peers_admitted", "Peers (machines) ever admitted by invite.", snap.counts["peers"]),
        gauge(
            "dedloc_sessions_open", "Volunteer processes whose session is open.", snap.counts["open_sessions"]
        ),
        gauge(
            "dedloc_peers_active",
            "Peers with an open session heard from within the session timeout.",
            len(snap.active),
        ),
        counter(
            "dedloc_reports_total",
            "Contribution reports recorded, by verdict.",
            {k: float(v) for k, v in snap.reports.items()},
            "status",
        ),
    ]
    node = live.node
    if node is not None:
        status = node.status()
        families += [
            gauge(
                "dedloc_dht_size_estimate", "The DHT's estimated number of nodes.", status.dht_size_estimate
            ),
            gauge(
                "dedloc_dht_routing_table_size",
                "Contacts in this backbone's routing table.",
                status.routing_table_size,
            ),
            gauge(
                "dedloc_connected_peers", "Peers this backbone holds a connection to.", status.connected_peers
            ),
            gauge(
                "dedloc_members_online",
                "Members this backbone's node counts online (presence).",
                status.members_online,
            ),
            gauge(
                "dedloc_rpc_latency_seconds",
                "Median RPC round-trip time this node measured.",
                status.rpc_latency_ms / 1e3 if status.rpc_latency_ms is not None else None,
            ),
            counter("dedloc_sent_bytes_total", "Bytes this node sent.", float(status.bytes_sent)),
            counter("dedloc_received_bytes_total", "Bytes this node received.", float(status.bytes_received)),
            counter(
                "dedloc_tolerated_failures_total",
                "Failures survived, by where they happened.",
                {k: float(v) for k, v in status.tolerated.items()},
                "site",
            ),
        ]
    if live.aggregator is not None:
        stats = live.aggregator.statistics()
        rounds = {
            "joined": stats.rounds_joined,
            "aggregated": stats.rounds_aggregated,
            "failed": stats.rounds_failed,
            "no_group": stats.no_group,
            "error": stats.errors,
        }
        families += [
            counter(
                "dedloc_aggregator_rounds_total",
                "Averaging rounds of this backbone's aggregator, by outcome.",
                {k: float(v) for k, v in rounds.items()},
                "outcome",
            ),
            counter(
                "dedloc_aggregator_elements_total",
                "Elements of the slices this backbone averaged.",
                float(stats.elements_aggregated),
            ),
            gauge(
                "dedloc_aggregator_last_step",
                "The step of the last round this backbone aggregated for.",
                stats.last_step,
            ),
        ]
    if live.relay is not None:
        relay = live.relay.statistics()
        families += [
            gauge("dedloc_relay_reservations", "Relay reservations held now.", relay.reservations),
            gauge(
                "dedloc_relay_circuits_active",
                "Relayed circuits being set up or spliced now.",
                relay.circuits_active,
            ),
            counter(
                "dedloc_relay_circuits_total",
                "Relayed circuits requested, by outcome.",
                {"granted": float(relay.circuits_granted), "refused": float(relay.circuits_refused)},
                "outcome",
            ),
            counter(
                "dedloc_relay_bytes_total",
                "Bytes spliced through this backbone's relay.",
                float(relay.bytes_relayed),
            ),
        ]
    if live.checkpoints is not None:
        entries = await trio.to_thread.run_sync(live.checkpoints.entries)
        families += [
            gauge("dedloc_checkpoints", "Checkpoints this backbone stores.", len(entries)),
            gauge(
                "dedloc_checkpoint_bytes",
                "Bytes of the checkpoints this backbone stores.",
                sum(e.nbytes for e in entries),
            ),
            gauge(
                "dedloc_checkpoint_newest_step",
                "The step of the newest stored checkpoint.",
                max((e.step for e in entries), default=None),
            ),
        ]
    return families


# --------------------------------------------------------------------------------------------- routes


def routes(state: ApiState) -> list[Route]:
    """The dashboard's and ``/metrics``' routes, for :func:`backbone.api.build_app`."""
    live = state.live
    page = resources.files("backbone") / "static"
    shared = _SharedAnswer(ANSWER_TTL_S)  # one per app: every request of a view shares its answer

    def answer(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                response = await handler(request)
            except HttpError as exc:
                response = Response(
                    msgspec.json.encode(ApiError(exc.code, exc.message)),
                    status_code=exc.status,
                    media_type="application/json",
                )
            response.headers.update(_HEADERS)
            return response

        return endpoint

    @answer
    async def index(request: Request) -> Response:
        return Response((page / "dashboard.html").read_bytes(), media_type="text/html; charset=utf-8")

    @answer
    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _ASSETS:
            raise HttpError(404, "not_found", "no such dashboard file")
        return Response((page / name).read_bytes(), media_type=f"{_ASSETS[name]}; charset=utf-8")

    @answer
    async def data(request: Request) -> Response:
        admin = "authorization" in request.headers
        if admin:
            _check_admin(request, state.admin_token)  # a wrong token is a 401, never a downgrade
        per_user = admin or state.public_leaderboard

        async def compute() -> bytes:
            return msgspec.json.encode(await dashboard_data(state, live, per_user=per_user))

        return Response(await shared.get(per_user, compute), media_type="application/json")

    @answer
    async def metrics(request: Request) -> Response:
        return Response(render(await metric_families(state, live)), media_type=CONTENT_TYPE)

    async def home(request: Request) -> Response:
        return RedirectResponse("/dashboard", status_code=302)

    return [
        Route("/", home, methods=["GET"]),
        Route("/dashboard", index, methods=["GET"]),
        Route("/dashboard/static/{name}", asset, methods=["GET"]),
        Route("/dashboard/data.json", data, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


async def serve_dashboard(
    state: ApiState,
    sock: socket.socket,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the dashboard and ``/metrics`` (none of the API) over plain HTTP on the listening ``sock``
    (``backbone start --dashboard-listen``); started with its URLs. Browsers cannot open the API's HTTPS
    (an Ed25519 certificate, which they do not accept), so this is how a person opens the page: on
    loopback through an SSH tunnel, or behind a TLS reverse proxy."""
    host, port = sock.getsockname()[:2]
    if not ipaddress.ip_address(host).is_loopback:
        logger.warning(
            "serving the dashboard over plain HTTP on %s:%d: an admin token typed into it crosses the "
            "network in clear; prefer 127.0.0.1 and an SSH tunnel or a TLS reverse proxy",
            host,
            port,
        )
    config = HypercornConfig()
    config.bind = [f"fd://{os.dup(sock.fileno())}"]  # hypercorn owns (and closes) the duplicate
    config.accesslog = None
    config.errorlog = logging.getLogger("backbone.http")
    app = Starlette(routes=routes(state))
    urls = [f"http://{f'[{h}]' if ':' in h else h}:{port}" for h in expand_unspecified(host)]

    async def serve(task_status: trio.TaskStatus[None]) -> None:
        await serve_http(app, config, task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        await nursery.start(serve)
        task_status.started(urls)
