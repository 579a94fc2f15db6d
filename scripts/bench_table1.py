"""DeDLOC's Table 1 (seed 000 §4.1) here: all-reduce, parameter server and adaptive averaging, timed.

The paper times one averaging round of a ResNet-50 gradient (25.6 M parameters, ~102 MB in float32) in four
networks of volunteers: A, 8 peers at 1 Gb/s; B, 16 peers at 200 Mb/s; C, A and B together; D, B plus one
2.5 Gb/s peer. Its headline: the adaptive plan matches all-reduce on homogeneous peers (A, B), matches a
parameter server where one peer dominates (D), and beats both on the mixed network (C: 1.9x faster than
all-reduce).

This script builds each network with ``scripts/bench_strategies.py`` (one network namespace and process per
peer, upload and download capped with ``tc``; ``--rtt-ms`` adds latency) and times the three strategies
there, every round checked exact and bit-identical. By default both the bandwidths and the gradient are
divided by 10 (100 Mb/s peers, a 10 MB gradient): times are then comparable with the paper's seconds while
24 peers fit on a small machine. ``--bandwidth-divisor`` and ``--gradient-divisor`` change that (a round's
time scales with ``gradient / bandwidth``; ``paper_equivalent_s`` multiplies the measured seconds back);
``--full`` runs the paper's scale. Where the machine's CPU, not the emulated links, is what limits a round,
the ``cpu_share_of_machine`` column approaches 1: divide the bandwidths further.

In D the 2.5 Gb/s peer is an auxiliary peer: it computes nothing (weight 0) and helps average, as DeDLOC's
CPU-only servers do. The parameter server is the best single server the LP's model predicts (in D, that
peer). Prints ONE JSON object (the table's rows, each setup's full ``bench_strategies`` result) on stdout,
and the table itself on stderr.

Examples::

    python scripts/bench_table1.py                       # all four setups, 5 timed rounds each
    python scripts/bench_table1.py --setups C --rounds 3 --rtt-ms 50
    python scripts/bench_table1.py --bandwidth-divisor 30 --gradient-divisor 30
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.bench_strategies import (  # noqa: E402
    BenchError,
    Terminated,
    _terminate,
    parse_scenario,
    run_benchmark,
)

#: Parameters of torchvision's ResNet-50.
RESNET50_NUMEL = 25_557_032


@dataclass(frozen=True)
class Setup:
    name: str
    peers_mbps: tuple[float, ...]  # per peer, symmetric, at the paper's scale
    compute: tuple[float, ...]
    paper_s: tuple[float, float, float]  # all-reduce, parameter server, adaptive ("Ours")


def _setup(name: str, groups: list[tuple[int, float, float]], paper: tuple[float, float, float]) -> Setup:
    mbps = tuple(b for count, b, _ in groups for _ in range(count))
    compute = tuple(c for count, _, c in groups for _ in range(count))
    return Setup(name, mbps, compute, paper)


SETUPS = {
    s.name: s
    for s in (
        _setup("A", [(8, 1000.0, 1.0)], (1.19, 4.73, 1.20)),
        _setup("B", [(16, 200.0, 1.0)], (5.3, 39.6, 5.3)),
        _setup("C", [(8, 1000.0, 1.0), (16, 200.0, 1.0)], (5.69, 14.1, 2.96)),
        _setup("D", [(16, 200.0, 1.0), (1, 2500.0, 0.0)], (5.3, 3.22, 3.18)),
    )
}


def run_setup(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    """Time the three strategies on one setup, scaled as ``args`` says; the row and the full result."""
    bandwidth = ",".join(f"{b / args.bandwidth_divisor:g}" for b in setup.peers_mbps)
    compute = ",".join(f"{c:g}" for c in setup.compute)
    scenario = parse_scenario(bandwidth, compute)
    numel = max(1, round(RESNET50_NUMEL / args.gradient_divisor))
    result = run_benchmark(
        scenario,
        numel,
        rounds=args.rounds,
        warmup=args.warmup,
        trace_dir=args.trace / setup.name if args.trace else None,
        rtt_ms=args.rtt_ms,
        part_numel=args.part_numel,
    )
    strategies = result["strategies"]
    ar = strategies["all-reduce"]
    ps = strategies[result["best_ps"]]
    adaptive = strategies["adaptive"]
    back = args.gradient_divisor / args.bandwidth_divisor  # measured seconds -> the paper's scale
    paper_ar, paper_ps, paper_ours = setup.paper_s
    row = {
        "setup": setup.name,
        "peers": scenario.n,
        "all_reduce_s": ar["round_s_median"],
        "parameter_server_s": ps["round_s_median"],
        "adaptive_s": adaptive["round_s_median"],
        "adaptive_predicted_s": adaptive["predicted_s"],
        "paper_equivalent_s": {
            "all_reduce": ar["round_s_median"] * back,
            "parameter_server": ps["round_s_median"] * back,
            "adaptive": adaptive["round_s_median"] * back,
        },
        "paper_s": {"all_reduce": paper_ar, "parameter_server": paper_ps, "adaptive": paper_ours},
        "ar_over_adaptive": ar["round_s_median"] / adaptive["round_s_median"],
        "ar_over_adaptive_paper": paper_ar / paper_ours,
        "ps_over_adaptive": ps["round_s_median"] / adaptive["round_s_median"],
        "ps_over_adaptive_paper": paper_ps / paper_ours,
        "adaptive_over_predicted": adaptive["measured_vs_predicted"],
        "adaptive_over_best_of_ar_ps": result["adaptive_vs_best_of_ar_ps"],
        "cpu_share_of_machine": max(s["cpu_share_of_machine"] for s in strategies.values()),
        "all_complete": result["all_complete"],
        "all_bit_identical": result["all_bit_identical"],
    }
    return {"row": row, "result": result}


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'setup':<6}{'AR s':>8}{'PS s':>8}{'adapt s':>9}{'LP s':>7}"
        f"{'AR/adapt (paper)':>19}{'PS/adapt (paper)':>19}{'adapt/LP':>10}{'cpu':>6}  exact"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['setup']:<6}{r['all_reduce_s']:>8.2f}{r['parameter_server_s']:>8.2f}{r['adaptive_s']:>9.2f}"
            f"{r['adaptive_predicted_s']:>7.2f}"
            f"{r['ar_over_adaptive']:>11.2f} ({r['ar_over_adaptive_paper']:.2f})"
            f"{r['ps_over_adaptive']:>11.2f} ({r['ps_over_adaptive_paper']:.2f})"
            f"{r['adaptive_over_predicted']:>10.2f}{r['cpu_share_of_machine']:>6.2f}"
            f"  {'yes' if r['all_complete'] and r['all_bit_identical'] else 'NO'}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--setups", default="A,B,C,D", help="comma list of A, B, C, D")
    parser.add_argument("--bandwidth-divisor", type=float, default=10.0, help="divide every link by this")
    parser.add_argument(
        "--gradient-divisor", type=float, default=10.0, help="divide ResNet-50's size by this"
    )
    parser.add_argument("--full", action="store_true", help="the paper's scale (both divisors 1)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per strategy (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds per strategy first")
    parser.add_argument("--rtt-ms", type=float, help="round-trip time between every two peers")
    parser.add_argument("--part-numel", type=int, default=0, help="elements per part (default: automatic)")
    parser.add_argument(
        "--trace", type=Path, metavar="DIR", help="trace each strategy's last round: DIR/<setup>/"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    try:
        if args.full:
            args.bandwidth_divisor = args.gradient_divisor = 1.0
        names = [n.strip().upper() for n in args.setups.split(",") if n.strip()]
        unknown = [n for n in names if n not in SETUPS]
        if unknown or not names:
            raise BenchError(f"--setups: unknown {unknown or args.setups!r}; choose from A, B, C, D")
        if not (args.bandwidth_divisor > 0 and args.gradient_divisor > 0):
            raise BenchError("--bandwidth-divisor and --gradient-divisor must be positive")
        if args.rounds < 1 or args.warmup < 0:
            raise BenchError("--rounds must be >= 1 and --warmup >= 0")
        runs = []
        for name in names:
            print(f"bench_table1: setup {name} ...", file=sys.stderr, flush=True)
            runs.append(run_setup(SETUPS[name], args))
            print(table([r["row"] for r in runs]), file=sys.stderr, flush=True)
    except BenchError as exc:
        print(f"bench_table1: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("bench_table1: interrupted; namespaces and peers removed", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except Terminated as exc:
        print(f"bench_table1: {exc}; namespaces and peers removed", file=sys.stderr)
        sys.exit(128 + exc.signum)
    rows = [r["row"] for r in runs]
    out = {
        "bandwidth_divisor": args.bandwidth_divisor,
        "gradient_divisor": args.gradient_divisor,
        "rtt_ms": args.rtt_ms,
        "rounds": args.rounds,
        "table": table(rows).splitlines(),
        "rows": rows,
        "results": {r["row"]["setup"]: r["result"] for r in runs},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
