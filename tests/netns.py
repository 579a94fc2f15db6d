"""A throwaway LAN of network namespaces for tests that need multicast (mDNS), which loopback lacks.

``lan(n)`` builds one "switch" namespace holding a Linux bridge ``br0`` and ``n`` host namespaces, each with
one veth leg ``eth0`` (its peer ``p<i>`` is a bridge port) addressed ``10.77.<x>.<i+1>/24``. Every link is
created directly inside its namespace (``ip -n``), so nothing is added to, or sent from, the caller's own
network namespace. Namespace names carry a prefix, the pid and a counter; leftovers from dead pids (an
aborted run) are deleted the next time a LAN is built. Needs root and iproute2.

**Bandwidth.** ``lan(n, shape=[(down_mbps, up_mbps), ...])`` (or :func:`set_bandwidth` on a built LAN) caps
each host's upload and download separately with a ``tc`` token bucket (``tbf``), no ``ifb`` needed: upload
on the host's ``eth0`` egress, download on the egress of its bridge port ``p<i>`` in the switch namespace
(everything the bridge forwards to the host leaves through that port). Traffic from ``a`` to ``b`` thus
passes ``a``'s upload cap and then ``b``'s download cap, as on an access link. ``None`` leaves a direction
unshaped. The rates are in Mbit/s (10^6 bit/s) of IP packets; TCP goodput is a few percent lower.
:func:`tcp_throughput_mbps` measures one direction with a plain TCP transfer between two hosts.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

__all__ = [
    "Bandwidth",
    "NetnsHost",
    "lan",
    "netns_available",
    "set_bandwidth",
    "tcp_throughput_mbps",
    "tc_available",
]

PREFIX = "dlt-"
"""Prefix of every namespace this module creates: ``dlt-<pid>-<counter>-<role>``."""

_IP_TIMEOUT_S = 10.0
_counter = itertools.count()
_STALE = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")


Bandwidth = tuple[float | None, float | None]
"""``(down_mbps, up_mbps)`` of one host; ``None`` leaves that direction unshaped."""


@dataclass(frozen=True)
class NetnsHost:
    """One host on the LAN: a namespace whose ``eth0`` has ``address``.

    ``switch`` and ``port`` name the switch namespace and this host's bridge port in it (where its download
    is shaped); they are empty for a host built by hand.
    """

    name: str
    address: str
    switch: str = ""
    port: str = ""

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
    _run_tool("ip", *args)


def _run_tool(tool: str, *args: str) -> None:
    proc = subprocess.run([tool, *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)} failed: {proc.stderr.strip() or proc.returncode}")


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


@cache
def tc_available() -> str | None:
    """``None`` if ``tc`` can shape a veth inside a namespace, else the reason (for ``pytest.skip``)."""
    reason = netns_available()
    if reason is not None:
        return reason
    if shutil.which("tc") is None:
        return "iproute2 `tc` not found"
    probe = f"{_new_prefix()}-probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "name", "vp0", "type", "veth", "peer", "name", "vp1")
        _run_tool("tc", "-n", probe, "qdisc", "replace", "dev", "vp0", "root", *_tbf(10.0))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"tc tbf on a veth failed: {exc}"
    finally:
        _delete_netns(probe)
    return None


def _tbf(mbps: float) -> list[str]:
    """``tbf`` arguments for ``mbps`` Mbit/s.

    The bucket holds 4 ms of traffic but at least 96 KiB, so a GSO super-packet (up to 64 KiB) passes
    whole instead of being re-segmented; the queue holds 50 ms beyond it, enough for TCP to fill the link.
    """
    if not (mbps > 0 and mbps < 1e6):
        raise ValueError(f"a bandwidth cap must be in (0, 1e6) Mbit/s, got {mbps!r}")
    rate = mbps * 1e6 / 8  # bytes/s
    burst = max(96 * 1024, int(rate * 0.004))
    return ["tbf", "rate", f"{int(mbps * 1e6)}bit", "burst", str(burst), "latency", "50ms"]


def _shape(namespace: str, device: str, mbps: float | None) -> None:
    if mbps is None:
        # No qdisc to delete is fine: the device is unshaped either way.
        subprocess.run(
            ["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"],
            capture_output=True,
            timeout=_IP_TIMEOUT_S,
            check=False,
        )
        return
    _run_tool("tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", *_tbf(mbps))


def set_bandwidth(host: NetnsHost, down_mbps: float | None, up_mbps: float | None) -> None:
    """Cap ``host``'s download and upload (Mbit/s; ``None``: unshaped), replacing any earlier caps.

    Raises:
        ValueError: ``host`` was not built by :func:`lan`, or a cap is not a positive number.
        RuntimeError: ``tc`` failed (its stderr is in the message).
    """
    if not host.switch or not host.port:
        raise ValueError(f"{host.name} has no switch port to shape: build it with lan()")
    _shape(host.name, "eth0", up_mbps)
    _shape(host.switch, host.port, down_mbps)


_RECEIVER = """
import json, socket, sys, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], 0))
srv.listen(1)
srv.settimeout(float(sys.argv[2]))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(float(sys.argv[2]))
buf = bytearray(1 << 20)
total, first = 0, None
while n := conn.recv_into(buf):
    first = first or time.monotonic()
    total += n
print(json.dumps({"bytes": total, "seconds": time.monotonic() - (first or time.monotonic())}), flush=True)
"""

_SENDER = """
import socket, sys
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
chunk = bytes(1 << 20)
left = int(sys.argv[3])
while left > 0:
    left -= sock.send(memoryview(chunk)[: min(left, len(chunk))])
sock.shutdown(socket.SHUT_WR)
sock.recv(1)
"""


def tcp_throughput_mbps(sender: NetnsHost, receiver: NetnsHost, nbytes: int, timeout: float = 60.0) -> float:
    """Send ``nbytes`` over one TCP connection from ``sender`` to ``receiver``; the goodput in Mbit/s.

    Timed at the receiver, from the first byte to the end of the stream.

    Raises:
        RuntimeError: either side failed or timed out (its stderr is in the message).
    """
    rx = receiver.popen(
        [sys.executable, "-c", _RECEIVER, receiver.address, str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert rx.stdout is not None
        port = rx.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"throughput receiver did not start: {rx.communicate(timeout=timeout)[1]}")
        tx = sender.run(
            [sys.executable, "-c", _SENDER, receiver.address, port, str(nbytes), str(timeout)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if tx.returncode != 0:
            raise RuntimeError(f"throughput sender failed: {tx.stderr.strip()}")
        out, err = rx.communicate(timeout=timeout)
        if rx.returncode != 0:
            raise RuntimeError(f"throughput receiver failed: {err.strip()}")
        report = json.loads(out.strip().splitlines()[-1])
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    if report["bytes"] != nbytes or report["seconds"] <= 0:
        raise RuntimeError(f"throughput transfer incomplete: {report}")
    return float(report["bytes"]) * 8 / 1e6 / float(report["seconds"])


@contextmanager
def lan(n_hosts: int, shape: Sequence[Bandwidth | None] | None = None) -> Iterator[list[NetnsHost]]:
    """Build a bridged LAN of ``n_hosts`` namespaces; tear it all down on exit, even on failure.

    ``shape`` gives each host ``(down_mbps, up_mbps)`` (or ``None``: unshaped), see :func:`set_bandwidth`.
    """
    if n_hosts < 1:
        raise ValueError(f"a LAN needs at least one host, got {n_hosts}")
    if shape is not None and len(shape) != n_hosts:
        raise ValueError(f"shape has {len(shape)} entries for {n_hosts} hosts")
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
            host = NetnsHost(name=name, address=address, switch=switch, port=port)
            caps = shape[i] if shape is not None else None
            if caps is not None:
                set_bandwidth(host, *caps)
            hosts.append(host)
        yield hosts
    finally:
        for name in reversed(created):
            _delete_netns(name)
