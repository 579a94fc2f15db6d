"""A real headless Chromium for tests, driven through chromedriver's W3C WebDriver HTTP API with httpx.

Debian's ``chromium`` and ``chromium-driver`` packages (``scripts/test`` installs them as root); no
browser downloads, no selenium. :func:`require_chromium` skips the calling test where they are missing
and fails it under CI (``$CI`` set), like :func:`tests.natnet.require_nat`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: W3C WebDriver's element reference key
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"


def require_chromium() -> None:
    """Skip the calling test without Debian's chromium and chromium-driver; under CI, fail."""
    import pytest

    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        reason = (
            f"the dashboard's browser test needs {' and '.join(missing)}: "
            "apt-get install chromium chromium-driver (scripts/test does as root)"
        )
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test, but {reason}")
        pytest.skip(reason)


class WebDriverError(AssertionError):
    pass


class Browser:
    """One WebDriver session of headless Chromium."""

    def __init__(self, client: httpx.Client, session: str) -> None:
        self.client, self.session = client, session

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.client.request(method, f"/session/{self.session}{path}", json=body)
        value = response.json().get("value")
        if response.status_code != 200:
            raise WebDriverError(f"{method} {path}: {response.status_code} {value}")
        return value

    def get(self, url: str) -> None:
        self._call("POST", "/url", {"url": url})

    def run(self, script: str, *args: Any) -> Any:
        """Run ``script`` (a function body; ``arguments`` holds ``args``) in the page; its return value."""
        return self._call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def text(self, selector: str) -> str:
        value = self.run(
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", selector
        )
        if value is None:
            raise WebDriverError(f"no element {selector}")
        return str(value)

    def element(self, selector: str) -> str:
        """The WebDriver reference of the element ``selector`` finds."""
        found = self._call("POST", "/element", {"using": "css selector", "value": selector})
        if not isinstance(found, dict) or ELEMENT not in found:
            raise WebDriverError(f"no element reference for {selector}: {found!r}")
        return str(found[ELEMENT])

    def type_into(self, selector: str, text: str) -> None:
        self._call("POST", f"/element/{self.element(selector)}/value", {"text": text})

    def click(self, selector: str) -> None:
        self._call("POST", f"/element/{self.element(selector)}/click", {})

    def alert_open(self) -> bool:
        response = self.client.get(f"/session/{self.session}/alert/text")
        return response.status_code == 200

    def wait_for(self, script: str, *args: Any, within: float = 20.0) -> Any:
        """Poll ``script`` until it returns a truthy value; that value."""
        deadline = time.monotonic() + within
        last: Any = None
        while time.monotonic() < deadline:
            last = self.run(script, *args)
            if last:
                return last
            time.sleep(0.2)
        raise WebDriverError(f"not true within {within} s: {script} (last {last!r})")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def headless_chromium(*, ignore_certificate_errors: bool = False) -> Iterator[Browser]:
    """chromedriver on a free loopback port and one headless Chromium session; both gone afterwards."""
    require_chromium()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        driver = subprocess.Popen(
            [CHROMEDRIVER, f"--port={port}", "--allowed-ips=127.0.0.1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as client:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if client.get("/status").json()["value"]["ready"]:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline or driver.poll() is not None:
                        raise WebDriverError(f"chromedriver did not start (exit {driver.poll()})")
                    time.sleep(0.1)
                args = [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    f"--user-data-dir={profile}",
                    "--no-first-run",
                    "--disable-extensions",
                ]
                if ignore_certificate_errors:
                    args.append("--ignore-certificate-errors")
                capabilities = {
                    "browserName": "chrome",
                    "goog:chromeOptions": {"binary": CHROMIUM, "args": args},
                }
                if ignore_certificate_errors:
                    capabilities["acceptInsecureCerts"] = True
                created = client.post("/session", json={"capabilities": {"alwaysMatch": capabilities}})
                if created.status_code != 200:
                    raise WebDriverError(f"no browser session: {created.text[:2000]}")
                session = created.json()["value"]["sessionId"]
                try:
                    yield Browser(client, session)
                finally:
                    with contextlib.suppress(httpx.HTTPError):
                        client.delete(f"/session/{session}")
        finally:
            driver.terminate()
            try:
                driver.wait(10)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait()
            shutil.rmtree(profile, ignore_errors=True)
