"""Relay fallback (shared.net.reachability.relay_candidates and keep_relayed with candidates).

The candidate order is a pure function, checked by properties. On loopback, a target holding a slot at
relay R1 loses R1 (its host stops): it reserves at R2 (a candidate "found in the DHT") at once, not after
RELAY_RETRY, and a dialer reaches it through R2; with no candidate left it ends in client mode.
"""

from __future__ import annotations

import trio
from hypothesis import given
from hypothesis import strategies as st

from protocols.peer_id import PeerId
from shared.auth.keys import Identity
from shared.net.addresses import PeerAddress, relayed
from shared.net.host import Host, HostConfig
from shared.net.reachability import RELAY_RETRY, keep_relayed, relay_candidates
from shared.net.relay import RelayService

from .conftest import RUN_ID, StartHost, address_of
from .test_relay import RelayEcho, RelayEchoReply

HANG_GUARD_S = 20
IDS = [PeerId(f"peer{i}") for i in range(8)]  # the function only compares peer ids; no key needed here


def _address(peer: PeerId, port: int = 4001) -> PeerAddress:
    return PeerAddress("192.0.2.1", port, peer, "ip4")


@given(
    first=st.none() | st.sampled_from(IDS),
    found=st.lists(st.tuples(st.sampled_from(IDS), st.integers(1, 9)), max_size=12),
    own=st.sampled_from(IDS),
    failed=st.dictionaries(st.sampled_from(IDS), st.floats(0, 100)),
    now=st.floats(0, 200),
)
def test_candidates_checker_first_no_self_no_recent_failure_no_duplicates(
    first: PeerId | None,
    found: list[tuple[PeerId, int]],
    own: PeerId,
    failed: dict[str, float],
    now: float,
) -> None:
    head = None if first is None else _address(first)
    others = [_address(p, port) for p, port in found]
    out = relay_candidates(head, others, own, failed, now, retry=30.0)

    ids = [a.peer_id for a in out]
    assert len(ids) == len(set(ids))  # one address per relay
    assert own not in ids
    assert all(p not in failed or now - failed[p] >= 30.0 for p in ids)
    eligible = {a.peer_id for a in [*([head] if head else []), *others]} - {own}
    eligible -= {p for p, t in failed.items() if now - t < 30.0}
    assert set(ids) == eligible  # nobody usable is left out
    if head is not None and head.peer_id in eligible:
        assert out[0] == head  # the checker first
    assert all(a == head or a in others for a in out)  # addresses are taken as given, never made up


@given(st.permutations(IDS[1:]))
def test_candidate_order_does_not_depend_on_how_the_dht_listed_them(order: list[PeerId]) -> None:
    """Rendezvous order: a function of (own, relay) only, so clients of a dead relay spread out."""
    listed = [_address(p) for p in order]
    assert relay_candidates(None, listed, IDS[0], {}, 0.0) == relay_candidates(
        None, sorted(listed, key=str), IDS[0], {}, 0.0
    )


def test_a_relay_that_failed_is_tried_again_after_the_retry_delay() -> None:
    checker = _address(IDS[1])
    assert relay_candidates(checker, [], IDS[0], {IDS[1]: 10.0}, 10.0 + RELAY_RETRY - 1) == []
    assert relay_candidates(checker, [], IDS[0], {IDS[1]: 10.0}, 10.0 + RELAY_RETRY) == [checker]


# ---------------------------------------------------------------- on loopback, real hosts


async def _echo_target(start_host: StartHost) -> Host:
    target = await start_host()

    async def echo(ctx: object, request: RelayEcho) -> RelayEchoReply:
        return RelayEchoReply(text=request.text, relayed=True)

    target.registry.add(RelayEcho, echo)
    return target


async def test_a_target_whose_relay_dies_reserves_at_the_next_candidate_at_once(
    nursery: trio.Nursery, start_host: StartHost
) -> None:
    # R1 runs in its own scope so that the test can kill it; R2 and the others live as long as the test
    r1_scope = trio.CancelScope()
    r1 = Host(Identity.generate(), RUN_ID, HostConfig(dial_deadline=5))

    async def run_r1(task_status: trio.TaskStatus[None]) -> None:
        with r1_scope:
            await r1.run(["/ip4/127.0.0.1/tcp/0"], task_status=task_status)

    await nursery.start(run_r1)
    RelayService(r1)
    r2 = await start_host()
    r2_service = RelayService(r2)
    target = await _echo_target(start_host)
    dialer = await start_host()
    changes: list[tuple[str, ...]] = []
    changed = trio.Event()

    def on_change(addresses: tuple[str, ...]) -> None:
        changes.append(addresses)
        changed.set()

    looked_up = 0

    async def found() -> list[PeerAddress]:  # what the DHT's relay records would say: both relays
        nonlocal looked_up
        looked_up += 1
        return [address_of(r2), address_of(r1), address_of(target)]  # ourselves too: skipped

    nursery.start_soon(lambda: keep_relayed(target, address_of(r1), on_change, candidates=found))
    with trio.fail_after(HANG_GUARD_S):
        while not changes or not changes[-1]:
            changed = trio.Event()
            await changed.wait()
    via_r1 = str(relayed(address_of(r1), target.peer_id))
    assert changes == [(via_r1,)]  # the checker first
    assert target.advertised_addrs == [via_r1]
    reply = await dialer.call(relayed(address_of(r1), target.peer_id), RelayEcho(text="one"))
    assert isinstance(reply, RelayEchoReply)

    r1_scope.cancel()  # R1 dies: its connections close
    started = trio.current_time()
    via_r2 = str(relayed(address_of(r2), target.peer_id))
    with trio.fail_after(HANG_GUARD_S):
        while not changes or changes[-1] != (via_r2,):
            changed = trio.Event()
            await changed.wait()
    took = trio.current_time() - started
    assert took < RELAY_RETRY / 3, f"fell back after {took:.1f} s"
    assert () in changes[1:]  # it advertised nothing between losing R1 and holding R2
    assert target.advertised_addrs == [via_r2]
    assert r2_service.statistics().reservations == 1
    reply = await dialer.call(relayed(address_of(r2), target.peer_id), RelayEcho(text="two"))
    assert isinstance(reply, RelayEchoReply) and reply.text == "two"
    assert r2_service.statistics().circuits_granted == 1
    assert looked_up >= 2


async def test_with_no_relay_left_the_target_ends_in_client_mode(
    nursery: trio.Nursery, start_host: StartHost
) -> None:
    target = await start_host()
    dead = await start_host()  # a host that serves no relay: its reservation is refused
    changes: list[tuple[str, ...]] = []
    done = trio.Event()

    def on_change(addresses: tuple[str, ...]) -> None:
        changes.append(addresses)
        done.set()

    async def found() -> list[PeerAddress]:
        return [address_of(dead)]

    nursery.start_soon(lambda: keep_relayed(target, address_of(dead), on_change, candidates=found))
    with trio.fail_after(HANG_GUARD_S):
        await done.wait()
    assert changes == [()]
    assert target.advertised_addrs == []
