"""Multiaddrs as this engine uses them: ``/ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>[/p2p/<peer-id>]``,
and relayed ones: ``/ip4/<relay-ip>/tcp/<port>/p2p/<relay-id>/p2p-circuit/p2p/<target-id>`` (dial the
relay, proven to be ``relay-id``, and ask it for a circuit to ``target-id``; see :mod:`shared.net.relay`).
A relayed :class:`PeerAddress` carries the relay's own address (with its peer id) in ``relay``; its
``host``/``port`` are the relay's, its ``peer_id`` the target's (always present).

Parsing happens once, at the edge (CLI flags, DHT contact records); the rest of the engine passes
:class:`PeerAddress` values around.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterable
from dataclasses import dataclass

import ifaddr
import multiaddr
import multiaddr.exceptions

from protocols.peer_id import PeerId, validate_peer_id

from ..errors import ConfigError

__all__ = [
    "PeerAddress",
    "expand_unspecified",
    "format_multiaddr",
    "local_hosts",
    "parse_multiaddr",
    "relayed",
]

_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


@dataclass(frozen=True)
class PeerAddress:
    """Where to dial: a TCP endpoint and, if known, the peer id expected there."""

    host: str
    port: int
    peer_id: PeerId | None = None
    proto: str = "ip4"
    #: the relay's own address (with its peer id) when this address is reached through a relay
    relay: PeerAddress | None = None

    @classmethod
    def dial_back(cls, peer_id: PeerId) -> PeerAddress:
        """A peer that accepts no connections, reached over one it opens to us on request
        (:mod:`protocols.reversal`); only :class:`~shared.net.host.Host` bulk transfers can use it."""
        return cls("", 0, peer_id, "dial-back")

    @property
    def is_dial_back(self) -> bool:
        return self.proto == "dial-back"

    def with_peer(self, peer_id: PeerId) -> PeerAddress:
        return PeerAddress(self.host, self.port, peer_id, self.proto, self.relay)

    def __str__(self) -> str:
        if self.relay is not None:
            return f"{self.relay}/p2p-circuit/p2p/{self.peer_id}"
        if self.is_dial_back:
            return f"/p2p/{self.peer_id} (dial-back)"
        return format_multiaddr(self.host, self.port, self.peer_id, self.proto)


def relayed(relay: PeerAddress, target: PeerId) -> PeerAddress:
    """The address of ``target`` reached through ``relay`` (which must carry its peer id).

    Raises:
        ConfigError: ``relay`` has no peer id or is itself relayed.
    """
    if relay.peer_id is None or relay.relay is not None:
        raise ConfigError(f"a relay address needs a peer id and no relay of its own, got {relay}")
    return PeerAddress(relay.host, relay.port, target, relay.proto, relay)


def parse_multiaddr(text: str) -> PeerAddress:
    """Parse a TCP multiaddr, with or without a trailing ``/p2p/<peer-id>``, or a relayed one
    (``<relay multiaddr with /p2p/<relay-id>>/p2p-circuit/p2p/<target-id>``).

    Raises:
        ConfigError: not a multiaddr, not TCP, or a malformed peer id; the message quotes the input.
    """
    head, circuit, tail = text.partition("/p2p-circuit")
    if circuit:
        relay = parse_multiaddr(head)
        if relay.peer_id is None:
            raise ConfigError(f"{text!r}: the relay before /p2p-circuit needs its /p2p/<peer-id>")
        parts = tail.split("/")
        if len(parts) != 3 or parts[:2] != ["", "p2p"]:
            raise ConfigError(f"{text!r}: /p2p-circuit must be followed by exactly /p2p/<target-id>")
        try:
            target = validate_peer_id(parts[2])
        except ValueError as exc:
            raise ConfigError(f"{text!r}: {exc}") from exc
        return relayed(relay, target)
    try:
        ma = multiaddr.Multiaddr(text)
        names = [p.name for p in ma.protocols()]
    except (multiaddr.exceptions.Error, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{text!r} is not a valid multiaddr ({exc})") from exc
    if len(names) not in (2, 3) or names[0] not in _HOST_PROTOCOLS or names[1] != "tcp":
        raise ConfigError(f"{text!r} is not a TCP multiaddr like /ip4/203.0.113.7/tcp/4001/p2p/12D3KooW…")
    if len(names) == 3 and names[2] != "p2p":
        raise ConfigError(f"{text!r}: only /p2p/<peer-id> may follow /tcp/<port>")
    host = ma.value_for_protocol(names[0])
    port = int(ma.value_for_protocol("tcp"))
    peer_id: PeerId | None = None
    if len(names) == 3:
        try:
            peer_id = validate_peer_id(ma.value_for_protocol("p2p"))
        except ValueError as exc:
            raise ConfigError(f"{text!r}: {exc}") from exc
    if not 0 <= port <= 65535:
        raise ConfigError(f"{text!r}: port {port} out of range")
    return PeerAddress(host, port, peer_id, names[0])


def format_multiaddr(host: str, port: int, peer_id: str | None = None, proto: str | None = None) -> str:
    if proto is None:
        try:
            proto = "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
        except ValueError:
            proto = "dns"
    text = f"/{proto}/{host}/tcp/{port}"
    return f"{text}/p2p/{peer_id}" if peer_id else text


def expand_unspecified(host: str) -> list[str]:
    """The concrete addresses a listener on ``host`` can be reached at.

    ``0.0.0.0`` / ``::`` become every configured interface address of that family (loopback included,
    listed last); any other host is returned as is.
    """
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return [host]
    if not ip.is_unspecified:
        return [host]
    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for entry in adapter.ips:
            value = entry.ip if isinstance(entry.ip, str) else entry.ip[0]
            try:
                candidate = ipaddress.ip_address(value.split("%")[0])
            except ValueError:
                continue
            if candidate.version == ip.version and not candidate.is_link_local:
                found.append(str(candidate))
    return _loopback_last(dict.fromkeys(found))


def _loopback_last(hosts: Iterable[str]) -> list[str]:
    ordered = sorted(hosts, key=lambda h: ipaddress.ip_address(h).is_loopback)
    return ordered or ["127.0.0.1"]


_LOCAL_CACHE: tuple[float, frozenset[str]] = (-1e9, frozenset())


def local_hosts(max_age: float = 30.0) -> frozenset[str]:
    """This machine's interface addresses (both families, loopback included), re-read at most every
    ``max_age`` seconds."""
    global _LOCAL_CACHE
    stamp, hosts = _LOCAL_CACHE
    now = time.monotonic()
    if now - stamp > max_age:
        hosts = frozenset([*expand_unspecified("0.0.0.0"), *expand_unspecified("::")])
        _LOCAL_CACHE = (now, hosts)
    return hosts
