"""SWARM pipeline mode, measured: heterogeneous peers, SWARM against fixed pipelines, and recovery after
a third of one stage's servers die (issue 17, "Benchmarks", first item).

**The peers.** A pool of ``N`` peers of relative speeds ``v_i`` (``--speeds``) serves an ``S``-stage model
(``--stages``; a tiny transformer of ``tiny-mlm``, one block per stage). Every peer is a real
:class:`~shared.node.Node` on loopback in this one process, with the real stage server
(:func:`volunteer.swarm.stage_service.serve_stage`), the real trainers
(:class:`~volunteer.swarm.client.SwarmClient`: stochastic wiring by interleaved weighted round-robin) and,
for SWARM, the real rebalancing (:func:`volunteer.swarm.member.serve_swarm`). **Speeds are emulated**: on
2 shared cores extra threads add no compute, so each server pads its requests to the time a device of its
speed would take (``StageServerConfig.emulated_seconds_per_sample = --base-seconds / v_i``: a sample costs
that many seconds at every stage, a third in the forward and two thirds in the backward; the server runs
one request at a time; see :mod:`volunteer.swarm.server`, "Emulating a slower device"). The model is
tiny so the emulated times dominate its real compute (a few ms per micro-batch, on one torch thread shared
by all servers): the capacity of a server is ``v_i / base`` samples/s at any stage, and a stage's is the
sum over its servers. Links are loopback: **not shaped** (no tc/netem in network namespaces; activations
of this model are ~16 KB per micro-batch, so link time would not matter at these sizes anyway).

**The comparison** (same pool, same trainers, same micro-batches, same measuring window):

* ``fixed`` — GPipe-like fixed pipelines, the baseline: the pool is cut, in arrival order (a seeded
  random permutation, ``--seed``), into ``N/S`` pipelines of one peer per stage (the ``j``-th arrival of
  a pipeline serves stage ``j``); each pipeline is a run of its own (its own DHT), fed by its share of the
  trainers. No rerouting between pipelines, no rebalancing: a pipeline runs at its slowest peer's speed,
  ``Σ_p min_{i∈p} v_i / base`` samples/s at best.
* ``swarm`` — the same peers arriving in the same order join one swarm (``serve_swarm``: a newcomer
  serves the stage with the least measured capacity, an empty one first), every ``--period`` seconds
  rebalancing moves a server by :mod:`shared.swarm.rebalance`, and every trainer routes each micro-batch
  through any server of each stage. At best ``Θ = max_placement min_s Σ_{i∈s} v_i / base``.

**Trainers.** ``N/S`` trainer peers (:class:`~volunteer.swarm.client.SwarmClient`) on one node carry
``--in-flight`` micro-batches per peer at once between them (each micro-batch a task looping forward
and backward through the pipeline); the fixed pipelines get one trainer each with its share of the
micro-batches in flight. Servers keep their default bounded queue (8 requests; a full queue answers
"busy", and ``busy_answers`` counts them).

``ratio`` = swarm samples/s / fixed samples/s (issue target >= 1.5). ``predicted`` gives the model's
numbers for the same pool (the fixed grouping measured, the best grouping -- sorted by speed --, the
mean over random groupings, the swarm's reached placement and its optimum), so a measured ratio can be
told apart from the luck of one arrival order. Throughput is the samples of the micro-batches the trainers
completed (forward and backward through every stage) per second over ``--window`` seconds. The stages do
**not** step: the target batch is never reached, so neither mode pays the stages' gradient averaging
(which both would pay alike, per stage); this measures the pipeline, not the optimizer.

**Recovery.** Once the swarm's placement is stable (no move for two periods, after every peer joined;
at most ``--max-warmup`` periods) the pre-failure throughput is measured over ``--window`` seconds (it is
also the swarm's number above); then a third (rounded, at least one) of the servers of the stage with
the most servers (ties: the lower index), chosen at random (``--seed``), die (their nodes stop as if the
process died), and the trainers' completions are followed for ``--observe`` periods. Throughput over
time: windows of ``--bin`` seconds (default half a period), sliding by a fifth of that. Reported: the
pre-failure rate, the post-failure minimum window, and ``recovered_s``: the end of the first window after
the kill from which every later window is at least 90 % of the pre-failure rate (``null`` if the last one
is not), also in periods. ``bound_fraction`` is the best the surviving pool can do relative to the
placement at the kill (optimal placement of the survivors by exhaustive search when small enough, else
the bound ``Σ v / S``): with equal peers, losing a third of one of three stages' servers leaves 8/9 of
the pool, so 90 % needs spare capacity somewhere; ``recovered_of_bound_periods`` is the time to 90 % of
that bound. ``placement_at_kill`` and ``moves_during_window`` show whether rebalancing was still moving
peers while the pre-failure rate was measured. What limits the speed of recovery: a dead server's DHT
record lingers until it expires (``protocols.swarm.STAGE_RECORD_TTL``, 12 s; trainers ban it at once, but
rebalancing reads records), then the next period's read moves one server (one move per period), then
trainers re-read the stage's servers (every 2 s). The paper rebalances every T = 60-300 s, far above that
TTL; ``--period`` defaults to 15 s to keep the benchmark short while ``T`` stays above the TTL.

Per server, ``servers`` gives the fraction of the measuring window its emulated device was busy, which
says where a pipeline falls short of its prediction (no saturated stage: the trainers' concurrency or this
process's CPU, not the devices, limit it).

Caveats: one process on a shared 2-core machine; the trainers, DHTs and servers share one event loop and
one torch thread, so a busy machine slows the bookkeeping (not the emulated devices): ``cpu_fraction``
is this process's CPU seconds per second during the measuring window; near 1 the event loop, not the
emulated devices, is the bottleneck. Most of that CPU is DHT traffic (the stage collaborations' progress
records, read every ``COLLAB.poll_period`` and written after every counted backward, and the trainers'
directory reads), which is why the emulated devices are slow (``--base-seconds``) and the progress polls
sparse. Compare the measured with the predicted numbers, and repeat.

Prints ONE JSON object on stdout, progress on stderr.

Examples::

    python scripts/bench_swarm.py                     # the default pool, about 4 minutes
    python scripts/bench_swarm.py --speeds 2,1,1,1 --period 2 --window 2 --observe 2 --base-seconds 0.02
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import trio  # noqa: E402

from protocols.errors import ProjectError  # noqa: E402
from protocols.swarm import STAGE_RECORD_TTL  # noqa: E402
from protocols.training import TrainingSpec  # noqa: E402
from shared.auth.keys import Identity  # noqa: E402
from shared.data.corpus import generate_examples  # noqa: E402
from shared.node import Node, open_node  # noqa: E402
from shared.swarm.directory import find_stage_servers  # noqa: E402
from volunteer.collab.optimizer import CollabConfig  # noqa: E402
from volunteer.swarm.client import NoStageServer, SwarmClient, SwarmClientConfig  # noqa: E402
from volunteer.swarm.member import SwarmMember, serve_swarm  # noqa: E402
from volunteer.swarm.server import StageServerConfig  # noqa: E402
from volunteer.swarm.stage_service import serve_stage  # noqa: E402
from volunteer.tasks import make_task  # noqa: E402
from volunteer.tasks.base import Task  # noqa: E402

RUN = "bench-swarm"
#: a volunteer pool: one fast accelerator, two mid-range ones, three of unit speed and three slow ones
DEFAULT_SPEEDS = (4.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5)
RATIO_TARGET = 1.5
RECOVERY_FRACTION = 0.9
RECOVERY_PERIODS = 2.0
#: the stages never step here (module docstring), so how often their servers read each other's progress
#: records does not matter; the default (0.3 s) costs most of this one process's CPU in DHT lookups
COLLAB = CollabConfig(poll_period=2.0)
#: more placements than this and the optimum is replaced by the bound sum(v) / S
EXHAUSTIVE_LIMIT = 200_000


class BenchError(Exception):
    """A bad argument (exit status 2, one line on stderr)."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------- the model


def fixed_capacity(pipelines: Sequence[Sequence[float]]) -> float:
    """Samples/s (in units of speed) of independent fixed pipelines: each at its slowest peer's speed."""
    return math.fsum(min(p) for p in pipelines)


def stage_capacity(stages: Sequence[Sequence[float]]) -> float:
    """Samples/s (in units of speed) of a swarm placement: the slowest stage's summed speed."""
    return min(math.fsum(s) for s in stages)


def best_swarm_capacity(speeds: Sequence[float], stages: int) -> tuple[float, bool]:
    """The best placement's capacity, and whether it is exact (exhaustive search) or the bound
    ``sum(v) / S`` (too many placements)."""
    if len(speeds) < stages:
        return 0.0, True
    if stages ** len(speeds) > EXHAUSTIVE_LIMIT:
        return math.fsum(speeds) / stages, False
    best = 0.0
    for assignment in itertools.product(range(stages), repeat=len(speeds)):
        sums = [0.0] * stages
        for speed, stage in zip(speeds, assignment, strict=True):
            sums[stage] += speed
        best = max(best, min(sums))
    return best, True


def group(order: Sequence[float], stages: int) -> list[list[float]]:
    """Consecutive arrivals form a pipeline, one peer per stage."""
    return [list(order[i : i + stages]) for i in range(0, len(order) - len(order) % stages, stages)]


def predicted(speeds: Sequence[float], order: Sequence[float], stages: int, seed: int) -> dict[str, Any]:
    """The model's capacities (units of speed) for the pool (module docstring)."""
    rng = random.Random(seed + 1)
    shuffled = list(speeds)
    draws = []
    for _ in range(2000):
        rng.shuffle(shuffled)
        draws.append(fixed_capacity(group(shuffled, stages)))
    optimum, exact = best_swarm_capacity(speeds, stages)
    return {
        "fixed_this_grouping": fixed_capacity(group(order, stages)),
        "fixed_best_grouping": fixed_capacity(group(sorted(speeds, reverse=True), stages)),
        "fixed_mean_random_grouping": statistics.fmean(draws),
        "swarm_optimum": optimum,
        "swarm_optimum_exact": exact,
    }


def windows(
    completions: Sequence[tuple[float, int]], start: float, end: float, width: float
) -> list[tuple[float, float]]:
    """``(window end, samples/s)`` of windows of ``width`` from ``start`` to ``end``, sliding by a fifth of
    ``width`` (a completion at ``t`` counts in the windows ``(a, a + width]`` holding it)."""
    out = []
    step = width / 5
    a = start
    while a + width <= end + 1e-9:
        samples = sum(n for t, n in completions if a < t <= a + width)
        out.append((a + width, samples / width))
        a += step
    return out


def rate(completions: Sequence[tuple[float, int]], start: float, end: float) -> float:
    return sum(n for t, n in completions if start < t <= end) / (end - start)


def recovered_after(series: Sequence[tuple[float, float]], floor: float, kill: float) -> float | None:
    """Seconds from ``kill`` to the end of the first window from which every later one is ``>= floor``."""
    for i, (end, _) in enumerate(series):
        if all(r >= floor for _, r in series[i:]):
            return end - kill
    return None


def recovery(
    series: Sequence[tuple[float, float]], pre: float, kill: float, period: float, bound: float = 1.0
) -> dict[str, Any]:
    """The recovery figures of the post-failure windows ``series`` (module docstring); ``bound``: the
    fraction of ``pre`` the survivors can reach at best."""
    if not series or pre <= 0:
        return {"post_min_samples_per_s": None, "recovered_s": None, "recovered_periods": None}
    recovered = recovered_after(series, RECOVERY_FRACTION * pre, kill)
    of_bound = recovered_after(series, RECOVERY_FRACTION * bound * pre, kill)
    low = min(r for _, r in series)
    return {
        "post_min_samples_per_s": round(low, 2),
        "post_min_fraction": round(low / pre, 3),
        "final_fraction": round(series[-1][1] / pre, 3),
        "recovered_s": None if recovered is None else round(recovered, 2),
        "recovered_periods": None if recovered is None else round(recovered / period, 2),
        "recovered_of_bound_periods": None if of_bound is None else round(of_bound / period, 2),
    }


# ------------------------------------------------------------------------------------------ the run


@dataclass
class Peer:
    speed: float
    member: SwarmMember = field(default_factory=SwarmMember)
    scope: trio.CancelScope | None = None
    node: Node | None = None


@dataclass
class Trainers:
    """Completed micro-batches ``(trio time, samples)`` and what went wrong."""

    completions: list[tuple[float, int]] = field(default_factory=list)
    errors: int = 0
    last_error: str | None = None
    clients: list[SwarmClient] = field(default_factory=list)


async def start_node(
    nursery: trio.Nursery, run_id: str, initial: Sequence[str], body: Callable[[Node], Any] | None = None
) -> tuple[Node, trio.CancelScope]:
    """A node on 127.0.0.1 in ``nursery`` running ``body(node)`` (or nothing) until its scope is cancelled
    (as if its process died) or ``body`` returns."""

    async def run(task_status: trio.TaskStatus[tuple[Node, trio.CancelScope]]) -> None:
        with trio.CancelScope() as scope:
            async with open_node(
                Identity.generate(), run_id, "volunteer", listen=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=list(initial),
            ) as node:  # fmt: skip
                task_status.started((node, scope))
                if body is None:
                    await trio.sleep_forever()
                else:
                    await body(node)

    started: tuple[Node, trio.CancelScope] = await nursery.start(run)
    return started


async def feed(
    client: SwarmClient, batches: Sequence[Mapping[str, torch.Tensor]], offset: int, out: Trainers
) -> None:
    """One trainer: micro-batches one after another, forever."""
    i = offset
    while True:
        batch = batches[i % len(batches)]
        try:
            await client.process(batch)
        except (NoStageServer, ProjectError) as exc:
            out.errors += 1
            out.last_error = str(exc)[:200]
            await trio.sleep(0.2)
            continue
        out.completions.append((trio.current_time(), len(batch["input_ids"])))
        i += 1


def start_trainers(
    nursery: trio.Nursery,
    node: Node,
    clients: int,
    in_flight: int,
    stages: int,
    batches: Sequence[Mapping[str, torch.Tensor]],
    out: Trainers,
) -> None:
    """``clients`` trainers on ``node`` carrying ``in_flight`` micro-batches at once between them."""
    config = SwarmClientConfig(timeout=30.0, patience=600.0)
    out.clients = [SwarmClient(node, stages, config) for _ in range(clients)]
    for j in range(in_flight):
        nursery.start_soon(feed, out.clients[j % clients], batches, j * 7, out)


async def wait_served(node: Node, stages: int, counts: Sequence[int], limit: float = 60.0) -> None:
    with trio.fail_after(limit):
        for k in range(stages):
            while True:
                if len(await find_stage_servers(node.dht, k, stages)) >= counts[k]:
                    break
                await trio.sleep(0.1)


async def run_fixed(
    args: argparse.Namespace, task: Task, spec: TrainingSpec, order: Sequence[float], batches: Any
) -> dict[str, Any]:
    """The baseline (module docstring): independent fixed pipelines, one run each."""
    stages = args.stages
    pipelines = group(order, stages)
    in_flight = max(1, round(args.in_flight * len(order) / len(pipelines)))
    outs = [Trainers() for _ in pipelines]
    async with trio.open_nursery() as nursery:
        for p, speeds in enumerate(pipelines):
            run_id = f"{RUN}-fixed-{p}"
            seed, _ = await start_node(nursery, run_id, [])
            initial = [seed.host.listen_addrs[0]]
            for k, speed in enumerate(speeds):
                config = StageServerConfig(emulated_seconds_per_sample=args.base_seconds / speed)

                async def body(
                    node: Node, run_id: str = run_id, k: int = k, config: StageServerConfig = config
                ) -> None:
                    await serve_stage(
                        node, task, spec, run_id, k, stages, server_config=config, collab_config=COLLAB
                    )

                await start_node(nursery, run_id, initial, body)
            await wait_served(seed, stages, [1] * stages)
            start_trainers(nursery, seed, 1, in_flight, stages, batches, outs[p])
        log(f"fixed: {len(pipelines)} pipelines {pipelines}, {in_flight} micro-batches in flight each")
        await trio.sleep(args.warmup)
        start, cpu = trio.current_time(), time.process_time()
        await trio.sleep(args.window)
        end, cpu = trio.current_time(), time.process_time() - cpu
        nursery.cancel_scope.cancel()
    rates = [rate(o.completions, start, end) for o in outs]
    total = math.fsum(rates)
    log(f"fixed: {total:.1f} samples/s (per pipeline {[round(r, 1) for r in rates]})")
    return {
        "pipelines": pipelines,
        "in_flight_per_pipeline": in_flight,
        "samples_per_s": round(total, 2),
        "per_pipeline_samples_per_s": [round(r, 2) for r in rates],
        "predicted_samples_per_s": round(fixed_capacity(pipelines) / args.base_seconds, 2),
        "trainer_errors": sum(o.errors for o in outs),
        "busy_answers": sum(c.stats.busy for o in outs for c in o.clients),
        "cpu_fraction": round(cpu / (end - start), 2),
    }


def served(peers: Sequence[Peer]) -> dict[int, tuple[int, int, int]]:
    """Per peer (by index), its current server's (forward requests, backward samples, busy answers)."""
    out = {}
    for i, peer in enumerate(peers):
        service = peer.member.service
        if service is not None:
            stats = service.server.stats
            out[i] = (stats.forwards, stats.samples, stats.busy)
    return out


def utilization(
    peers: Sequence[Peer],
    before: Mapping[int, tuple[int, int, int]],
    after: Mapping[int, tuple[int, int, int]],
    args: argparse.Namespace,
    seconds: float,
) -> list[dict[str, Any]]:
    """Per server, the fraction of ``seconds`` its emulated device was busy, and its busy answers."""
    rows = []
    for i, peer in enumerate(peers):
        if i not in before or i not in after or peer.member.stage is None:
            continue
        forwards, samples, busy = (b - a for a, b in zip(before[i], after[i], strict=True))
        e = args.base_seconds / peer.speed
        last = peer.member.stage == args.stages - 1
        busy_s = forwards * args.micro_batch * e / 3 + samples * (e if last else 2 * e / 3)
        rows.append(
            {"speed": peer.speed, "stage": peer.member.stage, "utilization": round(busy_s / seconds, 2),
             "busy_answers": busy}
        )  # fmt: skip
    return rows


def placement(peers: Sequence[Peer], stages: int) -> list[list[float]]:
    return [[p.speed for p in peers if p.member.stage == k] for k in range(stages)]


async def run_swarm(
    args: argparse.Namespace, task: Task, spec: TrainingSpec, order: Sequence[float], batches: Any
) -> dict[str, Any]:
    """SWARM, then the recovery experiment (module docstring)."""
    stages, period = args.stages, args.period
    out = Trainers()
    peers = [Peer(speed) for speed in order]
    rng = random.Random(args.seed + 2)
    result: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        seed, _ = await start_node(nursery, RUN, [])
        initial = [seed.host.listen_addrs[0]]
        in_flight = max(1, round(args.in_flight * len(order)))
        start_trainers(nursery, seed, len(order) // stages, in_flight, stages, batches, out)
        began = trio.current_time()
        for peer in peers:
            config = StageServerConfig(emulated_seconds_per_sample=args.base_seconds / peer.speed)

            async def body(node: Node, peer: Peer = peer, config: StageServerConfig = config) -> None:
                peer.node = node
                await serve_swarm(
                    node, task, spec, RUN, stages, period=period, member=peer.member,
                    hysteresis=args.hysteresis, server_config=config, collab_config=COLLAB,
                )  # fmt: skip

            _, peer.scope = await start_node(nursery, RUN, initial, body)
            await trio.sleep(args.join_gap)
        joined = trio.current_time()
        log(f"swarm: {len(peers)} peers joined, placement {placement(peers, stages)}; warming up")

        # warm-up: until no move for two periods (every peer placed), at most --max-warmup periods
        last_change, seen = joined, -1
        converged = False
        while trio.current_time() - joined < args.max_warmup * period:
            moves = sum(len(p.member.moves) for p in peers)
            if moves != seen:
                seen, last_change = moves, trio.current_time()
                log(f"swarm: placement {placement(peers, stages)} after {moves} moves")
            if trio.current_time() - last_change >= 2 * period and all(
                p.member.stage is not None for p in peers
            ):
                converged = True
                break
            await trio.sleep(0.5)
        placed = placement(peers, stages)
        moves_before = [m for p in peers for m in p.member.moves]

        start, cpu, snapshot = trio.current_time(), time.process_time(), served(peers)
        await trio.sleep(args.window)
        kill, cpu = trio.current_time(), time.process_time() - cpu
        servers = utilization(peers, snapshot, served(peers), args, kill - start)
        at_kill = placement(peers, stages)
        moves_in_window = sum(len(p.member.moves) for p in peers) - len(moves_before)
        pre = rate(out.completions, start, kill)
        log(f"swarm: {pre:.1f} samples/s with placement {placed}")
        result.update(
            samples_per_s=round(pre, 2),
            placement=placed,
            predicted_samples_per_s=round(stage_capacity(placed) / args.base_seconds, 2),
            converged=converged,
            warmup_s=round(start - began, 1),
            moves_during_warmup=len(moves_before),
            trainers=len(out.clients),
            in_flight=in_flight,
            cpu_fraction=round(cpu / (kill - start), 2),
            servers=servers,
            moves_during_window=moves_in_window,
            placement_at_kill=at_kill,
        )

        # the failure: a third of the servers of the most-served stage die
        counts = [sum(p.member.stage == k for p in peers) for k in range(stages)]
        victim_stage = max(range(stages), key=lambda k: (counts[k], -k))
        members = [p for p in peers if p.member.stage == victim_stage]
        victims = rng.sample(members, max(1, round(len(members) / 3)))
        for peer in victims:
            assert peer.scope is not None
            peer.scope.cancel()
        survivors = [p for p in peers if p not in victims]
        moves_at_kill = sum(len(p.member.moves) for p in survivors)
        known = [len(p.member.moves) for p in survivors]
        log(
            f"swarm: killed {[p.speed for p in victims]} of stage {victim_stage}"
            f" ({counts[victim_stage]} servers)"
        )
        timeline = []
        move_times: list[float] = []  # seconds after the kill at which a survivor's move was seen
        while trio.current_time() < kill + args.observe * period:
            await trio.sleep(1.0)
            moved = sum(len(p.member.moves) for p in survivors) - moves_at_kill
            move_times += [round(trio.current_time() - kill, 1)] * (moved - len(move_times))
            timeline.append(
                [round(trio.current_time() - kill, 1), sum(n for _, n in out.completions),
                 sum(c.stats.busy for c in out.clients), sum(c.stats.failures for c in out.clients),
                 [sum(p.member.service.server.queued for p in survivors
                      if p.member.stage == k and p.member.service) for k in range(stages)]]
            )  # fmt: skip
        end = trio.current_time()
        after = placement(survivors, stages)
        nursery.cancel_scope.cancel()

    bin_s = args.bin if args.bin > 0 else period / 2
    series = windows(out.completions, kill, end, bin_s)
    before_series = windows(out.completions, start, kill, bin_s)
    best_after, exact = best_swarm_capacity([p.speed for p in survivors], stages)
    capacity = stage_capacity(at_kill)
    bound = min(1.0, best_after / capacity) if capacity else 1.0
    figures = recovery(series, pre, kill, period, bound)
    met = figures["recovered_periods"] is not None and figures["recovered_periods"] <= RECOVERY_PERIODS
    result["recovery"] = {
        "stage": victim_stage,
        "servers": counts[victim_stage],
        "killed_speeds": [p.speed for p in victims],
        "pre_samples_per_s": round(pre, 2),
        "pre_window_min_fraction": round(min(r for _, r in before_series) / pre, 3)
        if before_series and pre
        else None,
        **figures,
        "bound_fraction": round(bound, 3),
        "bound_exact": exact,
        "placement_after": after,
        "moves_after_kill": [m for p, n in zip(survivors, known, strict=True) for m in p.member.moves[n:]],
        "moves_after_kill_at_s": move_times,
        "bin_s": bin_s,
        "series": [[round(t - kill, 2), round(r, 2)] for t, r in series],
        #: each second after the kill: samples completed, busy answers, failed requests (all cumulative),
        #: and the requests queued at each stage's servers
        "timeline": timeline,
        "target": {"fraction": RECOVERY_FRACTION, "periods": RECOVERY_PERIODS, "met": met},
    }
    result["trainer_errors"] = out.errors
    result["last_trainer_error"] = out.last_error
    result["busy_answers"] = sum(c.stats.busy for c in out.clients)
    result["failed_requests"] = sum(c.stats.failures for c in out.clients)
    return result


def make_batches(task: Task, size: int, count: int) -> list[Mapping[str, torch.Tensor]]:
    examples = [{"text": text} for text in generate_examples(17, 50 * count * size)]
    samples = list(task.preprocess(iter(examples)))[: count * size]
    if len(samples) < count * size:
        raise BenchError("the corpus prefix is too short for the micro-batches asked")
    return [task.collate(samples[i * size : (i + 1) * size]) for i in range(count)]


def speeds_arg(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of numbers: {text!r}") from None
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise argparse.ArgumentTypeError(f"speeds must be finite and > 0, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--speeds", type=speeds_arg, default=list(DEFAULT_SPEEDS),
        help="relative speeds of the peers, a comma list (default 4,2,2,1,1,1,0.5,0.5,0.5)",
    )  # fmt: skip
    parser.add_argument("--stages", type=int, default=3, help="pipeline stages S (default 3)")
    parser.add_argument(
        "--base-seconds", type=float, default=0.15,
        help="emulated device seconds per sample per stage of a peer of speed 1 (default 0.15)",
    )  # fmt: skip
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per micro-batch (default 8)")
    parser.add_argument(
        "--in-flight", type=float, default=2.0, help="micro-batches in flight per peer (default 2)"
    )
    parser.add_argument("--period", type=float, default=15.0, help="rebalancing period T, s (default 15)")
    parser.add_argument("--hysteresis", type=float, default=0.1, help="rebalancing margin (default 0.1)")
    parser.add_argument("--window", type=float, default=30.0, help="measuring window, s (default 30)")
    parser.add_argument("--warmup", type=float, default=5.0, help="fixed pipelines' warm-up, s (default 5)")
    parser.add_argument("--join-gap", type=float, default=1.0, help="s between swarm arrivals (default 1)")
    parser.add_argument(
        "--max-warmup", type=float, default=8.0, help="the swarm's longest warm-up, periods (default 8)"
    )
    parser.add_argument("--observe", type=float, default=4.0, help="periods after the kill (default 4)")
    parser.add_argument("--bin", type=float, default=0.0, help="throughput window, s (default period/2)")
    parser.add_argument("--seed", type=int, default=0, help="arrival order and victims (default 0)")
    args = parser.parse_args()
    try:
        if args.stages < 2:
            raise BenchError("--stages must be >= 2")
        if len(args.speeds) < 2 * args.stages or len(args.speeds) % args.stages:
            raise BenchError(f"need a multiple of --stages peers, at least {2 * args.stages}")
        for name in ("base_seconds", "period", "window", "observe", "in_flight", "max_warmup"):
            value = getattr(args, name)
            if not (math.isfinite(value) and value > 0):
                raise BenchError(f"--{name.replace('_', '-')} must be finite and > 0, got {value}")
        if args.micro_batch < 1 or args.warmup < 0 or args.join_gap < 0 or args.bin < 0:
            raise BenchError("--micro-batch must be >= 1; --warmup, --join-gap and --bin >= 0")
        torch.set_num_threads(1)
        spec = TrainingSpec(
            task_options={"layers": args.stages, "d_model": 32, "heads": 2, "ffn": 64, "seq_len": 16},
            target_batch=1 << 30,  # never reached: the stages do not step (module docstring)
            local_batch=args.micro_batch,
        )
        task = make_task(spec)
        batches = make_batches(task, args.micro_batch, 16)
        order = list(args.speeds)
        random.Random(args.seed).shuffle(order)
        started = time.perf_counter()
        fixed = trio.run(run_fixed, args, task, spec, order, batches)
        swarm = trio.run(run_swarm, args, task, spec, order, batches)
    except BenchError as exc:
        print(f"bench_swarm: error: {exc}", file=sys.stderr)
        sys.exit(2)
    model = predicted(args.speeds, order, args.stages, args.seed)
    ratio = swarm["samples_per_s"] / fixed["samples_per_s"] if fixed["samples_per_s"] > 0 else None
    print(
        json.dumps(
            {
                "speeds": args.speeds,
                "arrival_order": order,
                "stages": args.stages,
                "base_seconds": args.base_seconds,
                "micro_batch": args.micro_batch,
                "period_s": args.period,
                "window_s": args.window,
                "stage_record_ttl_s": STAGE_RECORD_TTL,
                "links": "loopback, not shaped",
                "fixed": fixed,
                "swarm": swarm,
                "ratio": None if ratio is None else round(ratio, 3),
                "ratio_target": {"ratio": RATIO_TARGET, "met": ratio is not None and ratio >= RATIO_TARGET},
                "predicted_samples_per_s": {
                    k: (round(v / args.base_seconds, 2) if isinstance(v, float) else v)
                    for k, v in model.items()
                },
                "predicted_ratio": round(model["swarm_optimum"] / model["fixed_this_grouping"], 3),
                "total_s": round(time.perf_counter() - started, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
