"""Issue 14 "done when", the aggregating backbone across real NAT (tests/natnet.py): two volunteers, each
behind its own MASQUERADE router, and a public backbone train together; both volunteers are in client
mode, so the backbone (an auxiliary aggregator by default) holds every slice, and nobody dials an
address it cannot reach."""

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
    """Steps ``v`` took in a group of three (both volunteers and the backbone)."""
    path = v.dir / "steps.jsonl"
    if not path.exists():
        return 0
    return sum(json.loads(line)["peers"] == 3 for line in path.read_text().splitlines() if line.strip())


def test_two_natted_volunteers_train_with_an_aggregating_public_backbone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_nat()
    monkeypatch.setattr(test_nat_training, "MANIFEST", EVERY_STEP)  # why: test_aux_aggregation.EVERY_STEP
    with nat_network(public=1, homes=[Home(), Home()]) as net:
        backbone = Backbone(tmp_path, net.public[0], "--no-relay")  # so both volunteers stay in client mode
        bob = Volunteer(tmp_path, "bob", net.homes[0].hosts[0], backbone)
        carol = Volunteer(tmp_path, "carol", net.homes[1].hosts[0], backbone)
        volunteers = [bob, carol]
        try:
            wait_for(
                lambda: all(_averaged(v) >= 3 for v in volunteers),
                "3 steps averaged by both NATed volunteers through the backbone",
                300,
                volunteers,
            )
            for v in volunteers:
                assert v.status()["reachability"] == "client", v.status()
            assert assert_identical(volunteers) >= 3  # type: ignore[arg-type]

            def aggregated() -> int:  # status.json is rewritten every second: it may lag a round behind
                try:
                    stats = json.loads((backbone.dir / "status.json").read_text())["aggregator"]
                except (FileNotFoundError, json.JSONDecodeError):
                    return 0
                return int(stats["rounds_aggregated"]) if stats else 0

            wait_for(lambda: aggregated() >= 3, "the backbone's statistics", 30, volunteers)
            assert _unreachable_dials(net) == {
                **{h.name: {"private": 0} for h in net.public},
                **{h.name: {"loopback": 0} for home in net.homes for h in home.hosts},
            }
        finally:
            results = {v.name: stop(v.proc, within=10) for v in volunteers if v.alive()}
            stop(backbone.proc, within=30)
        for name, (code, _, _) in results.items():
            log = (tmp_path / name / "volunteer.log").read_text()[-3000:]
            assert code == 0, f"{name} exited with {code}: {log}"
