"""Real CLI processes for system tests: start, read their first line, watch status.json, stop."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}


def cli(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def spawn(argv: Sequence[str], wrap: Callable[[list[str]], list[str]] | None = None) -> subprocess.Popen[str]:
    final = wrap(list(argv)) if wrap else list(argv)
    return subprocess.Popen(final, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


_PENDING: weakref.WeakKeyDictionary[subprocess.Popen[str], bytearray] = weakref.WeakKeyDictionary()


def read_line(proc: subprocess.Popen[str], within: float = 60.0) -> str:
    """The next stdout line, failing (with stderr shown) if the process dies or stays silent.

    Reads the pipe's fd directly: ``select`` cannot see lines already buffered by a text wrapper.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    pending = _PENDING.setdefault(proc, bytearray())
    deadline = time.monotonic() + within
    while b"\n" not in pending:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, left))
        if not ready:
            _, _, err = stop(proc, signal.SIGKILL)
            raise AssertionError(f"no output within {within} s; stderr: {err}")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise AssertionError(
                f"process exited ({proc.wait()}); stderr: {proc.stderr.read() if proc.stderr else ''}"
            )
        pending += chunk
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    return line.decode()


def start_backbone(
    data_dir: Path, *extra: str, run_id: str = "sys-run", wrap: Callable[[list[str]], list[str]] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """An open-run backbone (``--open``) unless ``extra`` says otherwise; returns its first address."""
    argv = cli("backbone", "start", "--run-id", run_id, "--data-dir", str(data_dir), *extra)
    if "--listen" not in extra:
        argv += ["--listen", "/ip4/127.0.0.1/tcp/0"]
    if "--pinned" in argv:
        argv.remove("--pinned")
        argv += ["--api-listen", "127.0.0.1:0"]
    else:
        argv.append("--open")
    proc = spawn(argv, wrap)
    line = read_line(proc)
    assert line.startswith("listening on /ip4/"), line
    return proc, line.removeprefix("listening on ")


def start_pinned_backbone(
    data_dir: Path, *extra: str, run_id: str = "sys-run"
) -> tuple[subprocess.Popen[str], str, str, str]:
    """A pinned-run backbone: returns (process, first multiaddr, pinned run id, first API URL)."""
    proc, address = start_backbone(data_dir, "--pinned", *extra, run_id=run_id)
    pinned = api = ""
    while not (pinned and api):
        line = read_line(proc)
        if line.startswith("run id "):
            pinned = line.removeprefix("run id ")
        elif line.startswith("api on ") and not api:
            api = line.removeprefix("api on ")
    return proc, address, pinned, api


def wait_status(
    data_dir: Path, ready: Callable[[dict[str, Any]], bool], proc: subprocess.Popen[str], within: float = 90.0
) -> dict[str, Any]:
    """Poll ``status.json`` (written every second by a running node) until ``ready`` holds."""
    deadline = time.monotonic() + within
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"process exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
            )
        try:
            last = json.loads((data_dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        else:
            if ready(last):
                return last
        time.sleep(0.2)
    raise AssertionError(f"status never became ready; last: {last}")


def stop(
    proc: subprocess.Popen[str], sig: int = signal.SIGTERM, within: float = 20.0
) -> tuple[int, str, str]:
    """Signal ``proc`` and collect (exit code, stdout, stderr); kill it if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(
            f"did not exit within {within} s after {signal.Signals(sig).name}: {err}"
        ) from None
    return proc.returncode, out, err


def invite(data_dir: Path, username: str) -> str:
    """An invite for ``username`` from the backbone with data dir ``data_dir`` (``backbone allow add``)."""
    result = subprocess.run(
        cli("backbone", "allow", "add", username, "--data-dir", str(data_dir), "--json"),
        capture_output=True, text=True, env=ENV, check=True,
    )  # fmt: skip
    return str(json.loads(result.stdout)["invite"])


def step_fingerprints(data_dir: Path) -> dict[int, str]:
    """step -> parameter fingerprint, as a volunteer writes them to ``steps.jsonl`` after each step."""
    path = data_dir / "steps.jsonl"
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {line["step"]: line["fingerprint"] for line in lines}
