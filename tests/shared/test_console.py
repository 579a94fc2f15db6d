"""What both CLIs print: log records off a terminal are whole lines (a log file is read with grep)."""

from __future__ import annotations

import os
import subprocess
import sys

LOG_ONE_RECORD = (
    "import logging; from shared.console import setup_logging; setup_logging(False); "
    "logging.getLogger('volunteer.collab.step').info('step %d done: params %s', 7, 'ab' * 60)"
)


def test_setup_logging_off_a_terminal_writes_one_plain_line_per_record() -> None:
    result = subprocess.run(
        [sys.executable, "-c", LOG_ONE_RECORD],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "80"},
        timeout=60,
        check=True,
    )
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].endswith(" INFO volunteer.collab.step: step 7 done: params " + "ab" * 60), lines
