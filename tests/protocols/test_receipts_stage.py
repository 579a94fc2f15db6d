"""A part receipt's ``stage`` (swarm runs, issue 17 item 6): omitted when None, so data-parallel receipts
keep their bytes and signatures; bounded; signed, so it cannot be moved between stages."""

from __future__ import annotations

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from backbone.ledger.accounting import ReceiptRejected, verify_receipt
from protocols import receipts, training
from protocols.errors import ProtocolError
from protocols.receipts import PartReceipt, SignedReceipt, decode_receipt, encode_receipt, sign_receipt
from shared.auth.keys import Identity

AGGREGATOR = Identity(Ed25519PrivateKey.from_private_bytes(bytes([21]) * 32))
SENDER = Identity(Ed25519PrivateKey.from_private_bytes(bytes([22]) * 32))
#: a receipt signed by the code before the field (commit 4cc1190), by AGGREGATOR about SENDER's step 7
OLD_RECEIPT = bytes.fromhex(
    "89a672756e5f6964ab6c65646765722d74657374aa61676772656761746f72d934313244334b6f6f57514171515832"
    "595165784d6d51617066677246563838505474716b7969526f314c6a705a6f56626b6a515952a673656e646572d934"
    "313244334b6f6f5746477a38766e794c4e6e4846396d526542776b367833736a717550396b39656571656e6b72714a"
    "5034324739a47374657007a867726f75705f6964c40167a5726f756e6403a6776569676874cb4048000000000000a6"
    "6e6279746573cd04d2a96973737565645f6174cb41d954fc40000000"
)
OLD_SIGNATURE = bytes.fromhex(
    "8a6a96a144e107cf5354025a184f51b45d440c9777507e02530410f0e250f4a8e2913a6711c0cdd71745bb53fea785cf"
    "15d7a0cf8cc2f27e0a26471386a45c05"
)


def make(stage: int | None = None, step: int = 7) -> PartReceipt:
    return PartReceipt(
        run_id="ledger-test",
        aggregator=AGGREGATOR.peer_id,
        sender=SENDER.peer_id,
        step=step,
        group_id=b"g",
        round=3,
        weight=48.0,
        nbytes=1234,
        issued_at=1_700_000_000.0,
        stage=stage,
    )


def test_a_receipt_of_the_code_before_the_field_decodes_reencodes_identically_and_verifies() -> None:
    decoded = decode_receipt(OLD_RECEIPT)
    assert decoded.stage is None and decoded == make()
    assert encode_receipt(decoded) == OLD_RECEIPT  # byte-identical: old signatures still verify
    assert encode_receipt(make()) == OLD_RECEIPT
    kept = verify_receipt(SignedReceipt(OLD_RECEIPT, OLD_SIGNATURE), "ledger-test", SENDER.peer_id)
    assert kept.stage is None


@given(st.integers(0, receipts.MAX_STAGES - 1), st.integers(0, 2**53))
def test_a_stage_receipt_round_trips_and_differs_from_the_data_parallel_one(stage: int, step: int) -> None:
    body = encode_receipt(make(stage, step))
    assert decode_receipt(body) == make(stage, step)
    assert body != encode_receipt(make(None, step))


@pytest.mark.parametrize("stage", [-1, receipts.MAX_STAGES, 2**40])
def test_a_stage_out_of_range_is_refused_built_or_decoded(stage: int) -> None:
    with pytest.raises(ValueError, match="stage"):
        make(stage)
    fields = msgspec.structs.asdict(make(0))
    fields["stage"] = stage
    with pytest.raises(ProtocolError):
        decode_receipt(msgspec.msgpack.encode(fields))


def test_the_stage_is_signed_so_a_receipt_cannot_move_between_stages_or_modes() -> None:
    signed = sign_receipt(make(2), AGGREGATOR.sign)
    assert verify_receipt(signed, "ledger-test", SENDER.peer_id).stage == 2
    for moved in (make(1), make(None)):  # another stage; a data-parallel receipt
        forged = SignedReceipt(encode_receipt(moved), signed.signature)
        with pytest.raises(ReceiptRejected) as caught:
            verify_receipt(forged, "ledger-test", SENDER.peer_id)
        assert caught.value.code == "receipt_bad_signature"


def test_max_stages_agrees_with_the_training_spec() -> None:
    assert receipts.MAX_STAGES == training.MAX_STAGES
