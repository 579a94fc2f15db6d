"""Wire headers of the butterfly all-reduce's bulk transfers (DESIGN §2; seed 000 §3.2).

Each gradient part travels as one bulk transfer (:mod:`protocols.bulk`) whose ``meta`` is a msgpack
:class:`PartHeader` (sender -> aggregator) or :class:`AveragedHeader` (aggregator -> every peer), and whose
``nbytes`` raw bytes are the part encoded with ``codec``::

    sender     -> aggregator j   BulkHeader{topic, nbytes, meta=PartHeader}      + encoded part
    aggregator -> peer k         BulkHeader{topic, nbytes, meta=AveragedHeader}  + encoded average

``offset`` and ``numel`` locate the part inside aggregator ``j``'s slice (element offsets, not bytes).
``nbytes`` must equal :func:`encoded_nbytes` of ``codec`` and ``numel``, so a receiver knows before reading
a single payload byte whether the transfer is consistent. Encoded layouts (little-endian throughout):

    none            numel x float32
    fp16            numel x float16
    int8-blockwise  ceil(numel / 4096) x float32 scales, then numel x int8 values

``weight`` is the sender's sample count for the round: the aggregator computes ``Σ w_i x_i / Σ w_i``.
Auxiliary peers (no accelerator) have weight 0 and in practice send nothing, they only receive.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from .errors import ProtocolError
from .receipts import SignedReceipt

__all__ = [
    "INT8_BLOCK",
    "MAX_PART_BYTES",
    "MAX_DEADLINE",
    "MAX_NORM",
    "MAX_PART_NUMEL",
    "MAX_WEIGHT",
    "AveragedHeader",
    "CodecName",
    "PartHeader",
    "AssemblyMember",
    "GroupAssembly",
    "JoinTicket",
    "PullRequest",
    "decode_averaged_header",
    "decode_pull_request",
    "decode_part_header",
    "encode_header",
    "encoded_nbytes",
]

CodecName = Literal["none", "fp16", "int8-blockwise"]
CODEC_NAMES: tuple[CodecName, ...] = ("none", "fp16", "int8-blockwise")
#: Elements per scale of ``int8-blockwise`` (fixed by the codec name: another block size is another format).
INT8_BLOCK = 4096
#: Hard ceiling on one part's encoded bytes; senders split slices far below it (4 MiB by default).
MAX_PART_BYTES = 64 * 1024 * 1024
MAX_PART_NUMEL = MAX_PART_BYTES  # no codec takes less than one byte per element; nbytes is the real cap
#: Sample counts are exact integers in float64 up to 2**53; larger weights are refused.
MAX_WEIGHT = float(2**53)
#: Largest gradient norm a ticket may claim: a finite float64, far beyond any trainable model's gradient.
MAX_NORM = 1e30
#: Largest round deadline a plan may set (seconds); followers bound it much tighter (``groups``).
MAX_DEADLINE = 3600.0
_MAX_ROUND = 2**63 - 1
_MAX_PART_INDEX = 2**31 - 1
_MAX_OFFSET = 2**48  # elements; far beyond any model

_GroupId = Annotated[bytes, msgspec.Meta(max_length=32)]
_Round = Annotated[int, msgspec.Meta(ge=0, le=_MAX_ROUND)]
_PartIndex = Annotated[int, msgspec.Meta(ge=0, le=_MAX_PART_INDEX)]
_Offset = Annotated[int, msgspec.Meta(ge=0, le=_MAX_OFFSET)]
_Numel = Annotated[int, msgspec.Meta(ge=0, le=MAX_PART_NUMEL)]
_Nbytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_PART_BYTES)]
_Weight = Annotated[float, msgspec.Meta(ge=0, le=MAX_WEIGHT)]
_Norm = Annotated[float, msgspec.Meta(ge=0, le=MAX_NORM)]


def encoded_nbytes(codec: CodecName, numel: int) -> int:
    """Bytes of ``numel`` elements encoded with ``codec`` (see the module docstring for the layouts)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if codec == "none":
        return 4 * numel
    if codec == "fp16":
        return 2 * numel
    if codec == "int8-blockwise":
        return 4 * -(-numel // INT8_BLOCK) + numel
    raise ValueError(f"unknown codec {codec!r}")


def _check_common(header: PartHeader | AveragedHeader) -> None:
    """Checks ``__post_init__`` repeats for structs built in code, where msgspec ``Meta`` is not applied."""
    if len(header.group_id) > 32:
        raise ValueError(f"group id of {len(header.group_id)} bytes exceeds 32")
    for name, value, high in (
        ("round", header.round, _MAX_ROUND),
        ("part_index", header.part_index, _MAX_PART_INDEX),
        ("offset", header.offset, _MAX_OFFSET),
        ("numel", header.numel, MAX_PART_NUMEL),
        ("nbytes", header.nbytes, MAX_PART_BYTES),
    ):
        if not 0 <= value <= high:
            raise ValueError(f"{name} {value} is outside [0, {high}]")
    if header.dtype != "float32":
        raise ValueError(f"dtype {header.dtype!r} is not float32")
    if header.codec not in CODEC_NAMES:
        raise ValueError(f"unknown codec {header.codec!r}")
    expected = encoded_nbytes(header.codec, header.numel)
    if header.nbytes != expected:
        raise ValueError(
            f"{header.numel} elements in {header.codec} take {expected} bytes, not {header.nbytes}"
        )


def _check_weight(name: str, weight: float) -> None:
    if not (math.isfinite(weight) and 0.0 <= weight <= MAX_WEIGHT):
        raise ValueError(f"{name} {weight!r} is not a finite number in [0, 2**53]")


class PartHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Sender -> aggregator: one part of the sender's gradient, restricted to the aggregator's slice."""

    group_id: _GroupId
    round: _Round
    part_index: _PartIndex
    offset: _Offset
    numel: _Numel
    dtype: Literal["float32"] = "float32"
    codec: CodecName
    weight: _Weight
    nbytes: _Nbytes

    def __post_init__(self) -> None:
        _check_common(self)
        _check_weight("weight", self.weight)


class AveragedHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Aggregator -> peer: one part of the averaged slice.

    ``total_weight`` (``Σ w_i`` over the senders that were averaged) and ``contributors`` (their number)
    let every receiver report what its round actually averaged. ``receipt`` is the aggregator's signed
    :class:`~protocols.receipts.PartReceipt` for the *puller*'s parts, sent with the reply to the last part
    of the slice once the whole slice is averaged (``None`` otherwise, or when the puller sent nothing).
    """

    group_id: _GroupId
    round: _Round
    part_index: _PartIndex
    offset: _Offset
    numel: _Numel
    dtype: Literal["float32"] = "float32"
    codec: CodecName
    nbytes: _Nbytes
    total_weight: Annotated[float, msgspec.Meta(ge=0)]
    contributors: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    receipt: SignedReceipt | None = None

    def __post_init__(self) -> None:
        _check_common(self)
        if not (math.isfinite(self.total_weight) and self.total_weight >= 0.0):
            raise ValueError(f"total_weight {self.total_weight!r} is not a finite number >= 0")
        if not 0 <= self.contributors <= 1 << 20:
            raise ValueError(f"contributors {self.contributors} is outside [0, 2**20]")


_PART_DECODER = msgspec.msgpack.Decoder(PartHeader)
_AVERAGED_DECODER = msgspec.msgpack.Decoder(AveragedHeader)


class PullRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Peer -> aggregator: "send me part ``part_index`` of your averaged slice" (answered once averaged)."""

    group_id: _GroupId
    round: _Round
    part_index: _PartIndex


def encode_header(header: PartHeader | AveragedHeader | PullRequest) -> bytes:
    """The msgpack bytes that travel as a bulk transfer's ``meta``."""
    return msgspec.msgpack.encode(header)


def decode_part_header(meta: bytes | memoryview) -> PartHeader:
    """Decode and validate a :class:`PartHeader`.

    Raises:
        ProtocolError: malformed msgpack or a field out of range (including an inconsistent ``nbytes``).
    """
    try:
        return _PART_DECODER.decode(meta)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:  # ValidationError included
        raise ProtocolError(f"invalid part header: {exc}") from exc


def decode_pull_request(meta: bytes | memoryview) -> PullRequest:
    """Decode and validate a :class:`PullRequest` (raises ProtocolError)."""
    try:
        return msgspec.msgpack.decode(meta, type=PullRequest)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"invalid pull request: {exc}") from exc


def decode_averaged_header(meta: bytes | memoryview) -> AveragedHeader:
    """Decode and validate an :class:`AveragedHeader`.

    Raises:
        ProtocolError: malformed msgpack or a field out of range (including an inconsistent ``nbytes``).
    """
    try:
        return _AVERAGED_DECODER.decode(meta)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"invalid averaged header: {exc}") from exc


class JoinTicket(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A peer's entry under a round's matchmaking key (DHT subkey = its peer id): where to reach it, its
    weight this round and its measured capabilities, which the group's leader feeds to the LP.

    ``norm`` is the L2 norm of the whole vector the peer will average (float64 over its float32 values).
    No part it sends may be larger (aggregators refuse and ban one that is), so the claims bound what an
    honest aggregator can return, and receivers check averaged slices against them
    (:func:`shared.averaging.groups.average_norm_bound`).
    """

    addr: Annotated[str, msgspec.Meta(max_length=256)] | None
    weight: _Weight
    norm: _Norm
    samples_per_second: Annotated[float, msgspec.Meta(ge=0, le=1e12)]
    upload_bps: Annotated[float, msgspec.Meta(gt=0, le=1e13)]
    download_bps: Annotated[float, msgspec.Meta(gt=0, le=1e13)]
    client_mode: bool = False


class AssemblyMember(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A member as the plan names it: ``addr`` and ``norm`` copied from its ticket, ``weight`` its ticket's
    claim after the group's bound (:func:`shared.averaging.groups.bound_weights`)."""

    peer_id: Annotated[str, msgspec.Meta(max_length=64)]
    addr: Annotated[str, msgspec.Meta(max_length=256)] | None
    weight: _Weight
    norm: _Norm


class GroupAssembly(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The leader's plan for one group and round, stored signed in the DHT next to the tickets."""

    group_id: _GroupId
    round: _Round
    members: Annotated[list[AssemblyMember], msgspec.Meta(min_length=1, max_length=256)]
    slice_sizes: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=256)]
    codec: CodecName
    part_numel: Annotated[int, msgspec.Meta(ge=1, le=MAX_PART_NUMEL)]
    deadline: Annotated[float, msgspec.Meta(gt=0, le=MAX_DEADLINE)]
    predicted_seconds: Annotated[float, msgspec.Meta(ge=0)]
