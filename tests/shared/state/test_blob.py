"""State blobs: canonical safetensors encoding, validating decoding, header-only metadata reads."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import StateError
from shared.state.blob import (
    STATE_FORMAT,
    decode_state,
    encode_state,
    file_digest,
    read_metadata,
    state_digest,
    state_step,
)

META = {"step": "42", "run_id": "run@abc", "task": "tiny-mlm"}


def sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "model/embed.weight": rng.standard_normal((7, 5)).astype(np.float32),
        "model/head.bias": rng.standard_normal(5).astype(np.float32),
        "optim/state.0.exp_avg": rng.standard_normal((7, 5)).astype(np.float32),
        "optim/state.0.step": np.array(12, dtype=np.int64),
    }


def test_encode_state_round_trips_tensors_and_metadata() -> None:
    tensors = sample_tensors()
    blob = encode_state(tensors, META)

    decoded, metadata = decode_state(blob)

    assert metadata == {**META, "format": STATE_FORMAT}
    assert decoded.keys() == tensors.keys()
    for name, array in tensors.items():
        assert decoded[name].dtype == array.dtype
        np.testing.assert_array_equal(decoded[name], array)
    assert state_step(metadata) == 42


def test_encode_state_is_canonical_whatever_the_order_of_tensors_and_metadata() -> None:
    tensors = sample_tensors()
    meta = {**META, **{f"extra{i}": str(i) for i in range(12)}}
    blobs = {encode_state(tensors, meta) for _ in range(10)}
    blobs.add(encode_state(dict(reversed(tensors.items())), dict(reversed(meta.items()))))
    assert len(blobs) == 1
    (blob,) = blobs
    # still a plain safetensors file for the reference loader
    loaded = safetensors.numpy.load(blob)
    np.testing.assert_array_equal(loaded["model/head.bias"], tensors["model/head.bias"])


def test_encode_state_differs_when_one_value_differs() -> None:
    tensors = sample_tensors()
    changed = dict(tensors, **{"model/head.bias": tensors["model/head.bias"] + 1e-6})
    assert state_digest(encode_state(tensors, META)) != state_digest(encode_state(changed, META))


def test_encode_state_handles_big_endian_and_non_contiguous_arrays() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensors = {"model/t": base.T, "model/be": base.astype(">f4")}
    decoded, _ = decode_state(encode_state(tensors, META))
    np.testing.assert_array_equal(decoded["model/t"], base.T)
    np.testing.assert_array_equal(decoded["model/be"], base)


@pytest.mark.parametrize(
    ("tensors", "meta", "message"),
    [
        ({"model/x": np.zeros(2, dtype=np.complex64)}, META, "dtype"),
        ({"": np.zeros(2, dtype=np.float32)}, META, "name"),
        ({"__metadata__": np.zeros(2, dtype=np.float32)}, META, "name"),
        ({"model/x": [1.0, 2.0]}, META, "numpy"),
        ({"model/x": np.zeros(2, dtype=np.float32)}, {"step": "1", "task": "t"}, "run_id"),
        ({"model/x": np.zeros(2, dtype=np.float32)}, {**META, "step": "-1"}, "step"),
        ({"model/x": np.zeros(2, dtype=np.float32)}, {**META, "format": "other"}, "format"),
    ],
)
def test_encode_state_refuses_unusable_input(
    tensors: dict[str, object], meta: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        encode_state(tensors, meta)  # type: ignore[arg-type]


def test_read_metadata_parses_only_the_header(tmp_path: Path) -> None:
    blob = encode_state(sample_tensors(), META)
    (length,) = struct.unpack_from("<Q", blob)
    header_only = blob[: 8 + length]  # the tensors are cut off: reading the header must not need them
    path = tmp_path / "state.safetensors"
    path.write_bytes(header_only)

    assert read_metadata(header_only) == {**META, "format": STATE_FORMAT}
    assert read_metadata(path) == {**META, "format": STATE_FORMAT}
    assert read_metadata(memoryview(blob)) == read_metadata(path)
    with pytest.raises(StateError):
        decode_state(header_only)


def test_file_digest_equals_state_digest(tmp_path: Path) -> None:
    blob = encode_state(sample_tensors(), META)
    path = tmp_path / "s"
    path.write_bytes(blob)
    assert file_digest(path) == state_digest(blob)
    assert len(state_digest(blob)) == 32


def _blob_with_header(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\x01\x02",
        struct.pack("<Q", 2**40) + b"{}",
        struct.pack("<Q", 100) + b"{}",
        _blob_with_header([1, 2]),
        _blob_with_header({"__metadata__": {"format": STATE_FORMAT, "step": 1}}),
        _blob_with_header({"__metadata__": {"format": "other", "step": "1", "run_id": "r", "task": "t"}}),
        _blob_with_header({"__metadata__": {"format": STATE_FORMAT, "step": "1", "run_id": "r"}}),
        _blob_with_header(
            {
                "__metadata__": {"format": STATE_FORMAT, "step": "1", "run_id": "r", "task": "t"},
                "model/x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            },
            b"\0" * 8,  # the tensor claims 16 bytes, 8 are there
        ),
        _blob_with_header(
            {
                "__metadata__": {"format": STATE_FORMAT, "step": "1", "run_id": "r", "task": "t"},
                "model/x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},  # a hole before it
            },
            b"\0" * 16,
        ),
        b"\xff" * 8 + b"{}",
    ],
)
def test_decode_state_refuses_garbage_with_a_state_error(blob: bytes) -> None:
    with pytest.raises(StateError):
        decode_state(blob)


def test_decode_state_refuses_a_truncated_blob() -> None:
    blob = encode_state(sample_tensors(), META)
    for cut in (1, 7, 9, len(blob) // 2, len(blob) - 1):
        with pytest.raises(StateError):
            decode_state(blob[:cut])


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=300) | st.builds(lambda b: encode_state(sample_tensors(), META)[: len(b)], st.binary())
)
def test_decode_state_raises_only_state_error_on_any_bytes(blob: bytes) -> None:
    with contextlib.suppress(StateError):
        decode_state(blob)


@settings(max_examples=100, deadline=None)
@given(
    position=st.integers(min_value=0, max_value=10_000),
    value=st.integers(min_value=0, max_value=255),
)
def test_decode_state_raises_only_state_error_on_a_flipped_byte(position: int, value: int) -> None:
    blob = bytearray(encode_state(sample_tensors(), META))
    blob[position % len(blob)] = value
    try:
        tensors, metadata = decode_state(bytes(blob))
    except StateError:
        return
    assert metadata["format"] == STATE_FORMAT
    assert all(isinstance(t, np.ndarray) for t in tensors.values())
