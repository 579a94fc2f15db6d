"""Stochastic wiring (shared.swarm.wiring): shares follow throughput, bans hold until re-announcement,
busy servers are deferred, bad times are refused, and the router is deterministic."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.swarm.wiring import NoServer, Pick, StageRouter, Wait, WiringConfig

times = st.lists(st.floats(1e-3, 10.0), min_size=1, max_size=8)


def measured_router(seconds: list[float]) -> StageRouter:
    """A router whose servers ``s0, s1, …`` each answered once in the given time (the EMA's first
    sample sets it exactly)."""
    router = StageRouter()
    router.announce({f"s{i}": 0.0 for i in range(len(seconds))})
    for i, t in enumerate(seconds):
        router.observe(f"s{i}", t)
    return router


def pick(router: StageRouter, now: float = 0.0) -> str:
    choice = router.choose(now)
    assert isinstance(choice, Pick), choice
    return choice.server


@settings(max_examples=60, deadline=None)
@given(times, st.integers(1, 400))
def test_wiring_share_converges_to_throughput_weight(seconds: list[float], n: int) -> None:
    router = measured_router(seconds)
    counts = Counter(pick(router) for _ in range(n))
    inverse = [1.0 / t for t in seconds]
    slowest = max(seconds)
    for i, t in enumerate(seconds):
        weight = inverse[i] / math.fsum(inverse)
        # the IWRR bound of the module docstring: |c_j - n w_j| <= e_max / e_j
        assert abs(counts[f"s{i}"] - n * weight) <= slowest / t + 1e-6
    shares = router.statistics().weights
    assert sum(shares.values()) == pytest.approx(1.0)


def test_wiring_twice_as_fast_server_gets_twice_the_micro_batches() -> None:
    router = measured_router([0.5, 1.0])  # the paper's example (§3.2): A takes half as long as B
    counts = Counter(pick(router) for _ in range(300))
    assert counts == {"s0": 200, "s1": 100}


@settings(max_examples=60, deadline=None)
@given(times, st.lists(st.tuples(st.sampled_from(["pick", "fail", "busy", "announce"]), st.integers(0, 7))))
def test_wiring_never_picks_a_banned_server(seconds: list[float], ops: list[tuple[str, int]]) -> None:
    router = measured_router(seconds)
    names = [f"s{i}" for i in range(len(seconds))]
    announced = dict.fromkeys(names, 0.0)
    banned: set[str] = set()
    now = 0.0
    for op, k in ops:
        name = names[k % len(names)]
        now += 0.25
        if op == "fail":
            router.fail(name)
            banned.add(name)
        elif op == "busy":
            router.busy(name, now=now, retry_after=0.5)
        elif op == "announce":
            announced[name] = now  # a fresh announcement lifts that server's ban
            router.announce(announced)
            banned.discard(name)
        else:
            choice = router.choose(now)
            if isinstance(choice, Pick):
                assert choice.server not in banned
            elif isinstance(choice, NoServer):
                assert banned == set(names)
            else:
                assert choice.until > now
        assert router.statistics().banned == banned


def test_wiring_ban_survives_a_repeat_of_the_same_announcement() -> None:
    router = measured_router([1.0, 1.0])
    router.fail("s0")
    router.announce({"s0": 0.0, "s1": 0.0})  # the same record, still listed in the DHT
    assert {pick(router) for _ in range(10)} == {"s1"}
    router.announce({"s0": 5.0, "s1": 0.0})  # s0 re-announced itself
    assert "s0" in {pick(router) for _ in range(10)}


def test_wiring_no_server_when_none_is_announced_or_all_are_banned() -> None:
    router = StageRouter()
    assert router.choose(0.0) == NoServer()
    router.announce({"a": 1.0})
    router.fail("a")
    assert router.choose(0.0) == NoServer()
    router.announce({})  # the record expired: forgotten
    assert router.statistics().seconds == {}
    # an answer that arrives after its server was forgotten is ignored, not an error
    assert not router.observe("a", 1.0)
    assert not router.fail("a")
    assert not router.busy("a", now=0.0, retry_after=1.0)


def test_wiring_busy_server_is_skipped_until_its_retry_hint_without_a_ban() -> None:
    router = measured_router([0.1, 1.0])
    router.busy("s0", now=0.0, retry_after=2.0)
    assert {pick(router, now) for now in (0.0, 0.5, 1.0, 1.5)} == {"s1"}
    router.busy("s1", now=1.5, retry_after=10.0)
    assert router.choose(1.6) == Wait(until=2.0)
    assert pick(router, 2.0) == "s0"
    assert router.statistics().banned == frozenset()


def test_wiring_busy_hint_is_clamped() -> None:
    router = StageRouter(WiringConfig(max_retry_seconds=5.0))
    router.announce({"a": 0.0})
    router.busy("a", now=0.0, retry_after=1e9)
    assert router.choose(1.0) == Wait(until=5.0)
    router.busy("a", now=6.0, retry_after=-3.0)  # a negative hint means "now"
    assert pick(router, 6.0) == "a"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0])
def test_wiring_refuses_times_that_are_not_finite_and_non_negative(bad: float) -> None:
    router = measured_router([1.0])
    with pytest.raises(ValueError, match="response time"):
        router.observe("s0", bad)
    assert router.statistics().seconds == {"s0": 1.0}


def test_wiring_zero_time_is_raised_to_the_floor_and_weights_stay_finite() -> None:
    router = measured_router([0.0, 1.0])
    stats = router.statistics()
    assert stats.seconds["s0"] == WiringConfig().min_seconds
    assert all(math.isfinite(w) for w in stats.weights.values())
    assert Counter(pick(router) for _ in range(1000))["s0"] >= 999


def test_wiring_ema_smooths_after_the_first_answer() -> None:
    router = measured_router([1.0])
    router.observe("s0", 2.0)
    assert router.statistics().seconds["s0"] == pytest.approx(0.1 * 2.0 + 0.9 * 1.0)


def test_wiring_unmeasured_server_is_charged_the_median_of_the_measured_ones() -> None:
    router = measured_router([1.0, 3.0, 5.0])
    router.announce({"s0": 0.0, "s1": 0.0, "s2": 0.0, "new": 0.0})
    assert router.statistics().weights["new"] == pytest.approx((1 / 3) / (1 + 1 / 3 + 1 / 3 + 1 / 5))


def test_wiring_late_newcomer_starts_at_the_virtual_time_and_does_not_take_every_micro_batch() -> None:
    router = measured_router([1.0, 1.0])
    for _ in range(1000):
        pick(router)
    router.announce({"s0": 0.0, "s1": 0.0, "late": 0.0})
    counts = Counter(pick(router) for _ in range(30))
    assert counts == {"s0": 10, "s1": 10, "late": 10}


@settings(max_examples=30, deadline=None)
@given(times, st.lists(st.tuples(st.integers(0, 7), st.floats(0.0, 5.0)), max_size=40), st.randoms())
def test_wiring_is_deterministic_given_its_calls(
    seconds: list[float], answers: list[tuple[int, float]], rng: object
) -> None:
    def run(order: list[int]) -> list[str]:
        router = StageRouter()
        router.announce({f"s{i}": 0.0 for i in order})  # the mapping's order does not matter
        picks = []
        for k, t in answers:
            picks.append(pick(router))
            router.observe(f"s{k % len(seconds)}", t)
        return picks

    order = list(range(len(seconds)))
    shuffled = order[:]
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    assert run(order) == run(shuffled)


def test_wiring_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="smoothing"):
        WiringConfig(smoothing=0.0)
    with pytest.raises(ValueError, match="min_seconds"):
        WiringConfig(min_seconds=math.nan)
    router = StageRouter()
    with pytest.raises(ValueError, match="finite"):
        router.announce({"a": math.inf})
    with pytest.raises(ValueError, match="finite"):
        router.choose(math.nan)
