"""Benchmark the adaptive-averaging program (shared.averaging.load_balance) on random heterogeneous peers.

Usage: scripts/bench_lp.py --peers N [--pairwise [--caps-mb LO,HI]] [--relayed F [--relay-cap-mb H]]
                           [--repeats R] [--seed S] [--batch B] [--gradient-mb M] [--time-limit SECONDS|none]

Each repeat draws a new group (seed, seed+1, ...) and times one plan_averaging call on it, after one warm-up
call that is not timed. A group: 60% GPU peers (samples/s log-uniform in [2, 100]) and 40% CPU-only peers;
30% fast links (download 50-125 MB/s, upload 20-125 MB/s) and 70% home links (download 2-12 MB/s, upload
0.5-5 MB/s); ~10% in client mode. With --pairwise, peers sit in 4 regions and every pair in different
regions gets caps drawn uniformly from --caps-mb (default 1-10 MB/s) each way; the home uploads usually bind
first, so try 0.05,0.5 for caps that bind. With --relayed F, each home-link peer not in client mode is, with
probability F, behind NAT and relayed by a random fast-link peer (not in client mode, not relayed itself;
none if there is no such peer), every relay with a slot limit of --relay-cap-mb MB/s if given (the
load_balance module docstring, "Relays"). --time-limit is plan_averaging's budget for the compute-set
search (default: its default; ``none``: search until proven optimal). Prints ONE JSON object: solve times
(ms: median, p95, min, worst), how each plan was found (methods, without their gap), the optimality gaps
(plans not proven optimal within the budget: how many, the largest, all of them), and a summary of the
first group's plan next to the all-reduce and best parameter-server plans of the same model. Targets
(DESIGN §5, not asserted): <= 10 ms at 64 peers, <= 1 s at 512, <= 1 s worst case at 64 with --pairwise.
HiGHS's MILP sometimes prints a debug line on stdout; it is sent to stderr here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.averaging.load_balance import (
    DEFAULT_TIME_LIMIT,
    PeerSpec,
    Plan,
    plan_all_reduce,
    plan_averaging,
    plan_parameter_server,
)

MB = 1e6


def random_group(
    n: int,
    rng: np.random.Generator,
    pairwise: bool,
    caps_mb: tuple[float, float],
    relayed: float = 0.0,
    relay_cap_mb: float | None = None,
) -> tuple[list[PeerSpec], dict[tuple[int, int], float] | None]:
    gpu = rng.random(n) < 0.6
    gpu[0] = True
    samples = np.where(gpu, np.exp(rng.uniform(np.log(2), np.log(100), n)), 0.0)
    fast = rng.random(n) < 0.3
    down = np.where(fast, rng.uniform(50, 125, n), rng.uniform(2, 12, n)) * MB
    up = np.where(fast, rng.uniform(20, 125, n), rng.uniform(0.5, 5, n)) * MB
    client = rng.random(n) < 0.1
    client[0] = False
    relay: list[int | None] = [None] * n
    hubs = np.flatnonzero(fast & ~client)
    if relayed > 0 and len(hubs):
        behind = ~fast & ~client & (rng.random(n) < relayed)
        for i in np.flatnonzero(behind):
            relay[i] = int(rng.choice(hubs))
    cap = None if relay_cap_mb is None else relay_cap_mb * MB
    peers = [
        PeerSpec(
            float(samples[i]),
            float(down[i]),
            float(up[i]),
            bool(client[i]),
            relay=relay[i],
            relay_capacity_bps=cap if i in relay else None,
        )
        for i in range(n)
    ]
    if not pairwise:
        return peers, None
    region = rng.integers(0, 4, n)
    caps = rng.uniform(*caps_mb, (n, n)) * MB
    pairs = {
        (i, j): float(caps[i, j]) for i in range(n) for j in range(n) if i != j and region[i] != region[j]
    }
    return peers, pairs


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Route file descriptor 1 to stderr (HiGHS writes debug lines there from C++)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    lo, hi = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def summary(plan: Plan) -> dict[str, object]:
    ranked = sorted(range(len(plan.fractions)), key=lambda i: -plan.fractions[i])
    return {
        "computing": sum(plan.compute),
        "aggregating": sum(f > 0 for f in plan.fractions),
        "top_fractions": [[i, round(plan.fractions[i], 4)] for i in ranked[:5] if plan.fractions[i] > 0],
        "steps_per_second": plan.steps_per_second,
        "averaging_seconds": plan.averaging_seconds,
        "compute_rate": plan.compute_rate,
        "comm_rate": plan.comm_rate,
        "method": plan.method,
        "gap": plan.gap,
    }


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def time_limit(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--pairwise", action="store_true")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=float, default=4096.0, help="target batch, samples")
    parser.add_argument("--gradient-mb", type=float, default=68.0, help="gradient size, MB (17M float32)")
    parser.add_argument(
        "--caps-mb", default="1,10", help="with --pairwise: range of inter-region caps, MB/s (default 1,10)"
    )
    parser.add_argument("--relayed", type=float, default=0.0, help="share of home peers relayed (default 0)")
    parser.add_argument("--relay-cap-mb", type=float, default=None, help="every relay's slot limit, MB/s")
    parser.add_argument(
        "--time-limit",
        type=time_limit,
        default=DEFAULT_TIME_LIMIT,
        help=f"seconds for the compute-set search, or none (default {DEFAULT_TIME_LIMIT})",
    )
    args = parser.parse_args()
    gradient = args.gradient_mb * MB
    lo, hi = (float(v) for v in args.caps_mb.split(","))
    times: list[float] = []
    methods: Counter[str] = Counter()
    gaps: list[float] = []
    with stdout_to_stderr():
        extra = (args.relayed, args.relay_cap_mb)
        first = random_group(args.peers, np.random.default_rng(args.seed), args.pairwise, (lo, hi), *extra)
        limit = args.time_limit
        plan_averaging(first[0], args.batch, gradient, pairwise=first[1], time_limit=limit)  # warm-up
        for r in range(args.repeats):
            peers, pairs = random_group(
                args.peers, np.random.default_rng(args.seed + r), args.pairwise, (lo, hi), *extra
            )
            start = time.perf_counter()
            plan = plan_averaging(peers, args.batch, gradient, pairwise=pairs, time_limit=limit)
            times.append((time.perf_counter() - start) * 1e3)
            methods[re.sub(r", gap [^)]*", "", plan.method)] += 1
            gaps.append(plan.gap)
            if r == 0:
                first_plan = plan
                peers0, pairs0 = peers, pairs
        all_reduce = plan_all_reduce(peers0, args.batch, gradient, pairwise=pairs0)
        servers = [
            plan_parameter_server(peers0, i, args.batch, gradient, pairwise=pairs0)
            for i, peer in enumerate(peers0)
            if not peer.client_mode
        ]
    best_ps = max(servers, key=lambda p: p.steps_per_second)
    result = {
        "peers": args.peers,
        "pairwise": args.pairwise,
        "repeats": args.repeats,
        "seed": args.seed,
        "caps_mb": [lo, hi] if args.pairwise else None,
        "relayed": args.relayed,
        "relay_cap_mb": args.relay_cap_mb,
        "relayed_peers_first_group": sum(p.relay is not None for p in peers0),
        "time_limit_s": args.time_limit,
        "solve_ms_median": statistics.median(times),
        "solve_ms_p95": percentile(times, 0.95),
        "solve_ms_min": min(times),
        "solve_ms_worst": max(times),
        "methods": dict(methods),
        "gaps_nonzero": sum(g > 0 for g in gaps),
        "gap_max": max(gaps),
        "gaps": [round(g, 4) for g in gaps],
        "plan": summary(first_plan),
        "all_reduce": summary(all_reduce),
        "best_parameter_server": summary(best_ps),
        # None: the baseline cannot average at all (all-reduce gives a slice to a peer whose relay forwards 0)
        "speedup_vs_all_reduce": ratio(first_plan.steps_per_second, all_reduce.steps_per_second),
        "speedup_vs_best_parameter_server": ratio(first_plan.steps_per_second, best_ps.steps_per_second),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
