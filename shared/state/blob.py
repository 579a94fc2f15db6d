"""Training-state blobs: named tensors plus string metadata as one safetensors file (DESIGN D2).

A state blob is what a peer hands another peer that falls behind, and what a backbone stores as a
checkpoint. It is a safetensors file::

    u64 little-endian N | N bytes of JSON header (space-padded) | the tensors' raw bytes

The header maps each tensor name to its dtype, shape and byte range; its ``__metadata__`` object is a
``str -> str`` map that holds at least ``format`` (:data:`STATE_FORMAT`), ``step`` (decimal), ``run_id``
and ``task``. Tensor names are ``model/<parameter name>`` for model parameters and ``optim/<...>`` for
optimizer tensors. Nothing is ever pickled: decoding a blob from a stranger only ever yields arrays.

**Equal input, equal bytes.** Peers whose parameters agree bit for bit must announce the same SHA-256
(:func:`state_digest`), so the encoding is canonical: ``safetensors`` lays out the tensors
deterministically, but writes the metadata map in hash order (it differs between calls), so
:func:`encode_state` rewrites the header as compact JSON with sorted keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy

from ..errors import StateError

__all__ = [
    "MAX_HEADER_BYTES",
    "REQUIRED_METADATA",
    "STATE_DTYPES",
    "STATE_FORMAT",
    "decode_state",
    "encode_state",
    "file_digest",
    "read_metadata",
    "state_digest",
    "state_step",
]

STATE_FORMAT = "dedloc-state-v1"
REQUIRED_METADATA = ("format", "step", "run_id", "task")
#: Element types a state may hold (parameters, optimizer moments, step counters, masks).
STATE_DTYPES = frozenset(
    np.dtype(t) for t in (np.float32, np.float16, np.float64, np.int64, np.int32, np.uint8, np.bool_)
)
#: The safetensors library's own limit on the JSON header.
MAX_HEADER_BYTES = 100_000_000
_MAX_NAME = 1024
_LENGTH = struct.Struct("<Q")
_HASH_BLOCK = 8 * 1024 * 1024

BlobLike = bytes | bytearray | memoryview


def encode_state(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """Encode ``tensors`` and ``metadata`` as a canonical safetensors blob.

    ``metadata`` gets ``format`` = :data:`STATE_FORMAT` if it has none; it must hold ``step`` (a
    non-negative decimal integer), ``run_id`` and ``task``.

    Raises:
        ValueError: a tensor name, dtype or metadata entry is unusable (the message says which).
    """
    meta = {"format": STATE_FORMAT, **metadata}
    _check_metadata(meta, ValueError)
    arrays: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME or name == "__metadata__":
            raise ValueError(f"unusable tensor name {name!r}")
        if not isinstance(array, np.ndarray):
            raise ValueError(f"tensor {name} is a {type(array).__name__}, not a numpy array")
        if array.dtype.newbyteorder("=") not in STATE_DTYPES:
            raise ValueError(f"tensor {name} has dtype {array.dtype}, not one of the state dtypes")
        arrays[name] = np.ascontiguousarray(array)
    raw = safetensors.numpy.save(arrays, metadata=meta)
    header = _parse_header(memoryview(raw))
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    canonical += b" " * (-len(canonical) % 8)  # tensors start 8-byte aligned, as safetensors writes them
    (length,) = _LENGTH.unpack_from(raw)
    return b"".join((_LENGTH.pack(len(canonical)), canonical, memoryview(raw)[_LENGTH.size + length :]))


def decode_state(blob: BlobLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Decode a state blob into its tensors and metadata.

    Raises:
        StateError: not a safetensors file, not of :data:`STATE_FORMAT`, missing metadata, or a tensor of
            a dtype states do not hold.
    """
    view = memoryview(blob)
    metadata = _metadata_of(_parse_header(view))
    _check_metadata(metadata, StateError)
    try:
        tensors = safetensors.numpy.load(bytes(view))
    except (safetensors.SafetensorError, ValueError, TypeError, OverflowError) as exc:
        raise StateError(f"not a valid safetensors blob: {exc}") from exc
    for name, array in tensors.items():
        if array.dtype.newbyteorder("=") not in STATE_DTYPES:
            raise StateError(f"tensor {name} has dtype {array.dtype}, not one of the state dtypes")
    return tensors, metadata


def read_metadata(source: BlobLike | str | os.PathLike[str]) -> dict[str, str]:
    """The ``__metadata__`` map of a safetensors blob or file, reading only its header.

    Raises:
        StateError: the header is truncated, oversized or not a JSON object of the safetensors layout.
        OSError: the file cannot be read.
    """
    if isinstance(source, bytes | bytearray | memoryview):
        return _metadata_of(_parse_header(memoryview(source)))
    with Path(source).open("rb") as file:
        prefix = file.read(_LENGTH.size)
        length = _header_length(prefix)
        header = file.read(length)
    if len(header) != length:
        raise StateError(f"{source}: header of {length} bytes is truncated to {len(header)}")
    return _metadata_of(_parse_json(header))


def state_step(metadata: Mapping[str, str]) -> int:
    """The ``step`` of a state's metadata.

    Raises:
        StateError: the metadata is not of :data:`STATE_FORMAT` or lacks a valid step.
    """
    _check_metadata(metadata, StateError)
    return int(metadata["step"])


def state_digest(blob: BlobLike) -> bytes:
    """SHA-256 of the exact blob bytes: what a :class:`~protocols.training.StateAnnouncement` carries."""
    return hashlib.sha256(blob).digest()


def file_digest(path: str | os.PathLike[str]) -> bytes:
    """SHA-256 of a file's bytes, read in blocks (blocking: call it in a worker thread)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as file:
        while block := file.read(_HASH_BLOCK):
            digest.update(block)
    return digest.digest()


def _header_length(prefix: bytes | memoryview) -> int:
    if len(prefix) < _LENGTH.size:
        raise StateError(f"not a safetensors blob: {len(prefix)} bytes, no header length")
    (length,) = _LENGTH.unpack_from(prefix)
    if not 2 <= length <= MAX_HEADER_BYTES:
        raise StateError(f"not a safetensors blob: header length {length} is out of range")
    return int(length)


def _parse_header(view: memoryview) -> dict[str, object]:
    length = _header_length(view[: _LENGTH.size])
    if len(view) < _LENGTH.size + length:
        raise StateError(f"not a safetensors blob: header of {length} bytes in {len(view)} bytes")
    return _parse_json(view[_LENGTH.size : _LENGTH.size + length])


def _parse_json(raw: bytes | memoryview) -> dict[str, object]:
    try:
        header = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StateError(f"not a safetensors blob: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise StateError("not a safetensors blob: header is not a JSON object")
    return header


def _metadata_of(header: Mapping[str, object]) -> dict[str, str]:
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise StateError("safetensors __metadata__ is not a map of strings to strings")
    return dict(metadata)


def _check_metadata(metadata: Mapping[str, str], error: type[Exception]) -> None:
    missing = [key for key in REQUIRED_METADATA if key not in metadata]
    if missing:
        raise error(f"state metadata lacks {', '.join(missing)}")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise error(f"state metadata must map strings to strings, got {key!r}: {value!r}")
    if metadata["format"] != STATE_FORMAT:
        raise error(f"state format {metadata['format'][:64]!r} is not {STATE_FORMAT!r}")
    step = metadata["step"]
    if not (step.isascii() and step.isdecimal() and len(step) <= 20):
        raise error(f"state step {step[:32]!r} is not a non-negative decimal integer")
