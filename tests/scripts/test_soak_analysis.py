"""The soak's figures (``scripts/soak.py``) from volunteers' step lines: which disagreements are a
re-syncing peer's discarded step and which are forks, what the surviving collaboration computed, and
whether the volunteers end in one collaboration."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak_script", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_script"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


soak = load()


def lines(name: str, steps: range, prints: str | list[str], samples: int = 10, start: float = 0.0) -> list:
    fps = [prints] * len(steps) if isinstance(prints, str) else prints
    return [
        soak.Line(name, s, fp, samples, 2, start + i)
        for i, (s, fp) in enumerate(zip(steps, fps, strict=True))
    ]


def test_steps_all_peers_agree_on_are_no_disagreement() -> None:
    everything = lines("a", range(1, 6), "x") + lines("b", range(1, 6), "x")
    assert soak.disagreements(everything) == ([], [])
    assert soak.computed_samples(everything) == 100


def test_one_stale_step_then_a_resync_is_a_discard_not_a_fork() -> None:
    a = lines("a", range(1, 6), ["a1", "a2", "a3", "a4", "a5"])
    b = lines("b", range(1, 6), ["a1", "a2", "a3", "a4", "a5"])
    c = lines("c", range(3, 6), ["stale", "a4", "a5"])  # restarted: one step on an old state, then synced
    assert soak.disagreements(a + b + c) == ([3], [])
    assert soak.computed_samples(a + b + c) == 120  # the stale step's samples are not the run's


def test_a_lone_fork_is_unexplained_and_its_samples_not_computed() -> None:
    a = lines("a", range(1, 8), [f"m{i}" for i in range(1, 8)])
    b = lines("b", range(1, 8), [f"m{i}" for i in range(1, 8)])
    lone = lines("c", range(2, 8), [f"f{i}" for i in range(2, 8)], samples=100)
    discarded, forks = soak.disagreements(a + b + lone)
    assert (discarded, forks) == ([], [2, 3, 4, 5, 6, 7])
    assert soak.computed_samples(a + b + lone) == 140


def test_the_end_is_one_collaboration_only_with_one_fingerprint_and_nobody_behind() -> None:
    together = {
        "a": lines("a", range(1, 4), ["1", "2", "3"]),
        "b": lines("b", range(1, 5), ["1", "2", "3", "4"]),
    }
    assert soak.final_agreement(together, ["a", "b"])["one_collaboration"]
    split = {"a": lines("a", range(1, 4), ["1", "2", "3"]), "b": lines("b", range(1, 4), ["1", "2", "x"])}
    assert soak.final_agreement(split, ["a", "b"])["why"] == "different parameters"
    behind = {
        "a": lines("a", range(1, 3), ["1", "2"]),
        "b": lines("b", range(1, 6), ["1", "2", "3", "4", "5"]),
    }
    assert soak.final_agreement(behind, ["a", "b"])["why"] == "a volunteer is behind"


def test_stall_waits_for_every_survivor_and_is_none_when_one_never_steps() -> None:
    survivors = {"a": lines("a", range(1, 4), "x", start=10.0), "b": lines("b", range(1, 4), "x", start=13.0)}
    assert soak.stall_after(9.5, survivors, until=100.0) == 3.5  # a at 10, b at 13
    assert soak.stall_after(12.5, survivors, until=12.9) is None


def test_a_step_lost_with_its_holders_and_taken_again_is_a_discard_not_a_fork() -> None:
    # v2 and v3 took step 19 and were killed together; restarted, they loaded 18 from v1, reported 19
    # discarded, and the three took 19 again: the first 19 is gone with its holders, not a fork
    v1 = lines("v1", range(17, 21), ["a17", "a18", "new19", "new20"], start=0)
    v2 = [
        *lines("v2", range(17, 20), ["a17", "a18", "old19"], start=0),
        *lines("v2", range(19, 21), ["new19", "new20"], start=10),
    ]
    v3 = [
        *lines("v3", range(17, 20), ["a17", "a18", "old19"], start=0),
        *lines("v3", range(19, 21), ["new19", "new20"], start=10),
    ]
    everything = [*v1, *v2, *v3]
    assert soak.disagreements(everything)[1] == [19]  # without the ledger's word: a fork
    kept, replaced = soak.superseded(everything, {"v2": [(19, 19)], "v3": [(19, 19)]})
    assert replaced == [19]
    assert soak.disagreements(kept) == ([], [])
    # a volunteer that did not report the step discarded keeps its line
    kept, _ = soak.superseded(everything, {"v2": [(19, 19)]})
    assert [(x.volunteer, x.fingerprint) for x in kept if x.fingerprint == "old19"] == [("v3", "old19")]


def test_a_minority_step_every_holder_reported_discarded_is_a_resync_not_a_fork() -> None:
    """The 600-s soak's split round: 106 completed for v1 and v5 (who went on to 107), v3 and v4 retried
    and took their own 106, then re-synced to 107 and reported 106 discarded."""
    v1 = lines("v1", range(105, 108), ["a105", "a106", "a107"], start=0)
    v5 = lines("v5", range(105, 108), ["a105", "a106", "a107"], start=0)
    v4 = [*lines("v4", range(105, 107), ["a105", "b106"], start=0), *lines("v4", [108], ["a108"], start=10)]
    v3 = lines("v3", range(105, 107), ["a105", "b106"], start=0)
    everything = [*v1, *v5, *v4, *v3]
    # a tie in holders: the majority is the greater sample count, equal here; either way one side is minority
    assert soak.disagreements(everything) == ([], [106])  # two holders, no ledger word: a fork
    minority = "b106" if soak.majority(everything)[106] == "a106" else "a106"
    holders = {x.volunteer for x in everything if x.fingerprint == minority}
    assert soak.disagreements(everything, {name: [(106, 106)] for name in holders}) == ([106], [])
    # one holder that did not report it keeps it a fork
    one = sorted(holders)[0]
    assert soak.disagreements(everything, {one: [(106, 106)]}) == ([], [106])


def test_lone_steps_lost_with_their_holder_and_reported_discarded_after_its_restart_are_no_fork() -> None:
    """The two-backbone soak under load: v3 took steps 1..5 alone and was killed with the only copy of
    step 5; the survivors went on from step 0 (shared.alone, rule (d)), and so did v3's next process,
    which reported its earlier 1..5 discarded (volunteer.collab.sync, "A restarted volunteer")."""
    v1 = lines("v1", range(1, 7), [f"n{i}" for i in range(1, 7)], start=10)
    v2 = lines("v2", range(1, 7), [f"n{i}" for i in range(1, 7)], start=10)
    v3 = [
        *lines("v3", range(1, 6), [f"lone{i}" for i in range(1, 6)], start=0),
        *lines("v3", range(1, 7), [f"n{i}" for i in range(1, 7)], start=10),
    ]
    everything = [*v1, *v2, *v3]
    assert soak.disagreements(everything) == ([], [1, 2, 3, 4, 5])  # unreported: a fork (streak 5)
    kept, replaced = soak.superseded(everything, {"v3": [(1, 5)]})
    assert replaced == [1, 2, 3, 4, 5]
    assert soak.disagreements(kept, {"v3": [(1, 5)]}) == ([], [])
