"""All-reduce benchmark: N peers, one OS process each, averaging a float32 tensor over loopback.

Mirrors ../shared/anchors/hivemind_bench.py: peer ``r`` starts every round with a tensor of ``numel``
elements all equal to ``r``; a round's time is ``max(end over peers) - min(start over peers)``; after
each round every peer checks its tensor against the exact mean ``(N-1)/2``. The group uses the equal
all-reduce plan (every peer aggregates 1/N), TLS-authenticated connections and the bulk lane.

Prints one JSON object: ``round_s_median`` (timed rounds), ``max_abs_err`` (all rounds, warm-up
included), ``peak_rss_mb`` (largest per-peer peak RSS), ``incomplete_rounds`` (rounds where any peer
reported an un-averaged range — must be 0), plus per-round detail.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(numel: int) -> None:
    import numpy as np
    import trio

    from shared.auth.keys import Identity
    from shared.averaging.allreduce import Averager, GroupPlan, Member
    from shared.net.addresses import parse_multiaddr
    from shared.net.host import Host, HostConfig

    async def main() -> None:
        host = Host(Identity.generate(), "bench-allreduce", HostConfig(bulk_stall=120))
        averager = Averager(host)
        async with trio.open_nursery() as nursery:
            await nursery.start(host.run)
            print(json.dumps({"peer_id": host.peer_id, "addr": host.listen_addrs[0]}), flush=True)
            setup = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
            me = setup["rank"]
            members = tuple(Member(p, parse_multiaddr(a), 1.0) for p, a in setup["members"])
            n = len(members)
            sizes = tuple(numel // n + (1 if i < numel % n else 0) for i in range(n))
            vector = np.empty(numel, dtype=np.float32)
            expected = np.float32((n - 1) / 2)
            while line := (await trio.to_thread.run_sync(sys.stdin.readline)).strip():
                round_ = int(line)
                vector.fill(me)
                plan = GroupPlan(b"bench", round_, members, sizes, deadline=300.0, codec=setup["codec"])
                start = time.time()
                result = await averager.all_reduce(plan, vector, me)
                end = time.time()
                error = float(np.max(np.abs(vector - expected)))
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                print(
                    json.dumps(
                        {
                            "round": round_,
                            "start": start,
                            "end": end,
                            "max_abs_err": error,
                            "complete": result.outcome.complete,
                            "peak_rss_mb": rss,
                        }
                    ),
                    flush=True,
                )
            nursery.cancel_scope.cancel()

    trio.run(main)


def coordinate(peers: int, numel: int, rounds: int, warmup: int, codec: str) -> dict[str, object]:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", "--numel", str(numel)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(peers)
    ]
    try:
        hello = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        members = [[h["peer_id"], h["addr"]] for h in hello]
        for rank, p in enumerate(procs):
            p.stdin.write(json.dumps({"rank": rank, "members": members, "codec": codec}) + "\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        reports = []
        for round_ in range(warmup + rounds):
            for p in procs:
                p.stdin.write(f"{round_}\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            reports.append([json.loads(p.stdout.readline()) for p in procs])  # type: ignore[union-attr]
        for p in procs:
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    times = [max(r["end"] for r in rs) - min(r["start"] for r in rs) for rs in reports]
    timed = times[warmup:]
    return {
        "peers": peers,
        "numel": numel,
        "codec": codec,
        "rounds": rounds,
        "round_s_median": statistics.median(timed),
        "round_s_all": timed,
        "warmup_round_s": times[:warmup],
        "max_abs_err": max(r["max_abs_err"] for rs in reports for r in rs),
        "incomplete_rounds": sum(not all(r["complete"] for r in rs) for rs in reports),
        "peak_rss_mb": max(r["peak_rss_mb"] for rs in reports for r in rs),
        "tensor_mb": numel * 4 / 1e6,
        "algbw_MBps": numel * 4 / 1e6 / statistics.median(timed),
        "one_process_per_peer": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers", default="2,4,8", help="comma-separated group sizes")
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--codec", default="none", choices=["none", "fp16", "int8-blockwise"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.numel)
        return
    results = [
        coordinate(int(n), args.numel, args.rounds, args.warmup, args.codec) for n in args.peers.split(",")
    ]
    print(json.dumps({"allreduce": results, "loadavg": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
