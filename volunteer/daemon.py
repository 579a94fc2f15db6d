"""The volunteer's root nursery: find the run, get admitted, join its DHT, measure this machine, train with
the others (see :mod:`volunteer.training`), show a live panel, report contributions, leave cleanly.
With ``--aux``, aggregate for the others instead of training (:mod:`volunteer.auxiliary`). With ``--relay``,
also serve a few relay slots to volunteers behind NAT, if a backbone proved this machine directly reachable
(:mod:`shared.relays`); a volunteer in client mode holds a slot at its checker, else at another relay found
in the DHT (:func:`shared.net.reachability.keep_relayed`). With ``--metrics-listen``, also serve its
Prometheus metrics (:mod:`volunteer.metrics`) from this nursery.

The training spec comes from ``--manifest FILE`` if given (open runs), else from the run's backbone API
(pinned runs; the manifest saved at admission if no backbone answers). A run without a training spec is
joined as a plain member (presence only)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio
from rich.console import Console

from protocols.training import TrainingSpec
from shared.auth.keys import Identity
from shared.console import project_version
from shared.discovery import discover_run
from shared.errors import AdmissionError, DiscoveryError, PeerUnavailable
from shared.lifecycle import Shutdown
from shared.manifest import load_training_spec
from shared.metrics_server import is_loopback, serve_metrics
from shared.net.addresses import parse_multiaddr
from shared.net.host import HostConfig
from shared.net.reachability import keep_relayed
from shared.net.relay import RelayService
from shared.node import Node, open_node
from shared.panel import LivePanel, status_line, status_view
from shared.prometheus import render
from shared.relays import VOLUNTEER_RELAY_LIMITS, find_relays, publish_relay_forever

from .activity import Activity, train_with_pauses, watch_policy
from .admission import Admission, admit, keep_admitted, remember_manifest
from .api_client import ApiClient
from .auxiliary import serve_auxiliary
from .control import serve_control
from .metrics import TrainingNumbers, session_numbers, volunteer_families
from .policy import Rules
from .session import TrainingSession
from .swarm.session import SwarmSession

__all__ = ["VolunteerOptions", "find_initial_peers", "serve_volunteer"]

logger = logging.getLogger("volunteer")
REFRESH = 1.0


@dataclass(frozen=True)
class VolunteerOptions:
    run_id: str
    data_dir: Path
    listen: Sequence[str]
    initial_peers: Sequence[str]
    discovery_wait: float = 3.0
    panel: bool = True
    log_period: float = 10.0
    invite: str | None = None
    manifest: Path | None = None
    device: str = "auto"
    threads: int = 0  # torch intra-op threads; 0: torch's default
    precision: str = "auto"  # auto, fp32, bf16 or fp16 (volunteer.precision)
    micro_batch: int = 0  # samples per forward/backward; 0: fitted to the GPU, else the spec's
    evaluate: bool = False  # held-out evaluation (volunteer.evaluation)
    evaluate_every: int | None = None  # steps between evaluations; None: the manifest's dataset.eval_every
    aux: bool = False  # aggregate only, no training (volunteer.auxiliary)
    rules: Rules = field(
        default_factory=Rules
    )  # when to pause by itself (volunteer.policy); none: always train
    gpu_memory_fraction: float | None = None  # the share of the GPU's memory torch may use; None: all
    relay: bool = False  # serve relay slots to volunteers behind NAT when directly reachable (shared.relays)
    metrics_listen: tuple[str, int] | None = None  # serve Prometheus metrics there (volunteer.metrics)
    max_upload_bps: float | None = None  # cap on all sending, bytes/s (shared.net.ratelimit); None: none
    max_download_bps: float | None = None  # ... and on all receiving
    swarm_role: str = "auto"  # a swarm run: server, trainer or auto (both; volunteer.swarm.session)
    trainers: int = 1  # a swarm run: micro-batches this peer carries through the stages at once


async def find_initial_peers(options: VolunteerOptions, known: Sequence[str]) -> list[str]:
    """The addresses to join through: the ones known (given, or from the run's manifest), else backbones of
    the run found over mDNS.

    Raises:
        DiscoveryError: none known and no backbone of the run answered on the LAN in time.
    """
    if known:
        return list(known)
    logger.info("looking for run %s on the local network (mDNS)…", options.run_id)
    found = await discover_run(options.run_id, wait=options.discovery_wait)
    if not found:
        raise DiscoveryError(
            f"no backbone of run {options.run_id!r} answered on the local network within "
            f"{options.discovery_wait:g} s; check the run id, or pass --initial-peer "
            f"/ip4/…/tcp/…/p2p/… as printed by `backbone start`"
        )
    return [address for ad in found for address in ad.multiaddrs]


async def serve_volunteer(options: VolunteerOptions, shutdown: Shutdown, console: Console) -> None:
    identity = Identity.load_or_create(options.data_dir)
    admission = await admit(options.run_id, options.data_dir, identity, options.invite, options.initial_peers)
    initial = await find_initial_peers(options, admission.initial_peers)
    training = await _training_spec(options, admission)
    async with open_node(
        identity,
        options.run_id,
        "volunteer",
        listen=options.listen,
        initial_peers=initial,
        authenticator=admission.authenticator,
        data_dir=options.data_dir,  # its saved DHT contacts: a restart re-dials them (shared.dht.contacts)
        verify_reachability=True,  # advertise only addresses a backbone dialed back (else: client mode)
        host_config=HostConfig(
            max_upload_bps=options.max_upload_bps, max_download_bps=options.max_download_bps
        ),
    ) as node:
        # one line whatever the width: scripts read the peer id from it (scripts/soak.py)
        console.print(
            f"joined run [bold]{options.run_id}[/] as {node.peer_id}", highlight=False, soft_wrap=True
        )
        if node.reachability is not None:
            console.print(node.reachability.describe(), highlight=False, soft_wrap=True)
        activity = Activity(can_pause=training is not None and not options.aux)
        session: TrainingSession | None = None
        last_step: int | None = None
        finished = TrainingNumbers()  # what the sessions before this one counted (volunteer.metrics)
        activity.details = lambda: _details(node, options, session, last_step)

        version = project_version()

        def metrics_page() -> str:
            role = "aggregator" if options.aux else ("trainer" if training is not None else "member")
            numbers = finished.then(session_numbers(session) if session is not None else None)
            families = volunteer_families(
                node.status(),
                numbers,
                role=role,
                state=activity.state,
                paused=activity.paused,
                version=version,
            )
            return render(families)

        async with trio.open_nursery() as nursery:
            await nursery.start(serve_control, options.data_dir, activity.handle)
            if options.metrics_listen is not None:
                await _start_metrics(nursery, options.metrics_listen, metrics_page, console)
            reach = node.reachability
            if reach is not None and reach.mode == "client":  # checked, unreachable: hold a relay slot
                relay = parse_multiaddr(reach.checked_with)
                others = functools.partial(find_relays, node.dht)
                nursery.start_soon(
                    functools.partial(keep_relayed, candidates=others), node.host, relay, _on_relay(node)
                )
            if options.relay:
                _start_relaying(node, nursery)
            nursery.start_soon(keep_admitted, admission, identity, options.data_dir)
            nursery.start_soon(node.publish_presence_forever)
            nursery.start_soon(node.measure_latency_forever)
            if training is None:
                activity.state = "member (the run has no training spec)"
                logger.warning("run %s has no training spec: joining as a plain member", options.run_id)
                nursery.start_soon(_show_forever, node, options, console)
                shutdown.ready()
                await shutdown.requested.wait()
            elif options.aux:
                activity.state = "aggregating"
                await serve_auxiliary(node, training, shutdown, console)
            else:
                if not options.rules.empty:
                    await nursery.start(watch_policy, activity, options.rules)  # its first decision

                async def run_session(stop: Shutdown) -> bool:
                    nonlocal session, last_step, finished
                    assert training is not None
                    node.activity = "training"
                    handlers = dict(node.host.bulk_handlers)  # the node's own, without a session's
                    kind = SwarmSession if training.sync.mode == "swarm" else TrainingSession
                    session = kind(node, identity, admission, training, options, initial)
                    try:
                        await session.run(stop, console)
                    finally:  # a paused peer holds no model (GPU memory) and serves no stale state
                        collab = getattr(session, "collab", None)
                        last_step = last_step if collab is None else collab.trainer.step
                        finished = finished.then(session_numbers(session))
                        session = None
                        node.host.bulk_handlers.clear()
                        node.host.bulk_handlers.update(handlers)
                        await trio.to_thread.run_sync(_release_memory)
                    return stop.requested.is_set()

                async def show_paused() -> None:
                    async with trio.open_nursery() as showing:
                        showing.start_soon(_show_forever, node, options, console, lambda: node.activity)
                        while True:  # the reason may change while paused (the rules' readings)
                            node.activity = f"paused: {activity.reason}"
                            await trio.sleep(REFRESH / 2)

                await train_with_pauses(activity, run_session, show_paused, shutdown)
            nursery.cancel_scope.cancel()
        console.print("leaving the run…", highlight=False)
    console.print("left the run cleanly", highlight=False)


async def _training_spec(options: VolunteerOptions, admission: Admission) -> TrainingSpec | None:
    if options.manifest is not None:
        return load_training_spec(options.manifest)
    credential = admission.credential
    if credential is None:
        return None
    try:
        manifest = await ApiClient(options.run_id, credential.manifest.api).manifest()
    except (PeerUnavailable, AdmissionError) as exc:
        logger.warning("using the manifest saved at admission (the API did not answer: %s)", exc)
        manifest = credential.manifest
    else:
        if await trio.to_thread.run_sync(remember_manifest, admission, options.data_dir, manifest):
            logger.info("the run's backbones changed: now %d API URLs", len(manifest.api))
    return manifest.training


def _release_memory() -> None:
    """Give a finished session's memory back (its model, optimizer state and batches): a paused volunteer
    leaves the GPU to the programs it paused for."""
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _details(
    node: Node, options: VolunteerOptions, session: TrainingSession | None, last_step: int | None
) -> dict[str, object]:
    """``volunteer status``'s facts beside the activity: who, where in the run, with how many peers."""
    status = node.status()
    collab = getattr(session, "collab", None)
    return {
        "run_id": options.run_id,
        "peer_id": node.peer_id,
        "step": last_step if collab is None else collab.trainer.step,
        "peers_online": status.members_online,
        "connected": status.connected_peers,
        "role": "aggregator" if options.aux else "trainer",
        "doing": session.headline if session is not None and node.activity == "training" else "",
    }


async def _show_forever(
    node: Node,
    options: VolunteerOptions,
    console: Console,
    headline: Callable[[], str] | None = None,
) -> None:
    """The plain member's panel (or log lines), under ``headline()`` (the paused volunteer's too)."""
    title = headline or (lambda: "training run member")
    if options.panel:
        with LivePanel(console, lambda: status_view(node.status(), title())) as panel:
            while True:
                await trio.to_thread.run_sync(node.write_status, options.data_dir)
                panel.refresh()
                await trio.sleep(REFRESH)
    last = -options.log_period
    while True:
        await trio.to_thread.run_sync(node.write_status, options.data_dir)
        if trio.current_time() - last >= options.log_period:
            line = status_line(node.status())
            logger.info(line if headline is None else f"{headline()} · {line}")
            last = trio.current_time()
        await trio.sleep(REFRESH)


async def _start_metrics(
    nursery: trio.Nursery, where: tuple[str, int], page: Callable[[], str], console: Console
) -> None:
    """``--metrics-listen``: serve ``page`` at ``/metrics`` in ``nursery``; say where (and warn when the
    address is reachable from other machines)."""
    host, port = where
    bound = await nursery.start(serve_metrics, host, port, page)
    shown = f"[{host}]" if ":" in host else host
    console.print(f"metrics at http://{shown}:{bound}/metrics", highlight=False, soft_wrap=True)
    if not is_loopback(host):
        logger.warning(
            "--metrics-listen %s: other machines can read this volunteer's metrics (its peer id, run and "
            "traffic); use 127.0.0.1 to keep them local",
            host,
        )


def _start_relaying(node: Node, nursery: trio.Nursery) -> None:
    """``--relay``: serve relay slots and publish our relay record, if a backbone dialed us back."""
    reach = node.reachability
    if reach is None or reach.mode != "direct":
        why = "no reachability check" if reach is None else reach.describe()
        logger.warning("--relay: not relaying, this machine is not directly reachable (%s)", why)
        return
    node.relay = RelayService(node.host, VOLUNTEER_RELAY_LIMITS)
    nursery.start_soon(publish_relay_forever, node)
    logger.info(
        "relaying: up to %d volunteers behind NAT may hold a slot here",
        VOLUNTEER_RELAY_LIMITS.max_reservations,
    )


def _on_relay(node: Node) -> Callable[[tuple[str, ...]], None]:
    """Record our relayed addresses (none: client mode again) in the node's reachability."""

    def changed(addresses: tuple[str, ...]) -> None:
        if node.reachability is not None:
            node.reachability = dataclasses.replace(node.reachability, relayed=addresses)

    return changed
