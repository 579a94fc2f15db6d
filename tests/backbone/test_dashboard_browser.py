"""The dashboard in a real headless Chromium (Debian's chromium + chromedriver; tests/browser.py), served
by Hypercorn from the backbone's app with a real SQLite ledger that the test writes to while the page is
open: the page renders, its numbers are the ledger's, an update arrives without a reload, a hostile
username is shown as text (no element, no script, no alert), and the per-user rows appear only with the
admin token."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as serve_http
from starlette.applications import Starlette

from backbone.api import build_app
from backbone.startup import bind_api
from tests.backbone.api_app import ADMIN, in_process_api
from tests.backbone.dashboard_seed import HOSTILE_DEVICE, HOSTILE_USER, record_steps, seed
from tests.browser import Browser, headless_chromium

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def served(app: Starlette) -> Iterator[str]:
    """``app`` over plain HTTP on a loopback port, in a thread of its own (the browser calls block)."""
    sock = bind_api("127.0.0.1:0")
    port = sock.getsockname()[1]
    config = HypercornConfig()
    config.bind = [f"fd://{os.dup(sock.fileno())}"]
    config.accesslog = None
    started = threading.Event()
    token: list[trio.lowlevel.TrioToken] = []
    stop: list[trio.Event] = []
    failed: list[BaseException] = []

    async def main() -> None:
        stop.append(trio.Event())
        token.append(trio.lowlevel.current_trio_token())
        started.set()
        await serve_http(app, config, shutdown_trigger=stop[0].wait)  # type: ignore[arg-type]

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # shown by the test
            failed.append(exc)
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(10)
    try:
        assert not failed, failed
        yield f"http://127.0.0.1:{port}"
    finally:
        if token:
            trio.from_thread.run_sync(stop[0].set, trio_token=token[0])
        thread.join(10)
        sock.close()


def shown(browser: Browser) -> dict[str, str]:
    return {k: browser.text(f"#{k}") for k in ("global-step", "loss", "active-peers", "active-users")}


def test_dashboard_renders_the_ledger_and_updates_live(tmp_path: Path) -> None:
    with in_process_api(tmp_path) as api, served(build_app(api.state)) as url:
        store = api.state.store
        seeded = seed(store, time.time())
        with headless_chromium() as browser:
            browser.get(f"{url}/dashboard?poll=500")
            browser.wait_for("return Number(document.body.dataset.updates || 0) >= 1")
            newest = store.recent_steps(1)[0]
            assert newest.loss is not None
            assert shown(browser) == {
                "global-step": str(newest.global_step),
                "loss": f"{newest.loss:.4f}",
                "active-peers": "2",
                "active-users": "2",
            }
            assert browser.text("#run-id") == api.state.run_id
            # both series of the loss plot: the training loss of every step, no held-out loss
            assert browser.run("return document.querySelector('#loss-plot').dataset.points") == str(
                seeded.steps
            )
            assert browser.run("return document.querySelectorAll('#loss-plot path.series').length") == 1
            # the public view: no per-user row, nobody's name anywhere on the page
            page_text = browser.run("return document.body.textContent")
            assert "need the admin token" in browser.text("#peers")
            assert "bob" not in page_text and HOSTILE_USER not in page_text

            # a new step in the ledger shows up without a reload
            browser.run("window.stillTheSamePage = true;")
            updates = int(browser.run("return document.body.dataset.updates"))
            record_steps(store, seeded.steps + 1, seeded.steps + 1, time.time() - 1)
            step = str(seeded.steps + 1)
            browser.wait_for(
                "return document.querySelector('#global-step').textContent === arguments[0]", step
            )
            assert browser.run("return window.stillTheSamePage === true")
            assert int(browser.run("return document.body.dataset.updates")) > updates
            assert browser.run("return document.querySelector('#loss-plot').dataset.points") == step

            # the admin token (typed into the form) shows the per-user rows; the hostile name is text
            browser.type_into("#admin-token", ADMIN)
            browser.click("#admin-form button[type=submit]")
            browser.wait_for("return document.querySelectorAll('#peers tbody tr').length === 2")
            cells = browser.run(
                "return [...document.querySelectorAll('#peers tbody tr')].map(r => "
                "[...r.children].map(c => c.textContent))"
            )
            by_user = {row[0]: row for row in cells}
            assert set(by_user) == {HOSTILE_USER, "bob"}
            assert by_user[HOSTILE_USER][3] == HOSTILE_DEVICE
            held = store.capabilities(seeded.bob_peer)
            assert held is not None and by_user["bob"][4] == f"{held.samples_per_second:.1f}"
            board = browser.run(
                "return [...document.querySelectorAll('#leaderboard tbody tr')]"
                ".map(r => r.children[1].textContent)"
            )
            assert set(board) == {r.username for r in store.leaderboard()}
            assert browser.run("return document.querySelectorAll('img').length") == 0
            assert browser.run("return document.querySelectorAll('script').length") == 1
            assert not browser.alert_open()
            assert browser.run("return window.stillTheSamePage === true")

            # a wrong token: the page says so and falls back to the public view
            browser.run("sessionStorage.setItem('dedloc-admin-token', 'wrong');")
            browser.wait_for("return document.querySelector('#status').textContent.includes('refused')")
            browser.wait_for("return document.querySelectorAll('#peers tbody tr').length === 0")
