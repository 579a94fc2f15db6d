"""Invites from the organizer's and the volunteer's side, with the real commands (issue 11, items 6-7):
`backbone allow add` on a fresh data dir, single-use invites, the run an invite pins, and one-line
errors (exit 2: unusable input; exit 1: the run refused us, with what to do next)."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import trio

from protocols.api import Invite, decode_invite, encode_invite
from shared.auth.keys import Identity
from volunteer.api_client import ApiClient

from .procs import ENV, cli, read_line, spawn, stop

pytestmark = pytest.mark.slow


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    # a wide terminal: the point is that the message is one line, not how a terminal wraps it
    env = {**ENV, "COLUMNS": "1000"}
    return subprocess.run(cli(*argv), capture_output=True, text=True, timeout=120, env=env)


def one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_allow_add_on_a_fresh_data_dir_exits_2_with_the_full_command_in_one_line(tmp_path: Path) -> None:
    data_dir = tmp_path / "bb"
    line = one_line_error(run("backbone", "allow", "add", "alice", "--data-dir", str(data_dir)), 2)
    assert f"`backbone allow add alice --data-dir {data_dir} --run-id my-run --public-url https://" in line
    assert not data_dir.exists()


def test_volunteer_join_with_a_garbled_invite_exits_2_in_one_line(tmp_path: Path) -> None:
    garbled = "dli1_gaFhAQ"  # msgpack of {"a": 1}: it decodes, but not as an invite
    result = run("volunteer", "join", "--invite", garbled, "--data-dir", str(tmp_path / "v"), "--no-panel")
    assert one_line_error(result, 2) == (
        "error: this is not a valid invite code (it is damaged or cut short: copy the whole code again)"
    )


def test_volunteer_join_refuses_a_run_id_the_invite_is_not_for(tmp_path: Path) -> None:
    run_id = "inv@" + "1" * 17
    invite = encode_invite(Invite(run_id, ["https://127.0.0.1:1"], "s" * 43))
    result = run("volunteer", "join", "other-run", "--invite", invite, "--data-dir", str(tmp_path / "v"))
    assert f"this invite is for run {run_id}, not other-run" in one_line_error(result, 2)


def test_an_invite_made_before_the_first_start_admits_once_then_says_what_to_do(
    tmp_path: Path,
) -> None:
    """The whole path of an invite made before the backbone's first start: `allow add` on a fresh data
    dir, the backbone started as it says, one machine joins with a single-use invite; a second machine
    (joining with the run's bare name: the invite pins the run) is refused: exit 1, one line saying what
    to do (the other refusals: ``tests/volunteer/test_invite_admission.py``)."""
    data_dir, port = tmp_path / "bb", free_port()
    argv = ["allow", "add", "alice", "--data-dir", str(data_dir), "--run-id", "inv"]
    made = run("backbone", *argv, "--public-url", f"https://127.0.0.1:{port}", "--max-uses", "1", "--json")
    assert made.returncode == 0, made.stderr
    single = json.loads(made.stdout)
    argv = ["--run-id", "inv", "--data-dir", str(data_dir), "--api-listen", f"127.0.0.1:{port}"]
    bb = spawn(cli("backbone", "start", *argv, "--listen", "/ip4/127.0.0.1/tcp/0", "--no-mdns"))
    try:
        while not (line := read_line(bb)).startswith("run id "):
            pass
        assert line == f"run id {single['run_id']}"
        code = decode_invite(single["invite"])
        first = trio.run(ApiClient(code.run_id, code.api).join, code.secret, Identity.generate())
        assert first.username == "alice"
        second = run(
            "volunteer", "join", "inv", "--invite", single["invite"], "--data-dir", str(tmp_path / "v")
        )
        assert one_line_error(second, 1) == (
            "error: the invite has been used by as many machines as it allows: ask the run's organizers "
            "for a new invite"
        )
    finally:
        code_bb, _, err = stop(bb)
    assert code_bb == 0, err
