"""Typed request/response between two Hosts on loopback (shared.net.rpc, shared.net.host)."""

from __future__ import annotations

from typing import ClassVar

import msgspec
import outcome
import pytest
import trio
import trio.testing

import shared.net.host as host_module
from protocols.codes import ErrorCode
from protocols.dht import FindNodeRequest, LeaveNotice, PingRequest, PingResponse
from protocols.envelope import (
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Envelope,
    ErrorReply,
    Flags,
    Message,
    Request,
    decode_envelope,
    decode_message,
    encode_frame,
    register,
)
from protocols.errors import ProtocolError
from protocols.handshake import Lane
from shared.auth.keys import Identity
from shared.errors import Overloaded, PeerUnavailable, RemoteError
from shared.net.addresses import PeerAddress
from shared.net.connection import LocalEndpoint, SecureConnection, dial
from shared.net.host import Host, HostConfig
from shared.net.rpc import RequestContext

from .conftest import RUN_ID, StartHost, address_of

HANG_GUARD_S = 10  # only a guard against hangs; no test depends on how long anything takes

_ENVELOPE = bytes([0x95, PROTOCOL_VERSION])  # msgpack: a 5-field envelope of this version


@register
class EchoResponse(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "test.rpc.echo.ok"
    data: bytes = b""


@register
class EchoRequest(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "test.rpc.echo"
    response: ClassVar[type[Message]] = EchoResponse
    data: bytes = b""


async def echo(ctx: RequestContext, request: EchoRequest) -> EchoResponse:
    return EchoResponse(data=request.data)


async def _pair(start_host: StartHost, server_config: HostConfig | None = None) -> tuple[Host, Host]:
    """(client, server) with the echo handler on the server."""
    client, server = await start_host(), await start_host(server_config)
    server.registry.add(EchoRequest, echo)
    return client, server


async def _echo(client: Host, server: Host, data: bytes) -> bytes:
    reply = await client.call(address_of(server), EchoRequest(data=data))
    assert isinstance(reply, EchoResponse)
    return reply.data


# ---------------------------------------------------------------- request / response


async def test_host_call_returns_handler_reply_and_tells_handler_who_called(start_host: StartHost) -> None:
    client, server = await start_host(), await start_host()
    seen: list[RequestContext] = []

    async def handler(ctx: RequestContext, request: EchoRequest) -> EchoResponse:
        seen.append(ctx)
        return EchoResponse(data=request.data[::-1])

    server.registry.add(EchoRequest, handler)

    with trio.fail_after(HANG_GUARD_S):
        reply = await client.call(address_of(server), EchoRequest(data=b"abc"))

    assert reply == EchoResponse(data=b"cba")
    assert [ctx.peer_id for ctx in seen] == [client.peer_id]
    assert seen[0].listen_addrs == tuple(client.listen_addrs)
    stats = server.statistics()
    assert (stats.requests_served, client.statistics().calls_sent) == (1, 1)


async def test_host_call_works_in_both_directions_over_one_connection(start_host: StartHost) -> None:
    a, b = await start_host(), await start_host()
    a.registry.add(EchoRequest, echo)
    b.registry.add(EchoRequest, echo)

    with trio.fail_after(HANG_GUARD_S):
        assert await _echo(a, b, b"a->b") == b"a->b"
        assert await _echo(b, a, b"b->a") == b"b->a"  # reuses the connection a opened

    assert a.statistics().rpc_connections == 1
    assert b.statistics().rpc_connections == 1
    assert a.connected_peers() == [b.peer_id]
    assert b.connected_peers() == [a.peer_id]


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (ProtocolError("field x is odd"), ErrorCode.BAD_REQUEST, "field x is odd"),
        (ProtocolError("too big for me", ErrorCode.TOO_LARGE), ErrorCode.TOO_LARGE, "too big for me"),
        (RemoteError(ErrorCode.NOT_FOUND, "nothing here"), ErrorCode.NOT_FOUND, "nothing here"),
        (RemoteError(ErrorCode.FORBIDDEN, ""), ErrorCode.FORBIDDEN, ""),
        (RuntimeError("secret internals"), ErrorCode.INTERNAL, "internal error"),
        (KeyError("k"), ErrorCode.INTERNAL, "internal error"),
    ],
    ids=[
        "protocol-error",
        "protocol-error-code",
        "remote-error",
        "remote-error-no-text",
        "runtime",
        "keyerror",
    ],
)
async def test_host_call_maps_handler_exception_to_remote_error_code_and_channel_keeps_working(
    start_host: StartHost, error: Exception, code: ErrorCode, message: str
) -> None:
    client, server = await _pair(start_host)

    async def failing(ctx: RequestContext, request: PingRequest) -> PingResponse:
        raise error

    server.registry.add(PingRequest, failing)

    with trio.fail_after(HANG_GUARD_S):
        assert await _echo(client, server, b"before") == b"before"
        with pytest.raises(RemoteError) as info:
            await client.call(address_of(server), PingRequest())
        assert await _echo(client, server, b"after") == b"after"

    assert info.value.code == code
    assert info.value.remote_message.endswith(message)
    assert "secret" not in str(info.value)
    assert client.statistics().rpc_connections == 1
    assert client.statistics().calls_failed == 1


async def test_host_call_raises_unknown_kind_when_peer_has_no_handler(start_host: StartHost) -> None:
    client, server = await _pair(start_host)

    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(RemoteError, match=r"no handler for dht\.ping") as info:
            await client.call(address_of(server), PingRequest())
        assert await _echo(client, server, b"still fine") == b"still fine"

    assert info.value.code == ErrorCode.UNKNOWN_KIND


async def test_handler_registry_refuses_second_handler_for_a_kind() -> None:
    host = Host(Identity.generate(), RUN_ID)
    host.registry.add(EchoRequest, echo)

    with pytest.raises(ValueError, match=r"test\.rpc\.echo"):
        host.registry.add(EchoRequest, echo)


async def test_host_call_raises_internal_when_handler_exceeds_handler_deadline(start_host: StartHost) -> None:
    client, server = await _pair(start_host, HostConfig(handler_deadline=0.05))

    async def stuck(ctx: RequestContext, request: PingRequest) -> PingResponse:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    server.registry.add(PingRequest, stuck)

    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(RemoteError, match="handler timed out") as info:
            await client.call(address_of(server), PingRequest())
        assert await _echo(client, server, b"next") == b"next"

    assert info.value.code == ErrorCode.INTERNAL


async def test_host_call_raises_protocol_error_when_request_exceeds_its_size_limit(
    start_host: StartHost,
) -> None:
    client, server = await _pair(start_host)

    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(ProtocolError) as info:
            await client.call(address_of(server), EchoRequest(data=b"x" * (64 * 1024)))
        assert await _echo(client, server, b"small") == b"small"

    assert info.value.code == ErrorCode.TOO_LARGE


async def test_host_notify_delivers_one_way_message(start_host: StartHost) -> None:
    client, server = await start_host(), await start_host()
    delivered = trio.Event()
    senders = []

    async def on_leave(ctx: RequestContext, message: LeaveNotice) -> None:
        senders.append(ctx.peer_id)
        delivered.set()

    server.registry.add_notification(LeaveNotice, on_leave)

    with trio.fail_after(HANG_GUARD_S):
        await client.notify(address_of(server), LeaveNotice())
        await delivered.wait()

    assert senders == [client.peer_id]


# ---------------------------------------------------------------- deadlines and back-pressure


async def test_host_call_deadline_raises_too_slow_and_late_reply_is_dropped(start_host: StartHost) -> None:
    client, server = await start_host(), await start_host()
    release, replied = trio.Event(), trio.Event()

    async def slow_echo(ctx: RequestContext, request: EchoRequest) -> EchoResponse:
        if request.data == b"slow":
            await release.wait()
            replied.set()
        return EchoResponse(data=request.data)

    server.registry.add(EchoRequest, slow_echo)
    address = address_of(server)

    with trio.fail_after(HANG_GUARD_S):
        assert (
            await _echo(client, server, b"warm-up") == b"warm-up"
        )  # connected: only the reply is waited for
        with pytest.raises(trio.TooSlowError), trio.fail_after(0.05):
            await client.call(address, EchoRequest(data=b"slow"))
        channel = client.channel_for(server.peer_id)

        release.set()
        await replied.wait()
        await trio.testing.wait_all_tasks_blocked()  # the late reply has arrived and been dropped

        assert await _echo(client, server, b"fresh") == b"fresh"

    assert client.channel_for(server.peer_id) is channel
    assert client.statistics().rpc_connections == 1


async def test_host_call_raises_overloaded_beyond_max_inflight_and_serves_the_rest(
    start_host: StartHost,
) -> None:
    client, server = await start_host(), await start_host(HostConfig(max_inflight=2))
    release = trio.Event()
    calls = 6

    async def blocking_echo(ctx: RequestContext, request: EchoRequest) -> EchoResponse:
        await release.wait()
        return EchoResponse(data=request.data)

    server.registry.add(EchoRequest, blocking_echo)
    results: dict[int, outcome.Outcome[Message]] = {}

    async def one_call(i: int) -> None:
        results[i] = await outcome.acapture(client.call, address_of(server), EchoRequest(data=b"%d" % i))
        overloaded = [r for r in results.values() if isinstance(r, outcome.Error)]
        if len(overloaded) == calls - 2:
            release.set()  # every rejection has arrived while two handlers were still blocked

    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            for i in range(calls):
                nursery.start_soon(one_call, i)

    errors = [r.error for r in results.values() if isinstance(r, outcome.Error)]
    served = {i: r.unwrap() for i, r in results.items() if isinstance(r, outcome.Value)}
    assert len(errors) == calls - 2
    assert all(isinstance(e, Overloaded) and e.code == ErrorCode.OVERLOADED for e in errors)
    assert len(served) == 2
    assert all(reply == EchoResponse(data=b"%d" % i) for i, reply in served.items())
    channel = server.channel_for(client.peer_id)
    assert channel is not None
    assert channel.statistics().requests_rejected == calls - 2
    with trio.fail_after(HANG_GUARD_S):
        assert await _echo(client, server, b"later") == b"later"  # the slots were given back


# ---------------------------------------------------------------- malformed frames


def _frame(body: bytes) -> bytes:
    return FRAME_HEADER.pack(len(body)) + body


def _envelope_body(version: int, kind: str, request_id: int, payload: object) -> bytes:
    raw = msgspec.Raw(msgspec.msgpack.encode(payload))
    return msgspec.msgpack.encode(Envelope(version, kind, request_id, int(Flags.REQUEST), raw))


# request ids far above any the channels under test will use for their own calls
MALFORMED = [
    pytest.param(b"\xc1\xc1\xc1", ErrorCode.BAD_REQUEST, 0, id="garbage-msgpack"),
    pytest.param(msgspec.msgpack.encode({"not": "an envelope"}), ErrorCode.BAD_REQUEST, 0, id="map"),
    pytest.param(_ENVELOPE + b"\xa2\xff\xfe\x01\x00\x80", ErrorCode.BAD_REQUEST, 0, id="invalid-utf8-kind"),
    pytest.param(_ENVELOPE + b"\xa8dht.ping" + b"\x91" * 5000, ErrorCode.BAD_REQUEST, 0, id="deeply-nested"),
    pytest.param(
        _envelope_body(PROTOCOL_VERSION + 1, "dht.ping", 2**40 + 1, {}),
        ErrorCode.WRONG_VERSION,
        2**40 + 1,
        id="wrong-version",
    ),
    pytest.param(
        _envelope_body(PROTOCOL_VERSION, "no.such.kind", 2**40 + 2, {}),
        ErrorCode.UNKNOWN_KIND,
        2**40 + 2,
        id="unknown-kind",
    ),
    pytest.param(
        _envelope_body(PROTOCOL_VERSION, "dht.ping", 2**40 + 3, {"pad": b"x" * 300}),
        ErrorCode.TOO_LARGE,
        2**40 + 3,
        id="oversized-for-kind",
    ),
    pytest.param(
        _envelope_body(PROTOCOL_VERSION, "dht.find_node", 2**40 + 4, {"target": b"t" * 19}),
        ErrorCode.BAD_REQUEST,
        2**40 + 4,
        id="invalid-field",
    ),
    pytest.param(
        _envelope_body(PROTOCOL_VERSION, "test.rpc.echo.ok", 2**40 + 5, {}),
        ErrorCode.UNKNOWN_KIND,
        2**40 + 5,
        id="response-kind-as-request",
    ),
]


async def _raw_connection(server: Host) -> SecureConnection:
    """An authenticated connection without an RpcChannel on our side: we see every frame."""
    return await dial(LocalEndpoint(Identity.generate(), RUN_ID), address_of(server), "rpc")


async def _receive(conn: SecureConnection) -> tuple[Envelope, Message]:
    envelope = decode_envelope(await conn.receive_frame())
    return envelope, decode_message(envelope)


@pytest.mark.parametrize(("body", "code", "request_id"), MALFORMED)
async def test_rpc_channel_answers_malformed_frame_with_error_reply_and_keeps_serving(
    start_host: StartHost, body: bytes, code: ErrorCode, request_id: int
) -> None:
    server = await start_host()
    server.registry.add(EchoRequest, echo)

    with trio.fail_after(HANG_GUARD_S):
        conn = await _raw_connection(server)
        try:
            await conn.send_frame(_frame(body))
            envelope, reply = await _receive(conn)
            assert isinstance(reply, ErrorReply)
            assert (reply.code, envelope.request_id, envelope.flags) == (code, request_id, Flags.ERROR)

            await conn.send_frame(encode_frame(EchoRequest(data=b"ok"), 77, Flags.REQUEST))
            envelope, reply = await _receive(conn)
            assert (reply, envelope.request_id, envelope.flags) == (
                EchoResponse(data=b"ok"),
                77,
                Flags.RESPONSE,
            )
        finally:
            conn.close()


async def test_rpc_channel_stays_usable_after_peer_sends_malformed_frames(start_host: StartHost) -> None:
    client, server = await _pair(start_host)

    with trio.fail_after(HANG_GUARD_S):
        assert await _echo(client, server, b"first") == b"first"
        channel = client.channel_for(server.peer_id)
        assert channel is not None
        for param in MALFORMED:
            body = param.values[0]
            assert isinstance(body, bytes)
            await channel.conn.send_frame(_frame(body))
        # the error replies come back with ids nobody waits for and are dropped
        assert await _echo(client, server, b"second") == b"second"

    assert client.channel_for(server.peer_id) is channel
    assert not channel.closed
    assert server.statistics().rpc_connections == 1


async def test_rpc_channel_closes_only_the_connection_that_announces_oversized_frame(
    start_host: StartHost,
) -> None:
    client, server = await _pair(start_host)

    with trio.fail_after(HANG_GUARD_S):
        assert await _echo(client, server, b"before") == b"before"
        conn = await _raw_connection(server)
        try:
            await conn.send_frame(FRAME_HEADER.pack(MAX_FRAME_BYTES + 1))
            envelope, reply = await _receive(conn)
            assert isinstance(reply, ErrorReply)
            assert (reply.code, envelope.request_id) == (ErrorCode.TOO_LARGE, 0)
            with pytest.raises((EOFError, PeerUnavailable)):
                await conn.receive_frame()
        finally:
            conn.close()

        assert await _echo(client, server, b"old connection") == b"old connection"
        newcomer = await start_host()
        assert await _echo(newcomer, server, b"new connection") == b"new connection"

    assert server.statistics().rpc_connections == 2


# ---------------------------------------------------------------- failures and pooling


async def test_host_call_raises_peer_unavailable_when_peer_goes_away_mid_call(nursery: trio.Nursery) -> None:
    client = Host(Identity.generate(), RUN_ID)
    server = Host(Identity.generate(), RUN_ID)
    await nursery.start(client.run)
    entered = trio.Event()

    async def never_answers(ctx: RequestContext, request: EchoRequest) -> EchoResponse:
        entered.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    server.registry.add(EchoRequest, never_answers)

    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as server_nursery:
            await server_nursery.start(server.run)
            address = address_of(server)
            done = trio.Event()
            result: list[outcome.Outcome[Message]] = []

            async def caller() -> None:
                result.append(await outcome.acapture(client.call, address, EchoRequest()))
                done.set()

            nursery.start_soon(caller)
            await entered.wait()
            server_nursery.cancel_scope.cancel()  # the server process goes away
        await done.wait()

        with pytest.raises(PeerUnavailable):
            result[0].unwrap()
        with pytest.raises(PeerUnavailable):  # and nobody listens there any more
            await client.call(address, EchoRequest())

    assert client.connected_peers() == []


async def test_host_disconnect_fails_pending_call_and_next_call_redials(start_host: StartHost) -> None:
    client, server = await start_host(), await start_host()
    entered = trio.Event()

    async def first_blocks(ctx: RequestContext, request: EchoRequest) -> EchoResponse:
        if request.data == b"block":
            entered.set()
            await trio.sleep_forever()
        return EchoResponse(data=request.data)

    server.registry.add(EchoRequest, first_blocks)

    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:

            async def blocked_call() -> None:
                with pytest.raises(PeerUnavailable):
                    await client.call(address_of(server), EchoRequest(data=b"block"))

            nursery.start_soon(blocked_call)
            await entered.wait()
            client.disconnect(server.peer_id)

        assert await _echo(client, server, b"again") == b"again"

    assert client.statistics().rpc_connections == 1


async def test_host_reuses_one_connection_for_sequential_calls(start_host: StartHost) -> None:
    client, server = await _pair(start_host)

    with trio.fail_after(HANG_GUARD_S):
        for i in range(3):
            assert await _echo(client, server, b"%d" % i) == b"%d" % i

    stats = client.statistics()
    assert (stats.rpc_connections, stats.peers_connected, stats.calls_sent) == (1, 1, 3)
    assert server.statistics().rpc_connections == 1
    assert stats.bytes_sent > 0
    assert stats.bytes_received > 0
    # by kind: the three requests (and nothing else) from the client, the three replies from the server
    sent, served = stats.rpc_sent_by_kind, server.statistics().rpc_sent_by_kind
    assert set(sent) == {EchoRequest.kind} and set(served) == {EchoResponse.kind}
    assert 0 < sent[EchoRequest.kind] <= stats.bytes_sent


async def test_host_counts_rpc_bytes_by_kind_across_closed_channels(start_host: StartHost) -> None:
    client, server = await _pair(start_host)
    with trio.fail_after(HANG_GUARD_S):
        assert await _echo(client, server, b"x" * 1000) == b"x" * 1000
        first = client.statistics().rpc_sent_by_kind[EchoRequest.kind]
        assert first > 1000  # the payload and its envelope
        client.disconnect(server.peer_id)  # that channel is gone; its bytes stay counted
        while client.statistics().rpc_connections:
            await trio.sleep(0.01)  # the closed channel leaves the host
        assert await _echo(client, server, b"y" * 10) == b"y" * 10
    after = client.statistics().rpc_sent_by_kind[EchoRequest.kind]
    assert first < after < 2 * first


async def test_host_reuses_connection_when_address_has_no_peer_id(start_host: StartHost) -> None:
    client, server = await _pair(start_host)
    with_id = address_of(server)
    without_id = PeerAddress(with_id.host, with_id.port)

    with trio.fail_after(HANG_GUARD_S):
        assert await client.connect(without_id) == server.peer_id
        assert await client.call(without_id, EchoRequest(data=b"1")) == EchoResponse(data=b"1")
        assert await client.call(with_id, EchoRequest(data=b"2")) == EchoResponse(data=b"2")

    assert client.statistics().rpc_connections == 1


async def test_host_concurrent_calls_to_new_peer_share_one_dial(
    start_host: StartHost, monkeypatch: pytest.MonkeyPatch
) -> None:

    client, server = await _pair(start_host)
    dials: list[str] = []

    async def counting_dial(endpoint: LocalEndpoint, address: PeerAddress, lane: Lane) -> SecureConnection:
        dials.append(lane)
        return await dial(endpoint, address, lane)

    monkeypatch.setattr(host_module, "dial", counting_dial)
    replies: dict[int, bytes] = {}

    async def one_call(i: int) -> None:
        replies[i] = await _echo(client, server, b"%d" % i)

    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one_call, i)

    assert replies == {i: b"%d" % i for i in range(8)}
    assert dials == ["rpc"]
    assert client.statistics().rpc_connections == 1
    assert server.statistics().rpc_connections == 1


async def test_host_call_raises_peer_unavailable_when_nobody_listens(start_host: StartHost) -> None:
    client = await start_host()
    gone = Host(Identity.generate(), RUN_ID)
    async with trio.open_nursery() as nursery:
        await nursery.start(gone.run)
        address = address_of(gone)
        nursery.cancel_scope.cancel()

    with trio.fail_after(HANG_GUARD_S), pytest.raises(PeerUnavailable):
        await client.call(address, EchoRequest())


async def test_host_find_node_with_invalid_target_is_refused_as_bad_request(start_host: StartHost) -> None:
    client, server = await start_host(), await start_host()

    async def find_node(ctx: RequestContext, request: FindNodeRequest) -> PingResponse:
        raise AssertionError("an invalid request must never reach its handler")

    server.registry.add(FindNodeRequest, find_node)

    with trio.fail_after(HANG_GUARD_S), pytest.raises(RemoteError) as info:
        # constraints are checked by the receiver's decoder, not at construction
        await client.call(address_of(server), FindNodeRequest(target=b"short"))

    assert info.value.code == ErrorCode.BAD_REQUEST
