"""Benchmark what the volunteer stack costs one peer: its training throughput against a plain PyTorch loop.

Usage: scripts/bench_overhead.py [--task NAME] [--option KEY=VALUE ...] [--tokenizer KIND] [--vocab-size V]
                                 [--seconds S] [--repeats R] [--warmup W] [--threads T] [--local-batch B]
                                 [--target-batch N] [--matchmaking-window W] [--dpu] [--shards K]
                                 [--examples-per-shard E]

Both sides train the task ``--task`` names (default ``tiny-mlm``; any name of the task registry,
``volunteer.tasks.make_task``) with its options: ``--option`` entries over the defaults of
``DEFAULT_OPTIONS`` (``hf-mlm``: a tiny ALBERT, the ``albert-tiny`` recipe's model; ``hf-clm``: a tiny
GPT-2). A task that tokenizes gets a tokenizer trained first (``--tokenizer``, default ``unigram`` of
``--vocab-size`` tokens for every task but tiny-mlm) on the shards' texts. Both sides start from the same
fresh initial parameters and read the same examples: a few shards of the synthetic corpus
(``write_shards``) in a temporary directory, through the volunteer's own pipeline (``open_examples`` +
``task.preprocess`` + ``batches`` + ``Prefetcher``, same seed, so the same micro-batches in the same order),
with the same local batch, the same target batch and the spec's optimizer (``make_optimizer``), one
optimizer step per target batch, and the same ``torch.set_num_threads``.

* **plain**: the loop a careful user writes by hand around the model (for ``hf-*``: a ``transformers``
  model, its logits and the task's loss of them): per micro-batch ``(loss * n).backward()``; once the
  accumulated samples reach the target batch, divide the gradients by the samples, clip if the spec says
  so, set the learning rate from the schedule, ``optimizer.step()``, ``zero_grad()``.
* **volunteer**: the real stack in this process: a node (``open_node``, loopback, publishing its presence),
  a ``LocalTrainer``, a ``CollaborativeOptimizer`` (``run`` in a nursery) and ``train_until_stopped`` with
  ``prefetch.get(timeout=0.5)`` and ``ready_batch=prefetch.get(timeout=0)`` as the daemon passes them,
  stopped after ``--seconds``. Alone in its run, the volunteer finds no group at matchmaking and steps
  with its own gradient; whatever that costs per step is counted.

Each run is a fresh process (``--child``), so no run inherits another's threads. That matters: torch's
OpenMP runtime (libgomp) gives every thread that runs torch operations a team of its own, and once a process
holds more OpenMP threads than cores, libgomp stops spin-waiting between parallel regions and every small
operation pays a futex wake-up (micro-batches of the default model about twice as slow on 2 cores). A plain
run's main thread followed by a volunteer's worker thread in one process would measure that, not the stack.
The volunteer run builds its ``LocalTrainer`` in a worker thread, as the daemon does.

Throughput = samples stepped between the first step that ends after ``--warmup`` seconds and the last step
of the run, over the time between those two steps (whole steps only: the cost between micro-batches and
the cost of a step are both in it; ``window``: "steps"). A run with fewer than two steps after the warm-up
is measured between micro-batches instead (``window``: "micro-batches"). The runs alternate (plain,
volunteer, plain, …); the medians of each and ``ratio`` = volunteer median / plain median are reported
(target >= 0.97, issue 12, not asserted).

On a shared machine the torch time of a step varies by tens of percent from run to run, far more than
the few percent ``ratio`` is about. ``ratio_at_equal_compute`` is robust to that: each side's overhead per
step (its step period less its torch time: ``compute`` for plain, ``accumulate_torch`` for the volunteer;
medians over its runs) added to the same torch time (the median over all runs of both sides),
``(compute + plain overhead) / (compute + volunteer overhead)``.

``breakdown_ms_per_step`` says where each side's time per step goes, from timers wrapped around the calls
the loops make (a few ``perf_counter`` reads per micro-batch): waiting for a batch, the micro-batches
(for the volunteer: ``data_take``, taking a ready batch on the torch thread, the torch time inside
``LocalTrainer.accumulate`` and the trio-side time around both, whose difference ``accumulate_hop`` is the
hand-over to the torch thread and back; ``data_wait``: waiting for a batch in a worker thread when none was
ready), the optimizer step and, for the volunteer, each part of ``average_and_step``
(taking the gradients, matchmaking, applying, the parameter fingerprint, state announcements) and the DHT
traffic of the background tasks (progress publishing and polling, presence). ``unaccounted`` is the rest
of the step period (the loop's own overhead, the ``to_thread`` hop of a batch that was not ready, GIL
contention).
``cpu_ms_per_step`` is the CPU time of the whole process per step (all its threads), and
``foreign_cpu_seconds`` the CPU time other processes of the machine took during the run: a run with much of
it was measured on a busy machine (with as many torch threads as cores, a busy core can halve throughput).
Prints ONE JSON object.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols.training import DatasetSpec, OptionValue, TokenizerKind, TokenizerSpec, TrainingSpec
from shared.auth.keys import Identity
from shared.data.corpus import write_shards
from shared.node import open_node
from shared.tokenizer import train_tokenizer
from volunteer.collab.optimizer import CollabConfig, CollaborativeOptimizer, StepRecord
from volunteer.collab.torch_thread import run_torch
from volunteer.collab.trainer import LocalTrainer, make_optimizer
from volunteer.data import Prefetcher, open_examples
from volunteer.tasks import Task, make_task
from volunteer.training import batches, train_until_stopped

RUN_ID = "bench-overhead"
DATA_SEED = 1  # the examples' order: the same for both sides
PREFETCH_DEPTH = 16  # as the volunteer daemon
FIRST_BATCH_TIMEOUT = 60.0
TARGET = 0.97  # issue 12
#: each task's options unless ``--option`` says otherwise (tiny-mlm: its own defaults)
DEFAULT_OPTIONS: dict[str, dict[str, OptionValue]] = {
    "hf-mlm": {  # the albert-tiny recipe's model (deploy/recipes/albert-tiny.toml)
        "model_type": "albert",
        "seq_len": 64,
        "embedding_size": 64,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 256,
    },
    "hf-clm": {
        "model_type": "gpt2",
        "seq_len": 64,
        "n_positions": 64,
        "n_embd": 128,
        "n_layer": 2,
        "n_head": 4,
    },
}
R = TypeVar("R")


@dataclass
class Timers:
    """Durations by name, each stamped with its end (``perf_counter``), and the end times of steps and of
    micro-batches with the cumulative samples; :meth:`summary` keeps what falls into the measured window."""

    warmup: float
    target_batch: int
    started: float = field(default_factory=time.perf_counter)
    spans: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    steps: list[tuple[float, int]] = field(default_factory=list)  # (end time, samples stepped so far)
    cpu: dict[float, float] = field(default_factory=dict)  # step end time -> CPU time of the process
    micro: list[tuple[float, int]] = field(default_factory=list)  # (end time, samples computed so far)

    def add(self, name: str, seconds: float) -> None:
        self.spans.setdefault(name, []).append((time.perf_counter(), seconds))

    def step(self, samples_so_far: int) -> None:
        now = time.perf_counter()
        self.steps.append((now, samples_so_far))
        self.cpu[now] = time.process_time()

    def wrap(self, name: str, fn: Callable[..., R]) -> Callable[..., R]:
        def timed(*args: Any, **kwargs: Any) -> R:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - began)

        return timed

    def wrap_async(self, name: str, fn: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
        async def timed(*args: Any, **kwargs: Any) -> R:
            began = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - began)

        return timed

    def instrument(self, owner: object, attribute: str, name: str) -> None:
        method = getattr(owner, attribute)
        wrap = self.wrap_async if inspect.iscoroutinefunction(method) else self.wrap
        setattr(owner, attribute, wrap(name, method))

    def micro_batch(self, samples: int) -> None:
        self.micro.append((time.perf_counter(), (self.micro[-1][1] if self.micro else 0) + samples))

    def summary(self) -> dict[str, Any]:
        """Samples/s over the measured window (see the module docstring) and ms per step in it. With fewer
        than two steps after the warm-up, the window runs between micro-batches instead (``window``)."""
        window, marks = "steps", self.steps
        after = [i for i, (t, _) in enumerate(marks) if t - self.started >= self.warmup]
        if len(after) < 2:
            window, marks = "micro-batches", self.micro
            after = [i for i, (t, _) in enumerate(marks) if t - self.started >= self.warmup]
        if len(after) < 2:
            raise SystemExit(f"fewer than 2 micro-batches after the {self.warmup} s warm-up: run longer")
        (t0, s0), (t1, s1) = marks[after[0]], marks[after[-1]]
        steps = after[-1] - after[0] if window == "steps" else (s1 - s0) / self.target_batch
        breakdown = {
            name: round(1e3 * sum(d for t, d in spans if t0 < t <= t1) / steps, 3)
            for name, spans in sorted(self.spans.items())
        }
        return {
            "samples_per_second": (s1 - s0) / (t1 - t0),
            "steps": len(self.steps),
            "window": window,
            "measured_steps": round(steps, 2),
            "measured_seconds": round(t1 - t0, 3),
            "ms_per_step": round(1e3 * (t1 - t0) / steps, 3),
            "breakdown_ms_per_step": breakdown,
            # all threads of the process (torch, data pipeline, trio loop); None in the micro-batch window
            "cpu_ms_per_step": round(1e3 * (self.cpu[t1] - self.cpu[t0]) / steps, 3)
            if window == "steps"
            else None,
        }


def open_batches(task: Task, spec: TrainingSpec) -> Prefetcher[dict[str, Any]]:
    """The volunteer's pipeline, with its first batch already read (so start-up is not timed)."""
    samples = task.preprocess(open_examples(spec.dataset, seed=DATA_SEED))
    prefetch = Prefetcher(batches(task.collate, samples, spec.local_batch), depth=PREFETCH_DEPTH)
    if prefetch.get(timeout=FIRST_BATCH_TIMEOUT) is None:
        prefetch.close()
        raise SystemExit(f"no batch within {FIRST_BATCH_TIMEOUT} s")
    return prefetch


# ---------------------------------------------------------------------------------------------- plain


def run_plain(spec: TrainingSpec, tokenizer: bytes | None, seconds: float, warmup: float) -> dict[str, Any]:
    task = make_task(spec, tokenizer)
    model = task.build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    o = spec.optimizer
    optimizer = make_optimizer(o, params)
    model.train()
    prefetch = open_batches(task, spec)
    try:
        timers = Timers(warmup, spec.target_batch)
        deadline = timers.started + seconds
        accumulated = stepped = step = 0
        while time.perf_counter() < deadline:
            began = time.perf_counter()
            batch = prefetch.get(timeout=0.5)
            computing = time.perf_counter()
            timers.add("data_wait", computing - began)
            if batch is None:
                continue
            n = task.batch_size(batch)
            loss = task.loss(model, batch)
            (loss * n).backward()  # type: ignore[no-untyped-call]
            accumulated += n
            timers.micro_batch(n)
            stepping = time.perf_counter()
            timers.add("compute", stepping - computing)
            if accumulated >= spec.target_batch:
                for p in params:
                    if p.grad is not None:
                        p.grad /= accumulated
                if o.clip_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(params, o.clip_grad_norm)
                for group in optimizer.param_groups:
                    group["lr"] = o.lr * spec.schedule.factor(step)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                stepped += accumulated
                accumulated = 0
                timers.add("optimizer_step", time.perf_counter() - stepping)
                timers.step(stepped)
        return timers.summary()
    finally:
        prefetch.close()


# ------------------------------------------------------------------------------------------ volunteer


async def volunteer(
    spec: TrainingSpec, tokenizer: bytes | None, config: CollabConfig, seconds: float, warmup: float
) -> dict[str, Any]:
    task = make_task(spec, tokenizer)
    # as the daemon does: torch runs in worker threads only (see the module docstring)
    trainer = await run_torch(LocalTrainer, task, spec, RUN_ID)
    prefetch = await trio.to_thread.run_sync(open_batches, task, spec)
    try:
        async with (
            open_node(Identity.generate(), RUN_ID, "volunteer", listen=["/ip4/127.0.0.1/tcp/0"]) as node,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(node.publish_presence_forever)
            timers = Timers(warmup, spec.target_batch)
            stepped = 0

            def on_step(record: StepRecord) -> None:
                nonlocal stepped
                stepped += record.samples
                timers.step(stepped)

            collab = CollaborativeOptimizer(node, trainer, spec, config=config, on_step=on_step)
            accumulate_from = collab.accumulate_from

            async def counted(take: Callable[[], dict[str, torch.Tensor] | None]) -> int | None:
                samples = await accumulate_from(take)
                if samples is not None:
                    timers.micro_batch(samples)
                return samples

            setattr(collab, "accumulate_from", counted)  # noqa: B010 (mypy: no assigning to a method)
            # Timers around the calls the stack makes: instance attributes that shadow the methods.
            for owner, attribute, name in [
                (collab, "accumulate_from", "accumulate_trio"),
                (trainer, "accumulate", "accumulate_torch"),
                (collab.mode, "average_and_step", "average_and_step"),
                (collab.matchmaker, "assemble", "average_and_step.matchmaking"),
                (collab.sync, "announce_state", "average_and_step.announce_state"),
                (trainer, "take_gradients", "average_and_step.take_gradients"),
                (trainer, "apply", "average_and_step.apply"),
                (trainer, "fingerprint", "fingerprint"),
                (node.dht, "store", "dht_store_all"),
                (node.dht, "get", "dht_get_all"),
            ]:
                timers.instrument(owner, attribute, name)
            next_batch = timers.wrap("data_wait", lambda: prefetch.get(timeout=0.5))
            ready_batch = timers.wrap("data_take", lambda: prefetch.get(timeout=0))
            await nursery.start(collab.run)
            timers.started = time.perf_counter()
            stop = trio.Event()

            async def stop_later() -> None:
                await trio.sleep(seconds)
                stop.set()

            nursery.start_soon(stop_later)
            await train_until_stopped(collab, next_batch, stop, ready_batch=ready_batch)
            nursery.cancel_scope.cancel()
        result = timers.summary()
        b = result["breakdown_ms_per_step"]
        # dht_*_all: every DHT call, matchmaking's (inside average_and_step) and the background tasks'
        # (publishing, polling, presence), which run concurrently with the micro-batches.
        inside = b.get("accumulate_torch", 0.0) + b.get("data_take", 0.0)
        b["accumulate_hop"] = round(b.get("accumulate_trio", 0.0) - inside, 3)
        return result
    finally:
        prefetch.close()


def run_volunteer(
    spec: TrainingSpec, tokenizer: bytes | None, config: CollabConfig, seconds: float, warmup: float
) -> dict[str, Any]:
    return trio.run(volunteer, spec, tokenizer, config, seconds, warmup)


# ------------------------------------------------------------------------------------------------ main


def parse_option(text: str) -> tuple[str, OptionValue]:
    key, sep, raw = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    value: OptionValue
    try:
        value = int(raw)
    except ValueError:
        try:
            value = float(raw)
        except ValueError:
            value = raw
    return key, value


def finish(breakdown: dict[str, float], ms_per_step: float) -> dict[str, float]:
    """``unaccounted``: the step period less the sequential parts (background DHT calls overlap)."""
    sequential = ["data_wait", "compute", "optimizer_step", "accumulate_trio", "average_and_step"]
    out = dict(breakdown)
    out["unaccounted"] = round(ms_per_step - sum(breakdown.get(k, 0.0) for k in sequential), 3)
    return out


def busy_seconds() -> tuple[float, float]:
    """CPU seconds used so far by the whole machine (``/proc/stat``; 0 where unreadable) and by us with
    our finished children."""
    ours = os.times()
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
        machine = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        machine = 0.0
    return machine, ours.user + ours.system + ours.children_user + ours.children_system


def run_child(side: str, spec: TrainingSpec, args: argparse.Namespace) -> dict[str, Any]:
    """One run in a fresh process (see the module docstring), with ``foreign_cpu_seconds``: CPU time
    other processes took meanwhile (a busy machine makes that run's numbers unreliable)."""
    command = [
        sys.executable,
        __file__,
        "--child",
        side,
        "--spec",
        msgspec.json.encode(spec).decode(),
        "--seconds",
        str(args.seconds),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--matchmaking-window",
        str(args.matchmaking_window),
        "--tokenizer-file",
        args.tokenizer_file,
    ]
    machine, ours = busy_seconds()
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    machine_after, ours_after = busy_seconds()
    if done.returncode != 0:
        raise SystemExit(f"the {side} run failed (exit code {done.returncode})")
    result: dict[str, Any] = json.loads(done.stdout)
    result["breakdown_ms_per_step"] = finish(result["breakdown_ms_per_step"], result["ms_per_step"])
    foreign = (machine_after - machine) - (ours_after - ours)
    result["foreign_cpu_seconds"] = round(max(0.0, foreign), 2)
    return result


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    spec = msgspec.json.decode(args.spec, type=TrainingSpec)
    tokenizer = Path(args.tokenizer_file).read_bytes() if args.tokenizer_file else None
    if args.child == "plain":
        result = run_plain(spec, tokenizer, args.seconds, args.warmup)
    else:
        config = CollabConfig(matchmaking_window=args.matchmaking_window)
        result = run_volunteer(spec, tokenizer, config, args.seconds, args.warmup)
    result["torch_threads"] = torch.get_num_threads()
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="wall time of each run (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating (default 3)")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds not measured at a run's start")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--local-batch", type=int, default=TrainingSpec().local_batch)
    parser.add_argument("--target-batch", type=int, default=TrainingSpec().target_batch)
    parser.add_argument("--task", default="tiny-mlm", help="the task both sides train (default tiny-mlm)")
    parser.add_argument(
        "--option",
        type=parse_option,
        action="append",
        default=[],
        help="a task option KEY=VALUE, over the task's defaults (DEFAULT_OPTIONS)",
    )
    parser.add_argument(
        "--tokenizer",
        choices=["none", "unigram", "wordpiece", "bpe"],
        help="the run's tokenizer, trained on the shards (default: none for tiny-mlm, else unigram)",
    )
    parser.add_argument("--vocab-size", type=int, default=2000, help="of a trained tokenizer (default 2000)")
    parser.add_argument(
        "--matchmaking-window",
        type=float,
        default=CollabConfig().matchmaking_window,
        help="CollabConfig.matchmaking_window of the volunteer (default: the daemon's)",
    )
    parser.add_argument(
        "--dpu",
        action="store_true",
        help="volunteer with delayed parameter updates (TrainingSpec.dpu)",
    )
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--examples-per-shard", type=int, default=4000)
    parser.add_argument("--child", choices=["plain", "volunteer"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-file", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    kind: TokenizerKind = args.tokenizer or ("none" if args.task == "tiny-mlm" else "unigram")
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as directory:
        paths = write_shards(Path(directory), args.shards, args.examples_per_shard)
        spec = TrainingSpec(
            task=args.task,
            task_options={**DEFAULT_OPTIONS.get(args.task, {}), **dict(args.option)},
            target_batch=args.target_batch,
            local_batch=args.local_batch,
            dpu=args.dpu,
            tokenizer=TokenizerSpec(kind=kind, vocab_size=args.vocab_size),
            dataset=DatasetSpec(source="files", files=[str(p) for p in paths]),
        )
        tokenizer = None
        if kind != "none":
            tokenizer = train_tokenizer(spec.tokenizer, shard_texts(paths), masked_lm=args.task != "hf-clm")
            args.tokenizer_file = str(Path(directory) / "tokenizer.json")
            Path(args.tokenizer_file).write_bytes(tokenizer)
        task = make_task(spec, tokenizer)  # a bad --task or --option fails here, before any run
        plain: list[dict[str, Any]] = []
        lone: list[dict[str, Any]] = []
        for _ in range(args.repeats):
            plain.append(run_child("plain", spec, args))
            lone.append(run_child("volunteer", spec, args))
    plain_sps = statistics.median(r["samples_per_second"] for r in plain)
    torch_ms = [r["breakdown_ms_per_step"].get("compute", 0.0) for r in plain] + [
        r["breakdown_ms_per_step"].get("accumulate_torch", 0.0) for r in lone
    ]
    compute = statistics.median(torch_ms)
    plain_over = statistics.median(r["ms_per_step"] - torch_ms[i] for i, r in enumerate(plain))
    lone_over = statistics.median(r["ms_per_step"] - torch_ms[len(plain) + i] for i, r in enumerate(lone))
    volunteer_sps = statistics.median(r["samples_per_second"] for r in lone)
    model = task.build_model()
    config = CollabConfig(matchmaking_window=args.matchmaking_window)
    result = {
        "ratio": volunteer_sps / plain_sps,
        "ratio_at_equal_compute": (compute + plain_over) / (compute + lone_over),
        "overhead_ms_per_step": {"plain": plain_over, "volunteer": lone_over, "compute": compute},
        "target": TARGET,
        "plain_samples_per_second": plain_sps,
        "volunteer_samples_per_second": volunteer_sps,
        "plain_runs": plain,
        "volunteer_runs": lone,
        "settings": {
            "task": spec.task,
            "task_options": spec.task_options,
            "tokenizer": {"kind": kind, "vocab_size": args.vocab_size} if kind != "none" else None,
            "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "local_batch": spec.local_batch,
            "target_batch": spec.target_batch,
            "optimizer": {"name": spec.optimizer.name, "lr": spec.optimizer.lr},
            "schedule": spec.schedule.kind,
            "checkpoint_every": spec.checkpoint_every,
            "dpu": spec.dpu,
            "shards": args.shards,
            "examples_per_shard": args.examples_per_shard,
            "shuffle_buffer": spec.dataset.shuffle_buffer,
            "seconds": args.seconds,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "collab_config": {
                "matchmaking_window": config.matchmaking_window,
                "poll_period": config.poll_period,
                "publish_period": config.publish_period,
            },
        },
        "torch": torch.__version__,
        "threads": args.threads,
        "cpu": {"cores": os.cpu_count(), "usable": len(os.sched_getaffinity(0)), "model": cpu_model()},
        "python": platform.python_version(),
        "loadavg_at_end": os.getloadavg(),
    }
    print(json.dumps(result, indent=2))


def shard_texts(paths: list[Path]) -> Iterator[str]:
    """The texts of the shards' JSON lines (what the run's tokenizer is trained on)."""
    for path in paths:
        with path.open() as lines:
            for line in lines:
                text = json.loads(line).get("text")
                if isinstance(text, str):
                    yield text


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
