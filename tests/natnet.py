"""Home networks behind NAT, built from network namespaces, for the reachability tests (issue 14).

``nat_network(public=P, homes=[...])`` builds::

    public segment 198.51.100.0/24 (bridge br0 in the "pub" switch namespace)
      ├── public host i        198.51.100.<1+i>       (a backbone, a reachable volunteer, a relay)
      ├── router of home h     198.51.100.<101+h> wan ── NAT ── lan0 192.168.1.1/24
      │                                                         ├── home host 192.168.1.10
      │                                                         └── home host 192.168.1.11 …
      └── …

Every home uses the *same* private subnet, 192.168.1.0/24, as real homes do: a private address announced
by a peer in one home names a different machine (or nobody) in another, which is exactly the confusion
the address-hygiene rules must avoid.

**A router** forwards its LAN to the public segment with ``iptables -t nat … MASQUERADE`` and behaves like
a home router: it drops (not rejects) every unsolicited connection from the outside, to itself or to the
LAN, and lets in only packets of connections its LAN opened (conntrack ``ESTABLISHED,RELATED``). Its NAT is
"cone-like" by default: Linux keeps a connection's source port when it is free, so one local port maps to
the same public port whatever the destination, and a simultaneous TCP open through two such routers
succeeds (hole punching). ``Home(symmetric=True)`` uses ``MASQUERADE --random-fully`` instead: every
connection gets a random public port, so the port a relay observed is not the port a punch leaves from,
and punching must fail.

**Public hosts** get a default route out of their ``eth0`` (nobody answers beyond the segment), so a dial
to a private or otherwise unreachable address really sends a SYN instead of failing at ``connect``; every
host (public and home) counts the connection attempts it makes, by class, in its own ``OUTPUT`` chain
(:func:`syn_counts`): ``loopback`` (SYNs sent over ``lo``), ``private`` (to RFC 1918 addresses over
``eth0``) and ``all`` (every SYN over ``eth0``). A test then asserts how many attempts went where no peer
can be: a public host dialing 192.168/16, a home host dialing 127.0.0.1 (its own loopback: another
peer's announced port).

Needs root, iproute2 and iptables (:func:`nat_available` says why not); namespaces are named like
:mod:`tests.netns`'s (``dlt-<pid>-<counter>-…``), so stale ones from a dead run are removed the same way.
Everything is torn down on exit, also on failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache

from tests.netns import NetnsHost, _delete_netns, _ip, _new_prefix, _remove_stale, _run_tool, netns_available

__all__ = ["Home", "HomeNet", "NatNetwork", "nat_available", "nat_network", "syn_counts"]

PUBLIC_SUBNET = "198.51.100"
HOME_SUBNET = "192.168.1"
PRIVATE_RANGES = "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16"
_CLASSES = ("loopback", "private", "all")


@dataclass(frozen=True)
class Home:
    """What to build for one home: ``hosts`` machines behind one router; ``symmetric``: a symmetric NAT."""

    hosts: int = 1
    symmetric: bool = False


@dataclass(frozen=True)
class HomeNet:
    """A built home: its ``router`` (``address``: the public address its LAN is seen from) and ``hosts``."""

    router: NetnsHost
    hosts: list[NetnsHost]
    symmetric: bool


@dataclass(frozen=True)
class NatNetwork:
    public: list[NetnsHost]
    homes: list[HomeNet]
    switch: str
    namespaces: list[str] = field(default_factory=list)

    @property
    def every_host(self) -> list[NetnsHost]:
        return [*self.public, *(h for home in self.homes for h in home.hosts)]


@cache
def nat_available() -> str | None:
    """``None`` if NAT routers can be built here, else the reason to skip (for ``pytest.skip``)."""
    reason = netns_available()
    if reason is not None:
        return reason
    if shutil.which("iptables") is None:
        return "iptables not found (apt-get install iptables)"
    probe = f"{_new_prefix()}-natprobe"
    try:
        _ip("netns", "add", probe)
        _iptables(probe, "-t", "nat", "-A", "POSTROUTING", "-o", "lo", "-j", "MASQUERADE", "--random-fully")
        _iptables(
            probe, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"
        )
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"iptables NAT in a namespace failed: {exc}"
    finally:
        _delete_netns(probe)
    return None


def _iptables(namespace: str, *args: str) -> None:
    _run_tool("ip", "netns", "exec", namespace, "iptables", "-w", "5", *args)


def _sysctl(namespace: str, *settings: str) -> None:
    _run_tool("ip", "netns", "exec", namespace, "sysctl", "-qw", *settings)


def _count_syns(namespace: str) -> None:
    """Counting rules in ``namespace``'s OUTPUT chain, one per class (they only count: no target)."""
    syn = ("-p", "tcp", "--syn")
    _iptables(namespace, "-A", "OUTPUT", "-o", "lo", *syn, "-m", "comment", "--comment", "loopback")
    private = ("-d", PRIVATE_RANGES)
    _iptables(
        namespace, "-A", "OUTPUT", "-o", "eth0", *private, *syn, "-m", "comment", "--comment", "private"
    )
    _iptables(namespace, "-A", "OUTPUT", "-o", "eth0", *syn, "-m", "comment", "--comment", "all")


def syn_counts(host: NetnsHost) -> dict[str, int]:
    """SYNs ``host`` has sent so far: ``{"loopback": n, "private": n, "all": n}`` (module docstring).

    A connection attempt retransmits its SYN when nobody answers, so an unanswered attempt counts more than
    once; zero is the only count these tests compare against exactly.
    """
    listing = subprocess.run(
        host.command(["iptables", "-w", "5", "-L", "OUTPUT", "-v", "-x", "-n"]),
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    counts = dict.fromkeys(_CLASSES, 0)
    for line in listing.splitlines():
        for name in _CLASSES:
            if f"/* {name} */" in line:
                counts[name] += int(line.split()[0])
    return counts


def _veth(namespace: str, outside: str, host: str, inside: str = "eth0") -> None:
    """A veth pair: ``outside`` stays in ``namespace``, ``inside`` goes to ``host``'s namespace."""
    _ip(
        "-n", namespace, "link", "add", "name", outside, "type", "veth", "peer", "name", inside, "netns", host
    )
    _ip("-n", namespace, "link", "set", outside, "up")


def _bridge(namespace: str, name: str) -> None:
    # Snooping off: with no querier the bridge must flood all multicast (mDNS inside a home works).
    _ip("-n", namespace, "link", "add", "name", name, "type", "bridge", "mcast_snooping", "0")
    _ip("-n", namespace, "link", "set", name, "up")


def _host(name: str, address: str, gateway: str | None) -> None:
    _ip("-n", name, "link", "set", "lo", "up")
    _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
    _ip("-n", name, "link", "set", "eth0", "up")
    _ip("-n", name, "route", "add", "224.0.0.0/4", "dev", "eth0")
    if gateway is None:
        _ip("-n", name, "route", "add", "default", "dev", "eth0")
    else:
        _ip("-n", name, "route", "add", "default", "via", gateway)
    _count_syns(name)


def _router(name: str, symmetric: bool) -> None:
    _sysctl(name, "net.ipv4.ip_forward=1", "net.ipv4.conf.all.arp_ignore=1")
    masquerade = ["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
    _iptables(name, *masquerade, *(["--random-fully"] if symmetric else []))
    established = ("-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
    _iptables(name, "-P", "FORWARD", "DROP")
    # (where br_netfilter is loaded, frames bridged between two LAN hosts pass FORWARD as lan0 -> lan0)
    _iptables(name, "-A", "FORWARD", "-i", "lan0", "-o", "lan0", "-j", "ACCEPT")
    _iptables(name, "-A", "FORWARD", "-i", "lan0", "-o", "wan", "-j", "ACCEPT")
    _iptables(name, "-A", "FORWARD", "-i", "wan", "-o", "lan0", *established)
    _iptables(name, "-A", "INPUT", "-i", "wan", *established)
    _iptables(name, "-A", "INPUT", "-i", "wan", "-j", "DROP")


@contextmanager
def nat_network(public: int = 1, homes: Sequence[Home] = (Home(), Home())) -> Iterator[NatNetwork]:
    """Build ``public`` public hosts and one NATed home per entry of ``homes``; tear all down on exit.

    Raises:
        ValueError: bad counts.
        RuntimeError: ``ip``/``iptables`` failed (see :func:`nat_available` to skip instead).
    """
    if public < 0 or len(homes) > 100 or any(not 1 <= h.hosts <= 100 for h in homes):
        raise ValueError(f"public={public}, homes={homes}: need public >= 0, <= 100 homes of 1..100 hosts")
    _remove_stale()
    prefix = _new_prefix()
    switch = f"{prefix}-pub"
    created: list[str] = []

    def namespace(name: str) -> str:
        _ip("netns", "add", name)
        created.append(name)
        return name

    try:
        namespace(switch)
        _ip("-n", switch, "link", "set", "lo", "up")
        _bridge(switch, "br0")
        public_hosts: list[NetnsHost] = []
        for i in range(public):
            name = namespace(f"{prefix}-pub{i}")
            _veth(switch, f"p{i}", name)
            _ip("-n", switch, "link", "set", f"p{i}", "master", "br0")
            address = f"{PUBLIC_SUBNET}.{1 + i}"
            _host(name, address, None)
            public_hosts.append(NetnsHost(name, address, switch, f"p{i}"))
        built: list[HomeNet] = []
        for h, home in enumerate(homes):
            router = namespace(f"{prefix}-r{h}")
            _ip("-n", router, "link", "set", "lo", "up")
            _veth(switch, f"r{h}", router, "wan")
            _ip("-n", switch, "link", "set", f"r{h}", "master", "br0")
            wan = f"{PUBLIC_SUBNET}.{101 + h}"
            _ip("-n", router, "addr", "add", f"{wan}/24", "dev", "wan")
            _ip("-n", router, "link", "set", "wan", "up")
            _bridge(router, "lan0")
            _ip("-n", router, "addr", "add", f"{HOME_SUBNET}.1/24", "dev", "lan0")
            _router(router, home.symmetric)
            hosts: list[NetnsHost] = []
            for j in range(home.hosts):
                name = namespace(f"{prefix}-h{h}x{j}")
                _veth(router, f"l{j}", name)
                _ip("-n", router, "link", "set", f"l{j}", "master", "lan0")
                address = f"{HOME_SUBNET}.{10 + j}"
                _host(name, address, f"{HOME_SUBNET}.1")
                hosts.append(NetnsHost(name, address, router, f"l{j}"))
            built.append(HomeNet(NetnsHost(router, wan, switch, f"r{h}"), hosts, home.symmetric))
        yield NatNetwork(public_hosts, built, switch, list(created))
    finally:
        for name in reversed(created):
            _delete_netns(name)


def require_nat() -> None:
    """Skip the calling test where the machine cannot build NAT routers; under CI (``$CI`` set) fail."""
    import pytest

    reason = nat_available()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the NAT tests, but: {reason}")
        pytest.skip(reason)
