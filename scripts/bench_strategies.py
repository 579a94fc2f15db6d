"""Averaging strategies on one emulated network: all-reduce vs parameter server vs the LP's adaptive plan.

The DeDLOC Table 1 comparison (seed 000 §4.1; DESIGN §5). Every peer gets its own network namespace on one
bridge (``tests/netns.py``), its download and upload capped with ``tc`` (``--bandwidth-mbps``), and one OS
process running a :class:`~shared.net.host.Host` on its namespace address plus an
:class:`~shared.averaging.allreduce.Averager`. The coordinator (this process) talks to the peers over
stdin/stdout JSON lines, as ``bench_allreduce.py`` does. ``--rtt-ms X`` puts every two peers ``X`` ms of
round trip apart (a userspace delay wire per peer, see ``tests/netns.py``; the JSON records ``rtt_ms``);
the model's ``predicted_s`` ignores latency, so with it ``measured_vs_predicted`` also shows what latency
costs.

For the same network it times rounds of three kinds of plan, all from :mod:`shared.averaging.load_balance`
fed with the emulated bandwidths (bytes/s) and compute rates:

* ``all-reduce`` — :func:`plan_all_reduce`: equal slices for every peer not in client mode;
* ``parameter server`` — :func:`plan_parameter_server` for each candidate server (``--ps-servers``;
  default: the one the model predicts fastest, i.e. the best single server);
* ``adaptive`` — :func:`plan_averaging`, the LP's optimum.

Computing peers (``samples/s > 0`` and chosen by the plan) send their gradient weighted by their samples/s;
the others (CPU-only auxiliary peers, ``--compute 0``) take part with weight 0. The target batch defaults to
one hour of the whole group's compute, so compute is the bottleneck and every peer with an accelerator
computes under every plan: the plans differ only in who aggregates how much, as in Table 1. Peer ``r`` starts
each round with ``(r + 1) * pattern + r / 2`` (``pattern`` exact in float32), so each peer can check its
result against the weighted mean computed in float64 (exact for equal weights); the result must also be
bit-identical on every peer.

A round's time is ``max(end) - min(start)`` over the peers. Each strategy first runs ``--warmup`` untimed
rounds (connections are dialled there), then ``--rounds`` timed rounds of every strategy in turn. Prints one
JSON object: per strategy the median seconds, the model's prediction (``predicted_s``: ``P / X``, which
assumes pipelined full-duplex links) and ``measured_vs_predicted``, the plan's fractions and slices and the
checks; ``best_of_ar_ps`` and ``adaptive_vs_best_of_ar_ps`` (adaptive median / better of the AR and best PS
medians; < 1 is faster).

Needs root, ``ip netns`` and ``tc``; exits with a one-line error (status 2) where they are unavailable.

Examples::

    python scripts/bench_strategies.py --bandwidth-mbps 100,100,100,100
    python scripts/bench_strategies.py --bandwidth-mbps 500,500,20,20
    python scripts/bench_strategies.py --bandwidth-mbps 10,10,10,10 --rtt-ms 50
    python scripts/bench_strategies.py --bandwidth-mbps 1000,20,20,20 --compute 0,1,1,1
    python scripts/bench_strategies.py --bandwidth-mbps 100/20,100/20,100,100 --client-mode 0,0,0,1
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.strategy_trace import LinkSampler, Recorder, analyze, instrument, rates, write_svg  # noqa: E402

if TYPE_CHECKING:
    from shared.averaging.load_balance import PeerSpec, Plan

MBIT = 1e6 / 8  # bytes/s in one Mbit/s
STARTUP_S = 60.0  # a peer process must report its address within this
GRACE_S = 30.0  # beyond a round's deadline before the coordinator gives up on a peer


class BenchError(Exception):
    """A failure to report as one line, not a traceback."""


# ---------------------------------------------------------------------------------------------- scenario


@dataclass(frozen=True)
class Scenario:
    """One emulated group: per peer ``(down_mbps, up_mbps)``, samples/s and client mode."""

    links: tuple[tuple[float, float], ...]
    compute: tuple[float, ...]
    client_mode: tuple[bool, ...]

    def __post_init__(self) -> None:
        n = len(self.links)
        if n < 2:
            raise BenchError("need at least two peers")
        if len(self.compute) != n or len(self.client_mode) != n:
            counts = f"{len(self.compute)} compute rates and {len(self.client_mode)} client flags"
            raise BenchError(f"{n} bandwidths but {counts}")
        if any(not (d > 0 and u > 0 and math.isfinite(d + u)) for d, u in self.links):
            raise BenchError(f"bandwidths must be positive, got {self.links}")
        if any(not (s >= 0 and math.isfinite(s)) for s in self.compute) or not any(self.compute):
            raise BenchError(f"compute rates must be >= 0 with at least one > 0, got {self.compute}")
        if all(self.client_mode):
            raise BenchError("every peer is in client mode: nobody can aggregate")

    @property
    def n(self) -> int:
        return len(self.links)

    def peer_specs(self) -> list[PeerSpec]:
        from shared.averaging.load_balance import PeerSpec

        return [
            PeerSpec(s, d * MBIT, u * MBIT, client_mode=c)
            for (d, u), s, c in zip(self.links, self.compute, self.client_mode, strict=True)
        ]


def parse_scenario(bandwidth: str, compute: str | None = None, client_mode: str | None = None) -> Scenario:
    """``"100,500/20"`` (Mbit/s: symmetric, or download/upload), ``"1,0"`` (samples/s), ``"0,1"`` (flags)."""
    links: list[tuple[float, float]] = []
    for item in _split(bandwidth, "--bandwidth-mbps"):
        down, _, up = item.partition("/")
        try:
            links.append((float(down), float(up or down)))
        except ValueError:
            raise BenchError(f"--bandwidth-mbps: {item!r} is not MBPS or DOWN/UP") from None
    n = len(links)
    rates = [1.0] * n if compute is None else [_number(v, "--compute") for v in _split(compute, "--compute")]
    if client_mode is None:
        flags = [False] * n
    else:
        values = _split(client_mode, "--client-mode")
        if any(v not in ("0", "1") for v in values):
            raise BenchError(f"--client-mode takes 0/1 per peer, got {client_mode!r}")
        flags = [v == "1" for v in values]
    return Scenario(tuple(links), tuple(rates), tuple(flags))


def _split(text: str, option: str) -> list[str]:
    values = [v.strip() for v in text.split(",")]
    if not all(values):
        raise BenchError(f"{option}: empty entry in {text!r}")
    return values


def _number(text: str, option: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise BenchError(f"{option}: {text!r} is not a number") from None


# ---------------------------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Strategy:
    name: str  # "all-reduce", "parameter server @i", "adaptive"
    plan: Plan

    def weights(self, scenario: Scenario) -> list[float]:
        return [s if c else 0.0 for s, c in zip(scenario.compute, self.plan.compute, strict=True)]


def make_strategies(
    scenario: Scenario, numel: int, ps_servers: str = "best", target_batch: float | None = None
) -> list[Strategy]:
    """The plans to time: all-reduce, the parameter server(s) chosen by ``ps_servers`` and the LP's.

    ``ps_servers``: ``"best"`` (the server the model predicts fastest; ties to the lower index), ``"all"``
    (every peer not in client mode) or a comma list of peer indices.
    """
    from shared.averaging.load_balance import plan_all_reduce, plan_averaging, plan_parameter_server

    peers = scenario.peer_specs()
    gradient_bytes = 4.0 * numel
    # One hour of the whole group's compute per step: compute binds, so every accelerator computes.
    batch = target_batch if target_batch is not None else 3600.0 * sum(scenario.compute)
    args = (batch, gradient_bytes)
    candidates = [i for i in range(scenario.n) if not scenario.client_mode[i]]
    ps = {i: plan_parameter_server(peers, i, *args, numel=numel) for i in candidates}
    if ps_servers == "best":
        chosen = [min(candidates, key=lambda i: (ps[i].averaging_seconds, i))]
    elif ps_servers == "all":
        chosen = candidates
    else:
        chosen = [int(_number(v, "--ps-servers")) for v in _split(ps_servers, "--ps-servers")]
        if any(i not in ps for i in chosen):
            raise BenchError(f"--ps-servers: {ps_servers!r} names a client-mode peer or no peer")
    return [
        Strategy("all-reduce", plan_all_reduce(peers, *args, numel=numel)),
        *(Strategy(f"parameter server @{i}", ps[i]) for i in chosen),
        Strategy("adaptive", plan_averaging(peers, *args, numel=numel)),
    ]


# ---------------------------------------------------------------------------------------------- peer side


def pattern(numel: int) -> Any:
    """A fixed float32 vector of multiples of 1/64 in [-8, 8): exact, so the mean can be checked exactly."""
    import numpy as np

    i = np.arange(numel, dtype=np.uint64)
    return (((i * np.uint64(2654435761)) % np.uint64(1024)).astype(np.float32) - 512) / 64


def tcp_counters() -> dict[str, int]:
    """This network namespace's TCP loss counters (``/proc/net/snmp`` and ``/proc/net/netstat``)."""
    wanted = {"RetransSegs", "OutSegs", "TCPTimeouts", "TCPLossProbes", "TCPFastRetrans", "TCPSpuriousRTOs"}
    found: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        with open(path) as f:
            lines = f.read().splitlines()
        for names, values in zip(lines[::2], lines[1::2], strict=False):
            for name, value in zip(names.split()[1:], values.split()[1:], strict=False):
                if name in wanted:
                    found[name] = int(value)
    return found


def start_value(rank: int) -> tuple[float, float]:
    """Peer ``rank`` starts each round with ``a * pattern + b``."""
    return float(rank + 1), rank / 2


def worker(listen: str, numel: int, trace: bool = False) -> None:
    """One peer: a Host (listening on ``listen``; empty: client mode) and an Averager, driven by stdin.
    With ``trace``, its protocol events are recorded (``scripts/strategy_trace.py``) and sent with the
    reply of every round whose command asks for them."""
    import resource

    import numpy as np
    import trio

    from protocols.peer_id import validate_peer_id
    from shared.auth.keys import Identity
    from shared.averaging.allreduce import Averager, GroupPlan, Member
    from shared.net.addresses import parse_multiaddr
    from shared.net.host import Host, HostConfig

    base = pattern(numel)
    vector = np.empty(numel, dtype=np.float32)

    def reply(obj: dict[str, Any]) -> None:
        print(json.dumps(obj), flush=True)

    async def main() -> None:
        config = HostConfig(
            bulk_stall=600.0, handler_deadline=600.0, dial_deadline=30.0, accept_deadline=30.0
        )
        host = Host(Identity.generate(), "bench-strategies", config)
        averager = Averager(host)
        async with trio.open_nursery() as nursery:
            await nursery.start(host.run, [f"/ip4/{listen}/tcp/0"] if listen else [])
            reply({"peer_id": str(host.peer_id), "addr": host.listen_addrs[0] if listen else None})
            setup = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
            me = setup["rank"]
            ids = [validate_peer_id(p) for p, _ in setup["members"]]
            recorder = Recorder({str(p): i for i, p in enumerate(ids)})
            if trace:
                instrument(host, averager, recorder)
            addresses = [None if a is None else parse_multiaddr(a) for _, a in setup["members"]]
            while line := (await trio.to_thread.run_sync(sys.stdin.readline)).strip():
                cmd = json.loads(line)
                weights = cmd["weights"]
                members = tuple(
                    Member(pid, addr, float(w)) for pid, addr, w in zip(ids, addresses, weights, strict=True)
                )
                plan = GroupPlan(
                    cmd["group"].encode(),
                    cmd["round"],
                    members,
                    tuple(cmd["slices"]),
                    deadline=cmd["deadline"],
                    part_numel=cmd["part_numel"],
                    predicted_seconds=cmd["predicted"],
                )
                a, b = start_value(me)
                np.multiply(base, np.float32(a), out=vector)
                np.add(vector, np.float32(b), out=vector)
                reply({"ready": cmd["round"]})
                await trio.to_thread.run_sync(sys.stdin.readline)  # "go"
                recorder.events.clear()
                usage = resource.getrusage(resource.RUSAGE_SELF)
                tcp = tcp_counters()
                start = time.time()
                result = await averager.all_reduce(plan, vector, me)
                end = time.time()
                after = resource.getrusage(resource.RUSAGE_SELF)
                cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
                tcp = {k: v - tcp.get(k, 0) for k, v in tcp_counters().items()}
                reply(
                    {
                        "round": cmd["round"],
                        "start": start,
                        "end": end,
                        "complete": result.outcome.complete,
                        "cpu_s": round(cpu, 4),
                        "tcp": tcp,
                        **({"events": recorder.events} if cmd.get("trace") else {}),
                    }
                )
                # checked once every peer's round ended ("check"), so that checking takes no CPU from a
                # peer still averaging
                await trio.to_thread.run_sync(sys.stdin.readline)
                total = sum(weights)
                ca = sum(w * start_value(k)[0] for k, w in enumerate(weights)) / total
                cb = sum(w * start_value(k)[1] for k, w in enumerate(weights)) / total
                expected = (base.astype(np.float64) * ca + cb).astype(np.float32)
                err = np.abs(vector.astype(np.float64) - expected) / np.maximum(1.0, np.abs(expected))
                reply(
                    {
                        "max_rel_err": float(err.max()) if numel else 0.0,
                        "digest": hashlib.sha256(vector.tobytes()).hexdigest(),
                    }
                )
            nursery.cancel_scope.cancel()

    trio.run(main)


# ---------------------------------------------------------------------------------------------- coordinator


@dataclass
class Peer:
    proc: subprocess.Popen[bytes]
    stderr: IO[bytes]
    rank: int
    pending: bytearray = field(default_factory=bytearray)

    def send(self, obj: object) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise BenchError(f"peer {self.rank} exited ({self.proc.poll()}): {self.stderr_tail()}") from None

    def receive(self, within: float) -> dict[str, Any]:
        """The next JSON line from the peer; ``BenchError`` if it dies or stays silent."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + within
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(0.0, left))
            if not ready:
                raise BenchError(f"peer {self.rank} silent for {within:.0f} s: {self.stderr_tail()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait()
                raise BenchError(f"peer {self.rank} exited ({code}): {self.stderr_tail()}")
            self.pending += chunk
        line, _, rest = bytes(self.pending).partition(b"\n")
        self.pending[:] = rest
        try:
            obj: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            raise BenchError(f"peer {self.rank} wrote {line[:200]!r}: {self.stderr_tail()}") from None
        return obj

    def stderr_tail(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        text = self.stderr.read().decode(errors="replace").strip()
        return text[-2000:] or "(no stderr)"


@contextlib.contextmanager
def peer_group(
    hosts: Sequence[Any], scenario: Scenario, numel: int, trace: bool = False
) -> Iterator[list[Peer]]:
    """One peer process per namespace host, introduced to each other; killed and reaped on exit."""
    peers: list[Peer] = []
    try:
        for rank, host in enumerate(hosts):
            listen = "" if scenario.client_mode[rank] else host.address
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--listen", listen]
            argv += ["--numel", str(numel), *(["--trace-events"] if trace else [])]
            stderr = tempfile.TemporaryFile()
            try:
                proc = host.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
            except BaseException:
                stderr.close()
                raise
            peers.append(Peer(proc, stderr, rank))
        hello = [p.receive(STARTUP_S) for p in peers]
        members = [[h["peer_id"], h["addr"]] for h in hello]
        for p in peers:
            p.send({"rank": p.rank, "members": members})
        yield peers
    finally:
        for p in peers:
            with contextlib.suppress(OSError):
                assert p.proc.stdin is not None
                p.proc.stdin.close()
        end = time.monotonic() + 5.0
        for p in peers:
            try:
                p.proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
            with contextlib.suppress(OSError):
                assert p.proc.stdout is not None
                p.proc.stdout.close()
            p.stderr.close()


_round_counter = 0


@dataclass(frozen=True)
class TraceSetup:
    """Where to trace: the LAN's switch namespace and bridge ports (one per peer), and the output folder."""

    switch: str
    ports: tuple[str, ...]
    out: Path


def run_round(
    peers: Sequence[Peer],
    strategy: Strategy,
    scenario: Scenario,
    deadline: float,
    trace: TraceSetup | None = None,
    numel: int = 0,
    part_numel: int = 0,
) -> dict[str, Any]:
    """One averaging round of ``strategy``; its time and checks (and, with ``trace``, where the time went:
    ``scripts/strategy_trace.py``)."""
    global _round_counter
    _round_counter += 1
    cmd = {
        "group": strategy.name,
        "round": _round_counter,
        "slices": list(strategy.plan.slices),
        "part_numel": part_numel,
        "weights": strategy.weights(scenario),
        "deadline": deadline,
        # as the volunteers' plans do: the base of the stall timeouts (shared/averaging/deadlines.py)
        "predicted": strategy.plan.averaging_seconds,
        "trace": trace is not None,
    }
    for p in peers:
        p.send(cmd)
    for p in peers:
        p.receive(STARTUP_S)  # ready: its vector is filled
    sampler = LinkSampler(trace.switch, trace.ports) if trace is not None else None
    try:
        for p in peers:
            p.send("go")
        reports = [p.receive(deadline + GRACE_S) for p in peers]
    finally:
        samples = sampler.stop() if sampler is not None else []
    for p in peers:
        p.send("check")
    for p, report in zip(peers, reports, strict=True):
        report.update(p.receive(STARTUP_S))
    traced = None
    if trace is not None:
        traced = _write_trace(trace, strategy, scenario, reports, samples, numel)
    return {
        "seconds": max(r["end"] for r in reports) - min(r["start"] for r in reports),
        "complete": all(r["complete"] for r in reports),
        "max_rel_err": max(r["max_rel_err"] for r in reports),
        "bit_identical": len({r["digest"] for r in reports}) == 1,
        "peer_s": [round(r["end"] - r["start"], 3) for r in reports],
        "start_spread_s": max(r["start"] for r in reports) - min(r["start"] for r in reports),
        "cpu_s": [r["cpu_s"] for r in reports],
        "tcp": {k: sum(r["tcp"].get(k, 0) for r in reports) for k in reports[0]["tcp"]},
        **({"trace": traced} if traced is not None else {}),
    }


def _write_trace(
    trace: TraceSetup,
    strategy: Strategy,
    scenario: Scenario,
    reports: list[dict[str, Any]],
    samples: list[list[float]],
    numel: int,
) -> dict[str, Any]:
    """Write ``<strategy>.json`` (samples, events, summary) and ``<strategy>.svg``; return the summary."""
    plan = strategy.plan
    summary = analyze(
        samples,
        [r["events"] for r in reports],
        reports,
        scenario.links,
        plan.fractions,
        plan.compute,
        4.0 * numel,
        plan.averaging_seconds,
    )
    start = min(r["start"] for r in reports)
    bin_s = max(0.02, summary["round_s"] / 200)
    series = rates(samples, start, scenario.links, bin_s)
    name = strategy.name.replace(" ", "-").replace("@", "")
    trace.out.mkdir(parents=True, exist_ok=True)
    events = [
        [[e[0], e[1], e[2], round(e[3] - start, 4), round(e[4] - start, 4), e[5]] for e in r["events"]]
        for r in reports
    ]
    full = {
        "strategy": strategy.name,
        "start": start,
        "bin_s": bin_s,
        "summary": summary,
        "rates": series,
        "events": events,
        "samples": samples,
    }
    (trace.out / f"{name}.json").write_text(json.dumps(full))
    write_svg(
        trace.out / f"{name}.svg",
        f"{strategy.name}: round {summary['round_s']} s, LP predicts {summary['predicted_s']} s",
        series,
        bin_s,
        plan.averaging_seconds,
        [r["end"] - start for r in reports],
    )
    return summary


def measure(
    peers: Sequence[Peer],
    strategies: Sequence[Strategy],
    scenario: Scenario,
    rounds: int,
    warmup: int,
    deadline: float,
    pause: float = 1.0,
    trace: TraceSetup | None = None,
    numel: int = 0,
    part_numel: int = 0,
) -> dict[str, dict[str, Any]]:
    """Time every strategy: ``warmup`` untimed rounds each, then ``rounds`` timed rounds of each strategy in
    turn (interleaved, so a drift in the machine's load hits every strategy alike).

    Every round starts after ``pause`` idle seconds, longer than TCP's retransmission timeout, so every
    connection restarts from slow start (``tcp_slow_start_after_idle``) as it would after a compute phase
    in training: no strategy inherits congestion windows warmed up by the round before it.
    """

    def one(strategy: Strategy, traced: bool = False) -> dict[str, Any]:
        time.sleep(pause)
        return run_round(peers, strategy, scenario, deadline, trace if traced else None, numel, part_numel)

    warm = {s.name: [one(s) for _ in range(warmup)] for s in strategies}
    timed: dict[str, list[dict[str, Any]]] = {s.name: [] for s in strategies}
    for r in range(rounds):
        for s in strategies:
            timed[s.name].append(one(s, traced=r == rounds - 1))
    return {s.name: _summary(s, warm[s.name], timed[s.name]) for s in strategies}


def _summary(strategy: Strategy, warm: list[dict[str, Any]], timed: list[dict[str, Any]]) -> dict[str, Any]:
    plan = strategy.plan
    median = statistics.median(r["seconds"] for r in timed)
    every = warm + timed
    cpu_sums = [sum(r["cpu_s"]) for r in timed]
    return {
        "round_s_median": median,
        "round_s_all": [r["seconds"] for r in timed],
        "warmup_round_s": [r["seconds"] for r in warm],
        "peer_s_last_round": timed[-1]["peer_s"],
        "start_spread_s_max": max(r["start_spread_s"] for r in every),
        "predicted_s": plan.averaging_seconds,
        "measured_vs_predicted": median / plan.averaging_seconds if plan.averaging_seconds > 0 else None,
        "fractions": [round(f, 6) for f in plan.fractions],
        "slices": list(plan.slices),
        "compute": list(plan.compute),
        "method": plan.method,
        "incomplete_rounds": sum(not r["complete"] for r in every),
        "max_rel_err": max(r["max_rel_err"] for r in every),
        "bit_identical": all(r["bit_identical"] for r in every),
        # CPU seconds of every peer process together per round, and as a share of the machine's cores
        "cpu_s_all_peers_median": round(statistics.median(cpu_sums), 3),
        "cpu_share_of_machine": round(statistics.median(cpu_sums) / median / (os.cpu_count() or 1), 3),
        "cpu_s_busiest_peer_median": round(statistics.median(max(r["cpu_s"]) for r in timed), 3),
        # TCP segments sent, retransmitted and retransmission timeouts, all peers, the last timed round
        "tcp_last_round": timed[-1]["tcp"],
        **({"trace": timed[-1]["trace"]} if "trace" in timed[-1] else {}),
    }


def check_environment() -> None:
    """``BenchError`` with the reason if namespaces or ``tc`` shaping are unavailable."""
    from tests.netns import netns_available, tc_available

    reason = netns_available() or tc_available()
    if reason is not None:
        raise BenchError(f"network namespaces with tc shaping are unavailable: {reason}")


def run_benchmark(
    scenario: Scenario,
    numel: int,
    rounds: int = 3,
    warmup: int = 1,
    ps_servers: str = "best",
    target_batch: float | None = None,
    deadline: float | None = None,
    pause: float = 1.0,
    trace_dir: Path | None = None,
    rtt_ms: float | None = None,
    part_numel: int = 0,
) -> dict[str, Any]:
    """Build the shaped LAN (every pair ``rtt_ms`` apart, if given) and peers, time every strategy on it
    (see :func:`measure`); the JSON-ready result. With ``trace_dir``, the last timed round of each
    strategy is traced into it."""
    from tests.netns import LinkError, lan

    check_environment()
    strategies = make_strategies(scenario, numel, ps_servers, target_batch)
    slowest = max(s.plan.averaging_seconds for s in strategies)
    # The model ignores protocol overhead and start-up; a round past 5x its prediction has gone wrong.
    round_deadline = deadline if deadline is not None else max(30.0, 5.0 * slowest)
    started = time.monotonic()
    try:
        with (
            lan(scenario.n, shape=list(scenario.links), rtt_ms=rtt_ms) as hosts,
            peer_group(hosts, scenario, numel, trace_dir is not None) as peers,
        ):
            trace = None
            if trace_dir is not None:
                trace = TraceSetup(hosts[0].switch, tuple(h.port for h in hosts), trace_dir)
            results = measure(
                peers, strategies, scenario, rounds, warmup, round_deadline, pause, trace, numel, part_numel
            )
    except LinkError as exc:  # a delay wire died: its peer's link was dead, the timings are void
        raise BenchError(f"emulated link failed: {exc}") from exc
    ar = results["all-reduce"]["round_s_median"]
    ps_name = min(
        (k for k in results if k.startswith("parameter server")), key=lambda k: results[k]["round_s_median"]
    )
    best = min(ar, results[ps_name]["round_s_median"])
    adaptive = results["adaptive"]["round_s_median"]
    plan = strategies[-1].plan
    same = [s.name for s in strategies[:-1] if (s.plan.slices, s.plan.compute) == (plan.slices, plan.compute)]
    return {
        "peers": scenario.n,
        "bandwidth_mbps": [{"down": d, "up": u} for d, u in scenario.links],
        "rtt_ms": rtt_ms,
        "part_numel": part_numel or "auto",
        "compute": list(scenario.compute),
        "client_mode": list(scenario.client_mode),
        "numel": numel,
        "tensor_mb": numel * 4 / 1e6,
        "rounds": rounds,
        "warmup": warmup,
        "round_deadline_s": round_deadline,
        "pause_s": pause,
        "strategies": results,
        "best_ps": ps_name,
        "best_of_ar_ps": "all-reduce" if ar <= results[ps_name]["round_s_median"] else ps_name,
        "best_of_ar_ps_s": best,
        "adaptive_vs_best_of_ar_ps": adaptive / best,
        "adaptive_vs_ar": adaptive / ar,
        # baselines whose plan equals the adaptive one: their medians differ only by measurement noise
        "adaptive_plan_same_as": same,
        "all_complete": all(r["incomplete_rounds"] == 0 for r in results.values()),
        "all_bit_identical": all(r["bit_identical"] for r in results.values()),
        "max_rel_err": max(r["max_rel_err"] for r in results.values()),
        "wall_s": time.monotonic() - started,
        "loadavg": os.getloadavg(),
    }


class Terminated(BaseException):
    """SIGTERM/SIGHUP: unwind through the cleanup in ``peer_group`` and ``lan`` like Ctrl+C does."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bandwidth-mbps", help="per peer: Mbit/s (symmetric) or DOWN/UP, comma-separated")
    parser.add_argument("--compute", help="per peer samples/s (0: CPU-only auxiliary peer); default all 1")
    parser.add_argument("--client-mode", help="per peer 0/1: accepts no inbound connections")
    parser.add_argument("--numel", type=int, default=2_000_000, help="float32 elements averaged per round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per strategy (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds per strategy before timing")
    parser.add_argument("--ps-servers", default="best", help="best | all | comma list of peer indices")
    parser.add_argument("--target-batch", type=float, help="samples per step for the LP (default: 1 h)")
    parser.add_argument("--deadline", type=float, help="seconds per round (default: 5x the slowest model)")
    parser.add_argument("--pause", type=float, default=1.0, help="idle seconds before each round")
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="trace the last timed round of each strategy: DIR/<strategy>.json and .svg",
    )
    parser.add_argument("--rtt-ms", type=float, help="round-trip time between every two peers (default: ~0)")
    parser.add_argument(
        "--part-numel", type=int, default=0, help="elements per part (default 0: the plans' automatic size)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trace-events", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--listen", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.listen, args.numel, args.trace_events)
        return
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    try:
        if not args.bandwidth_mbps:
            raise BenchError("--bandwidth-mbps is required")
        if args.part_numel < 0:
            raise BenchError("--part-numel must be >= 0")
        if args.numel < 1 or args.rounds < 1 or args.warmup < 0 or not args.pause >= 0:
            raise BenchError("--numel and --rounds must be >= 1, --warmup and --pause >= 0")
        if args.rtt_ms is not None and not 0 <= args.rtt_ms < 40_000:
            raise BenchError("--rtt-ms must be in [0, 40000)")
        scenario = parse_scenario(args.bandwidth_mbps, args.compute, args.client_mode)
        result = run_benchmark(
            scenario,
            args.numel,
            args.rounds,
            args.warmup,
            args.ps_servers,
            args.target_batch,
            args.deadline,
            args.pause,
            args.trace,
            args.rtt_ms,
            args.part_numel,
        )
    except BenchError as exc:
        print(f"bench_strategies: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("bench_strategies: interrupted; namespaces and peers removed", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except Terminated as exc:
        print(f"bench_strategies: {exc}; namespaces and peers removed", file=sys.stderr)
        sys.exit(128 + exc.signum)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
