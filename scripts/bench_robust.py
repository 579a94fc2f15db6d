"""Robust-averaging benchmark: what the aggregation rules cost, and what they buy against a bad peer.

Prints one JSON object with three parts:

``allreduce`` — the real all-reduce (one OS process per peer, TLS, the bulk lane, as
``bench_allreduce.py``) of ``--numel`` float32 (default 25,000,000: 100 MB) among 4 and 8 peers, with
rounds of every rule interleaved in the same run. Peer ``r`` sends ``base + 0.1 · noise_r`` (gradient-like:
a shared signal plus its own noise), so the robust rules do their real work. ``mean-unbounded`` is the
averaging before issue 9 (no norm bound); ``mean`` is today's default (the relative norm bound on);
``ratio`` is each rule's median round time over ``mean-unbounded``'s (target <= 1.3). Every round checks
that all peers hold bit-identical results. The rule travels as it does in a run: ``GroupPlan.averaging``.

``aggregation`` — the reducer alone, in this process: the time to finalize one aggregator's slice
(``numel / peers`` elements, cut into parts as the all-reduce cuts them) under each rule, with honest
inputs and with one peer's input sign-flipped (where CenteredClip has to iterate).

``training`` — tiny-mlm in one process: four simulated peers each compute a real gradient on their own
batch (``--batches``, samples per peer and its weight; default 64 each, the default ``target_batch`` of
256 split four ways; ``4,16,16,64`` shows that unequal honest batches ban nobody); peer 0 is honest in the
``honest`` runs and otherwise sends its gradient scaled x100 (``scaled``) or sign-flipped (``flipped``).
The four flat gradients are averaged exactly as an aggregator would (one ``SliceReducer`` per part,
sorted senders) under each rule, and the model (SGD, momentum 0.9, by default) steps on the result.
Reported per run: the final held-out loss, its gap to the all-honest plain mean (target for the robust
rules: within 2 %), rounds where the norm bound banned the attacker or an honest peer, rounds where
CenteredClip clipped, and the gradients' signal-to-spread ratio (||mean|| / mean ||peer - mean||: near 1 a
sign-flipped peer is no outlier). This simulates the group in one process; the collaborative path
(matchmaking, plan, all-reduce) is not exercised here.

Default run: about 5 minutes on 2 idle cores (much longer on a loaded machine). ``--steps 400`` trains
longer; ``--peers 4``, ``--skip-allreduce``, ``--runs flipped/centered-clip`` or ``--numel`` shorten it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TypedDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RULES = ("mean-unbounded", "mean", "centered-clip", "trimmed-mean")


CLIP_FACTOR = 1.0  # --clip-factor


def spec_of(rule: str) -> Any:
    from protocols.training import AveragingSpec

    if rule == "mean-unbounded":
        return AveragingSpec(norm_factor=math.inf)  # what the aggregator did before issue 9
    return AveragingSpec(rule=rule, clip_factor=CLIP_FACTOR)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- all-reduce


def worker(numel: int) -> None:
    import numpy as np
    import trio

    from shared.auth.keys import Identity
    from shared.averaging.allreduce import Averager, GroupPlan, Member
    from shared.net.addresses import parse_multiaddr
    from shared.net.host import Host, HostConfig

    async def main() -> None:
        host = Host(Identity.generate(), "bench-robust", HostConfig(bulk_stall=300))
        averager = Averager(host)
        async with trio.open_nursery() as nursery:
            await nursery.start(host.run)
            print(json.dumps({"peer_id": host.peer_id, "addr": host.listen_addrs[0]}), flush=True)
            setup = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
            me = setup["rank"]
            members = tuple(Member(p, parse_multiaddr(a), 1.0) for p, a in setup["members"])
            n = len(members)
            sizes = tuple(numel // n + (1 if i < numel % n else 0) for i in range(n))
            mine = np.random.default_rng(0).standard_normal(numel, dtype=np.float32)
            mine += np.float32(0.1) * np.random.default_rng(1 + me).standard_normal(numel, dtype=np.float32)
            vector = np.empty_like(mine)
            while line := (await trio.to_thread.run_sync(sys.stdin.readline)).strip():
                round_text, rule = line.split()
                plan = GroupPlan(
                    b"bench", int(round_text), members, sizes, deadline=600.0, averaging=spec_of(rule)
                )
                np.copyto(vector, mine)
                start = time.time()
                result = await averager.all_reduce(plan, vector, me)
                end = time.time()
                report = {
                    "start": start,
                    "end": end,
                    "complete": result.outcome.complete,
                    "banned": sum(len(c.banned) for c in result.completeness.values()),
                    "digest": hashlib.sha256(vector.data).hexdigest()[:16],
                }
                print(json.dumps(report), flush=True)
            nursery.cancel_scope.cancel()

    trio.run(main)


def allreduce(peers: int, numel: int, rounds: int, warmup: int) -> dict[str, Any]:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", "--numel", str(numel)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(peers)
    ]
    times: dict[str, list[float]] = {rule: [] for rule in RULES}
    identical, complete, banned = True, True, 0
    try:
        hello = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        members = [[h["peer_id"], h["addr"]] for h in hello]
        for rank, p in enumerate(procs):
            p.stdin.write(json.dumps({"rank": rank, "members": members}) + "\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        schedule = [(False, RULES[0])] * warmup + [(True, rule) for _ in range(rounds) for rule in RULES]
        for round_, (timed, rule) in enumerate(schedule):  # interleaved: every rule sees the same load
            for p in procs:
                p.stdin.write(f"{round_} {rule}\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            reports = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
            identical &= len({r["digest"] for r in reports}) == 1
            complete &= all(r["complete"] for r in reports)
            banned += sum(r["banned"] for r in reports)
            if timed:
                times[rule].append(max(r["end"] for r in reports) - min(r["start"] for r in reports))
        for p in procs:
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    medians = {rule: statistics.median(ts) for rule, ts in times.items()}
    return {
        "peers": peers,
        "numel": numel,
        "round_s_median": medians,
        "round_s_all": times,
        "ratio": {rule: medians[rule] / medians["mean-unbounded"] for rule in RULES},
        "identical_on_every_peer": identical,
        "every_round_complete": complete,
        "honest_peers_banned": banned,
    }


# --------------------------------------------------------------------------------------- aggregation


class ReduceStats(TypedDict):
    """What :func:`reduce_parts` saw besides the average."""

    banned: dict[str, int]  # per sender: the parts in which it was banned
    clipped: int  # the parts where CenteredClip had to clip


def reduce_parts(
    inputs: list[Any], weights: list[float], spec: Any, part_numel: int
) -> tuple[Any, ReduceStats]:
    """Average flat vectors as an aggregator of the whole vector would: one SliceReducer per part, like
    ``Averager._take_duty``. Returns the average and statistics: per sender, the parts in which it was
    banned, and the parts where CenteredClip had to clip (``clipped``) rather than return the mean."""
    import numpy as np

    from protocols.averaging import PartHeader
    from protocols.peer_id import PeerId
    from shared.averaging.partition import num_parts, part_bounds
    from shared.averaging.reducer import PartRejected, SliceReducer

    numel = inputs[0].size
    peers = [PeerId(f"peer-{i}") for i in range(len(inputs))]
    out = np.empty(numel, dtype=np.float32)
    banned: dict[str, int] = {}
    clipped = 0
    for k in range(num_parts(numel, part_numel)):
        lo, hi = part_bounds(numel, part_numel, k)
        reducer = SliceReducer(hi - lo, dict.fromkeys(peers), math.inf, part_numel=hi - lo, rule=spec)
        for peer, x, w in zip(peers, inputs, weights, strict=True):
            header = PartHeader(
                group_id=b"b", round=0, part_index=0, offset=0, numel=hi - lo, codec="none", weight=w,
                nbytes=4 * (hi - lo),
            )  # fmt: skip
            with contextlib.suppress(PartRejected):  # NaN/Inf: banned, as the aggregator would
                reducer.add_part(peer, header, x[lo:hi])
        out[lo:hi] = reducer.finalize()
        clipped += reducer.clip_report is not None and reducer.clip_report.iterations > 0
        for peer, _ in reducer.completeness().banned:
            banned[peer] = banned.get(peer, 0) + 1
    return out, {"banned": banned, "clipped": clipped}


def aggregation(peers: int, numel: int, repeats: int) -> dict[str, Any]:
    import numpy as np

    from shared.averaging.partition import auto_part_numel

    n = numel // peers
    part = auto_part_numel([n] * peers)
    base = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    noise = [np.random.default_rng(1 + r).standard_normal(n, dtype=np.float32) for r in range(peers)]
    inputs = [base + np.float32(0.1) * x for x in noise]
    attacked = [(-inputs[0]).astype(np.float32), *inputs[1:]]  # one peer sign-flipped: clipping iterates
    reduce_parts(inputs, [1.0] * peers, spec_of("mean"), part)  # warm-up: page faults, caches
    seconds: dict[str, float] = {}
    under_attack: dict[str, float] = {}
    for rule in RULES:
        for table, data in ((seconds, inputs), (under_attack, attacked)):
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                reduce_parts(data, [1.0] * peers, spec_of(rule), part)
                runs.append(time.perf_counter() - start)
            table[rule] = statistics.median(runs)
    return {
        "peers": peers,
        "slice_numel": n,
        "part_numel": part,
        "finalize_s": seconds,
        "ratio": {rule: seconds[rule] / seconds["mean-unbounded"] for rule in RULES},
        "finalize_s_one_peer_flipped": under_attack,
    }


# ------------------------------------------------------------------------------------------ training


def training(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from protocols.training import TrainingSpec
    from shared.averaging.partition import auto_part_numel
    from shared.averaging.reducer import NothingToAverage
    from shared.data.corpus import generate_examples
    from volunteer.tasks.registry import make_task

    torch.set_num_threads(1)
    task = make_task(TrainingSpec(seed=args.seed))
    batches = [int(b) for b in args.batches.split(",")]
    peers, per_step = len(batches), sum(batches)
    texts = [{"text": t} for t in generate_examples(args.seed + 7, args.steps * per_step)]
    held_out = task.collate([{"text": t} for t in generate_examples(args.seed + 99, 512)])
    logging.getLogger("shared.averaging.reducer").setLevel(logging.ERROR)  # bans are counted below
    runs = [("honest", "mean-unbounded"), ("honest", "centered-clip"), ("honest", "trimmed-mean")]
    runs += [(attack, rule) for attack in ("scaled", "flipped") for rule in RULES]
    if args.runs:
        wanted = {"honest/mean-unbounded", *args.runs.split(",")}  # the honest run is the reference
        runs = [run for run in runs if "/".join(run) in wanted]
    results: dict[str, dict[str, Any]] = {}
    for attack, rule in runs:
        model = task.build_model()
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        part = auto_part_numel([numel // peers] * peers)  # parts as the all-reduce would cut them
        if args.optimizer == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9)
        else:
            optimizer = torch.optim.AdamW(params, lr=args.lr)
        banned_rounds, attacker_banned, clipped_rounds, diverged_at = 0, 0, 0, None
        snr = []
        start = time.perf_counter()
        for step in range(args.steps):
            grads = []
            for peer in range(peers):
                first = step * per_step + sum(batches[:peer])
                model.zero_grad()
                torch.autograd.backward(task.loss(model, task.collate(texts[first : first + batches[peer]])))
                flat = torch.cat([p.grad.reshape(-1) for p in params]).numpy().copy()  # type: ignore[union-attr]
                if peer == 0 and attack == "scaled":
                    flat *= np.float32(100.0)
                elif peer == 0 and attack == "flipped":
                    flat *= np.float32(-1.0)
                grads.append(flat)
            try:
                average, stats = reduce_parts(grads, [float(b) for b in batches], spec_of(rule), part)
            except NothingToAverage:  # every gradient was NaN/Inf: the model has diverged
                diverged_at = step
                break
            banned_rounds += any(p != "peer-0" for p in stats["banned"])
            attacker_banned += "peer-0" in stats["banned"]
            clipped_rounds += stats["clipped"] > 0
            if attack == "honest" and rule == "mean-unbounded" and step % 10 == 0:
                spread = statistics.mean(float(np.linalg.norm(g - average)) for g in grads)
                snr.append(float(np.linalg.norm(average)) / spread)
            if not np.isfinite(average).all():
                diverged_at = step
                break
            offset = 0
            with torch.no_grad():
                for p in params:
                    p.grad.copy_(torch.from_numpy(average[offset : offset + p.numel()]).view_as(p))  # type: ignore[union-attr]
                    offset += p.numel()
            optimizer.step()
        with torch.no_grad():
            loss = float(task.loss(model, held_out)) if diverged_at is None else math.nan
        results[f"{attack}/{rule}"] = {
            "final_loss": loss if math.isfinite(loss) else None,
            "diverged": not math.isfinite(loss),
            "non_finite_at_step": diverged_at,
            "rounds_with_an_honest_peer_banned": banned_rounds,
            "rounds_attacker_banned": attacker_banned,
            "rounds_centered_clip_clipped": clipped_rounds,
            "seconds": round(time.perf_counter() - start, 1),
        }
        if snr:  # ||mean gradient|| / mean ||peer gradient - mean||: below ~1 a flipped peer is no outlier
            results[f"{attack}/{rule}"]["signal_to_spread"] = statistics.mean(snr)
    with torch.no_grad():
        initial = float(task.loss(task.build_model(), held_out))
    honest = results["honest/mean-unbounded"]["final_loss"]
    for result in results.values():
        loss = result["final_loss"]
        result["gap_to_honest"] = None if loss is None or honest is None else (loss - honest) / honest
        result["progress_vs_honest"] = (
            None if loss is None or honest is None else (initial - loss) / (initial - honest)
        )
    robust = [k for k in results if k.split("/")[1] in ("centered-clip", "trimmed-mean")]
    within = {k: (g := results[k]["gap_to_honest"]) is not None and abs(g) <= 0.02 for k in robust}
    return {
        "task": "tiny-mlm",
        "peers": peers,
        "batches": batches,
        "steps": args.steps,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "clip_factor": CLIP_FACTOR,
        "initial_loss": initial,
        "runs": results,
        "robust_within_2pct_of_honest": within,
        "simulated_in_one_process": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", default="4,8", help="comma-separated group sizes for the all-reduce")
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per rule (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds of plain averaging first")
    parser.add_argument("--skip-allreduce", action="store_true", help="only the in-process parts")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--steps", type=int, default=100, help="training steps per run")
    parser.add_argument("--batches", default="64,64,64,64", help="samples per peer per step; peer 0 attacks")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clip-factor", type=float, default=1.0, help="CenteredClip c (default 1)")
    parser.add_argument("--runs", default="", help="only these training runs, e.g. flipped/centered-clip")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global CLIP_FACTOR
    CLIP_FACTOR = args.clip_factor
    if args.worker:
        worker(args.numel)
        return
    sizes = [int(n) for n in args.peers.split(",")]
    out: dict[str, Any] = {"loadavg_before": os.getloadavg(), "cpus": os.cpu_count()}
    out["aggregation"] = [aggregation(n, args.numel, 2) for n in sizes]
    print(json.dumps(out["aggregation"]), file=sys.stderr, flush=True)  # progress, in case a later part fails
    if not args.skip_training:
        out["training"] = training(args)
        print(json.dumps(out["training"]), file=sys.stderr, flush=True)
    if not args.skip_allreduce:
        out["allreduce"] = [allreduce(n, args.numel, args.rounds, args.warmup) for n in sizes]
    out["loadavg_after"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
