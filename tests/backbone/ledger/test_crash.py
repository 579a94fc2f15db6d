"""kill -9 while reports are being written (DESIGN §6, D5): nothing committed is lost or credited twice."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from backbone.ledger import LedgerStore, verify_report
from backbone.ledger.accounting import CREDITED

from .crash_writer import WRITER
from .reports import RUN_ID

ROOT = Path(__file__).resolve().parents[3]
COMMITS_BEFORE_KILL = 60
WITHIN_S = 60.0


class _Lines:
    """Lines of a child's stdout read straight from the pipe (no hidden buffer to lose at the kill)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._proc, self._fd, self._buffer = proc, proc.stdout.fileno(), b""

    def _fill(self) -> bool:
        ready, _, _ = select.select([self._fd], [], [], WITHIN_S)
        chunk = os.read(self._fd, 65536) if ready else b""
        self._buffer += chunk
        return bool(chunk)

    def next(self) -> str:
        while b"\n" not in self._buffer:
            if not self._fill():
                self._proc.kill()
                _, stderr = self._proc.communicate()
                raise AssertionError(f"the writer went silent or exited: {stderr.decode(errors='replace')}")
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def rest(self) -> list[str]:
        """Every complete line still in the pipe of the dead child."""
        while self._fill():
            pass
        return self._buffer.decode().splitlines()[: self._buffer.count(b"\n")]


@pytest.mark.slow
def test_ledger_survives_sigkill_of_the_writer_mid_stream(ledger_url: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.backbone.ledger.crash_writer", ledger_url],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    try:
        lines = _Lines(proc)
        assert lines.next() == "ready"
        printed = [int(lines.next()) for _ in range(COMMITS_BEFORE_KILL)]
        proc.send_signal(signal.SIGKILL)  # while it writes the next report
        proc.wait(timeout=WITHIN_S)
        printed += [int(line) for line in lines.rest()]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL

    with LedgerStore.open(ledger_url) as store:
        stored = store.peer_reports(WRITER.peer_id)
        seqs = [r.seq for r in stored]
        # Every printed seq had committed; at most one more committed before its line was printed.
        assert set(printed) <= set(seqs)
        assert len(seqs) == len(set(seqs))
        assert seqs == list(range(len(seqs)))
        assert len(seqs) - len(printed) in (0, 1)
        for row in stored:
            report = verify_report(row.signed, RUN_ID)
            assert store.record_report(row.signed, report, CREDITED, now=0.0) is False
        assert store.report_counts() == {"credited": len(seqs), "flagged": 0}
        writer = next(row for row in store.leaderboard() if row.username == "crash-writer")
        assert writer.samples == sum(r.samples for r in stored)
