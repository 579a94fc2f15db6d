"""mDNS run discovery between network namespaces on one bridge (loopback has no multicast).

Each peer is ``tests/shared/mdns_peer.py`` in a subprocess inside a namespace built by ``tests.netns``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from zeroconf import ServiceInfo

from shared.auth.keys import Identity
from shared.discovery.mdns import SERVICE_TYPE, Advertisement, _parse_advertisement
from tests.netns import NetnsHost, lan, netns_available

REPO = Path(__file__).resolve().parents[2]
PEER_SCRIPT = Path(__file__).with_name("mdns_peer.py")
# Only advertised, never bound: nothing listens on it.
ADVERTISED_PORT = 41_234
REGISTER_DEADLINE_S = 10.0
STOP_DEADLINE_S = 5.0


@pytest.fixture
def _needs_netns() -> None:
    reason = netns_available()
    if reason is not None:
        pytest.skip(reason)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL if the child has not exited within a bounded wait."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def advertiser(host: NetnsHost, run_id: str, peer_id: str, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Run an advertiser on ``host`` until the block ends; yields once it printed "advertising"."""
    stderr_path = tmp_path / f"advertise-{host.name}.err"
    argv = [sys.executable, str(PEER_SCRIPT), "advertise", "--run", run_id, "--peer", peer_id]
    argv += ["--port", str(ADVERTISED_PORT), "--address", host.address]
    with stderr_path.open("w") as stderr:
        proc = host.popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=_child_env())
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], REGISTER_DEADLINE_S)
        line = proc.stdout.readline().strip() if ready else ""
        if line != "advertising":
            _stop(proc)
            pytest.fail(f"advertiser did not register (got {line!r}): {stderr_path.read_text()}")
        yield proc
    finally:
        _stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def discover(host: NetnsHost, run_id: str, wait: float) -> dict[str, Any]:
    """Run one discovery on ``host``; return the helper's JSON report."""
    argv = [sys.executable, str(PEER_SCRIPT), "discover", "--run", run_id, "--wait", str(wait)]
    proc = host.run(argv, capture_output=True, text=True, env=_child_env(), timeout=wait + 10.0)
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    leftover = [name for name in report["threads"] if "zeroconf" in name or "_run_loop" in name]
    assert leftover == [], f"zeroconf threads survived discover_run: {leftover}"
    return report


@pytest.mark.netns
@pytest.mark.usefixtures("_needs_netns")
def test_discover_run_finds_advertiser_in_other_netns(tmp_path: Path) -> None:
    peer_id = Identity.generate().peer_id
    with lan(2) as (host_a, host_b), advertiser(host_a, "run-x", peer_id, tmp_path) as proc:
        report = discover(host_b, "run-x", wait=5.0)
        _stop(proc)
        assert proc.returncode == 0, "the advertiser must exit cleanly on SIGTERM"
        assert proc.stdout is not None
        assert proc.stdout.read().strip() == "stopped"

    assert report["found"] == [
        {
            "run_id": "run-x",
            "peer_id": peer_id,
            "multiaddrs": [f"/ip4/{host_a.address}/tcp/{ADVERTISED_PORT}/p2p/{peer_id}"],
        }
    ]
    # It returns right after the first match (plus the sibling grace), not after the full wait.
    assert report["elapsed"] < 3.0


@pytest.mark.netns
@pytest.mark.usefixtures("_needs_netns")
def test_discover_run_ignores_other_runs(tmp_path: Path) -> None:
    peer_id = Identity.generate().peer_id
    with lan(2) as (host_a, host_b), advertiser(host_a, "alpha", peer_id, tmp_path):
        beta = discover(host_b, "beta", wait=2.0)
        # The advertiser was reachable all along: the same host finds it under its own run id.
        alpha = discover(host_b, "alpha", wait=5.0)

    assert beta["found"] == []
    assert 2.0 <= beta["elapsed"] < 3.0
    assert [ad["peer_id"] for ad in alpha["found"]] == [peer_id]


@pytest.mark.netns
@pytest.mark.usefixtures("_needs_netns")
def test_discover_run_returns_empty_quickly_without_advertisers() -> None:
    with lan(1) as (host,):
        report = discover(host, "gamma", wait=1.0)

    assert report["found"] == []
    assert 1.0 <= report["elapsed"] < 2.0


GOOD_PEER = Identity.generate().peer_id


@pytest.mark.parametrize(
    ("properties", "port"),
    [
        pytest.param({b"v": b"2", b"run": b"r", b"peer": GOOD_PEER.encode()}, 1234, id="future-version"),
        pytest.param({b"run": b"r", b"peer": GOOD_PEER.encode()}, 1234, id="no-version"),
        pytest.param({b"v": b"1", b"run": b"r", b"peer": b"nonsense"}, 1234, id="bad-peer-id"),
        pytest.param({b"v": b"1", b"run": b"r", b"peer": b"\xff\xfe"}, 1234, id="peer-not-utf8"),
        pytest.param({b"v": b"1", b"run": b"\xff", b"peer": GOOD_PEER.encode()}, 1234, id="run-not-utf8"),
        pytest.param({b"v": None, b"run": b"r", b"peer": None}, 1234, id="valueless-keys"),
        pytest.param({b"v": b"1", b"run": b"r", b"peer": GOOD_PEER.encode()}, 0, id="port-zero"),
        pytest.param({b"v": b"1", b"run": b"other", b"peer": GOOD_PEER.encode()}, 1234, id="other-run"),
    ],
)
def test_parse_advertisement_skips_garbage_txt_records(
    properties: dict[bytes, bytes | None], port: int
) -> None:
    info = ServiceInfo(
        SERVICE_TYPE, f"junk.{SERVICE_TYPE}", port=port, properties=properties, parsed_addresses=["10.0.0.7"]
    )
    assert _parse_advertisement(info, "r") is None


def test_parse_advertisement_builds_multiaddrs_and_drops_undialable_addresses() -> None:
    properties = {b"v": b"1", b"run": b"r", b"peer": GOOD_PEER.encode()}
    addresses = ["10.0.0.7", "fe80::1", "2001:db8::5"]
    info = ServiceInfo(
        SERVICE_TYPE, f"x.{SERVICE_TYPE}", port=4001, properties=properties, parsed_addresses=addresses
    )
    assert _parse_advertisement(info, "r") == Advertisement(
        run_id="r",
        peer_id=GOOD_PEER,
        multiaddrs=(f"/ip4/10.0.0.7/tcp/4001/p2p/{GOOD_PEER}", f"/ip6/2001:db8::5/tcp/4001/p2p/{GOOD_PEER}"),
    )


def test_parse_advertisement_of_a_pinned_run_requires_its_authority_key() -> None:
    import base58

    from shared.auth.authority import Authority, pin_run_id
    from shared.auth.keys import Identity

    authority = Authority(Identity.generate())
    run = pin_run_id("r", authority)
    key = base58.b58encode(authority.identity.public_key_bytes)
    stranger = base58.b58encode(Identity.generate().public_key_bytes)

    def parse(ak: bytes | None) -> Advertisement | None:
        properties = {b"v": b"1", b"run": run.encode(), b"peer": GOOD_PEER.encode()}
        if ak is not None:
            properties[b"ak"] = ak
        info = ServiceInfo(
            SERVICE_TYPE, f"x.{SERVICE_TYPE}", port=4001, properties=properties, parsed_addresses=["10.0.0.7"]
        )
        return _parse_advertisement(info, run)

    assert parse(key) is not None
    assert parse(stranger) is None  # a stranger on the LAN cannot hijack the run id
    assert parse(None) is None
    assert parse(b"not base58 0OIl") is None
