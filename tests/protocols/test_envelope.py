"""The envelope: framing, the kind registry, size limits and validating decoders (protocols.envelope)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.bulk import BulkAck, BulkHeader
from protocols.codes import ErrorCode
from protocols.dht import (
    FindNodeRequest,
    FindNodeResponse,
    FindValueRequest,
    FindValueResponse,
    LeaveNotice,
    NodeInfo,
    PingRequest,
    PingResponse,
    SignedRecord,
    StoreRequest,
    StoreResponse,
)
from protocols.envelope import (
    FRAME_HEADER,
    PROTOCOL_VERSION,
    Envelope,
    ErrorReply,
    Flags,
    Message,
    decode_envelope,
    decode_message,
    encode_frame,
    registered_kinds,
)
from protocols.errors import ProtocolError
from protocols.handshake import ClientProof, ServerHello, Welcome
from protocols.peer_id import peer_id_from_public_key
from protocols.probe import ReachReply, ReachRequest
from protocols.relay import (
    CircuitAccepted,
    CircuitGranted,
    CircuitOffer,
    CircuitRequest,
    PunchConnect,
    PunchReply,
    PunchSync,
    RelayReservation,
    RelayReserve,
)
from protocols.reversal import DialBackReply, DialBackRequest

PEER = peer_id_from_public_key(bytes(range(32)))
ADDR = "/ip4/203.0.113.7/tcp/4001/p2p/" + PEER
RECORD = SignedRecord(
    key=b"k" * 20,
    subkey=None,
    value=b"\x00\xffvalue",
    expiration=1_700_000_000.5,
    writer=PEER,
    signature=b"s" * 64,
)
SUBKEY_RECORD = msgspec.structs.replace(RECORD, subkey=PEER.encode(), value=b"")
NODE = NodeInfo(peer_id=PEER, addrs=[ADDR, "/ip6/::1/tcp/4001"])

#: One representative value of every kind the protocols package registers.
SAMPLES: list[Message] = [
    ErrorReply(code=int(ErrorCode.NOT_FOUND), message="nothing stored under that key"),
    ServerHello(run_id="run-1.a@b:c", nonce=b"n" * 32, agent="dedloc/0.1"),
    ClientProof(
        run_id="run-1",
        lane="bulk",
        public_key=bytes(range(32)),
        listen_addrs=[ADDR],
        agent="dedloc/0.1",
        signature=b"\x01" * 64,
    ),
    Welcome(),
    PingRequest(),
    PingResponse(),
    FindNodeRequest(target=b"t" * 20),
    FindNodeResponse(nodes=[NODE]),
    FindValueRequest(key=b"k" * 20),
    FindValueResponse(records=[RECORD, SUBKEY_RECORD], nodes=[NODE]),
    StoreRequest(records=[RECORD, SUBKEY_RECORD]),
    StoreResponse(accepted=[True, False]),
    LeaveNotice(),
    BulkHeader(topic="grad.avg-1", nbytes=2**40, meta=b"\x00meta"),
    BulkAck(meta=b"ack"),
    ReachRequest(addrs=[ADDR, "/ip6/::1/tcp/4001"]),
    ReachReply(reachable=[ADDR], observed="203.0.113.7"),
    DialBackRequest(),
    DialBackReply(),
    RelayReserve(),
    RelayReservation(ttl=600.0, max_circuit_bytes=2**30, max_circuit_seconds=600.0, max_circuits=16),
    CircuitRequest(target=PEER),
    CircuitGranted(token=b"d" * 16),
    CircuitOffer(token=b"t" * 16, dialer=PEER),
    CircuitAccepted(),
    PunchConnect(observed="203.0.113.7:4001", lane="bulk"),
    PunchReply(observed="[2001:db8::7]:4001"),
    PunchSync(),
]

_ENVELOPE = bytes([0x95, PROTOCOL_VERSION])  # msgpack: a 5-field envelope of this version


def _body(frame: bytes) -> bytes:
    (length,) = FRAME_HEADER.unpack(frame[: FRAME_HEADER.size])
    body = frame[FRAME_HEADER.size :]
    assert length == len(body)
    return body


def _raw_body(version: Any, kind: Any, request_id: Any, flags: Any, payload: Any) -> bytes:
    """An envelope body built field by field, so each field can be wrong on purpose."""
    return msgspec.msgpack.encode([version, kind, request_id, flags, payload])


def _body_with_payload(kind: str, payload: object, request_id: int = 7) -> bytes:
    raw = msgspec.Raw(msgspec.msgpack.encode(payload))
    return msgspec.msgpack.encode(Envelope(PROTOCOL_VERSION, kind, request_id, int(Flags.REQUEST), raw))


def _protocol_kinds() -> set[str]:
    return {kind for kind, cls in registered_kinds().items() if cls.__module__.startswith("protocols.")}


# ---------------------------------------------------------------- round trips


def test_samples_cover_every_registered_protocol_kind() -> None:
    missing = _protocol_kinds() - {sample.kind for sample in SAMPLES}
    assert not missing, f"add a representative value to SAMPLES for {sorted(missing)}"


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.kind)
@pytest.mark.parametrize("flags", list(Flags))
def test_envelope_round_trips_every_kind(message: Message, flags: Flags) -> None:
    frame = encode_frame(message, 2**63 - 1, flags)

    envelope = decode_envelope(_body(frame))
    decoded = decode_message(envelope, expected=type(message))

    assert (envelope.version, envelope.kind, envelope.request_id, envelope.flags) == (
        PROTOCOL_VERSION,
        message.kind,
        2**63 - 1,
        int(flags),
    )
    assert decoded == message
    assert type(decoded) is type(message)


def test_decode_message_accepts_error_reply_whatever_kind_is_expected() -> None:
    body = _body(encode_frame(ErrorReply(code=int(ErrorCode.OVERLOADED)), 3, Flags.ERROR))

    decoded = decode_message(decode_envelope(body), expected=PingResponse)

    assert decoded == ErrorReply(code=int(ErrorCode.OVERLOADED))


def test_decode_message_rejects_another_kind_than_expected() -> None:
    body = _body(encode_frame(PingResponse(), 3, Flags.RESPONSE))

    with pytest.raises(ProtocolError, match=r"expected a dht\.find_node\.ok message, got dht\.pong"):
        decode_message(decode_envelope(body), expected=FindNodeResponse)


# ---------------------------------------------------------------- header checks


def test_decode_envelope_rejects_wrong_version_with_code_wrong_version_saying_who_upgrades() -> None:
    newer = _raw_body(PROTOCOL_VERSION + 1, "dht.ping", 1, 0, {})
    with pytest.raises(ProtocolError) as info:
        decode_envelope(newer)
    assert info.value.code == ErrorCode.WRONG_VERSION
    assert str(info.value) == (
        f"upgrade dedloc: this run speaks protocol {PROTOCOL_VERSION + 1}, you speak {PROTOCOL_VERSION}"
    )
    older = _raw_body(PROTOCOL_VERSION - 1, "dht.ping", 1, 0, {})
    with pytest.raises(
        ProtocolError, match=rf"the peer speaks protocol {PROTOCOL_VERSION - 1}, older"
    ) as info:
        decode_envelope(older)
    assert info.value.code == ErrorCode.WRONG_VERSION


def test_decode_envelope_rejects_unknown_kind_with_code_unknown_kind() -> None:
    body = _raw_body(PROTOCOL_VERSION, "no.such.kind", 1, 0, {})

    with pytest.raises(ProtocolError, match=r"unknown message kind 'no\.such\.kind'") as info:
        decode_envelope(body)

    assert info.value.code == ErrorCode.UNKNOWN_KIND


@pytest.mark.parametrize(("request_id", "flags"), [(-1, 0), (2**63, 0), (1, 4), (1, -1)])
def test_decode_envelope_rejects_out_of_range_request_id_or_flags(request_id: int, flags: int) -> None:
    with pytest.raises(ProtocolError, match=r"request id|flags") as info:
        decode_envelope(_raw_body(PROTOCOL_VERSION, "dht.ping", request_id, flags, {}))

    assert info.value.code == ErrorCode.BAD_REQUEST


def test_encode_frame_rejects_payload_above_kind_limit_with_code_too_large() -> None:
    # Constraints are checked on decode, not construction: a 300-byte key makes a >256-byte payload.
    oversized = FindValueRequest(key=b"k" * 300)

    with pytest.raises(ProtocolError, match="exceeds its limit of 256") as info:
        encode_frame(oversized, 1, Flags.REQUEST)

    assert info.value.code == ErrorCode.TOO_LARGE


def test_decode_envelope_rejects_payload_above_kind_limit_with_code_too_large() -> None:
    body = _body_with_payload("dht.ping", b"x" * (PingRequest.max_bytes + 1))

    with pytest.raises(ProtocolError, match="exceeds its limit of 256") as info:
        decode_envelope(body)

    assert info.value.code == ErrorCode.TOO_LARGE


def test_decode_envelope_accepts_payload_exactly_at_kind_limit() -> None:
    body = _body_with_payload("dht.ping", b"x" * (PingRequest.max_bytes - 2))  # bin8: 2 header bytes
    envelope = decode_envelope(body)

    assert len(envelope.payload) == PingRequest.max_bytes
    with pytest.raises(ProtocolError, match=r"invalid dht\.ping message"):
        decode_message(envelope)  # the size is fine, the schema is not


# ---------------------------------------------------------------- malformed bodies


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.kind)
def test_decode_envelope_rejects_every_truncation_of_a_valid_body(message: Message) -> None:
    body = _body(encode_frame(message, 5, Flags.REQUEST))

    for cut in range(len(body)):
        with pytest.raises(ProtocolError, match="malformed envelope"):
            decode_envelope(body[:cut])


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        msgspec.msgpack.encode({"version": 1}),
        msgspec.msgpack.encode([1, "dht.ping", 1]),
        msgspec.msgpack.encode(["1", "dht.ping", 1, 0, {}]),
        msgspec.msgpack.encode([1, 7, 1, 0, {}]),
        msgspec.msgpack.encode([1, "dht.ping", 1.5, 0, {}]),
    ],
    ids=["empty", "reserved-byte", "map", "short-array", "str-version", "int-kind", "float-id"],
)
def test_decode_envelope_rejects_malformed_headers(body: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed envelope") as info:
        decode_envelope(body)

    assert info.value.code == ErrorCode.BAD_REQUEST


_DEEP = b"\x91" * 5000 + b"\xc0"  # 5000 nested one-element arrays: msgspec raises RecursionError


def test_decode_envelope_rejects_deeply_nested_payload() -> None:
    body = _ENVELOPE + b"\xa8dht.ping\x01\x00" + _DEEP

    with pytest.raises(ProtocolError, match="malformed envelope: maximum recursion depth"):
        decode_envelope(body)


def test_decode_envelope_rejects_invalid_utf8_kind() -> None:
    body = _ENVELOPE + b"\xa2\xff\xfe\x01\x00\x80"

    # msgspec < 0.23 lets Python's codec raise ("'utf-8' codec can't decode"), 0.23 says "Invalid UTF-8"
    with pytest.raises(ProtocolError, match=r"(?i)malformed envelope: .*utf-8"):
        decode_envelope(body)


def test_decode_message_rejects_invalid_utf8_string_field() -> None:
    payload = b"\x82\xa4code\x01\xa7message\xa2\xff\xfe"
    envelope = decode_envelope(b"\x95" + bytes([PROTOCOL_VERSION]) + b"\xa5error\x01\x02" + payload)

    with pytest.raises(ProtocolError, match=r"(?i)malformed error payload: .*utf-8"):
        decode_message(envelope)


def _record_fields(**changes: object) -> dict[str, object]:
    fields: dict[str, object] = msgspec.structs.asdict(RECORD)
    fields.update(changes)
    return fields


@pytest.mark.parametrize(
    ("kind", "payload", "problem"),
    [
        (
            "dht.find_node.ok",
            {"nodes": [{"peer_id": "not a peer id!", "addrs": [ADDR]}]},
            r"\$\.nodes\[0\]\.peer_id",
        ),
        ("dht.find_node.ok", {"nodes": [{"peer_id": PEER, "addrs": []}]}, r"\$\.nodes\[0\]\.addrs"),
        ("dht.find_node.ok", {"nodes": [{"peer_id": PEER, "addrs": ["ip4/x"]}]}, r"\$\.nodes\[0\]\.addrs"),
        ("dht.find_value", {"key": b"k" * 19}, r"length >= 20 - at `\$\.key`"),
        ("dht.find_node", {"target": b"t" * 21}, r"length <= 20 - at `\$\.target`"),
        ("dht.find_node", {}, "missing required field `target`"),
        ("dht.find_node", {"target": b"t" * 20, "extra": 1}, "unknown field `extra`"),
        ("bulk.header", {"topic": "t", "nbytes": -1}, r">= 0 - at `\$\.nbytes`"),
        ("bulk.header", {"topic": "T!", "nbytes": 1}, r"\$\.topic"),
        ("bulk.header", {"topic": "t", "nbytes": 2**40 + 1}, r"\$\.nbytes"),
        ("dht.store", {"records": []}, r"length >= 1 - at `\$\.records`"),
        ("dht.store", {"records": [_record_fields(expiration=math.nan)]}, "expiration nan is not a finite"),
        ("dht.store", {"records": [_record_fields(expiration=math.inf)]}, "expiration inf is not a finite"),
        ("dht.store", {"records": [_record_fields(writer="12D3KooW")]}, r"\$\.records\[0\]\.writer"),
        ("dht.store", {"records": [_record_fields(signature=b"s" * 63)]}, r"\$\.records\[0\]\.signature"),
        ("hs.hello", {"run_id": "run 1", "nonce": b"n" * 32}, r"\$\.run_id"),
        ("hs.proof", {"run_id": "r", "lane": "udp", "public_key": b"k" * 32, "signature": b"s" * 64}, "lane"),
        ("error", {"code": 1, "message": "m" * 1025}, "longer than 1024"),
        ("error", {"code": "one"}, r"Expected `int`, got `str` - at `\$\.code`"),
        ("dht.ping", [], "Expected `object`, got `array`"),
    ],
)
def test_decode_message_rejects_invalid_fields_naming_the_problem(
    kind: str, payload: object, problem: str
) -> None:
    envelope = decode_envelope(_body_with_payload(kind, payload))

    with pytest.raises(ProtocolError, match=problem) as info:
        decode_message(envelope)

    assert kind in str(info.value)
    assert info.value.code == ErrorCode.BAD_REQUEST


def test_signed_record_rejects_non_finite_expiration_on_construction() -> None:
    with pytest.raises(ValueError, match="not a finite unix time"):
        msgspec.structs.replace(RECORD, expiration=math.nan)


def test_error_reply_rejects_message_longer_than_1024_characters() -> None:
    with pytest.raises(ValueError, match="longer than 1024"):
        ErrorReply(code=1, message="m" * 1025)


# ---------------------------------------------------------------- fuzzing

FUZZ = settings(
    max_examples=400,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _decode_all(body: bytes) -> None:
    """Decode ``body`` fully; anything but ProtocolError escaping is a bug."""
    try:
        envelope = decode_envelope(body)
        decode_message(envelope)
    except ProtocolError:
        pass


_msgpack_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=80),
    st.binary(max_size=80),
)
_msgpack_values = st.recursive(
    _msgpack_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.text(max_size=12), inner, max_size=6),
    ),
    max_leaves=30,
)


@st.composite
def _plausible_payloads(draw: st.DrawFn, kind: str) -> object:
    """Maps using the kind's real field names (so decoding gets past the first key), or anything."""
    cls = registered_kinds().get(kind)
    if cls is None or draw(st.booleans()):
        return draw(_msgpack_values)
    names = [field.encode_name for field in msgspec.structs.fields(cls)]
    keys = st.sampled_from(names) if names else st.text(max_size=8)
    return draw(st.dictionaries(keys, _msgpack_values, max_size=len(names) + 1))


@st.composite
def _plausible_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.one_of(st.sampled_from(sorted(_protocol_kinds())), st.text(max_size=20)))
    version = draw(st.one_of(st.just(PROTOCOL_VERSION), st.integers(-(2**63), 2**64 - 1)))
    request_id = draw(st.one_of(st.integers(0, 2**63 - 1), st.integers(-(2**63), 2**64 - 1)))
    flags = draw(st.one_of(st.sampled_from([int(f) for f in Flags]), st.integers(-5, 300)))
    payload = draw(_plausible_payloads(kind))
    fields: list[object] = [version, kind, request_id, flags, payload]
    if draw(st.integers(0, 9)) == 0:  # now and then, the wrong shape of array
        fields = draw(st.lists(st.sampled_from(fields), max_size=7))
    return msgspec.msgpack.encode(fields)


@FUZZ
@given(body=st.binary(max_size=512))
def test_decoders_raise_only_protocol_error_on_arbitrary_bytes(body: bytes) -> None:
    _decode_all(body)


@FUZZ
@given(body=_plausible_bodies())
def test_decoders_raise_only_protocol_error_on_plausible_envelopes(body: bytes) -> None:
    _decode_all(body)


@FUZZ
@given(
    sample=st.sampled_from(SAMPLES),
    edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=8),
)
def test_decoders_raise_only_protocol_error_on_mutated_valid_bodies(
    sample: Message, edits: list[tuple[int, int]]
) -> None:

    body = bytearray(_body(encode_frame(sample, 9, Flags.REQUEST)))
    for position, value in edits:
        body[position % len(body)] = value

    _decode_all(bytes(body))
