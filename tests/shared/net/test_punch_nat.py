"""Relaying and hole punching across real NAT (tests/natnet.py): a relay on the public segment, a target
and a dialer each in its own home behind a MASQUERADE router that drops unsolicited inbound traffic.

Each node is a process in its namespace (tests/relaynode.py). With two cone-like NATs the punch succeeds
and the connection that replaces the relayed one runs straight between the two routers' public
addresses; behind a symmetric NAT (``--random-fully``) it fails and the peers stay relayed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.natnet import Home, NatNetwork, nat_network, require_nat
from tests.netns import NetnsHost

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 60


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@contextmanager
def node(host: NetnsHost, *args: str) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Start a serving node on ``host``; yield its ready line and a list that receives its final line."""
    argv = [sys.executable, "-m", "tests.relaynode", *args, "--listen", host.address]
    final: list[dict[str, Any]] = []
    with host.popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env()
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdin is not None
            line = proc.stdout.readline()
            assert line, f"{args[0]} on {host.name} exited: {proc.wait(TIMEOUT_S)}"
            yield json.loads(line), final
            proc.stdin.close()
            last = proc.stdout.readline()
            if last:
                final.append(json.loads(last))
            proc.wait(TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def dial(host: NetnsHost, *args: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "tests.relaynode", "dial", *args, "--listen", host.address]
    out = host.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT, env=_env(), check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@contextmanager
def homes(*kinds: Home) -> Iterator[NatNetwork]:
    require_nat()
    with nat_network(public=1, homes=kinds) as net:
        yield net


def _punch_between_homes(net: NatNetwork) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    relay_host, dialer_host, target_host = net.public[0], net.homes[0].hosts[0], net.homes[1].hosts[0]
    with node(relay_host, "relay") as (relay, relay_final):
        with node(target_host, "target", "--relay", relay["addr"]) as (target, target_final):
            load = ("--rpcs", "5", "--bulk-mb", "8", "--punch")
            result = dial(dialer_host, "--target", target["relayed"], "--relay", relay["addr"], *load)
        assert target_final, "the target printed no final line"
    assert relay_final, "the relay printed no final line"
    return result, target_final[0], relay_final[0]


def test_punch_between_two_cone_nats_gives_a_direct_connection() -> None:
    with homes(Home(), Home()) as net:
        result, target, relay = _punch_between_homes(net)
        dialer_nat, target_nat = net.homes[0].router.address, net.homes[1].router.address
        relay_ip = net.public[0].address

    assert result["kind"] == "relayed" and result["server_sees"] == "relayed"
    assert result["punched"] is True, result
    assert result["kind_after"] == "punched" and result["server_sees_after"] == "punched"
    peer_ip = result["socket_peer_after"].rpartition(":")[0]
    assert peer_ip == target_nat != relay_ip  # straight to the other home's router, not via the relay
    assert result["server_seen_from"].rpartition(":")[0] == relay_ip
    assert result["server_seen_from_after"].rpartition(":")[0] == dialer_nat
    assert target["punch"]["punched"] == 2  # the RPC and the bulk connection
    # the transfer after the punch went over a second punched connection (a bulk lane), not the relay
    assert result["punch_after_bulk"]["punched"] == 2 and result["bulk_MBps_after"] > 0
    assert relay["relay"]["circuits_granted"] == 1 and relay["relay"]["observed"] == 4
    assert relay["relay"]["bytes_relayed"] < 1 << 20


def test_punch_behind_a_symmetric_nat_fails_and_traffic_stays_relayed() -> None:
    with homes(Home(), Home(symmetric=True)) as net:
        result, target, relay = _punch_between_homes(net)
        relay_ip = net.public[0].address

    assert result["punched"] is False, result
    assert result["kind_after"] == "relayed" and result["server_sees_after"] == "relayed"
    assert result["socket_peer_after"].rpartition(":")[0] == relay_ip
    assert result["punch"]["failures"] == {"timeout": 1}
    assert result["punch_after_bulk"]["attempts"] == 1  # no bulk punch over an unpunched connection
    assert relay["relay"]["bytes_relayed"] > 8 << 20  # so the transfer went through the relay
    assert result["server_seen_from_after"].rpartition(":")[0] == relay_ip
    assert target["punch"]["punched"] == 0
    assert relay["relay"]["bytes_relayed"] > 0


def test_relayed_rpc_and_bulk_cross_two_nats() -> None:
    with homes(Home(), Home()) as net:
        relay_host, dialer_host, target_host = net.public[0], net.homes[0].hosts[0], net.homes[1].hosts[0]
        with node(relay_host, "relay") as (relay, relay_final):  # noqa: SIM117
            with node(target_host, "target", "--relay", relay["addr"]) as (target, _):
                result = dial(dialer_host, "--target", target["relayed"], "--rpcs", "3", "--bulk-mb", "8")

    assert result["kind"] == "relayed" and result["server_sees"] == "relayed"
    assert result["bulk_MBps"] > 0
    assert relay_final[0]["relay"]["bytes_relayed"] > 8 << 20
