"""The real `backbone` and `volunteer` commands, in subprocesses on loopback."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from .procs import cli, spawn, start_backbone, start_pinned_backbone, stop, wait_status

pytestmark = pytest.mark.slow


def run(*argv: str, within: float = 30.0) -> subprocess.CompletedProcess[str]:
    from .procs import ENV

    return subprocess.run(list(argv), capture_output=True, text=True, timeout=within, env=ENV)


def join_argv(
    peer: str, data_dir: Path, *extra: str, run_id: str = "sys-run", panel: bool = False
) -> list[str]:
    """`volunteer join` of an open run through ``peer``, listening on loopback."""
    argv = ["volunteer", "join", run_id, "--initial-peer", peer, "--data-dir", str(data_dir), *extra]
    return cli(*argv, *([] if panel else ["--no-panel"]))


def test_backbone_start_prints_full_multiaddr_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    proc, address = start_backbone(tmp_path / "bb")
    assert "/tcp/" in address and "/p2p/12D3KooW" in address
    code, _, err = stop(proc)
    assert code == 0, err
    assert "Traceback" not in err
    assert (tmp_path / "bb" / "identity.key").stat().st_mode & 0o777 == 0o600


def test_backbone_keeps_its_peer_id_across_restarts(tmp_path: Path) -> None:
    first, address1 = start_backbone(tmp_path / "bb")
    stop(first)
    second, address2 = start_backbone(tmp_path / "bb")
    stop(second)
    assert address1.split("/p2p/")[1] == address2.split("/p2p/")[1]


def test_second_backbone_and_volunteers_join_and_see_each_other(tmp_path: Path) -> None:
    bb1, address = start_backbone(tmp_path / "bb1")
    bb2, _ = start_backbone(tmp_path / "bb2", "--initial-peer", address)
    volunteers = [
        spawn(join_argv(address, tmp_path / f"v{i}", "--listen", "/ip4/127.0.0.1/tcp/0")) for i in range(2)
    ]
    try:
        for i, proc in enumerate(volunteers):
            status = wait_status(
                tmp_path / f"v{i}", lambda s: s["routing_table_size"] >= 3 and s["members_online"] >= 4, proc
            )
            assert status["run_id"] == "sys-run"
            assert status["role"] == "volunteer"
            assert status["rpc_latency_ms"] is None or status["rpc_latency_ms"] > 0
    finally:
        results = [stop(p) for p in [*volunteers, bb2, bb1]]
    for code, _out, err in results:
        assert code == 0, err
        assert "Traceback" not in err
    assert "left the run cleanly" in results[0][1]


def test_volunteer_ctrl_c_leaves_cleanly(tmp_path: Path) -> None:
    bb, address = start_backbone(tmp_path / "bb")
    vol = spawn(join_argv(address, tmp_path / "v", "--listen", "/ip4/127.0.0.1/tcp/0"))
    try:
        wait_status(tmp_path / "v", lambda s: s["routing_table_size"] >= 1, vol)
        code, _out, err = stop(vol, signal.SIGINT)
    finally:
        stop(bb)
    assert code == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "stopped by SIGINT" in err


def test_volunteer_join_refuses_a_backbone_of_another_run(tmp_path: Path) -> None:
    bb, address = start_backbone(tmp_path / "bb", run_id="run-a")
    try:
        started = time.monotonic()
        result = run(*join_argv(address, tmp_path / "v", run_id="run-b"))
        assert time.monotonic() - started < 30
    finally:
        stop(bb)
    assert result.returncode == 1
    assert "serves run 'run-a', not 'run-b'" in result.stderr.replace("\n", "")
    assert "Traceback" not in result.stderr


def test_volunteer_join_with_unreachable_initial_peer_fails_clearly(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on: bind, read it, close
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run(*join_argv(f"/ip4/127.0.0.1/tcp/{port}", tmp_path / "v"))
    assert result.returncode == 1
    assert "ECONNREFUSED" in result.stderr and "Traceback" not in result.stderr


JOIN = ["volunteer", "join", "sys-run", "--initial-peer", "/ip4/127.0.0.1/tcp/5", "--no-panel"]
START = ["backbone", "start", "--run-id", "r", "--listen", "/ip4/127.0.0.1/tcp/0", "--no-mdns"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["volunteer", "join", "sys-run", "--initial-peer", "garbage"], "not a valid multiaddr"),
        (["volunteer", "join", "sys-run", "--initial-peer", "/ip4/127.0.0.1/udp/5"], "not a TCP multiaddr"),
        (["volunteer", "join", "bad run id!", "--initial-peer", "/ip4/127.0.0.1/tcp/5"], "run id"),
        (["backbone", "start", "--run-id", "r", "--listen", "/dns4/example.com/tcp/0"], "give an IP address"),
        ([*JOIN, "--device", "tpu"], "--device 'tpu' is not a device to train on: use auto, cpu, cuda"),
        ([*JOIN, "--device", "cuda:999"], "CUDA device"),  # none here, or fewer than 1000
        ([*JOIN, "--precision", "int8"], "--precision 'int8': use auto, fp32, bf16 or fp16"),
        ([*JOIN, "--micro-batch", "-1"], "--micro-batch -1"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, argv: list[str], message: str) -> None:
    result = run(*cli(argv[0], *argv[1:], "--data-dir", str(tmp_path / "d")))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()  # one line, however long
    assert message in line
    assert not (tmp_path / "d").exists()  # checked before the data dir is touched


def test_backbone_start_with_a_run_no_volunteer_can_train_exits_2_before_anything(tmp_path: Path) -> None:
    manifest = tmp_path / "run.toml"
    manifest.write_text('task = "gpt-5"\ntarget_batch = 256\n')
    result = run(*cli(*START, "--data-dir", str(tmp_path / "d"), "--manifest", str(manifest)))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"error: {manifest}: unknown task 'gpt-5': volunteers can train hf-clm, hf-mlm, tiny-mlm, or the "
        'task of a plugin the manifest names (plugin = "distribution==version")'
    ]
    assert result.stdout == ""  # no run id printed, no invite possible
    assert not (tmp_path / "d").exists()


def test_backbone_start_on_a_taken_api_port_announces_and_writes_nothing(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(*cli(*START, "--data-dir", str(tmp_path / "d"), "--api-listen", f"127.0.0.1:{port}"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"error: cannot serve the API on 127.0.0.1:{port}: the port is in use by another process; "
        "choose another port (or 0 for any free one)"
    ]
    assert result.stdout == ""  # no "listening on", no run id
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["lock"]  # no corpus, keys, ledger or run.json


def test_restarting_a_data_dir_under_another_run_id_is_refused(tmp_path: Path) -> None:
    bb, _, pinned, _ = start_pinned_backbone(tmp_path / "bb")
    assert stop(bb)[0] == 0
    typo = run(*cli(*START[:2], "--run-id", "sys-rnu", "--data-dir", str(tmp_path / "bb"), *START[4:]))
    assert typo.returncode == 2, typo.stderr
    (line,) = typo.stderr.splitlines()
    assert f"holds run {pinned}, not sys-rnu (invites carry that id): start it with --run-id sys-run" in line
    assert typo.stdout == ""
    # The run's full id is that run: a second backbone (or this one) may start with it.
    again, _, pinned_again, _ = start_pinned_backbone(tmp_path / "bb", run_id=pinned)
    assert stop(again)[0] == 0
    assert pinned_again == pinned


def test_backbone_start_on_a_port_in_use_exits_2(tmp_path: Path) -> None:
    bb, address = start_backbone(tmp_path / "bb")
    try:
        listen = address.split("/p2p/")[0]
        result = run(
            *cli(
                "backbone",
                "start",
                "--run-id",
                "sys-run",
                "--data-dir",
                str(tmp_path / "bb2"),
                "--listen",
                listen,
            )
        )
    finally:
        stop(bb)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "address already in use" in line
    assert result.stdout == ""  # nothing announced
    assert not (tmp_path / "bb2" / "run.json").exists() and not (tmp_path / "bb2" / "shards").exists()


def test_data_dir_used_by_a_running_node_is_refused(tmp_path: Path) -> None:
    bb, _ = start_backbone(tmp_path / "bb")
    try:
        result = run(
            *cli(
                "backbone",
                "start",
                "--run-id",
                "sys-run",
                "--data-dir",
                str(tmp_path / "bb"),
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
            )
        )
    finally:
        stop(bb)
    assert result.returncode == 2
    assert "in use by another process" in result.stderr


def test_volunteer_join_shows_a_live_panel_on_a_terminal(tmp_path: Path) -> None:
    import os
    import pty
    import select as select_module

    bb, address = start_backbone(tmp_path / "bb")
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        join_argv(address, tmp_path / "v", "--listen", "/ip4/127.0.0.1/tcp/0", panel=True),
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env={**os.environ, "COLUMNS": "120", "TERM": "xterm"},
    )
    os.close(terminal)
    screen = b""
    labels = (b"peers known", b"DHT size", b"RPC latency", b"sys-run")
    try:
        deadline = time.monotonic() + 30
        # The panel arrives in pieces: wait for all of it, not for its first line (flaked under load).
        while time.monotonic() < deadline and not all(label in screen for label in labels):
            ready, _, _ = select_module.select([controller], [], [], 0.5)
            if ready:
                try:
                    screen += os.read(controller, 65536)
                except OSError:
                    break
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(controller)
        stop(bb)
    text = screen.decode(errors="replace")
    for label in labels:
        assert label.decode() in text, text[-2000:]
    assert code == 0
