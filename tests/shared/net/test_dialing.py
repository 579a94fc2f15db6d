"""The pure rules of shared.net.dialing: which advertised addresses a connection vouches for, and the
per-target dial back-off (issue 9, finding 12b)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.net.dialing import DialGuard, DialPolicy, vouched_addresses

PEER = "12D3KooWPsaVb6yEtVZarNQrgEX5wdApFdHiEKbgfqJEV976uxKg"


@pytest.mark.parametrize(
    ("advertised", "observed", "kept"),
    [
        ("/ip4/198.51.100.7/tcp/4001", "198.51.100.7", True),  # its own IP, any port
        (f"/ip4/198.51.100.7/tcp/9/p2p/{PEER}", "::ffff:198.51.100.7", True),  # IPv4-mapped observation
        ("/ip4/198.51.100.8/tcp/4001", "198.51.100.7", False),  # someone else's machine
        ("/ip4/127.0.0.1/tcp/4001", "198.51.100.7", False),  # our own loopback, named by a stranger
        ("/ip4/10.0.0.9/tcp/4001", "198.51.100.7", False),  # our LAN, named by a stranger
        ("/ip4/127.0.0.1/tcp/4001", "127.0.0.1", True),
        ("/ip4/127.0.0.5/tcp/4001", "127.0.0.1", True),  # any loopback address is this machine
        ("/ip4/10.1.2.3/tcp/4001", "127.0.0.1", True),  # this machine's interface (local_hosts below)
        ("/ip4/10.1.2.4/tcp/4001", "127.0.0.1", False),  # not an address of this machine
        ("/ip6/::1/tcp/4001", "::1", True),
        ("/dns4/example.org/tcp/443", "198.51.100.7", False),  # names resolve to the attacker's choice
        ("not a multiaddr", "198.51.100.7", False),
    ],
)
def test_vouched_addresses_keeps_only_what_the_connection_vouches_for(
    advertised: str, observed: str, kept: bool
) -> None:
    addrs, dropped = vouched_addresses([advertised], observed, local_hosts=["10.1.2.3", "127.0.0.1"])
    assert addrs == ((advertised,) if kept else ())
    assert dropped == (0 if kept else 1)


@settings(max_examples=100, deadline=None, database=None, derandomize=True)
@given(a=st.ip_addresses(v=4), o=st.ip_addresses(v=4), port=st.integers(0, 65535))
def test_vouched_addresses_never_keeps_another_ip_unless_over_loopback(
    a: object, o: object, port: int
) -> None:
    addrs, _ = vouched_addresses([f"/ip4/{a}/tcp/{port}"], str(o))
    assert not addrs or a == o or o.is_loopback  # type: ignore[attr-defined]


def test_dial_guard_backs_off_doubling_up_to_its_cap_and_forgets_on_success() -> None:
    guard = DialGuard(DialPolicy(redial_after_failure=1.0, max_redial_backoff=4.0))
    assert guard.refusal("h", 1, None, 0.0) is None
    delays = []
    now = 0.0
    for _ in range(4):
        guard.failed("h", 1, now)
        start = now
        while guard.refusal("h", 1, None, now) is not None:
            now += 0.5
        delays.append(now - start)
    assert delays == [1.0, 2.0, 4.0, 4.0]
    assert guard.refusal("h", 2, None, 0.0) is None  # another target is not affected
    guard.succeeded("h", 1)
    guard.failed("h", 1, now)
    assert guard.refusal("h", 1, None, now + 1.0) is None  # back to the first step


def test_dial_guard_blocks_a_target_that_failed_the_identity_check() -> None:
    guard = DialGuard(DialPolicy(identity_block=100.0))
    guard.failed_identity("h", 1, "QmA", 0.0)  # h:1 is not QmA
    assert guard.refusal("h", 1, "QmA", 99.0) is not None
    assert guard.refusal("h", 1, "QmB", 1.0) is None  # whoever is really there may still be dialed
    assert guard.refusal("h", 1, "QmA", 100.0) is None
    guard.failed_identity("h", 1, None, 0.0)  # h:1 is of another run: nobody there is for us
    assert guard.refusal("h", 1, "QmB", 50.0) is not None
    assert guard.refused == 2


def test_dial_guard_memory_is_bounded() -> None:
    guard = DialGuard(DialPolicy(max_entries=8))
    for port in range(100):
        guard.failed("h", port, 0.0)
        guard.failed_identity("h", port, None, 0.0)
    assert guard.refusal("h", 0, None, 0.1) is None  # the oldest were forgotten
    assert guard.refusal("h", 99, None, 0.1) is not None
