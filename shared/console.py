"""What both CLIs share: logging, data dirs (locked, one daemon each), run-id checks, and turning the
project's errors into one red line and an exit code instead of a traceback.

Exit codes: 0 success or clean stop by signal; 1 the network or a peer failed us (unreachable, wrong
run, nothing discovered); 2 the user's input is unusable (flags, addresses, data dir).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import trio
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from .errors import ConfigError, ProjectError

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup
from .lifecycle import Shutdown, run_until_signal

__all__ = [
    "default_data_dir",
    "fail",
    "locked_data_dir",
    "run_service",
    "setup_logging",
    "stderr",
    "validate_run_id",
]

stderr = Console(stderr=True)
_RUN_ID = re.compile(r"^[A-Za-z0-9._@:-]{1,128}$")


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(name)s: %(message)s",
        handlers=[RichHandler(console=stderr, show_path=False, rich_tracebacks=False)],
        force=True,
    )
    if not verbose:
        for noisy in ("zeroconf", "shared.net.rpc", "hpack", "httpx"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def validate_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ConfigError(f"run id {run_id!r} is invalid: use 1-128 letters, digits and . _ @ : -")
    return run_id


def default_data_dir(role: str) -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "dedloc" / role


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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ConfigError(
                f"data dir {path} is in use by another process (pid {holder}); give --data-dir"
            ) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
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
