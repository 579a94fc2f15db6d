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

**Latency.** ``lan(n, rtt_ms=X)`` gives every pair of hosts a round-trip time of about ``X`` ms;
``lan(n, delay_ms=[d0, d1, ...])`` gives host ``i`` an access link of one-way latency ``d_i`` in each
direction, so hosts ``a`` and ``b`` see ``RTT = 2 (d_a + d_b)`` (``rtt_ms=X`` is ``d_i = X / 4`` for all).
This kernel has no ``netem`` (nor ``fq``, which a BPF departure-time program would need), so the delay is a
userspace "wire", ``tests/netdelay.py``: for a delayed host the veth pair ``eth0``/``p<i>`` becomes two
pairs, ``eth0``/``h<i>`` and ``s<i>``/``p<i>``, with ``h<i>``, ``s<i>`` and the bridge port ``p<i>`` all in
the switch namespace, and one process in that namespace per host copies frames between ``h<i>`` and ``s<i>``
after ``d_i`` in each direction (raw packet sockets carrying the offload state; see its docstring)::

    host i: eth0 [tbf up] ── h<i> ═ netdelay d_i ═ s<i> ── p<i> [tbf down] ── br0 (switch namespace)

The wires sit in the switch namespace, not the host's, because that namespace has no IP address: frames
reaching ``h<i>``/``s<i>`` can only be forwarded, never answered (in the host's namespace an extra device
would answer ARP for the host's address and take delivery of broadcasts, bypassing the delay). IPv6 is off
in a delayed LAN's switch namespace, so its devices send nothing of their own (bridging of IPv6 frames is
unaffected). Symmetric one-way delays (rather than the whole ``X / 2`` on the way out) keep the one-way
latency between two hosts the same both ways, as on real access links; each frame is held twice (once per
wire), which costs no more than holding it once, since every frame is copied by both wires anyway.
Without ``rtt_ms``/``delay_ms`` (or for a host with delay 0) the LAN is built exactly as without latency:
one veth pair, no process.

A wire process is started with a raised priority (nice -10): frames are late by its scheduling latency,
and on a loaded machine a fair share would add tens of milliseconds. ``lan`` waits until every wire reports
it is ready, stops them (end of file on their stdin; ``SIGKILL`` after 5 s) and reaps them on exit, also on
errors, and raises :class:`LinkError` with the wire's stderr if one died before that (a dead wire is a link
that drops everything); :func:`check_links` asks the same at any time.

**Queue sizing.** ``tbf``'s queue holds ``max(50 ms, RTT)`` of traffic at the capped rate (``RTT``: the
largest emulated round trip from that host) on top of its bucket: a single TCP flow needs a bottleneck
buffer of about one bandwidth-delay product to keep the link full after a loss (CUBIC backs off to 0.7 of
its window, so 0.43 BDP is the bare minimum), and a queue of a fixed 50 ms would starve long-RTT paths.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = [
    "Bandwidth",
    "LinkError",
    "NetnsHost",
    "check_links",
    "lan",
    "netns_available",
    "set_bandwidth",
    "tcp_rtt_ms",
    "tcp_throughput_mbps",
    "tc_available",
]

PREFIX = "dlt-"
"""Prefix of every namespace this module creates: ``dlt-<pid>-<counter>-<role>``."""

_IP_TIMEOUT_S = 10.0
_WIRE = Path(__file__).with_name("netdelay.py")
_WIRE_NICE = -10
_WIRE_READY_S = 30.0  # a wire process must report it is ready within this
_WIRE_STOP_S = 5.0  # after its stdin closes, before SIGKILL
_QUEUE_MIN_MS = 50.0
_counter = itertools.count()
_STALE = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")


Bandwidth = tuple[float | None, float | None]
"""``(down_mbps, up_mbps)`` of one host; ``None`` leaves that direction unshaped."""


@dataclass(frozen=True)
class NetnsHost:
    """One host on the LAN: a namespace whose ``eth0`` has ``address``.

    ``switch`` and ``port`` name the switch namespace and this host's bridge port in it (where its download
    is shaped); they are empty for a host built by hand. ``delay_ms`` is the one-way latency of its access
    link in each direction, ``max_rtt_ms`` the largest emulated round trip to another host on its LAN (its
    ``tbf`` queues are sized for it).
    """

    name: str
    address: str
    switch: str = ""
    port: str = ""
    delay_ms: float = 0.0
    max_rtt_ms: float = 0.0

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


def _tbf(mbps: float, rtt_ms: float = 0.0) -> list[str]:
    """``tbf`` arguments for ``mbps`` Mbit/s on a path whose round trip is at most ``rtt_ms``.

    The bucket holds 4 ms of traffic but at least 96 KiB, so a GSO super-packet (up to 64 KiB) passes
    whole instead of being re-segmented; the queue holds ``max(50 ms, rtt_ms)`` beyond it, about one
    bandwidth-delay product, enough for TCP to fill the link (module docstring, "Queue sizing").
    """
    if not (mbps > 0 and mbps < 1e6):
        raise ValueError(f"a bandwidth cap must be in (0, 1e6) Mbit/s, got {mbps!r}")
    rate = mbps * 1e6 / 8  # bytes/s
    burst = max(96 * 1024, int(rate * 0.004))
    queue_ms = max(_QUEUE_MIN_MS, rtt_ms)
    return ["tbf", "rate", f"{int(mbps * 1e6)}bit", "burst", str(burst), "latency", f"{queue_ms:.0f}ms"]


def _shape(namespace: str, device: str, mbps: float | None, rtt_ms: float = 0.0) -> None:
    if mbps is None:
        # No qdisc to delete is fine: the device is unshaped either way.
        subprocess.run(
            ["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"],
            capture_output=True,
            timeout=_IP_TIMEOUT_S,
            check=False,
        )
        return
    _run_tool("tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", *_tbf(mbps, rtt_ms))


def set_bandwidth(host: NetnsHost, down_mbps: float | None, up_mbps: float | None) -> None:
    """Cap ``host``'s download and upload (Mbit/s; ``None``: unshaped), replacing any earlier caps.

    Raises:
        ValueError: ``host`` was not built by :func:`lan`, or a cap is not a positive number.
        RuntimeError: ``tc`` failed (its stderr is in the message).
    """
    if not host.switch or not host.port:
        raise ValueError(f"{host.name} has no switch port to shape: build it with lan()")
    _shape(host.name, "eth0", up_mbps, host.max_rtt_ms)
    _shape(host.switch, host.port, down_mbps, host.max_rtt_ms)


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


_ECHO = """
import socket, sys
srv = socket.socket()
srv.bind((sys.argv[1], 0))
srv.listen(1)
srv.settimeout(float(sys.argv[2]))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(float(sys.argv[2]))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(64):
    conn.sendall(data)
"""

_PINGER = """
import json, socket, sys, time
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
samples = []
for _ in range(int(sys.argv[3])):
    start = time.monotonic()
    sock.sendall(b"x")
    if sock.recv(64) != b"x":
        sys.exit("echo mismatch")
    samples.append((time.monotonic() - start) * 1000)
print(json.dumps(samples), flush=True)
"""


@contextmanager
def _serving(
    host: NetnsHost, code: str, args: Sequence[str], what: str, timeout: float
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Run the one-file server ``code`` on ``host`` (it prints its port first); yield it and its port, then
    kill and reap it.

    Raises:
        RuntimeError: it did not start (its stderr is in the message).
    """
    proc = host.popen(
        [sys.executable, "-c", code, host.address, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"{what} did not start: {proc.communicate(timeout=timeout)[1]}")
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def tcp_rtt_ms(client: NetnsHost, server: NetnsHost, count: int = 10, timeout: float = 30.0) -> list[float]:
    """Round trips (ms) of ``count`` one-byte TCP ping-pongs from ``client`` to an echo on ``server``.

    Raises:
        RuntimeError: either side failed or timed out (its stderr is in the message).
    """
    with _serving(server, _ECHO, [str(timeout)], "echo server", timeout) as (_, port):
        ping = client.run(
            [sys.executable, "-c", _PINGER, server.address, port, str(count), str(timeout)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if ping.returncode != 0:
            raise RuntimeError(f"ping-pong client failed: {ping.stderr.strip()}")
        samples = json.loads(ping.stdout.strip().splitlines()[-1])
    return [float(x) for x in samples]


def tcp_throughput_mbps(sender: NetnsHost, receiver: NetnsHost, nbytes: int, timeout: float = 60.0) -> float:
    """Send ``nbytes`` over one TCP connection from ``sender`` to ``receiver``; the goodput in Mbit/s.

    Timed at the receiver, from the first byte to the end of the stream.

    Raises:
        RuntimeError: either side failed or timed out (its stderr is in the message).
    """
    with _serving(receiver, _RECEIVER, [str(timeout)], "throughput receiver", timeout) as (rx, port):
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
    if report["bytes"] != nbytes or report["seconds"] <= 0:
        raise RuntimeError(f"throughput transfer incomplete: {report}")
    return float(report["bytes"]) * 8 / 1e6 / float(report["seconds"])


class LinkError(RuntimeError):
    """A latency wire of a LAN died (its host's link drops every frame), or would not start."""


@dataclass
class _Wire:
    host: str
    proc: subprocess.Popen[bytes]
    _failure: str | None = None

    def failure(self) -> str | None:
        """``None`` while the process runs, else its exit status and stderr."""
        if self._failure is None and (rc := self.proc.poll()) is not None:
            assert self.proc.stderr is not None
            err = self.proc.stderr.read().decode(errors="replace").strip()
            self._failure = f"the delay wire of {self.host} exited with status {rc}: {err or '(no stderr)'}"
        return self._failure


_wires: dict[str, list[_Wire]] = {}
"""Running wires by switch namespace, for :func:`check_links`."""


def access_delays(n_hosts: int, rtt_ms: float | None, delay_ms: Sequence[float | None] | None) -> list[float]:
    """Each host's one-way access delay (ms, each direction) from ``lan``'s ``rtt_ms`` or ``delay_ms``.

    ``rtt_ms = X`` gives every host ``X / 4``, so any two see ``2 (X/4 + X/4) = X``; ``delay_ms`` is per host
    (``None``: 0). Raises ``ValueError`` for both at once, a wrong length, or a delay outside [0, 10 s).
    """
    if rtt_ms is not None and delay_ms is not None:
        raise ValueError("give rtt_ms (every pair) or delay_ms (per host), not both")
    if rtt_ms is not None:
        if not (rtt_ms >= 0 and rtt_ms < 40_000):
            raise ValueError(f"rtt_ms must be in [0, 40000), got {rtt_ms!r}")
        return [rtt_ms / 4] * n_hosts
    if delay_ms is None:
        return [0.0] * n_hosts
    if len(delay_ms) != n_hosts:
        raise ValueError(f"delay_ms has {len(delay_ms)} entries for {n_hosts} hosts")
    delays = [0.0 if d is None else float(d) for d in delay_ms]
    for d in delays:
        if not (d >= 0 and d < 10_000):
            raise ValueError(f"a one-way delay must be in [0, 10000) ms, got {d!r}")
    return delays


def max_rtts(delays: Sequence[float]) -> list[float]:
    """For each host, the largest round trip (ms) to another host: ``2 (d_i + max_{j != i} d_j)``
    (``2 d_i`` alone on a one-host LAN)."""
    out = []
    for i, d in enumerate(delays):
        others = [e for j, e in enumerate(delays) if j != i]
        out.append(2 * (d + max(others, default=0.0)))
    return out


def check_links(hosts: Sequence[NetnsHost]) -> None:
    """Raise :class:`LinkError` if a delay wire of ``hosts``' LAN has died (their links would drop all)."""
    failures = [
        msg for switch in {h.switch for h in hosts} for w in _wires.get(switch, []) if (msg := w.failure())
    ]
    if failures:
        raise LinkError("; ".join(failures))


def _start_wires(switch: str, delayed: Sequence[tuple[NetnsHost, int]]) -> None:
    """Start one ``netdelay`` process in ``switch`` per ``(host, index)`` and wait until each is ready.

    Each is registered in ``_wires[switch]`` as soon as it starts, so the caller can stop every process
    started so far (:func:`_stop_wires`) whatever happens.
    """
    wires: list[_Wire] = []
    _wires[switch] = wires
    for host, i in delayed:
        argv = [sys.executable, str(_WIRE), f"h{i}", f"s{i}", repr(host.delay_ms), "--nice", str(_WIRE_NICE)]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", switch, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        wires.append(_Wire(host.name, proc))
    deadline = time.monotonic() + _WIRE_READY_S
    for wire in wires:
        out = wire.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
        line = out.readline() if ready else b""
        if line.strip() != b"ready":
            if wire.proc.poll() is None:
                raise LinkError(f"the delay wire of {wire.host} did not start within {_WIRE_READY_S:.0f} s")
            raise LinkError(wire.failure() or f"the delay wire of {wire.host} did not start")


def _stop_wires(wires: Sequence[_Wire]) -> list[str]:
    """Stop and reap ``wires``; the failures of those that had died before."""
    failures = [msg for w in wires if (msg := w.failure())]
    for w in wires:
        if w.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                w.proc.stdin.close()  # end of file: the wire exits
    deadline = time.monotonic() + _WIRE_STOP_S
    for w in wires:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        for stream in (w.proc.stdout, w.proc.stderr):
            if stream is not None:
                stream.close()
    return failures


def _add_link(switch: str, host: NetnsHost, i: int) -> None:
    """Connect ``host``'s ``eth0`` to bridge port ``p<i>``: one veth pair, or with a delay wire, two."""
    to_host = ("type", "veth", "peer", "name", "eth0", "netns", host.name)
    if host.delay_ms > 0:
        _ip("-n", switch, "link", "add", "name", f"h{i}", *to_host)
        _ip("-n", switch, "link", "add", "name", host.port, "type", "veth", "peer", "name", f"s{i}")
        for device in (f"h{i}", f"s{i}"):
            _ip("-n", switch, "link", "set", device, "up")
    else:
        _ip("-n", switch, "link", "add", "name", host.port, *to_host)
    _ip("-n", switch, "link", "set", host.port, "master", "br0")
    _ip("-n", switch, "link", "set", host.port, "up")


@contextmanager
def lan(
    n_hosts: int,
    shape: Sequence[Bandwidth | None] | None = None,
    rtt_ms: float | None = None,
    delay_ms: Sequence[float | None] | None = None,
) -> Iterator[list[NetnsHost]]:
    """Build a bridged LAN of ``n_hosts`` namespaces; tear it all down on exit, even on failure.

    ``shape`` gives each host ``(down_mbps, up_mbps)`` (or ``None``: unshaped), see :func:`set_bandwidth`.
    ``rtt_ms`` gives every pair of hosts that round-trip time; ``delay_ms`` instead gives each host the
    one-way latency of its access link (module docstring, "Latency").

    Raises:
        ValueError: bad arguments.
        RuntimeError: ``ip``/``tc`` failed; :class:`LinkError` (a subclass) if a delay wire would not start,
            or had died by the time the ``with`` block ended (chained to the block's exception, if any).
    """
    if n_hosts < 1:
        raise ValueError(f"a LAN needs at least one host, got {n_hosts}")
    if shape is not None and len(shape) != n_hosts:
        raise ValueError(f"shape has {len(shape)} entries for {n_hosts} hosts")
    delays = access_delays(n_hosts, rtt_ms, delay_ms)
    rtts = max_rtts(delays)
    _remove_stale()
    prefix = _new_prefix()
    # Each LAN is isolated in its own namespaces, so subnets cannot clash; varying the third octet
    # anyway keeps addresses of concurrent runs distinct in logs.
    subnet = f"10.77.{(os.getpid() * 31 + int(prefix.rsplit('-', 1)[1])) % 254 + 1}"
    switch = f"{prefix}-sw"
    created: list[str] = []
    body_error: BaseException | None = None
    try:
        _ip("netns", "add", switch)
        created.append(switch)
        _ip("-n", switch, "link", "set", "lo", "up")
        if any(delays) and os.path.isdir("/proc/sys/net/ipv6"):
            # The wires' devices must not send frames of their own (router solicitations, MLD reports).
            _run_tool(
                "ip", "netns", "exec", switch, "sysctl", "-qw",
                "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
            )  # fmt: skip
        # Snooping off: with no querier on this LAN the bridge must flood all multicast.
        _ip("-n", switch, "link", "add", "name", "br0", "type", "bridge", "mcast_snooping", "0")
        _ip("-n", switch, "link", "set", "br0", "up")
        hosts: list[NetnsHost] = []
        for i in range(n_hosts):
            name = f"{prefix}-h{i}"
            _ip("netns", "add", name)
            created.append(name)
            address = f"{subnet}.{i + 1}"
            host = NetnsHost(name, address, switch, f"p{i}", delays[i], rtts[i])
            _add_link(switch, host, i)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", "dev", "eth0", "multicast", "on")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "route", "add", "224.0.0.0/4", "dev", "eth0")
            caps = shape[i] if shape is not None else None
            if caps is not None:
                set_bandwidth(host, *caps)
            hosts.append(host)
        delayed = [(h, i) for i, h in enumerate(hosts) if h.delay_ms > 0]
        if delayed:
            _start_wires(switch, delayed)
        yield hosts
    except BaseException as exc:
        body_error = exc
        raise
    finally:
        failures = _stop_wires(_wires.pop(switch, []))
        for name in reversed(created):
            _delete_netns(name)
        if failures and not isinstance(body_error, LinkError):
            report = "; ".join(failures)
            if body_error is None or isinstance(body_error, Exception):
                raise LinkError(report) from body_error
            print(f"tests.netns: {report}", file=sys.stderr)
