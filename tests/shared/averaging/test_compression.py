"""Gradient codecs: exact round trips and documented error bounds (shared.averaging.compression)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from protocols.averaging import encoded_nbytes
from protocols.errors import ProtocolError
from shared.averaging.compression import Float16, Int8Blockwise, NoCompression, codec_by_name

F32_MAX = float(np.finfo(np.float32).max)
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
vectors = arrays(np.float32, st.integers(0, 300), elements=finite32)
# Mixed magnitudes inside one block are what stresses a per-block scale.
scaled_vectors = st.builds(
    lambda v, e: (v * np.float32(2.0**e)).astype(np.float32),
    arrays(np.float32, st.integers(0, 300), elements=st.floats(-1, 1, width=32)),
    st.integers(-140, 127),
)
CODECS = [NoCompression(), Float16(), Int8Blockwise(), Int8Blockwise(block=7)]


def _err(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.abs(x.astype(np.float64) - y.astype(np.float64))


@settings(max_examples=200, deadline=None)
@given(vectors)
def test_no_compression_round_trip_is_exact(x: np.ndarray) -> None:
    codec = NoCompression()
    data = codec.encode(x)
    assert len(data) == codec.encoded_size(x.size)
    assert codec.decode(data, x.size).tobytes() == x.tobytes()


@settings(max_examples=300, deadline=None)
@given(st.one_of(vectors, scaled_vectors))
def test_float16_error_within_documented_bound(x: np.ndarray) -> None:
    codec = Float16()
    decoded = codec.decode(codec.encode(x), x.size)
    magnitude = np.abs(x.astype(np.float64))
    inside = magnitude <= 65504.0
    bound = np.maximum(2.0**-11 * magnitude, 2.0**-25)
    assert np.all(_err(x, decoded)[inside] <= bound[inside])
    assert np.all(decoded[~inside] == np.sign(x[~inside]) * np.float32(65504.0))


@settings(max_examples=500, deadline=None)
@given(st.one_of(vectors, scaled_vectors), st.sampled_from([1, 2, 7, 64, 4096]))
def test_int8_blockwise_error_at_most_absmax_over_254(x: np.ndarray, block: int) -> None:
    codec = Int8Blockwise(block=block)
    data = codec.encode(x)
    assert len(data) == codec.encoded_size(x.size)
    decoded = codec.decode(data, x.size)
    err = _err(x, decoded)
    for start in range(0, x.size, block):
        absmax = float(np.max(np.abs(x[start : start + block].astype(np.float64))))
        block_err = err[start : start + block]
        if absmax >= 2.0**-119:
            assert np.all(254.0 * block_err <= absmax)  # exact in float64 (see the codec's docstring)
        else:
            assert np.all(decoded[start : start + block] == 0.0)


def test_int8_blockwise_layout_is_steps_then_int8_values() -> None:
    x = np.array([1.0, -0.5, 0.0, 0.25, 3.0], dtype=np.float32)
    data = Int8Blockwise(block=3).encode(x)
    steps = np.frombuffer(data[:8], dtype="<f4")
    q = np.frombuffer(data[8:], dtype=np.int8)
    assert len(data) == 2 * 4 + 5
    assert steps[0] <= 1.0 / 127 and steps[1] <= 3.0 / 127
    assert q.tolist() == [127, -64, 0, 11, 127]  # 0.25 / (3/127) = 10.58 -> 11


def test_int8_blockwise_extremes_neither_overflow_nor_lose_the_bound() -> None:
    x = np.array([F32_MAX, -F32_MAX, 1.0, 0.0, -1e38], dtype=np.float32)
    codec = Int8Blockwise(block=5)
    decoded = codec.decode(codec.encode(x), x.size)
    assert np.all(np.isfinite(decoded))
    assert np.all(254.0 * _err(x, decoded) <= F32_MAX)


def test_int8_blockwise_tiny_blocks_decode_to_zeros() -> None:
    x = np.array([1e-37, -3e-38, 1e-45], dtype=np.float32)
    codec = Int8Blockwise(block=4)
    assert codec.decode(codec.encode(x), 3).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}")
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_codec_refuses_to_encode_non_finite_values(codec: NoCompression, bad: float) -> None:
    x = np.ones(10, dtype=np.float32)
    x[3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode(x)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}")
@pytest.mark.parametrize("x", [np.ones(3, dtype=np.float64), np.ones((2, 2), dtype=np.float32)])
def test_codec_refuses_non_flat_or_non_float32_input(codec: NoCompression, x: np.ndarray) -> None:
    with pytest.raises(ValueError, match="1-D float32"):
        codec.encode(x)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}")
@pytest.mark.parametrize("delta", [-1, 1])
def test_codec_decode_rejects_wrong_length(codec: NoCompression, delta: int) -> None:
    data = codec.encode(np.arange(10, dtype=np.float32))
    with pytest.raises(ProtocolError, match="bytes, expected"):
        codec.decode(data + b"\0" if delta > 0 else data[:-1], 10)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}")
def test_codec_decode_writes_into_out(codec: NoCompression) -> None:
    x = np.linspace(-3, 3, 20, dtype=np.float32)
    out = np.zeros(20, dtype=np.float32)
    result = codec.decode(codec.encode(x), 20, out=out)
    assert result is out
    assert np.array_equal(out, codec.decode(codec.encode(x), 20))
    with pytest.raises(ValueError, match="out must be"):
        codec.decode(codec.encode(x), 20, out=np.zeros(19, dtype=np.float32))
    with pytest.raises(ValueError, match="out must be"):
        codec.decode(codec.encode(x), 20, out=np.zeros(40, dtype=np.float32)[::2])
    with pytest.raises(ValueError, match="numel"):
        codec.decode(b"", -1)


def test_no_compression_decode_does_not_alias_a_mutable_buffer() -> None:
    x = np.arange(4, dtype=np.float32)
    buffer = bytearray(NoCompression().encode(x))
    decoded = NoCompression().decode(memoryview(buffer), 4)
    buffer[:] = b"\0" * len(buffer)
    assert decoded.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("step", [np.nan, np.inf, -1.0, F32_MAX])
def test_int8_blockwise_decode_rejects_bad_steps(step: float) -> None:
    data = bytearray(Int8Blockwise(block=2).encode(np.array([1, 2, 3], dtype=np.float32)))
    data[4:8] = np.array([step], dtype="<f4").tobytes()
    with pytest.raises(ProtocolError, match="scale"):
        Int8Blockwise(block=2).decode(bytes(data), 3)


def test_int8_blockwise_decode_rejects_minus_128() -> None:
    data = bytearray(Int8Blockwise(block=4).encode(np.array([1, 2, 3], dtype=np.float32)))
    data[-1] = 0x80
    with pytest.raises(ProtocolError, match="-128"):
        Int8Blockwise(block=4).decode(bytes(data), 3)


@pytest.mark.parametrize("name", ["none", "fp16", "int8-blockwise"])
@pytest.mark.parametrize("numel", [0, 1, 4095, 4096, 4097, 1 << 20])
def test_codec_by_name_sizes_match_the_wire_header(name: str, numel: int) -> None:
    codec = codec_by_name(name)
    assert codec.name == name
    assert codec.encoded_size(numel) == encoded_nbytes(name, numel)


def test_codec_by_name_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        codec_by_name("int4")


def test_int8_blockwise_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block"):
        Int8Blockwise(block=0)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}")
def test_codec_round_trips_an_empty_vector(codec: NoCompression) -> None:
    empty = np.empty(0, dtype=np.float32)
    assert codec.encode(empty) == b""
    assert codec.decode(b"", 0).size == 0
