"""A state's lineage and which of a peer's steps a loaded state replaced (shared.state.lineage)."""

from __future__ import annotations

import hashlib

from hypothesis import given
from hypothesis import strategies as st

from shared.state.lineage import (
    LINEAGE_STEPS,
    MAX_TEXT,
    comparable,
    decode_lineage,
    encode_lineage,
    extend_lineage,
    fork_start_known,
    replaced_steps,
)


def fp(history: str, step: int) -> bytes:
    """The fingerprint of ``history``'s state at ``step`` (distinct histories, distinct fingerprints)."""
    return hashlib.blake2b(f"{history}/{step}".encode(), digest_size=8).digest()


def chain(history: str, first: int, last: int, common_until: int = -1) -> dict[int, bytes]:
    """A lineage of steps first..last that equals the shared history ``"run"`` up to ``common_until``."""
    lineage: dict[int, bytes] = {}
    for step in range(first, last + 1):
        lineage = extend_lineage(lineage, step, fp("run" if step <= common_until else history, step))
    return lineage


@given(st.integers(0, 10**6), st.integers(1, 80))
def test_a_lineage_keeps_the_last_steps_and_round_trips(start: int, steps: int) -> None:
    lineage = chain("run", start, start + steps - 1)
    assert len(lineage) == min(steps, LINEAGE_STEPS)
    assert max(lineage) == start + steps - 1
    text = encode_lineage(lineage)
    assert len(text) <= MAX_TEXT
    assert decode_lineage(text) == lineage


@given(st.text(max_size=2 * MAX_TEXT))
def test_a_malformed_lineage_is_ignored_never_fatal(text: str) -> None:
    lineage = decode_lineage(text)
    assert len(lineage) <= LINEAGE_STEPS
    assert all(len(f) == 8 for f in lineage.values())


def test_oversized_or_malformed_lineages_are_absent() -> None:
    assert decode_lineage("1:" + "ab" * 8 + "," * MAX_TEXT) == {}
    assert decode_lineage("1:zz" + "0" * 14) == {}
    assert decode_lineage("-1:" + "0" * 16) == {}
    assert decode_lineage("1:" + "0" * 15) == {}


def test_extending_drops_entries_of_another_history_above_the_step() -> None:
    lineage = chain("run", 1, 10)
    assert max(extend_lineage(lineage, 5, fp("load", 5))) == 5


@given(
    ours_start=st.integers(1, 100),
    ours_len=st.integers(1, 40),
    loaded_offset=st.integers(-35, 35),
    split_offset=st.integers(-40, 40),
)
def test_no_step_of_a_fork_keeps_its_credit_and_a_known_split_is_exact(
    ours_start: int, ours_len: int, loaded_offset: int, split_offset: int
) -> None:
    """Our history and the loaded one agree up to ``split`` and differ after it. Every step of ours
    above ``split`` or above the loaded step is replaced (never kept as the collaboration's); when the
    split is inside what both lineages know, exactly those are; when ours forked before the loaded
    lineage begins, all of ours is (none can be shown the collaboration's)."""
    ours_step = ours_start + ours_len - 1
    loaded = max(1, ours_step + loaded_offset)
    split = ours_step + split_offset
    ours = chain("ours", ours_start, ours_step, common_until=split)
    theirs = chain("theirs", max(1, loaded - LINEAGE_STEPS + 1), loaded, common_until=split)
    if not comparable(ours, theirs):
        assert not set(ours) & set(theirs)
        return
    replaced = replaced_steps(ours, ours_step, theirs, loaded)
    lost = {s for s in ours if s > split or s > loaded}
    kept = set(ours) if replaced is None else {s for s in ours if s < replaced[0]}
    assert replaced is None or replaced[1] == ours_step
    assert not kept & lost  # no fork step keeps its credit
    if min(set(ours) & set(theirs)) <= split:
        assert fork_start_known(ours, theirs)
        assert kept == set(ours) - lost  # and no honest step loses it
    elif min(ours) < min(theirs):
        assert not fork_start_known(ours, theirs) and kept == set()


def test_the_issue_case_behind_by_one_after_a_split_round() -> None:
    """A round completed for some members (they went on to step 107) and failed for others, who retried
    and took their own step 106: one step behind, the loaded state's lineage shows theirs was a fork."""
    survivors = chain("survivors", 80, 107, common_until=105)
    retried = chain("retried", 80, 106, common_until=105)
    assert replaced_steps(retried, 106, survivors, 107) == (106, 106)
    honest_laggard = chain("x", 80, 105, common_until=105)
    assert replaced_steps(honest_laggard, 105, survivors, 107) is None


def test_an_earlier_life_loses_its_steps_taken_again_differently_and_those_above_the_loaded_state() -> None:
    from shared.state.lineage import earlier_life_replaced

    run = chain("run", 0, 3)  # the survivors resumed from step 1 and took steps 2, 3 again
    life = chain("lost", 0, 9, common_until=1)  # our earlier process's steps 2..9: another history
    assert earlier_life_replaced(life, 9, run, 3) == (2, 9)  # not only 4..9
    assert earlier_life_replaced(chain("run", 0, 9), 9, run, 3) == (4, 9)  # 1..3 were the run's
    assert earlier_life_replaced(chain("run", 0, 3), 3, run, 3) is None  # nothing lost
    assert earlier_life_replaced(chain("lost", 0, 3, common_until=1), 3, run, 3) == (2, 3)
    # the loaded state is ahead and its window starts after a fork of ours: none of ours is vouched for
    ahead = chain("run", 50, 50 + LINEAGE_STEPS - 1)
    assert earlier_life_replaced(chain("lost", 40, 60, common_until=10), 60, ahead, 81) == (40, 60)
    # no lineage journaled (an older version), or none in common (a long absence): the step numbers
    assert earlier_life_replaced({}, 9, run, 3) == (4, 9)
    assert earlier_life_replaced({}, 3, run, 3) is None
    assert earlier_life_replaced(chain("run", 0, 9), 9, ahead, 81) is None
