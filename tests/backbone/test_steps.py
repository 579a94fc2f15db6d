from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from backbone.steps import StepTracker


def test_a_finished_step_is_recorded_with_what_was_seen_of_it() -> None:
    tracker = StepTracker()
    assert tracker.observe(3, 10.0, 2, 5.0) == []
    assert tracker.observe(3, 40.0, 3, 4.5) == []
    assert tracker.observe(4, 0.0, 3, None) == [(4, 4.5, 40, 3)]


def test_steps_jumped_over_get_no_placeholder_rows() -> None:
    """Version 2 recorded a 0-peer row for every step jumped over (351 in one soak); and a claim of step
    2**40 must not become 2**40 rows."""
    tracker = StepTracker()
    tracker.observe(10, 5.0, 1, None)
    assert tracker.observe(2**40, 0.0, 0, None) == [(11, None, 5, 1)]  # only the step it saw worked on
    assert tracker.observe(2**40 + 1, 0.0, 0, None) == []  # nobody seen working toward it: not seen taken


@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=30))
def test_rows_are_increasing_one_per_view_and_never_placeholders(steps: list[int]) -> None:
    tracker = StepTracker()
    last = -1
    for step in sorted(steps):  # the run's step only grows (a backbone restart starts a new tracker)
        rows = tracker.observe(step, 1.0, 1, None)
        assert len(rows) <= 1
        assert all(peers > 0 or samples > 0 for _, _, samples, peers in rows)
        numbers = [r[0] for r in rows]
        assert all(n > last for n in numbers)
        if numbers:
            last = numbers[-1]


def test_a_finished_step_is_recorded_with_the_batch_its_members_claim_not_an_extrapolation() -> None:
    """Issue 11: a lone volunteer's steps each held exactly the target (128), yet the ledger showed 15 % to
    377 % of it: the tracker recorded the largest extrapolated estimate it had read at the step before."""
    tracker = StepTracker()
    tracker.observe(3, 10.0, 1, 5.0)
    tracker.observe(3, 483.0, 1, 5.0)  # extrapolated from a record read while the peer computed
    assert tracker.observe(4, 0.0, 1, None, batch=128) == [(4, 5.0, 128, 1)]
    tracker.observe(4, 20.0, 1, None)
    assert tracker.observe(6, 0.0, 1, None, batch=128) == [(5, None, 20, 1)]  # the claim is step 6's
