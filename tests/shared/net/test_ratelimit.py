"""Upload/download caps (shared.net.ratelimit): the token bucket's bound as properties, the trio wrapper on
trio's mock clock, and real connections on 127.0.0.1 that share one capped bucket.

Timings on loopback are noisy on a busy machine: the lower bounds (what a cap guarantees) are firm, with a
small margin; the upper bounds only catch a cap applied twice or pacing gone wrong, and are generous.
"""

from __future__ import annotations

import math
import socket
import time

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.envelope import FRAME_HEADER
from shared.auth.keys import Identity
from shared.net.addresses import parse_multiaddr
from shared.net.connection import LocalEndpoint, SecureConnection, accept, dial
from shared.net.host import Host, HostConfig
from shared.net.probe import ProbeService, measure_bandwidth
from shared.net.ratelimit import (
    MAX_QUANTUM,
    MIN_BURST,
    RateLimit,
    Throttle,
    TokenBucket,
    burst_for,
    quantum_for,
)

from .conftest import RUN_ID, StartHost, address_of
from .test_bulk import Sink

MB = 1_000_000
HANG_GUARD_S = 60
PROPERTY = settings(max_examples=200, deadline=None, database=None, derandomize=True)

rates = st.floats(min_value=1.0, max_value=1e9)
bursts = st.floats(min_value=1.0, max_value=1e7)
# (seconds since the previous request, its share of the burst)
schedules = st.lists(
    st.tuples(st.floats(min_value=0, max_value=2.0), st.floats(min_value=0.0, max_value=1.0)),
    min_size=1,
    max_size=60,
)


def _grants(rate: float, burst: float, schedule: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``(grant time, bytes)`` of each request of ``schedule`` to one bucket."""
    bucket = TokenBucket(rate, burst)
    now, out = 0.0, []
    for gap, share in schedule:
        now += gap * burst / rate  # gaps on the bucket's own time scale: every case is interesting
        n = share * burst
        out.append((now + bucket.reserve(n, now), n))
    return out


@PROPERTY
@given(rates, bursts, schedules)
def test_bytes_granted_in_any_window_are_at_most_rate_times_its_length_plus_the_burst(
    rate: float, burst: float, schedule: list[tuple[float, float]]
) -> None:
    grants = _grants(rate, burst, schedule)
    times = [g for g, _ in grants]
    assert times == sorted(times)  # grants come in request order
    for i, (start, _) in enumerate(grants):
        total = 0.0
        for end, n in grants[i:]:
            total += n
            assert total <= rate * (end - start) + burst + 1e-9 * (total + burst)


@PROPERTY
@given(rates, bursts, st.lists(st.floats(min_value=0.01, max_value=1.0), min_size=1, max_size=60))
def test_a_backlog_is_granted_at_exactly_the_rate(rate: float, burst: float, shares: list[float]) -> None:
    """All requests at once: the first burst goes at once, the rest at the rate (the cap is reached)."""
    grants = _grants(rate, burst, [(0.0, s) for s in shares])
    total = sum(n for _, n in grants)
    expected_last = max(0.0, total - burst) / rate
    assert math.isclose(grants[-1][0], expected_last, rel_tol=1e-9, abs_tol=1e-9 * burst / rate)


@PROPERTY
@given(rates, bursts, schedules)
def test_a_bucket_left_idle_for_burst_over_rate_grants_a_full_burst_at_once(
    rate: float, burst: float, schedule: list[tuple[float, float]]
) -> None:
    bucket = TokenBucket(rate, burst)
    now = 0.0
    for gap, share in schedule:
        now += gap * burst / rate
        bucket.reserve(share * burst, now)
    later = now + bucket.delay(now) + burst / rate
    assert bucket.reserve(burst, later) <= 1e-9 * burst / rate  # 0 but for rounding


@PROPERTY
@given(rates, st.lists(st.tuples(st.floats(min_value=0, max_value=1.0), st.floats(0.0, 1.0)), max_size=60))
def test_reads_charged_afterwards_stay_within_the_bound_plus_one_quantum(
    rate: float, reads: list[tuple[float, float]]
) -> None:
    """The download side: wait out the debt, read at most a quantum, charge it (one reader)."""
    limit = RateLimit(rate, clock=lambda: 0.0)
    bucket, quantum, burst = limit.bucket, limit.quantum, limit.bucket.burst
    now, done = 0.0, []
    for gap, share in reads:
        now += gap * quantum / rate
        now += bucket.delay(now)  # wait_ready
        n = share * quantum
        done.append((now, n))
        bucket.charge(n, now)
    for i, (start, _) in enumerate(done):
        total = 0.0
        for end, n in done[i:]:
            total += n
            assert total <= rate * (end - start) + burst + quantum + 1e-9 * (total + burst)


@PROPERTY
@given(st.floats(min_value=1.0, max_value=1e12))
def test_the_quantum_fits_the_burst(rate: float) -> None:
    assert 0 < quantum_for(rate) <= burst_for(rate)
    assert quantum_for(rate) <= MAX_QUANTUM and burst_for(rate) >= MIN_BURST


@pytest.mark.parametrize("rate", [0, -1.0, math.nan, math.inf, -math.inf])
def test_impossible_rates_are_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="rate limit"):
        RateLimit(rate)
    with pytest.raises(ValueError, match="rate limit"):
        Throttle.from_rates(rate, None)
    with pytest.raises(ValueError, match="rate limit"):
        Host(Identity.generate(), RUN_ID, HostConfig(max_download_bps=rate))


def test_no_caps_no_throttle_and_measurements_are_capped_each_way() -> None:
    assert Throttle.from_rates(None, None) is None
    throttle = Throttle.from_rates(2 * MB, None)
    assert throttle is not None and throttle.download is None
    assert throttle.cap(5 * MB, 7 * MB) == (2 * MB, 7 * MB)
    assert throttle.cap(1 * MB, 7 * MB) == (1 * MB, 7 * MB)


async def test_acquire_sleeps_on_trio_until_the_rate_allows(autojump_clock: trio.testing.MockClock) -> None:
    limit = RateLimit(1 * MB)
    burst = limit.bucket.burst
    started = trio.current_time()
    await limit.acquire(int(burst))  # the first burst: at once
    assert trio.current_time() == started
    await limit.acquire(3 * MB)  # larger than a burst: reserved piece by piece
    assert trio.current_time() - started == pytest.approx(3.0, rel=1e-6)
    await limit.wait_ready()
    limit.charge(MB // 2)
    before = trio.current_time()
    await limit.wait_ready()
    assert trio.current_time() - before == pytest.approx(0.5, rel=1e-6)


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


# ---------------------------------------------------------------- real connections on loopback


async def _pair(client: LocalEndpoint, server: LocalEndpoint) -> tuple[SecureConnection, SecureConnection]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    target = parse_multiaddr(f"/ip4/127.0.0.1/tcp/1/p2p/{server.peer_id}")
    out: dict[str, SecureConnection] = {}
    async with trio.open_nursery() as nursery:

        async def accepted() -> None:
            out["server"] = await accept(server, b, "127.0.0.1:2")

        nursery.start_soon(accepted)
        out["client"] = await dial(client, target, "bulk", raw=a)
    return out["client"], out["server"]


async def _move_frames(sender: SecureConnection, receiver: SecureConnection, nbytes: int) -> None:
    body = bytes(256 * 1024)
    frame = FRAME_HEADER.pack(len(body)) + body
    count = nbytes // len(body)
    async with trio.open_nursery() as nursery:

        async def send() -> None:
            for _ in range(count):
                await sender.send_frame(frame)

        nursery.start_soon(send)
        for _ in range(count):
            assert len(await receiver.receive_frame(len(body))) == len(body)


def _endpoint(throttle: Throttle | None = None) -> LocalEndpoint:
    endpoint = LocalEndpoint(Identity.generate(), RUN_ID)
    endpoint.throttle = throttle
    return endpoint


@pytest.mark.parametrize("way", ["upload", "download"])
async def test_two_connections_share_one_cap_for_framed_messages(way: str) -> None:
    """6 MB over two TLS connections of one node capped at 2 MB/s: about 3 s (one burst less)."""
    capped = _endpoint(
        Throttle.from_rates(2 * MB, None) if way == "upload" else Throttle.from_rates(None, 2 * MB)
    )
    pairs: list[tuple[SecureConnection, SecureConnection]] = []
    try:
        with trio.fail_after(HANG_GUARD_S):
            for _ in range(2):
                pairs.append(await _pair(capped, _endpoint()))
            started = time.monotonic()
            async with trio.open_nursery() as nursery:
                for ours, theirs in pairs:
                    if way == "upload":
                        nursery.start_soon(_move_frames, ours, theirs, 3 * MB)
                    else:
                        nursery.start_soon(_move_frames, theirs, ours, 3 * MB)
            elapsed = time.monotonic() - started
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
    moved = 2 * (3 * MB // (256 * 1024)) * 256 * 1024
    limit = 2 * MB
    floor = (moved - burst_for(limit) - 2 * quantum_for(limit)) / limit  # one burst, a quantum per reader
    assert elapsed >= 0.95 * floor, f"{moved} bytes in {elapsed:.2f} s: faster than the cap allows"
    assert elapsed < 4 * floor + 5, f"{moved} bytes in {elapsed:.2f} s: far slower than the cap"


@pytest.mark.parametrize("way", ["upload", "download"])
async def test_bulk_transfers_of_two_connections_share_one_cap(start_host: StartHost, way: str) -> None:
    """The bulk lane (worker threads) is paced too: 2 x 3 MB to/from two peers at 2 MB/s."""
    caps = {"max_upload_bps": 2 * MB} if way == "upload" else {"max_download_bps": 2 * MB}
    capped = await start_host(HostConfig(dial_deadline=5, **caps))
    others = [await start_host() for _ in range(2)]
    payload = memoryview(bytes(3 * MB))
    if way == "download":
        capped.bulk_handlers["sink"] = Sink()
    else:
        for other in others:
            other.bulk_handlers["sink"] = Sink()
    with trio.fail_after(HANG_GUARD_S):
        # connect first (the handshake and the first empty transfer are not what is timed)
        for other in others:
            if way == "upload":
                await capped.send_bulk(address_of(other), "sink", memoryview(b""))
            else:
                await other.send_bulk(address_of(capped), "sink", memoryview(b""))
        await trio.sleep(burst_for(2 * MB) / (2 * MB))  # a full bucket, as a test of the worst case
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            for other in others:
                if way == "upload":
                    nursery.start_soon(capped.send_bulk, address_of(other), "sink", payload)
                else:
                    nursery.start_soon(other.send_bulk, address_of(capped), "sink", payload)
        elapsed = time.monotonic() - started
    floor = (6 * MB - burst_for(2 * MB)) / (2 * MB)
    assert elapsed >= 0.95 * floor, f"6 MB in {elapsed:.2f} s: faster than the cap allows"
    assert elapsed < 4 * floor + 5, f"6 MB in {elapsed:.2f} s: far slower than the cap"


async def test_measured_bandwidth_never_exceeds_the_hosts_caps(start_host: StartHost) -> None:
    server = await start_host()
    ProbeService(server)
    client = await start_host(HostConfig(dial_deadline=5, max_upload_bps=20 * MB, max_download_bps=30 * MB))
    with trio.fail_after(HANG_GUARD_S):
        up, down = await measure_bandwidth(client, address_of(server), 4 * (1 << 20))
    # 4 MiB with a 2-3 MB burst on loopback would measure far above the caps without the min()
    assert 0 < up <= 20 * MB and 0 < down <= 30 * MB
