"""Receipts: what other peers saw a peer do, signed by them (DESIGN D5, D10 (e)).

A volunteer's contribution report is its own claim. What the ledger credits must be backed by what
*others* observed, so every averaging round leaves two kinds of evidence:

* **Part receipts** (aggregator -> sender). When aggregator ``A`` finalizes its slice of round
  ``(group_id, round)`` for global step ``step``, it signs one :class:`PartReceipt` per sender ``S`` whose
  parts it averaged in: the weight it actually used for ``S`` (after its own bounds, never more than ``S``
  claimed) and the bytes it accepted from ``S``. ``A`` hands the signed receipt to ``S`` with the averaged
  slice ``S`` pulls. ``S`` keeps it and forwards it, unchanged, inside its next
  :class:`~protocols.ledger.ContributionReport` (``receipts``). Anyone can check it: the signer's public
  key is inside ``aggregator``.
* **Pull records** (member -> aggregator). A member lists, in its own signed report (``pulled``), the
  averaged bytes it pulled from each aggregator per step (:class:`PulledSlice`). Aggregation work of ``A``
  is credited from the pull records that *other* peers signed about ``A``, never from ``A``'s own
  ``bytes_aggregated`` claim alone.

Both are bounded before they are believed: a receipt's weight is what the aggregator used, and honest
aggregators bound a member's weight by the group's statistics (see :mod:`shared.averaging`); the ledger
credits each ``(sender, step)`` at most once, only from receipts signed by a peer of *another* user, and
never beyond the run's recorded steps (see :mod:`backbone.ledger.accounting`).

**Swarm runs** (issue 17). Each pipeline stage of a swarm run is a collaboration of its own among that
stage's servers, with its own step counter. An aggregator of stage ``k`` signs receipts with
``stage = k``: the weight is then *stage-samples* (samples whose activations went through stage ``k``
on the sender; one sample through a 3-stage pipeline is 3 stage-samples, one per stage) and ``step`` is
stage ``k``'s step. A data-parallel receipt has ``stage = None``, which is omitted from its bytes
(``omit_defaults``), so data-parallel receipts are byte-identical to those of versions before the field and
their signatures still verify. The stage is signed, so a receipt cannot be moved to another stage (nor a
data-parallel receipt into a stage) without breaking its signature. A backbone older than the field
refuses a stage receipt as malformed (``forbid_unknown_fields``): it credits nothing, as before.

**Trainers' receipts** (issue 17 item 6). A swarm trainer holds no parameters and averages with nobody;
the evidence of its work is what the stage servers it used saw. When a server of stage ``k`` completes a
*backward* for trainer ``T`` that asked for a receipt (:class:`protocols.swarm.StageRequest` ``receipt``),
it answers with a :class:`PartReceipt` with ``carried = True``: ``aggregator`` is the server (the signer),
``sender`` the trainer, ``stage`` and ``step`` the stage step the micro-batch's samples were counted toward,
``weight`` the samples and ``nbytes`` the request bytes it received from ``T`` for that stage step (its
backwards' and forwards' payloads: the evidence of the trainer's sending, :mod:`backbone.ledger
.accounting`, "Swarm bytes"), *cumulative* over ``T``'s requests at that server (``group_id`` empty,
``round`` 0). So a trainer keeps only the latest receipt per ``(server, stage, step)``
(:class:`volunteer.receipts.ReceiptBook`) and the ledger keeps the largest. ``carried`` is signed, so a
trainer's receipt is never counted as a stage server's part (nor the reverse); it is omitted when False, so
every other receipt's bytes are unchanged, and a backbone older than the field refuses a carried receipt as
malformed: it credits nothing, as before.

Sizes: a signed receipt is at most :data:`MAX_RECEIPT_BYTES` + 64 bytes; a report carries at most
:data:`MAX_RECEIPTS_PER_REPORT` receipts and :data:`MAX_PULLED_PER_REPORT` pull records, so a report fits
in :data:`protocols.ledger.MAX_REPORT_BYTES`. A member keeps at most :data:`RECEIPTS_PER_STEP` receipts per
step (from distinct aggregators other than itself, when it has them).

Example (aggregator side; ``identity`` is its :class:`shared.auth.keys.Identity`)::

    signed = sign_receipt(PartReceipt(...), identity.sign)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated

import msgspec

from .errors import ProtocolError
from .types import Bytes64, PeerIdStr, RunIdStr

__all__ = [
    "MAX_PULLED_PER_REPORT",
    "MAX_RECEIPTS_PER_REPORT",
    "MAX_RECEIPT_BYTES",
    "RECEIPTS_PER_STEP",
    "PartReceipt",
    "PulledSlice",
    "SignedReceipt",
    "decode_receipt",
    "encode_receipt",
    "receipt_payload",
    "sign_receipt",
]

MAX_RECEIPT_BYTES = 512
MAX_RECEIPTS_PER_REPORT = 32
MAX_PULLED_PER_REPORT = 32
RECEIPTS_PER_STEP = 2
_MAX_COUNT = 2**53
_MAX_TIME = 1e12
_RECEIPT_DOMAIN = b"dedloc-part-receipt-v1"
#: stages of a swarm run: protocols.training.MAX_STAGES (not imported: protocols.training imports this
#: module through protocols.averaging; tests/protocols/test_receipts_stage.py checks they agree)
MAX_STAGES = 64

_Count = Annotated[int, msgspec.Meta(ge=0, le=_MAX_COUNT)]
_Weight = Annotated[float, msgspec.Meta(ge=0, le=float(_MAX_COUNT))]
_UnixTime = Annotated[float, msgspec.Meta(ge=0, le=_MAX_TIME)]
_GroupId = Annotated[bytes, msgspec.Meta(max_length=32)]
_Stage = Annotated[int, msgspec.Meta(ge=0, lt=MAX_STAGES)]


class PartReceipt(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Aggregator ``aggregator`` averaged ``sender``'s parts for ``step`` with weight ``weight`` (of
    pipeline stage ``stage`` in a swarm run; None: a data-parallel run's global step); with ``carried``,
    stage server ``aggregator`` completed backwards of ``weight`` samples for trainer ``sender``."""

    run_id: RunIdStr
    aggregator: PeerIdStr  # the signer
    sender: PeerIdStr
    step: _Count  # the global step this round averaged for
    group_id: _GroupId
    round: _Count
    weight: _Weight  # the weight the aggregator used (samples), after its bounds
    nbytes: _Count  # encoded bytes of the sender's parts it accepted
    issued_at: _UnixTime
    #: the pipeline stage whose collaboration took ``step`` (swarm runs; module docstring)
    stage: _Stage | None = None
    #: a stage server's receipt for a trainer that carried ``weight`` samples through it (module
    #: docstring, "Trainers' receipts"; cumulative over the stage step)
    carried: bool = False

    def __post_init__(self) -> None:
        if self.carried and self.stage is None:
            raise ValueError("a trainer's receipt (carried) names its stage")
        if self.stage is not None and not 0 <= self.stage < MAX_STAGES:
            raise ValueError(f"stage {self.stage!r} is not within [0, {MAX_STAGES})")
        if not (math.isfinite(self.weight) and 0 <= self.weight <= _MAX_COUNT):
            raise ValueError(f"weight {self.weight!r} is not within [0, 2**53]")
        if not (math.isfinite(self.issued_at) and 0 <= self.issued_at <= _MAX_TIME):
            raise ValueError(f"issued_at {self.issued_at!r} is not a unix time")
        for name in ("step", "round", "nbytes"):
            if not 0 <= getattr(self, name) <= _MAX_COUNT:
                raise ValueError(f"{name} {getattr(self, name)!r} is not within [0, 2**53]")


class SignedReceipt(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """The msgpack bytes of a :class:`PartReceipt` and the aggregator's signature over
    :func:`receipt_payload` of those exact bytes."""

    receipt: Annotated[bytes, msgspec.Meta(max_length=MAX_RECEIPT_BYTES)]
    signature: Bytes64


class PulledSlice(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """In a member's report: it pulled ``nbytes`` averaged bytes from ``aggregator`` for ``step``."""

    aggregator: PeerIdStr
    step: _Count
    nbytes: _Count


def receipt_payload(receipt_bytes: bytes) -> bytes:
    """The bytes an aggregator signs: a domain tag, then the receipt's msgpack bytes."""
    return _RECEIPT_DOMAIN + receipt_bytes


def encode_receipt(receipt: PartReceipt) -> bytes:
    data = msgspec.msgpack.encode(receipt)
    if len(data) > MAX_RECEIPT_BYTES:  # cannot happen with valid fields; checked so it never ships
        raise ValueError(f"receipt of {len(data)} bytes exceeds {MAX_RECEIPT_BYTES}")
    return data


def sign_receipt(receipt: PartReceipt, sign: Callable[[bytes], bytes]) -> SignedReceipt:
    """Encode ``receipt`` and sign :func:`receipt_payload` of its bytes with ``sign`` (the aggregator's
    identity key, e.g. ``Identity.sign``)."""
    body = encode_receipt(receipt)
    return SignedReceipt(receipt=body, signature=sign(receipt_payload(body)))


_DECODER = msgspec.msgpack.Decoder(PartReceipt)


def decode_receipt(data: bytes | memoryview) -> PartReceipt:
    """Decode the msgpack bytes of a :class:`PartReceipt` (the signature is the caller's to check).

    Raises:
        ProtocolError: over :data:`MAX_RECEIPT_BYTES`, malformed, or a value out of range.
    """
    if len(data) > MAX_RECEIPT_BYTES:
        raise ProtocolError(f"receipt of {len(data)} bytes exceeds {MAX_RECEIPT_BYTES}")
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"invalid receipt: {exc}") from exc
