"""Issue 14 end to end across real NAT (tests/natnet.py): a public backbone, a public volunteer and
volunteers in homes behind MASQUERADE routers train the built-in task together; the NATed ones find out they
are in client mode and say so; nobody dials an address it cannot reach; the backbone checkpoints a state
only a NATed volunteer holds, and a public newcomer catches up from it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.natnet import Home, NatNetwork, nat_network, require_nat, syn_counts
from tests.netns import NetnsHost

from .procs import ENV, cli, invite, read_line, step_fingerprints, stop
from .test_training import MANIFEST, assert_identical

pytestmark = [pytest.mark.slow, pytest.mark.netns]

PORT, API_PORT = 4001, 8443


class Backbone:
    def __init__(self, root: Path, host: NetnsHost, *extra: str) -> None:
        self.host = host
        self.dir = root / "bb"
        self.dir.mkdir()
        (root / "manifest.toml").write_text(MANIFEST)
        argv = cli(
            "backbone", "start", "--run-id", "nat-e2e", "--data-dir", str(self.dir),
            "--listen", f"/ip4/{host.address}/tcp/{PORT}", "--api-listen", f"{host.address}:{API_PORT}",
            "--manifest", str(root / "manifest.toml"), "--no-mdns", *extra,
        )  # fmt: skip
        with (self.dir / "backbone.log").open("a") as log:
            self.proc = subprocess.Popen(
                host.command(argv), stdout=subprocess.PIPE, stderr=log, text=True, env=ENV
            )
        self.address = read_line(self.proc, within=90).removeprefix("listening on ")
        self.run_id = ""
        while not self.run_id:
            line = read_line(self.proc, within=60)
            if line.startswith("run id "):
                self.run_id = line.removeprefix("run id ")

    def invite(self, username: str) -> str:
        return invite(self.dir, username)

    def checkpoint_steps(self) -> list[int]:
        index = self.dir / "checkpoints" / "index.json"
        try:
            return sorted(int(entry["step"]) for entry in json.loads(index.read_text())["entries"])
        except (FileNotFoundError, json.JSONDecodeError):
            return []


class Volunteer:
    def __init__(self, root: Path, name: str, host: NetnsHost, backbone: Backbone, *extra: str) -> None:
        self.name, self.host = name, host
        self.dir = root / name
        self.dir.mkdir()
        argv = cli(
            "volunteer", "join", backbone.run_id, "--data-dir", str(self.dir),
            "--initial-peer", backbone.address, "--no-panel", "--threads", "1",
            "--invite", backbone.invite(name), *extra,
        )  # fmt: skip
        self.log = self.dir / "volunteer.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                host.command(argv), stdout=log, stderr=subprocess.STDOUT, text=True, env=ENV
            )

    def steps(self) -> dict[int, str]:
        """step -> parameter fingerprint, as written after each step this volunteer took."""
        return step_fingerprints(self.dir)

    def step(self) -> int:
        return max(self.steps(), default=0)

    def status(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.dir / "status.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def alive(self) -> bool:
        return self.proc.poll() is None


def wait_for(condition: Callable[[], bool], what: str, within: float, volunteers: list[Volunteer]) -> None:
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return
        for v in volunteers:
            if not v.alive():
                raise AssertionError(f"{v.name} exited with {v.proc.returncode}: {v.log.read_text()[-3000:]}")
        time.sleep(0.5)
    logs = "\n".join(f"--- {v.name}: {v.log.read_text()[-2500:]}" for v in volunteers)
    raise AssertionError(f"timed out waiting for {what}; steps {[v.step() for v in volunteers]}\n{logs}")


def _unreachable_dials(net: NatNetwork) -> dict[str, dict[str, int]]:
    """SYNs nobody could answer: public hosts to private addresses, home hosts to their own loopback."""
    out = {h.name: {"private": syn_counts(h)["private"]} for h in net.public}
    for home in net.homes:
        for h in home.hosts:
            out[h.name] = {"loopback": syn_counts(h)["loopback"]}
    return out


def test_natted_volunteers_train_with_public_ones_in_client_mode_and_dial_nowhere(tmp_path: Path) -> None:
    require_nat()
    with nat_network(public=3, homes=[Home(), Home()]) as net:
        backbone = Backbone(tmp_path, net.public[0], "--no-relay")  # client mode, not relayed: dial-backs
        alice = Volunteer(tmp_path, "alice", net.public[1], backbone)  # public
        bob = Volunteer(tmp_path, "bob", net.homes[0].hosts[0], backbone)  # behind NAT
        carol = Volunteer(tmp_path, "carol", net.homes[1].hosts[0], backbone)  # behind another NAT
        volunteers = [alice, bob, carol]
        everyone = list(volunteers)
        try:
            wait_for(
                lambda: all(v.step() >= 3 for v in volunteers), "3 volunteers at step 3", 240, volunteers
            )
            assert alice.status()["reachability"] == "direct"
            # the public volunteer advertises its public address only (no loopback, no other interface)
            assert [a.split("/tcp/")[0] for a in alice.status()["advertised_addrs"]] == [
                f"/ip4/{net.public[1].address}"
            ]
            for v, home in ((bob, net.homes[0]), (carol, net.homes[1])):
                status = v.status()
                assert status["reachability"] == "client", status
                assert status["advertised_addrs"] == []
                assert home.router.address in status["reachability_note"]  # "seen as <the router's IP>"
                assert "client mode" in v.log.read_text()

            # the state lives behind NAT only: the public volunteer and carol leave, bob trains on alone
            for leaving in (alice, carol):
                assert stop(leaving.proc, within=40)[0] == 0
                volunteers.remove(leaving)
            target = bob.step() + 3
            wait_for(lambda: bob.step() >= target, f"bob alone at {target}", 180, volunteers)
            wait_for(
                lambda: any(s >= target - 1 for s in backbone.checkpoint_steps()),
                f"a checkpoint of step >= {target - 1} from a NATed peer only",
                120,
                volunteers,
            )
            # a public newcomer catches up from that state
            dave = Volunteer(tmp_path, "dave", net.public[2], backbone)
            everyone.append(dave)
            volunteers.append(dave)
            wait_for(lambda: dave.step() >= target + 2, "dave caught up", 180, volunteers)
            assert min(dave.steps()) > 1  # it downloaded the state instead of starting over
            assert_identical(everyone)
            assert _unreachable_dials(net) == {
                **{h.name: {"private": 0} for h in net.public},
                **{h.name: {"loopback": 0} for home in net.homes for h in home.hosts},
            }
        finally:
            results = {v.name: stop(v.proc, within=10) for v in everyone if v.alive()}
            stop(backbone.proc, within=30)
        for name, (code, _, _) in results.items():
            assert code == 0, (
                f"{name} exited with {code}: {(tmp_path / name / 'volunteer.log').read_text()[-3000:]}"
            )
