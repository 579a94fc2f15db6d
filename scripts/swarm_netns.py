"""``bench_swarm.py --netns``: the SWARM benchmark with every peer its own process on a tc-shaped link.

The same experiment as on loopback (:mod:`scripts.bench_swarm`: the fixed pipelines, then the swarm and the
recovery, driven by the same :func:`~scripts.bench_swarm.run_fixed` and
:func:`~scripts.bench_swarm.run_swarm`) with a different :class:`~scripts.bench_swarm.Backend`: every stage
server and every group of trainers (the node that carries a run's trainers is also its DHT's first peer)
is an OS process in a network
namespace of its own on one bridge (:func:`tests.netns.lan`). Each host's upload and download are capped
with ``tc`` (``tbf``) at ``--netns-mbps`` (one value, or one per peer of ``--speeds``, so bandwidths can
differ between peers; the trainers' hosts get the largest), and every pair of hosts is ``--netns-rtt-ms``
apart (a userspace delay wire per host: this kernel has no ``netem``; see ``tests/netns.py``). The LAN is
built for each mode; the fixed pipelines use ``N / S`` trainer hosts (one per pipeline), the swarm one
(carrying ``N / S`` trainer clients, as on loopback).

**Processes** (:mod:`scripts.netns_peers`): the coordinator (this process) starts every peer of a mode at
once; each builds the model and its micro-batches and says ``ready``; then they are driven by JSON lines on
stdin: a trainer process is told to ``open`` its node (it answers its address), to wait until every stage
is ``served`` (fixed pipelines) and to ``train``; a server process is told to ``join`` a run through that
address, at a stage or (``null``) in the swarm. A server that dies is ``SIGKILL``-ed: the process is gone,
its connections reset, its DHT records linger until they expire, as with a real peer's crash.

**State.** Every peer writes its state every ``PUSH_S`` seconds: a server its stage, moves, its stage
server's counters and queue; a trainer process the micro-batches completed since its last report, each
with the time it completed on ``CLOCK_MONOTONIC`` (shared by all processes of this machine, so the
coordinator's windows need no clock correction), its errors, busy answers and failed requests, and every
peer its CPU seconds (``getrusage``). Before reading the completions of a window the coordinator asks
every trainer process to ``flush`` (:meth:`Netns.settle`), so a window's count is exact; the placement the
warm-up and the timeline see is up to ``PUSH_S`` old. ``cpu_fraction`` here is the CPU seconds of all the
peer processes together per second (up to the number of cores).

Needs root, ``ip netns`` and ``tc``; exits with a one-line error (status 2) where they are unavailable.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import trio  # noqa: E402

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from protocols.training import TrainingSpec  # noqa: E402
from scripts import bench_swarm as bench  # noqa: E402
from scripts.netns_peers import PeerError, PeerProcess, start, stop, unavailable  # noqa: E402
from shared.node import Node  # noqa: E402
from volunteer.swarm.client import SwarmClient  # noqa: E402
from volunteer.swarm.member import SwarmMember  # noqa: E402
from volunteer.tasks.base import Task  # noqa: E402

SCRIPT = Path(__file__).resolve()
STARTUP_S = 300.0  # to import torch and build the model, every peer of a mode at once on 2 shared cores
ANSWER_S = 120.0  # to answer a command (open a node, see every stage served)
PUSH_S = 0.5  # how often every peer writes its state
STOP_S = 10.0  # after end of file on its stdin, before SIGKILL

Run = Callable[[bench.Backend, argparse.Namespace, Sequence[float]], Awaitable[dict[str, Any]]]


# ---------------------------------------------------------------------------------------------- peer side


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Session:
    """What a peer process does for one mode: its node, its server or trainers, and its state reports;
    ``reset`` ends it (the node stops, as at the end of the loopback benchmark's ``trio.run``)."""

    def __init__(self, args: argparse.Namespace, setup: tuple[Task, TrainingSpec, Any]) -> None:
        self.args, self.setup = args, setup
        self.member = SwarmMember()
        self.out = bench.Trainers()
        self.clients: list[SwarmClient] = []
        self.reported = 0
        self.node: Node | None = None
        self.done = trio.Event()

    async def run(self, task_status: trio.TaskStatus[trio.Nursery]) -> None:
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(nursery)
                await trio.sleep_forever()  # until reset cancels the nursery
        finally:
            self.done.set()

    def state(self) -> dict[str, Any]:
        if self.args.role == "server":
            s = bench.server_state(self.member)
            return {"stage": s.stage, "moves": s.moves, "counters": s.counters, "queued": s.queued,
                    "periods": s.periods, "capacities": s.capacities, "cpu_s": cpu_s()}  # fmt: skip
        out = bench.count_clients(self.out, self.clients)
        offset = time.monotonic() - trio.current_time()  # trio's clock to CLOCK_MONOTONIC
        new = [[t + offset, n] for t, n in out.completions[self.reported :]]
        self.reported += len(new)
        return {"new": new, "errors": out.errors, "last_error": out.last_error, "busy": out.busy,
                "failures": out.failures, "cpu_s": cpu_s()}  # fmt: skip

    async def push(self) -> None:
        while True:
            say({"state": self.state()})
            await trio.sleep(PUSH_S)

    async def handle(self, nursery: trio.Nursery, command: dict[str, Any]) -> None:
        """One command of the coordinator (module docstring, "Processes")."""
        args, (task, spec, batches) = self.args, self.setup
        if "join" in command:  # a server
            join = command["join"]

            async def body(node: Node) -> None:
                run_id, stage = join["run"], join["stage"]
                await bench.serve(node, task, spec, args, run_id, stage, args.speed, self.member)

            await bench.start_node(nursery, join["run"], join["initial"], body, args.listen)
            nursery.start_soon(self.push)
        elif "open" in command:  # a trainer process: the run's first node
            self.node, _ = await bench.start_node(nursery, command["open"], [], None, args.listen)
            say({"addr": str(self.node.host.listen_addrs[0])})
            nursery.start_soon(self.push)
        elif "served" in command:
            assert self.node is not None
            await bench.wait_served(self.node, args.stages, command["served"], ANSWER_S)
            say({"served": True})
        elif "train" in command:
            assert self.node is not None
            train = command["train"]
            self.clients += bench.start_trainers(
                nursery, self.node, train["clients"], train["in_flight"], args.stages, batches, self.out
            )
        elif "flush" in command:
            say({"state": self.state()})
            say({"flushed": True})
        else:
            raise ValueError(f"unknown command {command!r}")


def say(obj: Mapping[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def worker(args: argparse.Namespace) -> None:
    """One peer process: JSON commands on stdin, JSON lines on stdout, until end of file."""
    setup = bench.setup(args.stages, args.micro_batch)

    async def main() -> None:
        async with trio.open_nursery() as outer:
            session = Session(args, setup)
            nursery = await outer.start(session.run)
            say({"ready": True})
            while line := await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True):
                command: dict[str, Any] = json.loads(line)
                if "reset" in command:
                    nursery.cancel_scope.cancel()
                    await session.done.wait()
                    session = Session(args, setup)
                    nursery = await outer.start(session.run)
                    say({"reset": True})
                else:
                    await session.handle(nursery, command)
            outer.cancel_scope.cancel()  # end of file: the coordinator is done with us

    trio.run(main)


def worker_main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--role", choices=("server", "trainer"), required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--speed", type=float, default=1.0)
    for name in ("stages", "micro_batch"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, required=True)
    for name in ("base_seconds", "period", "hysteresis"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, required=True)
    worker(parser.parse_args(argv))


# ---------------------------------------------------------------------------------------------- coordinator


@dataclass
class _Proc:
    peer: PeerProcess
    answers: tuple[trio.MemorySendChannel[dict[str, Any]], trio.MemoryReceiveChannel[dict[str, Any]]]
    state: dict[str, Any] = field(default_factory=dict)
    killed: bool = False


class Pool:
    """The peer processes on ``hosts``, for every mode: servers ``0 .. N-1`` on the first ``N`` hosts, the
    trainer processes (one per group) on the rest; their state reports go to the mode now running."""

    def __init__(self, args: argparse.Namespace, order: Sequence[float], hosts: Sequence[Any]) -> None:
        self.args, self.order, self.hosts = args, order, hosts
        self.procs: list[_Proc] = []
        self.mode: Netns | None = None

    def _argv(self, role: str, host: Any, speed: float) -> list[str]:
        a = self.args
        return [
            sys.executable, str(SCRIPT), "--worker", "--role", role, "--listen", host.address,
            "--speed", repr(speed), "--stages", str(a.stages), "--micro-batch", str(a.micro_batch),
            "--base-seconds", repr(a.base_seconds), "--period", repr(a.period),
            "--hysteresis", repr(a.hysteresis),
        ]  # fmt: skip

    async def start_all(self, nursery: trio.Nursery) -> None:
        """Start every peer process, read their lines from now on, and wait until each is ready."""
        n = len(self.order)
        for rank, host in enumerate(self.hosts):
            role, speed = ("server", self.order[rank]) if rank < n else ("trainer", 0.0)
            answers = trio.open_memory_channel[dict[str, Any]](64)
            self.procs.append(_Proc(start(host, self._argv(role, host, speed), rank), answers))
        for proc in self.procs:
            nursery.start_soon(self._read, proc)
        for proc in self.procs:
            await self.answer(proc, "ready")

    async def reset_all(self) -> None:
        """Every live process ends its session (its node stops) and forgets its state but its CPU time."""
        live = [p for p in self.procs if not p.killed]
        for proc in live:
            proc.peer.send({"reset": True})
        for proc in live:
            await self.answer(proc, "reset")
            proc.state = {"cpu_s": proc.state.get("cpu_s", 0.0)}

    async def _read(self, proc: _Proc) -> None:
        while True:
            try:
                message = await trio.to_thread.run_sync(proc.peer.receive, 1e6, abandon_on_cancel=True)
            except PeerError:
                if proc.killed:
                    return
                raise
            if "state" in message:
                proc.state = message["state"]
                if "new" in proc.state and self.mode is not None:
                    self.mode.absorb(proc.peer.rank - len(self.order), proc.state)
            else:
                await proc.answers[0].send(message)

    async def answer(self, proc: _Proc, key: str) -> dict[str, Any]:
        """The process's next answer, which must be ``key``'s (every process starts at once, so the
        first ``ready`` may take all of ``STARTUP_S``)."""
        limit = STARTUP_S if key == "ready" else ANSWER_S
        with trio.move_on_after(limit) as waited:
            message = await proc.answers[1].receive()
        if waited.cancelled_caught:
            tail = proc.peer.stderr_tail()
            raise PeerError(f"peer {proc.peer.rank}: no {key!r} within {limit:.0f} s: {tail}")
        if key not in message:
            raise PeerError(f"peer {proc.peer.rank} answered {message!r}, expected {key!r}")
        return message


class Netns:
    """One mode's :class:`~scripts.bench_swarm.Backend` on the processes of ``pool``."""

    def __init__(self, pool: Pool) -> None:
        self.pool, self.order = pool, pool.order
        self.groups: list[tuple[str, str, bench.Trainers]] = []  # run id, its first node's address, trainers

    def _trainer(self, group: int) -> _Proc:
        return self.pool.procs[len(self.order) + group]

    def absorb(self, group: int, state: Mapping[str, Any]) -> None:
        """A trainer process's report: its group's completions grow."""
        out = self.groups[group][2]
        out.completions += [(float(t), int(k)) for t, k in state["new"]]
        out.errors, out.last_error = state["errors"], state["last_error"]
        out.busy, out.failures = state["busy"], state["failures"]

    def now(self) -> float:
        return time.monotonic()

    def cpu_s(self) -> float:
        return math.fsum(p.state.get("cpu_s", 0.0) for p in self.pool.procs)

    async def open_group(self, run_id: str) -> int:
        group = len(self.groups)
        proc = self._trainer(group)
        self.groups.append((run_id, "", bench.Trainers()))
        proc.peer.send({"open": run_id})
        address = (await self.pool.answer(proc, "addr"))["addr"]
        self.groups[group] = (run_id, address, self.groups[group][2])
        return group

    async def start_server(self, i: int, group: int, stage: int | None) -> None:
        run_id, address, _ = self.groups[group]
        self.pool.procs[i].peer.send({"join": {"run": run_id, "initial": [address], "stage": stage}})

    async def wait_served(self, group: int, counts: Sequence[int]) -> None:
        self._trainer(group).peer.send({"served": list(counts)})
        await self.pool.answer(self._trainer(group), "served")

    async def start_trainers(self, group: int, clients: int, in_flight: int) -> None:
        self._trainer(group).peer.send({"train": {"clients": clients, "in_flight": in_flight}})

    def servers(self) -> dict[int, bench.ServerState]:
        out = {}
        for i, proc in enumerate(self.pool.procs[: len(self.order)]):
            s = proc.state
            if proc.killed or "moves" not in s:
                continue
            counters = tuple(s["counters"]) if s["counters"] is not None else None
            moves = [(int(a), int(b)) for a, b in s["moves"]]
            periods = {str(k): int(n) for k, n in s["periods"].items()}
            seen = None if s["capacities"] is None else [float(c) for c in s["capacities"]]
            out[i] = bench.ServerState(s["stage"], moves, counters, int(s["queued"]), periods, seen)
        return out

    async def settle(self) -> None:
        for group in range(len(self.groups)):
            self._trainer(group).peer.send({"flush": True})
            await self.pool.answer(self._trainer(group), "flushed")

    def trainers(self, group: int) -> bench.Trainers:
        return self.groups[group][2]

    async def kill(self, indices: Sequence[int]) -> None:
        for i in indices:
            self.pool.procs[i].killed = True
            self.pool.procs[i].peer.proc.kill()


async def _drive(
    modes: Sequence[tuple[str, Run]], args: argparse.Namespace, order: Sequence[float], hosts: Sequence[Any]
) -> dict[str, dict[str, Any]]:
    pool = Pool(args, order, hosts)
    results: dict[str, dict[str, Any]] = {}
    try:
        async with trio.open_nursery() as nursery:
            await pool.start_all(nursery)
            bench.log(f"netns: {len(hosts)} peer processes ready")
            for name, run in modes:
                if results:
                    await pool.reset_all()
                pool.mode = Netns(pool)
                before = os.getloadavg()
                results[name] = await run(pool.mode, args, order)
                results[name]["loadavg"] = bench.loads(before)
            nursery.cancel_scope.cancel()
    finally:
        stop([p.peer for p in pool.procs], STOP_S)
    return results


def links(args: argparse.Namespace, arrivals: Sequence[int]) -> tuple[list[float], float]:
    """Each server's link (Mbit/s, up and down) in arrival order, and the trainers' hosts' link."""
    mbps = args.netns_mbps
    per_peer = [mbps[j] for j in arrivals] if len(mbps) > 1 else [mbps[0]] * len(arrivals)
    return per_peer, max(mbps)


def check(args: argparse.Namespace) -> dict[str, Any]:
    """The link settings for the JSON; ``PeerError`` for bad ones or where namespaces are unavailable
    (``PeerError``, not ``bench_swarm.BenchError``: run as a script, that module is ``__main__``)."""
    if len(args.netns_mbps) not in (1, len(args.speeds)):
        raise PeerError(f"--netns-mbps takes one value or one per peer of --speeds ({len(args.speeds)})")
    if any(not m < 1e5 for m in args.netns_mbps):
        raise PeerError("--netns-mbps must be in (0, 100000)")
    if not 0 <= args.netns_rtt_ms < 40_000:
        raise PeerError("--netns-rtt-ms must be in [0, 40000)")
    reason = unavailable()
    if reason is not None:
        raise PeerError(f"network namespaces with tc shaping are unavailable: {reason}")
    return {
        "shaped": "tc tbf, each host's upload and download; delay wires (tests/netns.py)",
        "mbps_per_peer": args.netns_mbps if len(args.netns_mbps) > 1 else args.netns_mbps * len(args.speeds),
        "trainer_mbps": max(args.netns_mbps),
        "rtt_ms": args.netns_rtt_ms,
    }


def first_error(exc: BaseException) -> BaseException:
    """The first leaf of nested exception groups (trio's nurseries wrap what their tasks raise)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def run(
    modes: Sequence[tuple[str, Run]],
    args: argparse.Namespace,
    order: Sequence[float],
    arrivals: Sequence[int],
) -> dict[str, dict[str, Any]]:
    """Each of ``modes`` in turn with the same peer processes on one shaped LAN (module docstring); a mode
    that kills servers must come last. Any failure of a peer or a link is one ``PeerError``."""
    from tests.netns import LinkError, lan

    servers, trainers = links(args, arrivals)
    groups = len(order) // args.stages  # the fixed pipelines' trainer processes; the swarm uses the first
    shape: list[tuple[float | None, float | None]] = [(m, m) for m in [*servers, *[trainers] * groups]]
    try:
        with lan(len(shape), shape=shape, rtt_ms=args.netns_rtt_ms or None) as hosts:
            return trio.run(_drive, modes, args, order, hosts)
    except LinkError as exc:
        raise PeerError(f"emulated link failed: {exc}") from exc
    except BaseExceptionGroup as group:
        first = first_error(group)
        if isinstance(first, PeerError):
            raise PeerError(str(first)) from group
        raise


if __name__ == "__main__":
    worker_main(sys.argv[1:])
