"""Bandwidth and reachability probes: a server side any node can run, and the client functions.

See :mod:`protocols.probe` for the wire exchange. Backbones run :class:`ProbeService`; a volunteer calls
:func:`measure_bandwidth` and :func:`check_reachable` against one of them when it starts (DESIGN §1).

Timing. Bandwidth is ``nbytes / seconds`` of one transfer on a bulk connection that already exists:
an empty upload first opens (or reuses) the connection, a second empty one times the round trip ``rtt``,
then each direction is timed once. A transfer's time includes one round trip (header out, ack back), so
``rtt`` is subtracted — but never more than half the elapsed time, so that jitter on a fast link cannot
turn a measurement into nonsense. On a link slower than the server's the numbers are the link's; on a
faster one they are the server's share, a lower bound (which is what the LP should plan with anyway).

Load. A server runs at most ``max_concurrent`` probes at once and refuses more with ``OVERLOADED``
straight away (a queued upload would be timed as a slow one); clients retry after a short random pause.
A download holds its slot until its bytes are on the wire.
"""

from __future__ import annotations

import ipaddress
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from protocols.bulk import BulkHeader
from protocols.codes import ErrorCode
from protocols.errors import ProtocolError
from protocols.probe import (
    MAX_PROBE_BYTES,
    MAX_REACH_ADDRS,
    PROBE_DOWN,
    PROBE_UP,
    REACH_DEADLINE,
    DownloadProbe,
    ProbeReceipt,
    ReachReply,
    ReachRequest,
    decode_download_probe,
    decode_probe_receipt,
    encode_probe_meta,
)

from ..errors import ConfigError, Overloaded, PeerUnavailable, RemoteError
from ..tolerated import Tolerated
from .addresses import PeerAddress, format_multiaddr, parse_multiaddr
from .bulk import BulkReader, BulkReply
from .host import Host
from .rpc import RequestContext

__all__ = ["ProbeService", "ProbeStatistics", "check_reachability", "check_reachable", "measure_bandwidth"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Probes a server runs at once, by default (bandwidth probes and reachability checks together).
DEFAULT_CONCURRENT_PROBES = 4
#: How often a client retries a probe the server refused as OVERLOADED, and the first pause (doubling).
OVERLOAD_RETRIES = 5
OVERLOAD_PAUSE = 0.2

#: Zero bytes the server sends as download payloads. ``bytes(n)`` is calloc'd: pages that are only
#: read map the kernel's shared zero page, so this costs no memory however many downloads run.
_ZEROS: memoryview | None = None


def _zeros(nbytes: int) -> memoryview:
    global _ZEROS
    if _ZEROS is None:
        _ZEROS = memoryview(bytes(MAX_PROBE_BYTES))
    return _ZEROS[:nbytes]


@dataclass(frozen=True)
class ProbeStatistics:
    uploads: int  # probe.up transfers served
    downloads: int  # probe.down transfers served
    reach_checks: int
    bytes_received: int
    bytes_sent: int
    refused: int  # oversize or overloaded
    tolerated: dict[str, int] = field(default_factory=dict)  # failures survived, by site (dial-backs)


class ProbeService:
    """Serves ``probe.up``, ``probe.down`` and ``probe.reach`` on ``host`` (registered at construction).

    Raises:
        ValueError: ``host`` already serves these probes, or ``max_concurrent`` / ``max_bytes`` < 1.
    """

    def __init__(
        self, host: Host, *, max_concurrent: int = DEFAULT_CONCURRENT_PROBES, max_bytes: int = MAX_PROBE_BYTES
    ) -> None:
        if max_concurrent < 1 or max_bytes < 1:
            raise ValueError(f"max_concurrent and max_bytes must be >= 1, got {max_concurrent}, {max_bytes}")
        if PROBE_UP in host.bulk_handlers or PROBE_DOWN in host.bulk_handlers:
            raise ValueError("this host already serves bandwidth probes")
        self.host = host
        self.max_bytes = min(max_bytes, MAX_PROBE_BYTES)
        self.limiter = trio.CapacityLimiter(max_concurrent)
        self._counts = {"uploads": 0, "downloads": 0, "reach_checks": 0, "bytes_received": 0, "bytes_sent": 0}
        self._refused = 0
        self.tolerated = Tolerated(logger)
        host.registry.add(ReachRequest, self._on_reach)
        host.bulk_handlers[PROBE_UP] = self._on_up
        host.bulk_handlers[PROBE_DOWN] = self._on_down

    def statistics(self) -> ProbeStatistics:
        return ProbeStatistics(**self._counts, refused=self._refused, tolerated=self.tolerated.snapshot())

    def _slot(self, ctx: RequestContext, what: str) -> Callable[[], None]:
        """Take a probe slot (or refuse with OVERLOADED); returns the function that gives it back once."""
        token = object()
        try:
            self.limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            self._refused += 1
            raise RemoteError(
                ErrorCode.OVERLOADED, f"{self.limiter.total_tokens} probes running; retry shortly"
            ) from None
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.limiter.release_on_behalf_of(token)

        logger.debug("%s probe for %s", what, ctx.peer_id)
        return release

    def _check_size(self, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            self._refused += 1
            raise ProtocolError(
                f"probes are limited to {self.max_bytes} bytes, not {nbytes}", ErrorCode.TOO_LARGE
            )

    async def _on_up(self, ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
        self._check_size(header.nbytes)
        release = self._slot(ctx, "upload")
        try:
            await reader.discard()
        finally:
            release()
        self._counts["uploads"] += 1
        self._counts["bytes_received"] += header.nbytes
        return encode_probe_meta(ProbeReceipt(nbytes=header.nbytes))

    async def _on_down(self, ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> BulkReply:
        if header.nbytes:
            raise ProtocolError(f"a download probe carries no bytes, this one {header.nbytes}")
        request = decode_download_probe(header.meta)
        self._check_size(request.nbytes)
        release = self._slot(ctx, "download")
        self._counts["downloads"] += 1
        self._counts["bytes_sent"] += request.nbytes
        meta = encode_probe_meta(ProbeReceipt(nbytes=request.nbytes))
        return BulkReply(meta, _zeros(request.nbytes), on_sent=release)

    async def _on_reach(self, ctx: RequestContext, request: ReachRequest) -> ReachReply:
        release = self._slot(ctx, "reachability")
        try:
            reached = await self._dial_back(ctx, request.addrs)
        finally:
            release()
        self._counts["reach_checks"] += 1
        return ReachReply(reachable=reached, observed=ctx.remote_host[:64])

    async def _dial_back(self, ctx: RequestContext, addrs: list[str]) -> list[str]:
        """The addresses among ``addrs`` where a fresh, authenticated dial reached ``ctx.peer_id``."""
        observed = _ip(ctx.remote_host)
        candidates: dict[str, PeerAddress] = {}
        for text in addrs[:MAX_REACH_ADDRS]:
            try:
                address = parse_multiaddr(text)
            except ConfigError:
                continue
            if address.peer_id not in (None, ctx.peer_id):
                continue  # it names another peer: reaching it would prove nothing about the requester
            if observed is None or _ip(address.host) != observed:
                continue  # only the IP the request came from (see protocols.probe)
            candidates[text] = address.with_peer(ctx.peer_id)
        reached: set[str] = set()

        async def dial(text: str, address: PeerAddress) -> None:
            with trio.move_on_after(REACH_DEADLINE), self.tolerated.around("reach dial-back"):
                if await self.host.dial_fresh(address) == ctx.peer_id:
                    reached.add(text)

        async with trio.open_nursery() as nursery:
            for text, address in candidates.items():
                nursery.start_soon(dial, text, address)
        return [text for text in candidates if text in reached]


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP (an IPv4-mapped IPv6 address as its IPv4 address), or None for a name."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


async def _retry_overloaded(attempt: Callable[[], Awaitable[T]]) -> T:
    """Run ``attempt``; if the server says OVERLOADED, pause (doubling, jittered) and try again."""
    pause = OVERLOAD_PAUSE
    for _ in range(OVERLOAD_RETRIES):
        try:
            return await attempt()
        except Overloaded:
            await trio.sleep(pause * random.uniform(0.5, 1.5))
            pause *= 2
    return await attempt()


def _as_address(target: PeerAddress | str) -> PeerAddress:
    return parse_multiaddr(target) if isinstance(target, str) else target


async def measure_bandwidth(host: Host, address: PeerAddress | str, nbytes: int) -> tuple[float, float]:
    """Measure this node's upload and download rate against the probe server at ``address``.

    Args:
        host: our running host (it may be a client-mode one: every transfer runs on a connection we open).
        address: a node running :class:`ProbeService`.
        nbytes: bytes moved each way, 1 .. :data:`~protocols.probe.MAX_PROBE_BYTES`. Large enough that a
            transfer takes much longer than a round trip (8 MiB suits home links).

    Returns:
        ``(upload_bps, download_bps)`` in bytes per second, each at most the host's cap that way
        (``HostConfig.max_upload_bps`` / ``max_download_bps``, :mod:`shared.net.ratelimit`): what it states
        to the load balancer is what it will actually move.

    Raises:
        ValueError: ``nbytes`` out of range.
        PeerUnavailable, HandshakeError, RemoteError (Overloaded after retries, TOO_LARGE): as for
            :meth:`Host.send_bulk`.
        ProtocolError: the server's receipt does not match what was sent.
    """
    if not 0 < nbytes <= MAX_PROBE_BYTES:
        raise ValueError(f"nbytes must be in 1..{MAX_PROBE_BYTES}, got {nbytes}")
    target = _as_address(address)
    empty = memoryview(b"")

    async def upload(data: memoryview) -> float:
        started = trio.current_time()
        meta = await host.send_bulk(target, PROBE_UP, data)
        elapsed = trio.current_time() - started
        received = decode_probe_receipt(meta).nbytes
        if received != data.nbytes:
            raise ProtocolError(f"the server received {received} of {data.nbytes} bytes")
        return elapsed

    buffer = bytearray(nbytes)

    def sink(meta: bytes, size: int) -> memoryview:
        if decode_probe_receipt(meta).nbytes != nbytes or size != nbytes:
            raise ProtocolError(f"asked for {nbytes} bytes, the server announced {size}")
        return memoryview(buffer)

    async def download() -> float:
        started = trio.current_time()
        await host.send_bulk(target, PROBE_DOWN, empty, encode_probe_meta(DownloadProbe(nbytes=nbytes)), sink)
        return trio.current_time() - started

    await _retry_overloaded(lambda: upload(empty))  # opens the bulk connection (or reuses one)
    rtt = await _retry_overloaded(lambda: upload(empty))
    up = await _retry_overloaded(lambda: upload(memoryview(bytes(nbytes))))
    down = await _retry_overloaded(download)
    upload_bps, download_bps = nbytes / _transfer_seconds(up, rtt), nbytes / _transfer_seconds(down, rtt)
    throttle = host.endpoint.throttle  # the node's own caps: it will never move more, whatever the link does
    return (upload_bps, download_bps) if throttle is None else throttle.cap(upload_bps, download_bps)


def _transfer_seconds(elapsed: float, rtt: float) -> float:
    return max(elapsed - rtt, elapsed / 2, 1e-9)


async def check_reachable(host: Host, address: PeerAddress | str) -> list[str]:
    """The addresses where the probe server at ``address`` dialed us back (:func:`check_reachability`)."""
    return list((await check_reachability(host, address))[0])


async def check_reachability(host: Host, address: PeerAddress | str) -> tuple[tuple[str, ...], str]:
    """Ask the probe server at ``address`` which of our listen addresses it can dial back.

    If it reaches none of them and sees us on another IP (a NAT), it is asked once more about that IP
    with our listen ports, which finds a forwarded port.

    Returns:
        ``(reachable, observed)``: the addresses (multiaddrs with our peer id) where the server reached
        *us*, empty for a client-mode node (no listener, or nothing reachable); and the IP the server saw
        us come from ("" if it did not say or we have no listener to ask about).

    Raises:
        PeerUnavailable, HandshakeError, RemoteError (Overloaded after retries), ProtocolError: as for
            :meth:`Host.call`.
    """
    target = _as_address(address)
    asked = list(dict.fromkeys(host.listen_addrs))[:MAX_REACH_ADDRS]
    if not asked:
        return (), ""
    reply = await _ask_reach(host, target, asked)
    reached = tuple(a for a in reply.reachable if a in asked)
    observed = _ip(reply.observed)
    seen = "" if observed is None else str(observed)
    if reached or observed is None:
        return reached, seen
    ports = dict.fromkeys(parse_multiaddr(a).port for a in asked)
    public = [format_multiaddr(str(observed), port, host.peer_id) for port in ports]
    public = [a for a in public if a not in asked][:MAX_REACH_ADDRS]
    if not public:
        return (), seen
    second = await _ask_reach(host, target, public)
    return tuple(a for a in second.reachable if a in public), seen


async def _ask_reach(host: Host, target: PeerAddress, addrs: list[str]) -> ReachReply:
    async def ask() -> ReachReply:
        # The server dials every address at once, each for at most REACH_DEADLINE.
        deadline = REACH_DEADLINE + 2 * host.config.dial_deadline
        with trio.move_on_after(deadline):
            reply = await host.call(target, ReachRequest(addrs=addrs))
            if not isinstance(reply, ReachReply):
                raise ProtocolError(f"expected {ReachReply.kind}, got {reply.kind}")
            return reply
        raise PeerUnavailable(f"{target} did not answer a reachability check within {deadline:.0f} s")

    return await _retry_overloaded(ask)
