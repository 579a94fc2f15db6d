"""The policy's readings (volunteer.sources) from fake /dev and /proc trees, and once from the real ones."""

from __future__ import annotations

import os
from pathlib import Path

from volunteer.sources import CpuMeter, idle_seconds, running_programs

NOW = 1_800_000_000.0


def touch(path: Path, atime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    os.utime(path, (atime, atime))


def test_idle_is_the_newest_input_or_terminal_access(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    assert idle_seconds(dev, NOW) is None  # no device visible: cannot tell
    touch(dev / "input" / "event0", NOW - 900)
    touch(dev / "null", NOW - 1)  # not an input device: ignored
    assert idle_seconds(dev, NOW) == 900
    touch(dev / "pts" / "3", NOW - 120)  # someone typed in a terminal
    assert idle_seconds(dev, NOW) == 120
    touch(dev / "tty2", NOW - 30)
    assert idle_seconds(dev, NOW) == 30
    touch(dev / "input" / "mice", NOW + 5)  # clock skew never gives a negative idle time
    assert idle_seconds(dev, NOW) == 0


def test_running_programs_skips_what_it_cannot_read(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for pid, name in ((1, "systemd"), (42, "steam"), (77, "a-very-long-pro")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "comm").write_text(name + "\n")
    (proc / "99").mkdir()  # vanished between listing and reading: no comm
    (proc / "self").mkdir()
    (proc / "self" / "comm").write_text("not a pid\n")
    assert running_programs(proc) == {"systemd", "steam", "a-very-long-pro"}
    assert running_programs(tmp_path / "missing") == frozenset()


def write_stat(proc: Path, busy: int, idle: int, own: int, pid: int = 4242) -> None:
    """/proc/stat (user nice system idle iowait irq softirq steal) and /proc/PID/stat (utime, stime)."""
    proc.mkdir(exist_ok=True)
    user = busy // 2
    (proc / "stat").write_text(f"cpu  {user} 0 {busy - user} {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    (proc / str(pid)).mkdir(exist_ok=True)
    fields = ["S", "1", "1", "1", "0", "-1", "0", "0", "0", "0", "0", str(own // 2), str(own - own // 2)]
    (proc / str(pid) / "stat").write_text(f"{pid} (python (x) y) {' '.join(fields)} 20 0 1 0\n")


def test_other_cpu_subtracts_our_own_use(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    meter = CpuMeter(proc, pid=4242)
    write_stat(proc, busy=1000, idle=1000, own=500)
    assert meter.read() is None  # one reading: no interval yet
    write_stat(proc, busy=1600, idle=1400, own=900)  # 1000 jiffies: 600 busy, 400 of them ours
    assert meter.read() == 20.0
    write_stat(proc, busy=2600, idle=1400, own=1000)  # 1000 jiffies, all busy, 100 ours
    assert meter.read() == 90.0


def test_other_cpu_is_unknown_without_proc(tmp_path: Path) -> None:
    meter = CpuMeter(tmp_path / "none", pid=1)
    assert meter.read() is None and meter.read() is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "stat").write_text("garbage\n")
    assert CpuMeter(tmp_path / "bad", pid=1).read() is None


def test_the_real_proc_reads_sensibly() -> None:
    if not Path("/proc/stat").exists():
        return
    meter = CpuMeter()
    meter.read()
    sum(i * i for i in range(200_000))  # some CPU of our own
    other = meter.read()
    assert other is None or 0 <= other <= 100
    assert running_programs()  # this process at least
