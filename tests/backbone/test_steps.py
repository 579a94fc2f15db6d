from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from backbone.steps import MAX_SKIPPED_ROWS, StepTracker


def test_a_finished_step_is_recorded_with_what_was_seen_of_it() -> None:
    tracker = StepTracker()
    assert tracker.observe(3, 10.0, 2, 5.0) == []
    assert tracker.observe(3, 40.0, 3, 4.5) == []
    assert tracker.observe(4, 0.0, 3, None) == [(4, 4.5, 40, 3)]


def test_a_step_claim_of_2_to_the_40_records_a_bounded_number_of_rows() -> None:
    """One admitted user alone in a quiet run is credible; its claim once made the backbone build a list
    of 2**40 rows on the event loop."""
    tracker = StepTracker()
    tracker.observe(10, 5.0, 1, None)
    rows = tracker.observe(2**40, 0.0, 1, None)
    assert len(rows) <= MAX_SKIPPED_ROWS + 1
    assert rows[0][0] == 11 and rows[-1][0] == 2**40


@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=30))
def test_rows_are_increasing_and_bounded_per_view(steps: list[int]) -> None:
    tracker = StepTracker()
    last = -1
    for step in sorted(steps):  # the run's step only grows (a backbone restart starts a new tracker)
        rows = tracker.observe(step, 1.0, 1, None)
        assert len(rows) <= MAX_SKIPPED_ROWS + 1
        numbers = [r[0] for r in rows]
        assert numbers == sorted(set(numbers)) and all(n > last for n in numbers)
        if numbers:
            last = numbers[-1]
