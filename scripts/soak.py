"""Churn soak: real backbone and volunteer processes on loopback, a seeded schedule of faults, and a check of
what must hold whatever fails (issue 10: one collaboration, honest credit).

Processes (each with its own data dir and one log, appended across restarts, in the work dir):

* one backbone (``--backbones 2``: two, sharing one authority key and one ledger database — a throw-away
  PostgreSQL server when its binaries are installed, else one SQLite file — each listing both API URLs
  (``--public-url``) so that volunteers can fail over);
* ``--volunteers`` invited volunteers training ``tiny-mlm`` (target batch 128, local batch 8, the
  synthetic corpus the backbone generates: no network).

Faults, from ``random.Random(--seed)``, once every volunteer has taken a step (``t0``), over
``--seconds``; the last quarter (at least 30 s) is quiet so that the run can converge before the check,
and the fixed faults sit at fractions of the active time before it:

* every 20-60 s one volunteer is SIGKILLed and restarted 1-4 s later with its data dir;
* at 20 %: two volunteers are SIGKILLed at once (both restarted);
* at 45 %: backbone 1 is SIGKILLed and restarted 3 s later on the same ports and data dir;
* at 65 %: a volunteer is SIGKILLed and restarted with ``DEDLOC_FAULTS=state.mid_download=kill`` so that
  it dies again in its state download (where that fault point exists); then it is restarted plainly;
* at 85 % (two backbones only): one backbone (``--lost-backbone``, else by the seed) is SIGKILLed for
  good.

Then the soak waits (at most :data:`SETTLE_S`: a condition, not a sleep) until every volunteer has
stepped since it last started and all hold the same latest (step, fingerprint); then every volunteer
gets SIGTERM (it finishes its round, reports, leaves and must exit 0), then the figures below are
computed from the volunteers' ``steps.jsonl`` (one line per step taken: step, parameter fingerprint,
samples, peers, wall time) and from the ledger's database, then the backbones stop. Definitions:

* **steps per minute**: the steps the surviving collaboration took from ``t0`` to the end (the median
  of the volunteers' last steps, so that a lone fork does not count), per minute;
* **stall** after a volunteer kill at ``t``: the time from ``t`` until every survivor (alive from ``t``
  to its next step, not killed itself) has logged a step after ``t``; ``null`` when some survivor took
  none before the next fault (counted as unresolved);
* **convergence** after a backbone restart at ``t``: the first moment after ``t`` at which every live
  volunteer has stepped since it last started and all hold the same (step, fingerprint) (a volunteer
  killed and restarted meanwhile must have rejoined too); ``null`` if that never happened;
* **disagreeing steps**: step numbers logged with more than one fingerprint. The *majority* fingerprint
  of a step is the one most volunteers logged (ties: the greater sample count). A disagreement is
  *discarded by re-sync* when each minority fingerprint there comes from one volunteer whose minority
  streak (consecutive minority steps) is at most :data:`RESYNC_STREAK` long — a peer that stepped once
  on a stale state and then re-synced — or when every volunteer holding it reported that step discarded
  to the ledger (a round that completed for some members only, whose other members retried together and
  later re-synced); every other one is *unexplained* (a fork);
* **computed samples**: the samples of the majority-fingerprint lines of every step (what the surviving
  collaboration computed); **credited**: ``SUM(reports.credited_samples)`` in the ledger;
* **credited ≤ computed** holds in total and per volunteer (its peer's credited samples against its own
  majority-fingerprint samples): nothing is credited twice, whichever backbone a report reached;
* **one collaboration at the end**: every volunteer that stopped cleanly (and has stepped since it last
  started; one still joining is listed as ``not_rejoined``) logged the same fingerprint at
  the highest step all of them logged, and each one's last step is at most one behind the highest.

Invariants (listed by name in ``failures`` when broken): ``one_collaboration``, ``no_unexplained_forks``,
``progress_kept`` (the collaboration ends at a later step than it was at ``t0``: it did not start over),
``credited_le_computed``, ``clean_exits``, ``no_open_sessions``, ``no_zero_peer_steps``,
``converged_after_backbone_restart``, ``no_unexpected_exits``, ``survives_backbone_lost`` (two backbones:
reports reach the ledger and volunteers step after the loss). The exit status is 0 when none broke, 1
otherwise. The machine's load average is reported: stall times mean little on a saturated machine.

Run: ``.venv/bin/python scripts/soak.py --seconds 600 --json`` (``--backbones 2``, ``--seed N``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RUN_NAME = "soak-run"
STARTUP_S = 240.0  # every volunteer's first step; torch imports are slow on a busy machine
STOP_S = 90.0  # SIGTERM -> finish or abandon the round, report, leave
BACKBONE_STOP_S = 30.0
RESYNC_STREAK = 2
POLL_S = 0.2
SETTLE_S = 120.0  # after the soak: every volunteer back and in one collaboration, or give up
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}

MANIFEST = """\
task = "tiny-mlm"
target_batch = 128
local_batch = 8
checkpoint_every = 10
keep_checkpoints = 3

[optimizer]
name = "adamw"
lr = 0.003

[schedule]
kind = "constant"

[dataset]
generate = 8
examples_per_shard = 2000
shuffle_buffer = 1000
"""

#: ``--small``: a smaller model (CI), the same target batch.
SMALL_OPTIONS = """
[task_options]
d_model = 32
layers = 1
heads = 2
ffn = 64
seq_len = 32
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


@dataclass
class Proc:
    """One node: its argv, data dir and log (appended across restarts), and its incarnations."""

    name: str
    data: Path
    log: Path
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    #: (started, ended or None, how it ended) per incarnation, wall-clock seconds
    lives: list[list[Any]] = field(default_factory=list)
    expect_exit: bool = False  # the armed download-fault incarnation may kill itself

    def start(self, extra: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        with self.log.open("ab") as out:
            out.write(f"=== soak: start at {time.time():.3f} {' '.join(extra or [])}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                [*self.argv, *(extra or [])],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**ENV, **(env or {})},
                cwd=ROOT,
                start_new_session=True,
            )
        self.lives.append([time.time(), None, None])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._ended("SIGKILL")

    def _ended(self, how: str) -> None:
        if self.lives and self.lives[-1][1] is None:
            self.lives[-1][1] = time.time()
            self.lives[-1][2] = how

    def reap(self) -> int | None:
        """The exit code if this incarnation has just ended by itself (recorded), else None."""
        if self.proc is None or not self.lives or self.lives[-1][1] is not None:
            return None
        code = self.proc.poll()
        if code is not None:
            self._ended(f"exit {code}")
        return code

    def terminate(self, within: float, signalled: bool = False) -> int | None:
        """SIGTERM (once: a second one may land after the node removed its handler) and wait; None when it
        had to be SIGKILLed."""
        if self.proc is None:
            return None
        if not signalled and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        self._ended("SIGTERM" if code is not None else "SIGTERM, then SIGKILL")
        return code

    def alive_at(self, t: float) -> bool:
        return any(start <= t and (end is None or t < end) for start, end, _ in self.lives)

    def life_start(self, t: float) -> float | None:
        for start, end, _ in self.lives:
            if start <= t and (end is None or t < end):
                return float(start)
        return None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def read_steps(data: Path) -> list[dict[str, Any]]:
    try:
        text = (data / "steps.jsonl").read_text()
    except FileNotFoundError:
        return []
    steps = []
    for line in text.splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by a SIGKILL
            steps.append(json.loads(line))
    return steps


# ----------------------------------------------------------------------------- analysis (pure)


@dataclass(frozen=True)
class Line:
    volunteer: str
    step: int
    fingerprint: str
    samples: int
    peers: int
    time: float


def majority(lines: list[Line]) -> dict[int, str]:
    """step -> the fingerprint most volunteers logged there (ties: more samples, then the smaller hex)."""
    holders: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    samples: dict[tuple[int, str], int] = Counter()
    for line in lines:
        holders[line.step][line.fingerprint].add(line.volunteer)
        samples[(line.step, line.fingerprint)] += line.samples
    return {
        step: min(prints, key=lambda fp: (-len(prints[fp]), -samples[(step, fp)], fp))
        for step, prints in holders.items()
    }


def disagreements(
    lines: list[Line], discards: dict[str, list[tuple[int, int]]] | None = None
) -> tuple[list[int], list[int]]:
    """(steps discarded by a re-syncing peer, unexplained forks): see the module docstring. ``discards``
    (the ledger's discarded step ranges, keyed by volunteer name): a minority fingerprint every holder of
    which reported that step discarded is a re-sync discard, however many held it."""
    discards = discards or {}

    def reported(name: str, step: int) -> bool:
        return any(a <= step <= b for a, b in discards.get(name, []))

    best = majority(lines)
    prints: dict[int, set[str]] = defaultdict(set)
    for line in lines:
        prints[line.step].add(line.fingerprint)
    disagreeing = sorted(step for step, fps in prints.items() if len(fps) > 1)
    # The minority streaks: per volunteer, consecutive lines (in its file order) off the majority.
    streak_of: dict[tuple[str, int], int] = {}
    by_volunteer: dict[str, list[Line]] = defaultdict(list)
    for line in lines:
        by_volunteer[line.volunteer].append(line)
    for name, own in by_volunteer.items():
        run: list[Line] = []
        for entry in [*own, None]:
            if entry is not None and entry.fingerprint != best[entry.step]:
                run.append(entry)
                continue
            for member in run:
                streak_of[(name, member.step)] = max(streak_of.get((name, member.step), 0), len(run))
            run = []
    discarded: list[int] = []
    forks: list[int] = []
    for step in disagreeing:
        minority: dict[str, set[str]] = defaultdict(set)
        for line in lines:
            if line.step == step and line.fingerprint != best[step]:
                minority[line.fingerprint].add(line.volunteer)
        explained = all(
            (len(names) == 1 and streak_of.get((next(iter(names)), step), 0) <= RESYNC_STREAK)
            or all(reported(name, step) for name in names)
            for names in minority.values()
        )
        (discarded if explained else forks).append(step)
    return discarded, forks


def computed_samples(lines: list[Line]) -> int:
    best = majority(lines)
    return sum(line.samples for line in lines if line.fingerprint == best[line.step])


def peer_id_of(log: Path) -> str | None:
    """The volunteer's peer id, from its ``joined run … as <peer id>`` line."""
    with contextlib.suppress(FileNotFoundError):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("joined run ") and " as " in line:
                return line.rsplit(" as ", 1)[1].strip()
    return None


def stall_after(kill_time: float, survivors: dict[str, list[Line]], until: float) -> float | None:
    """Seconds until every survivor logged a step after ``kill_time``; None if one did not by ``until``."""
    worst = 0.0
    for own in survivors.values():
        after = [line.time for line in own if kill_time < line.time <= until]
        if not after:
            return None
        worst = max(worst, min(after) - kill_time)
    return worst


def convergence_after(
    restart: float, lines: dict[str, list[Line]], procs: dict[str, Proc], until: float
) -> float | None:
    """Seconds from ``restart`` until every live volunteer that has stepped since it (re)started holds the
    same (step, fingerprint); None if that never happened before ``until``."""
    moments = sorted({line.time for own in lines.values() for line in own if restart < line.time <= until})
    for t in moments:
        held: set[tuple[int | str, str]] = set()  # (step, fingerprint), or (why it is not in one, name)
        counted = 0
        for name, own in lines.items():
            proc = procs[name]
            if not proc.alive_at(t):
                continue
            began = proc.life_start(t)
            mine = [line for line in own if began is not None and began <= line.time <= t]
            if not mine:  # still joining: in no collaboration yet, so not "every volunteer in one"
                held.add(("joining", name))
                break
            last = mine[-1]
            if last.time <= restart:
                held.add(("stale", name))  # has not stepped since the restart
            held.add((last.step, last.fingerprint))
            counted += 1
        if counted >= 2 and len(held) == 1:
            return t - restart
    return None


def final_agreement(lines: dict[str, list[Line]], names: list[str]) -> dict[str, Any]:
    last = {name: lines[name][-1] for name in names if lines[name]}
    if len(last) < len(names) or not last:
        return {"one_collaboration": False, "why": "a volunteer never took a step", "last_steps": {}}
    top = max(line.step for line in last.values())
    common = min(line.step for line in last.values())
    at_common = {}
    for name in names:
        found = [line.fingerprint for line in lines[name] if line.step == common]
        at_common[name] = found[-1] if found else None
    same = len(set(at_common.values())) == 1 and None not in at_common.values()
    close = top - common <= 1
    return {
        "one_collaboration": same and close,
        "why": None if same and close else "different parameters" if not same else "a volunteer is behind",
        "last_steps": {name: line.step for name, line in last.items()},
        "compared_step": common,
        "fingerprints": {name: (fp or "")[:16] for name, fp in at_common.items()},
    }


# ----------------------------------------------------------------------------- ledger


def discards_by_peer(conn: Any) -> dict[str, list[tuple[int, int]]]:
    """The step ranges each peer reported discarded (the ledger's ``step_discards``)."""
    from sqlalchemy import text

    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for peer, first, last in conn.execute(text("SELECT peer_id, first_step, last_step FROM step_discards")):
        out[str(peer)].append((int(first), int(last)))
    return dict(out)


def superseded(lines: list[Line], discards: dict[str, list[tuple[int, int]]]) -> tuple[list[Line], list[int]]:
    """Drop the lines a volunteer reported discarded and then logged again (a re-sync to an older state:
    its earlier line of that step was replaced); returns the kept lines and the steps dropped. ``discards``
    is keyed by volunteer name."""
    last_of: dict[tuple[str, int], float] = {}
    for line in lines:
        key = (line.volunteer, line.step)
        last_of[key] = max(last_of.get(key, line.time), line.time)
    kept, dropped = [], set()
    for line in lines:
        ranges = discards.get(line.volunteer, [])
        if line.time < last_of[(line.volunteer, line.step)] and any(a <= line.step <= b for a, b in ranges):
            dropped.add(line.step)
        else:
            kept.append(line)
    return kept, sorted(dropped)


def ledger_figures(url: str) -> dict[str, Any]:
    """Credited samples, step rows (and those with 0 peers), open sessions, report statuses."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as conn:

            def one(query: str) -> Any:
                return conn.execute(text(query)).scalar()

            return {
                "credited_samples": float(one("SELECT COALESCE(SUM(credited_samples), 0) FROM reports")),
                "reported_samples": int(one("SELECT COALESCE(SUM(samples), 0) FROM reports")),
                "reports": int(one("SELECT COUNT(*) FROM reports")),
                "flagged_reports": int(one("SELECT COUNT(*) FROM reports WHERE status = 'flagged'")),
                "step_rows": int(one("SELECT COUNT(*) FROM steps")),
                "zero_peer_step_rows": int(one("SELECT COUNT(*) FROM steps WHERE peers = 0")),
                "max_recorded_step": one("SELECT MAX(global_step) FROM steps"),
                "sessions": int(one("SELECT COUNT(*) FROM sessions")),
                "open_sessions": int(one("SELECT COUNT(*) FROM sessions WHERE ended_at IS NULL")),
                "discards_by_peer": discards_by_peer(conn),
                "credited_by_peer": {
                    str(peer): float(samples)
                    for peer, samples in conn.execute(
                        text("SELECT peer_id, SUM(credited_samples) FROM reports GROUP BY peer_id")
                    )
                },
                "report_times": sorted(
                    float(t) for (t,) in conn.execute(text("SELECT received_at FROM reports"))
                ),
                "step_times": sorted(
                    (int(step), float(t))
                    for step, t in conn.execute(text("SELECT global_step, finished_at FROM steps"))
                ),
                # a step taken again after a rollback keeps its first row in ``steps``; its new receipts
                # replace the discarded ones, in the reports that brought them
                "receipt_times": sorted(
                    (int(step), float(t))
                    for step, t in conn.execute(
                        text(
                            "SELECT receipts.step, reports.received_at FROM receipts JOIN reports"
                            " ON receipts.report_id = reports.id WHERE receipts.discarded = 0"
                        )
                    )
                ),
            }
    finally:
        engine.dispose()


@contextlib.contextmanager
def ledger_database(backbones: int, work: Path, given: str | None) -> Iterator[tuple[str | None, str]]:
    """(the ``--database-url`` to give the backbones or None, the URL to read the ledger from)."""
    if given:
        yield given, given
        return
    if backbones == 1:
        yield None, f"sqlite:///{work / 'backbone1' / 'ledger.sqlite3'}"
        return
    sys.path.insert(0, str(ROOT))
    from tests.pg import find_bindir, postgres_cluster

    if find_bindir() is None:
        url = f"sqlite:///{work / 'ledger.sqlite3'}"  # one file, two processes: SQLite's own locking
        yield url, url
        return
    with postgres_cluster() as cluster:
        url = cluster.create_database()
        yield url, url


# ----------------------------------------------------------------------------- the soak


@dataclass
class Event:
    at: float  # seconds after t0
    kind: str  # kill | kill_two | backbone_restart | download_kill | backbone_lost
    target: int = 0  # for backbone_lost: which backbone (0 or 1)


def schedule(rng: random.Random, seconds: float, backbones: int, lost: int | None = None) -> list[Event]:
    """The faults of the module docstring; the fixed ones at fractions of the active (not quiet) time."""
    active = seconds - max(30.0, seconds / 4)
    fixed = [Event(0.2 * active, "kill_two"), Event(0.45 * active, "backbone_restart")]
    fixed.append(Event(0.65 * active, "download_kill"))
    if backbones == 2:
        fixed.append(Event(0.85 * active, "backbone_lost", rng.randrange(2) if lost is None else lost - 1))
    events = list(fixed)
    t = rng.uniform(20, 60)
    while t < active:
        if all(abs(t - e.at) > 8 for e in fixed):
            events.append(Event(t, "kill"))
        t += rng.uniform(20, 60)
    return sorted(events, key=lambda e: e.at)


class Soak:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.rng = random.Random(args.seed)
        self.backbones: list[Proc] = []
        self.volunteers: list[Proc] = []
        self.kills: list[dict[str, Any]] = []  # volunteer kills: time, names
        self.restarts: list[float] = []  # backbone restarts (time started again)
        self.events: list[dict[str, Any]] = []
        self.unexpected: list[dict[str, Any]] = []
        self.pending: list[tuple[float, Proc, list[str], dict[str, str]]] = []  # restarts due
        self.addresses: list[str] = []
        self.run_id = ""
        self.loads: list[float] = []
        self.settled_s = 0.0

    def log(self, what: str) -> None:
        if not self.args.json:
            print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)

    # -- starting

    def start_backbones(self, database_url: str | None) -> None:
        manifest = self.work / "manifest.toml"
        manifest.write_text(MANIFEST + (SMALL_OPTIONS if self.args.small else ""))
        ports = [(free_port(), free_port()) for _ in range(self.args.backbones)]
        urls = [f"https://127.0.0.1:{api}" for _, api in ports]
        for i, (port, api) in enumerate(ports, start=1):
            data = self.work / f"backbone{i}"
            argv = cli(
                "backbone", "start", "--run-id", RUN_NAME, "--data-dir", str(data),
                "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--api-listen", f"127.0.0.1:{api}",
                "--manifest", str(manifest), "--no-mdns",
            )  # fmt: skip
            for url in urls:  # every backbone's manifest lists every API: volunteers fail over
                argv += ["--public-url", url]
            if database_url is not None:
                argv += ["--database-url", database_url]
            if i > 1:
                argv += ["--authority-key", str(self.work / "backbone1" / "authority.key")]
                argv += ["--initial-peer", self.addresses[0]]
            node = Proc(f"backbone{i}", data, self.work / f"backbone{i}.log", argv)
            node.start()
            address, run_id = self.wait_started(node)
            self.addresses.append(address)
            self.run_id = self.run_id or run_id
            self.backbones.append(node)
            self.log(f"{node.name} up: {address}")
        if len(self.backbones) == 2:  # a restarted backbone 1 rejoins through backbone 2
            self.backbones[0].argv += ["--initial-peer", self.addresses[1]]

    def wait_started(self, node: Proc) -> tuple[str, str]:
        deadline = time.monotonic() + STARTUP_S
        mark = node.log.read_text(errors="replace").rfind("=== soak: start")
        while True:
            text = node.log.read_text(errors="replace")[mark:]
            lines = text.splitlines()
            address = next(
                (x.removeprefix("listening on ") for x in lines if x.startswith("listening on ")), ""
            )
            run_id = next((x.removeprefix("run id ") for x in lines if x.startswith("run id ")), "")
            if address and run_id:
                return address.strip(), run_id.strip()
            if not node.alive() or time.monotonic() > deadline:
                raise SystemExit(f"{node.name} did not start; the end of {node.log}:\n{node.tail()}")
            time.sleep(POLL_S)

    def invite(self, username: str, database_url: str | None) -> str:
        argv = cli("backbone", "allow", "add", username, "--data-dir", str(self.backbones[0].data), "--json")
        if database_url is not None:
            argv += ["--database-url", database_url]
        result = subprocess.run(argv, capture_output=True, text=True, env=ENV, cwd=ROOT, check=False)
        if result.returncode != 0:
            raise SystemExit(f"backbone allow add {username} failed: {result.stderr}")
        return str(json.loads(result.stdout)["invite"])

    def start_volunteers(self, database_url: str | None) -> None:
        for i in range(1, self.args.volunteers + 1):
            name = f"volunteer{i}"
            data = self.work / name
            argv = cli(
                "volunteer", "join", self.run_id, "--data-dir", str(data),
                "--listen", "/ip4/127.0.0.1/tcp/0", "--no-panel", "--threads", "1",
            )  # fmt: skip
            for address in self.addresses:
                argv += ["--initial-peer", address]
            node = Proc(name, data, self.work / f"{name}.log", argv)
            node.start(["--invite", self.invite(name, database_url)])  # later starts: the saved credential
            self.volunteers.append(node)

    def wait_first_steps(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while not all(read_steps(v.data) for v in self.volunteers):
            for node in [*self.backbones, *self.volunteers]:
                if not node.alive():
                    raise SystemExit(f"{node.name} exited during start-up:\n{node.tail()}")
            if time.monotonic() > deadline:
                raise SystemExit("not every volunteer took a step within the start-up deadline")
            time.sleep(1.0)

    # -- faults

    def trained_volunteers(self) -> list[Proc]:
        """Alive volunteers not waiting for a restart, preferring those that have stepped since starting."""
        waiting = {p.name for _, p, _, _ in self.pending}
        alive = [v for v in self.volunteers if v.alive() and v.name not in waiting]
        stepped = [v for v in alive if any(s["time"] >= v.lives[-1][0] for s in read_steps(v.data)[-5:])]
        return stepped or alive

    def kill_volunteers(self, count: int, kind: str, env: dict[str, str] | None = None) -> None:
        candidates = self.trained_volunteers()
        if len(candidates) < count:
            self.events.append({"time": time.time(), "kind": kind, "skipped": "too few volunteers"})
            return
        victims = self.rng.sample(candidates, count)
        now = time.time()
        for v in victims:
            v.kill()
            delay = self.rng.uniform(1, 4)
            self.pending.append((time.monotonic() + delay, v, [], env or {}))
        names = [v.name for v in victims]
        self.kills.append({"time": now, "kind": kind, "volunteers": names})
        self.events.append({"time": now, "kind": kind, "volunteers": names})
        self.log(f"{kind}: SIGKILL {', '.join(names)}")

    def fire(self, event: Event) -> None:
        if event.kind == "kill":
            self.kill_volunteers(1, "kill")
        elif event.kind == "kill_two":
            self.kill_volunteers(2, "kill_two")
        elif event.kind == "download_kill":
            self.kill_volunteers(1, "download_kill", {"DEDLOC_FAULTS": "state.mid_download=kill"})
        elif event.kind == "backbone_restart":
            node = self.backbones[0]
            node.kill()
            self.events.append({"time": time.time(), "kind": "backbone_restart", "backbone": node.name})
            self.log(f"backbone_restart: SIGKILL {node.name}")
            time.sleep(3.0)
            node.start()
            self.wait_started(node)
            self.restarts.append(time.time())
            self.log(f"{node.name} restarted")
        elif event.kind == "backbone_lost":
            node = self.backbones[event.target]
            node.kill()
            self.events.append({"time": time.time(), "kind": "backbone_lost", "backbone": node.name})
            self.log(f"backbone_lost: SIGKILL {node.name} for good")

    def watch(self) -> None:
        """Restart what is due; record (and repair) processes that died without being killed."""
        now = time.monotonic()
        for due in [p for p in self.pending if p[0] <= now]:
            self.pending.remove(due)
            _, node, extra, env = due
            node.expect_exit = bool(env)
            node.start(extra, env)
            self.log(f"restarted {node.name}" + (f" with {env}" if env else ""))
        lost = {e["backbone"] for e in self.events if e["kind"] == "backbone_lost"}
        for node in [*self.volunteers, *self.backbones]:
            code = node.reap()
            if code is None or node.name in lost:
                continue
            armed = node.expect_exit and code in (-signal.SIGKILL, 70)
            record = {"time": time.time(), "node": node.name, "code": code, "fault_point": armed}
            if armed:
                self.events.append({**record, "kind": "died_at_fault_point"})
                self.kills.append({"time": time.time(), "kind": "fault_point", "volunteers": [node.name]})
            else:
                self.unexpected.append({**record, "tail": node.tail(8)})
            node.expect_exit = False
            self.log(f"{node.name} exited with {code}" + (" (the armed fault point)" if armed else ""))
            if node in self.volunteers:
                self.pending.append((time.monotonic() + 1.0, node, [], {}))
            else:
                node.start()

    def run(self, database_url: str | None) -> float:
        self.start_backbones(database_url)
        self.start_volunteers(database_url)
        self.log(f"run {self.run_id}: {len(self.volunteers)} volunteers starting")
        self.wait_first_steps()
        t0 = time.time()
        plan = schedule(self.rng, self.args.seconds, self.args.backbones, self.args.lost_backbone)
        self.log(f"every volunteer stepped; {len(plan)} faults over {self.args.seconds:.0f} s")
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < self.args.seconds:
            while plan and plan[0].at <= elapsed:
                self.fire(plan.pop(0))
            self.watch()
            self.loads.append(os.getloadavg()[0])
            time.sleep(POLL_S)
        self.settle()
        return t0

    def settle(self) -> None:
        """Wait (at most :data:`SETTLE_S`) until every volunteer has stepped since it last started and all
        hold the same latest (step, fingerprint): a condition, not a sleep; the check reports what holds."""
        began = time.monotonic()
        while time.monotonic() - began < self.args.settle:
            self.watch()
            if not self.pending and all(v.alive() for v in self.volunteers):
                latest = []
                for v in self.volunteers:
                    own = [s for s in read_steps(v.data) if s["time"] >= v.lives[-1][0]]
                    latest.append((own[-1]["step"], own[-1]["fingerprint"]) if own else None)
                if None not in latest and len(set(latest)) == 1:
                    break
            time.sleep(POLL_S)
        self.settled_s = time.monotonic() - began

    def stop(self) -> dict[str, int | None]:
        for _, node, extra, env in self.pending:  # a restart still due: start it, so it can leave cleanly
            node.start(extra, env)
        self.pending.clear()
        live = [v for v in self.volunteers if v.alive()]
        for v in live:
            if v.proc is not None:
                v.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        return {v.name: v.terminate(max(0.1, deadline - time.monotonic()), signalled=True) for v in live}


def analyse(
    soak: Soak, t0: float, end: float, codes: dict[str, int | None], ledger_url: str
) -> dict[str, Any]:
    lines: dict[str, list[Line]] = {}
    for v in soak.volunteers:
        lines[v.name] = [
            Line(
                v.name,
                int(s["step"]),
                str(s["fingerprint"]),
                int(s["samples"]),
                int(s["peers"]),
                float(s["time"]),
            )
            for s in read_steps(v.data)
        ]
    everything = [line for own in lines.values() for line in own]
    procs = {v.name: v for v in soak.volunteers}
    fault_times = sorted(
        [k["time"] for k in soak.kills]
        + soak.restarts
        + [e["time"] for e in soak.events if e["kind"] == "backbone_lost"]
    )

    stalls = []
    for kill in soak.kills:
        t = kill["time"]
        following = [f for f in fault_times if f > t + 0.5]
        until = min([*following, end])
        survivors = {
            name: own
            for name, own in lines.items()
            if name not in kill["volunteers"]
            and procs[name].alive_at(t)
            and procs[name].alive_at(until - 0.01)
        }
        stall = stall_after(t, survivors, until) if survivors else None
        stalls.append(
            {
                "kind": kill["kind"],
                "volunteers": kill["volunteers"],
                "at": round(t - t0, 1),
                "stall_s": None if stall is None else round(stall, 2),
                "survivors": len(survivors),
            }
        )
    known = [s["stall_s"] for s in stalls if s["stall_s"] is not None]

    convergence = []
    for restart in soak.restarts:
        converged = convergence_after(restart, lines, procs, end)
        convergence.append(
            {"at": round(restart - t0, 1), "seconds": None if converged is None else round(converged, 2)}
        )

    ledger = ledger_figures(ledger_url)
    discards = ledger.pop("discards_by_peer")
    named = {v.name: discards.get(peer_id_of(v.log) or "", []) for v in soak.volunteers}
    everything, replaced = superseded(everything, named)
    discarded, forks = disagreements(everything, named)
    discarded = sorted({*discarded, *replaced})
    best = majority(everything)
    start_step = max((line.step for line in everything if line.time <= t0), default=0)
    top = int(statistics.median([own[-1].step for own in lines.values() if own] or [0]))
    # A volunteer that has not stepped since it last started is still joining (slow on a busy machine): it
    # is in no collaboration yet, so it is listed, not compared.
    stopped = [name for name, code in codes.items() if code == 0]
    rejoined = {n for n in stopped if any(x.time >= procs[n].lives[-1][0] for x in lines[n])}
    finals = [n for n in stopped if n in rejoined]
    agreement = (
        final_agreement(lines, finals)
        if finals
        else {"one_collaboration": False, "why": "no volunteer stopped cleanly"}
    )
    computed = computed_samples(everything)
    report_times, step_times = ledger.pop("report_times"), ledger.pop("step_times")
    receipt_times = ledger.pop("receipt_times")
    credited_by_peer = ledger.pop("credited_by_peer")
    per_volunteer = {}
    for v in soak.volunteers:
        own = [line for line in everything if line.volunteer == v.name]
        peer = peer_id_of(v.log)
        per_volunteer[v.name] = {
            "peer_id": peer,
            "computed": sum(line.samples for line in own if line.fingerprint == best[line.step]),
            "credited": credited_by_peer.get(peer or "", 0.0),
        }
    overcredited = [n for n, f in per_volunteer.items() if f["credited"] > f["computed"] + 1e-6]
    lost_at = [e["time"] for e in soak.events if e["kind"] == "backbone_lost"]
    after_lost = None
    if lost_at:
        after_lost = {
            "reports_received": sum(1 for t in report_times if t > lost_at[0]),
            # steps the ledger recorded, or took counting receipts of, after the loss (a step taken again
            # after a rollback is recorded by its receipts: its row in ``steps`` is the first one's)
            "steps_recorded": len(
                {step for step, t in step_times if t > lost_at[0]}
                | {step for step, t in receipt_times if t > lost_at[0]}
            ),
            "volunteer_steps": len({line.step for line in everything if line.time > lost_at[0]}),
        }
    minutes = max(1e-9, (end - t0) / 60)

    failures = []
    if not agreement["one_collaboration"]:
        failures.append("one_collaboration")
    if forks:
        failures.append("no_unexplained_forks")
    if ledger["credited_samples"] > computed + 1e-6 or overcredited:
        failures.append("credited_le_computed")
    if after_lost is not None and not (after_lost["reports_received"] and after_lost["volunteer_steps"]):
        failures.append("survives_backbone_lost")
    if any(code != 0 for code in codes.values()):
        failures.append("clean_exits")
    if top < start_step:
        failures.append("progress_kept")
    if ledger["open_sessions"]:
        failures.append("no_open_sessions")
    if ledger["zero_peer_step_rows"]:
        failures.append("no_zero_peer_steps")
    if any(c["seconds"] is None for c in convergence):
        failures.append("converged_after_backbone_restart")
    if soak.unexpected:
        failures.append("no_unexpected_exits")

    return {
        "seed": soak.args.seed,
        "seconds": soak.args.seconds,
        "volunteers": soak.args.volunteers,
        "backbones": soak.args.backbones,
        "small_model": soak.args.small,
        "work_dir": str(soak.work),
        "load_average": {
            "mean": round(statistics.fmean(soak.loads), 2) if soak.loads else None,
            "max": round(max(soak.loads), 2) if soak.loads else None,
            "cores": os.cpu_count(),
        },
        "settle_s": round(soak.settled_s, 1),
        "steps_per_minute": round((top - start_step) / minutes, 1),
        "steps": {"at_t0": start_step, "at_end": top},
        "stall": {
            "median_s": round(statistics.median(known), 2) if known else None,
            "worst_s": max(known) if known else None,
            "unresolved": sum(1 for s in stalls if s["stall_s"] is None),
            "per_kill": stalls,
        },
        "backbone_restart_convergence": convergence,
        "disagreeing_steps": len(discarded) + len(forks),
        "discarded_by_resync": discarded,
        "unexplained_forks": len(forks),
        "fork_steps_sample": forks[:20],
        "steps_taken_by_several": sum(
            1
            for step in {line.step for line in everything}
            if len({line.volunteer for line in everything if line.step == step}) > 1
        ),
        "lone_steps": sum(1 for line in everything if line.peers <= 1),
        "final": {**agreement, "not_rejoined": sorted(set(stopped) - rejoined)},
        "samples": {
            "computed": computed,
            "credited": ledger["credited_samples"],
            "ratio": round(ledger["credited_samples"] / computed, 3) if computed else None,
        },
        "per_volunteer": per_volunteer,
        "overcredited": overcredited,
        "after_backbone_lost": after_lost,
        "ledger": ledger,
        "exit_codes": codes,
        "unexpected_exits": soak.unexpected,
        "events": [{**e, "time": round(e["time"] - t0, 1)} for e in soak.events],
        "lives": {
            v.name: [
                [round(a - t0, 1), None if b is None else round(b - t0, 1), how] for a, b, how in v.lives
            ]
            for v in soak.volunteers
        },
        "failures": failures,
    }


def prepare_work_dir(given: Path | None) -> Path:
    if given is None:
        return Path(tempfile.mkdtemp(prefix="dedloc-soak-"))
    if given.exists() and any(given.iterdir()):
        raise SystemExit(f"--work-dir {given} is not empty; give a new or empty directory")
    given.mkdir(parents=True, exist_ok=True)
    return given.resolve()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=300.0, help="soak length after start-up (300)")
    parser.add_argument("--volunteers", type=int, default=5)
    parser.add_argument("--backbones", type=int, choices=(1, 2), default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object (no progress lines)")
    parser.add_argument("--work-dir", type=Path, help="an empty dir for data dirs and logs (default: temp)")
    parser.add_argument("--database-url", help="the ledger database for the backbones (default: see doc)")
    parser.add_argument("--lost-backbone", type=int, choices=(1, 2), help="which one (default: by the seed)")
    parser.add_argument("--settle", type=float, default=SETTLE_S, help="longest wait for one collaboration")
    parser.add_argument("--small", action="store_true", help="a smaller model (CI): same target batch")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (always kept on failure)")
    args = parser.parse_args()
    if args.volunteers < 3 or args.seconds < 60:
        parser.error("--volunteers must be at least 3 (two are killed at once) and --seconds at least 60")
    work = prepare_work_dir(args.work_dir)
    soak = Soak(args, work)
    report: dict[str, Any] = {}
    try:
        with ledger_database(args.backbones, work, args.database_url) as (given_url, read_url):
            try:
                t0 = soak.run(given_url)
                end = time.time()
                codes = soak.stop()
                time.sleep(2.0)  # the backbones finish the last reports' transactions
                report = analyse(soak, t0, end, codes, read_url)
            finally:
                for v in soak.volunteers:
                    if v.alive():
                        v.kill()
                for b in soak.backbones:
                    b.terminate(BACKBONE_STOP_S)
    except KeyboardInterrupt:
        return 130
    (work / "report.json").write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(json.dumps({k: v for k, v in report.items() if k not in ("events",)}, indent=1))
        print(f"work dir: {work}")
    if not report["failures"] and args.work_dir is None and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not report["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
