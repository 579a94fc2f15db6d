"""Who may write DHT records (shared.dht.admission): each rule of the validator, on records alone."""

from __future__ import annotations

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.auth import (
    REVOCATIONS_KEY,
    SignedRevocation,
    SignedToken,
    revocation_payload,
    token_payload,
)
from protocols.dht import SignedRecord
from protocols.presence import PRESENCE_KEY
from shared.auth.authority import Authority, pin_run_id
from shared.auth.guard import OpenAuthenticator, RunAuthenticator
from shared.auth.keys import Identity
from shared.dht.admission import TOKEN_GRACE, AdmissionValidator, TokenlessValidator, record_user
from shared.dht.keys import key_id
from shared.dht.records import sign_record
from shared.errors import RecordRejected
from shared.node import run_validator

AUTHORITY = Authority(Identity(Ed25519PrivateKey.from_private_bytes(b"\x09" * 32)))
RUN = pin_run_id("admission", AUTHORITY)
ALICE = Identity(Ed25519PrivateKey.from_private_bytes(b"\x01" * 32))
BOB = Identity(Ed25519PrivateKey.from_private_bytes(b"\x02" * 32))
NOW = 1_700_000_000.0
KEY = key_id("some.key")
REVOCATIONS = key_id(REVOCATIONS_KEY)


def token(
    identity: Identity,
    user: str = "alice",
    *,
    authority: Authority = AUTHORITY,
    run: str = RUN,
    issued: float = NOW - 10,
    lifetime: float = 3600,
) -> SignedToken:
    return authority.issue_token(run, user, identity.peer_id, identity.public_key_bytes, issued, lifetime)


def record(
    identity: Identity = ALICE,
    tok: SignedToken | None = None,
    *,
    key: bytes = KEY,
    value: bytes = b"v",
    expiration: float = NOW + 60,
    subkey: bytes | None = None,
) -> SignedRecord:
    return sign_record(identity, key, value, expiration, subkey, tok)


def pinned(revoked: set[str] | None = None) -> AdmissionValidator:
    return AdmissionValidator(RUN, AUTHORITY.key, set() if revoked is None else revoked)


def test_admission_accepts_an_admitted_writer_and_names_its_user() -> None:
    signed = record(tok=token(ALICE, "alice"))
    pinned().validate(signed, NOW)
    assert record_user(signed) == "alice"
    assert record_user(record()) == ALICE.peer_id  # open runs: every peer its own user


@pytest.mark.parametrize(
    ("tok", "reason"),
    [
        (None, "carries no token"),
        (token(ALICE, authority=Authority(Identity.generate())), "not signed by this run's authority"),
        (token(ALICE, run=pin_run_id("other", AUTHORITY)), "token of run"),
        (token(BOB, "bob"), "not of its writer"),  # a lent token: Bob's, on a record Alice signed
        (token(ALICE, issued=NOW - 7200, lifetime=3600), "expired"),
    ],
)
def test_admission_refuses_records_of_writers_not_admitted(tok: SignedToken | None, reason: str) -> None:
    with pytest.raises(RecordRejected, match=reason):
        pinned().validate(record(tok=tok, expiration=NOW + TOKEN_GRACE), NOW)


def test_admission_refuses_revoked_users_at_once_through_the_live_set() -> None:
    revoked: set[str] = set()
    validator = pinned(revoked)
    signed = record(tok=token(ALICE, "alice"))
    validator.validate(signed, NOW)  # cached as verified
    revoked.add("alice")
    with pytest.raises(RecordRejected, match="removed from the run"):
        validator.validate(signed, NOW)


def test_admission_keeps_records_written_while_the_token_was_valid() -> None:
    tok = token(ALICE, issued=NOW - 3600, lifetime=3000)  # expired 600 s ago
    pinned().validate(record(tok=tok, expiration=NOW + 60), NOW)
    pinned().validate(record(tok=tok, expiration=NOW - 600 + TOKEN_GRACE), NOW)
    with pytest.raises(RecordRejected, match="expired"):
        pinned().validate(record(tok=tok, expiration=NOW - 600 + TOKEN_GRACE + 1), NOW)


def test_admission_token_is_covered_by_the_writer_signature() -> None:
    """A relayer cannot swap the token of someone else's record (e.g. to pin it on another user)."""
    signed = record(tok=token(ALICE, "alice"))
    swapped = msgspec.structs.replace(signed, token=token(ALICE, "alice-again"))
    pinned().validate(swapped, NOW)  # the token itself is valid...
    with pytest.raises(RecordRejected, match="bad signature"):
        run_validator(RunAuthenticator(RUN, AUTHORITY.key, ALICE)).validate(
            swapped, NOW
        )  # ...the record is not


def test_admission_accepts_authority_revocations_from_any_carrier_and_nothing_else_there() -> None:
    revocation = msgspec.msgpack.encode(AUTHORITY.revoke(RUN, "mallory", NOW))
    revoked = {"alice"}  # even a carrier that was itself removed, with no token, spreads it
    pinned(revoked).validate(record(key=REVOCATIONS, value=revocation, subkey=b"mallory"), NOW)
    forged = msgspec.msgpack.encode(Authority(Identity.generate()).revoke(RUN, "bob", NOW))
    with pytest.raises(RecordRejected, match="not an authority revocation"):
        pinned().validate(record(key=REVOCATIONS, value=forged, subkey=b"bob"), NOW)
    with pytest.raises(RecordRejected, match="another subkey"):
        pinned().validate(record(key=REVOCATIONS, value=revocation, subkey=b"bob"), NOW)
    with pytest.raises(RecordRejected, match="not an authority revocation"):
        pinned().validate(record(tok=token(ALICE), key=REVOCATIONS, value=b"junk", subkey=b"bob"), NOW)


def test_run_validator_enforces_own_subkeys_and_admission_in_a_pinned_run() -> None:
    validator = run_validator(RunAuthenticator(RUN, AUTHORITY.key, ALICE))
    tok = token(ALICE)
    validator.validate(record(tok=tok, key=key_id(PRESENCE_KEY), subkey=ALICE.peer_id.encode()), NOW)
    for subkey in (BOB.peer_id.encode(), None):
        with pytest.raises(RecordRejected, match="subkey"):
            validator.validate(record(tok=tok, key=key_id(PRESENCE_KEY), subkey=subkey), NOW)
    with pytest.raises(RecordRejected, match="only the peer named"):
        validator.validate(record(tok=tok, key=key_id("avg.3."), subkey=BOB.peer_id.encode()), NOW)
    with pytest.raises(RecordRejected, match="no token"):
        validator.validate(record(key=key_id(PRESENCE_KEY), subkey=ALICE.peer_id.encode()), NOW)


def test_open_runs_refuse_tokens_they_cannot_check() -> None:
    validator = run_validator(OpenAuthenticator())
    validator.validate(record(subkey=ALICE.peer_id.encode()), NOW)
    with pytest.raises(RecordRejected, match="open run"):
        validator.validate(record(tok=token(ALICE)), NOW)
    with pytest.raises(RecordRejected, match="open run"):
        TokenlessValidator().validate(record(tok=token(ALICE)), NOW)


def test_admission_rejects_a_bad_grace() -> None:
    with pytest.raises(ValueError, match="token_grace"):
        AdmissionValidator(RUN, AUTHORITY.key, set(), token_grace=float("inf"))


@settings(max_examples=150, deadline=None)
@given(
    body=st.binary(max_size=300),
    by_authority=st.booleans(),
    where=st.sampled_from(["token", "revocation", "revocation-raw"]),
    subkey=st.one_of(st.none(), st.just(ALICE.peer_id.encode()), st.binary(max_size=40)),
)
def test_admission_refuses_arbitrary_tokens_and_revocations_only_with_record_rejected(
    body: bytes, by_authority: bool, where: str, subkey: bytes | None
) -> None:
    """Attack: garbage (even garbage the authority signed) where a token or a revocation goes."""
    signer = AUTHORITY.identity if by_authority else BOB
    if where == "token":
        signed = record(tok=SignedToken(body, signer.sign(token_payload(body))), subkey=subkey)
    else:
        value = body
        if where == "revocation":
            value = msgspec.msgpack.encode(
                SignedRevocation(body[:512], signer.sign(revocation_payload(body[:512])))
            )
        signed = record(key=REVOCATIONS, value=value, subkey=subkey)
    validator = run_validator(RunAuthenticator(RUN, AUTHORITY.key, ALICE))
    with pytest.raises(RecordRejected):
        validator.validate(signed, NOW)
    assert record_user(signed) == ALICE.peer_id  # an unverifiable token names nobody
