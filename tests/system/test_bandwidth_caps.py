"""Issue 15, item 5, with real processes: ``volunteer join --max-upload 3 --max-download 5`` trains on (the
state download, averaging and the DHT all run through the capped buckets of shared.net.ratelimit) and the
bandwidth it measures and tells the run is at most its caps; on loopback it would measure far more."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .procs import stop
from .test_training import Backbone, Volunteer, wait_for

pytestmark = pytest.mark.slow

MEASURED = re.compile(r"↑ (\d+) MB/s ↓ (\d+) MB/s")


def test_a_capped_volunteer_trains_and_states_at_most_its_caps(tmp_path: Path) -> None:
    backbone = Backbone(tmp_path)
    backbone.start()
    alice = Volunteer(tmp_path, "alice", backbone, "--max-upload", "3", "--max-download", "5")
    try:
        wait_for(lambda: MEASURED.search(alice.log.read_text()) is not None, "alice measured", 120, [alice])
        wait_for(lambda: alice.step() >= 2, "alice at step 2", 120, [alice])
    finally:
        code = stop(alice.proc, within=40)[0] if alice.alive() else alice.proc.returncode
        if backbone.proc is not None and backbone.proc.poll() is None:
            stop(backbone.proc, within=30)
    log = alice.log.read_text()
    assert code == 0, log[-3000:]
    found = MEASURED.search(log)
    assert found is not None, log[-3000:]
    upload, download = int(found.group(1)), int(found.group(2))  # rounded to whole MB/s
    assert 0 <= upload <= 3 and 0 <= download <= 5, found.group(0)
