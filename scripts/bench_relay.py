"""Relayed vs direct transfer, and hole-punch time, across real NAT (issue 14's benchmark).

Builds ``tests/natnet.py``'s network with three public hosts and two homes, each behind its own MASQUERADE
router (cone-like)::

    public 198.51.100.0/24:  R (relay, pub0)   P (public target, pub1)   Q (public dialer, pub2)
    home 0 behind router 0:  D (dialer)        home 1 behind router 1:  T (target)

Every node is one process in its namespace (``tests/relaynode.py``): a :class:`~shared.net.host.Host`
serving an echo RPC and a ``sink`` bulk topic; P and T hold reservations at R. Per repeat (a fresh dialer
process each time, so every measurement includes its own connection set-up separately):

* ``direct``: Q -> P at P's own address: ``--mb`` MiB to ``sink`` (one bulk transfer), ``--rpcs`` echo calls;
* ``relayed_public``: Q -> P through R (P's relayed address): the relay's cost alone, both ends public;
* ``relayed``: D -> T through R, the case relaying exists for (both ends behind NAT);
* ``punch``: D -> T through R, then a hole punch; ``punch_ms`` is the punch call's duration on D (two
  observed-address requests, the exchange, ``rtt/2`` and the simultaneous open plus TLS), and the echo
  calls are timed again over the punched connection, and the transfer is sent over a punched bulk
  connection (``punched_MBps``).

No link is shaped: the numbers say what the relay's splice costs on this machine (CPU: every relayed byte
is copied through user space once more, and the two TLS ends, relay and dialer share the same cores), not
what an Internet path would give. Throughput is ``MiB * 2**20 / 1e6 / seconds`` (MB/s) of one transfer,
including its header/ack round trip; latency is the median (and worst) of sequential echo calls on an
established connection. Prints one JSON object: ``direct_MBps``, ``relayed_MBps``, ``relayed_public_MBps``,
``punch_ms`` (medians over ``--repeats``), their worst cases, and the RPC latencies.

Needs root, iproute2 and iptables; exits with a one-line error (status 2) where they are unavailable.

Example::

    python scripts/bench_relay.py --mb 64 --rpcs 50 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.natnet import Home, nat_available, nat_network  # noqa: E402
from tests.netns import NetnsHost  # noqa: E402

TIMEOUT_S = 300


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@contextmanager
def _node(host: NetnsHost, *args: str) -> Iterator[dict[str, Any]]:
    argv = [sys.executable, "-m", "tests.relaynode", *args, "--listen", host.address]
    with host.popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env()
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdin is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{args[0]} on {host.name} exited with {proc.wait(TIMEOUT_S)}")
            yield json.loads(line)
            proc.stdin.close()
            proc.stdout.read()
            proc.wait(TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _dial(host: NetnsHost, *args: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "tests.relaynode", "dial", *args, "--listen", host.address]
    out = host.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT, env=_env(), check=False)
    if out.returncode != 0:
        raise RuntimeError(f"dial {' '.join(args)} failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _summary(values: list[float], worst: str) -> dict[str, float]:
    pick = min if worst == "min" else max
    return {"median": statistics.median(values), "worst": pick(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="MiB per bulk transfer")
    parser.add_argument("--rpcs", type=int, default=50, help="echo calls timed per connection")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    reason = nat_available()
    if reason is not None:
        print(f"bench_relay: cannot build NAT namespaces: {reason}", file=sys.stderr)
        sys.exit(2)
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "relayed_public": [], "relayed": [], "punch": []}
    with nat_network(public=3, homes=[Home(), Home()]) as net, ExitStack() as stack:
        r_host, p_host, q_host = net.public
        d_host, t_host = net.homes[0].hosts[0], net.homes[1].hosts[0]
        relay = stack.enter_context(_node(r_host, "relay"))
        public = stack.enter_context(_node(p_host, "target", "--relay", relay["addr"]))
        home = stack.enter_context(_node(t_host, "target", "--relay", relay["addr"]))
        load = ("--rpcs", str(args.rpcs), "--bulk-mb", str(args.mb))
        for _ in range(args.repeats):
            runs["direct"].append(_dial(q_host, "--target", public["addr"], *load))
            runs["relayed_public"].append(_dial(q_host, "--target", public["relayed"], *load))
            runs["relayed"].append(_dial(d_host, "--target", home["relayed"], *load))
            punch = ("--relay", relay["addr"], *load, "--punch")
            runs["punch"].append(_dial(d_host, "--target", home["relayed"], *punch))
    for name in ("direct", "relayed_public", "relayed"):
        expected = "direct" if name == "direct" else "relayed"
        if any(run["kind"] != expected for run in runs[name]):
            raise RuntimeError(f"{name}: connections were {[run['kind'] for run in runs[name]]}")
    punched = [run for run in runs["punch"] if run.get("punched")]
    out: dict[str, Any] = {
        "mb": args.mb,
        "repeats": args.repeats,
        "unshaped": True,
        "direct_MBps": statistics.median(r["bulk_MBps"] for r in runs["direct"]),
        "relayed_MBps": statistics.median(r["bulk_MBps"] for r in runs["relayed"]),
        "relayed_public_MBps": statistics.median(r["bulk_MBps"] for r in runs["relayed_public"]),
        "punch_ms": statistics.median(r["punch_ms"] for r in punched) if punched else None,
        "punch_successes": len(punched),
        "punched_MBps": statistics.median(r["bulk_MBps_after"] for r in punched) if punched else None,
        "worst": {
            "direct_MBps": min(r["bulk_MBps"] for r in runs["direct"]),
            "relayed_MBps": min(r["bulk_MBps"] for r in runs["relayed"]),
            "relayed_public_MBps": min(r["bulk_MBps"] for r in runs["relayed_public"]),
            "punch_ms": max(r["punch_ms"] for r in punched) if punched else None,
        },
        "rpc_ms": {
            name: _summary([r["rpc_ms_median"] for r in runs[name]], "max")
            for name in ("direct", "relayed_public", "relayed")
        },
        "rpc_ms_punched": _summary([r["rpc_ms_median_after"] for r in punched], "max") if punched else None,
        "connect_ms": {name: _summary([r["connect_ms"] for r in runs[name]], "max") for name in runs},
    }
    out["relayed_vs_direct"] = out["relayed_MBps"] / out["direct_MBps"]
    out["rpc_added_ms"] = out["rpc_ms"]["relayed"]["median"] - out["rpc_ms"]["direct"]["median"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
