"""Pure checks of contribution reports: is it authentic (:func:`verify_report`), is it plausible
(:func:`assess`). No SQL, no I/O, no clock: the caller passes ``now``.

Authenticity. A :class:`~protocols.ledger.SignedReport` is accepted only if its bytes decode to a valid
:class:`~protocols.ledger.ContributionReport` of this run and ``signature`` verifies (Ed25519) over
``report_payload(report_bytes)`` with the key inside the report's own ``peer_id``. Anything else is
:class:`ReportRejected` and must not be stored.

Plausibility. An authentic report is *credited* or *flagged*; flagged reports are kept (evidence) but add
nothing to the leaderboard. With report r, the peer's measured capabilities c (samples/s ``s``, upload
``u`` and download ``d`` in bytes/s), the end p of the peer's latest credited report, the backbone's
clock t, and the interval length L = r.end - r.start, r is credited iff every rule holds:

    (1) r.end <= t + 300 s                                    (clock skew allowance, MAX_CLOCK_SKEW)
    (2) p is None  or  r.start >= p - 1 s                     (no second credit for the same time)
    (3) r.compute_seconds <= L + 1 s                          (cannot compute longer than the interval)
    (4) c known:    r.samples <= 1.5 * s * r.compute_seconds + 16
        c unknown:  r.samples == 0                            ("no measured capabilities")
    (5) max(r.bytes_aggregated, r.bytes_relayed) <= 1.5 * (u + d) * L + 1 MiB    (u = d = 0 if c unknown)

The 1.5 factors and the small constants absorb measurement noise, warm-up and protocol overhead; they
catch a peer claiming several times its measured throughput, not a peer that is a little lucky. A flagged
report's ``reason`` names every rule it broke, separated by ``"; "``.

What aggregators actually received (DESIGN D5's cross-check) is a later, separate check.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from protocols.ledger import MAX_REPORT_BYTES, Capabilities, ContributionReport, SignedReport, report_payload
from shared.auth.keys import verify_by_peer_id
from shared.errors import ProjectError

__all__ = [
    "BYTES_ALLOWANCE",
    "BYTES_SLACK",
    "CLOCK_SKEW_S",
    "COMPUTE_TOLERANCE_S",
    "CREDITED",
    "OVERLAP_TOLERANCE_S",
    "SAMPLES_ALLOWANCE",
    "SAMPLES_SLACK",
    "Assessment",
    "ReportRejected",
    "assess",
    "verify_report",
]

CLOCK_SKEW_S = 300.0
OVERLAP_TOLERANCE_S = 1.0
COMPUTE_TOLERANCE_S = 1.0
SAMPLES_ALLOWANCE = 1.5
SAMPLES_SLACK = 16
BYTES_ALLOWANCE = 1.5
BYTES_SLACK = 1024 * 1024

_REPORT_DECODER = msgspec.msgpack.Decoder(ContributionReport)


class ReportRejected(ProjectError):
    """A signed report is not authentic or not for this run: undecodable or invalid bytes, another run
    id, or a signature that does not verify with the key inside the report's peer id. Rejected reports
    are not stored; answer the sender with the message."""


@dataclass(frozen=True)
class Assessment:
    """The plausibility verdict on one authentic report: credited, or flagged with the broken rules."""

    credited: bool
    reason: str | None = None


CREDITED = Assessment(credited=True)


def verify_report(signed: SignedReport, run_id: str) -> ContributionReport:
    """Decode and authenticate a signed report.

    Returns:
        The report, guaranteed to be written and signed by ``report.peer_id`` for ``run_id``.

    Raises:
        ReportRejected: too large, malformed, another run's, or a bad signature.
    """
    if len(signed.report) > MAX_REPORT_BYTES:
        raise ReportRejected(f"report has {len(signed.report)} bytes, the limit is {MAX_REPORT_BYTES}")
    try:
        report = _REPORT_DECODER.decode(signed.report)
    except (msgspec.MsgspecError, RecursionError, UnicodeDecodeError) as exc:  # msgspec: bad UTF-8 too
        raise ReportRejected(f"malformed report: {exc}") from exc
    if report.run_id != run_id:
        raise ReportRejected(f"report is for run {report.run_id!r}, not {run_id!r}")
    if not verify_by_peer_id(report.peer_id, signed.signature, report_payload(signed.report)):
        raise ReportRejected(f"signature does not verify with the key of peer {report.peer_id}")
    return report


def assess(
    report: ContributionReport, capabilities: Capabilities | None, previous_end: float | None, now: float
) -> Assessment:
    """Apply the plausibility rules of the module docstring.

    Args:
        report: an authentic report (see :func:`verify_report`).
        capabilities: the peer's measured capabilities, or ``None`` if it never reported any.
        previous_end: ``interval_end`` of the peer's latest *credited* report, if any.
        now: the backbone's clock, unix seconds.
    """
    reasons: list[str] = []
    length = report.interval_end - report.interval_start
    if report.interval_end > now + CLOCK_SKEW_S:
        reasons.append(f"interval ends {report.interval_end - now:.0f} s in the future")
    if previous_end is not None and report.interval_start < previous_end - OVERLAP_TOLERANCE_S:
        reasons.append(f"interval overlaps the previous credited report (ended {previous_end:.3f})")
    if report.compute_seconds > length + COMPUTE_TOLERANCE_S:
        reasons.append(f"compute time {report.compute_seconds:.1f} s exceeds the {length:.1f} s interval")
    if capabilities is None:
        if report.samples > 0 or max(report.bytes_aggregated, report.bytes_relayed) > BYTES_SLACK:
            reasons.append("no measured capabilities")
    else:
        samples_limit = SAMPLES_ALLOWANCE * capabilities.samples_per_second * report.compute_seconds
        if report.samples > samples_limit + SAMPLES_SLACK:
            reasons.append(
                f"{report.samples} samples exceed the measured throughput "
                f"({capabilities.samples_per_second:g}/s for {report.compute_seconds:.1f} s)"
            )
        rate = capabilities.upload_bps + capabilities.download_bps
        bytes_limit = BYTES_ALLOWANCE * rate * length + BYTES_SLACK
        for name, value in (("aggregated", report.bytes_aggregated), ("relayed", report.bytes_relayed)):
            if value > bytes_limit:
                reasons.append(f"{value} bytes {name} exceed the measured bandwidth ({rate:g} B/s)")
    return Assessment(credited=False, reason="; ".join(reasons)) if reasons else CREDITED
