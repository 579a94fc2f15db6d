"""Where the resource policy's readings come from (:mod:`volunteer.policy`), each reading a directory tree
that tests replace with a fake one.

* **Idleness** (:func:`idle_seconds`): the newest access time of the terminals (``/dev/tty*``,
  ``/dev/pts/*``: Linux's tty layer stamps a terminal's access time when a program reads what was typed,
  ssh sessions included) and of the input devices (``/dev/input/event*``, ``/dev/input/mice``: where the
  kernel stamps those; a desktop whose input never touches them counts as idle unless a terminal is used).
  None (cannot tell) when none of them is visible, e.g. in a container without /dev/pts, on macOS or
  Windows. What it cannot see is input that never reaches this machine's devices (remote desktops).
* **Other programs' CPU** (:class:`CpuMeter`): between two readings, the share of all CPUs' time spent busy
  (``/proc/stat``'s first line: everything but idle and iowait) minus the time this process used
  (``/proc/PID/stat``'s utime and stime, every thread of it), as a percent of all CPUs. None before the
  second reading or without ``/proc``.
* **Running programs** (:func:`running_programs`): the names in ``/proc/*/comm``. Processes that vanish
  or cannot be read while scanning are skipped. Empty without ``/proc`` (nothing to pause for).

Every reader is cheap (a directory listing, a few small files) and runs in a worker thread every few
seconds (:mod:`volunteer.activity`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CpuMeter", "Sources", "idle_seconds", "running_programs"]

_INPUT_GLOBS = (("input", "event*"), ("input", "mice"), ("", "tty*"), ("pts", "[0-9]*"))


def idle_seconds(dev: Path = Path("/dev"), now: float | None = None) -> float | None:
    """Seconds since the newest access of an input device or terminal under ``dev``; None: none found."""
    newest: float | None = None
    for sub, pattern in _INPUT_GLOBS:
        base = dev / sub if sub else dev
        try:
            candidates = list(base.glob(pattern))
        except OSError:
            continue
        for path in candidates:
            try:
                atime = path.stat().st_atime
            except OSError:
                continue
            newest = atime if newest is None else max(newest, atime)
    if newest is None:
        return None
    return max(0.0, (time.time() if now is None else now) - newest)


def running_programs(proc: Path = Path("/proc")) -> frozenset[str]:
    """The names (``comm``) of the processes under ``proc``; empty when it cannot be read."""
    names: set[str] = set()
    try:
        entries = list(os.scandir(proc))
    except OSError:
        return frozenset()
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "comm"), encoding="utf-8", errors="replace") as f:
                name = f.read(64).strip()
        except OSError:
            continue
        if name:
            names.add(name)
    return frozenset(names)


def _cpu_totals(proc: Path) -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from ``proc/stat``."""
    try:
        with open(proc / "stat", encoding="ascii", errors="replace") as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    try:
        values = [int(v) for v in first[1:]]
    except ValueError:
        return None
    if len(values) < 4:
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user and nice]
    counted = values[:8]
    idle = counted[3] + (counted[4] if len(counted) > 4 else 0)
    total = sum(counted)
    return total - idle, total


def _own_jiffies(proc: Path, pid: int) -> int | None:
    """utime + stime of process ``pid`` (all its threads) from ``proc/PID/stat``."""
    try:
        text = (proc / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # the name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return int(fields[11]) + int(fields[12])  # fields 14 and 15 of the whole line
    except (IndexError, ValueError):
        return None


@dataclass
class CpuMeter:
    """Other programs' CPU use between consecutive :meth:`read` calls (module docstring)."""

    proc: Path = Path("/proc")
    pid: int = field(default_factory=os.getpid)
    _last: tuple[int, int, int] | None = None

    def read(self) -> float | None:
        totals = _cpu_totals(self.proc)
        own = _own_jiffies(self.proc, self.pid)
        if totals is None or own is None:
            self._last = None
            return None
        busy, total = totals
        last, self._last = self._last, (busy, total, own)
        if last is None or total <= last[1]:
            return None
        others = (busy - last[0]) - (own - last[2])
        return min(100.0, max(0.0, 100.0 * others / (total - last[1])))


@dataclass
class Sources:
    """The readers the watcher uses; tests give fake trees."""

    dev: Path = Path("/dev")
    proc: Path = Path("/proc")
    cpu: CpuMeter | None = None

    def __post_init__(self) -> None:
        if self.cpu is None:
            self.cpu = CpuMeter(self.proc)
