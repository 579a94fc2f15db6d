"""Which addresses this node believes and how often it dials them (DESIGN D10: no amplification).

A node dials addresses it learned from others: the ``listen_addrs`` a dialer states in its identity
proof (:mod:`protocols.handshake`), the contacts of DHT replies, presence records. Believed blindly, they
let one peer make every node dial any ``host:port`` on the Internet (or on the node's own LAN). Two rules
close that:

**1. An address advertised in a handshake is kept only if the connection vouches for it**
(:func:`vouched_addresses`). The connection's observed remote IP ``o`` (what ``accept`` saw) vouches for an
advertised ``/ip4|ip6/<a>/tcp/<port>`` when

* ``a == o`` (IPv4-mapped IPv6 compared as IPv4): the peer can only point at its own machine, and only a
  port of it; or
* ``o`` is a loopback address and ``a`` is loopback or one of this machine's interface addresses: a
  peer that reached us over loopback runs on this machine, so those are its addresses too.

Host names (``/dns…``) are dropped: resolving them is the attacker's choice of target. The addresses that
survive are what :class:`~shared.net.rpc.RequestContext` hands to services (the DHT learns contacts
from them); the others are dropped and counted.

**2. An address from any other source is dialed at a bounded rate per target, and not again after its
far end failed the identity check** (:class:`DialGuard`). After a failed dial (nobody answered, reset,
not TLS 1.3, timeout) the same ``host:port`` is not dialed again for a back-off that starts at
``redial_after_failure`` and doubles per consecutive failure up to ``max_redial_backoff``; calls in
between fail at once with :class:`~shared.errors.PeerUnavailable`. A far end that completed TLS but
failed the identity check — another peer id than the one we were told (``PeerIdMismatch``), another run
(``WrongRun``), a refused proof — is not dialed again for ``identity_block`` seconds: with the same
expected peer id for a mismatch (a restarted node keeps its address but not necessarily its identity,
so the address stays usable for the id it proves now), at all for the other failures. A success
clears the target's back-off. Memory is bounded (oldest entries go first).

A bulk dial of a known peer id may *wait out* a back-off that ends within ``bulk_backoff_wait`` seconds
instead of failing at once (:meth:`shared.net.host.Host._dial`): the members of an averaging round are
peers whose fresh signed tickets named them, and a peer that restarted on its address (a backbone) is
back within seconds; failing its round at once made the members that had tried it during its restart
leave a round the others completed (a fork, seen in the churn test). The waiters of one target dial one
at a time, each after checking the back-off again, so a target still down costs one dial per back-off
period, as before, and the next, doubled back-off (beyond the wait) refuses the rest.

Pure: the caller passes ``now``.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import ConfigError
from .addresses import parse_multiaddr

__all__ = ["DialGuard", "DialPolicy", "vouched_addresses"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
K = TypeVar("K")
V = TypeVar("V")


def _ip(host: str) -> IPAddress | None:
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def vouched_addresses(
    advertised: Iterable[str], observed_host: str, local_hosts: Iterable[str] = ()
) -> tuple[tuple[str, ...], int]:
    """The advertised multiaddrs the connection from ``observed_host`` vouches for (rule 1), and how
    many were dropped. ``local_hosts`` are this machine's interface addresses."""
    observed = _ip(observed_host)
    local = {ip for ip in map(_ip, local_hosts) if ip is not None}
    kept: list[str] = []
    dropped = 0
    for text in advertised:
        try:
            address = _ip(parse_multiaddr(text).host)
        except ConfigError:
            address = None
        if observed is not None and address is not None and _vouches(observed, address, local):
            kept.append(text)
        else:
            dropped += 1
    return tuple(kept), dropped


def _vouches(observed: IPAddress, address: IPAddress, local: set[IPAddress]) -> bool:
    if address == observed:
        return True
    return observed.is_loopback and (address.is_loopback or address in local)


@dataclass(frozen=True)
class DialPolicy:
    redial_after_failure: float = 0.5  # first back-off after a failed dial of a target
    max_redial_backoff: float = 8.0  # the back-off doubles up to this
    identity_block: float = 600.0  # a target that failed the identity check is not redialed this long
    max_entries: int = 4096  # targets remembered


class DialGuard:
    """Per-target dial back-off and identity-failure memory (rule 2 of the module docstring)."""

    def __init__(self, policy: DialPolicy | None = None) -> None:
        self.policy = policy or DialPolicy()
        # (host, port) -> (not before, consecutive failures)
        self._backoff: OrderedDict[tuple[str, int], tuple[float, int]] = OrderedDict()
        # (host, port, expected peer id or "*") -> not before
        self._blocked: OrderedDict[tuple[str, int, str], float] = OrderedDict()
        self.refused = 0

    def refusal(self, host: str, port: int, peer_id: str | None, now: float) -> str | None:
        """Why ``host:port`` (expected to be ``peer_id``) must not be dialed now, or ``None``."""
        for key in ((host, port, "*"), (host, port, peer_id or "")):
            until = self._blocked.get(key)
            if until is not None and now < until:
                self.refused += 1
                return f"{host}:{port} failed the identity check; not redialed for {until - now:.0f} s"
        entry = self._backoff.get((host, port))
        if entry is not None and now < entry[0]:
            self.refused += 1
            return f"{host}:{port} failed {entry[1]} time(s) in a row; next dial in {entry[0] - now:.1f} s"
        return None

    def backoff_left(self, host: str, port: int, now: float) -> float:
        """Seconds until ``host:port`` may be dialed again after failed dials (0: now); identity blocks
        are not counted (see :meth:`refusal`)."""
        entry = self._backoff.get((host, port))
        return max(0.0, entry[0] - now) if entry is not None else 0.0

    def failed(self, host: str, port: int, now: float) -> None:
        """A dial of ``host:port`` failed before the identity check (unreachable, reset, timeout)."""
        _, count = self._backoff.pop((host, port), (0.0, 0))
        delay = min(self.policy.redial_after_failure * 2**count, self.policy.max_redial_backoff)
        self._backoff[(host, port)] = (now + delay, count + 1)
        _trim(self._backoff, self.policy.max_entries)

    def failed_identity(self, host: str, port: int, peer_id: str | None, now: float) -> None:
        """The far end of ``host:port`` failed the identity check: it is not ``peer_id`` (pass the
        expected id), or (``peer_id=None``) it is of another run or refused our proof."""
        key = (host, port, peer_id or "*")
        self._blocked.pop(key, None)
        self._blocked[key] = now + self.policy.identity_block
        _trim(self._blocked, self.policy.max_entries)

    def succeeded(self, host: str, port: int) -> None:
        self._backoff.pop((host, port), None)


def _trim(table: OrderedDict[K, V], limit: int) -> None:
    while len(table) > limit:
        table.popitem(last=False)
