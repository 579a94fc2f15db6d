#!/usr/bin/env python
"""
Performance-anchor harness for hivemind (PyPI hivemind==1.1.12) on loopback.

Run it through scripts/reference/run.sh, which creates the reference library's own venv (see
docs/benchmarks.md), or with that venv's python:

    $REFERENCE_DIR/venv/bin/python scripts/reference/hivemind_bench.py --out hivemind_results.json

Measures (everything on 127.0.0.1, hivemind defaults unless stated):
  a. DHT: start --dht-nodes hivemind.DHT nodes (each = 1 python process + 1 p2pd daemon), all bootstrapped off
     the first one; store --dht-keys keys from node[1] and get them from node[-1]; per-op latency + success rate.
  b. All-reduce: for each group size in --peers, spawn that many separate peer processes; each owns its own
     hivemind.DHT + hivemind.averaging.DecentralizedAverager over one float32 tensor of --numel elements filled
     with its rank. One warm-up step, then --rounds timed steps. Matchmaking (group formation) and the all-reduce
     itself are timed separately: step(wait=False, require_trigger=True) forms the group, all peers then meet at a
     barrier and trigger the all-reduce at the same instant; the round time is max(end) - min(start) over peers.
     Correctness: after every round each peer must hold mean(0..N-1) = (N-1)/2; the max abs error is reported.
  c. Same all-reduce for a group of --client-group peers where the last peer runs with client_mode=True
     (its DHT and averager accept no incoming connections).

Prints exactly one JSON object to stdout (progress/logs go to stderr). Also writes it to --out if given.
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
import traceback


def log(*args):
    print(f"[bench {time.strftime('%H:%M:%S')}]", *args, file=sys.stderr, flush=True)


def percentile(values, q):
    """Nearest-rank-with-interpolation percentile (same as numpy.percentile 'linear')."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_ms(seconds_list):
    ms = [s * 1000.0 for s in seconds_list]
    if not ms:
        return dict(n=0)
    return dict(
        n=len(ms),
        median_ms=round(statistics.median(ms), 3),
        p95_ms=round(percentile(ms, 95), 3),
        mean_ms=round(statistics.fmean(ms), 3),
        min_ms=round(min(ms), 3),
        max_ms=round(max(ms), 3),
    )


# ----------------------------------------------------------------------------------------------------------------
# process bookkeeping: we only ever kill processes that this script started, by explicit PID
# ----------------------------------------------------------------------------------------------------------------


def descendants(pid):
    """PIDs of all live descendants of pid (via /proc), children first."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        for c in children.get(p, []):
            out.append(c)
            stack.append(c)
    return out


def kill_pids(pids, sig=signal.SIGKILL):
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
        except Exception as e:  # pragma: no cover
            log(f"could not kill {p}: {e!r}")


class ForeignLoadMonitor:
    """
    Background sampler (1 Hz) of CPU time used by processes that are NOT this script or its descendants
    (and not kernel threads). Lets a reader tell whether a result was disturbed by other work on the machine.
    """

    def __init__(self, period=1.0):
        import threading

        self.period = period
        self.clk = os.sysconf("SC_CLK_TCK")
        self.foreign_s = 0.0
        self.steal_s = 0.0  # hypervisor steal time (all cores), from /proc/stat
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _snapshot():
        procs = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                procs[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime+stime
            except (OSError, ValueError, IndexError):
                continue
        return procs

    def _foreign_ticks(self, before, after):
        children = {}
        for pid, (ppid, _) in after.items():
            children.setdefault(ppid, []).append(pid)
        mine, stack = {os.getpid()}, [os.getpid()]
        while stack:
            for c in children.get(stack.pop(), []):
                if c not in mine:
                    mine.add(c)
                    stack.append(c)
        ticks = 0
        for pid, (ppid, t) in after.items():
            if pid in mine or pid == 2 or ppid == 2 or pid not in before:
                continue
            ticks += max(0, t - before[pid][1])
        return ticks

    @staticmethod
    def _steal_ticks():
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
            return int(fields[8]) if fields[0] == "cpu" and len(fields) > 8 else 0
        except (OSError, ValueError):
            return 0

    def _run(self):
        prev, prev_steal = self._snapshot(), self._steal_ticks()
        while not self.stop_event.wait(self.period):
            cur, cur_steal = self._snapshot(), self._steal_ticks()
            with self.lock:
                self.foreign_s += self._foreign_ticks(prev, cur) / self.clk
                self.steal_s += max(0, cur_steal - prev_steal) / self.clk
            prev, prev_steal = cur, cur_steal

    def start(self):
        self.thread.start()
        return self

    def read(self):
        with self.lock:
            return self.foreign_s, self.steal_s

    def stop(self):
        self.stop_event.set()


MONITOR = None


def foreign_cpu_since(mark, t_mark):
    """CPU-seconds used by foreign processes since (mark, t_mark), and that as a share of all cores."""
    if MONITOR is None:
        return None
    foreign, steal = MONITOR.read()
    used, stolen = foreign - mark[0], steal - mark[1]
    wall = max(1e-9, time.perf_counter() - t_mark)
    ncpu = os.cpu_count()
    return dict(
        foreign_cpu_s=round(used, 2),
        foreign_share_of_all_cores=round(used / wall / ncpu, 3),
        hypervisor_steal_share_of_all_cores=round(stolen / wall / ncpu, 3),
    )


def monitor_mark():
    return (MONITOR.read() if MONITOR is not None else (0.0, 0.0)), time.perf_counter()


# ----------------------------------------------------------------------------------------------------------------
# a. DHT benchmark
# ----------------------------------------------------------------------------------------------------------------


def bench_dht(args):
    import hivemind
    from hivemind.utils import get_dht_time

    n = args.dht_nodes
    assert n >= 2
    log(f"DHT: starting {n} nodes")
    mark = monitor_mark()
    nodes = []
    per_node = []
    t_all = time.perf_counter()
    try:
        t = time.perf_counter()
        first = hivemind.DHT(start=True)
        per_node.append(time.perf_counter() - t)
        nodes.append(first)
        initial_peers = [str(m) for m in first.get_visible_maddrs()]
        for _ in range(n - 1):
            t = time.perf_counter()
            nodes.append(hivemind.DHT(initial_peers=initial_peers, start=True))
            per_node.append(time.perf_counter() - t)
        startup_total = time.perf_counter() - t_all
        log(f"DHT: {n} nodes up in {startup_total:.2f}s")

        writer, reader = nodes[1], nodes[-1]
        value = "x" * args.dht_value_bytes
        keys = [f"anchor_key_{i}" for i in range(args.dht_keys)]

        store_lat, store_ok = [], 0
        t_store_phase = time.perf_counter()
        for k in keys:
            t = time.perf_counter()
            ok = writer.store(k, value, expiration_time=get_dht_time() + 600)
            store_lat.append(time.perf_counter() - t)
            store_ok += bool(ok)
        store_phase = time.perf_counter() - t_store_phase

        get_lat, get_ok = [], 0
        t_get_phase = time.perf_counter()
        for k in keys:
            t = time.perf_counter()
            res = reader.get(k)
            get_lat.append(time.perf_counter() - t)
            get_ok += res is not None and res.value == value
        get_phase = time.perf_counter() - t_get_phase

        # second pass of gets: values are now cached locally on the reader (hivemind caches by default)
        get2_lat = []
        for k in keys:
            t = time.perf_counter()
            reader.get(k)
            get2_lat.append(time.perf_counter() - t)

        result = dict(
            nodes=n,
            keys=len(keys),
            value_bytes=args.dht_value_bytes,
            startup_total_s=round(startup_total, 3),
            startup_first_node_s=round(per_node[0], 3),
            startup_per_joining_node_median_s=round(statistics.median(per_node[1:]), 3),
            store=dict(
                summarize_ms(store_lat), success_rate=store_ok / len(keys), phase_s=round(store_phase, 3)
            ),
            get=dict(summarize_ms(get_lat), success_rate=get_ok / len(keys), phase_s=round(get_phase, 3)),
            get_repeat_cached=summarize_ms(get2_lat),
            other_processes_load=foreign_cpu_since(*mark),
            notes="store from node[1], get from node[-1]; sequential blocking calls through hivemind.DHT's "
            "process pipe (user-visible latency); default num_replicas=5, caching on",
        )
        log(
            f"DHT: store median {result['store']['median_ms']} ms, get median {result['get']['median_ms']} ms"
        )
        return result
    finally:
        for node in reversed(nodes):
            try:
                node.shutdown()
            except Exception as e:
                log(f"DHT shutdown error {e!r}")


# ----------------------------------------------------------------------------------------------------------------
# b/c. all-reduce benchmark: one OS process per peer
# ----------------------------------------------------------------------------------------------------------------


def allreduce_worker(rank, n, client_ranks, initial_peers, prefix, cfg, barrier, result_q):
    # runs in a fresh (spawned) process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    # hivemind's DHT/DecentralizedAverager are mp.Process subclasses designed for the 'fork' start method;
    # a spawned child would otherwise inherit 'spawn' and fail to pickle them
    mp.set_start_method("fork", force=True)
    averager = dht = None
    try:
        import torch

        torch.set_num_threads(cfg["torch_threads"])
        import hivemind
        from hivemind.averaging import DecentralizedAverager
        from hivemind.averaging.control import AveragingStage

        client_mode = rank in client_ranks
        dht = hivemind.DHT(initial_peers=initial_peers, start=True, client_mode=client_mode)
        tensor = torch.full((cfg["numel"],), float(rank), dtype=torch.float32)
        averager = DecentralizedAverager(
            [tensor],
            dht,
            start=True,
            prefix=prefix,
            target_group_size=n,
            min_group_size=n,
            min_matchmaking_time=cfg["matchmaking_time"],
            request_timeout=cfg["request_timeout"],
            client_mode=client_mode,
        )
        result_q.put(dict(kind="pids", rank=rank, pids=[os.getpid(), dht.pid, averager.pid]))
        expected = (n - 1) / 2.0
        bt = cfg["barrier_timeout"]
        barrier.wait(timeout=bt)

        for r in range(cfg["warmup"] + cfg["rounds"]):
            with averager.get_tensors() as ts:
                ts[0].fill_(float(rank))
            barrier.wait(timeout=bt)  # everybody starts matchmaking together
            t_mm0 = time.time()
            control = averager.step(wait=False, require_trigger=True, timeout=cfg["step_timeout"])
            while control.stage not in (AveragingStage.AWAITING_TRIGGER, AveragingStage.FINISHED):
                if time.time() - t_mm0 > cfg["step_timeout"]:
                    raise TimeoutError(f"rank {rank}: matchmaking did not finish in {cfg['step_timeout']}s")
                time.sleep(0.002)
            t_mm1 = time.time()
            barrier.wait(timeout=bt)  # group formed everywhere -> trigger all-reduce simultaneously
            t0 = time.time()
            control.allow_allreduce()
            gathered = control.result(timeout=cfg["step_timeout"])
            t1 = time.time()
            with averager.get_tensors() as ts:
                dev = (ts[0] - expected).abs()
                err = float(dev.max().item())
                frac_wrong = float((dev > 1e-5).float().mean().item()) if err > 1e-5 else 0.0
                del dev
            result_q.put(
                dict(
                    kind="round",
                    rank=rank,
                    round=r,
                    warmup=r < cfg["warmup"],
                    matchmaking_s=t_mm1 - t_mm0,
                    t0=t0,
                    t1=t1,
                    group_size=len(gathered) if gathered is not None else None,
                    max_abs_err=err,
                    frac_elements_wrong=frac_wrong,
                )
            )
        barrier.wait(timeout=bt)  # nobody leaves before everyone is done
        result_q.put(dict(kind="done", rank=rank))
    except BaseException as e:
        result_q.put(dict(kind="error", rank=rank, error=repr(e), tb=traceback.format_exc()))
        try:
            barrier.abort()
        except Exception:
            pass
    finally:
        for obj in (averager, dht):
            try:
                if obj is not None:
                    obj.shutdown()
            except Exception:
                pass


def bench_allreduce(args, n, client_ranks=()):
    import hivemind

    ctx = mp.get_context("spawn")
    label = f"{n} peers" + (f" (client_mode ranks {list(client_ranks)})" if client_ranks else "")
    log(f"all-reduce: {label}, numel={args.numel}")
    cfg = dict(
        numel=args.numel,
        rounds=args.rounds,
        warmup=args.warmup,
        matchmaking_time=args.matchmaking_time,
        request_timeout=args.request_timeout,
        step_timeout=args.step_timeout,
        barrier_timeout=args.step_timeout + 60,
        torch_threads=args.torch_threads,
    )
    t_start = time.perf_counter()
    mark = monitor_mark()
    bootstrap = hivemind.DHT(start=True)  # bootstrap-only node, not part of the averaging group
    initial_peers = [str(m) for m in bootstrap.get_visible_maddrs()]
    barrier = ctx.Barrier(n)
    result_q = ctx.Queue()
    procs = []
    rounds, errors, pids, done = [], [], {}, set()
    try:
        for rank in range(n):
            p = ctx.Process(
                target=allreduce_worker,
                args=(
                    rank,
                    n,
                    tuple(client_ranks),
                    initial_peers,
                    f"anchor{n}c{len(client_ranks)}",
                    cfg,
                    barrier,
                    result_q,
                ),
                daemon=False,
            )
            p.start()
            procs.append(p)
        deadline = time.time() + args.group_timeout
        while len(done) + len({e["rank"] for e in errors}) < n and time.time() < deadline:
            try:
                msg = result_q.get(timeout=1.0)
            except Exception:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if msg["kind"] == "round":
                rounds.append(msg)
                if msg["rank"] == 0:
                    log(
                        f"  round {msg['round']} rank0 allreduce {msg['t1'] - msg['t0']:.2f}s "
                        f"matchmaking {msg['matchmaking_s']:.2f}s err {msg['max_abs_err']:.2e}"
                    )
            elif msg["kind"] == "pids":
                pids[msg["rank"]] = msg["pids"]
            elif msg["kind"] == "done":
                done.add(msg["rank"])
            elif msg["kind"] == "error":
                errors.append(msg)
                log(f"  rank {msg['rank']} error: {msg['error']}")
        timed_out = time.time() >= deadline and len(done) < n
        for p in procs:
            p.join(timeout=20)
    finally:
        # cleanup: only processes we started (workers and their descendants), by PID
        for p in procs:
            if p.is_alive():
                log(f"  worker pid {p.pid} still alive, killing it and its descendants")
                kill_pids(descendants(p.pid) + [p.pid])
                p.join(timeout=5)
        for rank, plist in pids.items():  # orphaned DHT/averager/p2pd processes of dead workers, if any
            leftovers = [q for q in plist[1:] if os.path.exists(f"/proc/{q}")]
            if leftovers:
                kill_pids([d for q in leftovers for d in descendants(q)] + leftovers)
        try:
            bootstrap.shutdown()
        except Exception:
            pass
    wall = time.perf_counter() - t_start

    size_bytes = args.numel * 4
    timed = [r for r in rounds if not r["warmup"]]
    per_round = {}
    for r in timed:
        per_round.setdefault(r["round"], []).append(r)
    round_times, mm_times, fastest, slowest = [], [], [], []
    for idx, rs in sorted(per_round.items()):
        if len(rs) == n:
            round_times.append(max(x["t1"] for x in rs) - min(x["t0"] for x in rs))
            mm_times.append(max(x["matchmaking_s"] for x in rs))
            fastest.append(min(x["t1"] - x["t0"] for x in rs))
            slowest.append(max(x["t1"] - x["t0"] for x in rs))
    res = dict(
        group_size=n,
        client_mode_ranks=list(client_ranks),
        numel=args.numel,
        tensor_mb=size_bytes / 1e6,
        completed_timed_rounds=len(round_times),
        requested_timed_rounds=args.rounds,
        errors=[dict(rank=e["rank"], error=e["error"], tb_tail=e["tb"][-1500:]) for e in errors],
        timed_out=bool(timed_out),
        wall_s_including_process_startup=round(wall, 2),
        other_processes_load=foreign_cpu_since(*mark),
    )
    if round_times:
        med = statistics.median(round_times)
        algbw = size_bytes / med / 1e6
        res.update(
            allreduce_round_s=dict(
                median=round(med, 4),
                min=round(min(round_times), 4),
                max=round(max(round_times), 4),
                all=[round(x, 4) for x in round_times],
            ),
            per_peer_step_s_median=dict(
                fastest_peer=round(statistics.median(fastest), 4),
                slowest_peer=round(statistics.median(slowest), 4),
            ),
            matchmaking_s_median=round(statistics.median(mm_times), 4),
            step_s_median_incl_matchmaking=round(
                statistics.median([a + b for a, b in zip(round_times, mm_times)]), 4
            ),
            algbw_MBps=round(algbw, 2),
            busbw_MBps=round(algbw * 2 * (n - 1) / n, 2),
            loopback_total_traffic_MBps=round(algbw * 2 * (n - 1), 2),
        )
        warm = [r for r in rounds if r["warmup"]]
        if warm:
            res["warmup_round_s"] = round(max(x["t1"] for x in warm) - min(x["t0"] for x in warm), 4)
    all_errs = [r["max_abs_err"] for r in rounds]
    res["max_abs_err"] = max(all_errs) if all_errs else None
    bad = [r for r in rounds if r["max_abs_err"] > 1e-5]
    res["incorrect_results"] = [
        dict(
            round=r["round"],
            warmup=r["warmup"],
            rank=r["rank"],
            max_abs_err=r["max_abs_err"],
            frac_elements_wrong=round(r["frac_elements_wrong"], 4),
        )
        for r in bad
    ]
    res["expected_value"] = (n - 1) / 2.0
    res["group_sizes_seen"] = sorted({r["group_size"] for r in rounds if r["group_size"] is not None})
    res["ok"] = (
        bool(round_times)
        and len(round_times) == args.rounds
        and not errors
        and res["group_sizes_seen"] == [n]
        and (res["max_abs_err"] is not None and res["max_abs_err"] <= 1e-5)
    )
    log(f"  -> {label}: {res.get('allreduce_round_s', {}).get('median')} s/round, ok={res['ok']}")
    return res


def hivemind_sockets():
    """hivemind's P2P hard-codes its unix sockets as /tmp/hivemind-{p2pd,p2pclient}-*.sock and never unlinks them."""
    import glob

    return set(glob.glob("/tmp/hivemind-p2pd-*.sock") + glob.glob("/tmp/hivemind-p2pclient-*.sock"))


def remove_stale_sockets(before, t_start):
    """Unlink socket files that appeared during this run and are no longer bound by any process."""
    try:
        with open("/proc/net/unix") as f:
            bound = {line.split()[-1] for line in f.read().splitlines()[1:] if len(line.split()) >= 8}
    except OSError:
        return 0
    removed = 0
    for path in hivemind_sockets() - before:
        try:
            if path not in bound and os.stat(path).st_mtime >= t_start - 1:
                os.unlink(path)
                removed += 1
        except OSError:
            pass
    return removed


def dependency_versions():
    from importlib import metadata

    out = {}
    for name in (
        "hivemind",
        "torch",
        "protobuf",
        "pydantic",
        "grpcio",
        "numpy",
        "msgpack",
        "uvloop",
        "cryptography",
    ):
        try:
            out[name] = metadata.version(name)
        except Exception:
            out[name] = None
    return out


def p2pd_sha256():
    import hashlib

    import hivemind

    path = os.path.join(os.path.dirname(hivemind.__file__), "hivemind_cli", "p2pd")
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="2,4,8", help="comma-separated all-reduce group sizes")
    ap.add_argument(
        "--numel", type=int, default=25_000_000, help="float32 elements per tensor (25M = 100 MB)"
    )
    ap.add_argument("--dht-nodes", type=int, default=16)
    ap.add_argument("--dht-keys", type=int, default=200)
    ap.add_argument("--dht-value-bytes", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="timed averaging rounds per group size")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds")
    ap.add_argument(
        "--client-group",
        type=int,
        default=4,
        help="group size for the client_mode run (last peer is a client); 0 disables",
    )
    ap.add_argument(
        "--matchmaking-time", type=float, default=5.0, help="DecentralizedAverager min_matchmaking_time"
    )
    ap.add_argument(
        "--request-timeout", type=float, default=3.0, help="DecentralizedAverager request_timeout"
    )
    ap.add_argument(
        "--step-timeout", type=float, default=120.0, help="per step (matchmaking or all-reduce) timeout"
    )
    ap.add_argument("--group-timeout", type=float, default=300.0, help="hard wall limit per group-size run")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads in each peer process")
    ap.add_argument(
        "--no-load-monitor",
        action="store_true",
        help="do not sample CPU use of unrelated processes (other_processes_load fields)",
    )
    ap.add_argument("--skip-dht", action="store_true")
    ap.add_argument("--skip-allreduce", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()

    import hivemind
    import torch

    global MONITOR
    sockets_before, t_wall_start = hivemind_sockets(), time.time()
    if not args.no_load_monitor:
        MONITOR = ForeignLoadMonitor().start()
    t_total = time.perf_counter()
    mark_total = monitor_mark()
    result = dict(
        library="hivemind",
        hivemind_version=hivemind.__version__,
        torch_version=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        cpu_count=os.cpu_count(),
        started_at_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        args=vars(args),
        loadavg_at_start=open("/proc/loadavg").read().split()[:3],
        key_dependency_versions=dependency_versions(),
        p2pd_sha256=p2pd_sha256(),
    )
    if not args.skip_dht:
        try:
            result["dht"] = bench_dht(args)
        except Exception as e:
            result["dht"] = dict(error=repr(e), tb=traceback.format_exc()[-1500:])
    if not args.skip_allreduce:
        result["allreduce"] = []
        for n in [int(x) for x in args.peers.split(",") if x.strip()]:
            try:
                result["allreduce"].append(bench_allreduce(args, n))
            except Exception as e:
                result["allreduce"].append(
                    dict(group_size=n, error=repr(e), tb=traceback.format_exc()[-1500:])
                )
        if args.client_group and args.client_group >= 2:
            try:
                result["allreduce_client_mode"] = bench_allreduce(
                    args, args.client_group, client_ranks=(args.client_group - 1,)
                )
            except Exception as e:
                result["allreduce_client_mode"] = dict(error=repr(e), tb=traceback.format_exc()[-1500:])
    result["total_runtime_s"] = round(time.perf_counter() - t_total, 2)
    result["loadavg_at_end"] = open("/proc/loadavg").read().split()[:3]
    result["other_processes_load_total"] = foreign_cpu_since(*mark_total)
    time.sleep(1.0)  # let the last p2pd daemons exit before looking at their socket files
    result["stale_hivemind_sockets_removed"] = remove_stale_sockets(sockets_before, t_wall_start)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
