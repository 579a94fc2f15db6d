"""Report wire types, authenticity (verify_report) and plausibility (assess): pure, no database."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from backbone.ledger.accounting import (
    CREDITED,
    MAX_INTERVAL_S,
    MAX_SAMPLES_PER_SECOND,
    CapabilitiesRejected,
    Credit,
    ReceiptRejected,
    ReportRejected,
    assess,
    cap_capabilities,
    check_capabilities,
    credit_due,
    reason_codes,
    verify_receipt,
    verify_report,
)
from protocols.ledger import MAX_REPORT_BYTES, Capabilities, ContributionReport, SignedReport, report_payload
from protocols.receipts import SignedReceipt

from .reports import CAPS, RUN_ID, T0, identity, make_report, receipt, sign

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


def test_assess_credits_a_report_within_bounds() -> None:
    report = make_report(ALICE, 1)
    assert assess(report, previous_end=report.interval_start, now=report.interval_end) == CREDITED


def test_assess_flags_an_interval_ending_beyond_the_clock_skew() -> None:
    report = make_report(ALICE, 0)
    assert assess(report, None, now=report.interval_end - 299).credited
    verdict = assess(report, None, now=report.interval_end - 301)
    assert reason_codes(verdict.reason) == ["future"]


def test_assess_flags_overlap_with_the_previous_report_beyond_one_second() -> None:
    report = make_report(ALICE, 1)
    now = report.interval_end
    assert assess(report, previous_end=report.interval_start + 0.9, now=now).credited
    verdict = assess(report, previous_end=report.interval_start + 1.1, now=now)
    assert reason_codes(verdict.reason) == ["overlap"]


def test_assess_flags_compute_time_longer_than_the_interval() -> None:
    report = make_report(ALICE, 0, length=60.0, compute_seconds=61.5, samples=0)
    assert reason_codes(assess(report, None, now=report.interval_end).reason) == ["compute"]


def test_assess_flags_intervals_longer_than_an_hour_or_begun_before_the_peer_joined() -> None:
    # finding 9: an interval that began 1e9 s ago was credited 1.4e11 samples
    ancient = make_report(ALICE, 0, start=T0 - 1e9, length=1e9)
    assert set(reason_codes(assess(ancient, None, now=T0, joined_at=T0 - 60).reason)) == {
        "before_join",
        "too_long",
    }
    hour = make_report(ALICE, 0, start=T0, length=MAX_INTERVAL_S + 0.5)  # float slack of a clipped wait
    assert assess(hour, None, now=hour.interval_end, joined_at=T0).credited


def test_assess_credits_a_backlog_sent_days_later() -> None:
    """Version 4 flagged a backlog older than 24 h (``too_old``): queued while no backbone answered, or
    replayed from the journal by a volunteer restarted days later, it is honest work."""
    backlog = make_report(ALICE, 0, start=T0, length=60.0)
    assert assess(backlog, None, now=T0 + 5 * 86400, joined_at=T0 - 10).credited


def test_assess_flags_samples_beyond_any_device_in_the_interval() -> None:
    length = 10.0
    ceiling = MAX_SAMPLES_PER_SECOND * (length + 1)
    fast = make_report(ALICE, 0, length=length, samples=int(ceiling))
    assert assess(fast, None, now=fast.interval_end).credited
    absurd = make_report(ALICE, 0, length=length, samples=int(ceiling) + 1)
    assert reason_codes(assess(absurd, None, now=absurd.interval_end).reason) == ["rate"]


def test_assess_names_every_broken_rule() -> None:
    report = make_report(ALICE, 1, compute_seconds=100.0)
    verdict = assess(report, previous_end=report.interval_end, now=report.interval_start - 400)
    assert reason_codes(verdict.reason) == ["future", "overlap", "compute"]


@settings(max_examples=200)
@given(
    length=st.floats(0, MAX_INTERVAL_S),
    compute_fraction=st.floats(0, 1),
    rate_fraction=st.floats(0, 1),
    gap=st.one_of(st.none(), st.floats(0, 1e5)),
    lag=st.floats(-299, 30 * 86400),
)
def test_assess_always_credits_a_report_within_bounds_whatever_it_claims(
    length: float, compute_fraction: float, rate_fraction: float, gap: float | None, lag: float
) -> None:
    # samples are judged against the physical ceiling, not the peer's measured throughput (receipts
    # bound them), so a peer that sped up is never flagged for it
    compute = compute_fraction * length
    samples = math.floor(rate_fraction * MAX_SAMPLES_PER_SECOND * compute)
    report = make_report(ALICE, 0, start=T0, length=length, compute_seconds=compute, samples=samples)
    previous_end = None if gap is None else report.interval_start - gap
    verdict = assess(report, previous_end, now=report.interval_end + lag, joined_at=T0)
    assert verdict == CREDITED, verdict.reason


@settings(max_examples=200)
@given(
    length=st.floats(0, MAX_INTERVAL_S),
    extra_compute=st.floats(1.01, 1e6),
    extra_samples=st.integers(1, 2**40),
    which=st.sampled_from(["compute", "rate"]),
)
@example(length=1.967749996376142, extra_compute=1.01, extra_samples=1, which="rate")  # T0 + length rounds up
def test_assess_flags_a_report_claiming_more_than_its_interval_could_hold(
    length: float, extra_compute: float, extra_samples: int, which: str
) -> None:
    if which == "compute":
        report = make_report(ALICE, 0, start=T0, length=length, compute_seconds=length + extra_compute)
    else:
        report = make_report(ALICE, 0, start=T0, length=length, compute_seconds=length)
        # the limit of the interval as stored: T0 + length rounds, and may stretch it by ~1e-7 s
        stored = report.interval_end - report.interval_start
        samples = math.floor(MAX_SAMPLES_PER_SECOND * (max(length, stored) + 1)) + extra_samples
        report = make_report(ALICE, 0, start=T0, length=length, compute_seconds=length, samples=samples)
    verdict = assess(report, None, now=report.interval_end, joined_at=T0)
    assert reason_codes(verdict.reason) == [which]


# ------------------------------------------------------------------------------------- receipts


def test_verify_receipt_accepts_a_receipt_signed_by_its_aggregator() -> None:
    assert verify_receipt(receipt(MALLORY, ALICE, 3, 10.0), RUN_ID, ALICE.peer_id).step == 3


@pytest.mark.parametrize(
    ("signed", "code"),
    [
        (receipt(MALLORY, ALICE, 3, 10.0, signer=ALICE), "receipt_bad_signature"),
        (receipt(MALLORY, ALICE, 3, 10.0, run_id="other"), "receipt_wrong_run"),
        (receipt(MALLORY, MALLORY, 3, 10.0), "receipt_wrong_sender"),
        (receipt(ALICE, ALICE, 3, 10.0), "receipt_own"),
        (SignedReceipt(receipt=b"\xc1garbage", signature=b"s" * 64), "receipt_malformed"),
    ],
)
def test_verify_receipt_rejects_with_a_code(signed: SignedReceipt, code: str) -> None:
    with pytest.raises(ReceiptRejected) as info:
        verify_receipt(signed, RUN_ID, ALICE.peer_id)
    assert info.value.code == code


@given(data=st.binary(max_size=600))
def test_verify_receipt_rejects_random_bytes_cleanly(data: bytes) -> None:
    with pytest.raises(ReceiptRejected):
        verify_receipt(SignedReceipt(receipt=data, signature=b"s" * 64), RUN_ID, ALICE.peer_id)


_amount = st.floats(0, 1e12)


@given(claimed=_amount, evidence=_amount, first=st.floats(0, 1))
def test_credit_due_in_two_reports_never_exceeds_claims_nor_evidence(
    claimed: float, evidence: float, first: float
) -> None:
    early = credit_due(Credit(first * claimed, 10.0, 0.0), Credit(first * evidence), Credit())
    total = Credit(early.samples, early.compute_seconds, early.bytes_aggregated)
    late = credit_due(Credit(claimed, 20.0, 0.0), Credit(evidence), total)
    credited = early.samples + late.samples
    assert credited <= min(claimed, evidence) * (1 + 1e-9) + 1e-6
    assert credited == pytest.approx(min(claimed, evidence), rel=1e-9, abs=1e-6)
    assert early.compute_seconds + late.compute_seconds <= 20.0 + 1e-9


def test_capabilities_beyond_sane_ceilings_are_rejected() -> None:
    with pytest.raises(CapabilitiesRejected):
        check_capabilities(Capabilities(1e12, 1e6, 1e6, "liar"))  # finding 9
    with pytest.raises(CapabilitiesRejected):
        check_capabilities(Capabilities(10.0, 1e12, 1e6, "liar"))
    check_capabilities(CAPS)


def test_cap_capabilities_only_once_there_is_a_history() -> None:
    claim = Capabilities(1e5, 1e6, 1e6, "gpu")
    assert cap_capabilities(claim, credited_samples=6000, compute_seconds=59) == claim
    assert cap_capabilities(claim, credited_samples=0, compute_seconds=600) == claim
    capped = cap_capabilities(claim, credited_samples=6000, compute_seconds=60)
    assert capped.samples_per_second == pytest.approx(200.0)
    modest = Capabilities(150.0, 1e6, 1e6, "gpu")  # sped up 1.5x: a co-located job ended
    assert cap_capabilities(modest, credited_samples=6000, compute_seconds=60) == modest


# ------------------------------------------------------------------------------------ relayed bytes

_RELAYS = [identity(n).peer_id for n in (40, 41, 42)]
_CLIENTS = [identity(n) for n in (43, 44, 45)]


def test_relay_evidence_counts_only_relays_of_other_users_and_caps_by_the_interval() -> None:
    from backbone.ledger.accounting import relay_cap, relay_evidence

    mine, theirs, unknown = _RELAYS
    users = {ALICE.peer_id: 1, mine: 1, theirs: 2}
    report = make_report(ALICE, 4, length=10.0, relayed={mine: 5, theirs: 7, unknown: 9, ALICE.peer_id: 3})
    counted, notes = relay_evidence(report, 1, users)
    assert [(e.reporter, e.seq, e.relay, e.nbytes) for e in counted] == [(ALICE.peer_id, 4, theirs, 7)]
    assert notes == {"relay_same_user": 2, "relay_unknown": 1}
    huge = make_report(ALICE, 5, length=10.0, relayed={theirs: 2**53})
    [capped], notes = relay_evidence(huge, 1, users)
    assert capped.nbytes == relay_cap(10.0) < 2**53 and notes == {"relay_capped": 1}


_record = st.tuples(
    st.integers(0, 2), st.integers(0, 5), st.integers(0, 2), st.integers(0, 10**12), st.integers(1, 3)
)


@given(claim=st.integers(0, 10**13), records=st.lists(_record, max_size=30), relay_user=st.integers(1, 3))
def test_a_relay_is_never_credited_beyond_its_claim_nor_what_peers_of_other_users_received(
    claim: int, records: list[tuple[int, int, int, int, int]], relay_user: int
) -> None:
    """Each record: (client, seq, relay, bytes, the client's user). Reports are idempotent by
    (peer_id, seq): the first one seen of a (client, seq) is the report, later ones are replays."""
    from backbone.ledger.accounting import credited_relayed, relay_evidence

    relay = _RELAYS[0]
    reports: dict[tuple[int, int], tuple[int, int, int]] = {}
    evidence = []
    for client, seq, which, nbytes, user in records:
        first = reports.setdefault((client, seq), (which, nbytes, user))
        which, nbytes, user = first  # a replay is the same report
        report = make_report(_CLIENTS[client], seq, relayed={_RELAYS[which]: nbytes})
        users = {relay: relay_user, _RELAYS[1]: 9, _CLIENTS[client].peer_id: user}
        counted, _ = relay_evidence(report, user, users)
        evidence += [e for e in counted if e.relay == relay]
    others = sum(n for (w, n, u) in reports.values() if w == 0 and u != relay_user)
    credited = credited_relayed(claim, evidence)
    assert credited == min(claim, others)
    assert credited_relayed(claim, evidence + evidence) == credited  # duplicates add nothing
    index = {c.peer_id: i for i, c in enumerate(_CLIENTS)}
    assert all(reports[(index[e.reporter], e.seq)][2] != relay_user for e in evidence)  # same user: never


@given(claimed=_amount, evidence=_amount, first=st.floats(0, 1))
def test_credit_due_of_relayed_bytes_in_two_reports_is_min_of_claim_and_evidence(
    claimed: float, evidence: float, first: float
) -> None:
    early = credit_due(
        Credit(bytes_relayed=first * claimed), Credit(bytes_relayed=first * evidence), Credit()
    )
    late = credit_due(Credit(bytes_relayed=claimed), Credit(bytes_relayed=evidence), early)
    assert early.bytes_relayed >= 0 and late.bytes_relayed >= 0
    total = early.bytes_relayed + late.bytes_relayed
    assert total <= min(claimed, evidence) * (1 + 1e-9) + 1e-6
    assert total == pytest.approx(min(claimed, evidence), rel=1e-9, abs=1e-6)
