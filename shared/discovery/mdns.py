"""Advertise a training run on the LAN with mDNS / DNS-SD, and find a run's advertisers (DESIGN D1, D8).

Record format, version 1 (one service instance per advertising node)::

    service type   _dedloc._tcp.local.
    instance       <run label>-<last 12 chars of the peer id>._dedloc._tcp.local.
    SRV            target <instance label>.local., port = the node's TCP listen port
    A / AAAA       the node's listen addresses
    TXT            v=1             format version; other versions are ignored
                   run=<run id>    the run id, verbatim (opaque: never parsed here)
                   peer=<peer id>  the node's peer id (``12D3KooW…``)
                   ak=<base58>     pinned runs: the authority public key; a volunteer of run
                                   ``name@fp`` ignores answers whose key does not have fingerprint ``fp``

The run label is the run id with every run of characters outside ``[A-Za-z0-9-]`` replaced by ``-``, cut to
50 characters (``run`` if nothing is left), so the instance label fits DNS's 63-byte limit. The label is
lossy and only for humans: discovery matches on the TXT ``run`` value, never on the instance name.

An answer is a hint of where to dial, not a trust decision: anyone on the LAN can advertise anything. The
handshake checks the peer id when dialing, and the volunteer checks the run's authority (D8).

Threads: zeroconf's synchronous API is used, every blocking call crossing into a worker thread through
:data:`MDNS_THREADS`. Each ``Zeroconf`` instance also runs its own asyncio loop in a daemon thread (and each
browser one more thread); both functions here join those threads before they return or exit.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from typing import Final, TypeVar

import base58
import ifaddr
import trio
from zeroconf import Error as ZeroconfError
from zeroconf import (
    InterfaceChoice,
    IPVersion,
    NonUniqueNameException,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

from protocols.auth import authority_fingerprint, split_run_id
from protocols.peer_id import validate_peer_id
from shared.errors import ConfigError, DiscoveryError

__all__ = [
    "FORMAT_VERSION",
    "MDNS_THREADS",
    "SERVICE_TYPE",
    "Advertisement",
    "advertise_run",
    "discover_run",
]

logger = logging.getLogger(__name__)

SERVICE_TYPE: Final = "_dedloc._tcp.local."
FORMAT_VERSION: Final = "1"

MDNS_THREADS: Final = trio.CapacityLimiter(8)
"""Worker threads for zeroconf's blocking calls (open, register, resolve, close)."""

SIBLING_GRACE_S: Final = 0.2
"""After the first match, how long discovery keeps listening for other nodes of the same run."""

_RESOLVE_MAX_MS: Final = 1000
"""Upper bound on resolving one instance; answers usually carry SRV/TXT/A and resolve from cache at once."""

_CLEANUP_S: Final = 5.0
"""Bound on unregistering (three goodbye packets, ~0.3 s) and closing zeroconf, even when cancelled."""

_RUN_LABEL_MAX: Final = 50
_PEER_LABEL_LEN: Final = 12
_TXT_ENTRY_MAX_BYTES: Final = 255
_NOT_LABEL_CHARS: Final = re.compile(r"[^A-Za-z0-9-]+")

_T = TypeVar("_T")
_Interfaces = list[str] | InterfaceChoice


@dataclass(frozen=True)
class Advertisement:
    """One node advertising ``run_id``: its peer id and where to dial it.

    ``multiaddrs`` are ``/ip4/<a>/tcp/<port>/p2p/<peer_id>`` or ``/ip6/…``, one per advertised address.
    """

    run_id: str
    peer_id: str
    multiaddrs: tuple[str, ...]


def _instance_label(run_id: str, peer_id: str) -> str:
    run_label = _NOT_LABEL_CHARS.sub("-", run_id)[:_RUN_LABEL_MAX].strip("-") or "run"
    # the tail of a peer id is random; its head is the constant "12D3KooW" of every Ed25519 id
    return f"{run_label}-{peer_id[-_PEER_LABEL_LEN:]}"


async def _in_thread(fn: Callable[[], _T], *, abandon_on_cancel: bool = False) -> _T:
    # The ignore is for trio-typing's stale ``trio-stubs`` (pulled in by pytest-trio), which shadow trio's
    # own annotations and predate ``abandon_on_cancel``; ``unused-ignore`` keeps mypy quiet without them.
    return await trio.to_thread.run_sync(fn, limiter=MDNS_THREADS, abandon_on_cancel=abandon_on_cancel)


@contextmanager
def _zeroconf_errors(action: str) -> Iterator[None]:
    """Translate zeroconf's and the OS's failures into :class:`DiscoveryError` (the one boundary)."""
    try:
        yield
    except (ZeroconfError, OSError, RuntimeError) as exc:
        raise DiscoveryError(f"mDNS: {action} failed: {exc!r}") from exc


async def _open_zeroconf(interfaces: _Interfaces) -> Zeroconf:
    # Shielded: opening takes milliseconds, and a cancellation arriving meanwhile would otherwise drop the
    # new instance (and its loop thread) on the floor.
    where = "all interfaces" if interfaces is InterfaceChoice.All else f"the interfaces holding {interfaces}"
    with trio.CancelScope(shield=True), _zeroconf_errors(f"opening multicast sockets on {where}"):
        zc = await _in_thread(lambda: Zeroconf(interfaces=interfaces, use_asyncio=False))
    return zc


async def _close_zeroconf(zc: Zeroconf, browser: ServiceBrowser | None = None) -> None:
    """Cancel ``browser``, send goodbyes for registered services, and join zeroconf's threads.

    Runs shielded and bounded, so it finishes even when the caller is being cancelled.
    """

    def close() -> None:
        if browser is not None:
            browser.cancel()
        zc.close()

    with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_S) as scope:
        try:
            await _in_thread(close, abandon_on_cancel=True)
        except (ZeroconfError, OSError, RuntimeError) as exc:
            logger.warning("mDNS: closing zeroconf failed: %r", exc)
    if scope.cancelled_caught:
        logger.warning("mDNS: closing zeroconf took over %.0f s; left it to finish in its thread", _CLEANUP_S)


def _default_addresses() -> list[str]:
    """Every non-loopback IPv4 address of this host, as zeroconf's ``InterfaceChoice.All`` would find."""
    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if ip.is_IPv4 and isinstance(ip.ip, str) and not ipaddress.IPv4Address(ip.ip).is_loopback:
                found.append(ip.ip)
    return sorted(set(found))


def _checked_addresses(addresses: Sequence[str]) -> list[str]:
    if isinstance(addresses, str):
        raise ConfigError(f"addresses must be a sequence of IP addresses, not the string {addresses!r}")
    if not addresses:
        raise ConfigError("addresses is empty; pass None to advertise on every non-loopback IPv4 address")
    checked: list[str] = []
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError as exc:
            raise ConfigError(f"cannot advertise {address!r}: not an IP address") from exc
        if ip.is_unspecified or ip.is_multicast:
            raise ConfigError(f"cannot advertise {address!r}: pass the concrete address, or None for all")
        checked.append(str(ip))
    return checked


def _service_info(
    run_id: str, peer_id: str, port: int, addresses: list[str], authority_key: bytes | None
) -> ServiceInfo:
    label = _instance_label(run_id, peer_id)
    properties = {"v": FORMAT_VERSION, "run": run_id, "peer": peer_id}
    if authority_key is not None:
        properties["ak"] = base58.b58encode(authority_key).decode("ascii")
    return ServiceInfo(
        SERVICE_TYPE,
        f"{label}.{SERVICE_TYPE}",
        port=port,
        properties=properties,
        server=f"{label}.local.",
        parsed_addresses=addresses,
    )


@asynccontextmanager
async def advertise_run(
    run_id: str,
    peer_id: str,
    port: int,
    addresses: Sequence[str] | None = None,
    authority_key: bytes | None = None,
) -> AsyncIterator[None]:
    """Advertise this node as a member of ``run_id`` on the LAN for the duration of the ``async with``.

    Registration probes the LAN for a name conflict first, so entering takes about 1.5-2 s. On exit
    (also on cancellation) the service is withdrawn with goodbye packets and zeroconf is closed, within a
    bounded time.

    Args:
        run_id: the run to advertise (opaque; sent verbatim in TXT ``run``).
        peer_id: this node's peer id; it must be well formed.
        port: the TCP port the node listens on.
        addresses: the addresses to advertise; multicast is then sent only on the interfaces holding
            them. Pass the node's listen address when it listens on a specific one. ``None`` advertises
            every non-loopback IPv4 address of this host, on all interfaces.

    Raises:
        ConfigError: a malformed peer id, port, address, or a run id too long for a TXT entry.
        DiscoveryError: no usable interface, the sockets could not be opened, or another node already
            advertises the same instance name (same run label and peer id prefix).
    """
    try:
        validate_peer_id(peer_id)
    except ValueError as exc:
        raise ConfigError(f"cannot advertise: {exc}") from exc
    if not 0 < port < 65536:
        raise ConfigError(f"cannot advertise port {port}: not a TCP port")
    if not run_id or len(f"run={run_id}".encode()) > _TXT_ENTRY_MAX_BYTES:
        raise ConfigError(f"cannot advertise run id {run_id!r}: must be 1 to 251 bytes of UTF-8")
    interfaces: _Interfaces
    if addresses is None:
        chosen = await _in_thread(_default_addresses)
        if not chosen:
            raise DiscoveryError("mDNS: no non-loopback IPv4 address to advertise; pass addresses explicitly")
        interfaces = InterfaceChoice.All
    else:
        chosen = _checked_addresses(addresses)
        interfaces = chosen
    info = _service_info(run_id, peer_id, port, chosen, authority_key)

    zc = await _open_zeroconf(interfaces)
    try:
        try:
            # Not abandoned on cancellation: registration finishes (bounded by zeroconf, ~2 s) and the
            # finally below then withdraws it.
            await _in_thread(lambda: zc.register_service(info))
        except NonUniqueNameException as exc:
            raise DiscoveryError(
                f"mDNS: another node on the LAN already advertises {info.name!r}"
                " (the same run, and a peer id with the same prefix)"
            ) from exc
        except (ZeroconfError, OSError, RuntimeError) as exc:
            raise DiscoveryError(f"mDNS: registering {info.name!r} failed: {exc!r}") from exc
        # A cancellation that arrived while registering must not enter the body.
        await trio.lowlevel.checkpoint_if_cancelled()
        logger.info("mDNS: advertising run %r as %s on %s port %d", run_id, info.name, chosen, port)
        yield
    finally:
        await _close_zeroconf(zc)


def _txt(properties: dict[bytes, bytes | None], key: bytes) -> str | None:
    raw = properties.get(key)
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _multiaddr(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, peer_id: str) -> str | None:
    if ip.is_unspecified or ip.is_multicast:
        return None
    if ip.version == 6 and ip.is_link_local:
        return None  # not dialable without a zone, which an mDNS answer does not carry
    return f"/ip{ip.version}/{ip}/tcp/{port}/p2p/{peer_id}"


def _pins(encoded_key: str | None, fingerprint: str) -> bool:
    """True if the TXT ``ak`` value is the authority key whose fingerprint a pinned run id carries."""
    try:
        key = base58.b58decode(encoded_key or "")
    except ValueError:
        return False
    return len(key) == 32 and authority_fingerprint(key) == fingerprint


def _parse_advertisement(info: ServiceInfo, run_id: str) -> Advertisement | None:
    """The advertisement in ``info`` if it is a valid v1 record for ``run_id``, else ``None`` (logged)."""
    properties = info.properties
    if _txt(properties, b"run") != run_id:
        return None  # another run (or a stranger's record): normal, not worth a log line
    version = _txt(properties, b"v")
    if version != FORMAT_VERSION:
        logger.debug("mDNS: ignoring %s: format version %r, expected %r", info.name, version, FORMAT_VERSION)
        return None
    _, fingerprint = split_run_id(run_id)
    if fingerprint is not None and not _pins(_txt(properties, b"ak"), fingerprint):
        logger.warning(
            "mDNS: ignoring %s: it claims run %s without that run's authority key", info.name, run_id
        )
        return None
    peer_id = _txt(properties, b"peer") or ""
    try:
        validate_peer_id(peer_id)
    except ValueError:
        logger.debug("mDNS: ignoring %s: bad peer id %r", info.name, peer_id)
        return None
    port = info.port
    if port is None or not 0 < port < 65536:
        logger.debug("mDNS: ignoring %s: bad port %r", info.name, port)
        return None
    multiaddrs = [_multiaddr(ip, port, peer_id) for ip in info.ip_addresses_by_version(IPVersion.All)]
    dialable = tuple(m for m in multiaddrs if m is not None)
    if not dialable:
        logger.debug("mDNS: ignoring %s: no dialable address", info.name)
        return None
    return Advertisement(run_id=run_id, peer_id=peer_id, multiaddrs=dialable)


async def discover_run(run_id: str, *, wait: float = 3.0) -> list[Advertisement]:
    """Find the nodes advertising ``run_id`` on the LAN.

    Returns shortly (:data:`SIBLING_GRACE_S`) after the first match, so that other nodes of the same
    run that answer at about the same time are included, or after ``wait`` seconds with whatever was
    found (usually nothing). Records of other runs, other format versions, or malformed records are
    skipped. Zeroconf's threads are joined before returning.

    Args:
        run_id: the run to look for (compared verbatim with TXT ``run``).
        wait: the most seconds to listen when nothing matches.

    Returns:
        One :class:`Advertisement` per matching instance, in the order they were resolved.

    Raises:
        DiscoveryError: the multicast sockets could not be opened (e.g. no usable interface).
    """
    if math.isnan(wait) or wait < 0:
        raise ValueError(f"wait must be a non-negative number of seconds, got {wait}")
    found: dict[str, Advertisement] = {}
    with trio.move_on_after(wait) as listening:
        zc = await _open_zeroconf(InterfaceChoice.All)
        browser: ServiceBrowser | None = None
        try:
            names_in, names_out = trio.open_memory_channel[str](math.inf)
            token = trio.lowlevel.current_trio_token()

            def offer(name: str) -> None:  # in the trio thread, via run_sync_soon
                with suppress(trio.ClosedResourceError, trio.BrokenResourceError):  # discovery is over
                    names_in.send_nowait(name)

            def on_change(
                *, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
            ) -> None:  # in the browser's thread
                if state_change is not ServiceStateChange.Removed:
                    with suppress(trio.RunFinishedError):
                        token.run_sync_soon(offer, name)

            async def resolve(name: str) -> None:
                budget_ms = min(_RESOLVE_MAX_MS, (listening.deadline - trio.current_time()) * 1000)
                timeout_ms = max(1, int(budget_ms))
                try:
                    info = await _in_thread(lambda: zc.get_service_info(SERVICE_TYPE, name, timeout_ms))
                except ZeroconfError as exc:
                    logger.warning("mDNS: resolving %s failed: %r", name, exc)
                    info = None
                if info is None:
                    resolving.discard(name)  # a later announcement may retry it
                    return
                advertisement = _parse_advertisement(info, run_id)
                if advertisement is None:
                    return
                found[name] = advertisement
                listening.deadline = min(listening.deadline, trio.current_time() + SIBLING_GRACE_S)

            resolving: set[str] = set()
            with trio.CancelScope(shield=True):  # as in _open_zeroconf: never lose the browser's thread
                browser = await _in_thread(lambda: ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change]))
            with names_in, names_out:
                async with trio.open_nursery() as nursery:
                    async for name in names_out:
                        if name not in resolving:
                            resolving.add(name)
                            nursery.start_soon(resolve, name)
        finally:
            await _close_zeroconf(zc, browser)
    return list(found.values())
