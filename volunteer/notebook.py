"""Joining a run from a notebook cell (Colab, Kaggle, Jupyter): one call, the live panel in the cell.

::

    %pip install -q 'dedloc[volunteer]'        # or a git URL or wheel URL, whatever the organizers name
    from volunteer.notebook import join
    join("my-run@4fT9…", invite="dli1_…")

**One daemon, not two.** The volunteer runs as its own process, ``python -m volunteer join … --no-panel``:
exactly the daemon the command line runs (the same data dir, credential, reports and clean stop). A
kernel is a poor home for a daemon (its event loop, its signal handling, its restarts), and a second
implementation would drift from the first.

**The panel** is redrawn in the cell every second (an IPython display handle, no widgets needed) from what
the daemon writes into its data dir: ``status.json`` (the node: peers, reachability, links, traffic) and
``steps.jsonl`` (each step it took: step, loss, samples, peers), with its last log lines. Outside IPython
(a plain script) the same call prints a line every ``log_period`` seconds instead.

**What it decides for a notebook.** The micro-batch is fitted to the GPU the daemon detects, at warm-up
(``--micro-batch 0``, :mod:`volunteer.fitting`); a notebook accepts no connections, which the daemon's
reachability check finds out by itself (client mode, or a relay slot at a backbone). Extra ``volunteer
join`` flags go in ``flags`` (``join(run, flags=["--device", "cpu"])``).

**Stopping.** Interrupting the cell (the stop button: ``KeyboardInterrupt``) sends the daemon SIGTERM, so
the round it is in ends and its reports go out, and waits for it; the run's end (its step limit) ends the
daemon by itself. :func:`join` returns the daemon's exit code, and raises :class:`VolunteerFailed` (with
its last log lines) when it failed: a refused invite, a run that cannot be found.
"""

from __future__ import annotations

import collections
import importlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec
from rich.console import Console
from rich.text import Text

from shared.console import default_data_dir
from shared.errors import ProjectError
from shared.node import NodeStatus
from shared.panel import PanelView, Row, draw, status_view

__all__ = ["VolunteerFailed", "join", "render_html", "snapshot"]

REFRESH = 1.0
STOP_WITHIN = 30.0  # seconds a SIGTERMed daemon gets to finish its round and reports
LOG_LINES = 6


class VolunteerFailed(ProjectError):
    """The volunteer daemon exited with an error; the message holds its last log lines."""


def snapshot(data_dir: Path, log: Sequence[str] = ()) -> PanelView | None:
    """The panel of the daemon using ``data_dir``, from its ``status.json`` and ``steps.jsonl`` (None until
    it wrote a status)."""
    try:
        status = msgspec.json.decode((data_dir / "status.json").read_bytes(), type=NodeStatus)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    view = status_view(status, "training from a notebook")
    rows = list(view.rows)
    last = _last_step(data_dir / "steps.jsonl")
    if last is not None:
        loss = last.get("loss")
        rows[:0] = [
            Row("step", Text(f"{last.get('step')}  ·  {last.get('peers')} peers averaged it")),
            Row("loss", Text("—" if not isinstance(loss, int | float) else f"{float(loss):.4f}")),
            Row("samples", Text(f"{last.get('samples')} of the step's {last.get('batch')} computed here")),
        ]
    else:
        rows[:0] = [Row("step", "warming up: measuring this machine, loading the run's state")]
    footer = [Text(line, no_wrap=True, overflow="ellipsis") for line in log[-LOG_LINES:]]  # never markup
    return PanelView(view.title, rows, view.summary, footer=footer, hint="interrupt the cell to leave")


def _last_step(path: Path) -> dict[str, Any] | None:
    try:
        with path.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 4096))
            lines = file.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the first line of the tail may be cut, the last one half-written
        if isinstance(record, dict):
            return record
    return None


def render_html(view: PanelView) -> str:
    """``view`` as self-contained HTML (inline styles; every value escaped by rich's exporter)."""
    console = Console(
        record=True, width=110, file=io.StringIO(), force_terminal=True, color_system="truecolor"
    )
    console.print(draw(view))
    return console.export_html(
        inline_styles=True, code_format='<pre style="font-family:monospace">{code}</pre>'
    )


def _reader(stream: IO[str], sink: collections.deque[str]) -> None:
    for line in stream:
        sink.append(line.rstrip("\n"))


def join(
    run_id: str | None = None,
    *,
    invite: str | None = None,
    data_dir: str | Path | None = None,
    flags: Sequence[str] = (),
    log_period: float = 10.0,
    python: str = sys.executable,
) -> int:
    """Run a volunteer for ``run_id`` until the cell is interrupted or the run ends (module docstring).

    Raises:
        VolunteerFailed: the daemon exited with an error (the message holds its last log lines).
    """
    directory = Path(data_dir).expanduser() if data_dir is not None else default_data_dir("volunteer")
    argv = [python, "-m", "volunteer", "join", *([run_id] if run_id else [])]
    argv += ["--data-dir", str(directory), "--no-panel", *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    if invite:
        env["VOLUNTEER_INVITE"] = invite  # not on the command line, where `ps` shows it
    log: collections.deque[str] = collections.deque(maxlen=200)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    threading.Thread(target=_reader, args=(proc.stdout, log), daemon=True).start()
    show = _display()
    last_line = 0.0
    try:
        while proc.poll() is None:
            view = snapshot(directory, list(log))
            if show is not None:
                if view is not None:
                    show(render_html(view))
            elif time.monotonic() - last_line >= log_period and view is not None:
                print(view.summary, flush=True)
                last_line = time.monotonic()
            time.sleep(REFRESH)
    except KeyboardInterrupt:
        print("leaving the run (the current round ends, reports go out)…", flush=True)
        _stop(proc)
    finally:
        if proc.poll() is None:  # an error in the loop itself: never leave a daemon behind
            _stop(proc)
    time.sleep(0.1)  # the reader thread's last lines
    view = snapshot(directory, list(log))
    if show is not None and view is not None:
        show(render_html(view))
    code = proc.returncode
    if code not in (0, -signal.SIGTERM):
        raise VolunteerFailed(
            f"the volunteer exited with code {code}:\n" + "\n".join(list(log)[-LOG_LINES * 2 :])
        )
    return code


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_WITHIN)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _display() -> Callable[[str], None] | None:
    """A function that replaces the cell's output with HTML, or None outside IPython."""
    try:  # IPython is the notebook's, not a dependency of ours
        ipython = importlib.import_module("IPython")
        shown = importlib.import_module("IPython.display")
    except ImportError:
        return None
    if ipython.get_ipython() is None:
        return None
    handle = shown.display(shown.HTML("<pre>starting the volunteer…</pre>"), display_id=True)

    def show(markup: str) -> None:
        handle.update(shown.HTML(markup))

    return show
