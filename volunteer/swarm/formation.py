"""A swarm run forming: its first servers measure the links among them and place themselves with the
heterogeneous scheduler (issue 17 item 5; seed 002 §3; the pure rules are :mod:`shared.swarm.links`).

**Who forms.** A server of a run whose stages show no server yet (no stage record,
:func:`~shared.swarm.directory.find_stage_servers`) joins the *formation* (:func:`form`); one that finds
stage records is a newcomer and is placed by :func:`~shared.swarm.rebalance.place_newcomer` as before.

**The window.** A formation lasts ``window`` seconds from its earliest member's join time, as the
members' link records state it (:class:`protocols.swarm.LinkRecord` ``started``). Every member computes
the same close ``T = min(started) + window`` from the same records, so all of them decide at once. A join
time is its writer's claim, so each reader bounds it (DESIGN D10 (c)): a record that claims to have
joined in the future (beyond :data:`CLOCK_SKEW`) is ignored, and one that claims to have joined more than
a window before the reader did counts as ``reader's join - window``. A liar therefore can only bring the
reader's close forward to its own join time -- it then places itself from the records it sees at once,
the way a newcomer would -- and never delays a formation. A server that joins after the close of an
honest formation finds stage records (the members serve within seconds of the close), or else closes at
its own join time and computes a placement from the records of the members (the same one, when it sees
the same records).

**During the window** every member, every ``poll`` seconds until ``settle`` seconds before the close:

1. reads the link records (key :data:`~protocols.swarm.LINKS_KEY`; one per writer: an entry whose subkey
   is not its writer's peer id is skipped, as the run's validator would; records that do not decode or
   name another stage count are skipped);
2. measures the round trip to the peers :func:`~shared.swarm.links.sample_peers` picks among the members
   it knows (``samples`` of them, not all ``n - 1``) that it has not measured yet: the fastest of
   ``pings`` authenticated DHT pings (:class:`protocols.dht.PingRequest`, over the peer's direct address),
   each within ``ping_timeout`` (a peer that does not answer is not measured; the fill rule covers it);
3. republishes its record with what it measured.

The ``settle`` seconds let the last records reach the DHT before anyone reads them. **At the close**
every member reads the records once more; the formation is the writers whose (bounded) join time is at
most ``T``, itself included. Their measurements (each writer's own, bounded by
:func:`~shared.swarm.links.bounded_links`; ours as we measured them), filled by
:func:`~shared.swarm.links.round_trips`, with the bandwidths the capability records state
(:func:`~shared.swarm.links.bandwidths`) and the run's :class:`~shared.swarm.placement_cost.Workload`,
go to :func:`~shared.swarm.links.formation_placement` (in a worker thread: the search is numpy and
scipy), which names our stage. What happens when members disagree, and with a member count that ``S``
does not divide, is stated there.

**After the close** (:func:`keep_links`, run while a server serves a run that re-placement may re-place,
:mod:`.member` 4): the records would expire :data:`~protocols.swarm.LINK_RECORD_TTL` after the formation
and leave a later re-placement link-blind, and servers that joined after the close never published one.
So every such server, the formation's members and newcomers alike, every :data:`LINK_REFRESH` seconds
reads the records, measures the round trip to the ``samples`` peers :func:`~shared.swarm.links.sample_peers`
picks among the writers it can reach now (all of them again: links change; a departed server's record
expires and drops out of the sample), and republishes its record with those measurements (a peer that did
not answer is left out; ``started``: when the server joined the formation, or began serving). Two refreshes
may fail before a record expires; a failed read, measurement or publish is counted and tried again at the
next refresh.

**What it costs.** One record of at most ``64`` samples per member, ``pings x samples`` pings, a few DHT
reads per second per member during the window, and a search of :data:`~shared.swarm.links
.DEFAULT_GENERATIONS` offspring after the close, in a worker thread (measured on a busy 2-core machine,
random round trips: about 2 s at 12 servers and 3 stages, 7 s at 24 and 13 s at 48 servers and 4 stages).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import msgspec
import trio

from protocols.dht import PingRequest
from protocols.errors import DECODE_FAILURES, ProtocolError
from protocols.peer_id import PeerId
from protocols.probe import CAPABILITIES_KEY, decode_capability_record
from protocols.swarm import (
    LINK_RECORD_TTL,
    LINKS_KEY,
    MAX_LINK_SAMPLES,
    LinkRecord,
    LinkSample,
    decode_link_record,
)
from protocols.training import TrainingSpec
from shared.errors import ConfigError
from shared.net.addresses import PeerAddress, parse_multiaddr
from shared.node import Node
from shared.swarm.links import (
    DEFAULT_GENERATIONS,
    FormationPlacement,
    bandwidths,
    formation_placement,
    round_trips,
    sample_peers,
)
from shared.swarm.placement_cost import Workload

from ..tasks.base import Task

__all__ = [
    "CLOCK_SKEW",
    "DEFAULT_LENGTH",
    "FormationConfig",
    "FormationOutcome",
    "Measure",
    "estimate_workload",
    "form",
    "measure_rtt",
    "read_capacities",
    "read_link_records",
]

logger = logging.getLogger(__name__)

#: A join time further than this in the reader's future is not believed (seconds; clocks of admitted
#: peers are already checked to agree within the auth layer's skew).
CLOCK_SKEW = 30.0
#: The sequence length :func:`estimate_workload` assumes when the task's options name none.
DEFAULT_LENGTH = 128
_RECORD_FAILURES: tuple[type[Exception], ...] = (ProtocolError, *DECODE_FAILURES)
_CAPABILITY_FAILURES: tuple[type[Exception], ...] = (*_RECORD_FAILURES, ValueError)

#: How often a serving server re-measures its links and republishes its record (seconds; module
#: docstring, "After the close"): a third of the record's lifetime.
LINK_REFRESH = LINK_RECORD_TTL / 3

#: How a member times the round trip to a peer (the default is :func:`measure_rtt`; tests emulate links)
Measure = Callable[[Node, PeerId, PeerAddress], Awaitable[float]]


@dataclass(frozen=True)
class FormationConfig:
    """How a swarm run forms (module docstring).

    Attributes:
        window: seconds from the earliest member's join to the close.
        samples: ``k``, the peers each member measures.
        generations: the scheduler's offspring (no time limit: deterministic).
        workload: the cost model's bytes (None: the caller estimates it from the task).
        pings: pings per measured peer (the fastest counts).
        ping_timeout: seconds one ping may take.
        measure: the round-trip measurement (None: :func:`measure_rtt`).
    """

    window: float = 20.0
    samples: int = 8
    generations: int = DEFAULT_GENERATIONS
    workload: Workload | None = None
    pings: int = 3
    ping_timeout: float = 5.0
    measure: Measure | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window) and self.window > 0):
            raise ValueError(f"window must be finite and > 0, got {self.window}")
        if not 0 <= self.samples <= MAX_LINK_SAMPLES:
            raise ValueError(f"samples must be in [0, {MAX_LINK_SAMPLES}], got {self.samples}")
        if self.pings < 1:
            raise ValueError(f"pings must be >= 1, got {self.pings}")

    @property
    def settle(self) -> float:
        """Seconds before the close when measuring stops (module docstring)."""
        return min(2.0, self.window / 4)

    @property
    def poll(self) -> float:
        return min(1.0, self.window / 10)


@dataclass
class FormationOutcome:
    """What a member saw and decided (for the panel, logs and tests)."""

    stage: int
    placement: FormationPlacement
    #: the members and their (bounded) join times
    joined: dict[str, float]
    #: per member, the round trips it measured (ours: what we measured; others': their bounded records)
    measured: dict[str, dict[str, float]]
    close: float
    #: the filled round-trip matrix over ``sorted(joined)``
    rtt: list[list[float]] = field(default_factory=list)
    #: when we joined (our record's ``started``)
    started: float = 0.0


async def measure_rtt(node: Node, peer: PeerId, address: PeerAddress, pings: int = 3) -> float:
    """The fastest of ``pings`` authenticated pings to ``peer`` at ``address``, in seconds (the first may
    pay for the connection; the fastest is the link's, not the busy machine's).

    Raises:
        whatever the call raises (CALL_FAILURES).
    """
    best = math.inf
    for _ in range(pings):
        begun = trio.current_time()
        await node.host.call(address.with_peer(peer), PingRequest())
        best = min(best, trio.current_time() - begun)
    return best


def estimate_workload(task: Task, spec: TrainingSpec, stages: int) -> Workload:
    """The cost model's bytes for the run (plain blocking code: it builds the model once).

    ``c_DP``: a stage's share of the parameters in float32 (``4 P / S``: the stages split the blocks
    evenly). ``c_PP``: one micro-batch's activations at a stage boundary, ``local_batch x length x width``
    elements at about one byte each (the int8-blockwise codec of seed 004 App. I), ``width`` the first
    embedding's and ``length`` the task's ``seq_len`` option, else :data:`DEFAULT_LENGTH`. An estimate:
    it only weighs the data-parallel against the pipeline term of the cost.
    """
    import torch

    model = task.build_model()
    params = sum(p.numel() for p in model.parameters())
    width = next((m.embedding_dim for m in model.modules() if isinstance(m, torch.nn.Embedding)), 1)
    option = spec.task_options.get("seq_len")
    length = (
        option if isinstance(option, int) and not isinstance(option, bool) and option > 0 else DEFAULT_LENGTH
    )
    return Workload(stages, 4.0 * params / stages, float(spec.local_batch * length * width))


@dataclass(frozen=True)
class _Member:
    record: LinkRecord
    address: PeerAddress | None


async def read_link_records(node: Node, stages: int) -> dict[str, _Member]:
    """The link records of the run, one per writer (module docstring, step 1).

    Raises:
        whatever the DHT lookup raises (CALL_FAILURES).
    """
    found = await node.dht.get(LINKS_KEY, latest=True)
    members: dict[str, _Member] = {}
    for subkey, signed in sorted(found.entries.items()) if found is not None else ():
        if subkey != signed.writer.encode():
            continue
        try:
            record = decode_link_record(signed.value)
        except _RECORD_FAILURES:
            continue
        if record.stages != stages:
            continue
        peer = PeerId(signed.writer)
        address = None
        for text in record.addrs:
            try:
                parsed = parse_multiaddr(text)
            except ConfigError:
                continue
            if parsed.relay is None and parsed.peer_id in (None, peer):
                address = parsed.with_peer(peer)
                break
        members[str(peer)] = _Member(record, address)
    return members


def _bounded_join(claimed: float, mine: float, now: float, window: float) -> float | None:
    """A member's join time as the reader believes it (module docstring, "The window")."""
    if claimed > now + CLOCK_SKEW:
        return None
    return max(claimed, mine - window)


async def read_capacities(node: Node, peers: set[str]) -> dict[str, tuple[float, float]]:
    """Upload and download (bytes/s) the members' capability records state, if any."""
    found = await node.dht.get(CAPABILITIES_KEY, latest=True)
    out: dict[str, tuple[float, float]] = {}
    for subkey, signed in found.entries.items() if found is not None else ():
        if subkey != signed.writer.encode() or signed.writer not in peers:
            continue
        try:
            caps = decode_capability_record(signed.value).capabilities
        except _CAPABILITY_FAILURES:
            continue
        out[signed.writer] = (caps.upload_bps, caps.download_bps)
    return out


async def form(
    node: Node, run_id: str, stages: int, config: FormationConfig, workload: Workload
) -> FormationOutcome:
    """Take part in the run's formation and return our stage (module docstring). ``workload.stages`` must
    be ``stages``.

    Raises:
        ValueError: ``workload`` is for another stage count.
    """
    if workload.stages != stages:
        raise ValueError(f"a workload of {workload.stages} stages for a run of {stages}")
    me = str(node.peer_id)
    joined_at = time.time()
    mine: dict[str, float] = {}

    async def publish() -> None:
        await publish_links(node, stages, joined_at, mine)

    def close_of(members: Mapping[str, _Member]) -> float:
        now = time.time()
        times = [_bounded_join(m.record.started, joined_at, now, config.window) for m in members.values()]
        return min([joined_at, *(t for t in times if t is not None)]) + config.window

    await publish()
    members: dict[str, _Member] = {}
    while True:
        with node.tolerated.around("swarm link records read"):
            members = await read_link_records(node, stages)
        close = close_of(members)
        if time.time() >= close - config.settle:
            break
        reachable: dict[str, PeerAddress] = {}
        for peer, member in members.items():
            if peer != me and member.address is not None:
                reachable[peer] = member.address
        todo = [p for p in sample_peers(me, reachable, config.samples) if p not in mine]
        if todo:
            mine.update(await measure_links(node, {p: reachable[p] for p in todo}, config))
            await publish()
        await trio.sleep(max(0.0, min(config.poll, close - config.settle - time.time())))
    await trio.sleep(max(0.0, close - time.time()))
    with node.tolerated.around("swarm link records read"):
        members = await read_link_records(node, stages)
    now = time.time()
    joined = {me: joined_at}
    measured: dict[str, dict[str, float]] = {}
    for peer, member in members.items():
        at = _bounded_join(member.record.started, joined_at, now, config.window)
        if peer != me and at is not None and at <= close:
            joined[peer] = at
            claims: dict[str, float] = {}
            for sample in member.record.links:  # the first claim per peer counts (bounded_links)
                claims.setdefault(sample.peer, sample.rtt)
            measured[peer] = claims
    measured[me] = dict(mine)
    peers = sorted(joined)
    capacities: dict[str, tuple[float, float]] = {}
    with node.tolerated.around("swarm capability records read"):
        capacities = await read_capacities(node, set(peers))
    rtt = round_trips(peers, measured)
    bandwidth = bandwidths(peers, capacities)
    placement = await trio.to_thread.run_sync(
        lambda: formation_placement(joined, rtt, bandwidth, workload, run_id, generations=config.generations)
    )
    stage = placement.stages[me]
    logger.info(
        "swarm formation of %d servers (%d scheduled): serving stage %d of %d", len(peers),
        len(placement.scheduled), stage, stages,
    )  # fmt: skip
    return FormationOutcome(stage, placement, joined, measured, close, rtt.tolist(), joined_at)


async def publish_links(node: Node, stages: int, started: float, measured: Mapping[str, float]) -> None:
    """Publish our link record: ``measured`` round trips (at most the type's count), ``started`` as our
    join time. A failed store is counted (``swarm link record publish``), not raised."""
    links = [LinkSample(p, min(r, 60.0)) for p, r in sorted(measured.items())][:MAX_LINK_SAMPLES]
    record = LinkRecord(stages, started, list(node.host.advertised_addrs[:8]), links)
    with node.tolerated.around("swarm link record publish"):
        await node.dht.store(
            LINKS_KEY,
            msgspec.msgpack.encode(record),
            time.time() + LINK_RECORD_TTL,
            subkey=str(node.peer_id).encode(),
        )


async def measure_links(
    node: Node, targets: Mapping[str, PeerAddress], config: FormationConfig
) -> dict[str, float]:
    """The round trips to ``targets``, measured at once (``config.measure``, else :func:`measure_rtt`),
    each within ``ping_timeout x pings`` seconds; a peer that did not answer is left out (counted,
    ``swarm link measurement``)."""
    measure = config.measure or (lambda n, p, a: measure_rtt(n, p, a, config.pings))
    found: dict[str, float] = {}

    async def one(peer: str, address: PeerAddress) -> None:
        with (
            node.tolerated.around("swarm link measurement"),
            trio.move_on_after(config.ping_timeout * config.pings),
        ):
            found[peer] = await measure(node, PeerId(peer), address)

    async with trio.open_nursery() as nursery:
        for peer, address in targets.items():
            nursery.start_soon(one, peer, address)
    return found


async def keep_links(
    node: Node,
    stages: int,
    started: float,
    config: FormationConfig,
    *,
    refresh: float = LINK_REFRESH,
    wait_first: bool = False,
) -> None:
    """Keep our link record measured and alive while we serve (module docstring, "After the close"), until
    cancelled. ``started``: our join time as the record states it; ``wait_first``: the formation has just
    published a fresh record, so the first refresh waits a period."""
    me = str(node.peer_id)
    if wait_first:
        await trio.sleep(refresh)
    while True:
        members: dict[str, _Member] = {}
        with node.tolerated.around("swarm link records read"):
            members = await read_link_records(node, stages)
        reachable = {p: m.address for p, m in members.items() if p != me and m.address is not None}
        sampled = sample_peers(me, reachable, config.samples)
        measured = await measure_links(node, {p: reachable[p] for p in sampled}, config)
        await publish_links(node, stages, started, measured)
        await trio.sleep(refresh)
