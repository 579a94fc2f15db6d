"""The benchmark trace's byte totals (scripts/strategy_trace.py): exact from the readings that bracket the
round, however seldom a loaded machine let the sampler read in between."""

from __future__ import annotations

import pytest

from scripts.strategy_trace import analyze


def test_the_totals_come_from_the_bracketing_readings_not_from_interpolation() -> None:
    # one peer uploads 1 MB in a burst that ends at t = 1.1, its round at 1.2; a starved sampler read at
    # 1.05 (mid-burst) and next only at 3.0: interpolating at the round's ends counted 6 %
    samples = [
        [0.0, 0.0, 0.0, 0.0, 0.0],  # before "go"
        [1.05, 500_000.0, 0.0, 0.0, 500_000.0],
        [3.0, 1_000_000.0, 0.0, 0.0, 1_000_000.0],  # after every peer reported
    ]
    reports = [{"start": 1.0, "end": 1.2, "cpu_s": 0.1}, {"start": 1.0, "end": 1.2, "cpu_s": 0.1}]
    summary = analyze(
        samples,
        [[], []],
        reports,
        [(20.0, 20.0), (20.0, 20.0)],
        [0.0, 1.0],
        [True, False],
        1_000_000.0,
        0.4,
    )
    up, down = summary["peers"][0]["up_bytes"], summary["peers"][1]["down_bytes"]
    assert (up, down) == (1_000_000, 1_000_000)
    assert summary["peers"][0]["up_busy_s"] == pytest.approx(0.4)


def test_no_readings_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no link samples"):
        analyze([], [[]], [{"start": 0.0, "end": 1.0}], [(1.0, 1.0)], [1.0], [True], 1.0, 1.0)
