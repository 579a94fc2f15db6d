"""Issue 14 item 3 across real NAT (tests/natnet.py): a relay killed mid-run makes its clients fall back to
another relay. The backbone relays for two NATed volunteers; a public volunteer started with ``--relay``
also offers slots and publishes its relay record in the DHT. The backbone is SIGKILLed mid-run: the NATed
volunteers reserve at the public volunteer at once (relayed again, now through it) and keep training
with it, every step with one fingerprint."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shared.relays import VOLUNTEER_RELAY_LIMITS
from tests.natnet import Home, nat_network, require_nat

from . import test_nat_training
from .procs import stop
from .test_aux_aggregation import EVERY_STEP
from .test_nat_training import Backbone, Volunteer, wait_for
from .test_training import assert_identical

pytestmark = [pytest.mark.slow, pytest.mark.netns]


def _relay_ips(v: Volunteer) -> list[str]:
    """The IPs of the relays ``v`` advertises a relayed address through."""
    addrs = v.status().get("advertised_addrs", [])
    return [a.split("/tcp/")[0].removeprefix("/ip4/") for a in addrs if "/p2p-circuit/" in a]


def test_a_relay_killed_mid_run_makes_its_clients_fall_back_to_another_relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_nat()
    monkeypatch.setattr(test_nat_training, "MANIFEST", EVERY_STEP)
    with nat_network(public=2, homes=[Home(), Home()]) as net:
        backbone = Backbone(tmp_path, net.public[0])
        alice = Volunteer(tmp_path, "alice", net.public[1], backbone, "--relay")
        bob = Volunteer(tmp_path, "bob", net.homes[0].hosts[0], backbone)
        carol = Volunteer(tmp_path, "carol", net.homes[1].hosts[0], backbone)
        volunteers = [alice, bob, carol]
        natted = [bob, carol]
        try:
            wait_for(
                lambda: (
                    all(_relay_ips(v) == [net.public[0].address] for v in natted)
                    and alice.status().get("relay_slots") == VOLUNTEER_RELAY_LIMITS.max_reservations
                    and all(v.step() >= 3 for v in volunteers)
                ),
                "NATed volunteers relayed by the backbone, alice relaying, everyone at step 3",
                240,
                volunteers,
            )
            assert alice.status()["reachability"] == "direct"
            killed = time.monotonic()
            backbone.proc.kill()
            backbone.proc.communicate()
            wait_for(
                lambda: all(_relay_ips(v) == [net.public[1].address] for v in natted),
                "the NATed volunteers relayed through alice",
                60,
                volunteers,
            )
            print(f"relayed through alice {time.monotonic() - killed:.1f} s after the backbone was killed")
            assert all(v.status()["reachability"] == "relayed" for v in natted)
            wait_for(
                lambda: alice.status().get("relay_reservations") == 2,
                "alice holds both slots",
                30,
                volunteers,
            )
            target = max(v.step() for v in volunteers) + 3
            wait_for(lambda: all(v.step() >= target for v in volunteers), f"all at {target}", 180, volunteers)
            assert assert_identical(volunteers) >= target  # type: ignore[arg-type]
            assert all(_relay_ips(v) == [net.public[1].address] for v in natted)
        finally:
            results = {v.name: stop(v.proc, within=10) for v in volunteers if v.alive()}
            if backbone.proc.poll() is None:
                stop(backbone.proc, within=30)
        for name, (code, _, _) in results.items():
            log = (tmp_path / name / "volunteer.log").read_text()[-3000:]
            assert code == 0, f"{name} exited with {code}: {log}"
