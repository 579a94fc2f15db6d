"""Issue 15, item 2, volunteer side, with real processes: ``volunteer join --metrics-listen`` serves
Prometheus text while it trains; after ``volunteer pause`` (no more steps) its step gauge and steps
counter match ``steps.jsonl``, garbage on the socket does not stop it, and the daemon still exits 0."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.backbone.dashboard_seed import parse_metrics

from .procs import ENV, cli, stop
from .test_training import Backbone, Volunteer, free_port, wait_for

pytestmark = pytest.mark.slow


def scrape(url: str) -> dict[str, Any]:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_metrics(response.text)


def one(parsed: dict[str, Any], name: str) -> float:
    samples = parsed[name]["samples"]
    assert len(samples) == 1, samples
    return float(samples[0][1])


def control(volunteer: Volunteer, command: str, *extra: str) -> str:
    out = subprocess.run(
        cli("volunteer", command, "--data-dir", str(volunteer.dir), *extra),
        capture_output=True, text=True, env=ENV, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def status(volunteer: Volunteer) -> dict[str, Any]:
    reply: dict[str, Any] = json.loads(control(volunteer, "status", "--json"))
    return reply


def test_a_volunteer_serves_metrics_that_match_its_steps(tmp_path: Path) -> None:
    root = tmp_path
    backbone = Backbone(root)
    backbone.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    alice = Volunteer(root, "alice", backbone, "--metrics-listen", f"127.0.0.1:{port}")
    try:
        wait_for(lambda: alice.step() >= 2, "alice at step 2", 120, [alice])
        training = scrape(url)
        assert one(training, "dedloc_volunteer_paused") == 0
        assert one(training, "dedloc_volunteer_step") >= 2
        assert one(training, "dedloc_volunteer_network_sent_bytes_total") > 0
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).status_code == 404
        assert httpx.post(url, content=b"x", timeout=10).status_code == 405
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # garbage, then hang up
            raw.sendall(b"\x00\xffnot http\r\n\r\n")
            assert raw.recv(100).startswith(b"HTTP/1.1 400")

        control(alice, "pause")
        wait_for(lambda: status(alice)["state"] == "paused", "alice paused", 60, [alice])
        steps = [json.loads(line) for line in (alice.dir / "steps.jsonl").read_text().splitlines() if line]
        paused = scrape(url)
        assert one(paused, "dedloc_volunteer_paused") == 1
        assert one(paused, "dedloc_volunteer_step") == max(s["step"] for s in steps)
        assert one(paused, "dedloc_volunteer_steps_total") == len(steps)  # counted across the session's end
        assert one(paused, "dedloc_volunteer_samples_total") >= sum(s["samples"] for s in steps) > 0
        assert one(paused, "dedloc_volunteer_averaging_rounds_total") >= 0
        info = paused["dedloc_volunteer_info"]["samples"][0][0]
        assert info["peer_id"] == status(alice)["peer_id"] and info["role"] == "trainer"
        assert alice.step() == max(s["step"] for s in steps)  # no step while paused
    finally:
        code = stop(alice.proc, within=40)[0] if alice.alive() else alice.proc.returncode
        if backbone.proc is not None and backbone.proc.poll() is None:
            stop(backbone.proc, within=30)
    log = alice.log.read_text()
    assert code == 0, log[-3000:]
    assert f"metrics at {url}" in log
    with pytest.raises(httpx.ConnectError):  # the server went with the daemon
        httpx.get(url, timeout=5)
