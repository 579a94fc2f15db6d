"""Trainers' receipts on the wire (issue 17 item 6): ``PartReceipt.carried`` is signed and omitted when
False (every other receipt keeps its bytes), a backbone older than it refuses a carried receipt as
malformed; ``StageRequest.receipt`` and ``StageAnswer.receipt`` are omitted at their defaults, so peers
older than them decode what does not use them; an answer's receipt is bounded."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocols.averaging import CodecName
from protocols.errors import ProtocolError
from protocols.receipts import MAX_RECEIPT_BYTES, PartReceipt, SignedReceipt, encode_receipt, sign_receipt
from protocols.swarm import (
    FieldSpec,
    StageAnswer,
    StageRequest,
    TensorSpec,
    decode_stage_answer,
    decode_stage_request,
)
from protocols.types import PeerIdStr, RunIdStr
from shared.auth.keys import Identity

SERVER = Identity(Ed25519PrivateKey.from_private_bytes(bytes([51]) * 32))
TRAINER = Identity(Ed25519PrivateKey.from_private_bytes(bytes([52]) * 32))


def carried(weight: float = 4.0, *, stage: int | None = 0, flag: bool = True) -> PartReceipt:
    return PartReceipt(
        run_id="run",
        aggregator=SERVER.peer_id,
        sender=TRAINER.peer_id,
        step=3,
        group_id=b"",
        round=0,
        weight=weight,
        nbytes=1000,
        issued_at=1.7e9,
        stage=stage,
        carried=flag,
    )


class OldPartReceipt(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True
):
    """PartReceipt before ``carried`` (schema 9's backbone)."""

    run_id: RunIdStr
    aggregator: PeerIdStr
    sender: PeerIdStr
    step: int
    group_id: bytes
    round: int
    weight: float
    nbytes: int
    issued_at: float
    stage: int | None = None


class OldStageRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    stage: int
    op: Literal["forward", "backward"]
    samples: int
    hidden: TensorSpec | None = None
    grad: TensorSpec | None = None
    fields: list[FieldSpec] = []
    answer_codec: CodecName = "none"


class OldStageAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    status: Literal["ok", "busy"]
    step: Annotated[int, msgspec.Meta(ge=0)] = 0
    retry_after: float = 0.0
    output: TensorSpec | None = None
    loss: float | None = None


def test_carried_is_omitted_when_false_and_signed_when_true() -> None:
    plain = encode_receipt(carried(flag=False))
    assert b"carried" not in plain
    assert msgspec.msgpack.decode(plain, type=OldPartReceipt).stage == 0  # an old backbone reads it
    body = encode_receipt(carried())
    assert b"carried" in body
    with pytest.raises(msgspec.ValidationError):  # an old backbone refuses it: credits nothing
        msgspec.msgpack.decode(body, type=OldPartReceipt)


def test_a_trainers_receipt_names_its_stage() -> None:
    with pytest.raises(ValueError, match="stage"):
        carried(stage=None)


def test_requests_without_receipt_decode_on_old_servers_and_ask_only_when_set() -> None:
    plain = StageRequest(stage=0, op="backward", samples=2)
    data = msgspec.msgpack.encode(plain)
    assert b"receipt" not in data
    assert msgspec.msgpack.decode(data, type=OldStageRequest).samples == 2
    asking = msgspec.msgpack.encode(StageRequest(stage=0, op="backward", samples=2, receipt=True))
    assert decode_stage_request(asking).receipt
    with pytest.raises(msgspec.ValidationError):  # an old server refuses a request that asks (docstring)
        msgspec.msgpack.decode(asking, type=OldStageRequest)


def test_answers_without_receipt_decode_on_old_trainers_and_round_trip_with_one() -> None:
    plain = msgspec.msgpack.encode(StageAnswer(status="ok", step=3, loss=1.5))
    assert msgspec.msgpack.decode(plain, type=OldStageAnswer).loss == 1.5
    signed = sign_receipt(carried(), SERVER.sign)
    answer = decode_stage_answer(msgspec.msgpack.encode(StageAnswer(status="ok", step=3, receipt=signed)))
    assert answer.receipt == signed


def test_an_answers_receipt_is_bounded() -> None:
    huge = SignedReceipt(receipt=b"x" * (MAX_RECEIPT_BYTES + 1), signature=b"s" * 64)
    data = msgspec.msgpack.encode(StageAnswer(status="ok", receipt=huge))
    with pytest.raises(ProtocolError):
        decode_stage_answer(data)
    short = msgspec.msgpack.encode({"status": "ok", "receipt": [b"x", b"short"]})
    with pytest.raises(ProtocolError):  # a signature of the wrong size
        decode_stage_answer(short)
