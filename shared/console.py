"""What both CLIs share: logging, data dirs (locked, one daemon each), run-id checks, and turning the
project's errors into one red line and an exit code instead of a traceback.

Exit codes: 0 success or clean stop by signal; 1 the network or a peer failed us (unreachable, wrong
run, nothing discovered); 2 the user's input is unusable (flags, addresses, data dir).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import re
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO

import trio
from rich.console import Console
from rich.file_proxy import FileProxy
from rich.logging import RichHandler
from rich.markup import escape

from .errors import ConfigError, ProjectError
from .portable import pread, pwrite, try_lock

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup
from .lifecycle import Shutdown, run_until_signal

__all__ = [
    "TERMINAL_LOCK",
    "default_data_dir",
    "fail",
    "locked_data_dir",
    "output_above",
    "project_version",
    "run_service",
    "same_terminal",
    "setup_logging",
    "shown_path",
    "stderr",
    "validate_run_id",
]

stderr = Console(stderr=True)
_RUN_ID = re.compile(r"^[A-Za-z0-9._@:-]{1,128}$")


TERMINAL_LOCK = threading.RLock()
"""Held by whatever draws on the terminal: a log record (from any thread) and a live panel's redraw never
interleave. A redraw moves the cursor up over the panel it drew last; a line written in between (by another
thread, or through another Console) shifts the screen under it, and each redraw then leaves a copy of the
panel's top behind (issue 11)."""

_log_console = stderr  # where log records go: stderr, or the live panel's console while one is shown


class _LogHandler(RichHandler):
    """Rich log lines on ``_log_console``, one record at a time under :data:`TERMINAL_LOCK`."""

    def emit(self, record: logging.LogRecord) -> None:
        with TERMINAL_LOCK:
            self.console = _log_console
            super().emit(record)


def setup_logging(verbose: bool) -> None:
    """Log to stderr: on a terminal in rich's columns (above a live panel while :func:`output_above`
    routes them there), else one plain line per record, for log files and ``grep``."""
    handler: logging.Handler
    if stderr.is_terminal:
        handler = _LogHandler(console=stderr, show_path=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True)
    if not verbose:
        for noisy in ("zeroconf", "shared.net.rpc", "hpack", "httpx"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


class _LockedProxy(FileProxy):
    """``sys.stdout``/``sys.stderr`` while a panel is live: whole lines, printed above it by its console."""

    def write(self, text: str) -> int:
        with TERMINAL_LOCK:
            return super().write(text)

    def flush(self) -> None:
        with TERMINAL_LOCK:
            super().flush()


def same_terminal(a: IO[str], b: IO[str]) -> bool:
    """Whether ``a`` and ``b`` are the same terminal (both ttys of one device)."""
    try:
        one, other = a.fileno(), b.fileno()
        if not (os.isatty(one) and os.isatty(other)):
            return False
        # Windows has no device numbers: two ttys of one console are taken as the same terminal
        return sys.platform == "win32" or os.fstat(one).st_rdev == os.fstat(other).st_rdev
    except (OSError, ValueError):  # no file descriptor (a test's StringIO), or closed
        return False


@contextlib.contextmanager
def output_above(console: Console) -> Iterator[None]:
    """While in the block, everything bound for ``console``'s terminal goes through ``console``: log
    records and writes to ``sys.stdout``/``sys.stderr`` print above a live display on it instead of over
    it. Output bound elsewhere (``2> file``) stays there.

    A Console unwraps rich's own stream proxies (it writes to the real file), so logging through one
    Console while another shows a ``rich.live.Live`` draws into the middle of the live display: that was
    the panel's smear.
    """
    global _log_console
    saved = (_log_console, sys.stdout, sys.stderr)
    with TERMINAL_LOCK:
        if same_terminal(stderr.file, console.file):
            _log_console = console
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if not isinstance(stream, FileProxy) and same_terminal(stream, console.file):
                setattr(sys, name, _LockedProxy(console, stream))
    try:
        yield
    finally:
        with TERMINAL_LOCK:
            for stream in (sys.stdout, sys.stderr):
                if isinstance(stream, _LockedProxy):
                    stream.flush()
            _log_console, sys.stdout, sys.stderr = saved


def validate_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ConfigError(f"run id {run_id!r} is invalid: use 1-128 letters, digits and . _ @ : -")
    return run_id


def default_data_dir(role: str) -> Path:
    """This user's data dir for ``role`` (``volunteer``, ``backbone``): ``$XDG_DATA_HOME/dedloc/ROLE``,
    by default ``~/.local/share/dedloc/ROLE`` (the XDG base directory spec ignores a relative
    ``$XDG_DATA_HOME``)."""
    base = os.environ.get("XDG_DATA_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "share"
    return root / "dedloc" / role


def project_version() -> str:
    """The installed project's version (``unknown`` in a source tree that was never installed)."""
    try:
        return importlib.metadata.version("dedloc")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def shown_path(path: Path) -> str:
    """``path`` as help text shows it: under the home directory as ``~/…``."""
    try:
        return f"~/{path.relative_to(Path.home())}"
    except (ValueError, RuntimeError):  # elsewhere, or no home directory
        return str(path)


@contextlib.contextmanager
def locked_data_dir(path: Path) -> Iterator[Path]:
    """Create ``path`` if needed and hold its lock: two daemons must never share one identity.

    Raises:
        ConfigError: the directory cannot be created, or another process holds it.
    """
    if path.exists() and not path.is_dir():
        raise ConfigError(f"data dir {path} is a file, not a directory; give another --data-dir")
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot use data dir {path}: {exc.strerror}; give another --data-dir") from exc
    try:
        if not try_lock(fd):
            holder = pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ConfigError(f"data dir {path} is in use by another process (pid {holder}); give --data-dir")
        os.ftruncate(fd, 0)
        pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)


def fail(message: str, code: int) -> None:
    """Print ``message`` on stderr as one line and exit with ``code``.

    One line whatever the message holds (a driver's multi-line text) and however wide the terminal: the
    terminal wraps it for the eye, a script reads one line. Brackets in it are text, not console markup.
    """
    line = " ".join(message.split())
    stderr.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    raise SystemExit(code)


def _project_error(exc: BaseException) -> ProjectError | None:
    """The project error inside ``exc`` (nurseries wrap errors in groups), if that is all it holds."""
    if isinstance(exc, ProjectError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        leaves = [_project_error(inner) for inner in exc.exceptions]
        if leaves and all(leaf is not None for leaf in leaves):
            return leaves[0]
    return None


def run_service(body: Callable[[Shutdown], Awaitable[None]]) -> None:
    """Run ``body`` under trio with signal handling; map the project's errors to exit codes."""
    try:
        shutdown = trio.run(run_until_signal, body)
    except (ProjectError, BaseExceptionGroup) as exc:
        error = _project_error(exc)
        if error is None:
            raise
        fail(str(error), 2 if isinstance(error, ConfigError) else 1)
    else:
        if shutdown.signal_name:
            stderr.print(f"stopped by {shutdown.signal_name}", highlight=False)
    sys.exit(0)
