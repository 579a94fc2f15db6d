"""Credentials are wire input: fuzzing the guard's decoders and checks (issue 9, finding 1 and "Fuzzing in
CI"). Decoding raises only ProtocolError; the checks raise only AuthError; signing a refusal never fails."""

from __future__ import annotations

import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.auth import RequestAuth, ResponseAuth, SignedToken
from protocols.codes import ErrorCode
from protocols.dht import SignedRecord
from protocols.errors import ProtocolError
from shared.auth.authority import Authority, pin_run_id
from shared.auth.guard import RunAuthenticator, decode_request_auth, decode_response_auth
from shared.auth.keys import Identity
from shared.auth.revocations import decode_revocation
from shared.errors import AuthError, RecordRejected

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
FINDING_1 = bytes.fromhex("81a3fffefdc0")  # {"\xff\xfe\xfd": nil}: a map key that is not UTF-8
AUTHORITY = Authority(Identity.generate())
RUN = pin_run_id("fuzz", AUTHORITY)
ME, PEER = Identity.generate(), Identity.generate()


def _token(identity: Identity) -> SignedToken:
    return AUTHORITY.issue_token(RUN, "alice", identity.peer_id, identity.public_key_bytes, time.time(), 3600)


GUARD = RunAuthenticator(RUN, AUTHORITY.key, ME, _token(ME))
_signature = st.one_of(st.binary(min_size=64, max_size=64), st.binary(max_size=70))
_token_st = st.one_of(
    st.just(_token(PEER)),
    st.builds(SignedToken, token=st.binary(max_size=64), signature=st.binary(min_size=64, max_size=64)),
)


def _structured_request_auth() -> st.SearchStrategy[bytes]:
    fields = st.fixed_dictionaries(
        {},
        optional={
            "token": st.one_of(_token_st.map(msgspec.to_builtins), st.binary(max_size=8), st.none()),
            "timestamp": st.one_of(st.floats(allow_nan=True), st.integers(-(2**63), 2**63 - 1), st.text()),
            "nonce": st.binary(max_size=20),
            "signature": _signature,
            "extra": st.integers(-(2**63), 2**63 - 1),
        },
    )
    return fields.map(msgspec.msgpack.encode)


_auth_bytes = st.one_of(st.binary(max_size=300), _structured_request_auth(), st.just(FINDING_1))


@FUZZ
@given(auth=_auth_bytes)
def test_credential_decoders_raise_only_protocol_error(auth: bytes) -> None:
    for decode in (decode_request_auth, decode_response_auth):
        try:
            decoded = decode(auth)
        except ProtocolError:
            continue
        assert isinstance(decoded, RequestAuth | ResponseAuth)


@FUZZ
@given(auth=_auth_bytes, payload=st.binary(max_size=16))
def test_guard_checks_raise_only_auth_error(auth: bytes, payload: bytes) -> None:
    with pytest.raises(AuthError):
        GUARD.check_request(PEER.peer_id, "dht.ping", 1, payload, auth)
    with pytest.raises(AuthError):
        GUARD.check_response(PEER.peer_id, b"n" * 16, "dht.pong", payload, auth)
    assert isinstance(GUARD.sign_error(auth, payload), bytes)


def test_guard_refuses_the_bytes_of_finding_1_as_a_bad_token() -> None:
    with pytest.raises(AuthError) as request:
        GUARD.check_request(PEER.peer_id, "bulk.header", 0, b"", FINDING_1)
    with pytest.raises(AuthError) as response:
        GUARD.check_response(PEER.peer_id, b"n" * 16, "bulk.ack", b"", FINDING_1)
    assert request.value.code == response.value.code == ErrorCode.BAD_TOKEN


def test_guard_signs_a_refusal_bound_to_the_requests_nonce() -> None:
    peer_guard = RunAuthenticator(RUN, AUTHORITY.key, PEER, _token(PEER))
    auth, nonce = peer_guard.sign_request(ME.peer_id, "dht.ping", 1, b"\x80")
    refusal = GUARD.sign_error(auth, b"payload")
    peer_guard.check_response(ME.peer_id, nonce, "error", b"payload", refusal)  # verifies
    with pytest.raises(AuthError):
        peer_guard.check_response(ME.peer_id, b"x" * 16, "error", b"payload", refusal)  # another request
    assert GUARD.sign_error(b"", b"payload") == b""  # no nonce to bind to: unsigned (and refused)


@FUZZ
@given(value=st.one_of(st.binary(max_size=200), st.just(FINDING_1)))
def test_revocation_records_of_any_bytes_are_rejected_not_raised(value: bytes) -> None:
    record = SignedRecord(
        key=b"k" * 20, subkey=b"alice", value=value, expiration=1e9, writer=PEER.peer_id, signature=b"s" * 64
    )
    with pytest.raises(RecordRejected):
        decode_revocation(record, RUN, AUTHORITY.key)
