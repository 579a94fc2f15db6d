"""Report wire types, authenticity (verify_report) and plausibility (assess): pure, no database."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backbone.ledger.accounting import CREDITED, Assessment, ReportRejected, assess, verify_report
from protocols.ledger import MAX_REPORT_BYTES, Capabilities, ContributionReport, SignedReport, report_payload

from .reports import CAPS, RUN_ID, T0, identity, make_report, sign

ALICE = identity(1)
MALLORY = identity(2)
MiB = 1024 * 1024


# ------------------------------------------------------------------------------------------- wire


def _decode_report(fields: dict[str, object]) -> ContributionReport:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=ContributionReport)


def _report_fields(**changes: object) -> dict[str, object]:
    fields = msgspec.structs.asdict(make_report(ALICE, 0))
    fields.update(changes)
    return fields


def test_contribution_report_round_trips_through_msgpack() -> None:
    report = make_report(ALICE, 3, bytes_aggregated=5, bytes_relayed=7)
    assert _decode_report(msgspec.structs.asdict(report)) == report


@pytest.mark.parametrize(
    "changes",
    [
        {"interval_end": T0 - 1},
        {"samples": -1},
        {"seq": -1},
        {"compute_seconds": -0.5},
        {"compute_seconds": math.nan},
        {"compute_seconds": math.inf},
        {"interval_start": math.nan},
        {"bytes_relayed": 2**64 - 1},
        {"peer_id": "not-a-peer-id"},
        {"run_id": ""},
        {"extra": 1},
    ],
)
def test_contribution_report_decoding_rejects_invalid_fields(changes: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        _decode_report(_report_fields(**changes))


def test_contribution_report_constructor_rejects_end_before_start() -> None:
    with pytest.raises(ValueError, match="before interval_start"):
        make_report(ALICE, 0, length=-1.0, compute_seconds=0.0)


def test_signed_report_decoding_rejects_more_than_4_kib_of_report() -> None:
    wire = msgspec.msgpack.encode({"report": b"x" * (MAX_REPORT_BYTES + 1), "signature": b"s" * 64})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(wire, type=SignedReport)


@pytest.mark.parametrize(
    "changes", [{"samples_per_second": -1.0}, {"upload_bps": math.inf}, {"device": "x" * 129}]
)
def test_capabilities_reject_invalid_values(changes: dict[str, object]) -> None:
    fields = {**msgspec.structs.asdict(CAPS), **changes}
    with pytest.raises(ValueError, match=r"\w"):
        Capabilities(**fields)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=Capabilities)


# ------------------------------------------------------------------------------- verify_report


def test_verify_report_returns_the_report_signed_by_its_peer() -> None:
    report = make_report(ALICE, 0)
    assert verify_report(sign(ALICE, report), RUN_ID) == report


def test_verify_report_rejects_another_runs_report() -> None:
    with pytest.raises(ReportRejected, match="other-run"):
        verify_report(sign(ALICE, make_report(ALICE, 0, run_id="other-run")), RUN_ID)


def test_verify_report_rejects_a_report_signed_by_someone_else() -> None:
    forged = sign(MALLORY, make_report(ALICE, 0))
    with pytest.raises(ReportRejected, match="signature"):
        verify_report(forged, RUN_ID)


def test_verify_report_rejects_signature_over_bytes_without_the_domain_tag() -> None:
    data = msgspec.msgpack.encode(make_report(ALICE, 0))
    with pytest.raises(ReportRejected, match="signature"):
        verify_report(SignedReport(report=data, signature=ALICE.sign(data)), RUN_ID)


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", msgspec.msgpack.encode([1, 2, 3]), msgspec.msgpack.encode({"run_id": RUN_ID})],
)
def test_verify_report_rejects_malformed_bytes(data: bytes) -> None:
    signed = SignedReport(report=data, signature=ALICE.sign(report_payload(data)))
    with pytest.raises(ReportRejected, match="malformed"):
        verify_report(signed, RUN_ID)


def test_verify_report_rejects_oversized_report_built_in_process() -> None:
    data = b"\x00" * (MAX_REPORT_BYTES + 1)
    with pytest.raises(ReportRejected, match="limit"):
        verify_report(SignedReport(report=data, signature=ALICE.sign(report_payload(data))), RUN_ID)


_GENUINE = sign(ALICE, make_report(ALICE, 7, samples=123, bytes_relayed=456))


@settings(max_examples=300)
@given(data=st.data())
def test_verify_report_rejects_any_single_byte_change(data: st.DataObject) -> None:
    report, signature = bytearray(_GENUINE.report), bytearray(_GENUINE.signature)
    index = data.draw(st.integers(0, len(report) + len(signature) - 1), label="index")
    flip = data.draw(st.integers(1, 255), label="xor")
    target, i = (report, index) if index < len(report) else (signature, index - len(report))
    target[i] ^= flip
    with pytest.raises(ReportRejected):
        verify_report(SignedReport(report=bytes(report), signature=bytes(signature)), RUN_ID)


# ---------------------------------------------------------------------------------------- assess


def test_assess_credits_a_plausible_report() -> None:
    report = make_report(ALICE, 1)
    assert assess(report, CAPS, previous_end=report.interval_start, now=report.interval_end) == CREDITED


def test_assess_flags_an_interval_ending_beyond_the_clock_skew() -> None:
    report = make_report(ALICE, 0)
    assert assess(report, CAPS, None, now=report.interval_end - 299).credited
    verdict = assess(report, CAPS, None, now=report.interval_end - 301)
    assert not verdict.credited
    assert "future" in (verdict.reason or "")


def test_assess_flags_overlap_with_the_previous_credited_report_beyond_one_second() -> None:
    report = make_report(ALICE, 1)
    now = report.interval_end
    assert assess(report, CAPS, previous_end=report.interval_start + 0.9, now=now).credited
    verdict = assess(report, CAPS, previous_end=report.interval_start + 1.1, now=now)
    assert verdict == Assessment(False, verdict.reason)
    assert "overlaps" in (verdict.reason or "")


def test_assess_flags_compute_time_longer_than_the_interval() -> None:
    report = make_report(ALICE, 0, length=60.0, compute_seconds=61.5, samples=0)
    verdict = assess(report, CAPS, None, now=report.interval_end)
    assert not verdict.credited
    assert "compute time" in (verdict.reason or "")


def test_assess_without_capabilities_credits_only_empty_work() -> None:
    idle = make_report(ALICE, 0, samples=0, bytes_relayed=MiB)
    assert assess(idle, None, None, now=idle.interval_end).credited
    busy = make_report(ALICE, 0, samples=1)
    assert assess(busy, None, None, now=busy.interval_end) == Assessment(False, "no measured capabilities")


def test_assess_flags_bytes_beyond_the_measured_bandwidth() -> None:
    report = make_report(ALICE, 0, samples=0, bytes_aggregated=int(1.5 * 2e6 * 60) + MiB + 1)
    verdict = assess(report, CAPS, None, now=report.interval_end)
    assert not verdict.credited
    assert "aggregated" in (verdict.reason or "")


def test_assess_names_every_broken_rule() -> None:
    report = make_report(ALICE, 1, samples=10**9, bytes_relayed=10**15)
    verdict = assess(report, CAPS, previous_end=report.interval_end, now=report.interval_start)
    assert not verdict.credited
    assert (verdict.reason or "").count("; ") == 2  # overlap, samples, relayed


_rates = st.floats(0, 1e5)
_bandwidth = st.floats(0, 2e9)
_fraction = st.floats(0, 1)


@settings(max_examples=300)
@given(
    sps=_rates,
    up=_bandwidth,
    down=_bandwidth,
    length=st.floats(0, 3600),
    compute_fraction=_fraction,
    samples_fraction=_fraction,
    aggregated_fraction=_fraction,
    relayed_fraction=_fraction,
    gap=st.one_of(st.none(), st.floats(0, 1e6)),
    lag=st.floats(-299, 1e6),
)
def test_assess_always_credits_a_report_consistent_with_capabilities(
    sps: float,
    up: float,
    down: float,
    length: float,
    compute_fraction: float,
    samples_fraction: float,
    aggregated_fraction: float,
    relayed_fraction: float,
    gap: float | None,
    lag: float,
) -> None:
    caps = Capabilities(samples_per_second=sps, upload_bps=up, download_bps=down, device="d")
    compute = compute_fraction * length
    samples_limit = 1.5 * sps * compute + 16
    probe = make_report(ALICE, 0, start=T0, length=length, compute_seconds=compute, samples=0)
    bytes_limit = 1.5 * (up + down) * (probe.interval_end - probe.interval_start) + MiB
    report = make_report(
        ALICE,
        0,
        start=T0,
        length=length,
        compute_seconds=compute,
        samples=math.floor(samples_fraction * samples_limit),
        bytes_aggregated=math.floor(aggregated_fraction * bytes_limit),
        bytes_relayed=math.floor(relayed_fraction * bytes_limit),
    )
    previous_end = None if gap is None else report.interval_start - gap
    verdict = assess(report, caps, previous_end, now=report.interval_end + lag)
    assert verdict == CREDITED, verdict.reason


@settings(max_examples=300)
@given(sps=_rates, length=st.floats(0, 3600), compute_fraction=_fraction)
def test_assess_always_flags_twice_the_plausible_samples(
    sps: float, length: float, compute_fraction: float
) -> None:
    compute = compute_fraction * length
    limit = 1.5 * sps * compute + 16
    report = make_report(
        ALICE, 0, start=T0, length=length, compute_seconds=compute, samples=math.ceil(2 * limit)
    )
    verdict = assess(report, CAPS.__class__(sps, 1e6, 1e6, "d"), None, now=report.interval_end)
    assert not verdict.credited
    assert "samples exceed" in (verdict.reason or "")
