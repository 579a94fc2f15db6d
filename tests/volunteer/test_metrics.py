"""The volunteer's metric families (:mod:`volunteer.metrics`): valid Prometheus names and text, counters
named ``_total`` and summed across sessions, hostile label values escaped, and ``--metrics-listen`` a
config key like every flag."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
from hypothesis import given
from hypothesis import strategies as st

from shared.errors import ConfigError
from shared.metrics_server import parse_listen
from shared.node import NodeStatus
from shared.prometheus import render
from tests.backbone.dashboard_seed import parse_metrics
from volunteer.cli import app
from volunteer.config import join_defaults
from volunteer.metrics import REACHABILITY_MODES, TrainingNumbers, volunteer_families

PROMETHEUS_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
HOSTILE = 'ev"il\\run\nwith } and {x="y"}'


def node_status(**changes: object) -> NodeStatus:
    fields: dict[str, object] = {
        "run_id": "my-run@abc",
        "peer_id": "12D3KooWpeer",
        "role": "volunteer",
        "listen_addrs": ["/ip4/127.0.0.1/tcp/4001"],
        "routing_table_size": 3,
        "connected_peers": 2,
        "dht_size_estimate": 4,
        "members_online": 3,
        "rpc_latency_ms": 12.5,
        "bytes_sent": 1000,
        "bytes_received": 2000,
        "uptime_s": 42.0,
        "updated_at": 0.0,
        "tolerated": {"presence publish": 1},
        "reachability": "direct",
        "links": {"direct": 2},
        "relay_slots": 4,
        "relay_reservations": 1,
        "rpc_sent_by_kind": {"dht.find_value": 300, "dht.store": 500},
    }
    fields.update(changes)
    return NodeStatus(**fields)  # type: ignore[arg-type]


TRAINING = TrainingNumbers(
    step=7,
    steps=5,
    samples=320,
    samples_per_second=88.5,
    rounds=5,
    failed_rounds=1,
    last_round_seconds=0.25,
    reports_sent=2,
    reports_pending=1,
    measured=True,
)


def page(
    node: NodeStatus | None = None, training: TrainingNumbers = TRAINING, **kw: object
) -> dict[str, Any]:
    options: dict[str, object] = {"role": "trainer", "state": "training", "paused": False, "version": "1.0"}
    options.update(kw)
    text = render(volunteer_families(node or node_status(), training, **options))  # type: ignore[arg-type]
    return parse_metrics(text)


def value(parsed: dict[str, Any], name: str, **labels: str) -> float:
    for got, number in parsed[name]["samples"]:
        if got == labels:
            return float(number)
    raise AssertionError(f"{name}{labels} not in {parsed[name]['samples']}")


def test_names_follow_prometheus_conventions() -> None:
    parsed = page()
    assert parsed, "no families"
    for name, family in parsed.items():
        assert PROMETHEUS_NAME.match(name) and name.startswith("dedloc_volunteer_"), name
        assert family["help"], name
        assert (family["type"] == "counter") == name.endswith("_total"), name
        assert not re.search(r"_(ms|milliseconds|kb|mb|kib|mib|minutes|hours)(_|$)", name), name
    expected = {
        "dedloc_volunteer_step",
        "dedloc_volunteer_steps_total",
        "dedloc_volunteer_samples_total",
        "dedloc_volunteer_samples_per_second",
        "dedloc_volunteer_averaging_rounds_total",
        "dedloc_volunteer_averaging_failures_total",
        "dedloc_volunteer_last_averaging_seconds",
        "dedloc_volunteer_network_sent_bytes_total",
        "dedloc_volunteer_network_received_bytes_total",
        "dedloc_volunteer_rpc_sent_bytes_total",
        "dedloc_volunteer_peers_connected",
        "dedloc_volunteer_reachability",
        "dedloc_volunteer_paused",
        "dedloc_volunteer_relay_reservations",
        "dedloc_volunteer_info",
    }
    assert expected <= set(parsed), expected - set(parsed)


def test_values_come_from_the_node_and_the_sessions() -> None:
    parsed = page()
    assert value(parsed, "dedloc_volunteer_step") == 7
    assert value(parsed, "dedloc_volunteer_steps_total") == 5
    assert value(parsed, "dedloc_volunteer_samples_total") == 320
    assert value(parsed, "dedloc_volunteer_averaging_failures_total") == 1
    assert value(parsed, "dedloc_volunteer_last_averaging_seconds") == 0.25
    assert value(parsed, "dedloc_volunteer_rpc_latency_seconds") == 0.0125  # base unit, not ms
    assert value(parsed, "dedloc_volunteer_network_received_bytes_total") == 2000
    assert value(parsed, "dedloc_volunteer_rpc_sent_bytes_total", kind="dht.store") == 500
    assert value(parsed, "dedloc_volunteer_rpc_sent_bytes_total", kind="dht.find_value") == 300
    assert value(parsed, "dedloc_volunteer_paused") == 0
    assert value(parsed, "dedloc_volunteer_reachability", mode="direct") == 1
    assert sum(n for _, n in parsed["dedloc_volunteer_reachability"]["samples"]) == 1
    assert {lab["mode"] for lab, _ in parsed["dedloc_volunteer_reachability"]["samples"]} == set(
        REACHABILITY_MODES
    )
    info = parsed["dedloc_volunteer_info"]["samples"]
    assert info == [
        ({"run_id": "my-run@abc", "peer_id": "12D3KooWpeer", "role": "trainer", "version": "1.0"}, 1)
    ]
    assert value(page(paused=True, state="paused"), "dedloc_volunteer_paused") == 1


def test_a_peer_that_never_trained_shows_no_training_families() -> None:
    parsed = page(
        training=TrainingNumbers(), role="aggregator", node=node_status(reachability="", rpc_latency_ms=None)
    )
    assert not any(name in parsed for name in ("dedloc_volunteer_step", "dedloc_volunteer_steps_total"))
    assert (
        "dedloc_volunteer_reachability" not in parsed and "dedloc_volunteer_rpc_latency_seconds" not in parsed
    )
    assert value(parsed, "dedloc_volunteer_peers_connected") == 2


def test_hostile_label_values_are_escaped_and_parse_back() -> None:
    node = node_status(run_id=HOSTILE, tolerated={HOSTILE: 3}, links={"direct": 1})
    parsed = page(node, state=HOSTILE)
    assert parsed["dedloc_volunteer_info"]["samples"][0][0]["run_id"] == HOSTILE
    assert value(parsed, "dedloc_volunteer_state", state=HOSTILE) == 1
    assert value(parsed, "dedloc_volunteer_tolerated_failures_total", site=HOSTILE) == 3


numbers = st.builds(
    TrainingNumbers,
    step=st.none() | st.integers(0, 10**6),
    steps=st.integers(0, 10**6),
    samples=st.integers(0, 10**9),
    samples_per_second=st.none() | st.floats(0, 1e6),
    rounds=st.integers(0, 10**6),
    failed_rounds=st.integers(0, 10**6),
    last_round_seconds=st.none() | st.floats(0, 1e3),
    reports_sent=st.integers(0, 10**6),
    reports_pending=st.integers(0, 100),
    measured=st.booleans(),
)


@given(st.lists(numbers, max_size=6))
def test_counters_add_up_across_sessions_and_gauges_are_the_newest(sessions: list[TrainingNumbers]) -> None:
    total = TrainingNumbers()
    for session in sessions:
        before = total
        total = total.then(session)
        for counter in ("steps", "samples", "rounds", "failed_rounds", "reports_sent"):
            assert getattr(total, counter) == getattr(before, counter) + getattr(session, counter)
        assert total.step == (session.step if session.step is not None else before.step)
        assert total.reports_pending == session.reports_pending
    assert total.then(None) == total
    assert total.measured == any(s.measured for s in sessions)


def test_metrics_listen_is_a_config_key_and_an_environment_variable(tmp_path: Path) -> None:
    join = typer.main.get_command(app).commands["join"]  # type: ignore[attr-defined]
    (tmp_path / "volunteer.toml").write_text('metrics-listen = "127.0.0.1:9101"\n')
    argv = ["join", "--data-dir", str(tmp_path)]
    assert join_defaults(join, argv, {})["metrics_listen"] == "127.0.0.1:9101"
    assert join_defaults(join, argv, {"VOLUNTEER_METRICS_LISTEN": "9102"})["metrics_listen"] == "9102"
    assert parse_listen("9102") == ("127.0.0.1", 9102)
    with pytest.raises(ConfigError, match="--metrics-listen"):
        parse_listen("example.org:9101")
