"""Issue 15, item 5, with real processes: ``volunteer pause`` stops a running volunteer's training but keeps
the process and its peer id; ``volunteer status`` says so; no steps are taken while paused; ``volunteer
resume`` re-syncs and trains again; the credit earned before the pause stays in the ledger."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from backbone.ledger import LedgerStore

from .procs import ENV, cli, stop
from .test_training import Backbone, Volunteer, wait_for

pytestmark = pytest.mark.slow


def control(volunteer: Volunteer, command: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli("volunteer", command, "--data-dir", str(volunteer.dir), *extra),
        capture_output=True, text=True, env=ENV, timeout=60,
    )  # fmt: skip


def status(volunteer: Volunteer) -> dict[str, Any]:
    result = control(volunteer, "status", "--json")
    assert result.returncode == 0, result.stderr
    reply: dict[str, Any] = json.loads(result.stdout)
    return reply


def status_file(volunteer: Volunteer) -> dict[str, Any]:
    try:
        found: dict[str, Any] = json.loads((volunteer.dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return found


def credited(backbone: Backbone) -> dict[str, int]:
    """Samples credited per user, as ``backbone ledger --json`` reads them (the backbone may be running)."""
    ledger = subprocess.run(
        cli("backbone", "ledger", "--data-dir", str(backbone.dir), "--json"),
        capture_output=True, text=True, env=ENV, check=True,
    )  # fmt: skip
    return {row["username"]: int(row["samples"]) for row in json.loads(ledger.stdout)}


def test_pause_keeps_the_peer_and_its_credit_and_resume_trains_again(tmp_path: Path) -> None:
    backbone = Backbone(tmp_path)
    backbone.start()
    alice = Volunteer(tmp_path, "alice", backbone)
    bob = Volunteer(tmp_path, "bob", backbone)  # trains on while alice is paused; credit needs a peer
    both = [alice, bob]
    try:
        # both train together (a paused peer serves no state: the run's state must live on in bob)
        wait_for(lambda: min(alice.step(), bob.step()) >= 3, "alice and bob at step 3", 120, both)
        before = status(alice)
        assert before["state"] == "training" and not before["paused"], before
        assert before["pid"] == alice.proc.pid

        paused = control(alice, "pause")
        assert paused.returncode == 0, paused.stderr
        assert paused.stdout.startswith("paused: paused by `volunteer pause`"), paused.stdout
        wait_for(lambda: status(alice)["state"] == "paused", "alice paused", 60, both)
        # the pause sent alice's open reports: what she did before it is credited (bob's receipts)
        wait_for(lambda: credited(backbone).get("alice", 0) > 0, "alice credited", 60, both)
        credit = credited(backbone)["alice"]
        wait_for(
            lambda: status_file(alice).get("activity", "").startswith("paused: "),
            "status.json says paused",
            30,
            both,
        )
        during = status(alice)
        assert during["paused"] and during["manual"], during
        shown = control(alice, "status")
        assert shown.returncode == 0 and shown.stdout.startswith("paused: paused by `volunteer pause`")
        assert f"peer {before['peer_id']}" in shown.stdout, shown.stdout
        assert during["peer_id"] == before["peer_id"] and during["pid"] == alice.proc.pid
        # no step while paused: watch the live process write several status updates
        stepped = alice.step()
        first = status_file(alice)["updated_at"]
        bob_at = bob.step()
        wait_for(lambda: bob.step() >= bob_at + 2, "bob steps on", 60, both)
        wait_for(lambda: status_file(alice).get("updated_at", 0) >= first + 2, "alice alive", 30, both)
        assert alice.step() == stepped, "a step was taken while paused"
        assert status(alice)["state"] == "paused"

        resumed = control(alice, "resume")
        assert resumed.returncode == 0, resumed.stderr
        wait_for(lambda: alice.step() > stepped + 1, "steps after resume", 120, both)
        after = status(alice)
        assert after["state"] == "training" and not after["paused"], after
        assert after["peer_id"] == before["peer_id"] and after["pid"] == alice.proc.pid
        log = alice.log.read_text()
        assert "pausing: paused by `volunteer pause`" in log and "resuming" in log
        resynced = [s for s in alice.steps() if s > stepped]
        assert min(resynced) > stepped + 1, "resumed from its old state instead of the run's"
    finally:
        codes = {v.name: stop(v.proc, within=40)[0] if v.alive() else v.proc.returncode for v in both}
        if backbone.proc is not None and backbone.proc.poll() is None:
            stop(backbone.proc, within=30)
    assert codes == {"alice": 0, "bob": 0}, alice.log.read_text()[-3000:]
    # the control socket is gone with the daemon: the commands say so in one line, exit 1
    gone = control(alice, "status")
    assert gone.returncode == 1 and "no volunteer runs" in gone.stderr, gone.stderr
    with LedgerStore.open(f"sqlite:///{backbone.dir / 'ledger.sqlite3'}") as store:
        sessions = store.sessions(before["peer_id"])
        assert sessions and all(s.end_reason == "leave" for s in sessions), sessions
    assert credited(backbone)["alice"] >= credit > 0  # the pause lost no credit


def test_a_rule_pauses_while_a_named_program_runs_and_resumes_after(tmp_path: Path) -> None:
    """``--pause-while``: the watcher sees the program in /proc, pauses (debounced), and resumes once it
    exits; the process and its peer id stay."""
    game = tmp_path / "dedloc-game"  # a program of our own name: /proc/PID/comm is "dedloc-game"
    shutil.copy("/bin/sleep", game)
    backbone = Backbone(tmp_path)
    backbone.start()
    alice = Volunteer(tmp_path, "alice", backbone, "--pause-while", "dedloc-game")
    running: subprocess.Popen[str] | None = None
    try:
        wait_for(lambda: alice.step() >= 2, "alice at step 2", 120, [alice])
        before = status(alice)
        assert not before["paused"] and before["policy"]["run"], before
        running = subprocess.Popen([str(game), "300"], text=True)
        wait_for(lambda: status(alice)["state"] == "paused", "alice paused by the rule", 60, [alice])
        during = status(alice)
        assert during["reason"] == "dedloc-game is running" and not during["manual"], during
        assert during["peer_id"] == before["peer_id"] and during["pid"] == alice.proc.pid
        stepped = alice.step()
        running.kill()
        running.wait()
        wait_for(lambda: alice.step() > stepped, "a step after the program exited", 120, [alice])
        assert status(alice)["state"] == "training"
    finally:
        if running is not None and running.poll() is None:
            running.kill()
            running.wait()
        code = stop(alice.proc, within=40)[0] if alice.alive() else alice.proc.returncode
        if backbone.proc is not None and backbone.proc.poll() is None:
            stop(backbone.proc, within=30)
    assert code == 0, alice.log.read_text()[-3000:]
    assert "policy: pause (dedloc-game is running)" in alice.log.read_text()
