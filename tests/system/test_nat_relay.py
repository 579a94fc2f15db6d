"""Issue 14 across real NAT with relays (tests/natnet.py): two volunteers behind separate cone NATs hold
relay slots at the public backbone, advertise relayed addresses, may aggregate (the LP bounds their
slices by the relay), punch direct links between each other, and train with identical fingerprints; nobody
dials an address it cannot reach."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.natnet import Home, nat_network, require_nat

from . import test_nat_training
from .procs import stop
from .test_aux_aggregation import EVERY_STEP
from .test_nat_training import Backbone, Volunteer, _unreachable_dials, wait_for
from .test_training import assert_identical

pytestmark = [pytest.mark.slow, pytest.mark.netns]


def _averaged(v: Volunteer) -> int:
    path = v.dir / "steps.jsonl"
    if not path.exists():
        return 0
    return sum(json.loads(line)["peers"] >= 2 for line in path.read_text().splitlines() if line.strip())


def test_two_natted_volunteers_relayed_through_the_backbone_train_and_punch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_nat()
    monkeypatch.setattr(test_nat_training, "MANIFEST", EVERY_STEP)
    with nat_network(public=1, homes=[Home(), Home()]) as net:
        backbone = Backbone(tmp_path, net.public[0])  # aggregates and relays by default
        bob = Volunteer(tmp_path, "bob", net.homes[0].hosts[0], backbone)
        carol = Volunteer(tmp_path, "carol", net.homes[1].hosts[0], backbone)
        volunteers = [bob, carol]
        try:
            wait_for(
                lambda: all(v.status().get("reachability") == "relayed" for v in volunteers),
                "both volunteers relayed",
                120,
                volunteers,
            )
            for v, home in ((bob, net.homes[0]), (carol, net.homes[1])):
                status = v.status()
                assert [
                    a.split("/p2p-circuit/")[0].split("/tcp/")[0] for a in status["advertised_addrs"]
                ] == [f"/ip4/{net.public[0].address}"], status
                assert home.router.address in status["reachability_note"]
            wait_for(lambda: all(_averaged(v) >= 4 for v in volunteers), "4 averaged steps", 300, volunteers)
            assert assert_identical(volunteers) >= 4  # type: ignore[arg-type]

            # wherever the plan made them connect to each other (a slice of one is pushed to by the other,
            # through the relay), that link was punched: direct through both NATs, no longer relayed. (Whether
            # the LP gives them slices depends on the bandwidth they measured, so it is not asserted here;
            # tests/shared/net/test_punch_nat.py punches deterministically.)
            def settled() -> bool:
                links = [v.status().get("links", {}) for v in volunteers]
                return all(link.get("relayed", 0) == 0 for link in links)

            wait_for(settled, "no relayed link left unpunched", 60, volunteers)
            punched = [v.status().get("links", {}).get("punched", 0) for v in volunteers]
            print(f"punched links: {punched}")
            assert _unreachable_dials(net) == {
                **{h.name: {"private": 0} for h in net.public},
                **{h.name: {"loopback": 0} for home in net.homes for h in home.hosts},
            }
        finally:
            results = {v.name: stop(v.proc, within=30) for v in volunteers if v.alive()}
            stop(backbone.proc, within=30)
        for name, (code, _, _) in results.items():
            log = (tmp_path / name / "volunteer.log").read_text()[-3000:]
            assert code == 0, f"{name} exited with {code}: {log}"


def test_a_relay_killed_mid_run_leaves_its_clients_in_client_mode_and_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backbone relays for two NATed volunteers and a public one trains with them; the backbone is
    SIGKILLed mid-run: the NATed ones fall back to client mode (advertising nothing) and keep stepping with
    the public volunteer, every step with one fingerprint."""
    require_nat()
    monkeypatch.setattr(test_nat_training, "MANIFEST", EVERY_STEP)
    with nat_network(public=2, homes=[Home(), Home()]) as net:
        backbone = Backbone(tmp_path, net.public[0])
        alice = Volunteer(tmp_path, "alice", net.public[1], backbone)
        bob = Volunteer(tmp_path, "bob", net.homes[0].hosts[0], backbone)
        carol = Volunteer(tmp_path, "carol", net.homes[1].hosts[0], backbone)
        volunteers = [alice, bob, carol]
        natted = [bob, carol]
        try:
            wait_for(
                lambda: (
                    all(v.status().get("reachability") == "relayed" for v in natted)
                    and all(v.step() >= 3 for v in volunteers)
                ),
                "NATed volunteers relayed, everyone at step 3",
                240,
                volunteers,
            )
            backbone.proc.kill()
            backbone.proc.communicate()
            wait_for(
                lambda: all(v.status().get("reachability") == "client" for v in natted),
                "the NATed volunteers back in client mode",
                60,
                volunteers,
            )
            assert all(v.status()["advertised_addrs"] == [] for v in natted)
            target = max(v.step() for v in volunteers) + 3
            wait_for(lambda: all(v.step() >= target for v in volunteers), f"all at {target}", 180, volunteers)
            assert assert_identical(volunteers) >= target  # type: ignore[arg-type]
        finally:
            results = {v.name: stop(v.proc, within=30) for v in volunteers if v.alive()}
            if backbone.proc.poll() is None:
                stop(backbone.proc, within=30)
        for name, (code, _, _) in results.items():
            log = (tmp_path / name / "volunteer.log").read_text()[-3000:]
            assert code == 0, f"{name} exited with {code}: {log}"
