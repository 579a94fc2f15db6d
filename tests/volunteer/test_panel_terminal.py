"""The volunteer's live panel on a real pseudo-terminal (issue 11: in tmux 160x48 old copies of it piled up
in the scrollback and log lines printed under it).

A child process (tests/volunteer/panel_child.py) shows the panel on a pty of a set size while log lines
arrive from several threads; a terminal emulator (pyte) replays everything it wrote, scrollback included.
After many redraws the screen and the scrollback hold exactly one panel, at the bottom, with every log
line above it, once and in order. A Ctrl+C typed on the terminal (the terminal echoes it) leaves the last
frame whole, the cursor shown and the keyboard echoing again.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pyte
import pytest

LINES = 40
HEADER = "volunteer ·"
LOG_LINE = re.compile(r"line (\d+) of \d+")
READY_MARK = b"\x1b]2;READY\x07"  # the child sets the title when no redraw is half written


class Terminal:
    """A pty of ``columns`` x ``rows`` and an emulator fed with what the child writes on it."""

    def __init__(self, columns: int, rows: int) -> None:
        self.columns = columns
        self.controller, self.terminal = pty.openpty()
        fcntl.ioctl(self.terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.screen = pyte.HistoryScreen(columns, rows, history=100_000)
        self.stream = pyte.ByteStream(self.screen)
        self.unread = b""

    def close(self) -> None:
        os.close(self.controller)
        os.close(self.terminal)

    def receive(self, within: float) -> bool:
        ready, _, _ = select.select([self.controller], [], [], within)
        if ready:
            self.unread += os.read(self.controller, 65536)
        return bool(ready)

    def feed_through(self, mark: bytes, proc: subprocess.Popen[bytes], within: float) -> None:
        """Replay the output up to and including ``mark``; the rest stays unread."""
        deadline = time.monotonic() + within
        while mark not in self.unread:
            if proc.poll() is not None or time.monotonic() > deadline:
                self.feed_all()
                raise AssertionError(f"no {mark!r} (exit {proc.poll()}); screen:\n" + "\n".join(self.lines()))
            self.receive(0.5)
        end = self.unread.index(mark) + len(mark)
        self.stream.feed(self.unread[:end])
        self.unread = self.unread[end:]

    def feed_all(self) -> None:
        while self.receive(0):
            pass
        self.stream.feed(self.unread)
        self.unread = b""

    def lines(self) -> list[str]:
        """The scrollback, then the screen, right-trimmed."""
        history = [
            "".join(line[x].data for x in range(self.columns)).rstrip() for line in self.screen.history.top
        ]
        return history + [line.rstrip() for line in self.screen.display]


def start_child(mode: str, tty: Terminal, data_dir: Path) -> subprocess.Popen[bytes]:
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.volunteer.panel_child", mode, str(data_dir), str(LINES)],
        stdin=tty.terminal,
        stdout=tty.terminal,
        stderr=tty.terminal,
        # unbuffered (as in many containers), stdout drops the rest of a write that a signal cuts short
        env={**env, "TERM": "xterm-256color", "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # the child makes the pty its controlling terminal
    )


def check_one_panel_below_the_logs(lines: list[str], *, last: str) -> None:
    shown = "\n".join(lines)
    headers = [i for i, line in enumerate(lines) if HEADER in line]
    assert len(headers) == 1, f"{len(headers)} panel headers:\n{shown}"
    logged = [(i, int(m.group(1))) for i, line in enumerate(lines) for m in [LOG_LINE.search(line)] if m]
    in_order = [n for _, n in logged] == list(range(1, LINES + 1))
    assert in_order, f"log lines lost, doubled or reordered:\n{shown}"
    assert all(i < headers[0] for i, _ in logged), f"a log line inside or under the panel:\n{shown}"
    assert any(last in line for line in lines[: headers[0]]), shown


@pytest.mark.parametrize(
    ("mode", "columns", "rows"),
    [
        ("member", 160, 48),  # the daemon's own panel task (imports torch: the slow one)
        ("training", 80, 16),  # the training panel grows and shrinks while live, as tall as the screen allows
        ("training", 60, 8),  # shorter than the panel: it is condensed, never scrolled
    ],
)
def test_live_panel_redraws_in_place_with_logs_above_it(
    tmp_path: Path, mode: str, columns: int, rows: int
) -> None:
    tty = Terminal(columns, rows)
    proc = start_child(mode, tty, tmp_path)
    try:
        tty.feed_through(READY_MARK, proc, within=90)
        live = tty.lines()
        check_one_panel_below_the_logs(live, last="READY")
        header = next(i for i, line in enumerate(live) if HEADER in line)
        assert header >= len(live) - rows, "the panel is not on the screen"
        assert all(line.strip() for line in live[header:]), "the panel is not at the bottom"
        assert len(live) - header <= rows - 1, "the panel must leave a row for the newest log line"

        os.write(tty.controller, b"\x03")  # Ctrl+C typed on the terminal: SIGINT, and an echoed ^C
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            tty.receive(0.1)  # a terminal reads all the time: a full pty would block the child
        assert proc.wait(timeout=1) == 0
        tty.feed_all()
        echo = termios.tcgetattr(tty.terminal)[3] & termios.ECHO
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tty.close()
    final = tty.lines()
    check_one_panel_below_the_logs(final, last="READY")
    assert "stopped by SIGINT" in final[-1] or "stopped by SIGINT" in "\n".join(final[-3:]), final[-5:]
    assert not tty.screen.cursor.hidden, "the cursor is still hidden"
    assert echo, "the keyboard does not echo any more"
