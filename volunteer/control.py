"""The running volunteer's local control channel: ``volunteer pause``, ``resume`` and ``status`` talk to
the daemon of a data dir over a Unix socket in it, ``control.sock``.

**Who may talk.** Only the daemon's own user: the socket is created mode 0600 (under a umask that never
lets it exist with wider rights) in the data dir (itself 0700), and every connection's peer credentials
(``SO_PEERCRED`` on Linux) must name the daemon's effective uid; root's connections are refused too unless
the daemon runs as root (root ignores file modes, the credential check does not). Where the platform has no
``SO_PEERCRED`` the file mode alone guards it.

**Creating it safely.** The data dir is locked by one daemon (:func:`shared.console.locked_data_dir`), but
a socket left by a daemon that was killed stays on disk: an existing ``control.sock`` is removed only if it
is a socket and nothing answers on it; a live one (another daemon, or one started outside the lock) makes
the channel fail to start with a clear error rather than steal it. A path that is not a socket is never
removed. Unix socket paths are short (about 107 bytes): a longer data dir is reached through
``/proc/self/fd`` on Linux. A system without Unix sockets runs the daemon without the channel (a warning).

**The protocol**: one request and one reply per connection, each a single JSON object on one line of at
most :data:`MAX_LINE` bytes. A request is ``{"command": "status" | "pause" | "resume"}``; a reply is
``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. The peer is a stranger even locally: a line
that is too long, not JSON, not an object or names no known command gets an error reply, a client that
sends nothing within :data:`READ_TIMEOUT` is dropped, and none of it ends the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import trio

from shared.errors import ConfigError, ProjectError

__all__ = [
    "COMMANDS",
    "MAX_LINE",
    "SOCKET_NAME",
    "ControlError",
    "handle_line",
    "request",
    "serve_control",
]

logger = logging.getLogger("volunteer.control")
SOCKET_NAME = "control.sock"
MAX_LINE = 4096
READ_TIMEOUT = 5.0
COMMANDS = ("status", "pause", "resume")
_SHORT_PATH = 100  # bytes; sun_path holds 108 with its terminating zero

Handler = Callable[[str], Mapping[str, Any]]


class ControlError(ProjectError):
    """No daemon answers for this data dir, or it answered with an error."""


def handle_line(line: bytes, handle: Handler) -> dict[str, Any]:
    """The reply to one request line (without its newline), never raising for a bad request: ``handle``
    gets the command of a well-formed one and returns the reply's fields."""
    if len(line) > MAX_LINE:
        return {"ok": False, "error": f"request longer than {MAX_LINE} bytes"}
    try:
        message = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {"ok": False, "error": "request is not a JSON line"}
    if not isinstance(message, dict):
        return {"ok": False, "error": "request is not a JSON object"}
    command = message.get("command")
    if command not in COMMANDS:
        return {
            "ok": False,
            "error": f"unknown command {str(command)[:40]!r}; use one of {', '.join(COMMANDS)}",
        }
    try:
        return {"ok": True, **handle(command)}
    except ProjectError as exc:
        return {"ok": False, "error": str(exc)}


#: Unix sockets (every platform but older Windows; serve_control and the client check before using them)
_AF_UNIX: int = getattr(socket, "AF_UNIX", -1)


def _euid() -> int:
    geteuid = getattr(os, "geteuid", None)  # POSIX only; SO_PEERCRED (Linux) is what asks for it
    return int(geteuid()) if geteuid is not None else -1


@contextlib.contextmanager
def _reachable(path: Path) -> Iterator[str]:
    """A name for ``path`` short enough for a Unix socket address."""
    name = os.fsencode(path)
    if len(name) < _SHORT_PATH:
        yield str(path)
        return
    if not os.path.isdir("/proc/self/fd"):
        raise ConfigError(f"the data dir's path is too long for a control socket: {path.parent}")
    fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _answers(path: Path) -> bool:
    """Something listens on the socket at ``path``."""
    with socket.socket(_AF_UNIX, socket.SOCK_STREAM) as probe, _reachable(path) as name:
        probe.settimeout(2.0)
        try:
            probe.connect(name)
        except OSError:
            return False
    return True


def _bind(path: Path) -> socket.socket:
    """A listening socket at ``path``, mode 0600 (module docstring: stale ones are replaced)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(mode):
            raise ConfigError(
                f"{path} exists and is not a socket; remove it to get `volunteer pause`/`status`"
            )
        if _answers(path):
            raise ConfigError(f"another process answers on {path}; is another volunteer using this data dir?")
        path.unlink()
    sock = socket.socket(_AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        with _reachable(path) as name:
            sock.bind(name)
        os.chmod(path, 0o600)
        sock.listen(16)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot create the control socket {path}: {exc.strerror}") from exc
    finally:
        os.umask(old)
    return sock


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket; None where the platform cannot tell."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    size = struct.calcsize("3i")
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, size))
    return int(uid)


async def _serve_one(stream: trio.SocketStream, handle: Handler) -> None:
    async with stream:
        uid = peer_uid(stream.socket)  # type: ignore[arg-type]  # trio's socket wraps a stdlib one
        if uid is not None and uid != _euid():
            logger.warning("control socket: refused a connection from uid %d", uid)
            await _reply(stream, {"ok": False, "error": "only the daemon's user may control it"})
            return
        data = bytearray()
        with trio.move_on_after(READ_TIMEOUT) as timer:
            while b"\n" not in data and len(data) <= MAX_LINE:
                chunk = await stream.receive_some(MAX_LINE + 1)
                if not chunk:
                    break
                data += chunk
        if timer.cancelled_caught and not data:
            return
        line, newline, _ = bytes(data).partition(b"\n")
        if not newline and len(data) > MAX_LINE:
            line = bytes(data)  # no end within the limit: too long
        await _reply(stream, handle_line(line, handle))


async def _reply(stream: trio.SocketStream, reply: Mapping[str, Any]) -> None:
    with trio.move_on_after(READ_TIMEOUT):
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(json.dumps(reply).encode() + b"\n")


async def serve_control(
    data_dir: Path, handle: Handler, *, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve the control socket of ``data_dir`` until cancelled; removes it on exit.

    Raises:
        ConfigError: it cannot be created (module docstring).
    """
    path = data_dir / SOCKET_NAME
    if not hasattr(socket, "AF_UNIX"):  # Windows without Unix sockets: the daemon runs, uncontrolled
        logger.warning("no Unix sockets on this system: volunteer pause/resume/status are unavailable")
        task_status.started(path)
        await trio.sleep_forever()
    raw = _bind(path)
    try:
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(raw))
        async with trio.open_nursery() as nursery:
            task_status.started(path)
            async with listener:
                while True:
                    try:
                        stream = await listener.accept()
                    except OSError as exc:  # EMFILE and the like: wait, do not end the daemon
                        logger.warning("control socket: accept failed: %s", exc)
                        await trio.sleep(0.5)
                        continue
                    nursery.start_soon(_serve_one, stream, handle)
    finally:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                path.unlink()


def request(data_dir: Path, command: str, timeout: float = 10.0) -> dict[str, Any]:
    """Send ``command`` to the daemon of ``data_dir`` and return its reply (blocking).

    Raises:
        ControlError: no daemon answers there, it refused us, or it answered with an error.
    """
    path = data_dir / SOCKET_NAME
    if not hasattr(socket, "AF_UNIX"):
        raise ControlError("no Unix sockets on this system: the volunteer cannot be controlled from here")
    with socket.socket(_AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            with _reachable(path) as name:
                sock.connect(name)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ControlError(
                f"no volunteer runs with data dir {data_dir} (nothing answers on {path})"
            ) from exc
        except ConfigError as exc:
            raise ControlError(str(exc)) from exc
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise ControlError(f"not allowed to open {path}: only the daemon's user may") from exc
            raise ControlError(f"cannot reach the volunteer of {data_dir}: {exc.strerror or exc}") from exc
        failed: OSError | None = None
        try:
            sock.sendall(json.dumps({"command": command}).encode() + b"\n")
        except OSError as exc:  # a daemon that refuses us answers and hangs up: read its reason
            failed = exc
        data = bytearray()
        try:
            while b"\n" not in data and len(data) <= MAX_LINE:
                chunk = sock.recv(MAX_LINE + 1)
                if not chunk:
                    break
                data += chunk
        except OSError as exc:
            failed = failed or exc
        if not data and failed is not None:
            why = failed.strerror or failed
            raise ControlError(f"the volunteer of {data_dir} did not answer: {why}") from failed
    try:
        reply = json.loads(bytes(data).partition(b"\n")[0])
    except ValueError as exc:
        raise ControlError(f"the volunteer of {data_dir} answered something unreadable") from exc
    if not isinstance(reply, dict):
        raise ControlError(f"the volunteer of {data_dir} answered something unreadable")
    if not reply.get("ok"):
        raise ControlError(str(reply.get("error", "the volunteer refused the request")))
    return reply
