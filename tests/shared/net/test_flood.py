"""A flood of strangers while an admitted volunteer keeps working (issue 9, "Fuzzing in CI" and finding 3).

A real Host with its DHT node (a backbone's network stack: pinned run, admitted identity) is configured
with small budgets and flooded from other loopback source addresses (127.0.0.2-6; all of 127/8 is this
machine) with tens of connections: silent TCP, plain garbage, TLS then an oversized announced length
before the identity proof, proven-but-unadmitted RPC connections sending garbage frames, undecodable
credentials and oversized announced lengths, and idle bulk lanes. Meanwhile an admitted volunteer node,
joined before the flood, keeps storing and reading DHT records and pinging it: every one of its RPCs
must succeed, and the node must stay up, count what it refused, and shed the flood's connections.

That decoding cannot block the loop is a property of how it is done, not something timed here: every
decode is typed and bounded by a frame limit checked before allocation (16 KiB before the identity
proof), and frames above ``INLINE_DECODE_BYTES`` are decoded in a worker thread (shared.net.connection).
"""

from __future__ import annotations

import contextlib
import errno
import socket
import time

import msgspec
import trio

from protocols.bulk import BulkHeader
from protocols.dht import PingRequest, PingResponse
from protocols.envelope import (
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Envelope,
    Flags,
    encode_payload,
    frame_payload,
)
from protocols.handshake import ClientProof, Lane, ServerHello, Welcome, proof_payload
from protocols.peer_id import PeerId
from shared.auth.keys import Identity
from shared.dht.node import DHTConfig
from shared.errors import PeerUnavailable, RemoteError
from shared.net.addresses import PeerAddress
from shared.net.connection import LocalEndpoint, SecureConnection
from shared.net.host import HostConfig
from shared.net.tls_socket import BufferedReceiver, TlsSocket
from shared.node import Node, open_node

from .conftest import address_of
from .test_auth_rpc import RUN, admitted

FLOOD_DEADLINE_S = 60  # a guard against hangs only
BUDGETS = HostConfig(
    max_incoming=48,
    max_pending=12,
    max_pending_per_address=4,
    max_incoming_per_address=8,
    accept_deadline=4.0,  # silent strangers are dropped after this
    idle_timeout=1.0,  # idle bulk lanes (and idle RPC connections) are reaped after this
    dial_deadline=5.0,
)

FINDING_1 = bytes.fromhex("81a3fffefdc0")
PER_WAVE = 10
PATIENT_DHT = DHTConfig(rpc_deadline=30.0)  # the volunteer's RPCs must succeed, however loaded the machine

_ENVELOPE = bytes([0x95, PROTOCOL_VERSION])  # msgpack: a 5-field envelope of this version


async def _tcp_from(source_ip: str, target: PeerAddress) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.bind((source_ip, 0))
    code = sock.connect_ex((target.host, target.port))
    if code == errno.EINPROGRESS:
        await trio.lowlevel.wait_writable(sock)
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if code:
        sock.close()
        raise PeerUnavailable(f"refused: {errno.errorcode.get(code, code)}")
    return sock


async def _tls_from(source_ip: str, target: PeerAddress) -> SecureConnection:
    """TLS done and the ServerHello read; no identity proof yet."""
    identity = Identity.generate()
    raw = await _tcp_from(source_ip, target)
    tls = await TlsSocket.handshake(
        raw, LocalEndpoint(identity, RUN).client_ctx, server_side=False, peer=str(target)
    )
    conn = SecureConnection(tls, BufferedReceiver(tls), PeerId(""), (), "rpc", True, 16 * 1024)
    conn.stranger = identity  # type: ignore[attr-defined]
    return conn


async def _proven_from(source_ip: str, target: PeerAddress, lane: Lane) -> SecureConnection:
    """A stranger that completes the identity proof (anyone can: it is not admission)."""
    conn = await _tls_from(source_ip, target)
    identity: Identity = conn.stranger  # type: ignore[attr-defined]
    hello = await conn.receive_message(ServerHello)
    cert = conn.tls.peer_certificate()
    assert cert is not None
    unsigned = ClientProof(run_id=RUN, lane=lane, public_key=identity.public_key_bytes, signature=b"\0" * 64)
    proof = msgspec.structs.replace(
        unsigned, signature=identity.sign(proof_payload(cert, hello.nonce, unsigned))
    )
    await conn.send_message(proof)
    await conn.receive_message(Welcome)
    conn.max_frame = MAX_FRAME_BYTES
    return conn


async def _until_closed(conn: SecureConnection) -> None:
    """Read (and drop) whatever the node answers until it hangs up."""
    try:
        while True:
            await conn.receive_frame()
    except (EOFError, PeerUnavailable, Exception):
        return
    finally:
        conn.close()


# ---------------------------------------------------------------- the attacks (each ignores refusals)


async def _silent_tcp(target: PeerAddress, held: list[socket.socket]) -> None:
    for _ in range(PER_WAVE):
        with contextlib.suppress(OSError):
            held.append(await _tcp_from("127.0.0.2", target))


async def _garbage_tcp(target: PeerAddress) -> None:
    for i in range(PER_WAVE):
        try:
            sock = await _tcp_from("127.0.0.3", target)
        except (OSError, PeerUnavailable):
            continue
        with sock, contextlib.suppress(OSError):
            sock.send(bytes((i * 37 + j) % 256 for j in range(2048)))


async def _oversized_before_proof(target: PeerAddress) -> None:
    for length in [2**32 - 1, MAX_FRAME_BYTES - 1, 16 * 1024 + 1] * (PER_WAVE // 3):
        try:
            conn = await _tls_from("127.0.0.4", target)
            await conn.receive_frame()  # the ServerHello
            await conn.send_frame(FRAME_HEADER.pack(length) + b"\xc1" * 64)
        except (OSError, PeerUnavailable, EOFError):
            continue
        await _until_closed(conn)


def _garbage_frames() -> list[bytes]:
    ping = encode_payload(PingRequest())
    wrong_version = msgspec.msgpack.encode(
        Envelope(PROTOCOL_VERSION + 1, "dht.ping", 5, 0, msgspec.Raw(ping))
    )
    nested = _ENVELOPE + b"\xa8dht.ping\x01\x00" + b"\x91" * 10_000 + b"\xc0"
    return [
        FRAME_HEADER.pack(3) + b"\xc1\xc1\xc1",
        frame_payload(PingRequest.kind, ping, 3, Flags.REQUEST, FINDING_1),
        frame_payload(BulkHeader.kind, encode_payload(BulkHeader(topic="x", nbytes=1)), 4, Flags.REQUEST),
        FRAME_HEADER.pack(len(wrong_version)) + wrong_version,
        FRAME_HEADER.pack(len(nested)) + nested,
        frame_payload(PingRequest.kind, ping, 6, Flags.RESPONSE, FINDING_1),  # an answer nobody asked for
        FRAME_HEADER.pack(MAX_FRAME_BYTES + 1),  # oversized: the node must hang up
    ]


async def _proven_garbage(target: PeerAddress) -> None:
    for _ in range(PER_WAVE // 2):
        try:
            conn = await _proven_from("127.0.0.5", target, "rpc")
            for frame in _garbage_frames():
                await conn.send_frame(frame)
        except (OSError, PeerUnavailable, EOFError, RemoteError):
            continue
        await _until_closed(conn)


async def _bulk_garbage(target: PeerAddress) -> None:
    header = encode_payload(BulkHeader(topic="state.get", nbytes=2**40))
    for frame in [
        frame_payload(BulkHeader.kind, header, 0, Flags.REQUEST, FINDING_1),  # finding 1 itself
        frame_payload(BulkHeader.kind, header, 0, Flags.REQUEST),  # no credentials, a huge transfer
        FRAME_HEADER.pack(MAX_FRAME_BYTES - 1),  # far above the bulk lane's frame limit
        FRAME_HEADER.pack(3) + b"\xc1\xc1\xc1",
    ]:
        try:
            conn = await _proven_from("127.0.0.7", target, "bulk")
            await conn.send_frame(frame)
        except (OSError, PeerUnavailable, EOFError, RemoteError):
            continue
        await _until_closed(conn)


async def _idle_bulk(target: PeerAddress, held: list[SecureConnection]) -> None:
    for _ in range(PER_WAVE):
        with contextlib.suppress(OSError, PeerUnavailable, EOFError, RemoteError):
            held.append(await _proven_from("127.0.0.6", target, "bulk"))


# ---------------------------------------------------------------- the test


async def _admitted_volunteer(target: Node, stop: trio.Event, done: list[int]) -> None:
    identity = Identity.generate()
    async with open_node(
        identity,
        RUN,
        "volunteer",
        listen=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=[target.host.listen_addrs[0]],
        dht_config=PATIENT_DHT,
        authenticator=admitted(identity, "alice"),
    ) as node:
        i = 0
        while not stop.is_set() or i < 5:
            await node.dht.store(f"work-{i}", b"v%d" % i, time.time() + 60)
            found = await node.dht.get(f"work-{i}")
            assert found is not None and found.value == b"v%d" % i
            assert await node.host.call(address_of(target.host), PingRequest()) == PingResponse()
            i += 1
            done.append(i)


async def test_node_keeps_serving_an_admitted_volunteer_through_a_flood_of_strangers() -> None:
    identity = Identity.generate()
    with trio.fail_after(FLOOD_DEADLINE_S):
        async with (
            open_node(
                identity,
                RUN,
                "backbone",
                listen=["/ip4/127.0.0.1/tcp/0"],
                host_config=BUDGETS,
                dht_config=PATIENT_DHT,
                authenticator=admitted(identity, "backbone-0"),
            ) as target,
            trio.open_nursery() as nursery,
        ):
            address = address_of(target.host)
            stop, done = trio.Event(), []
            nursery.start_soon(_admitted_volunteer, target, stop, done)
            while not done:  # the volunteer joined and worked before the flood
                await trio.sleep(0.01)
            silent: list[socket.socket] = []
            idle_bulk: list[SecureConnection] = []
            try:
                async with trio.open_nursery() as flood:
                    flood.start_soon(_silent_tcp, address, silent)
                    flood.start_soon(_garbage_tcp, address)
                    flood.start_soon(_oversized_before_proof, address)
                    flood.start_soon(_proven_garbage, address)
                    flood.start_soon(_idle_bulk, address, idle_bulk)
                    flood.start_soon(_bulk_garbage, address)
                during = len(done)
                stats = target.host.statistics()
                assert stats.connections_refused > 0  # the per-address budgets were hit
                assert stats.pending_connections <= BUDGETS.max_pending
                # the flood's connections are shed: silent ones at the handshake deadline, idle bulk
                # lanes at the idle timeout; only the volunteer's connections remain
                while target.host.statistics().incoming_connections > 2:
                    await trio.sleep(0.05)
            finally:
                for sock in silent:
                    sock.close()
                for lane in idle_bulk:
                    lane.close()
            stop.set()
            while len(done) < during + 5:  # and it keeps working after the flood
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        stats = target.host.statistics()
        assert stats.handshakes_failed > 0
        assert stats.protocol_errors > 0
        assert stats.connection_failures == 0  # every fault was an expected, handled one
