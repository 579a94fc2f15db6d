"""trusted_state: which announced state to believe, by distinct admitted users (a pure function; property
tests)."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.training import StateAnnouncement
from shared.state.trust import BACKBONE_USER, Announced, support_of, trusted_state, usable_states


def ann(
    step: int, digest: int, *, backbone: bool = False, time: float = 0.0, nbytes: int = 100
) -> StateAnnouncement:
    return StateAnnouncement(
        step=step, digest=bytes([digest]) * 32, nbytes=nbytes, time=time, backbone=backbone
    )


def by(user: str, announcement: StateAnnouncement) -> Announced:
    return Announced(announcement, user)


def alone(announcements: dict[str, StateAnnouncement]) -> dict[str, Announced]:
    """Each writer its own user (an open run)."""
    return {w: Announced(a, w) for w, a in announcements.items()}


_announcement = st.builds(
    ann,
    st.integers(0, 4),
    st.integers(0, 3),
    backbone=st.booleans(),
    time=st.floats(0, 100, allow_nan=False),
    nbytes=st.sampled_from([100, 101]),
)
_announced = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=3),
    st.builds(Announced, _announcement, st.sampled_from(["u1", "u2", "u3", BACKBONE_USER])),
    max_size=12,
)


def credible(writer: str, entry: Announced) -> bool:
    return entry.announcement.backbone and entry.user in (BACKBONE_USER, writer)


@settings(max_examples=300, deadline=None)
@given(_announced, st.integers(0, 5))
def test_trusted_state_lists_every_writer_once_in_its_own_group(
    announced: dict[str, Announced], min_step: int
) -> None:
    ranked = trusted_state(announced, min_step=min_step)
    seen = [w for _, writers in ranked for w in writers]
    assert sorted(seen) == sorted(w for w, e in announced.items() if e.announcement.step >= min_step)
    for summary, writers in ranked:
        for writer in writers:
            mine = announced[writer].announcement
            assert (mine.step, mine.digest, mine.nbytes) == (summary.step, summary.digest, summary.nbytes)
        assert summary.backbone == any(credible(w, announced[w]) for w in writers)
        assert summary.time == max(announced[w].announcement.time for w in writers)
        # credible backbones are listed first as sources
        flags = [credible(w, announced[w]) for w in writers]
        assert flags == sorted(flags, reverse=True)
    keys = [(s.step, s.digest, s.nbytes) for s, _ in ranked]
    assert len(keys) == len(set(keys))


@settings(max_examples=300, deadline=None)
@given(_announced)
def test_trusted_state_orders_newest_step_then_most_users_then_backbone(
    announced: dict[str, Announced],
) -> None:
    ranked = trusted_state(announced)
    for (a, wa), (b, wb) in itertools.pairwise(ranked):
        assert a.step >= b.step
        if a.step == b.step:
            assert support_of(announced, wa) >= support_of(announced, wb)
            if support_of(announced, wa) == support_of(announced, wb):
                assert a.backbone >= b.backbone


@settings(max_examples=200, deadline=None)
@given(_announced, st.randoms(use_true_random=False))
def test_trusted_state_does_not_depend_on_the_mapping_order(
    announced: dict[str, Announced], rng: random.Random
) -> None:
    items = list(announced.items())
    rng.shuffle(items)
    assert trusted_state(dict(items)) == trusted_state(announced)


@settings(max_examples=300, deadline=None)
@given(
    step=st.integers(0, 1000),
    identities=st.integers(1, 40),
    liar_digests=st.lists(st.integers(11, 14), min_size=1, max_size=40),
    liar_backbone=st.booleans(),
    honest_machines=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    others=_announced,
)
def test_trusted_state_one_user_with_k_identities_never_outvotes_two_other_users(
    step: int,
    identities: int,
    liar_digests: list[int],
    liar_backbone: bool,
    honest_machines: tuple[int, int],
    others: dict[str, Announced],
) -> None:
    # finding 8: the liar makes up ``identities`` peer ids (all admitted as the one user "mallory"), each
    # announcing some state of the same step, even claiming to be a backbone; two honest users (on one to
    # three machines each) agree on digest 10
    announced = {w: e for w, e in others.items() if e.announcement.step < step and e.user != "mallory"}
    for i in range(identities):
        digest = liar_digests[i % len(liar_digests)]
        announced[f"mallory-{i}"] = by("mallory", ann(step, digest, backbone=liar_backbone, time=99.0))
    for user, machines in zip(("alice", "bob"), honest_machines, strict=True):
        for m in range(machines):
            announced[f"{user}-{m}"] = by(user, ann(step, 10, time=float(m)))

    ranked = trusted_state(announced)

    first, writers = ranked[0]
    assert (first.step, first.digest[0]) == (step, 10)
    assert support_of(announced, writers) == 2
    assert not first.backbone and all(not s.backbone for s, _ in ranked if s.step == step)
    assert all(support_of(announced, w) == 1 for s, w in ranked[1:] if s.step == step)


@settings(max_examples=100, deadline=None)
@given(identities=st.integers(3, 40))
def test_trusted_state_counts_one_user_once_however_many_writers(identities: int) -> None:
    announced = {f"m{i}": by("mallory", ann(5, 11, time=float(i))) for i in range(identities)}
    announced |= {"a": by("alice", ann(5, 10)), "b": by("bob", ann(5, 10))}
    ranked = trusted_state(announced)
    assert [s.digest[0] for s, _ in ranked] == [10, 11]
    # without the users (an open run: every writer stands for itself) the writers would win
    writers_only = {w: Announced(e.announcement, w) for w, e in announced.items()}
    assert trusted_state(writers_only)[0][0].digest[0] == 11


def test_trusted_state_breaks_a_tie_by_a_credible_backbone_then_by_digest() -> None:
    ranked = trusted_state(alone({"v": ann(5, 1), "b": ann(5, 2, backbone=True), "old": ann(4, 3)}))
    assert [(s.digest[0], w) for s, w in ranked] == [(2, ["b"]), (1, ["v"]), (3, ["old"])]
    assert trusted_state(alone({"v": ann(5, 1)}), min_step=6) == []
    # an admitted volunteer that flags its announcement "backbone" is not believed to be one
    ranked = trusted_state({"v": by("alice", ann(5, 1)), "x": by("mallory", ann(5, 2, backbone=True))})
    assert [(s.digest[0], s.backbone) for s, _ in ranked] == [(1, False), (2, False)]
    ranked = trusted_state({"v": by("alice", ann(5, 2)), "b": by(BACKBONE_USER, ann(5, 1, backbone=True))})
    assert [(s.digest[0], s.backbone) for s, _ in ranked] == [(1, True), (2, False)]


def test_trusted_state_takes_a_lone_peer_when_nobody_contradicts_it() -> None:
    announced = {"v": by("alice", ann(7, 1)), "w": by("bob", ann(6, 2)), "x": by("carol", ann(6, 2))}
    ranked = trusted_state(announced)
    # newest step first even with less support: whether a step is credible is the caller's question
    assert [(s.step, support_of(announced, w)) for s, w in ranked] == [(7, 1), (6, 2)]


# ------------------------------------------------------------------ usable_states (issue 10: no lone forks)


def test_a_minority_peer_may_load_the_survivors_lower_state_and_never_a_forks() -> None:
    """A peer of a losing fork at step 568 re-syncs to the survivor at 250: the state there is usable,
    although lower than its own; the fork's own announcement of step 250 (made while it passed there) is
    not, though more users announce it."""
    survivors = {"a", "b", "c"}
    announced = {
        "a": by("alice", ann(250, 1)),
        "f1": by("frank", ann(250, 2)),
        "f2": by("fred", ann(250, 2)),
        "f3": by("fiona", ann(568, 3)),
    }
    ranked = trusted_state(announced)
    assert ranked[0][0].step == 568 and ranked[1][0].digest == bytes([2]) * 32  # newest, then most users
    usable = usable_states(ranked, target=250, alone=False, patient=True, survivor=survivors)
    assert [(u[0].step, u[0].digest[0]) for u in usable] == [(250, 1)]
    # without knowing the survivor (the filter of before) the fork's state would win
    before = usable_states(ranked, target=250, alone=False, patient=True)
    assert before[0][0].digest[0] == 2


def test_past_patience_a_backbone_checkpoint_or_an_older_survivor_state_is_usable() -> None:
    announced = {
        "bb": by(BACKBONE_USER, ann(240, 4, backbone=True)),
        "f1": by("frank", ann(240, 5)),
        "a": by("alice", ann(230, 6)),
    }
    ranked = trusted_state(announced)
    assert usable_states(ranked, target=250, alone=False, patient=True, survivor={"a"}) == []
    late = usable_states(ranked, target=250, alone=False, patient=False, survivor={"a"})
    assert [u[0].digest[0] for u in late] == [4, 6]
    # alone (nobody trains): the newest at or above the target, then anything
    assert usable_states(ranked, target=235, alone=True, patient=True)[0][0].step == 240


@given(
    st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), _announcement, max_size=4),
    st.integers(0, 4),
    st.booleans(),
    st.booleans(),
    st.sets(st.sampled_from(["a", "b", "c", "d"])),
)
def test_usable_states_keep_the_trusted_order_and_need_a_survivor_within_patience(
    raw: dict[str, StateAnnouncement], target: int, alone_: bool, patient: bool, survivor: set[str]
) -> None:
    ranked = trusted_state(alone(raw))
    usable = usable_states(ranked, target=target, alone=alone_, patient=patient, survivor=survivor)
    assert usable == [r for r in ranked if r in usable]  # a sub-sequence: the order is trusted_state's
    for announcement, writers in usable:
        if not alone_:
            assert announcement.step <= target
            if patient:
                assert announcement.step == target and set(writers) & survivor
            else:
                assert set(writers) & survivor or announcement.backbone
