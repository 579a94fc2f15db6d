"""The circuit relay on loopback (shared.net.relay, protocols.relay, the relay branch of Host._dial).

Three hosts on 127.0.0.1: a relay R, a target T holding a reservation at R, and a dialer D that reaches T
only through T's relayed address. Loopback has no NAT, so "T accepts nothing directly" is not enforced
here; what is checked is that the relayed path is the one taken (R splices the bytes, the connection says
it is relayed) and that R sees only ciphertext.
"""

from __future__ import annotations

import hashlib
import random
import socket
from typing import ClassVar

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from protocols.bulk import BulkHeader
from protocols.envelope import Message, Request, register
from protocols.peer_id import PeerId
from protocols.relay import (
    MAGIC,
    OBSERVE_MAGIC,
    PREAMBLE_BYTES,
    CircuitGranted,
    CircuitRequest,
    PunchConnect,
    parse_preamble,
)
from shared.auth.keys import Identity
from shared.errors import ConfigError, HandshakeError, Overloaded, PeerUnavailable, RemoteError
from shared.net.addresses import PeerAddress, parse_multiaddr, relayed
from shared.net.bulk import BulkReader
from shared.net.host import Host, HostConfig
from shared.net.punch import HolePuncher, split_host_port
from shared.net.relay import RelayClient, RelayLimits, RelayService, observe_address
from shared.net.rpc import RequestContext

from .conftest import StartHost, address_of

HANG_GUARD_S = 20
MiB = 1 << 20
MARKER = b"PLAINTEXT-MARKER-the-relay-must-never-see-this"


@register
class RelayEchoReply(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "test.relay.echo.ok"
    text: str
    relayed: bool


@register
class RelayEcho(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "test.relay.echo"
    response: ClassVar[type[Message]] = RelayEchoReply
    text: str


class Tap:
    """Everything R forwards, as R sees it."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.forwarded = 0
        self.threshold = 0
        self.reached = trio.Event()

    def __call__(self, direction: str, data: bytes) -> None:
        self.chunks.append(data)
        self.forwarded += len(data)
        if self.threshold and self.forwarded >= self.threshold:
            self.reached.set()

    def seen(self) -> bytes:
        return b"".join(self.chunks)


async def _sink(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
    buffer = bytearray(header.nbytes)
    await reader.read_into(memoryview(buffer))
    return hashlib.sha256(buffer).digest()


async def _setup(
    start_host: StartHost, limits: RelayLimits | None = None, config: HostConfig | None = None
) -> tuple[Host, Host, Host, RelayService, RelayClient, Tap]:
    relay = await start_host(config)
    target = await start_host(config)
    dialer = await start_host(config)
    tap = Tap()
    service = RelayService(relay, limits, tap=tap)
    client = RelayClient(target)

    async def echo(ctx: RequestContext, request: RelayEcho) -> RelayEchoReply:
        channel = target.channel_for(ctx.peer_id)
        return RelayEchoReply(
            text=request.text, relayed=channel is not None and channel.conn.via == "relayed"
        )

    target.registry.add(RelayEcho, echo)
    target.bulk_handlers["sink"] = _sink
    await client.reserve(address_of(relay))
    return relay, target, dialer, service, client, tap


# ---------------------------------------------------------------- addresses


def test_relayed_multiaddr_round_trips_and_carries_the_relay() -> None:
    relay_id, target_id = Identity.generate().peer_id, Identity.generate().peer_id
    text = f"/ip4/203.0.113.7/tcp/4001/p2p/{relay_id}/p2p-circuit/p2p/{target_id}"

    address = parse_multiaddr(text)

    assert address.relay == PeerAddress("203.0.113.7", 4001, relay_id, "ip4")
    assert (address.host, address.port, address.peer_id) == ("203.0.113.7", 4001, target_id)
    assert str(address) == text
    assert address == relayed(address.relay, target_id)
    assert str(address.with_peer(target_id)) == text


@pytest.mark.parametrize(
    "suffix",
    [
        "/p2p-circuit",  # no target
        "/p2p-circuit/p2p/notapeerid",
        "/p2p-circuit/p2p/{t}/p2p-circuit/p2p/{t}",  # nested circuits
        "/p2p-circuit/tcp/5",
        "/p2p-circuitx/p2p/{t}",
    ],
)
def test_malformed_relayed_multiaddrs_are_config_errors(suffix: str) -> None:
    relay_id, target_id = Identity.generate().peer_id, Identity.generate().peer_id
    with pytest.raises(ConfigError):
        parse_multiaddr(f"/ip4/203.0.113.7/tcp/4001/p2p/{relay_id}" + suffix.format(t=target_id))
    with pytest.raises(ConfigError):  # the relay must name its peer id
        parse_multiaddr(f"/ip4/203.0.113.7/tcp/4001/p2p-circuit/p2p/{target_id}")


def test_parse_preamble_accepts_only_the_two_fixed_forms() -> None:
    token = bytes(range(16))
    assert parse_preamble(MAGIC + token) == ("circuit", token)
    assert parse_preamble(OBSERVE_MAGIC + bytes(16)) == ("observe", b"")
    assert parse_preamble(OBSERVE_MAGIC + token) is None
    assert parse_preamble(MAGIC + token[:-1]) is None
    assert parse_preamble(b"\x16" + bytes(PREAMBLE_BYTES - 1)) is None
    assert MAGIC[0] != 0x16 and len(MAGIC + token) == PREAMBLE_BYTES


# ---------------------------------------------------------------- the relayed path


async def test_rpc_and_bulk_through_the_relay_are_end_to_end_encrypted(start_host: StartHost) -> None:
    relay, target, dialer, service, _, tap = await _setup(start_host)
    address = relayed(address_of(relay), target.peer_id)
    data = (MARKER * (4 * MiB // len(MARKER) + 1))[: 4 * MiB]

    with trio.fail_after(HANG_GUARD_S):
        reply = await dialer.call(address, RelayEcho(text=MARKER.decode()))
        ack = await dialer.send_bulk(address, "sink", data)

    assert isinstance(reply, RelayEchoReply)
    assert reply.text == MARKER.decode() and reply.relayed
    assert ack == hashlib.sha256(data).digest()
    assert dialer.connection_kind(target.peer_id) == "relayed"
    assert target.connection_kind(dialer.peer_id) == "relayed"
    seen = tap.seen()
    assert len(seen) > len(data)  # every byte of the transfer went through R ...
    assert MARKER not in seen  # ... and none of it in the clear
    assert service.bytes_relayed()[(dialer.peer_id, target.peer_id)] == len(seen)
    stats = service.statistics()
    assert stats.circuits_granted == 2 and stats.reservations == 1  # one RPC, one bulk circuit
    assert stats.refused == {}


async def test_both_ends_count_what_they_received_through_the_relay_a_little_below_its_claim(
    start_host: StartHost,
) -> None:
    """The ledger's evidence of relaying (shared.net.relaytraffic): the dialer and the target each count
    the plaintext bytes they received through R; together they are what R spliced, less TLS's overhead."""
    from shared.net.relaytraffic import relayed_since

    relay, target, dialer, service, _, _ = await _setup(start_host)
    claim = relayed_since(service)
    address = relayed(address_of(relay), target.peer_id)
    data = bytes(range(256)) * (2 * MiB // 256)
    with trio.fail_after(HANG_GUARD_S):
        await dialer.call(address, RelayEcho(text="hi"))
        await dialer.send_bulk(address, "sink", data)
        while target.relay_traffic.connections < 2:  # the bulk lane's reader registers as it is served
            await trio.sleep(0.01)
    at_target, at_dialer = target.relay_traffic.take(), dialer.relay_traffic.take()
    assert set(at_target) == set(at_dialer) == {relay.peer_id}
    received = at_target[relay.peer_id] + at_dialer[relay.peer_id]
    spliced = claim()
    assert at_target[relay.peer_id] >= len(data)  # the transfer reached the target through R
    assert 0.97 * spliced <= received <= spliced  # TLS's framing and handshakes: a few percent at most
    assert relay.relay_traffic.take() == {}  # the relay itself received nothing *through* a relay
    # delta-readable: nothing new since the last read; a second call adds only its own bytes
    assert target.relay_traffic.take() == {} and claim() == 0
    with trio.fail_after(HANG_GUARD_S):
        await dialer.call(address, RelayEcho(text="again"))
    again = target.relay_traffic.take()[relay.peer_id] + dialer.relay_traffic.take()[relay.peer_id]
    assert 0 < again <= claim() < 4096


async def test_the_relay_itself_reaches_its_target_over_the_targets_own_connection(
    start_host: StartHost,
) -> None:
    """A relay dialing a relayed address through itself would splice to itself; it asks the target to dial
    back instead (protocols.reversal), over the connection the reservation keeps open."""
    relay, target, _, service, _, _ = await _setup(start_host)
    address = relayed(address_of(relay), target.peer_id)
    data = bytes(range(256)) * 1000
    with trio.fail_after(HANG_GUARD_S):
        reply = await relay.call(address, RelayEcho(text="hi"))
        ack = await relay.send_bulk(address, "sink", data)
    assert isinstance(reply, RelayEchoReply) and reply.text == "hi"
    assert ack == hashlib.sha256(data).digest()
    assert service.statistics().circuits_granted == 0
    assert relay.statistics().reverse_lanes == 1 and target.statistics().dial_backs == 1


async def test_dialer_without_reservation_at_target_gets_peer_unavailable(start_host: StartHost) -> None:
    relay, stranger = await start_host(), await start_host()
    dialer = await start_host()
    service = RelayService(relay)

    with trio.fail_after(HANG_GUARD_S), pytest.raises(PeerUnavailable, match="no reservation"):
        await dialer.call(relayed(address_of(relay), stranger.peer_id), RelayEcho(text="x"))
    assert service.statistics().circuits_refused == 1


async def test_a_failed_relayed_dial_backs_off_without_asking_the_relay_again(start_host: StartHost) -> None:
    relay, stranger, dialer = await start_host(), await start_host(), await start_host()
    service = RelayService(relay)
    address = relayed(address_of(relay), stranger.peer_id)

    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(PeerUnavailable, match="no reservation"):
            await dialer.call(address, RelayEcho(text="x"))
        with pytest.raises(PeerUnavailable, match="not dialing"):
            await dialer.call(address, RelayEcho(text="x"))
        await dialer.connect(address_of(relay))  # the relay itself is not backed off

    assert service.statistics().circuits_refused == 1
    assert dialer.statistics().dials_refused == 1


async def test_relay_that_is_not_who_the_address_says_is_refused(start_host: StartHost) -> None:
    relay, target, dialer, service, _, _ = await _setup(start_host)
    impostor = address_of(relay).with_peer(Identity.generate().peer_id)

    with trio.fail_after(HANG_GUARD_S), pytest.raises(HandshakeError):
        await dialer.call(relayed(impostor, target.peer_id), RelayEcho(text="x"))
    assert service.statistics().circuits_granted == 0


async def test_reservation_slots_are_limited(start_host: StartHost) -> None:
    relay, _, _, service, client, _ = await _setup(start_host, RelayLimits(max_reservations=1))
    other = RelayClient(await start_host())

    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(Overloaded):
            await other.reserve(address_of(relay))
        await client.reserve(address_of(relay))  # renewing takes no new slot
    assert service.statistics().reservations == 1


async def test_circuit_byte_limit_cuts_the_transfer(start_host: StartHost) -> None:
    config = HostConfig(dial_deadline=5, bulk_stall=5)
    relay, target, dialer, service, _, _ = await _setup(
        start_host, RelayLimits(max_circuit_bytes=MiB), config
    )
    address = relayed(address_of(relay), target.peer_id)

    with trio.fail_after(HANG_GUARD_S):
        assert isinstance(await dialer.call(address, RelayEcho(text="small")), RelayEchoReply)
        with pytest.raises(PeerUnavailable):
            await dialer.send_bulk(address, "sink", bytes(4 * MiB))
    assert service.statistics().refused.get("bytes") == 1


async def test_circuit_time_limit_closes_the_circuit(start_host: StartHost) -> None:
    relay, target, dialer, service, _, _ = await _setup(start_host, RelayLimits(max_circuit_seconds=0.5))
    address = relayed(address_of(relay), target.peer_id)

    with trio.fail_after(HANG_GUARD_S):
        await dialer.call(address, RelayEcho(text="first"))
        channel = dialer.channel_for(target.peer_id)
        assert channel is not None
        await channel.wait_closed()
    assert service.statistics().refused.get("seconds") == 1


async def test_concurrent_circuits_are_limited(start_host: StartHost) -> None:
    relay, target, dialer, service, _, _ = await _setup(start_host, RelayLimits(max_circuits=1))
    address = relayed(address_of(relay), target.peer_id)

    with trio.fail_after(HANG_GUARD_S):
        await dialer.call(address, RelayEcho(text="holds the only circuit"))
        with pytest.raises(PeerUnavailable, match="OVERLOADED"):
            await dialer.send_bulk(address, "sink", b"needs a second circuit")
    assert service.statistics().circuits_refused == 1


async def test_reservation_ends_when_the_targets_connection_closes(start_host: StartHost) -> None:
    relay, target, dialer, service, _, _ = await _setup(start_host)
    seen_by_relay = relay.channel_for(target.peer_id)
    assert seen_by_relay is not None

    with trio.fail_after(HANG_GUARD_S):
        target.disconnect(relay.peer_id)
        await seen_by_relay.wait_closed()
        with pytest.raises(PeerUnavailable, match="no reservation"):
            await dialer.call(relayed(address_of(relay), target.peer_id), RelayEcho(text="x"))
    assert service.statistics().reservations == 0


async def test_keep_renews_the_reservation_and_ends_with_the_connection(
    start_host: StartHost, nursery: trio.Nursery
) -> None:
    relay, target, dialer = await start_host(), await start_host(), await start_host()
    service = RelayService(relay, RelayLimits(reservation_ttl=0.4))
    client = RelayClient(target)
    target.registry.add(RelayEcho, _plain_echo)
    address = relayed(address_of(relay), target.peer_id)
    ended: list[BaseException] = []

    async def keep() -> None:
        try:
            await client.keep(address_of(relay))
        except PeerUnavailable as exc:
            ended.append(exc)

    with trio.fail_after(HANG_GUARD_S):
        nursery.start_soon(keep)
        while not client.addresses():
            await trio.sleep(0.01)
        assert client.addresses() == [address]
        await trio.sleep(1.2)  # three ttls: alive only if renewed
        assert isinstance(await dialer.call(address, RelayEcho(text="renewed")), RelayEchoReply)
        relay.disconnect(target.peer_id)
        while not ended:
            await trio.sleep(0.01)
    assert client.addresses() == []
    assert service.statistics().reservations == 0


async def _plain_echo(ctx: RequestContext, request: RelayEcho) -> RelayEchoReply:
    return RelayEchoReply(text=request.text, relayed=True)


# ---------------------------------------------------------------- hostile raw connections


async def _raw_to(host: Host) -> socket.socket:
    address = address_of(host)
    sock = socket.create_connection((address.host, address.port), timeout=5)
    sock.setblocking(False)
    return sock


async def _closed_by_peer(sock: socket.socket) -> bool:
    with trio.move_on_after(HANG_GUARD_S):
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                if not sock.recv(4096):
                    return True
            except ConnectionResetError:
                return True
    return False


async def test_unknown_garbage_and_slow_preambles_are_refused_and_counted(start_host: StartHost) -> None:
    relay, target, dialer, service, _, _ = await _setup(start_host, RelayLimits(preamble_deadline=0.3))
    attempts = {
        "unknown": MAGIC + random.Random(1).randbytes(16),
        "garbage": b"D" + b"\xff" * (PREAMBLE_BYTES - 1),
        "slow": MAGIC[:3],
    }
    for preamble_bytes in attempts.values():
        sock = await _raw_to(relay)
        try:
            sock.send(preamble_bytes)
            assert await _closed_by_peer(sock)
        finally:
            sock.close()
    big = await _raw_to(relay)  # a long "preamble": R reads its fixed size and closes
    try:
        big.send(b"D" * 65536)
        assert await _closed_by_peer(big)
    finally:
        big.close()

    assert service.statistics().refused == {"unknown": 1, "garbage": 2, "slow": 1}
    with trio.fail_after(HANG_GUARD_S):  # and R still relays
        reply = await dialer.call(relayed(address_of(relay), target.peer_id), RelayEcho(text="ok"))
    assert isinstance(reply, RelayEchoReply) and reply.relayed


async def test_token_is_single_use_and_expires(start_host: StartHost) -> None:
    relay, target, dialer, service, _, _ = await _setup(start_host, RelayLimits(circuit_setup_seconds=0.5))

    with trio.fail_after(HANG_GUARD_S):
        granted = await dialer.call(address_of(relay), CircuitRequest(target=target.peer_id))
        assert isinstance(granted, CircuitGranted)
        await trio.sleep(1.0)  # T's end arrived and gave up waiting; D's token is now stale
        late = await _raw_to(relay)
        try:
            late.send(MAGIC + granted.token)
            assert await _closed_by_peer(late)
        finally:
            late.close()
        replay = await _raw_to(relay)  # the same token again: it was used up
        try:
            replay.send(MAGIC + granted.token)
            assert await _closed_by_peer(replay)
        finally:
            replay.close()

    refused = service.statistics().refused
    assert refused == {"unpaired": 1, "expired": 1, "unknown": 1}


async def test_observed_address_is_what_the_relay_sees(start_host: StartHost) -> None:
    relay = await start_host()
    service = RelayService(relay)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.setblocking(False)

    with trio.fail_after(HANG_GUARD_S):
        observed = await observe_address(address_of(relay), sock)

    assert observed == f"127.0.0.1:{port}"
    assert service.statistics().observed == 1


async def test_relay_killed_mid_transfer_fails_it_cleanly(start_host: StartHost) -> None:
    config = HostConfig(dial_deadline=5, bulk_stall=5)
    target, dialer = await start_host(config), await start_host(config)
    relay = Host(Identity.generate(), "test-run", config)
    tap = Tap()
    tap.threshold = 2 * MiB
    target.bulk_handlers["sink"] = _sink
    failure: list[BaseException] = []
    finished = trio.Event()

    async def transfer(address: PeerAddress) -> None:
        try:
            await dialer.send_bulk(address, "sink", bytes(256 * MiB))
        except PeerUnavailable as exc:
            failure.append(exc)
        finally:
            finished.set()

    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as outer, trio.open_nursery() as relay_scope:
            await relay_scope.start(relay.run)
            RelayService(relay, tap=tap)
            await RelayClient(target).reserve(address_of(relay))
            outer.start_soon(transfer, relayed(address_of(relay), target.peer_id))
            await tap.reached.wait()
            relay.abort()  # as a crash would: its circuits end with it, before run() is cancelled
            await finished.wait()
            relay_scope.cancel_scope.cancel()
    assert len(failure) == 1, "the transfer did not fail with PeerUnavailable"
    assert 2 * MiB <= tap.forwarded < 256 * MiB
    with trio.fail_after(HANG_GUARD_S), pytest.raises(PeerUnavailable):  # and the relay is gone
        await dialer.call(relayed(address_of(relay), target.peer_id), RelayEcho(text="x"))


# ---------------------------------------------------------------- hole punching (see test_punch_nat.py)


async def test_punch_to_a_peer_we_are_not_connected_to_is_peer_unavailable(start_host: StartHost) -> None:
    relay, target, dialer, _, _, _ = await _setup(start_host)

    with pytest.raises(PeerUnavailable):
        await HolePuncher(dialer, address_of(relay)).punch(target.peer_id)


async def test_a_punch_request_over_a_direct_connection_is_forbidden(start_host: StartHost) -> None:
    """Otherwise any peer could make us send SYNs to an address of its choice."""
    relay, asker, answerer = await start_host(), await start_host(), await start_host()
    service = RelayService(relay)
    HolePuncher(answerer, address_of(relay))

    with trio.fail_after(HANG_GUARD_S), pytest.raises(RemoteError, match="FORBIDDEN"):
        await asker.call(address_of(answerer), PunchConnect(observed="192.0.2.1:9"))
    assert service.statistics().observed == 0  # the answerer did not even ask the relay


# ---------------------------------------------------------------- properties of the pure parts

_IDS = [Identity.generate().peer_id for _ in range(4)]


@given(
    ip=st.ip_addresses(v=4).map(str),
    port=st.integers(0, 65535),
    relay_id=st.sampled_from(_IDS),
    target_id=st.sampled_from(_IDS),
)
def test_relayed_addresses_round_trip_through_text(ip: str, port: int, relay_id: str, target_id: str) -> None:
    relay = PeerAddress(ip, port, PeerId(relay_id), "ip4")
    address = relayed(relay, PeerId(target_id))

    assert parse_multiaddr(str(address)) == address
    assert parse_multiaddr(str(address)).relay == relay


@given(st.binary(max_size=2 * PREAMBLE_BYTES))
def test_parse_preamble_never_raises_and_accepts_only_its_two_forms(data: bytes) -> None:
    parsed = parse_preamble(data)

    if parsed is not None:
        kind, token = parsed
        assert len(data) == PREAMBLE_BYTES
        assert (kind, data) in (("circuit", MAGIC + token), ("observe", OBSERVE_MAGIC + bytes(16)))


@given(st.text(max_size=40))
def test_parse_multiaddr_of_any_circuit_text_is_an_address_or_config_error(tail: str) -> None:
    text = f"/ip4/198.51.100.1/tcp/4001/p2p/{_IDS[0]}/p2p-circuit{tail}"
    try:
        address = parse_multiaddr(text)
    except ConfigError:
        return
    assert address.relay is not None and str(address) == text


@given(st.ip_addresses().map(str), st.integers(1, 65535))
def test_split_host_port_inverts_the_punch_text_form(host: str, port: int) -> None:
    text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    assert split_host_port(text) == (host, port)
