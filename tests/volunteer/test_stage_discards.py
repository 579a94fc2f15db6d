"""Stage steps a swarm server discards (volunteer.reporting, "Stage discards"; volunteer.journal, "Stage
steps"): journaled at once, they survive a restart and go out in the next reports, merged per stage and at
most ``MAX_STAGE_DISCARDED_PER_REPORT`` per report (the rest in the next, also across a restart); the
discarded steps of that stage are not claimed, other stages' and trainers' claims stay; the highest step of
each stage survives restarts and compaction; and a backbone takes the credit of those stage steps back."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.ledger import MAX_STAGE_DISCARDED_PER_REPORT, ContributionReport
from protocols.receipts import PartReceipt, SignedReceipt, sign_receipt
from shared.auth.keys import Identity
from tests.backbone.pinned_api import serve_pinned_api
from volunteer.journal import JournaledStep, merge_stage_ranges
from volunteer.reporting import Reporter

from .journal_child import SAMPLES, VOLUNTEER, WITNESS
from .test_reporter_journal import admit_fixed, credited

ALICE = Identity.generate()
RUN = "r@x"


def step(number: int, at: float) -> JournaledStep:
    return JournaledStep(number, 32, 0.5, 0, at)


def decoded(reporter: Reporter) -> list[ContributionReport]:
    return [msgspec.msgpack.decode(s.report, type=ContributionReport) for s, _ in reporter._pending]


def ranges(report: ContributionReport) -> list[tuple[int, int, int]]:
    return [(r.stage, r.first, r.last) for r in report.stage_discarded]


def test_stage_discards_survive_a_restart_and_go_out_in_the_next_report(tmp_path: Path) -> None:
    start = time.time()
    reporter = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)
    for number in range(1, 5):
        reporter.record(step(number, start + number), stage=1)
    reporter.record(step(3, start + 5))  # a micro-batch our trainer carried (no stage): stays claimed
    reporter.record(step(2, start + 6), stage=0)  # another stage's step 2 (we moved): stays claimed
    reporter.discard_stage(1, 3, 4)  # the stage state we loaded replaced our steps 3 and 4 of stage 1
    reporter.discard_stage(1, 6, 6)
    reporter.discard_stage(1, 5, 5)
    reporter.discard_stage(0, 9, 7)  # empty: ignored
    assert (reporter.stage_last_step(1), reporter.stage_last_step(0), reporter.stage_last_step(2)) == (
        4,
        2,
        None,
    )
    restarted = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)
    [report] = decoded(restarted)
    assert ranges(report) == [(1, 3, 6)] and report.discarded == []
    assert report.samples == 4 * 32  # stage 1's steps 1-2, the carried batch and stage 0's step 2
    assert (restarted.stage_last_step(1), restarted.stage_last_step(0)) == (4, 2)
    again = Reporter(RUN, ALICE, None, tmp_path)  # from the compacted journal: nothing pending
    assert again._stage_discarded == [] and (again.stage_last_step(1), again.stage_last_step(0)) == (4, 2)


def test_more_stage_ranges_than_a_report_lists_go_out_in_the_next_ones_across_a_restart(
    tmp_path: Path,
) -> None:
    reporter = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)
    count = MAX_STAGE_DISCARDED_PER_REPORT + 4
    for stage in range(count):  # one range of each of more stages than a report lists
        reporter.discard_stage(stage, 10, 12)
    reporter.close_interval()
    [first] = decoded(reporter)
    assert ranges(first) == [(k, 10, 12) for k in range(MAX_STAGE_DISCARDED_PER_REPORT)]
    restarted = Reporter(RUN, ALICE, None, tmp_path, interval=1e9)  # replays: the rest goes out now
    [_, second] = decoded(restarted)
    assert ranges(second) == [(k, 10, 12) for k in range(MAX_STAGE_DISCARDED_PER_REPORT, count)]
    assert Reporter(RUN, ALICE, None, tmp_path)._stage_discarded == []


stage_ranges = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 60), st.integers(0, 60)).map(
        lambda r: (r[0], min(r[1], r[2]), max(r[1], r[2]))
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ranges=stage_ranges, limit=st.integers(1, 6))
def test_merged_stage_ranges_cover_every_discarded_step_and_stay_bounded(
    ranges: list[tuple[int, int, int]], limit: int
) -> None:
    merged = merge_stage_ranges(ranges, limit)
    assert merged == sorted(merged)
    for stage in {k for k, _, _ in ranges}:
        mine = [(a, b) for k, a, b in merged if k == stage]
        assert 1 <= len(mine) <= limit
        assert all(b1 + 1 < a2 for (_, b1), (a2, _) in itertools.pairwise(mine))  # disjoint, apart
        given_steps = {s for k, a, b in ranges if k == stage for s in range(a, b + 1)}
        covered = {s for a, b in mine for s in range(a, b + 1)}
        assert given_steps <= covered  # never fewer of our steps
        assert min(covered) == min(given_steps) and max(covered) == max(given_steps)  # nothing outside
    assert {k for k, _, _ in merged} == {k for k, _, _ in ranges}
    assert merge_stage_ranges(merged, limit) == merged


def stage_receipt(run_id: str, stage: int, step: int) -> SignedReceipt:
    body = PartReceipt(
        run_id=run_id,
        aggregator=WITNESS.peer_id,
        sender=VOLUNTEER.peer_id,
        step=step,
        group_id=b"s",
        round=0,
        weight=SAMPLES,
        nbytes=100,
        issued_at=time.time(),
        stage=stage,
    )
    return sign_receipt(body, WITNESS.sign)


async def test_stage_steps_a_server_discards_after_re_syncing_are_taken_back_by_the_ledger(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "vera"
    data_dir.mkdir()
    async with serve_pinned_api(tmp_path / "bb") as api:
        client = admit_fixed(api)
        for number in range(1, 7):
            api.store.record_stage_step(
                2, number, finished_at=time.time(), loss=None, samples=SAMPLES, peers=2, target_batch=SAMPLES
            )
        reporter = Reporter(api.run_id, VOLUNTEER, client, data_dir, interval=1e9)
        start = time.time()
        for number in range(1, 7):  # stage 2's steps 4-6 turn out to be a fork's
            reporter.book.add(number, [(WITNESS.peer_id, stage_receipt(api.run_id, 2, number))], stage=2)
            reporter.record(JournaledStep(number, SAMPLES, 0.5, 0, start + number / 10), stage=2)
        reporter.close_interval()
        await reporter.flush()
        assert credited(api) == {"vera": 6 * SAMPLES, "will": 0}
        reporter.discard_stage(2, 4, 6)  # the stage state it re-synced to replaced them
        reporter.close_interval()
        await reporter.flush()
        assert (reporter.sent, reporter.pending) == (2, 0)
        assert credited(api) == {"vera": 3 * SAMPLES, "will": 0}
        [vera, _] = api.store.leaderboard()
        assert vera.discarded_samples == 3 * SAMPLES
        assert api.store.stage_discards(VOLUNTEER.peer_id) == [(2, 4, 6)]
        assert api.store.discards(VOLUNTEER.peer_id) == []
