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
Auxiliary peers (no accelerator) have weight 0 and send nothing. A member whose ticket says ``aux``
(an auxiliary aggregator: a backbone, ``volunteer join --aux``) also *receives* nothing but its own slice's
average: it pulls no other aggregator's parts (a weight-0 member without ``aux``, e.g. one whose fp16
gradient overflowed, still pulls every average: it steps with the group).

**Signed averaged parts.** An averaged part may reach a member through another member that relays it
(:mod:`shared.averaging.allreduce`, "Departures"), so it must prove its origin by itself. Every
:class:`AveragedHeader` carries ``digest`` (SHA-256 of the encoded payload, :func:`part_digest`) and
``signature``: the aggregator's signature over :func:`averaged_payload` of an :class:`AveragedStatement`,
which binds what a :class:`~protocols.receipts.PartReceipt` binds of a round (run id, the global step,
group id, round; the signer is the aggregator named in the statement) plus the part (index, offset,
``numel``, codec, ``nbytes``), what was averaged into it (``total_weight``, ``contributors``) and the
digest. The statement is not sent: a receiver rebuilds it from the header's fields and the run, step and
aggregator *it expects*, so a header of another run, step, round, group, part or aggregator fails the
signature. ``receipt`` is not signed by it (a receipt is signed on its own, for one sender)::

    relay: member -> member  BulkHeader{topic, nbytes, meta=RelayRequest}    (reply: AveragedHeader + part)
"""

from __future__ import annotations

import hashlib
import math
from typing import Annotated, Literal

import msgspec

from .errors import ProtocolError
from .receipts import SignedReceipt
from .types import Bytes32, Bytes64, PeerIdStr, RunIdStr

__all__ = [
    "INT8_BLOCK",
    "MAX_PART_BYTES",
    "MAX_DEADLINE",
    "MAX_NORM",
    "MAX_PART_NUMEL",
    "MAX_WEIGHT",
    "AveragedHeader",
    "AveragedStatement",
    "RelayRequest",
    "averaged_payload",
    "decode_relay_request",
    "part_digest",
    "statement_of",
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
_AVERAGED_DOMAIN = b"dedloc-averaged-part-v1"
DIGEST_BYTES = 32
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
    digest: Bytes32  # part_digest of the encoded payload
    signature: Bytes64  # the aggregator's, over averaged_payload(statement_of(...)) (module docstring)
    receipt: SignedReceipt | None = None

    def __post_init__(self) -> None:
        _check_common(self)
        if not (math.isfinite(self.total_weight) and self.total_weight >= 0.0):
            raise ValueError(f"total_weight {self.total_weight!r} is not a finite number >= 0")
        if not 0 <= self.contributors <= 1 << 20:
            raise ValueError(f"contributors {self.contributors} is outside [0, 2**20]")
        if len(self.digest) != DIGEST_BYTES or len(self.signature) != 64:
            raise ValueError("digest must be 32 bytes and signature 64 bytes")


class AveragedStatement(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """What an aggregator signs about one averaged part (module docstring, "Signed averaged parts")."""

    run_id: RunIdStr
    aggregator: PeerIdStr  # the signer
    step: int
    group_id: bytes
    round: int
    part_index: int
    offset: int
    numel: int
    codec: str
    nbytes: int
    total_weight: float
    contributors: int
    digest: bytes


def part_digest(payload: bytes | bytearray | memoryview) -> bytes:
    """SHA-256 of an encoded part (hashlib releases the GIL on large buffers). SHA-256, not BLAKE2b: with
    the SHA extensions of current x86 and ARM CPUs it hashes about twice as fast (~1.8 GB/s per core)."""
    return hashlib.sha256(payload).digest()


def statement_of(
    header: AveragedHeader | PartHeader, *, run_id: str, aggregator: str, step: int, **fields: object
) -> AveragedStatement:
    """The statement the aggregator signs for ``header`` (``fields`` override or supply ``total_weight``,
    ``contributors`` and ``digest`` when ``header`` is not an :class:`AveragedHeader` yet)."""
    values: dict[str, object] = {
        "run_id": run_id,
        "aggregator": aggregator,
        "step": step,
        "group_id": header.group_id,
        "round": header.round,
        "part_index": header.part_index,
        "offset": header.offset,
        "numel": header.numel,
        "codec": header.codec,
        "nbytes": header.nbytes,
    }
    if isinstance(header, AveragedHeader):
        values.update(
            total_weight=header.total_weight, contributors=header.contributors, digest=header.digest
        )
    values.update(fields)
    return AveragedStatement(**values)  # type: ignore[arg-type]


def averaged_payload(statement: AveragedStatement) -> bytes:
    """The bytes an aggregator signs: a domain tag (not the receipts' one), then the statement's msgpack."""
    return _AVERAGED_DOMAIN + msgspec.msgpack.encode(statement)


_PART_DECODER = msgspec.msgpack.Decoder(PartHeader)
_AVERAGED_DECODER = msgspec.msgpack.Decoder(AveragedHeader)


class PullRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Peer -> aggregator: "send me part ``part_index`` of your averaged slice" (answered once averaged)."""

    group_id: _GroupId
    round: _Round
    part_index: _PartIndex


class RelayRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Member -> member: "send me part ``part_index`` of aggregator ``aggregator``'s averaged slice, as you
    received it" (answered at once: the part with the aggregator's signed header, or "not held")."""

    group_id: _GroupId
    round: _Round
    aggregator: Annotated[int, msgspec.Meta(ge=0, le=255)]  # index in the plan's members
    part_index: _PartIndex


def decode_relay_request(meta: bytes | memoryview) -> RelayRequest:
    """Decode and validate a :class:`RelayRequest` (raises ProtocolError)."""
    try:
        return msgspec.msgpack.decode(meta, type=RelayRequest)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"invalid relay request: {exc}") from exc


def encode_header(header: PartHeader | AveragedHeader | PullRequest | RelayRequest) -> bytes:
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

    ``overflow``: the peer's fp16 gradient overflowed at the collaboration's loss scale; it sends nothing
    (weight and norm 0) and every member of the round skips the step together if the claim is believed
    (the rule and its bound on liars: :mod:`volunteer.precision`).
    """

    addr: Annotated[str, msgspec.Meta(max_length=256)] | None
    weight: _Weight
    norm: _Norm
    samples_per_second: Annotated[float, msgspec.Meta(ge=0, le=1e12)]
    upload_bps: Annotated[float, msgspec.Meta(gt=0, le=1e13)]
    download_bps: Annotated[float, msgspec.Meta(gt=0, le=1e13)]
    client_mode: bool = False
    overflow: bool = False
    #: an auxiliary aggregator (weight 0, computes nothing): it takes a slice and needs no average back
    aux: bool = False
    #: elements of the vector the peer averages (its model's parameters); 0: not stated (an aux peer
    #: adopts the length its group's computing members agree on, shared.averaging.auxiliary)
    numel: Annotated[int, msgspec.Meta(ge=0, le=_MAX_OFFSET)] = 0

    def __post_init__(self) -> None:
        if self.overflow and (self.weight or self.norm):
            raise ValueError("a ticket claiming overflow sends nothing: weight and norm must be 0")
        if self.aux and (self.weight or self.norm or self.overflow or self.samples_per_second):
            raise ValueError("an auxiliary ticket computes nothing: weight, norm and samples/s must be 0")
        if not 0 <= self.numel <= _MAX_OFFSET:
            raise ValueError(f"numel {self.numel} is outside [0, 2**48]")


class AssemblyMember(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A member as the plan names it: ``addr``, ``norm``, ``overflow`` and ``aux`` copied from its ticket,
    ``weight`` its ticket's claim after the group's bound (:func:`shared.averaging.groups.bound_weights`)."""

    peer_id: Annotated[str, msgspec.Meta(max_length=64)]
    addr: Annotated[str, msgspec.Meta(max_length=256)] | None
    weight: _Weight
    norm: _Norm
    overflow: bool = False
    aux: bool = False  # its ticket's: an auxiliary aggregator, which pulls no other slice's average


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
    #: per member, in order: the first 16 bytes of SHA-256 of the signature of the ticket record the leader
    #: read (matchmaking, "Stale tickets"); ``group_id`` is derived from them, so no two plans share it
    tickets: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=16)]], msgspec.Meta(max_length=256)] = []
