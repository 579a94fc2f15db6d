"""Emulated latency on the namespace LAN (``tests/netns.py``'s delay wires, ``tests/netdelay.py``): the
delay line's rules as properties, and on a real LAN the round trip, TCP throughput under a cap, and that
no wire process outlives its LAN or dies unnoticed.

Timing bounds are generous (a round trip of ``X`` ms must lie in ``[0.8 X, 1.5 X + 5]``, a capped transfer
reach 70% of its cap): on a shared 2-core machine a wire can be late by its scheduling latency.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.netdelay import SO_TIMESTAMPNS, DelayLine, arrival, poll_timeout_ms
from tests.netns import (
    LinkError,
    access_delays,
    check_links,
    lan,
    max_rtts,
    netns_available,
    tc_available,
    tcp_rtt_ms,
    tcp_throughput_mbps,
)
from tests.netns import _wires as running_wires


@pytest.fixture
def _need_tc() -> None:
    reason = netns_available() or tc_available()
    if reason is not None:
        pytest.skip(f"network namespaces with tc shaping unavailable: {reason}")


# ------------------------------------------------------------------------------------------ pure rules

times = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(
    delay=st.floats(min_value=0, max_value=10, allow_nan=False),
    gaps=st.lists(st.floats(min_value=0, max_value=1, allow_nan=False), max_size=40),
    polls=st.lists(st.floats(min_value=0, max_value=2, allow_nan=False), max_size=40),
)
def test_delay_line_releases_each_item_once_in_order_never_early(
    delay: float, gaps: list[float], polls: list[float]
) -> None:
    line: DelayLine[int] = DelayLine(delay)
    pushed_at: list[float] = []
    now = 0.0
    for i, gap in enumerate(gaps):
        now += gap
        line.push(i, now)
        pushed_at.append(now)
    out: list[int] = []
    t = now
    for step in polls:
        t += step
        for item in line.pop_due(t):
            assert pushed_at[item] + delay <= t  # never before its due time
            out.append(item)
        due = line.next_due()
        assert due is None or due > t  # everything due was released
    out += line.pop_due(now + delay)  # by then every item is due
    assert out == list(range(len(gaps)))
    assert len(line) == 0 and line.next_due() is None


@given(delay=st.floats(min_value=0, max_value=1, allow_nan=False), first=times, back=times)
def test_delay_line_stays_fifo_when_the_clock_steps_back(delay: float, first: float, back: float) -> None:
    line: DelayLine[str] = DelayLine(delay)
    line.push("a", first)
    line.push("b", first - back)  # received "earlier": must not overtake, nor be due before "a"
    assert line.pop_due(first + delay) == ["a", "b"]


@pytest.mark.parametrize("delay", [-0.001, 3600.0, float("nan"), float("inf")])
def test_delay_line_refuses_a_nonsense_delay(delay: float) -> None:
    with pytest.raises(ValueError, match="delay"):
        DelayLine(delay)


@given(now=times, wait=st.floats(min_value=-10, max_value=10, allow_nan=False))
def test_poll_timeout_is_the_nearest_millisecond_and_never_negative(now: float, wait: float) -> None:
    assert poll_timeout_ms(None, now) is None
    ms = poll_timeout_ms(now + wait, now)
    assert ms is not None and ms >= 0
    if wait > 0:
        assert abs(ms - wait * 1000) <= 0.5 + 1e-6 * max(1.0, now)  # float rounding of now + wait
    else:
        assert ms == 0


def test_arrival_converts_the_kernel_wall_clock_stamp_and_falls_back_to_now() -> None:
    stamp = [(socket.SOL_SOCKET, SO_TIMESTAMPNS, struct.pack("qq", 1000, 250_000_000))]
    assert arrival(stamp, real_now=1000.75, mono_now=50.0) == pytest.approx(49.5)
    assert arrival([], real_now=1000.75, mono_now=50.0) == 50.0
    assert arrival(stamp, real_now=999.0, mono_now=50.0) == 50.0  # a stamp in the future: now


@given(n=st.integers(1, 30), rtt=st.floats(min_value=0, max_value=39_999, allow_nan=False))
def test_rtt_ms_gives_every_pair_that_round_trip(n: int, rtt: float) -> None:
    delays = access_delays(n, rtt, None)
    assert len(delays) == n
    for a in range(n):
        for b in range(n):
            if a != b:
                assert 2 * (delays[a] + delays[b]) == pytest.approx(rtt)
    assert all(m == pytest.approx(rtt) for m in max_rtts(delays)) or n == 1


@given(st.lists(st.floats(min_value=0, max_value=9_999, allow_nan=False), min_size=1, max_size=12))
def test_max_rtt_is_the_largest_round_trip_to_another_host(delays: list[float]) -> None:
    rtts = max_rtts(delays)
    for i, d in enumerate(delays):
        pairs = [2 * (d + e) for j, e in enumerate(delays) if j != i]
        assert rtts[i] == pytest.approx(max(pairs, default=2 * d))


def test_latency_arguments_are_checked() -> None:
    assert access_delays(3, None, None) == [0.0, 0.0, 0.0]
    assert access_delays(2, None, [None, 5]) == [0.0, 5.0]
    bad: list[tuple[float | None, list[float] | None, str]] = [
        (10.0, [1.0, 1.0], "not both"),
        (-1.0, None, "rtt_ms must be"),
        (float("nan"), None, "rtt_ms must be"),
        (None, [1.0], "1 entries for 2 hosts"),
        (None, [1.0, -2.0], "one-way delay must be"),
    ]
    for rtt, delays, message in bad:
        with pytest.raises(ValueError, match=message):
            access_delays(2, rtt, delays)


# ------------------------------------------------------------------------------------------ on a LAN


def _my_namespaces() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line for line in listing.splitlines() if line.startswith(f"dlt-{os.getpid()}-")]


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.usefixtures("_need_tc")
def test_rtt_between_every_pair_and_tcp_fills_a_capped_link() -> None:
    rtt = 50.0
    with lan(3, shape=[(20, 20), (20, 20), None], rtt_ms=rtt) as hosts:
        wires = list(running_wires[hosts[0].switch])
        assert len(wires) == 3
        for a, b in [(0, 1), (1, 2), (2, 0)]:
            samples = tcp_rtt_ms(hosts[a], hosts[b], count=10)
            median = statistics.median(samples)
            assert 0.8 * rtt <= median <= 1.5 * rtt + 5, (a, b, samples)
        # 20 Mbit/s both ways on 50 ms: a bandwidth-delay product of 125 kB that TCP must keep in flight
        mbps = tcp_throughput_mbps(hosts[0], hosts[1], 6_000_000)
        assert mbps >= 0.7 * 20, mbps
        assert mbps <= 1.5 * 20, mbps
        check_links(hosts)
    for wire in wires:
        assert wire.proc.returncode == 0  # stopped by end of file, reaped
        assert not os.path.exists(f"/proc/{wire.proc.pid}")
    assert _my_namespaces() == []


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.usefixtures("_need_tc")
def test_per_host_delays_add_up_and_an_undelayed_lan_has_no_wires() -> None:
    with lan(3, delay_ms=[5, 20, None]) as hosts:
        assert [h.delay_ms for h in hosts] == [5.0, 20.0, 0.0]
        assert len(running_wires[hosts[0].switch]) == 2  # host 2's link is a plain veth pair
        for (a, b), expected in [((0, 1), 50.0), ((0, 2), 10.0), ((1, 2), 40.0)]:
            median = statistics.median(tcp_rtt_ms(hosts[a], hosts[b], count=10))
            assert 0.8 * expected <= median <= 1.5 * expected + 5, (a, b, median)
    with lan(2) as hosts:
        assert hosts[0].switch not in running_wires
        assert statistics.median(tcp_rtt_ms(hosts[0], hosts[1], count=5)) < 5


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.usefixtures("_need_tc")
def test_a_dead_wire_is_reported_and_the_rest_are_reaped() -> None:
    dead = r"delay wire of .*-h1 exited with status -9"
    with pytest.raises(LinkError, match=dead), lan(3, rtt_ms=20) as hosts:  # noqa: PT012
        wires = list(running_wires[hosts[0].switch])
        os.kill(wires[1].proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while wires[1].proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(LinkError, match=dead):
            check_links(hosts)
    assert [w.proc.returncode for w in wires] == [0, -9, 0]
    assert _my_namespaces() == []


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.usefixtures("_need_tc")
def test_an_error_inside_the_lan_still_stops_every_wire() -> None:
    with pytest.raises(KeyError, match="boom"), lan(2, rtt_ms=10) as hosts:  # noqa: PT012
        wires = list(running_wires[hosts[0].switch])
        raise KeyError("boom")
    assert all(w.proc.returncode == 0 for w in wires)
    assert hosts[0].switch not in running_wires
    assert _my_namespaces() == []


_MCAST_RECEIVER = """
import socket, struct, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("", 45_454))
group = struct.pack("4s4s", socket.inet_aton("239.7.7.7"), socket.inet_aton(sys.argv[1]))
sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, group)
sock.settimeout(20)
print("joined", flush=True)
print(sock.recv(100).decode(), flush=True)
"""

_MCAST_SENDER = """
import socket, sys, time
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(sys.argv[1]))
for _ in range(20):  # until the receiver's join has crossed the wires too
    sock.sendto(b"hello over the wire", ("239.7.7.7", 45_454))
    time.sleep(0.1)
"""


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.usefixtures("_need_tc")
def test_multicast_crosses_the_delay_wires() -> None:
    """mDNS discovery must work on a LAN with latency too: the wires forward multicast like the bridge."""
    with lan(2, rtt_ms=40) as (a, b):
        rx = b.popen(
            [sys.executable, "-c", _MCAST_RECEIVER, b.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert rx.stdout is not None
            assert rx.stdout.readline().strip() == "joined"
            a.run([sys.executable, "-c", _MCAST_SENDER, a.address], check=True, timeout=30)
            out, err = rx.communicate(timeout=30)
        finally:
            if rx.poll() is None:
                rx.kill()
            rx.wait()
        assert rx.returncode == 0, err
        assert out.strip() == "hello over the wire"
