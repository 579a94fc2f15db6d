from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols.errors import ProtocolError
from protocols.ledger import ContributionReport, SignedReport
from protocols.receipts import (
    MAX_PULLED_PER_REPORT,
    MAX_RECEIPT_BYTES,
    MAX_RECEIPTS_PER_REPORT,
    PartReceipt,
    PulledSlice,
    SignedReceipt,
    decode_receipt,
    encode_receipt,
    receipt_payload,
)
from shared.auth.keys import Identity, verify_by_peer_id

A, S = Identity.generate(), Identity.generate()


def receipt(**changes: object) -> PartReceipt:
    fields: dict[str, object] = dict(
        run_id="r" * 128,
        aggregator=A.peer_id,
        sender=S.peer_id,
        step=2**53,
        group_id=b"g" * 32,
        round=2**53,
        weight=float(2**53),
        nbytes=2**53,
        issued_at=1e12,
    )
    fields.update(changes)
    return PartReceipt(**fields)  # type: ignore[arg-type]


def test_the_largest_receipt_fits_and_round_trips_with_a_verifiable_signature() -> None:
    body = encode_receipt(receipt())
    assert len(body) <= MAX_RECEIPT_BYTES
    signed = SignedReceipt(receipt=body, signature=A.sign(receipt_payload(body)))
    assert decode_receipt(signed.receipt) == receipt()
    assert verify_by_peer_id(A.peer_id, signed.signature, receipt_payload(signed.receipt))
    assert not verify_by_peer_id(S.peer_id, signed.signature, receipt_payload(signed.receipt))


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -1.0, 2.0**60])
def test_absurd_weights_are_refused_on_decode(weight: float) -> None:
    body = msgspec.msgpack.encode({**msgspec.structs.asdict(receipt()), "weight": weight})
    with pytest.raises(ProtocolError):
        decode_receipt(body)


@given(st.binary(max_size=2 * MAX_RECEIPT_BYTES))
def test_garbage_is_a_protocol_error_never_another_exception(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_receipt(data)


def test_a_full_report_fits_its_byte_limit() -> None:
    from protocols.ledger import MAX_REPORT_BYTES

    body = encode_receipt(receipt())
    signed = SignedReceipt(receipt=body, signature=A.sign(receipt_payload(body)))
    report = ContributionReport(
        run_id="r" * 128,
        peer_id=S.peer_id,
        seq=2**53,
        global_step=2**53,
        samples=2**53,
        compute_seconds=1e12,
        bytes_aggregated=2**53,
        bytes_relayed=2**53,
        interval_start=1e12,
        interval_end=1e12,
        receipts=[signed] * MAX_RECEIPTS_PER_REPORT,
        pulled=[PulledSlice(A.peer_id, 2**53, 2**53)] * MAX_PULLED_PER_REPORT,
    )
    data = msgspec.msgpack.encode(report)
    assert len(data) <= MAX_REPORT_BYTES
    SignedReport(report=data, signature=S.sign(data))
    with pytest.raises(ValueError, match="at most"):
        msgspec.structs.replace(report, receipts=[signed] * (MAX_RECEIPTS_PER_REPORT + 1))
