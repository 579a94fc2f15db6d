"""A throwaway LAN of network namespaces for tests that need multicast (mDNS), which loopback lacks.

``lan(n)`` builds one "switch" namespace holding a Linux bridge ``br0`` and ``n`` host namespaces, each with
one veth leg ``eth0`` (its peer ``p<i>`` is a bridge port) addressed ``10.77.<x>.<i+1>/24``. Every link is
created directly inside its namespace (``ip -n``), so nothing is added to, or sent from, the caller's own
network namespace. Namespace names carry a prefix, the pid and a counter; leftovers from dead pids (an
aborted run) are deleted the next time a LAN is built. Needs root and iproute2.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

__all__ = ["NetnsHost", "lan", "netns_available"]

PREFIX = "dlt-"
"""Prefix of every namespace this module creates: ``dlt-<pid>-<counter>-<role>``."""

_IP_TIMEOUT_S = 10.0
_counter = itertools.count()
_STALE = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")


@dataclass(frozen=True)
class NetnsHost:
    """One host on the LAN: a namespace whose ``eth0`` has ``address``."""

    name: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this namespace; ``kw`` goes to :class:`subprocess.Popen`."""
        return subprocess.Popen(self.command(argv), **kw)

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` to completion inside this namespace; ``kw`` goes to :func:`subprocess.run`."""
        return subprocess.run(self.command(argv), **kw)


def _ip(*args: str) -> None:
    """Run ``ip <args>``; raise ``RuntimeError`` carrying its stderr if it fails."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip() or proc.returncode}")


def _delete_netns(name: str) -> None:
    # Deleting a namespace destroys its devices; a veth pair dies with either end.
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=_IP_TIMEOUT_S, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale() -> None:
    """Delete namespaces left by test processes that died before their ``finally`` ran."""
    listing = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
    )
    for line in listing.stdout.splitlines():
        name = line.split(" ", 1)[0]
        match = _STALE.match(name)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            _delete_netns(name)


def _new_prefix() -> str:
    return f"{PREFIX}{os.getpid()}-{next(_counter)}"


@cache
def netns_available() -> str | None:
    """``None`` if this process can build a namespace LAN, else the reason to skip (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "iproute2 `ip` not found"
    probe = f"{_new_prefix()}-probe"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"ip netns add failed: {exc}"
    try:
        _ip("-n", probe, "link", "add", "name", "vp0", "type", "veth", "peer", "name", "vp1")
        _ip("-n", probe, "link", "add", "name", "br0", "type", "bridge")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"veth/bridge creation failed: {exc}"
    finally:
        _delete_netns(probe)
    return None


@contextmanager
def lan(n_hosts: int) -> Iterator[list[NetnsHost]]:
    """Build a bridged LAN of ``n_hosts`` namespaces; tear it all down on exit, even on failure."""
    if n_hosts < 1:
        raise ValueError(f"a LAN needs at least one host, got {n_hosts}")
    _remove_stale()
    prefix = _new_prefix()
    # Each LAN is isolated in its own namespaces, so subnets cannot clash; varying the third octet
    # anyway keeps addresses of concurrent runs distinct in logs.
    subnet = f"10.77.{(os.getpid() * 31 + int(prefix.rsplit('-', 1)[1])) % 254 + 1}"
    switch = f"{prefix}-sw"
    created: list[str] = []
    try:
        _ip("netns", "add", switch)
        created.append(switch)
        _ip("-n", switch, "link", "set", "lo", "up")
        # Snooping off: with no querier on this LAN the bridge must flood all multicast.
        _ip("-n", switch, "link", "add", "name", "br0", "type", "bridge", "mcast_snooping", "0")
        _ip("-n", switch, "link", "set", "br0", "up")
        hosts: list[NetnsHost] = []
        for i in range(n_hosts):
            name = f"{prefix}-h{i}"
            _ip("netns", "add", name)
            created.append(name)
            port = f"p{i}"
            veth = ("type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("-n", switch, "link", "add", "name", port, *veth)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            address = f"{subnet}.{i + 1}"
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", "dev", "eth0", "multicast", "on")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "route", "add", "224.0.0.0/4", "dev", "eth0")
            hosts.append(NetnsHost(name=name, address=address))
        yield hosts
    finally:
        for name in reversed(created):
            _delete_netns(name)
