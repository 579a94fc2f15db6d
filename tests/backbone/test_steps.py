from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backbone.steps import PlannedRounds, StepLog, StepTracker, observed_samples
from protocols.training import Progress
from shared.progress import summarize

NOW = 1_700_000_000.0


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


def test_a_step_seen_only_with_peers_and_no_samples_gets_no_row() -> None:
    """Issue 11: rows of 0 samples. A peer at the step that had accumulated nothing when the step moved
    is no evidence of the step's batch: receipts evidence such a step, if two users averaged for it."""
    tracker = StepTracker()
    tracker.observe(3, 0.0, 2, None)
    assert tracker.observe(4, 0.0, 2, None) == []


@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=30))
def test_rows_are_increasing_one_per_view_and_never_placeholders(steps: list[int]) -> None:
    tracker = StepTracker()
    last = -1
    for step in sorted(steps):  # the run's step only grows (a backbone restart starts a new tracker)
        rows = tracker.observe(step, 1.0, 1, None)
        assert len(rows) <= 1
        assert all(peers > 0 and samples > 0 for _, _, samples, peers in rows)
        numbers = [r[0] for r in rows]
        assert all(n > last for n in numbers)
        if numbers:
            last = numbers[-1]


def test_the_step_batch_is_what_the_records_say_not_their_extrapolation() -> None:
    """Issue 11: one volunteer at a target of 48 stepping every 0.3 s was recorded with 192 samples per
    step: the newcomer's view adds each record's throughput times its age (up to 3 s), capped at 4x."""
    fast = Progress(step=7, samples=40, samples_per_second=160.0, time=NOW - 2.0, loss=5.0)
    behind = Progress(step=6, samples=48, samples_per_second=10.0, time=NOW, loss=6.0)
    records = {"a": fast, "b": behind}
    nobody = Progress(step=0, samples=0, samples_per_second=0.0, time=NOW)
    view = summarize(records, "me", nobody, now=NOW, target_batch=48, anchored=False)
    assert view.step == 7 and view.samples == 48 * 4  # the extrapolated guess, capped
    assert observed_samples(records, 7, NOW, 48) == 40  # what the record says
    syncing = Progress(step=7, samples=30, samples_per_second=1.0, time=NOW, syncing=True)
    assert observed_samples({**records, "c": syncing}, 7, NOW, 48) == 40  # a download is no batch


def test_steps_log_at_debug_with_a_progress_line_and_run_finished_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 11: 1,633 INFO lines in 10 minutes, one per step, and nothing said the run finished."""
    log = StepLog(target_batch=48, max_steps=250, every_steps=100, every_s=60.0)
    with caplog.at_level(logging.DEBUG, logger="backbone.steps"):
        for step in range(1, 261):
            log.step(step, 5.0, 48 if step % 2 else 52, 3, NOW + step * 0.1)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 260
    assert info[0] == "global steps 1-100 recorded: loss 5.0000, median batch 50 / target 48, up to 3 peers"
    assert info[1].startswith("global steps 101-200 recorded")
    assert info[2].startswith("global steps 201-250 recorded")
    assert info[3] == "run finished: global step 250 reached the run's max_steps (250)"
    assert len(info) == 4  # steps past the limit (a late straggler) say nothing more until 100 more
    with caplog.at_level(logging.DEBUG, logger="backbone.steps"):
        log.step(261, None, 48, 1, NOW + 200.0)  # a minute later: a progress line, whatever the count
    assert caplog.records[-1].getMessage().startswith("global steps 251-261 recorded: loss 5.0000")


def test_run_finished_is_said_once_even_when_the_last_step_was_not_recorded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = StepLog(target_batch=48, max_steps=10)
    with caplog.at_level(logging.INFO, logger="backbone.steps"):
        log.step(8, 5.0, 48, 2, NOW)
        log.reached(10, NOW + 1)  # steps 9 and 10 passed within one poll: no rows, still the end
        log.reached(10, NOW + 2)
    finished = [r.getMessage() for r in caplog.records if "run finished" in r.getMessage()]
    assert finished == ["run finished: global step 10 reached the run's max_steps (10)"]


def test_a_finished_step_is_recorded_with_the_batch_its_members_claim_not_an_extrapolation() -> None:
    """Issue 11: a lone volunteer's steps each held exactly the target (128), yet the ledger showed 15 % to
    377 % of it: the tracker recorded the largest extrapolated estimate it had read at the step before."""
    tracker = StepTracker()
    tracker.observe(3, 10.0, 1, 5.0)
    tracker.observe(3, 483.0, 1, 5.0)  # extrapolated from a record read while the peer computed
    assert tracker.observe(4, 0.0, 1, None, batch=128) == [(4, 5.0, 128, 1)]
    tracker.observe(4, 20.0, 1, None)
    assert tracker.observe(6, 0.0, 1, None, batch=128) == [(5, None, 20, 1)]  # the claim is step 6's


def test_a_planned_rounds_target_is_what_its_peers_planned_at_the_step_before() -> None:
    planned = PlannedRounds()
    planned.see(4, 700)  # peers at step 4 aim at 700 samples for step 5
    planned.see(5, None)  # nobody plans: the manifest's target batch
    assert (planned.of(5, 1024), planned.of(6, 1024), planned.of(4, 1024)) == (700, 1024, 1024)
    for step in range(6, 6 + 2 * PlannedRounds.KEEP):
        planned.see(step, step)
    assert planned.of(5, 1024) == 1024 and len(planned._targets) <= PlannedRounds.KEEP  # bounded
    assert planned.of(6 + 2 * PlannedRounds.KEEP, 0) == 5 + 2 * PlannedRounds.KEEP
