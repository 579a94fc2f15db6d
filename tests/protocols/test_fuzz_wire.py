"""Fuzzing every wire decoder (issue 9, "Fuzzing in CI"): each registered message kind, the handshake,
bulk headers and the bulk-lane metas. Structured input (the kind's own field names with hostile values,
valid samples with one field replaced) and random bytes; a decoder may succeed or raise ProtocolError,
nothing else. test_envelope.py fuzzes the envelope itself; tests/shared/auth fuzzes credentials."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocols.api
import protocols.averaging
import protocols.ledger
import protocols.probe
import protocols.receipts
import protocols.state
import protocols.training
from protocols.envelope import PROTOCOL_VERSION, Envelope, Flags, Message, decode_message, registered_kinds
from protocols.errors import DECODE_FAILURES, ProtocolError

from .test_envelope import SAMPLES

FUZZ = settings(
    max_examples=25,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.just("\udcff"),  # a lone surrogate: encodes as invalid UTF-8 below
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=4)), inner, max_size=5),
    ),
    max_leaves=12,
)


def _encode(value: object) -> bytes:
    """msgpack of ``value``; lone surrogates become raw invalid UTF-8 (str8 with bytes ff fe)."""
    try:
        return msgspec.msgpack.encode(value)
    except (UnicodeEncodeError, TypeError):
        return bytes.fromhex("81a3fffefdc0")  # {"\xff\xfe\xfd": nil}: the bytes of finding 1


def _kinds() -> list[str]:
    return sorted(registered_kinds())


def _decode_payload(kind: str, payload: bytes) -> None:
    envelope = Envelope(PROTOCOL_VERSION, kind, 1, int(Flags.REQUEST), msgspec.Raw(payload))
    with contextlib.suppress(ProtocolError):
        decode_message(envelope)


@st.composite
def _structured(draw: st.DrawFn, cls: type[Message]) -> bytes:
    names = [field.encode_name for field in msgspec.structs.fields(cls)]
    if not names or draw(st.booleans()):
        return _encode(draw(_values))
    fields = draw(st.dictionaries(st.sampled_from(names), _values, max_size=len(names) + 1))
    return _encode(fields)


def test_fuzz_covers_every_registered_kind() -> None:
    # the handshake, DHT, bulk-lane and probe kinds all register with the one envelope registry
    assert {"error", "hs.hello", "hs.proof", "hs.welcome", "dht.store", "bulk.header", "probe.reach"} <= set(
        _kinds()
    )


@pytest.mark.parametrize("kind", _kinds())
@FUZZ
@given(data=st.data())
def test_each_kind_decodes_structured_garbage_to_protocol_error_only(kind: str, data: st.DataObject) -> None:
    _decode_payload(kind, data.draw(_structured(registered_kinds()[kind])))


@pytest.mark.parametrize("kind", _kinds())
@FUZZ
@given(payload=st.binary(max_size=256))
def test_each_kind_decodes_random_bytes_to_protocol_error_only(kind: str, payload: bytes) -> None:
    _decode_payload(kind, payload)


@FUZZ
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_valid_samples_with_one_hostile_field_decode_to_protocol_error_only(
    sample: Message, data: st.DataObject
) -> None:
    fields = msgspec.to_builtins(sample)
    assert isinstance(fields, dict)
    if fields:
        fields[data.draw(st.sampled_from(sorted(fields)))] = data.draw(_values)
    _decode_payload(sample.kind, _encode(fields))


# ---------------------------------------------------------------- bulk-lane metas and DHT values

META_DECODERS: list[Callable[[bytes], object]] = [
    protocols.probe.decode_download_probe,
    protocols.probe.decode_probe_receipt,
    protocols.probe.decode_capability_record,
    protocols.state.decode_state_request,
    protocols.state.decode_state_chunk,
    protocols.averaging.decode_part_header,
    protocols.averaging.decode_pull_request,
    protocols.averaging.decode_averaged_header,
    protocols.averaging.decode_relay_request,
    protocols.receipts.decode_receipt,
    protocols.ledger.decode_capabilities,
]


@pytest.mark.parametrize("decode", META_DECODERS, ids=lambda f: f.__name__)
@FUZZ
@given(meta=st.one_of(st.binary(max_size=256), _values.map(_encode)))
def test_meta_decoders_raise_only_protocol_error(decode: Callable[[bytes], object], meta: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode(meta)


@pytest.mark.parametrize("decode", META_DECODERS, ids=lambda f: f.__name__)
def test_meta_decoders_refuse_the_bytes_of_finding_1(decode: Callable[[bytes], object]) -> None:
    with pytest.raises(ProtocolError):
        decode(bytes.fromhex("81a3fffefdc0"))


# ---------------------------------------------------------------- matchmaking's DHT values

_TICKET = protocols.averaging.JoinTicket(
    addr="/ip4/127.0.0.1/tcp/4001",
    weight=0.0,
    norm=0.0,
    samples_per_second=1.0,
    upload_bps=1.0,
    download_bps=1.0,
    overflow=True,
)
_ASSEMBLY = protocols.averaging.GroupAssembly(
    group_id=b"g",
    round=3,
    members=[protocols.averaging.AssemblyMember("p", None, 0.0, 0.0, True)],
    slice_sizes=[4],
    codec="none",
    part_numel=4,
    deadline=1.0,
    predicted_seconds=0.5,
)


@pytest.mark.parametrize("sample", [_TICKET, _ASSEMBLY], ids=lambda s: type(s).__name__)
@FUZZ
@given(data=st.data())
def test_round_tickets_and_plans_decode_to_decode_failures_only(
    sample: msgspec.Struct, data: st.DataObject
) -> None:
    """Matchmaking reads these from the DHT and drops what fails with DECODE_FAILURES (the overflow claim
    of protocol version 3 included)."""
    fields = msgspec.to_builtins(sample)
    assert isinstance(fields, dict)
    fields[data.draw(st.sampled_from(sorted(fields)))] = data.draw(_values)
    raw = data.draw(st.one_of(st.just(_encode(fields)), st.binary(max_size=128), _values.map(_encode)))
    with contextlib.suppress(*DECODE_FAILURES):
        msgspec.msgpack.decode(raw, type=type(sample))


def test_a_ticket_claiming_overflow_sends_nothing() -> None:
    fields = msgspec.to_builtins(_TICKET)
    assert msgspec.msgpack.decode(_encode(fields), type=protocols.averaging.JoinTicket).overflow
    for name in ("weight", "norm"):
        with pytest.raises(msgspec.ValidationError, match="overflow"):
            msgspec.msgpack.decode(_encode({**fields, name: 1.0}), type=protocols.averaging.JoinTicket)
