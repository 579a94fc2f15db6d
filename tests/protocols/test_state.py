"""Wire metas of the state download (protocols.state): round trips, bounds, fuzzed decoders."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.errors import ProtocolError
from protocols.state import (
    MAX_CHUNK_BYTES,
    MAX_STATE_BYTES,
    StateChunk,
    StateRequest,
    decode_state_chunk,
    decode_state_request,
    encode_state_meta,
)

DIGEST = bytes(range(32))


def test_state_request_and_chunk_round_trip() -> None:
    request = StateRequest(digest=DIGEST, offset=MAX_STATE_BYTES - 1, length=MAX_CHUNK_BYTES)
    chunk = StateChunk(digest=DIGEST, offset=5, total=6)
    assert decode_state_request(encode_state_meta(request)) == request
    assert decode_state_chunk(encode_state_meta(chunk)) == chunk


@pytest.mark.parametrize(
    "fields",
    [
        {"digest": DIGEST[:31], "offset": 0, "length": 1},
        {"digest": DIGEST, "offset": -1, "length": 1},
        {"digest": DIGEST, "offset": 0, "length": 0},
        {"digest": DIGEST, "offset": 0, "length": MAX_CHUNK_BYTES + 1},
        {"digest": DIGEST, "offset": MAX_STATE_BYTES + 1, "length": 1},
        {"digest": DIGEST, "offset": 0},
        {"digest": DIGEST, "offset": 0, "length": 1, "extra": 1},
    ],
)
def test_state_request_out_of_bounds_is_a_protocol_error(fields: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        decode_state_request(msgspec.msgpack.encode(fields))


@pytest.mark.parametrize(
    "fields",
    [
        {"digest": DIGEST, "offset": 6, "total": 6},  # offset at the end: nothing to send
        {"digest": DIGEST, "offset": 0, "total": 0},
        {"digest": b"", "offset": 0, "total": 1},
        {"digest": DIGEST, "offset": 0, "total": MAX_STATE_BYTES + 1},
    ],
)
def test_state_chunk_out_of_bounds_is_a_protocol_error(fields: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        decode_state_chunk(msgspec.msgpack.encode(fields))


def test_state_metas_built_in_code_are_checked_too() -> None:
    with pytest.raises(ValueError, match="length"):
        StateRequest(digest=DIGEST, offset=0, length=MAX_CHUNK_BYTES + 1)
    with pytest.raises(ValueError, match="offset"):
        StateChunk(digest=DIGEST, offset=3, total=3)
    with pytest.raises(ValueError, match="digest"):
        StateRequest(digest=b"x", offset=0, length=1)


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.binary(max_size=40)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_plausible = st.dictionaries(
    st.sampled_from(["digest", "offset", "length", "total", "x"]), _values, max_size=4
).map(msgspec.msgpack.encode)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=120) | _plausible)
def test_state_decoders_raise_only_protocol_errors(meta: bytes) -> None:
    for decode in (decode_state_request, decode_state_chunk):
        with contextlib.suppress(ProtocolError):
            decode(meta)
