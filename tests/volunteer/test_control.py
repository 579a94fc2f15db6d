"""The volunteer's control socket (volunteer.control): 0600, only its user, one bounded JSON line each way,
stale sockets replaced and live ones left alone; and the state it controls (volunteer.activity)."""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from shared.errors import ConfigError
from volunteer.activity import Activity
from volunteer.control import MAX_LINE, SOCKET_NAME, ControlError, handle_line, request, serve_control
from volunteer.policy import Decision


def test_handle_line_answers_every_bad_request_with_an_error() -> None:
    def handle(command: str) -> dict[str, Any]:
        return {"echo": command}

    assert handle_line(b'{"command": "status"}', handle) == {"ok": True, "echo": "status"}
    for bad, why in (
        (b"x" * (MAX_LINE + 1), "longer than"),
        (b"not json", "not a JSON line"),
        (b"\xff\xfe", "not a JSON line"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"command": "rm -rf"}', "unknown command"),
        (b"{}", "unknown command"),
    ):
        reply = handle_line(bad, handle)
        assert reply["ok"] is False and why in reply["error"], (bad, reply)


def test_activity_pause_wins_over_the_rules_until_resume() -> None:
    activity = Activity()
    assert not activity.handle("status")["paused"]
    activity.handle("pause")
    assert activity.paused and activity.reason == "paused by `volunteer pause`"
    activity.set_policy(Decision(True, "idle for 20 min"))
    assert activity.paused  # the rules say train: the manual pause still holds
    activity.set_policy(Decision(False, "steam is running"))
    reply = activity.handle("resume")
    assert reply["paused"] and reply["reason"] == "steam is running"  # resumed into a rule's pause
    activity.set_policy(Decision(True, "idle"))
    assert not activity.snapshot()["paused"]
    with pytest.raises(ConfigError, match="nothing to pause"):
        Activity(can_pause=False).handle("pause")


async def _raw(path: Path, data: bytes) -> dict[str, Any]:
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        await stream.send_all(data)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            reply += chunk
    found: dict[str, Any] = json.loads(reply)
    return found


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A data dir with a short path (pytest's tmp_path may exceed a Unix socket's 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="ctl") as name:
        yield Path(name)


async def test_serve_control_end_to_end(short_dir: Path) -> None:
    activity = Activity(details=lambda: {"step": 7})
    async with trio.open_nursery() as nursery:
        path = await nursery.start(serve_control, short_dir, activity.handle)
        assert path == short_dir / SOCKET_NAME
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        reply = await trio.to_thread.run_sync(request, short_dir, "status")
        assert reply["ok"] and reply["state"] == "starting" and reply["step"] == 7 and not reply["paused"]
        assert reply["pid"] == os.getpid()
        reply = await trio.to_thread.run_sync(request, short_dir, "pause")
        assert reply["paused"] and activity.manual

        # strangers' lines: errors, never a crash
        assert "not a JSON line" in (await _raw(path, b"hello\n"))["error"]
        assert "longer than" in (await _raw(path, b"{" * (MAX_LINE * 4)))["error"]
        assert "unknown command" in (await _raw(path, b'{"command": 3}\n'))["error"]
        with trio.fail_after(5):  # a client that hangs up at once
            stream = await trio.open_unix_socket(str(path))
            await stream.aclose()
        reply = await trio.to_thread.run_sync(request, short_dir, "resume")
        assert not reply["paused"]
        nursery.cancel_scope.cancel()
    assert not path.exists()  # removed on exit
    with pytest.raises(ControlError, match="no volunteer runs with data dir"):
        request(short_dir, "status")


async def test_an_error_of_the_daemon_is_an_error_of_the_command(short_dir: Path) -> None:
    activity = Activity(can_pause=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, short_dir, activity.handle)
        with pytest.raises(ControlError, match="nothing to pause"):
            await trio.to_thread.run_sync(request, short_dir, "pause")
        nursery.cancel_scope.cancel()


async def test_a_stale_socket_is_replaced_a_live_one_or_a_file_is_not(short_dir: Path) -> None:
    path = short_dir / SOCKET_NAME
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a daemon that was killed: the file stays, nothing listens
    stale.close()
    activity = Activity()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, short_dir, activity.handle)
        with pytest.raises(ConfigError, match="another process answers"):
            await serve_control(short_dir, activity.handle)
        assert (await trio.to_thread.run_sync(request, short_dir, "status"))["ok"]  # still the first's
        nursery.cancel_scope.cancel()
    path.write_text("not a socket")
    with pytest.raises(ConfigError, match="is not a socket"):
        await serve_control(short_dir, activity.handle)
    assert path.read_text() == "not a socket"


async def test_a_long_data_dir_still_gets_its_socket(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    assert len(str(deep / SOCKET_NAME)) > 108
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, deep, Activity().handle)
        assert (await trio.to_thread.run_sync(request, deep, "status"))["ok"]
        nursery.cancel_scope.cancel()


def as_nobody(data_dir: Path) -> str:
    """``volunteer pause`` from a forked child that became ``nobody`` (it cannot exec the venv's python):
    what it got back, through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only syscalls and modules already imported
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                out = f"answered: {request(data_dir, 'pause')}"
            except ControlError as exc:
                out = f"refused: {exc}"
            os.write(write, out.encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


@pytest.mark.skipif(os.geteuid() != 0 or not hasattr(socket, "SO_PEERCRED"), reason="needs root and Linux")
async def test_another_user_is_refused(short_dir: Path) -> None:
    os.chmod(short_dir, 0o755)  # so that nobody may reach the directory: the socket's mode must stop it
    activity = Activity()

    async with trio.open_nursery() as nursery:
        path = await nursery.start(serve_control, short_dir, activity.handle)
        out = await trio.to_thread.run_sync(as_nobody, short_dir)
        assert "refused: not allowed to open" in out, out  # mode 0600
        os.chmod(path, 0o666)  # even through a socket anyone may open: the peer's uid is checked
        out = await trio.to_thread.run_sync(as_nobody, short_dir)
        assert "refused: only the daemon's user may control it" in out, out
        assert not activity.manual
        nursery.cancel_scope.cancel()
