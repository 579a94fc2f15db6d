"""What the notebook's cell shows (:mod:`volunteer.notebook`), from a data dir as the daemon writes it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgspec

from shared.node import NodeStatus
from volunteer.notebook import render_html, snapshot


def status(**changes: object) -> NodeStatus:
    base = NodeStatus(
        run_id="nb-run@4fT9", peer_id="12D3KooWtest", role="volunteer", listen_addrs=[], routing_table_size=2,
        connected_peers=2, dht_size_estimate=3, members_online=3, rpc_latency_ms=1.5, bytes_sent=2_000_000,
        bytes_received=3_000_000, uptime_s=12.0, updated_at=0.0,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_nothing_until_the_daemon_wrote_a_status(tmp_path: Path) -> None:
    assert snapshot(tmp_path) is None
    (tmp_path / "status.json").write_text("{half")
    assert snapshot(tmp_path) is None


def test_the_panel_shows_the_last_step_and_escapes_what_it_shows(tmp_path: Path) -> None:
    hostile = "<script>alert(1)</script>"
    (tmp_path / "status.json").write_bytes(msgspec.json.encode(status(reachability_note=hostile)))
    steps = [{"step": s, "loss": 6.5 - s / 10, "samples": 8, "batch": 32, "peers": 2} for s in (1, 2)]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps) + '{"step": 3, "lo')
    view = snapshot(tmp_path, ["[/bold] a log line that is not markup", hostile])
    assert view is not None
    page = render_html(view)
    assert "6.3000" in page and "2 peers averaged it" in page  # step 2: the cut line is skipped
    assert hostile not in page and "&lt;script&gt;" in page
    assert "[/bold] a log line" in page


def test_a_daemon_still_warming_up_says_so(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_bytes(msgspec.json.encode(status()))
    view = snapshot(tmp_path)
    assert view is not None and "warming up" in render_html(view)
