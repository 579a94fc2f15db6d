from __future__ import annotations

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.dht import SignedRecord
from shared.auth.keys import Identity
from shared.dht.keys import key_id
from shared.dht.records import (
    CompositeValidator,
    ExpiryValidator,
    RecordValidator,
    SignatureValidator,
    SubkeyOwnerValidator,
    default_validator,
    newer,
    sign_record,
)
from shared.errors import RecordRejected

ALICE = Identity(Ed25519PrivateKey.from_private_bytes(b"\x01" * 32))
BOB = Identity(Ed25519PrivateKey.from_private_bytes(b"\x02" * 32))
KEY = key_id("run/progress")
NOW = 1_700_000_000.0


def record(
    identity: Identity = ALICE,
    *,
    key: bytes = KEY,
    value: bytes = b"v",
    expiration: float = NOW + 60,
    subkey: bytes | None = None,
) -> SignedRecord:
    return sign_record(identity, key, value, expiration, subkey)


def test_signed_record_passes_the_default_validator() -> None:
    signed = record(subkey=ALICE.peer_id.encode())
    assert signed.writer == ALICE.peer_id
    assert len(signed.signature) == 64
    default_validator().validate(signed, NOW)


def test_signed_record_survives_the_wire() -> None:
    signed = record(subkey=b"s")
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(signed), type=SignedRecord)
    SignatureValidator().validate(decoded, NOW)


@pytest.mark.parametrize(
    ("field", "value"),
    [("key", b"\x00" * 19), ("value", b"x" * (64 * 1024 + 1)), ("subkey", b"s" * 257), ("expiration", 1e13)],
)
def test_sign_record_rejects_fields_outside_wire_limits(field: str, value: object) -> None:
    args: dict[str, object] = {"key": KEY, "value": b"v", "expiration": NOW + 60, "subkey": None}
    args[field] = value
    with pytest.raises(ValueError, match=r"cannot sign record|not a finite"):
        sign_record(ALICE, **args)  # type: ignore[arg-type]


def tampered(signed: SignedRecord, field: str, data: st.DataObject) -> SignedRecord:
    changes: dict[str, object]
    if field == "key":
        changes = {"key": data.draw(st.binary(min_size=20, max_size=20).filter(lambda b: b != signed.key))}
    elif field == "subkey":
        other_subkeys = (st.none() | st.binary(max_size=8)).filter(lambda s: s != signed.subkey)
        changes = {"subkey": data.draw(other_subkeys)}
    elif field == "value":
        changes = {"value": data.draw(st.binary(max_size=16).filter(lambda v: v != signed.value))}
    elif field == "expiration":
        changes = {"expiration": signed.expiration + data.draw(st.sampled_from([-1.0, 1e-3, 1.0, 3600.0]))}
    elif field == "writer":
        changes = {"writer": BOB.peer_id}
    else:
        index = data.draw(st.integers(min_value=0, max_value=63))
        flipped = bytearray(signed.signature)
        flipped[index] ^= 1 << data.draw(st.integers(min_value=0, max_value=7))
        changes = {"signature": bytes(flipped)}
    return msgspec.structs.replace(signed, **changes)


@settings(max_examples=60, deadline=None)
@given(
    field=st.sampled_from(["key", "subkey", "value", "expiration", "writer", "signature"]),
    subkey=st.none() | st.binary(max_size=8),
    data=st.data(),
)
def test_tampering_with_any_record_field_breaks_the_signature(
    field: str, subkey: bytes | None, data: st.DataObject
) -> None:
    forged = tampered(record(subkey=subkey), field, data)
    with pytest.raises(RecordRejected, match="bad signature"):
        SignatureValidator().validate(forged, NOW)


def test_signature_validator_rejects_malformed_writer() -> None:
    forged = msgspec.structs.replace(record(), writer="not-a-peer-id")
    with pytest.raises(RecordRejected, match="bad signature"):
        SignatureValidator().validate(forged, NOW)


def test_expiry_validator_rejects_expired_records() -> None:
    with pytest.raises(RecordRejected, match="expired"):
        ExpiryValidator().validate(record(expiration=NOW), NOW)
    with pytest.raises(RecordRejected, match="expired"):
        ExpiryValidator().validate(record(expiration=NOW - 1), NOW)


def test_expiry_validator_rejects_expiry_in_the_far_future() -> None:
    validator = ExpiryValidator(max_ttl=3600, max_clock_skew=300)
    validator.validate(record(expiration=NOW + 3900), NOW)
    with pytest.raises(RecordRejected, match="far future"):
        validator.validate(record(expiration=NOW + 3901), NOW)
    with pytest.raises(RecordRejected, match="far future"):
        default_validator().validate(record(expiration=NOW + 10 * 24 * 3600), NOW)


@pytest.mark.parametrize(("max_ttl", "max_clock_skew"), [(-1.0, 0.0), (1.0, -1.0), (float("inf"), 0.0)])
def test_expiry_validator_rejects_bad_limits(max_ttl: float, max_clock_skew: float) -> None:
    with pytest.raises(ValueError, match="seconds"):
        ExpiryValidator(max_ttl, max_clock_skew)


def test_default_validator_rejects_bad_signatures() -> None:
    forged = msgspec.structs.replace(record(), value=b"other")
    with pytest.raises(RecordRejected, match="bad signature"):
        default_validator().validate(forged, NOW)


def test_subkey_owner_validator_lets_only_the_named_peer_write_its_subkey() -> None:
    validator = SubkeyOwnerValidator([KEY])
    validator.validate(record(subkey=ALICE.peer_id.encode()), NOW)
    with pytest.raises(RecordRejected, match="only the peer named"):
        validator.validate(record(subkey=BOB.peer_id.encode()), NOW)
    with pytest.raises(RecordRejected, match="needs the writer's peer id"):
        validator.validate(record(subkey=None), NOW)


def test_subkey_owner_validator_applies_to_every_key_but_exempt_ones() -> None:
    other = key_id("avg.7.")  # e.g. a matchmaking key: not a per-peer key, still own subkeys only
    validator = SubkeyOwnerValidator([KEY], exempt_keys=[key_id("run.revocations")])
    with pytest.raises(RecordRejected, match="only the peer named"):
        validator.validate(record(key=other, subkey=BOB.peer_id.encode()), NOW)
    with pytest.raises(RecordRejected, match="only the peer named"):
        validator.validate(record(key=other, subkey=b"anything"), NOW)
    validator.validate(record(key=other, subkey=ALICE.peer_id.encode()), NOW)
    validator.validate(record(key=other), NOW)  # a plain record of a non-per-peer key has no owner
    validator.validate(record(key=key_id("run.revocations"), subkey=b"bob"), NOW)


def test_subkey_owner_validator_rejects_malformed_key_ids() -> None:
    with pytest.raises(ValueError, match="20 bytes"):
        SubkeyOwnerValidator([b"short"])


def test_composite_validator_applies_validators_in_order() -> None:
    seen: list[str] = []

    class Recording:
        def __init__(self, name: str, reject: bool) -> None:
            self.name, self.reject = name, reject

        def validate(self, record: SignedRecord, now: float) -> None:
            seen.append(self.name)
            if self.reject:
                raise RecordRejected(self.name)

    validators: list[RecordValidator] = [Recording("a", False), Recording("b", True), Recording("c", True)]
    with pytest.raises(RecordRejected, match=r"^b$"):
        CompositeValidator(validators).validate(record(), NOW)
    assert seen == ["a", "b"]
    CompositeValidator([]).validate(record(), NOW)


def test_newer_prefers_later_expiration_then_larger_signature() -> None:
    early, late = record(expiration=NOW + 10), record(expiration=NOW + 20)
    assert newer(late, early)
    assert not newer(early, late)
    a = record(value=b"a")
    b = record(value=b"b")
    assert a.expiration == b.expiration
    assert newer(a, b) == (a.signature > b.signature) != newer(b, a)
    assert not newer(a, a)
