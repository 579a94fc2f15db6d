"""Issue 11, item 4: the ledger's bounds never flag an honest volunteer's reports, as the real reporter
(:class:`volunteer.reporting.Reporter`) writes them, whatever its throughput does (a co-located peer left
and it sped up, it slowed down, it re-measured), however long it waited or stayed away, and whether it
left cleanly or was killed and replayed its journal when restarted; reports claiming more than their
interval could hold are still flagged (``test_accounting``)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

import volunteer.reporting
from backbone.ledger.accounting import CREDITED, MAX_SAMPLES_PER_SECOND, assess
from protocols.ledger import ContributionReport
from volunteer.journal import JournaledStep
from volunteer.reporting import Reporter

from .reports import RUN_ID, identity

VOLUNTEER = identity(61)
JOINED = 1_800_000_000.0
DAY = 86400.0

_step = st.tuples(
    st.just("step"),
    st.floats(0.01, 1800.0),  # how long the step took
    st.floats(0.0, 1.0),  # the share of it spent computing (the rest: waiting for the batch, averaging)
    st.floats(0.0, MAX_SAMPLES_PER_SECOND),  # samples per compute second: any speed a device reaches
)
_wait = st.tuples(
    st.just("wait"), st.floats(0.0, 3 * DAY), st.just(0.0), st.just(0.0)
)  # no peers, a download
_restart = st.tuples(st.just("restart"), st.floats(0.0, 5 * DAY), st.booleans(), st.just(0.0))  # killed?
_events = st.lists(st.one_of(_step, _step, _step, _wait, _restart), min_size=1, max_size=40)


def honest_reports(events: list[tuple[str, float, float, float]], data_dir: Path) -> list[ContributionReport]:
    """Every report the reporter queues for ``events`` (each seq once, by seq)."""
    now = [JOINED]
    clock = SimpleNamespace(time=lambda: now[0])
    queued: dict[int, ContributionReport] = {}
    with patch.object(volunteer.reporting, "time", clock):
        reporter = Reporter(RUN_ID, VOLUNTEER, None, data_dir)
        number = 0
        for kind, length, share, rate in events:
            if kind == "step":
                now[0] += length
                number += 1
                compute = share * length
                reporter.record(JournaledStep(number, math.floor(rate * compute), compute, 0, now[0]))
            elif kind == "wait":
                now[0] += length
            else:
                if not share:  # a clean leave reports what is open; a SIGKILL leaves it in the journal
                    reporter.close_all()
                queued.update((r.seq, r) for _, r in reporter._pending)
                now[0] += length
                reporter = Reporter(RUN_ID, VOLUNTEER, None, data_dir)  # replays the journal
        reporter.close_interval()
        queued.update((r.seq, r) for _, r in reporter._pending)
    return [queued[seq] for seq in sorted(queued)]


@settings(max_examples=60, deadline=None)
@given(events=_events, delays=st.lists(st.floats(0.0, 3 * DAY), min_size=1, max_size=8))
def test_an_honest_volunteers_reports_are_never_flagged(
    events: list[tuple[str, float, float, float]], delays: list[float]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        reports = honest_reports(events, Path(tmp))
    previous_end: float | None = None
    arrived = JOINED
    for i, report in enumerate(reports):  # delivered in order, each possibly after a backlog of days
        arrived = max(arrived, report.interval_end) + delays[i % len(delays)]
        verdict = assess(report, previous_end, now=arrived, joined_at=JOINED)
        assert verdict == CREDITED, (verdict.reason, report)
        previous_end = max(previous_end or report.interval_end, report.interval_end)
