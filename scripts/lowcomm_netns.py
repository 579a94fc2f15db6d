"""``bench_lowcomm.py --netns``: compute utilization of the batch mode and DiLoCo on shaped links (issue 16).

Every peer is its own OS process in its own network namespace on one bridge (``tests/netns.py``), its
upload and download capped with ``tc`` (``tbf``) at ``--netns-mbps`` (default 20 Mbit/s), running a real
:class:`~shared.node.Node` on its namespace address and the real
:class:`~volunteer.collab.optimizer.CollaborativeOptimizer` with one torch thread, on the same data, budget
and lockstep loop as the loopback benchmark (:func:`scripts.bench_lowcomm.run_peer`: each peer computes its
share of every global step, then averages). The coordinator (this process) starts the peers of one
configuration, waits until each sees all the others in the DHT, says "go" to all at once, and collects one
JSON report from each; the LAN is built once and every configuration's peers are new processes.

**Compute utilization** of a peer = ``compute_s / wall_s``:

* ``wall_s``: from "go" until the peer has taken the last global step (its own clock);
* ``compute_s``: the wall seconds it spent inside ``trainer.accumulate`` (forward, backward and, in DiLoCo,
  the inner optimizer steps) -- the *compute phase*. Everything else is non-compute: matchmaking, the
  averaging's transfers, waiting for the other peers to finish their share, state downloads.

**A paced device** (``--netns-pace``, default 0.25 s). On this machine four peer processes (plus other
users' jobs) share 2 cores: the OS preempts a computing peer, stretching its compute phase by however busy
the machine happens to be, and a peer that finished its share waits for peers that were preempted longer --
waiting a real collaboration of separate machines would not see. So each peer emulates a device of a fixed
speed: a micro-batch takes at least ``pace`` wall seconds (the real forward/backward/step, then a sleep
for the rest), all of it compute. While the real computation takes less than ``pace`` (tiny-mlm: about
40 ms of CPU per micro-batch of 16, so contention up to about 6x is absorbed), every peer's compute phase
has the same length whatever the load, and what is left of the wall time is the synchronization's own cost:
matchmaking, the averaging's transfers over the shaped links, the protocol's rounds trips, and the
preemption of those. ``--netns-pace 0`` measures the unpaced CPU instead. To show how much CPU the peers
actually got, each report also gives ``compute_cpu_s`` (the torch thread's CPU seconds inside
``accumulate``, ``time.thread_time``), ``cpu_s`` (the whole process's CPU seconds: ``getrusage``) and
``cpu_share`` (``cpu_s / wall_s``), and the JSON has the machine's load average before and after each
configuration.

Needs root, ``ip netns`` and ``tc``; exits with a one-line error (status 2) where they are unavailable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.netns_peers import PeerError, PeerProcess, start, stop, unavailable  # noqa: E402

DEFINITION = (
    "compute utilization = compute_s / wall_s per peer process: compute_s = wall seconds inside "
    "trainer.accumulate (forward, backward, inner optimizer steps), wall_s = from 'go' to the peer's last "
    "global step; time waiting for the network or other peers is non-compute, time the OS preempts a "
    "computing peer counts as compute; each micro-batch takes at least pace_s wall seconds (an emulated "
    "device of fixed speed, padded by a sleep, all compute; cpu_share and compute_cpu_s show the CPU time "
    "actually received)"
)
STARTUP_S = 300.0  # to start and see the other peers (four torch imports under load)
SCRIPT = Path(__file__).resolve()


NetnsError = PeerError
"""A failure to report as one line (a peer's, or the emulated links')."""


# ---------------------------------------------------------------------------------------------- peer side


def worker(args: argparse.Namespace) -> None:
    """One peer process: reads "go" and "exit" on stdin, writes JSON lines on stdout."""
    import torch
    import trio

    from scripts import bench_lowcomm as bench
    from volunteer.collab.diloco_trainer import make_trainer
    from volunteer.collab.optimizer import CollaborativeOptimizer, StepRecord
    from volunteer.collab.torch_thread import run_torch
    from volunteer.tasks import make_task

    torch.set_num_threads(1)
    setup = bench.TASKS[args.task]
    outer = (args.outer_lr, args.outer_momentum)
    spec = bench.make_spec(args.task, setup, args.peers, args.rounds or None, args.codec, args.overlap, outer)
    tokenizer = bench.task_tokenizer(args.task)
    task = make_task(spec, tokenizer)
    stream = bench.train_stream(task, args.rank, setup.local_batch, set())
    steps = args.budget // spec.target_batch
    share = spec.target_batch // args.peers

    def say(obj: dict[str, Any]) -> None:
        print(json.dumps(obj), flush=True)

    async def main() -> None:
        records: list[StepRecord] = []
        compute = {"wall": 0.0, "cpu": 0.0}
        async with trio.open_nursery() as nursery:
            node, uploads = await bench.start_node(nursery, args.initial or [], args.listen)
            say({"addr": str(node.host.listen_addrs[0])})
            trainer = await run_torch(make_trainer, task, spec, bench.RUN_ID)
            accumulate = trainer.accumulate

            def timed(batch: Any) -> Any:
                wall, cpu = time.perf_counter(), time.thread_time()  # on the torch thread
                try:
                    return accumulate(batch)
                finally:
                    compute["cpu"] += time.thread_time() - cpu
                    # the emulated device: a micro-batch takes at least ``pace`` seconds (module docstring)
                    time.sleep(max(0.0, args.pace - (time.perf_counter() - wall)))
                    compute["wall"] += time.perf_counter() - wall

            trainer.accumulate = timed  # type: ignore[method-assign]
            collab = CollaborativeOptimizer(node, trainer, spec, config=bench.CONFIG, on_step=records.append)
            await nursery.start(collab.run)
            with trio.fail_after(STARTUP_S):
                while (await collab.refresh_view()).peers != args.peers:  # noqa: ASYNC110
                    await trio.sleep(0.2)  # the view is read from the DHT: nothing to wait on but time
            say({"ready": True})
            await trio.to_thread.run_sync(sys.stdin.readline)  # "go"
            sent0 = uploads.sent
            usage0 = resource.getrusage(resource.RUSAGE_SELF)
            began = time.perf_counter()
            counters = bench.PeerCounters()
            await bench.run_peer(collab, stream, steps, share, counters, args.rank)
            wall = time.perf_counter() - began
            usage = resource.getrusage(resource.RUSAGE_SELF)
            sent = uploads.sent - sent0
            cpu = usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime
            fingerprint = (await run_torch(trainer.fingerprint)).hex()
            loss = None
            if args.rank == 0:
                held, _ = bench.heldout_batches(task, args.heldout, setup.local_batch)
                model = task.build_model()
                await run_torch(trainer.copy_state_into, model)
                loss = round(bench.heldout_loss(task, model, held), 5)
            say(
                {
                    "rank": args.rank,
                    "steps": trainer.step,
                    "samples": sum(r.samples for r in records if r.step <= steps),
                    "wall_s": round(wall, 3),
                    "compute_s": round(compute["wall"], 3),
                    "compute_cpu_s": round(compute["cpu"], 3),
                    "cpu_s": round(cpu, 3),
                    "bytes_sent": sent,
                    "fingerprint": fingerprint,
                    "heldout_loss": loss,
                    "failed_attempts": counters.failed,
                    "state_downloads": counters.downloads,
                    "samples_lost": counters.lost,
                }
            )
            # stay (serving the DHT) until every peer has reported: a departure must not disturb the others
            await trio.to_thread.run_sync(sys.stdin.readline)  # "exit"
            nursery.cancel_scope.cancel()

    try:
        bench.run_trio(main)
    except bench.BenchError as exc:
        print(f"peer {args.rank}: {exc}", file=sys.stderr)
        sys.exit(2)


# ---------------------------------------------------------------------------------------------- coordinator


@contextlib.contextmanager
def peer_group(hosts: Sequence[Any], config: list[str]) -> Iterator[list[PeerProcess]]:
    """One peer process per namespace host, peer 0 first (the others join the DHT through it); every
    process is told to exit, then killed if it does not, and reaped on exit."""
    peers: list[PeerProcess] = []
    base = [sys.executable, str(SCRIPT), "--worker", "--peers", str(len(hosts)), *config]
    try:
        peers.append(start(hosts[0], [*base, "--rank", "0", "--listen", hosts[0].address], 0))
        first = peers[0].receive(STARTUP_S)["addr"]
        for rank, host in enumerate(hosts[1:], start=1):
            argv = [*base, "--rank", str(rank), "--listen", host.address, "--initial", first]
            peers.append(start(host, argv, rank))
        for p in peers[1:]:
            p.receive(STARTUP_S)  # its address
        yield peers
    finally:
        stop(peers, 10.0)


def run_configuration(hosts: Sequence[Any], config: list[str], limit_s: float) -> list[dict[str, Any]]:
    """Start the peers of one configuration, let them train together, return their reports."""
    with peer_group(hosts, config) as peers:
        for p in peers:
            p.receive(STARTUP_S)  # ready: it sees every other peer
        for p in peers:
            p.send("go")
        deadline = time.monotonic() + limit_s
        reports = [p.receive(max(1.0, deadline - time.monotonic())) for p in peers]
        for p in peers:
            p.send("exit")
    return reports


def summarize(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's numbers from its peers' reports (module docstring: the definitions)."""
    utilization = [r["compute_s"] / r["wall_s"] for r in reports]
    sent = [r["bytes_sent"] for r in reports]
    return {
        "compute_utilization": {
            "mean": round(statistics.fmean(utilization), 4),
            "min": round(min(utilization), 4),
            "per_peer": [round(u, 4) for u in utilization],
        },
        "wall_s": round(max(r["wall_s"] for r in reports), 2),
        "compute_s_per_peer": [r["compute_s"] for r in reports],
        "compute_cpu_s_per_peer": [r["compute_cpu_s"] for r in reports],
        "cpu_share": round(statistics.fmean(r["cpu_s"] / r["wall_s"] for r in reports), 4),
        "bytes_sent_per_peer": {"mean": round(statistics.fmean(sent)), "max": max(sent)},
        "steps": max(r["steps"] for r in reports),
        "samples": sum(r["samples"] for r in reports),
        "heldout_loss": reports[0]["heldout_loss"],
        "identical": len({(r["fingerprint"], r["steps"]) for r in reports}) == 1,
        "failed_attempts": sum(r["failed_attempts"] for r in reports),
        "state_downloads": sum(r["state_downloads"] for r in reports),
        "samples_lost": sum(r["samples_lost"] for r in reports),
    }


def check_environment() -> None:
    reason = unavailable()
    if reason is not None:
        raise NetnsError(f"network namespaces with tc shaping are unavailable: {reason}")


def run_task(name: str, args: argparse.Namespace, budget: int, heldout: int) -> dict[str, Any]:
    """The batch mode and DiLoCo at each round length of ``rounds`` (and with ``--overlap``) on one shaped
    LAN."""
    from scripts import bench_lowcomm as bench
    from tests.netns import LinkError, lan

    peers, mbps = args.peers, args.netns_mbps
    configurations = bench.configurations_of(args)
    runs: dict[str, Any] = {}
    try:
        with lan(peers, shape=[(mbps, mbps)] * peers) as hosts:
            for label, k, codec, overlap in configurations:
                print(f"bench_lowcomm --netns: {name} {label} ...", file=sys.stderr, flush=True)
                config = ["--task", name, "--rounds", str(k), "--codec", codec]
                config += ["--overlap"] if overlap else []
                config += ["--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)]
                config += ["--budget", str(budget), "--heldout", str(heldout), "--pace", str(args.netns_pace)]
                load_before = os.getloadavg()
                reports = run_configuration(hosts, config, args.limit)
                runs[label] = {
                    "round_x": k or None,
                    "codec": codec,
                    "overlap": overlap,
                    **summarize(reports),
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                }
    except LinkError as exc:
        raise NetnsError(f"emulated link failed: {exc}") from exc
    base = runs["batch"]
    for label, _, _, _ in configurations[1:]:
        run = runs[label]
        sent = run["bytes_sent_per_peer"]["mean"]
        run["bytes_ratio"] = round(base["bytes_sent_per_peer"]["mean"] / max(1, sent), 1)
        run["loss_gap_pct"] = round(100.0 * (run["heldout_loss"] / base["heldout_loss"] - 1.0), 2)
    return {
        "task": name,
        "budget_samples": budget,
        "link_mbps": mbps,
        "pace_s": args.netns_pace,
        "runs": runs,
    }


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"{'task':9} {'mode':11} {'steps':>5} {'loss':>7} {'gap %':>7} {'MB/peer':>8} {'ratio':>7} "
        f"{'wall s':>7} {'util':>6} {'min':>6} {'cpu':>5} {'load':>5}"
    ]
    for result in results:
        for label, run in result["runs"].items():
            gap, ratio = run.get("loss_gap_pct"), run.get("bytes_ratio")
            util = run["compute_utilization"]
            lines.append(
                f"{result['task']:9} {label:11} {run['steps']:5d} {run['heldout_loss']:7.4f} "
                f"{'' if gap is None else f'{gap:+.2f}':>7} {run['bytes_sent_per_peer']['mean'] / 1e6:8.3f} "
                f"{'' if ratio is None else f'{ratio:.1f}':>7} {run['wall_s']:7.1f} {util['mean']:6.3f} "
                f"{util['min']:6.3f} {run['cpu_share']:5.2f} {run['loadavg_after'][0]:5.2f}"
            )
    return "\n".join(lines)


def worker_main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--initial", action="append")
    parser.add_argument("--task", required=True)
    parser.add_argument("--rounds", type=int, required=True)  # 0: the batch mode
    parser.add_argument("--codec", required=True)
    parser.add_argument("--budget", type=int, required=True)
    parser.add_argument("--heldout", type=int, required=True)
    parser.add_argument("--pace", type=float, required=True)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--outer-lr", type=float, required=True)
    parser.add_argument("--outer-momentum", type=float, required=True)
    worker(parser.parse_args(argv))


if __name__ == "__main__":
    worker_main(sys.argv[1:])
