"""The backbone's root nursery: one node of the run, its HTTPS API, the ledger and the allowlist.

Pinned runs (the default): the authority key (``authority.key``) pins the run id; the backbone issues
itself an access token, serves the API (join, refresh, manifest, revocations, ledger, reports,
capabilities, admin), and turns every user the allowlist revokes — through the API or ``backbone allow
remove`` in another process — into an authority-signed revocation in the DHT within a second or two.
Open runs (``--open``): no authority, no API, no admission; for local experiments.
Both keep the run's recent checkpoints in ``<data dir>/checkpoints`` (a swarm run's: each stage's in
``<data dir>/checkpoints/stage-<k>``) and serve them to peers (:mod:`backbone.checkpointer`).
Both serve bandwidth and reachability probes (:mod:`shared.net.probe`) for volunteers measuring themselves,
and relay slots for the ones behind NAT unless started with ``--no-relay`` (:mod:`shared.net.relay`).
Both take aggregation slices of the volunteers' averaging rounds unless started with ``--no-aggregate``
(:mod:`backbone.aggregator`: a run whose volunteers are all behind NAT still averages).
Both save the DHT contacts they know in ``<data dir>/dht-contacts.json`` and dial them again when restarted
on the same data dir (:mod:`shared.dht.contacts`), so a restarted backbone finds the run's peers by itself.

Start-up order (pinned runs; :mod:`backbone.startup` says why): the API's port is bound first, then the ledger
and the keys are opened (the authority key must be the one of the run the data dir holds), the node binds
its ports and joins the DHT, the dataset shards are prepared (and must exist when the run serves them),
and only then is ``listening on …`` printed, the API served, ``run.json`` written and the run id printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import ipaddress
import logging
import os
import secrets
import socket
import ssl
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio
from cryptography.hazmat.primitives import serialization
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as serve_http

from protocols.api import Manifest
from protocols.auth import DEFAULT_TOKEN_LIFETIME, SignedRevocation, SignedToken
from protocols.training import TrainingSpec
from shared.auth.authority import AUTHORITY_FILE, Authority, pin_run_id
from shared.auth.guard import RunAuthenticator
from shared.auth.keys import Identity
from shared.averaging.auxiliary import AuxiliaryAggregator
from shared.data.corpus import SHARD_PATTERN, shard_name, write_shards
from shared.data.heldout import HELDOUT_DIR, write_heldout
from shared.data.shards import is_shard_name
from shared.discovery import advertise_run
from shared.errors import ConfigError, DiscoveryError, RecordRejected
from shared.lifecycle import Shutdown
from shared.net.addresses import expand_unspecified, parse_multiaddr
from shared.net.probe import ProbeService
from shared.net.relay import RelayService
from shared.net.tls import self_signed_certificate
from shared.node import Node, open_node
from shared.panel import status_line
from shared.relays import publish_relay_forever
from shared.state.transfer import StateServer

from .aggregator import DEFAULT_AGGREGATE_MBPS, backbone_aggregator, write_status
from .api import DB_READ, ApiState, build_app
from .checkpointer import keep_scoped_checkpoints, open_stores
from .dashboard import serve_dashboard
from .ledger import BACKBONE_USERNAME, RESERVED_USERNAMES, LedgerStore
from .live import LiveSources
from .runinfo import RUN_INFO, RunInfo, check_held_run, read_run_info, write_run_info, write_served_spec
from .sessions import close_silent_sessions_forever
from .startup import bind_api, bind_dashboard
from .steps import record_steps_forever
from .tokenizer import TOKENIZER_FILE, prepare_tokenizer

__all__ = ["BackboneOptions", "serve_backbone"]

logger = logging.getLogger("backbone")
STATUS_PERIOD = 1.0
LOG_PERIOD = 30.0
REVOCATION_SYNC = 1.0  # seconds between looks at the allowlist for newly removed users
REVOCATION_REPUBLISH = 3600.0
CHECKPOINTS_DIR = "checkpoints"  # the run's stored states, in the data dir (see backbone.checkpoints)
SHARDS_DIR = "shards"  # dataset shards served by the API, in the data dir


@dataclass(frozen=True)
class BackboneOptions:
    run_id: str
    data_dir: Path
    listen: Sequence[str]
    initial_peers: Sequence[str]
    mdns: bool = True
    open_run: bool = False
    authority_key: Path | None = None
    database_url: str | None = None
    api_listen: str = "0.0.0.0:0"
    public_urls: Sequence[str] = ()
    training: TrainingSpec = field(default_factory=TrainingSpec)  # ``--manifest FILE``; default: built-in
    aggregate: bool = True  # take averaging slices as an auxiliary aggregator (``--no-aggregate``: not)
    aggregate_mbps: float = DEFAULT_AGGREGATE_MBPS  # stated in its tickets (``--aggregate-bandwidth``)
    relay: bool = True  # offer relay slots to volunteers behind NAT (``--no-relay``: not)
    public_leaderboard: bool = False  # the dashboard's per-user rows for everyone (backbone.dashboard)
    dashboard_listen: str | None = None  # also serve the dashboard over plain HTTP here (None: not)


@contextlib.asynccontextmanager
async def _advertised(node: Node, run_id: str, authority_key: bytes | None) -> AsyncIterator[None]:
    """Advertise every non-loopback listener over mDNS; loopback-only backbones are not advertised."""
    by_port: dict[int, list[str]] = defaultdict(list)
    for text in node.host.listen_addrs:
        address = parse_multiaddr(text)
        if not ipaddress.ip_address(address.host).is_loopback:
            by_port[address.port].append(address.host)
    async with contextlib.AsyncExitStack() as stack:
        for port, hosts in by_port.items():
            try:
                await stack.enter_async_context(
                    advertise_run(run_id, node.peer_id, port, hosts, authority_key)
                )
                logger.info("advertising run %s on the LAN (mDNS) at port %d", run_id, port)
            except DiscoveryError as exc:
                logger.warning("not advertised on the LAN: %s", exc)
        if not by_port:
            logger.info("listening on loopback only: not advertising over mDNS")
        yield


def make_private(data_dir: Path) -> None:
    """The data dir holds the authority and identity keys, the admin token and the ledger: make it 0700
    (also when the organizer created it beforehand with another mode), set this process's umask to 077
    so that every file it creates (ledger, run.json, status.json, checkpoints) is 0600 whatever the
    umask it was started with, and set the files already there to 0600."""
    os.umask(0o077)
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    data_dir.chmod(0o700)
    for path in data_dir.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(0o600)


async def serve_backbone(options: BackboneOptions, shutdown: Shutdown) -> None:
    """Serve one backbone of the run until ``shutdown`` (start-up order: the module docstring).

    Raises:
        ConfigError: a port is taken, a key, the ledger URL or the data dir is unusable, the data dir holds
            another run, or the run's dataset has no shard to serve; nothing was announced then.
        PeerUnavailable, HandshakeError: no initial peer answered, or one serves another run.
    """
    if not options.open_run:
        api_socket = bind_api(options.api_listen)  # first: a taken port fails before anything is written
        try:
            dashboard = bind_dashboard(options.dashboard_listen) if options.dashboard_listen else None
            try:
                await _serve_pinned_node(options, api_socket, shutdown, dashboard)
            finally:
                if dashboard is not None:
                    dashboard.close()
        finally:
            api_socket.close()
        return
    await trio.to_thread.run_sync(make_private, options.data_dir)
    identity = Identity.load_or_create(options.data_dir)
    if options.training.tokenizer.kind != "none":
        raise ConfigError(
            f"{options.training.task} tokenizes with the run's tokenizer, which volunteers fetch from the "
            "backbone's API: start a pinned run (without --open)"
        )
    logger.warning(
        "open run %s: anyone who can reach this node may join; no admission, no ledger", options.run_id
    )
    async with open_node(
        identity,
        options.run_id,
        "backbone",
        listen=options.listen,
        initial_peers=options.initial_peers,
        data_dir=options.data_dir,
    ) as node:
        _print_listening(node)
        await _serve_node(node, options, options.run_id, shutdown)


async def _serve_pinned_node(
    options: BackboneOptions,
    api_socket: socket.socket,
    shutdown: Shutdown,
    dashboard_socket: socket.socket | None = None,
) -> None:
    await trio.to_thread.run_sync(make_private, options.data_dir)
    store = await _open_ledger(options)  # before the keys: a bad --database-url leaves no new key behind
    try:
        identity = Identity.load_or_create(options.data_dir)
        key_path = options.authority_key or options.data_dir / AUTHORITY_FILE
        if not key_path.exists() and (options.data_dir / RUN_INFO).exists():  # never a new key for a held run
            held = read_run_info(options.data_dir)
            raise ConfigError(
                f"{options.data_dir} holds run {held.run_id} but not its {AUTHORITY_FILE}: give that run's "
                "key with --authority-key PATH, or copy it into the data dir"
            )
        authority = Authority.load_or_create(key_path)
        run_id = pin_run_id(options.run_id, authority)
        public_key = authority.identity.public_key_bytes.hex()
        check_held_run(options.data_dir, run_id, authority_public_key=public_key)
        auth = RunAuthenticator(run_id, authority.key, identity, _own_token(authority, run_id, identity))
        async with open_node(
            identity,
            run_id,
            "backbone",
            listen=options.listen,
            initial_peers=options.initial_peers,
            authenticator=auth,
            data_dir=options.data_dir,
        ) as node:
            await _prepare_shards(options.training, options.data_dir / SHARDS_DIR)
            training = await trio.to_thread.run_sync(
                prepare_tokenizer, options.training, options.data_dir, options.data_dir / SHARDS_DIR
            )
            options = dataclasses.replace(options, training=training)
            await trio.to_thread.run_sync(write_served_spec, options.data_dir, training)
            _print_listening(node)
            await _serve_pinned(
                node, options, run_id, authority, auth, store, shutdown, api_socket, dashboard_socket
            )
    finally:
        await trio.to_thread.run_sync(store.close)


async def _open_ledger(options: BackboneOptions) -> LedgerStore:
    url = options.database_url or f"sqlite:///{options.data_dir / 'ledger.sqlite3'}"
    try:
        return await trio.to_thread.run_sync(LedgerStore.open, url)
    except ConfigError as exc:
        if options.database_url is None:
            raise
        raise ConfigError(f"--database-url: {exc}") from exc


def _print_listening(node: Node) -> None:
    for address in node.host.listen_addrs:
        print(f"listening on {address}", flush=True)


def _own_token(authority: Authority, run_id: str, identity: Identity) -> SignedToken:
    return authority.issue_token(
        run_id,
        BACKBONE_USERNAME,
        identity.peer_id,
        identity.public_key_bytes,
        time.time(),
        DEFAULT_TOKEN_LIFETIME,
    )


async def _serve_node(
    node: Node,
    options: BackboneOptions,
    run_id: str,
    shutdown: Shutdown,
    authority_key: bytes | None = None,
    live: LiveSources | None = None,
) -> None:
    """``live``: filled in with what is started here, for the dashboard and ``/metrics``."""
    live = live if live is not None else LiveSources()
    live.node = node
    ProbeService(node.host)  # volunteers measure their bandwidth and reachability against us
    if options.relay:  # volunteers behind NAT become reachable through us (shared.net.relay)
        node.relay = live.relay = RelayService(node.host)
    mdns = _advertised(node, run_id, authority_key) if options.mdns else contextlib.nullcontext()
    aggregator = None
    if options.aggregate:
        aggregator = live.aggregator = backbone_aggregator(node, options.training, options.aggregate_mbps)
        logger.info(
            "aggregating: this backbone takes averaging slices as an auxiliary aggregator "
            "(stating %g MB/s; --no-aggregate opts out)",
            options.aggregate_mbps,
        )
    else:
        logger.info("not aggregating (--no-aggregate): volunteers that all run in client mode cannot average")
    async with mdns, trio.open_nursery() as nursery:
        nursery.start_soon(node.publish_presence_forever)
        nursery.start_soon(node.measure_latency_forever)
        if node.relay is not None:  # volunteers whose relay died find us here (shared.relays)
            nursery.start_soon(publish_relay_forever, node)
        nursery.start_soon(_report_forever, node, options.data_dir, aggregator)
        if aggregator is not None:
            nursery.start_soon(aggregator.serve_forever)
        stores = await trio.to_thread.run_sync(
            open_stores, options.data_dir / CHECKPOINTS_DIR, options.training
        )  # the run's, or each stage's in a swarm run (backbone.checkpointer, "Swarm runs")
        live.checkpoints = stores[0][1] if stores[0][0].stage is None else None
        server = StateServer(node.host, backbone=True)
        await nursery.start(keep_scoped_checkpoints, node, server, stores, options.training)
        shutdown.ready()
        await shutdown.requested.wait()
        logger.info("leaving the run")
        nursery.cancel_scope.cancel()


async def _serve_pinned(
    node: Node,
    options: BackboneOptions,
    run_id: str,
    authority: Authority,
    auth: RunAuthenticator,
    store: LedgerStore,
    shutdown: Shutdown,
    api_socket: socket.socket,
    dashboard_socket: socket.socket | None = None,
) -> None:
    revocations: dict[str, SignedRevocation] = {}
    changed = trio.Event()
    public_urls: list[str] = list(options.public_urls)

    def manifest() -> Manifest:
        return Manifest(
            run_id=run_id,
            authority_public_key=authority.identity.public_key_bytes,
            backbones=node.host.advertised_addrs[:64],
            api=public_urls[:16],
            training=options.training,
        )

    async def user_removed(username: str) -> None:
        nonlocal changed
        changed.set()

    admin_token = _admin_token(options.data_dir)
    state = ApiState(
        run_id=run_id,
        authority=authority,
        store=store,
        admin_token=admin_token,
        manifest=manifest,
        revocations=lambda: list(revocations.values()),
        on_user_removed=user_removed,
        peer_id=node.peer_id,
        shards_dir=options.data_dir / SHARDS_DIR,
        tokenizer=(options.data_dir / TOKENIZER_FILE if options.training.tokenizer.kind != "none" else None),
        public_leaderboard=options.public_leaderboard,
    )

    async def sync_revocations() -> None:
        nonlocal changed
        last_publish = trio.current_time()
        while True:
            removed = await trio.to_thread.run_sync(store.revoked_users, limiter=DB_READ)
            # A user named like the backbones (possible in a database older than the reservation)
            # must never revoke the backbones' own tokens: that would cut every volunteer off.
            removed = [(n, t) for n, t in removed if n.casefold() not in RESERVED_USERNAMES]
            fresh = [name for name, _ in removed if name not in revocations]
            republish = trio.current_time() - last_publish > REVOCATION_REPUBLISH
            for name, revoked_at in removed:
                if name in fresh or republish:
                    revocations[name] = authority.revoke(run_id, name, revoked_at)
                    auth.revoked.add(name)
                    logger.info("publishing the revocation of user %s", name)
                    try:
                        await node.publish_revocation(name, revocations[name])
                    except RecordRejected as exc:  # our own authority record: a bug, not a network issue
                        logger.error("could not publish the revocation of %s: %s", name, exc)
            if republish:
                last_publish = trio.current_time()
            with trio.move_on_after(REVOCATION_SYNC):
                await changed.wait()
            changed = trio.Event()

    async def refresh_own_token() -> None:
        while True:
            await trio.sleep(DEFAULT_TOKEN_LIFETIME * 2 / 3)
            auth.set_token(_own_token(authority, run_id, node.host.endpoint.identity))

    if options.aggregate:  # its receipts must count for the volunteers it aggregates for (ledger)
        identity = node.host.endpoint.identity
        await trio.to_thread.run_sync(
            functools.partial(
                store.register_backbone, node.peer_id, identity.public_key_bytes, now=time.time()
            )
        )
    async with trio.open_nursery() as nursery:
        api_urls = await nursery.start(_serve_api, state, authority, options, api_socket)
        public_urls.extend(u for u in api_urls if u not in public_urls)
        write_run_info(
            options.data_dir,
            RunInfo(
                run_id=run_id, api=public_urls, authority_public_key=authority.identity.public_key_bytes.hex()
            ),
        )
        print(f"run id {run_id}", flush=True)
        for url in public_urls:
            print(f"api on {url}", flush=True)
        if dashboard_socket is not None:
            for url in await nursery.start(serve_dashboard, state, dashboard_socket):
                print(f"dashboard on {url}/dashboard", flush=True)
        nursery.start_soon(sync_revocations)
        nursery.start_soon(refresh_own_token)
        nursery.start_soon(record_steps_forever, node, store, options.training, 1.0, node.tolerated)
        nursery.start_soon(close_silent_sessions_forever, store, state.session_timeout)
        await _serve_node(node, options, run_id, shutdown, authority.identity.public_key_bytes, state.live)
        nursery.cancel_scope.cancel()


async def _prepare_shards(training: TrainingSpec, directory: Path) -> None:
    """When the run's examples come from the backbones (``dataset.source = "backbone"``): write the
    synthetic corpus's shards if the run asks for them (``dataset.generate``) and the directory holds no
    shards of the organizer's own (complete shards from an earlier start are kept), and its held-out shard
    (``heldout/``, protocols.evaluation), then make sure there is a shard to serve.

    Raises:
        ConfigError: no shard to serve (none there and none to generate, or none matching
            ``dataset.files``), or the corpus cannot be written.
    """
    dataset = training.dataset
    if dataset.source != "backbone":
        return

    def prepare() -> None:
        present = {p.name for p in directory.glob("*.jsonl")} if directory.is_dir() else set()
        if dataset.generate == 0:
            pass
        elif any(not SHARD_PATTERN.match(name) for name in present):
            logger.info("serving the shards in %s (not generating: it holds other shards)", directory)
        elif missing := len({shard_name(i) for i in range(dataset.generate)} - present):
            logger.info(
                "writing %d shards of the synthetic corpus (%d examples each, seed %d) to %s",
                missing,
                dataset.examples_per_shard,
                training.seed,
                directory,
            )
            try:
                write_shards(directory, dataset.generate, dataset.examples_per_shard, training.seed)
            except OSError as exc:
                raise ConfigError(
                    f"cannot write the synthetic corpus to {directory}: {exc.strerror or exc}; "
                    "free some disk space or fix the data dir's permissions"
                ) from exc
            logger.info("the synthetic corpus is ready in %s", directory)
        if dataset.generate and all(SHARD_PATTERN.match(name) for name in present):
            try:  # the held-out examples of the synthetic corpus (protocols.evaluation)
                write_heldout(directory / HELDOUT_DIR, dataset.eval_examples, training.seed)
            except OSError as exc:
                raise ConfigError(f"cannot write the held-out shard to {directory}: {exc}") from exc
        served = [
            path.name
            for path in (directory.iterdir() if directory.is_dir() else [])
            if is_shard_name(path.name)
            and (not dataset.files or any(fnmatch.fnmatchcase(path.name, p) for p in dataset.files))
        ]
        if not served:
            matching = f" matching {', '.join(dataset.files)}" if dataset.files else ""
            raise ConfigError(
                f'the run\'s volunteers read shards from the backbones (dataset.source = "backbone"), but '
                f"{directory} holds no .jsonl shard{matching}: put the run's shards there, or set "
                "dataset.generate = 8 for the synthetic corpus"
            )

    await trio.to_thread.run_sync(prepare)


def _admin_token(data_dir: Path) -> str:
    path = data_dir / "admin.token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(32)
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    return token


async def _serve_api(
    state: ApiState,
    authority: Authority,
    options: BackboneOptions,
    api_socket: socket.socket | None = None,
    *,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    """Serve the HTTPS API on ``api_socket`` (bound by :func:`backbone.startup.bind_api`; None: bind
    ``options.api_listen`` now) with a certificate of the authority key (pinned by the run id)."""
    if api_socket is None:
        with bind_api(options.api_listen) as bound:
            await _serve_api(state, authority, options, bound, task_status=task_status)
        return
    cert_path = options.data_dir / "api-cert.pem"
    key_path = options.authority_key or options.data_dir / AUTHORITY_FILE
    cert_path.write_bytes(
        self_signed_certificate(authority.identity).public_bytes(serialization.Encoding.PEM)
    )
    config = _Tls13Config()
    config.bind = [f"fd://{os.dup(api_socket.fileno())}"]  # hypercorn owns (and closes) the duplicate
    config.certfile, config.keyfile = str(cert_path), str(key_path)
    config.accesslog = None
    config.errorlog = logging.getLogger("backbone.http")

    async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
        await serve_http(build_app(state), config, task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(serve)
        task_status.started([url for bind in binds for url in _concrete_urls(bind)])


class _Tls13Config(HypercornConfig):
    """Hypercorn's TLS context allows TLS 1.2; the API speaks TLS 1.3 only, like every other connection
    of the system (DESIGN D1)."""

    def create_ssl_context(self) -> ssl.SSLContext | None:
        context = super().create_ssl_context()
        if context is not None:
            context.minimum_version = ssl.TLSVersion.TLSv1_3
        return context


def _concrete_urls(bind: str) -> list[str]:
    """``https://0.0.0.0:PORT`` becomes one URL per interface address (loopback last)."""
    scheme, _, rest = bind.partition("://")
    host, _, port = rest.rpartition(":")
    return [f"{scheme}://{h}:{port}" for h in expand_unspecified(host.strip("[]"))]


async def _report_forever(node: Node, data_dir: Path, aggregator: AuxiliaryAggregator | None = None) -> None:
    last_log = trio.current_time()
    while True:
        await trio.to_thread.run_sync(write_status, node, aggregator, data_dir)
        if trio.current_time() - last_log >= LOG_PERIOD:
            logger.info(status_line(node.status()))
            if aggregator is not None:
                logger.info(aggregator.status())
            last_log = trio.current_time()
        await trio.sleep(STATUS_PERIOD)
