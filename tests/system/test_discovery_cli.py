"""`volunteer join RUN` with no address finds a `backbone start` over mDNS on another host.

Loopback has no multicast, so each process runs in its own network namespace on one bridge.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.netns import lan, netns_available

from .procs import cli, spawn, start_backbone, stop, wait_status

pytestmark = [pytest.mark.netns, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _need_netns() -> None:
    reason = netns_available()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")


def test_volunteer_join_discovers_backbone_over_mdns(tmp_path: Path) -> None:
    with lan(2) as (server, client):
        bb, address = start_backbone(
            tmp_path / "bb", "--listen", f"/ip4/{server.address}/tcp/0", wrap=server.command
        )
        assert server.address in address
        vol = spawn(
            cli(
                "volunteer",
                "join",
                "sys-run",
                "--data-dir",
                str(tmp_path / "v"),
                "--no-panel",
                "--listen",
                f"/ip4/{client.address}/tcp/0",
            ),
            wrap=client.command,
        )
        try:
            status = wait_status(tmp_path / "v", lambda s: s["routing_table_size"] >= 1, vol)
            assert status["connected_peers"] >= 1
        finally:
            vol_result = stop(vol)
            bb_result = stop(bb)
    assert vol_result[0] == 0, vol_result[2]
    assert bb_result[0] == 0, bb_result[2]


def test_volunteer_join_unknown_run_fails_within_seconds(tmp_path: Path) -> None:
    with lan(2) as (server, client):
        bb, _ = start_backbone(
            tmp_path / "bb", "--listen", f"/ip4/{server.address}/tcp/0", wrap=server.command
        )
        try:
            started = time.monotonic()
            vol = spawn(
                cli(
                    "volunteer",
                    "join",
                    "no-such-run",
                    "--data-dir",
                    str(tmp_path / "v"),
                    "--no-panel",
                    "--discovery-wait",
                    "2",
                ),
                wrap=client.command,
            )
            _, err = vol.communicate(timeout=30)
            code = vol.returncode
            elapsed = time.monotonic() - started
        finally:
            stop(bb)
    assert code == 1, err
    assert "no backbone of run 'no-such-run'" in err.replace("\n", " ")
    assert elapsed < 20
