"""The NAT test network itself (tests/natnet.py): homes reach out, nobody reaches in, ports behave."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.natnet import Home, nat_network, require_nat, syn_counts

# Listens on a port, prints it, then prints "ip:port" of every connection it accepts (one per line).
_OBSERVER = """
import socket, sys
srv = socket.socket()
srv.bind(("0.0.0.0", 0))
srv.listen(8)
srv.settimeout(30)
print(srv.getsockname()[1], flush=True)
for _ in range(int(sys.argv[1])):
    conn, addr = srv.accept()
    print(f"{addr[0]}:{addr[1]}", flush=True)
    conn.close()
"""

# Connects to argv[1]:argv[2] from local port argv[3] (0: any), prints "ok" or the error.
_DIALER = """
import socket, sys
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("0.0.0.0", int(sys.argv[3])))
sock.settimeout(float(sys.argv[4]))
try:
    sock.connect((sys.argv[1], int(sys.argv[2])))
    print("ok", sock.getsockname()[1])
except OSError as exc:
    print("failed", type(exc).__name__)
"""


def _dial(host, address: str, port: str, local_port: int = 0, timeout: float = 3.0) -> str:
    out = host.run(
        [sys.executable, "-c", _DIALER, address, port, str(local_port), str(timeout)],
        capture_output=True, text=True, timeout=timeout + 10, check=True,
    )  # fmt: skip
    return out.stdout.strip()


@contextmanager
def _observer(host, accepts: int) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A server on ``host`` printing ``ip:port`` of each of ``accepts`` connections; yields it, its port."""
    with host.popen(
        [sys.executable, "-c", _OBSERVER, str(accepts)], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        try:
            yield proc, proc.stdout.readline().strip()
        finally:
            proc.kill()


def test_homes_reach_out_but_nobody_reaches_in() -> None:
    require_nat()
    with nat_network(public=1, homes=[Home(hosts=2), Home()]) as net:
        server = net.public[0]
        home_a, home_b = net.homes
        with _observer(server, 2) as (proc, port):
            assert _dial(home_a.hosts[0], server.address, port).startswith("ok")
            assert _dial(home_b.hosts[0], server.address, port).startswith("ok")
            seen = [proc.stdout.readline().strip().rsplit(":", 1)[0] for _ in range(2)]
        # the server sees each home's router, never a private address
        assert seen == [home_a.router.address, home_b.router.address]
        # nothing gets in: not from the public segment, not from the other home
        inside = home_a.hosts[0]
        with _observer(inside, 1) as (_, lport):
            assert _dial(server, inside.address, lport, timeout=1.5) == "failed TimeoutError"
            assert _dial(server, home_a.router.address, lport, timeout=1.5) == "failed TimeoutError"
            assert _dial(home_b.hosts[0], home_a.router.address, lport, timeout=1.5) == "failed TimeoutError"
            # the same private address in the other home is another machine (nobody listens there)
            assert _dial(home_b.hosts[0], inside.address, lport, timeout=1.5).startswith("failed")
            # on its own LAN it is reachable
            assert _dial(home_a.hosts[1], inside.address, lport).startswith("ok")
        counts = syn_counts(server)
        assert counts["private"] >= 1 and counts["all"] >= counts["private"]
        assert syn_counts(home_a.hosts[0])["loopback"] == 0


@pytest.mark.parametrize("symmetric", [False, True])
def test_port_mapping_cone_vs_symmetric(symmetric: bool) -> None:
    """One local port seen from two public servers: the same public port behind the default NAT, a random
    one per connection behind the symmetric NAT (so hole punching can only work behind the first)."""
    require_nat()
    with nat_network(public=2, homes=[Home(symmetric=symmetric)]) as net:
        inside = net.homes[0].hosts[0]
        seen = []
        for server in net.public:
            with _observer(server, 1) as (proc, port):
                assert _dial(inside, server.address, port, local_port=40123).startswith("ok")
                seen.append(int(proc.stdout.readline().strip().rsplit(":", 1)[1]))
        if symmetric:
            assert seen[0] != seen[1] or seen[0] != 40123
        else:
            assert seen == [40123, 40123]
