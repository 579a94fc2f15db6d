"""The resource policy's pure core (volunteer.policy): windows, the decision's order and reasons, and the
debounce's bound on flapping."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.errors import ConfigError
from volunteer.policy import (
    Debounce,
    Decision,
    Readings,
    Rules,
    Window,
    bandwidth_caps,
    decide,
    parse_window,
    rules_from_flags,
)

minutes = st.integers(0, 24 * 60 - 1)


def test_parse_window() -> None:
    assert parse_window("22:00-07:00") == Window(22 * 60, 7 * 60)
    assert parse_window(" 9:30 - 17:45 ") == Window(9 * 60 + 30, 17 * 60 + 45)
    assert parse_window("08:00-24:00") == Window(8 * 60, 0)
    for bad in ("22-07", "25:00-07:00", "10:60-11:00", "", "22:00"):
        with pytest.raises(ConfigError, match="--active-hours"):
            parse_window(bad)


@given(minutes, minutes, minutes)
def test_a_window_wraps_midnight_exactly_when_its_end_is_not_after_its_start(
    start: int, end: int, minute: int
) -> None:
    window = Window(start, end)
    inside = window.contains(minute)
    if start == end:
        assert inside
    elif start < end:
        assert inside == (start <= minute < end)
    else:  # wraps: the complement of [end, start)
        assert inside == (not end <= minute < start)
    assert parse_window(str(window)) == window


def test_no_rules_always_train() -> None:
    decision = decide(Readings(minute_of_day=0, idle_seconds=0, other_cpu=100), Rules())
    assert decision == Decision(True, "no rules: always training")


def test_each_rule_pauses_with_its_reason() -> None:
    night = Rules(active_hours=parse_window("22:00-07:00"))
    assert decide(Readings(minute_of_day=23 * 60), night).run
    noon = decide(Readings(minute_of_day=12 * 60), night)
    assert not noon.run and noon.reason == "outside the active hours 22:00-07:00"

    game = Rules(pause_while=("steam",))
    assert not decide(Readings(0, programs=frozenset({"bash", "steam"})), game).run
    assert decide(Readings(0, programs=frozenset({"bash", "steamwebhelper"})), game).run
    long_name = Rules(pause_while=("a-very-long-program-name",))  # the kernel keeps 15 characters
    assert not decide(Readings(0, programs=frozenset({"a-very-long-pro"})), long_name).run

    idle = Rules(idle_after=600)
    busy = decide(Readings(0, idle_seconds=30), idle)
    assert not busy.run and "in use" in busy.reason and "30 s ago" in busy.reason
    assert decide(Readings(0, idle_seconds=601), idle).run

    cpu = Rules(max_other_cpu=25)
    loaded = decide(Readings(0, other_cpu=63.4), cpu)
    assert not loaded.run and loaded.reason == "other programs use 63% CPU (max 25%)"
    assert decide(Readings(0, other_cpu=25), cpu).run


def test_what_cannot_be_read_never_pauses_and_says_so() -> None:
    rules = Rules(idle_after=60, max_other_cpu=10)
    decision = decide(Readings(0, idle_seconds=None, other_cpu=None), rules)
    assert decision.run
    assert "cannot tell whether the machine is idle" in decision.reason
    assert "cannot tell other programs' CPU" in decision.reason


readings = st.builds(
    Readings,
    minute_of_day=minutes,
    idle_seconds=st.none() | st.floats(0, 1e5),
    other_cpu=st.none() | st.floats(0, 100),
    programs=st.frozensets(st.sampled_from(["steam", "blender", "bash", "python3"])),
)
rules = st.builds(
    Rules,
    idle_after=st.none() | st.floats(0, 1e4),
    max_other_cpu=st.none() | st.floats(0, 100),
    pause_while=st.lists(st.sampled_from(["steam", "blender"]), max_size=2).map(tuple),
    active_hours=st.none() | st.builds(Window, minutes, minutes),
)


@given(readings, rules)
def test_the_decision_pauses_iff_some_readable_rule_is_violated(r: Readings, rule: Rules) -> None:
    violated = (
        (rule.active_hours is not None and not rule.active_hours.contains(r.minute_of_day))
        or bool(set(rule.pause_while) & r.programs)
        or (rule.idle_after is not None and r.idle_seconds is not None and r.idle_seconds < rule.idle_after)
        or (rule.max_other_cpu is not None and r.other_cpu is not None and r.other_cpu > rule.max_other_cpu)
    )
    decision = decide(r, rule)
    assert decision.run == (not violated)
    assert decision.reason


def test_rules_from_flags_and_their_errors() -> None:
    rules = rules_from_flags(10, 30, ["steam"], "22:00-07:00")
    assert rules == Rules(600, 30, ("steam",), Window(22 * 60, 7 * 60))
    assert rules_from_flags(None, None, None, None).empty
    with pytest.raises(ConfigError, match="--max-other-cpu"):
        rules_from_flags(None, 120, None, None)
    with pytest.raises(ConfigError, match="--idle-only-after"):
        rules_from_flags(-1, None, None, None)
    with pytest.raises(ConfigError, match="--pause-while"):
        rules_from_flags(None, None, ["/usr/bin/steam"], None)


def test_debounce_waits_for_agreeing_readings() -> None:
    debounce = Debounce(pause_after=2, resume_after=3)
    run, stop = Decision(True, "idle"), Decision(False, "busy")
    assert debounce.update(run) == run  # the first reading applies at once
    assert debounce.update(stop).run  # one reading is a spike
    assert debounce.update(run).run
    assert debounce.update(stop).run
    assert not debounce.update(stop).run  # two in a row: pause
    assert not debounce.update(run).run
    assert not debounce.update(run).run
    applied = debounce.update(run)
    assert applied == run  # three in a row: resume


@given(st.lists(st.booleans(), max_size=200), st.integers(1, 5), st.integers(1, 5))
def test_debounce_flips_at_most_once_per_hold(raw: list[bool], pause_after: int, resume_after: int) -> None:
    debounce = Debounce(pause_after, resume_after)
    applied = [debounce.update(Decision(r, "r" if r else "p")).run for r in raw]
    assert not raw or applied[0] == raw[0]  # the first reading applies at once
    flips = [i for i in range(1, len(applied)) if applied[i] != applied[i - 1]]
    hold = min(pause_after, resume_after)
    assert all(b - a >= hold for a, b in itertools.pairwise(flips))
    # and every flip follows enough raw decisions in a row that agree with it
    for i in flips:
        needed = resume_after if applied[i] else pause_after
        assert i + 1 >= needed and all(r == applied[i] for r in raw[i + 1 - needed : i + 1])


def test_bandwidth_caps_are_mb_per_second_and_refuse_what_is_no_rate() -> None:
    assert bandwidth_caps(None, None) == (None, None)
    assert bandwidth_caps(2.5, None) == (2.5e6, None)
    assert bandwidth_caps(None, 0.125) == (None, 125_000.0)
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e8):
        with pytest.raises(ConfigError, match="--max-upload"):
            bandwidth_caps(bad, 1.0)
        with pytest.raises(ConfigError, match="--max-download"):
            bandwidth_caps(1.0, bad)


def test_the_bandwidth_caps_are_config_keys_and_environment_variables(tmp_path: Path) -> None:
    from tests.volunteer.test_config import parsed, write

    write(tmp_path, "max-upload = 2\nmax-download = 8.5\n")
    params = parsed(["--data-dir", str(tmp_path)], {"VOLUNTEER_MAX_UPLOAD": "1.5"})
    assert params["max_upload"] == 1.5 and params["max_download"] == 8.5


def test_the_policy_flags_are_config_keys(tmp_path: Path) -> None:
    from tests.volunteer.test_config import parsed, write

    write(
        tmp_path,
        'idle-only-after = 10\nmax-other-cpu = 25\npause-while = ["steam", "blender"]\n'
        'active-hours = "22:00-07:00"\ngpu-memory-fraction = 0.5\n',
    )
    params = parsed(["--data-dir", str(tmp_path)], {"VOLUNTEER_MAX_OTHER_CPU": "40"})
    assert params["idle_only_after"] == 10 and params["max_other_cpu"] == 40
    assert list(params["pause_while"]) == ["steam", "blender"]
    assert params["active_hours"] == "22:00-07:00" and params["gpu_memory_fraction"] == 0.5


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--active-hours", "25:00-07:00"], "--active-hours '25:00-07:00': hours are 00-23"),
        (["--max-other-cpu", "150"], "--max-other-cpu must be 0 to 100 percent"),
        (["--gpu-memory-fraction", "0"], "--gpu-memory-fraction 0: give a share above 0"),
        (["--max-upload", "0"], "--max-upload 0: give a rate above 0 in MB/s"),
        (["--max-download", "-2"], "--max-download -2: give a rate above 0 in MB/s"),
        (["--max-upload", "nan"], "--max-upload nan: give a rate above 0"),
        (["--max-download", "inf"], "--max-download inf: give a rate above 0"),
    ],
)
def test_bad_policy_flags_are_one_line_and_exit_2(tmp_path: Path, flags: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "volunteer", "join", "my-run", "--data-dir", str(tmp_path), *flags],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
