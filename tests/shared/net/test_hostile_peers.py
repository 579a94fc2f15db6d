"""Hostile bytes and forged answers end one request or connection, never a host (issue 9, findings 1, 12a).

Real hosts on 127.0.0.1 in a pinned run. The credentials ``81 a3 ff fe fd c0`` are a msgpack map whose
key is not UTF-8: msgspec raises UnicodeDecodeError for them, which used to escape the guard.
"""

from __future__ import annotations

import logging

import pytest
import trio

from protocols.bulk import BulkHeader
from protocols.codes import ErrorCode
from protocols.dht import PingRequest, PingResponse
from protocols.envelope import (
    ErrorReply,
    Flags,
    decode_envelope,
    decode_message,
    encode_payload,
    frame_payload,
)
from shared.auth.guard import RunAuthenticator
from shared.auth.keys import Identity
from shared.errors import AccessDenied, AuthError, PeerUnavailable, RemoteError
from shared.net.bulk import BulkReader
from shared.net.connection import LocalEndpoint, SecureConnection, dial
from shared.net.host import Host
from shared.net.rpc import RequestContext

from .conftest import address_of
from .test_auth_rpc import AUTHORITY, RUN, admitted, start, token_for

BAD_CREDENTIALS = bytes.fromhex("81a3fffefdc0")
HANG_GUARD_S = 10  # only a guard against hangs


async def _sink(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
    await reader.discard()
    return b"ok"


async def _server(nursery: trio.Nursery) -> Host:
    identity = Identity.generate()
    server = await start(nursery, identity, admitted(identity, "server"))
    server.bulk_handlers["sink"] = _sink
    return server


async def _still_serves(nursery: trio.Nursery, server: Host) -> None:
    """An admitted peer can call and send bulk data to ``server``."""
    identity = Identity.generate()
    good = await start(nursery, identity, admitted(identity))
    assert await good.call(address_of(server), PingRequest()) == PingResponse()
    assert await good.send_bulk(address_of(server), "sink", b"x" * 1000) == b"ok"


async def _refusal(conn: SecureConnection) -> ErrorReply:
    message = decode_message(decode_envelope(await conn.receive_frame()))
    assert isinstance(message, ErrorReply)
    return message


@pytest.mark.parametrize("lane", ["rpc", "bulk"])
async def test_host_refuses_undecodable_request_credentials_and_keeps_serving(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, lane: str
) -> None:
    server = await _server(nursery)
    with trio.fail_after(HANG_GUARD_S):
        conn = await dial(LocalEndpoint(Identity.generate(), RUN), address_of(server), lane)  # type: ignore[arg-type]
        try:
            if lane == "bulk":
                header = encode_payload(BulkHeader(topic="sink", nbytes=0))
                await conn.send_frame(
                    frame_payload(BulkHeader.kind, header, 0, Flags.REQUEST, BAD_CREDENTIALS)
                )
            else:
                ping = encode_payload(PingRequest())
                await conn.send_frame(
                    frame_payload(PingRequest.kind, ping, 7, Flags.REQUEST, BAD_CREDENTIALS)
                )
            with caplog.at_level(logging.WARNING):
                refusal = await _refusal(conn)
        finally:
            conn.close()
        assert refusal.code == ErrorCode.BAD_TOKEN
        assert "malformed credentials" in caplog.text
        await _still_serves(nursery, server)


class GarbledResponder(RunAuthenticator):
    """An admitted peer whose answers carry undecodable credentials."""

    def sign_response(self, request_nonce: bytes, kind: str, payload: bytes) -> bytes:
        return BAD_CREDENTIALS


async def test_host_refuses_undecodable_response_credentials_and_keeps_working(nursery: trio.Nursery) -> None:
    bad_id, client_id = Identity.generate(), Identity.generate()
    garbled = GarbledResponder(RUN, AUTHORITY.key, bad_id, token_for(bad_id, "mallory"))
    bad = await start(nursery, bad_id, garbled)
    bad.bulk_handlers["sink"] = _sink
    client = await start(nursery, client_id, admitted(client_id))
    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(AuthError) as info:
            await client.call(address_of(bad), PingRequest())
        assert info.value.code == ErrorCode.BAD_TOKEN
        with pytest.raises(AuthError) as info:
            await client.send_bulk(address_of(bad), "sink", b"x" * 100)
        assert info.value.code == ErrorCode.BAD_TOKEN
        good = await _server(nursery)
        assert await client.call(address_of(good), PingRequest()) == PingResponse()


class UnsignedRefuser(RunAuthenticator):
    """An admitted peer that sends its refusals unsigned (or, with ``rebind``, bound to another nonce)."""

    rebind = False

    def sign_error(self, request_auth: bytes, payload: bytes) -> bytes:
        if self.rebind:
            return self.sign_response(b"\0" * 16, "error", payload)
        return b""


async def _revoke_everyone(ctx: RequestContext, request: PingRequest) -> PingResponse:
    raise RemoteError(ErrorCode.REVOKED, "you have been removed (says who?)")


async def _refuse_bulk(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
    raise RemoteError(ErrorCode.FORBIDDEN, "go away")


@pytest.mark.parametrize(
    ("rebind", "code"), [(False, ErrorCode.UNAUTHENTICATED), (True, ErrorCode.BAD_SIGNATURE)]
)
async def test_client_does_not_believe_an_unsigned_or_misbound_error_reply(
    nursery: trio.Nursery, rebind: bool, code: ErrorCode
) -> None:
    liar_id, client_id = Identity.generate(), Identity.generate()
    liar_auth = UnsignedRefuser(RUN, AUTHORITY.key, liar_id, token_for(liar_id, "mallory"))
    liar_auth.rebind = rebind
    liar = Host(liar_id, RUN, authenticator=liar_auth)
    liar.registry.add(PingRequest, _revoke_everyone)
    liar.bulk_handlers["sink"] = _refuse_bulk
    await nursery.start(liar.run)
    client_auth = admitted(client_id)
    client = await start(nursery, client_id, client_auth)
    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(AuthError) as info:
            await client.call(address_of(liar), PingRequest())
        assert info.value.code == code
        assert not client_auth.refused_as_revoked  # a forged REVOKED does not make us think we were removed
        with pytest.raises(AuthError) as info:
            await client.send_bulk(address_of(liar), "sink", b"x" * 100)
        assert info.value.code == code


async def test_client_believes_a_signed_error_reply(nursery: trio.Nursery) -> None:
    honest_id, client_id = Identity.generate(), Identity.generate()
    honest = Host(honest_id, RUN, authenticator=admitted(honest_id, "server"))
    honest.registry.add(PingRequest, _revoke_everyone)
    honest.bulk_handlers["sink"] = _refuse_bulk
    await nursery.start(honest.run)
    client_auth = admitted(client_id)
    client = await start(nursery, client_id, client_auth)
    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(AccessDenied) as info:
            await client.call(address_of(honest), PingRequest())
        assert info.value.code == ErrorCode.REVOKED
        assert client_auth.refused_as_revoked
        with pytest.raises(RemoteError) as refused:
            await client.send_bulk(address_of(honest), "sink", b"x" * 100)
        assert refused.value.code == ErrorCode.FORBIDDEN


async def test_a_failing_bulk_handler_ends_its_lane_only_and_is_counted(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    server = await _server(nursery)

    async def broken(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
        raise MemoryError("a handler that allocates what a header announced")

    server.bulk_handlers["broken"] = broken
    identity = Identity.generate()
    client = await start(nursery, identity, admitted(identity))
    with trio.fail_after(HANG_GUARD_S):
        with caplog.at_level(logging.ERROR), pytest.raises(PeerUnavailable):
            await client.send_bulk(address_of(server), "broken", b"x" * 100)
        while server.statistics().connection_failures != 1:
            await trio.sleep(0.01)
        assert "unexpected error" in caplog.text
        await _still_serves(nursery, server)
