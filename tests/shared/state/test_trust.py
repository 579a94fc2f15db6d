"""trusted_state: which announced state to believe (a pure function; property tests)."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.training import StateAnnouncement
from shared.state.transfer import trusted_state


def ann(
    step: int, digest: int, *, backbone: bool = False, time: float = 0.0, nbytes: int = 100
) -> StateAnnouncement:
    return StateAnnouncement(
        step=step, digest=bytes([digest]) * 32, nbytes=nbytes, time=time, backbone=backbone
    )


_announcements = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=3),
    st.builds(
        ann,
        st.integers(0, 4),
        st.integers(0, 3),
        backbone=st.booleans(),
        time=st.floats(0, 100, allow_nan=False),
        nbytes=st.sampled_from([100, 101]),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(_announcements, st.integers(0, 5))
def test_trusted_state_lists_every_writer_once_in_its_own_group(
    announcements: dict[str, StateAnnouncement], min_step: int
) -> None:
    ranked = trusted_state(announcements, min_step=min_step)
    seen = [w for _, writers in ranked for w in writers]
    assert sorted(seen) == sorted(w for w, a in announcements.items() if a.step >= min_step)
    for summary, writers in ranked:
        for writer in writers:
            mine = announcements[writer]
            assert (mine.step, mine.digest, mine.nbytes) == (summary.step, summary.digest, summary.nbytes)
        assert summary.backbone == any(announcements[w].backbone for w in writers)
        assert summary.time == max(announcements[w].time for w in writers)
        # backbones are listed first as sources
        flags = [announcements[w].backbone for w in writers]
        assert flags == sorted(flags, reverse=True)
    keys = [(s.step, s.digest, s.nbytes) for s, _ in ranked]
    assert len(keys) == len(set(keys))


@settings(max_examples=300, deadline=None)
@given(_announcements)
def test_trusted_state_orders_newest_step_then_most_writers_then_backbone(
    announcements: dict[str, StateAnnouncement],
) -> None:
    ranked = trusted_state(announcements)
    for (a, wa), (b, wb) in itertools.pairwise(ranked):
        assert a.step >= b.step
        if a.step == b.step:
            assert len(wa) >= len(wb)
            if len(wa) == len(wb):
                assert a.backbone >= b.backbone


@settings(max_examples=200, deadline=None)
@given(_announcements, st.randoms(use_true_random=False))
def test_trusted_state_does_not_depend_on_the_mapping_order(
    announcements: dict[str, StateAnnouncement], rng: random.Random
) -> None:
    items = list(announcements.items())
    rng.shuffle(items)
    assert trusted_state(dict(items)) == trusted_state(announcements)


@settings(max_examples=200, deadline=None)
@given(
    step=st.integers(0, 1000),
    liar_backbone=st.booleans(),
    others=_announcements,
)
def test_trusted_state_puts_a_single_liar_after_two_honest_peers(
    step: int, liar_backbone: bool, others: dict[str, StateAnnouncement]
) -> None:
    # the liar claims the same step with another digest (even claiming to be a backbone)
    announcements = {k: a for k, a in others.items() if a.step < step}
    announcements |= {
        "honest-1": ann(step, 10, time=1.0),
        "honest-2": ann(step, 10, time=2.0),
        "liar": ann(step, 11, backbone=liar_backbone, time=99.0),
    }
    ranked = trusted_state(announcements)
    order = [s.digest[0] for s, _ in ranked if s.step == step]
    assert order == [10, 11]
    assert ranked[0][1] == ["honest-2", "honest-1"]  # most recent first


def test_trusted_state_breaks_a_tie_by_the_backbone() -> None:
    ranked = trusted_state({"v": ann(5, 1), "b": ann(5, 2, backbone=True), "old": ann(4, 3)})
    assert [(s.digest[0], w) for s, w in ranked] == [(2, ["b"]), (1, ["v"]), (3, ["old"])]
    assert trusted_state({"v": ann(5, 1)}, min_step=6) == []
