"""DHT benchmark: N nodes on loopback (all in this process), K sequential stores and gets.

Prints one JSON object: store/get latency medians and p95 (ms), success rate, and the startup time of
each joining node from creating it to its first successful lookup (its bootstrap self-lookup), with
interpreter start and imports excluded. The workload mirrors ../shared/anchors/hivemind_bench.py:
stores of 64-byte values on node 1, gets on node N-1 (which never stored them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.auth.authority import Authority, pin_run_id
from shared.auth.guard import RunAuthenticator
from shared.auth.keys import Identity
from shared.dht.node import DHTConfig
from shared.node import Node, open_node


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    lo, hi = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    return {
        "median_ms": statistics.median(ms),
        "p95_ms": percentile(ms, 0.95),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


async def bench(nodes: int, keys: int, value_bytes: int, pinned: bool, replicas: int) -> dict[str, object]:
    started: list[float] = []
    authority = Authority(Identity.generate()) if pinned else None
    run_id = pin_run_id("bench", authority) if authority else "bench"

    def authenticator(identity: Identity) -> RunAuthenticator | None:
        if authority is None:
            return None
        token = authority.issue_token(
            run_id, "bench", identity.peer_id, identity.public_key_bytes, time.time(), 3600
        )
        return RunAuthenticator(run_id, authority.key, identity, token)

    async with AsyncExitStack() as stack:
        swarm: list[Node] = []
        for i in range(nodes):
            identity = Identity.generate()
            t0 = time.perf_counter()
            initial = [swarm[0].host.listen_addrs[0]] if swarm else []
            node = await stack.enter_async_context(
                open_node(
                    identity,
                    run_id,
                    "volunteer",
                    listen=["/ip4/127.0.0.1/tcp/0"],
                    initial_peers=initial,
                    authenticator=authenticator(identity),
                    dht_config=DHTConfig(num_replicas=replicas),
                )
            )
            if i:
                started.append(time.perf_counter() - t0)
            swarm.append(node)
        writer, reader = swarm[1].dht, swarm[-1].dht
        value = os.urandom(value_bytes // 2).hex().encode()[:value_bytes]
        store_times, get_times = [], []
        stored = found = 0
        for i in range(keys):
            t0 = time.perf_counter()
            replicas = await writer.store(f"bench-key-{i}", value, time.time() + 600)
            store_times.append(time.perf_counter() - t0)
            stored += replicas > 0
        for i in range(keys):
            t0 = time.perf_counter()
            result = await reader.get(f"bench-key-{i}")
            get_times.append(time.perf_counter() - t0)
            found += result is not None and result.value == value
        return {
            "nodes": nodes,
            "keys": keys,
            "value_bytes": value_bytes,
            "nodes_share_one_process": True,
            "authenticated": pinned,
            "replicas": replicas,
            "startup_s_median": statistics.median(started),
            "startup_s_max": max(started),
            "store_ms_median": statistics.median(store_times) * 1e3,
            "get_ms_median": statistics.median(get_times) * 1e3,
            "store": summary(store_times) | {"success_rate": stored / keys},
            "get": summary(get_times) | {"success_rate": found / keys},
            "success_rate": (stored + found) / (2 * keys),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--value-bytes", type=int, default=64)
    parser.add_argument("--pinned", action="store_true", help="a pinned run: every RPC signed and checked")
    parser.add_argument(
        "--replicas", type=int, default=5, help="nodes per record (5, as the reference stores)"
    )
    args = parser.parse_args()
    if args.nodes < 2 or args.keys < 1:
        parser.error("need at least 2 nodes and 1 key")
    result = trio.run(bench, args.nodes, args.keys, args.value_bytes, args.pinned, args.replicas)
    result["loadavg"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
