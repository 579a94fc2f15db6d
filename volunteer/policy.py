"""When a volunteer trains: the owner's rules for staying out of the way (issue 15, item 5; BOINC's
"computing preferences" are the bar).

**The rules** (all optional; none given: always train), from ``volunteer join``'s flags:

* ``--active-hours 22:00-07:00``: train only inside this local-time window; a window whose end is not
  after its start wraps midnight (``22:00-07:00`` is 22:00 to 07:00 the next morning); ``00:00-00:00`` is
  the whole day.
* ``--pause-while NAME`` (repeatable): pause while a program of that name runs (a game, a video editor that
  wants the GPU to itself). Names are compared as the kernel keeps them (``/proc/PID/comm``: at most 15
  characters), so a longer name matches its first 15 characters.
* ``--idle-only-after MINUTES``: train only once nobody has used the keyboard, mouse or a terminal for that
  long. Where the platform cannot tell (no input devices visible, another OS), the rule cannot be applied:
  the decision says so and training goes on (a rule that cannot be read never stops a volunteer silently).
* ``--max-other-cpu PERCENT``: pause while other programs use more than this share of all CPUs (this
  process's own use is subtracted, so training does not pause itself). Unknown: as above.

**The decision** (:func:`decide`, pure): the first rule that says "pause" wins, in the order above (the
owner's explicit schedule first, then the programs named, then idleness and load), and its reason is what
``volunteer status`` and the panel show. A running decision carries a reason too (which rules hold, or that
a rule cannot be read).

**Hysteresis** (:class:`Debounce`, pure): readings are noisy (a CPU spike, a key pressed once), and a pause
costs a round and a state sync on resume, so the applied state changes only after the raw decision has
disagreed with it for ``pause_after`` readings in a row (to pause) or ``resume_after`` readings (to resume;
longer: resuming is the expensive direction). The applied state therefore flips at most once per
``min(pause_after, resume_after)`` readings, whatever the readings do.

**Bandwidth caps** (``--max-upload MBPS``, ``--max-download MBPS``, in MB/s = 10^6 bytes/s like the
backbone's ``--aggregate-bandwidth``; :func:`bandwidth_caps`) are not rules that pause: they hold all of
the daemon's traffic to a rate at all times (one token bucket each way, shared by every connection:
:mod:`shared.net.ratelimit`), and the bandwidth the volunteer publishes at join is at most its caps, so the
load balancer gives it a share it can carry.

A manual ``volunteer pause`` is not a rule: it wins over every rule until ``volunteer resume``
(:mod:`volunteer.activity`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.errors import ConfigError

__all__ = [
    "COMM_LENGTH",
    "MAX_RATE_MBPS",
    "Debounce",
    "Decision",
    "Readings",
    "Rules",
    "Window",
    "bandwidth_caps",
    "decide",
    "parse_window",
    "rules_from_flags",
]

#: The largest bandwidth cap taken, MB/s (as the backbone's --aggregate-bandwidth).
MAX_RATE_MBPS = 1e7
#: The kernel keeps a program's name (``/proc/PID/comm``) to 15 characters.
COMM_LENGTH = 15
_WINDOW = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


@dataclass(frozen=True)
class Window:
    """A daily window of local time, in minutes after midnight; wraps midnight when ``end <= start``."""

    start: int
    end: int

    def contains(self, minute: int) -> bool:
        if self.start == self.end:
            return True
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end

    def __str__(self) -> str:
        return f"{self.start // 60:02d}:{self.start % 60:02d}-{self.end // 60:02d}:{self.end % 60:02d}"


def parse_window(text: str) -> Window:
    """``"22:00-07:00"`` as a :class:`Window`.

    Raises:
        ConfigError: not ``HH:MM-HH:MM`` with hours 0-23 and minutes 0-59 (24:00 as an end is 00:00).
    """
    match = _WINDOW.match(text)
    if match is None:
        raise ConfigError(f"--active-hours {text!r}: give a local-time window HH:MM-HH:MM, e.g. 22:00-07:00")
    h1, m1, h2, m2 = (int(g) for g in match.groups())
    if h2 == 24 and m2 == 0:
        h2 = 0
    if not (h1 < 24 and h2 < 24 and m1 < 60 and m2 < 60):
        raise ConfigError(f"--active-hours {text!r}: hours are 00-23 and minutes 00-59")
    return Window(h1 * 60 + m1, h2 * 60 + m2)


@dataclass(frozen=True)
class Rules:
    idle_after: float | None = None  # seconds without user input before training; None: no such rule
    max_other_cpu: float | None = None  # percent of all CPUs other programs may use; None: no such rule
    pause_while: tuple[str, ...] = ()  # program names
    active_hours: Window | None = None

    def __post_init__(self) -> None:
        if self.idle_after is not None and not self.idle_after >= 0:
            raise ConfigError(f"--idle-only-after must be 0 or more minutes, got {self.idle_after / 60:g}")
        if self.max_other_cpu is not None and not 0 <= self.max_other_cpu <= 100:
            raise ConfigError(f"--max-other-cpu must be 0 to 100 percent, got {self.max_other_cpu:g}")
        for name in self.pause_while:
            if not name.strip() or "/" in name:
                raise ConfigError(f"--pause-while {name!r}: give a program's name, e.g. steam (no path)")

    @property
    def empty(self) -> bool:
        return (
            self.idle_after is None
            and self.max_other_cpu is None
            and not self.pause_while
            and self.active_hours is None
        )

    @property
    def needs_idle(self) -> bool:
        return self.idle_after is not None

    @property
    def needs_cpu(self) -> bool:
        return self.max_other_cpu is not None

    @property
    def needs_programs(self) -> bool:
        return bool(self.pause_while)


@dataclass(frozen=True)
class Readings:
    """What the sources (:mod:`volunteer.sources`) saw; None: this platform cannot tell."""

    minute_of_day: int  # local time, minutes after midnight
    idle_seconds: float | None = None
    other_cpu: float | None = None  # percent of all CPUs used by other programs
    programs: frozenset[str] = field(default_factory=frozenset)  # running programs' names (comm)


@dataclass(frozen=True)
class Decision:
    run: bool
    reason: str


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def decide(readings: Readings, rules: Rules) -> Decision:
    """Train or pause, and why (module docstring)."""
    if rules.active_hours is not None and not rules.active_hours.contains(readings.minute_of_day):
        return Decision(False, f"outside the active hours {rules.active_hours}")
    running = {name[:COMM_LENGTH] for name in readings.programs}
    for name in rules.pause_while:
        if name[:COMM_LENGTH] in running:
            return Decision(False, f"{name} is running")
    notes: list[str] = []
    if rules.idle_after is not None:
        if readings.idle_seconds is None:
            notes.append("cannot tell whether the machine is idle here")
        elif readings.idle_seconds < rules.idle_after:
            return Decision(
                False,
                f"the machine is in use (input {_minutes(readings.idle_seconds)} ago; "
                f"training after {_minutes(rules.idle_after)} idle)",
            )
        else:
            notes.append(f"idle for {_minutes(readings.idle_seconds)}")
    if rules.max_other_cpu is not None:
        if readings.other_cpu is None:
            notes.append("cannot tell other programs' CPU use here")
        elif readings.other_cpu > rules.max_other_cpu:
            return Decision(
                False, f"other programs use {readings.other_cpu:.0f}% CPU (max {rules.max_other_cpu:g}%)"
            )
        else:
            notes.append(f"other programs use {readings.other_cpu:.0f}% CPU")
    if rules.empty:
        return Decision(True, "no rules: always training")
    return Decision(True, "; ".join(notes) if notes else "every rule allows training")


@dataclass
class Debounce:
    """The applied decision, changed only after ``pause_after`` / ``resume_after`` raw decisions in a row
    disagree with it (module docstring). The first reading applies at once: a volunteer started outside
    its active hours does not start training first."""

    pause_after: int = 2
    resume_after: int = 3
    applied: Decision | None = None
    _against: int = 0

    def __post_init__(self) -> None:
        if self.pause_after < 1 or self.resume_after < 1:
            raise ValueError("pause_after and resume_after must be at least 1")

    def update(self, raw: Decision) -> Decision:
        if self.applied is None or raw.run == self.applied.run:
            self._against = 0
            self.applied = raw  # same direction: take the fresher reason
            return self.applied
        self._against += 1
        needed = self.resume_after if raw.run else self.pause_after
        if self._against >= needed:
            self.applied, self._against = raw, 0
        return self.applied


def rules_from_flags(
    idle_only_after: float | None,
    max_other_cpu: float | None,
    pause_while: Sequence[str] | None,
    active_hours: str | None,
) -> Rules:
    """``volunteer join``'s flags as :class:`Rules` (minutes to seconds). Raises ConfigError."""
    return Rules(
        idle_after=None if idle_only_after is None else idle_only_after * 60,
        max_other_cpu=max_other_cpu,
        pause_while=tuple(pause_while or ()),
        active_hours=None if active_hours is None else parse_window(active_hours),
    )


def bandwidth_caps(max_upload: float | None, max_download: float | None) -> tuple[float | None, float | None]:
    """``--max-upload`` / ``--max-download`` (MB/s, None: no cap) as ``(upload, download)`` bytes/s.

    Raises:
        ConfigError: a cap that is not a number in (0, :data:`MAX_RATE_MBPS`] (0, negative, NaN, infinite).
    """
    caps: list[float | None] = []
    for flag, value in (("--max-upload", max_upload), ("--max-download", max_download)):
        if value is not None and not (math.isfinite(value) and 0 < value <= MAX_RATE_MBPS):
            raise ConfigError(
                f"{flag} {value:g}: give a rate above 0 in MB/s (10^6 bytes/s), at most {MAX_RATE_MBPS:g}"
            )
        caps.append(None if value is None else value * 1e6)
    return caps[0], caps[1]
