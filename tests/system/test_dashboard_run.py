"""The dashboard of a real ``backbone start --public-leaderboard --dashboard-listen`` with a real
volunteer training, in a real headless Chromium (tests/browser.py; over the plain-HTTP dashboard
listener: Chromium refuses the API's Ed25519 certificate): the page shows the ledger's step and the
volunteer, a later step arrives without a reload, the health panel has the running node's DHT,
aggregator and relay, and ``/metrics`` on the HTTPS API carries them (run-level, no username)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from backbone.ledger import LedgerStore
from tests.backbone.dashboard_seed import parse_metrics
from tests.browser import Browser, headless_chromium, require_chromium

from .procs import stop
from .test_training import Backbone, Volunteer, free_port, wait_for

pytestmark = pytest.mark.slow


def newest_step(backbone: Backbone) -> int:
    with LedgerStore.open(f"sqlite:///{backbone.dir / 'ledger.sqlite3'}") as store:
        return store.newest_step() or 0


def page_step(browser: Browser) -> int:
    text = browser.text("#global-step")
    return int(text) if text.isdigit() else 0


def test_dashboard_of_a_live_run(tmp_path: Path) -> None:
    require_chromium()  # before starting processes
    backbone = Backbone(tmp_path)
    port = free_port()
    backbone.start("--public-leaderboard", "--dashboard-listen", f"127.0.0.1:{port}")
    volunteer = Volunteer(tmp_path, "alice", backbone)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: newest_step(backbone) >= 2, "two steps in the ledger", 300, [volunteer])
        with headless_chromium() as browser:
            browser.get(f"{url}/dashboard?poll=1000")
            browser.wait_for("return Number(document.body.dataset.updates || 0) >= 1", within=30)
            browser.run("window.stillTheSamePage = true;")
            first = page_step(browser)
            assert 2 <= first <= newest_step(backbone)  # the ledger's step (it may have moved on since)
            browser.wait_for("return document.querySelector('#active-peers').textContent === '1'", within=30)
            browser.wait_for("return document.querySelectorAll('#peers tbody tr').length === 1", within=30)
            row = browser.run(
                "return [...document.querySelector('#peers tbody tr').children].map(c => c.textContent)"
            )
            assert row[0] == "alice" and row[2].startswith("compute"), row
            # the reachability the volunteer published in the DHT (its capability record)
            reach = "return document.querySelector('#peers tbody tr').children[7].textContent"
            browser.wait_for(f"{reach} !== 'unknown'", within=60)
            assert browser.run(reach) in ("direct", "relayed", "client", "unchecked")
            # a later step arrives without a reload
            wait_for(lambda: page_step(browser) > first, "a later step on the page", 240, [volunteer])
            assert browser.run("return window.stillTheSamePage === true")
            assert page_step(browser) <= newest_step(backbone)
            health = dict(
                browser.run(
                    "return [...document.querySelectorAll('#health tbody tr')]"
                    ".map(r => [r.children[0].textContent, r.children[1].textContent])"
                )
            )
            assert health["DHT size (estimate)"].isdigit(), health
            assert health["aggregator rounds aggregated / failed / no group"] != "not aggregating"
            assert health["relay reservations / circuits / relayed"] != "not relaying"
        assert httpx.get(f"{url}/v1/runs/{backbone.run_id}/health", timeout=30).status_code == 404  # no API
        data = httpx.get(f"{url}/dashboard/data.json", timeout=30)
        assert data.json()["peers"][0]["user"] == "alice"  # --public-leaderboard: no token needed
        assert "last_error" not in data.json()["health"]["aggregator"]
        assert "127.0.0.1" not in data.text  # nobody's address, not even the volunteer's
        metrics = httpx.get(f"https://127.0.0.1:{backbone.api_port}/metrics", verify=False, timeout=30)
        families = parse_metrics(metrics.text)
        for name in (
            "dedloc_dht_size_estimate",
            "dedloc_aggregator_rounds_total",
            "dedloc_relay_reservations",
        ):
            assert name in families, sorted(families)
        assert families["dedloc_peers_active"]["samples"] == [({}, 1.0)]
        assert "alice" not in metrics.text
    finally:
        if volunteer.alive():
            stop(volunteer.proc, within=40)
        assert backbone.proc is not None
        stop(backbone.proc, within=30)
