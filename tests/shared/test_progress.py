"""The pure summary of the collaboration's progress records."""

from __future__ import annotations

import itertools

from hypothesis import example, given
from hypothesis import strategies as st

from protocols.training import Progress
from shared.progress import (
    MAX_SAMPLES_FACTOR,
    claimed_batch,
    held_for,
    micro_batch_budget,
    quotas,
    summarize,
)

NOW = 1_000_000.0
TARGET = 100


def progress(step: int, samples: int = 0, *, sps: float = 0.0, age: float = 0.0, **kw: object) -> Progress:
    return Progress(step=step, samples=samples, samples_per_second=sps, time=NOW - age, **kw)  # type: ignore[arg-type]


def view(records: dict[str, Progress], mine: Progress, anchored: bool = True):  # type: ignore[no-untyped-def]
    return summarize(records, "me", mine, now=NOW, target_batch=TARGET, anchored=anchored)


def test_samples_of_the_peers_at_the_step_add_up_to_ready() -> None:
    records = {"a": progress(3, 40), "b": progress(3, 30), "c": progress(2, 90)}
    assert not view(records, progress(3, 20)).ready
    assert view(records, progress(3, 30)).ready
    summary = view(records, progress(3, 30))
    assert (summary.step, summary.samples, summary.peers, summary.peers_at_step) == (3, 100, 4, 3)


def test_records_are_extrapolated_by_their_throughput_for_a_few_seconds_only() -> None:
    assert view({"a": progress(0, 10, sps=20.0, age=2.0)}, progress(0)).samples == 50
    assert view({"a": progress(0, 10, sps=20.0, age=20.0)}, progress(0)).samples == 10 + 20 * 3


def test_a_peer_that_entered_averaging_makes_its_step_ready() -> None:
    assert view({"a": progress(5, 1, ready=True)}, progress(5)).ready
    assert not view({"a": progress(4, 1, ready=True)}, progress(5)).ready
    assert not view({"a": progress(5, 0, ready=True)}, progress(5)).ready  # nothing to average


def test_peers_that_left_are_not_counted() -> None:
    summary = view({"a": progress(3, 90, left=True), "b": progress(3, 5)}, progress(3, 5))
    assert (summary.peers, summary.samples, summary.ignored) == (2, 10, ())


def test_stale_and_greedy_records_are_ignored() -> None:
    records = {"old": progress(0, 50, age=3600), "greedy": progress(0, MAX_SAMPLES_FACTOR * TARGET + 1)}
    summary = view(records, progress(0, 1))
    assert set(summary.ignored) == {"old", "greedy"}
    assert summary.samples == 1


def test_an_unsupported_step_claim_is_ignored_but_a_lone_peer_is_believed_by_a_newcomer() -> None:
    liar = {"liar": progress(10**6), "a": progress(7), "b": progress(7)}
    assert view(liar, progress(7)).step == 7
    assert "liar" in view(liar, progress(0), anchored=False).ignored
    assert view({"a": progress(40)}, progress(0), anchored=False).step == 40  # a run resumed by one peer
    assert view({"a": progress(8)}, progress(7)).step == 8  # one step ahead: it just stepped


def test_divergence_is_decided_by_the_majority_of_fingerprints() -> None:
    records = {"a": progress(2, params=b"x" * 8), "b": progress(2, params=b"x" * 8)}
    assert view(records, progress(2, params=b"y" * 8)).diverged
    assert not view(records, progress(2, params=b"x" * 8)).diverged
    tie = {"a": progress(2, params=b"b" * 8)}
    assert view(tie, progress(2, params=b"c" * 8)).diverged  # ties: the smaller fingerprint wins
    assert not view(tie, progress(2, params=b"a" * 8)).diverged


def test_divergence_counts_distinct_users_not_peer_ids() -> None:
    """Finding 8: one user's made-up peer ids cannot outvote honest users' fingerprints."""
    sybils = {f"m{i}": progress(2, params=b"z" * 8) for i in range(4)}
    records = {**sybils, "a": progress(2, params=b"x" * 8), "b": progress(2, params=b"x" * 8)}
    users = {**dict.fromkeys(sybils, "mallory"), "a": "alice", "b": "bob", "me": "carol"}
    mine = progress(2, params=b"x" * 8)
    assert view(records, mine).diverged  # counted in peer ids, the sybils win 4 to 3
    assert not summarize(records, "me", mine, now=NOW, target_batch=TARGET, users=users).diverged
    # one user's several honest devices still cast one vote: two users outvote a user with two devices
    two_devices = {"a1": progress(2, params=b"y" * 8), "a2": progress(2, params=b"y" * 8)}
    two_devices |= {"b": progress(2, params=b"x" * 8)}
    users = {"a1": "alice", "a2": "alice", "b": "bob", "me": "carol"}
    assert not summarize(two_devices, "me", mine, now=NOW, target_batch=TARGET, users=users).diverged


def test_a_step_claim_needs_support_from_another_user() -> None:
    records = {"m1": progress(10**6), "m2": progress(10**6 - 1), "a": progress(7)}
    assert view(records, progress(7)).step == 10**6  # two peer ids back each other up
    users = {"m1": "mallory", "m2": "mallory", "a": "alice"}
    for anchored in (True, False):
        got = summarize(
            records, "me", progress(7), now=NOW, target_batch=TARGET, anchored=anchored, users=users
        )
        assert got.step == 7
        assert {"m1", "m2"} <= set(got.ignored)


@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "c", "d", "e"]),
        st.tuples(st.integers(0, 20), st.integers(0, 10 * TARGET), st.floats(0, 100), st.booleans()),
        max_size=5,
    ),
    st.integers(0, 20),
    st.integers(0, TARGET),
)
# found by hypothesis: nobody could continue a collaboration, and the newest claim was a downloading peer's
@example(
    raw={"a": (0, 0, 0.0, False), "b": (0, 0, 0.0, False), "e": (18, 0, 0.0, True)}, my_step=17, my_samples=0
)
def test_view_invariants(raw: dict[str, tuple[int, int, float, bool]], my_step: int, my_samples: int) -> None:
    records = {
        peer: progress(step, samples, sps=sps, syncing=syncing)
        for peer, (step, samples, sps, syncing) in raw.items()
    }
    summary = view(records, progress(my_step, my_samples))
    assert summary.step >= my_step or summary.minority  # only the minority is told to go back
    assert 1 <= summary.peers <= len(records) + 1
    assert summary.peers_at_step <= summary.peers
    assert 0 <= summary.samples <= MAX_SAMPLES_FACTOR * TARGET
    assert set(summary.ignored) <= set(records)
    # the collaboration's step is a step some non-syncing credible peer (or we) hold: syncing peers
    # never lead; when those steps form one chain (one collaboration) it is the highest, as it always was
    members = sorted(
        [my_step] + [records[p].step for p in records if p not in summary.ignored and not records[p].syncing]
    )
    assert summary.step in members
    if all(b - a <= 1 for a, b in itertools.pairwise(members)):
        assert (summary.step, summary.minority, summary.collaborations) == (members[-1], False, 1)
    # No credible claim is more than one step ahead of every other peer's claim.
    for peer in records:
        if peer not in summary.ignored:
            others = [my_step] + [records[q].step for q in records if q != peer]
            assert any(s >= records[peer].step - 1 for s in others)


def test_entered_is_set_once_a_peer_at_the_step_averages() -> None:
    assert view({"a": progress(5, 10, ready=True), "b": progress(5, 10)}, progress(5)).entered
    assert not view({"b": progress(5, 10)}, progress(5)).entered


def test_a_round_is_held_for_a_syncing_peer_until_its_grace_runs_out() -> None:
    since: dict[str, float] = {}
    assert held_for(("d",), since, 0.0, grace=10, window=60) == ("d",)
    assert held_for(("d",), since, 9.9, grace=10, window=60) == ("d",)
    assert held_for(("d",), since, 10.0, grace=10, window=60) == ()
    assert held_for(("d",), since, 59.0, grace=10, window=60) == ()  # used up in this window
    assert held_for(("d",), since, 60.0, grace=10, window=60) == ("d",)  # a new window
    assert held_for((), since, 200.0, grace=10, window=60) == () and since == {}


@given(
    st.lists(
        st.tuples(st.floats(0, 5, allow_nan=False), st.sets(st.sampled_from("abc"), max_size=3)), max_size=80
    ),
    st.floats(0.5, 20),
    st.floats(1, 100),
)
def test_a_peer_holds_rounds_at_most_its_grace_per_window(
    events: list[tuple[float, set[str]]], grace: float, window: float
) -> None:
    since: dict[str, float] = {}
    now = 0.0
    starts: dict[str, list[float]] = {}
    for step, syncing in events:
        now += step
        for peer in held_for(tuple(sorted(syncing)), since, now, grace=grace, window=window):
            start = since[peer]
            assert now - start < grace  # held only within the grace of its window's start
            if not starts.get(peer) or starts[peer][-1] != start:
                starts.setdefault(peer, []).append(start)
        assert len(since) <= 3
    for windows in starts.values():  # windows of holding start at least ``window`` apart
        assert all(b - a >= window for a, b in itertools.pairwise(windows))


# ---------------------------------------------------------------------------------- batch accounting

rates = st.dictionaries(
    st.text(alphabet="abcdefgh", min_size=1, max_size=4),
    st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=1e6)),
    min_size=1,
    max_size=12,
)


@given(rates, st.integers(min_value=0, max_value=100_000))
def test_quotas_split_the_target_batch_exactly_in_proportion_to_throughput(
    given_rates: dict[str, float], target: int
) -> None:
    shares = quotas(given_rates, target)
    assert set(shares) == set(given_rates)
    assert all(q >= 0 for q in shares.values())
    assert sum(shares.values()) == target  # the step's batch: exactly the target, never more
    total = sum(given_rates.values())
    for peer, rate in given_rates.items():
        exact = rate / total * target if total > 0 else target / len(given_rates)
        assert abs(shares[peer] - exact) < 1 + 1e-6  # largest remainder: within one sample
    assert quotas(dict(reversed(list(given_rates.items()))), target) == shares  # same on every member


def test_quotas_give_peers_that_do_not_compute_nothing() -> None:
    assert quotas({"gpu": 300.0, "cpu": 0.0, "other": 100.0}, 128) == {"gpu": 96, "cpu": 0, "other": 32}
    assert quotas({"a": 0.0, "b": 0.0}, 5) == {"a": 3, "b": 2}  # nobody measured yet: equal shares


@given(st.integers(0, 1000), st.integers(0, 1000), st.integers(1, 64))
def test_a_micro_batch_never_carries_us_past_our_share(samples: int, limit: int, local_batch: int) -> None:
    budget = micro_batch_budget(samples, limit, local_batch)
    assert 0 <= budget <= local_batch
    assert samples + budget <= max(limit, samples)
    if samples < limit:
        assert budget == min(local_batch, limit - samples)  # a share is filled exactly, not undershot


def test_the_batch_of_a_step_is_what_most_users_at_it_claim() -> None:
    users = {"a1": "alice", "a2": "alice", "a3": "alice", "b": "bob", "c": "carol"}
    records = {
        "a1": progress(5, batch=999),  # one user's many peers vote once
        "a2": progress(5, batch=999),
        "a3": progress(5, batch=999),
        "b": progress(5, batch=128),
        "c": progress(5, batch=128),
        "late": progress(4, batch=77),  # another step's claim
        "greedy": progress(5, batch=MAX_SAMPLES_FACTOR * TARGET + 1),  # more than any honest group holds
    }
    assert claimed_batch(records, 5, TARGET, users) == 128
    assert claimed_batch(records, 4, TARGET, users) == 77
    assert claimed_batch({"x": progress(5, batch=0)}, 5, TARGET) is None  # a loaded state claims nothing
    # a tie goes to the claim closest to the target: one stranger claiming a tiny batch does not
    # outvote a lone honest volunteer (review of issue 11)
    assert claimed_batch({"x": progress(5, batch=100), "y": progress(5, batch=3)}, 5, TARGET) == 100
    assert claimed_batch({"x": progress(5, batch=90), "y": progress(5, batch=110)}, 5, TARGET) == 90
    # records of peers that left, or too old to believe, vote for nothing
    assert claimed_batch({"x": progress(5, batch=50, left=True)}, 5, TARGET) is None
    stale = {"x": progress(5, batch=50, age=10_000.0)}
    assert claimed_batch(stale, 5, TARGET) == 50
    assert claimed_batch(stale, 5, TARGET, now=NOW) is None


def test_the_planned_round_is_what_most_users_at_the_step_publish() -> None:
    users = {"a1": "alice", "a2": "alice", "a3": "alice", "b": "bob", "c": "carol"}

    def voted(records: dict[str, Progress], mine: Progress | None = None) -> int | None:
        ours = mine or progress(5)
        return summarize(records, "me", ours, now=NOW, target_batch=TARGET, users=users, min_target=10).target

    records = {
        "a1": progress(5, target=99),  # one user's many peers vote once
        "a2": progress(5, target=99),
        "a3": progress(5, target=99),
        "b": progress(5, target=40),
        "c": progress(5, target=40),
        "late": progress(4, target=77),  # another step's plan
        "long": progress(5, target=TARGET + 1),  # above the longest round: not counted
        "short": progress(5, target=9),  # below the shortest: not counted
    }
    assert voted(records) == 40
    # a tie goes to the longer round (a longer target never cuts the others' round short); our own vote
    # counts like anyone's; nobody at the step planning anything: None
    assert voted({"b": progress(5, target=40), "c": progress(5, target=60)}) == 60
    assert voted({"b": progress(5, target=40)}, progress(5, target=60)) == 60
    assert voted({"b": progress(5), "late": progress(4, target=50)}) is None
    assert voted({"b": progress(5, target=50, left=True)}) is None
