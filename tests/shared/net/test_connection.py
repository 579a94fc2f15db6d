"""Authenticated connections: TLS 1.3 plus the in-band identity proof, over real loopback sockets
(shared.net.connection, shared.net.tls, shared.net.tls_socket, and the Host's accept path)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import outcome
import pytest
import trio

from protocols.codes import ErrorCode
from protocols.dht import PingRequest, PingResponse
from protocols.envelope import Flags
from protocols.handshake import ClientProof, Lane, ServerHello, Welcome, proof_payload
from protocols.peer_id import PeerId
from shared.auth.keys import Identity
from shared.errors import BadIdentityProof, PeerIdMismatch, PeerUnavailable, RemoteError, WrongRun
from shared.net.addresses import PeerAddress
from shared.net.connection import LocalEndpoint, SecureConnection, accept, dial
from shared.net.host import Host, HostConfig
from shared.net.rpc import RequestContext
from shared.net.tls import peer_id_from_certificate
from shared.net.tls_socket import BufferedReceiver, TlsSocket, connect_tcp

from .conftest import RUN_ID, StartHost, address_of

HANG_GUARD_S = 10  # only a guard against hangs; no test depends on how long anything takes


@contextmanager
def _listening_socket() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        yield sock
    finally:
        sock.close()


async def _accept_raw(listener: socket.socket) -> tuple[socket.socket, str]:
    while True:
        await trio.lowlevel.wait_readable(listener)
        try:
            raw, addr = listener.accept()
        except BlockingIOError:
            continue
        return raw, f"{addr[0]}:{addr[1]}"


async def _handshake(
    listener_endpoint: LocalEndpoint,
    dial_side: Callable[[PeerAddress], Awaitable[Any]],
    expected_peer: PeerId | None = None,
) -> tuple[outcome.Outcome[Any], outcome.Outcome[SecureConnection]]:
    """Run ``accept`` on a fresh loopback listener while ``dial_side`` dials it; return both outcomes."""
    results: dict[str, outcome.Outcome[Any]] = {}
    with trio.fail_after(HANG_GUARD_S), _listening_socket() as listener:
        address = PeerAddress("127.0.0.1", listener.getsockname()[1], expected_peer)

        async def accept_side() -> None:
            raw, peer = await _accept_raw(listener)
            results["accept"] = await outcome.acapture(accept, listener_endpoint, raw, peer)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_side)
            results["dial"] = await outcome.acapture(dial_side, address)
    return results["dial"], results["accept"]


def _close(*results: outcome.Outcome[Any]) -> None:
    for result in results:
        if isinstance(result, outcome.Value) and isinstance(result.value, SecureConnection):
            result.value.close()


def _endpoint(run_id: str = RUN_ID, listen_addrs: list[str] | None = None) -> LocalEndpoint:
    return LocalEndpoint(Identity.generate(), run_id, listen_addrs or [])


async def _dial_with_crafted_proof(
    address: PeerAddress, identity: Identity, craft: Callable[[ServerHello, bytes], ClientProof]
) -> None:
    """A dialer built from the lower-level pieces, sending the ClientProof that ``craft`` returns
    (given the listener's hello and certificate); returns once the listener answers Welcome."""
    raw = await connect_tcp(address.host, address.port)
    tls = await TlsSocket.handshake(
        raw, LocalEndpoint(identity, RUN_ID).client_ctx, server_side=False, peer="x"
    )
    conn = SecureConnection(tls, BufferedReceiver(tls), PeerId(""), (), "rpc", True)
    try:
        hello = await conn.receive_message(ServerHello)
        cert = tls.peer_certificate()
        assert cert is not None
        await conn.send_message(craft(hello, cert))
        await conn.receive_message(Welcome)
    finally:
        conn.close()


def _signed_proof(
    identity: Identity, cert: bytes, nonce: bytes, run_id: str = RUN_ID, lane: Lane = "rpc"
) -> ClientProof:
    unsigned = ClientProof(
        run_id=run_id, lane=lane, public_key=identity.public_key_bytes, signature=b"\0" * 64
    )
    signature = identity.sign(proof_payload(cert, nonce, unsigned))
    return msgspec.structs.replace(unsigned, signature=signature)


# ---------------------------------------------------------------- dial / accept


@pytest.mark.parametrize("lane", ["rpc", "bulk"])
async def test_dial_and_accept_prove_both_peer_ids(lane: Lane) -> None:
    listener = _endpoint()
    dialer = _endpoint(listen_addrs=["/ip4/127.0.0.1/tcp/4001", "/ip4/198.51.100.1/tcp/4001"])

    dialed, accepted = await _handshake(
        listener, lambda address: dial(dialer, address, lane), expected_peer=listener.peer_id
    )

    client, server = dialed.unwrap(), accepted.unwrap()
    try:
        assert client.remote_peer == listener.peer_id
        assert server.remote_peer == dialer.peer_id
        assert (client.lane, server.lane) == (lane, lane)
        assert (client.initiator, server.initiator) == (True, False)
        # kept only where the connection vouches for it: this loopback connection cannot for 198.51.100.1
        assert server.remote_addrs == ("/ip4/127.0.0.1/tcp/4001",)
        assert peer_id_from_certificate(client.tls.peer_certificate()) == listener.peer_id
        # and the channel carries frames both ways
        await client.send_message(PingRequest(), 7, Flags.REQUEST)
        assert await server.receive_message(PingRequest) == PingRequest()
        await server.send_message(PingResponse(), 7, Flags.RESPONSE)
        assert await client.receive_message(PingResponse) == PingResponse()
    finally:
        _close(dialed, accepted)


async def test_dial_without_expected_peer_id_learns_it_from_certificate() -> None:
    listener, dialer = _endpoint(), _endpoint()

    dialed, accepted = await _handshake(listener, lambda address: dial(dialer, address, "rpc"))

    try:
        client = dialed.unwrap()
        assert client.remote_peer == listener.peer_id
        assert client.remote_addrs[0].endswith(f"/p2p/{listener.peer_id}")
    finally:
        _close(dialed, accepted)


async def test_dial_raises_peer_id_mismatch_when_listener_is_another_peer() -> None:
    listener, dialer = _endpoint(), _endpoint()
    someone_else = Identity.generate().peer_id

    dialed, accepted = await _handshake(
        listener, lambda address: dial(dialer, address, "rpc"), expected_peer=someone_else
    )

    with pytest.raises(PeerIdMismatch, match=someone_else):
        dialed.unwrap()
    with pytest.raises(PeerUnavailable):  # the dialer hung up before proving anything
        accepted.unwrap()


async def test_dial_raises_wrong_run_when_listener_serves_another_run() -> None:
    listener, dialer = _endpoint(run_id="run-a"), _endpoint(run_id="run-b")

    dialed, accepted = await _handshake(listener, lambda address: dial(dialer, address, "rpc"))

    with pytest.raises(WrongRun, match="'run-a', not 'run-b'"):
        dialed.unwrap()
    with pytest.raises(PeerUnavailable):
        accepted.unwrap()


async def test_accept_raises_wrong_run_and_tells_dialer_when_proof_names_another_run() -> None:
    listener, intruder = _endpoint(run_id="run-a"), Identity.generate()

    dialed, accepted = await _handshake(
        listener,
        lambda address: _dial_with_crafted_proof(
            address, intruder, lambda hello, cert: _signed_proof(intruder, cert, hello.nonce, run_id="run-b")
        ),
    )

    with pytest.raises(RemoteError) as info:
        dialed.unwrap()
    assert info.value.code == ErrorCode.WRONG_RUN
    with pytest.raises(WrongRun, match="'run-b', not 'run-a'"):
        accepted.unwrap()


async def test_accept_refuses_bad_signature_with_bad_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    listener, dialer = _endpoint(), _endpoint()
    monkeypatch.setattr(Identity, "sign", lambda self, data: b"\0" * 64)

    dialed, accepted = await _handshake(listener, lambda address: dial(dialer, address, "rpc"))

    with pytest.raises(RemoteError) as info:
        dialed.unwrap()
    assert info.value.code == ErrorCode.BAD_IDENTITY
    with pytest.raises(BadIdentityProof):
        accepted.unwrap()


@pytest.mark.parametrize("forgery", ["stale-nonce", "other-certificate", "other-key", "changed-lane"])
async def test_accept_refuses_proof_not_bound_to_this_channel(forgery: str) -> None:
    listener, dialer, other = _endpoint(), Identity.generate(), Identity.generate()

    def craft(hello: ServerHello, cert: bytes) -> ClientProof:
        if forgery == "stale-nonce":
            return _signed_proof(dialer, cert, b"\x07" * 32)
        if forgery == "other-certificate":
            return _signed_proof(dialer, _endpoint().cert_der, hello.nonce)
        proof = _signed_proof(dialer, cert, hello.nonce)
        if forgery == "other-key":  # claim another peer's key with our signature
            return msgspec.structs.replace(proof, public_key=other.public_key_bytes)
        return msgspec.structs.replace(proof, lane="bulk")  # signed as rpc

    dialed, accepted = await _handshake(
        listener, lambda address: _dial_with_crafted_proof(address, dialer, craft)
    )

    with pytest.raises(RemoteError) as info:
        dialed.unwrap()
    assert info.value.code == ErrorCode.BAD_IDENTITY
    with pytest.raises(BadIdentityProof):
        accepted.unwrap()


async def test_accept_welcomes_correctly_crafted_proof() -> None:
    listener, dialer = _endpoint(), Identity.generate()

    dialed, accepted = await _handshake(
        listener,
        lambda address: _dial_with_crafted_proof(
            address, dialer, lambda hello, cert: _signed_proof(dialer, cert, hello.nonce)
        ),
    )

    try:
        dialed.unwrap()
        assert accepted.unwrap().remote_peer == dialer.peer_id
    finally:
        _close(accepted)


async def test_dial_raises_peer_unavailable_when_nobody_listens() -> None:
    with _listening_socket() as listener:
        port = listener.getsockname()[1]
    # the port was just released: nothing listens there now

    with trio.fail_after(HANG_GUARD_S), pytest.raises(PeerUnavailable, match="cannot connect"):
        await dial(_endpoint(), PeerAddress("127.0.0.1", port), "rpc")


# ---------------------------------------------------------------- the Host's accept path


async def _ping_handler(ctx: RequestContext, request: PingRequest) -> PingResponse:
    return PingResponse()


async def _read_until_eof(sock: trio.socket.SocketType) -> bytes:
    """Everything the peer sends until it closes (a reset counts as a close)."""
    received = b""
    while True:
        try:
            chunk = await sock.recv(4096)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


async def _plain_tcp_client(host: Host) -> trio.socket.SocketType:
    address = address_of(host)
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    await sock.connect((address.host, address.port))
    return sock


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x00\x05hello",  # a TLS record header followed by nonsense
        bytes(range(256)) * 8,
    ],
    ids=["http", "fake-tls-record", "binary"],
)
async def test_host_survives_plain_tcp_client_sending_garbage(start_host: StartHost, garbage: bytes) -> None:
    server, client = await start_host(), await start_host()
    server.registry.add(PingRequest, _ping_handler)

    with trio.fail_after(HANG_GUARD_S):
        sock = await _plain_tcp_client(server)
        with sock:
            await sock.send(garbage)
            await _read_until_eof(sock)  # the server hangs up on us

        assert await client.call(address_of(server), PingRequest()) == PingResponse()
    assert server.statistics().rpc_connections == 1


async def test_host_drops_client_that_never_speaks_after_accept_deadline(start_host: StartHost) -> None:
    server = await start_host(HostConfig(accept_deadline=0.1))
    server.registry.add(PingRequest, _ping_handler)
    client = await start_host()

    with trio.fail_after(HANG_GUARD_S):
        sock = await _plain_tcp_client(server)
        with sock:
            assert await _read_until_eof(sock) == b""  # nothing was ever sent, then EOF

        # give real peers a generous deadline again, so a slow machine cannot fail the check below
        server.config = dataclasses.replace(server.config, accept_deadline=HANG_GUARD_S)
        assert await client.call(address_of(server), PingRequest()) == PingResponse()


async def _stall_after_tls(address: PeerAddress) -> None:
    """Complete TLS, then read (the ServerHello) but never send the identity proof."""
    raw = await connect_tcp(address.host, address.port)
    tls = await TlsSocket.handshake(raw, _endpoint().client_ctx, server_side=False, peer="server")
    conn = SecureConnection(tls, BufferedReceiver(tls), PeerId(""), (), "rpc", True)
    try:
        while True:
            await conn.receive_frame()
    finally:
        conn.close()


async def test_host_drops_dialer_that_stalls_after_tls_handshake(start_host: StartHost) -> None:
    server = await start_host(HostConfig(accept_deadline=0.1))
    server.registry.add(PingRequest, _ping_handler)
    client = await start_host()

    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises((EOFError, PeerUnavailable)):
            await _stall_after_tls(address_of(server))

        server.config = dataclasses.replace(server.config, accept_deadline=HANG_GUARD_S)
        assert await client.call(address_of(server), PingRequest()) == PingResponse()

    assert server.statistics().rpc_connections == 1  # only the real peer's


async def test_host_refuses_dialer_of_another_run_and_keeps_serving(start_host: StartHost) -> None:
    server = await start_host()
    server.registry.add(PingRequest, _ping_handler)
    stranger, friend = await start_host(run_id="another-run"), await start_host()

    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(WrongRun):
            await stranger.call(address_of(server), PingRequest())
        assert await friend.call(address_of(server), PingRequest()) == PingResponse()


async def test_host_call_raises_peer_id_mismatch_for_wrong_peer_id_in_address(start_host: StartHost) -> None:
    server, client = await start_host(), await start_host()
    wrong = address_of(server).with_peer(Identity.generate().peer_id)

    with trio.fail_after(HANG_GUARD_S), pytest.raises(PeerIdMismatch):
        await client.call(wrong, PingRequest())
    assert client.statistics().rpc_connections == 0


def test_an_idle_pooled_socket_is_judged_right_on_descriptors_above_1023() -> None:
    """``select`` cannot watch descriptors >= 1024: every pooled lane of a busy backbone looked readable
    (closed by the peer) and was redialed."""
    import os
    import resource
    import socket
    import ssl

    from shared.net.tls_socket import TlsSocket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1600:
        pytest.skip(f"the hard descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1600), hard))
    a, b = socket.socketpair()
    try:
        high = socket.socket(fileno=os.dup2(a.fileno(), 1500))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        wrapped = context.wrap_socket(high, do_handshake_on_connect=False)
        tls = TlsSocket(wrapped, "peer")
        assert wrapped.fileno() >= 1024
        assert not tls.readable_now()
        b.sendall(b"x")
        assert tls.readable_now()
        wrapped.close()
    finally:
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
