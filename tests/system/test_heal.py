"""A backbone SIGKILLed and restarted on its port and data dir finds the run's live peers by itself
(issue 10, item 1): real `backbone` and `volunteer` processes on loopback."""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

import pytest

from .procs import spawn, start_backbone, stop, wait_status
from .test_cli import join_argv

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)


def test_backbone_killed_and_restarted_knows_the_live_volunteer_again(tmp_path: Path) -> None:
    bb_dir = tmp_path / "bb"
    bb, address = start_backbone(bb_dir)
    port = address.split("/tcp/")[1].split("/")[0]
    volunteer = spawn(join_argv(address, tmp_path / "v", "--listen", "/ip4/127.0.0.1/tcp/0"))
    restarted = None
    try:
        wait_status(bb_dir, lambda s: s["routing_table_size"] >= 1, bb)
        contacts_file = bb_dir / "dht-contacts.json"
        deadline = time.monotonic() + 60
        while not contacts_file.exists() or not json.loads(contacts_file.read_text())["contacts"]:
            assert time.monotonic() < deadline, "the backbone never saved its contacts"
            time.sleep(0.2)

        stop(bb, signal.SIGKILL)
        (bb_dir / "status.json").unlink()
        # as in the run: the volunteer notices (a call fails) and forgets the backbone, so only
        # the healing can bring them together again
        wait_status(tmp_path / "v", lambda s: s["routing_table_size"] == 0, volunteer)
        started = time.monotonic()
        restarted, _ = start_backbone(bb_dir, "--listen", f"/ip4/127.0.0.1/tcp/{port}")
        status = wait_status(bb_dir, lambda s: s["routing_table_size"] >= 1, restarted)
        logger.warning(
            "the restarted backbone knew the volunteer %.2f s after its start", time.monotonic() - started
        )
        assert status["peer_id"] == address.split("/p2p/")[1]
        wait_status(tmp_path / "v", lambda s: s["routing_table_size"] >= 1, volunteer)
    finally:
        results = [stop(p) for p in [volunteer, *([restarted] if restarted else [])]]
    for code, _out, err in results:
        assert code == 0, err
        assert "Traceback" not in err
