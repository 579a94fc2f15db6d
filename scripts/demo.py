"""The main job: a backbone and N invited volunteers on loopback train a model together.

Every node is a real process started with the real CLIs, exactly as organizers and volunteers run them:

1. a recipe's manifest (``--recipe``, from ``deploy/recipes``: by default ``tiny-mlm``, the built-in task;
   ``albert-tiny``, a Hugging Face ALBERT with a tokenizer the backbone trains; each has a target batch
   small enough that a step takes a second or two on a laptop's CPU) is written into the work dir, and
   ``backbone start --manifest`` serves it in a run pinned to the backbone's authority key (SQLite
   ledger in its data dir);
2. ``backbone allow add`` mints one invite per volunteer, and ``volunteer join <run-id> --invite`` redeems
   it over the backbone's HTTPS API, downloads the manifest and starts training with the others;
3. a live table (refreshed every second) shows each volunteer's step, loss and samples/s (from the
   ``steps.jsonl`` it appends after every step) and its connections (from its ``status.json``), and the
   collaboration's step and loss as the backbone recorded them in its ledger;
4. after ``--seconds`` (or, with ``--until-step N``, as soon as the ledger recorded step ``N``, at most
   ``--seconds``: the same amount of training however loaded the machine), every volunteer gets SIGTERM:
   it finishes the round it is in, sends its last contribution reports and must exit 0; then ``backbone
   ledger`` prints who contributed what and ``backbone ledger --steps`` the last steps and the loss curve;
   then the backbone is stopped;
5. for a Hugging Face recipe, ``backbone export --format hf`` writes the last checkpoint as a folder, and
   a fresh interpreter loads it with ``transformers``' ``from_pretrained`` and fills in a masked word.

With ``--sync diloco`` the run uses the low-communication mode instead (``[sync] mode = "diloco"``):
every volunteer takes inner optimizer steps of ``local_batch`` samples at its own pace, and a global step
is a round of :data:`DILOCO_ROUND` times the recipe's target batch, after which the volunteers average
their pseudo-gradients, 8-bit compressed with error feedback, and take the outer step together.

With ``--sync swarm`` (``[sync] mode = "swarm"``) the tiny-mlm model has :data:`SWARM_STAGES` layers,
split into as many pipeline stages; four volunteers by default each serve a stage and run a trainer that
carries micro-batches through one server per stage. The volunteers that start within
:data:`SWARM_FORMATION` seconds of the first form the run: they measure the round trips among them and
the heterogeneous scheduler places them (the stage column marks them ``*``); a later one joins the stage
that needs it most. Each stage is a
collaboration of its servers and steps every 64 samples; the table shows which stage each volunteer
serves and each stage's step. Half-way (or half-way to ``--until-step``, which then counts the steps of
the slowest stage) the demo stops a volunteer that serves a stage alone: it hands the stage over, and
rebalancing (every :data:`SWARM_PERIOD` seconds) moves a volunteer from another stage into it, which
downloads the stage's state and continues from its step. The ledger credits each stage server its
*stage-samples* (a sample through one stage), backed by receipts of the other servers of its stage.

Each process writes its stdout and stderr to ``<name>.log`` in the work dir (a fresh temporary directory
unless ``--work-dir`` is given); the demo prints where they are.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from backbone.ledger import LedgerStore, StepRow

RUN_NAME = "demo-run"
REFRESH_S = 1.0
STARTUP_S = 90.0  # the backbone generates its dataset shards before it prints the run id
VOLUNTEER_EXIT_S = 120.0  # SIGTERM -> finish the round, send the last reports, leave the DHT
BACKBONE_EXIT_S = 30.0
SPS_WINDOW = 10  # steps over which a volunteer's samples/s is measured

DILOCO_ROUND = 8  # --sync diloco: a round is this many of the recipe's target batches
SWARM_STAGES = 3  # --sync swarm: the model's pipeline stages
SWARM_PERIOD = 8.0  # --sync swarm: seconds between rebalancing decisions
SWARM_FORMATION = 15.0  # --sync swarm: seconds the run's first servers measure links before placement
RECIPES = Path(__file__).resolve().parents[1] / "deploy" / "recipes"  # the manifests --recipe names

# not on a terminal (a log, CI): wide enough that the live table's columns need no abbreviation
console = Console(width=None if sys.stdout.isatty() else 120)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


class Stop(Exception):
    """SIGTERM or Ctrl+C reached the demo: stop the nodes cleanly and report."""


@dataclass
class Node:
    """One process of the demo, its data dir and the log that receives its stdout and stderr."""

    name: str
    proc: subprocess.Popen[bytes]
    data: Path
    log: Path

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def cli(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def spawn(name: str, argv: list[str], work: Path, data: Path) -> Node:
    """Start ``argv`` in its own session (a Ctrl+C reaches only the demo, which stops the nodes in order),
    its stdout and stderr into ``<work>/<name>.log``."""
    log = work / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=ENV,
            start_new_session=True,
        )
    return Node(name, proc, data, log)


def start_backbone(work: Path, manifest: Path) -> tuple[Node, str, str]:
    """Start the backbone; return it, its first address and the pinned run id it prints."""
    data = work / "backbone"
    argv = cli(
        "backbone", "start", "--run-id", RUN_NAME, "--data-dir", str(data),
        "--listen", "/ip4/127.0.0.1/tcp/0", "--api-listen", "127.0.0.1:0",
        "--manifest", str(manifest), "--no-mdns",
    )  # fmt: skip
    node = spawn("backbone", argv, work, data)
    deadline = time.monotonic() + STARTUP_S
    address = run_id = ""
    while not run_id:
        if node.proc.poll() is not None or time.monotonic() > deadline:
            stop([node], BACKBONE_EXIT_S)
            raise SystemExit(f"the backbone did not start; the end of {node.log}:\n{node.tail()}")
        time.sleep(0.2)
        for line in node.log.read_text(errors="replace").splitlines():
            if line.startswith("listening on ") and not address:
                address = line.removeprefix("listening on ").strip()
            elif line.startswith("run id "):
                run_id = line.removeprefix("run id ").strip()
    return node, address, run_id


def invite(backbone: Node, username: str) -> str:
    result = subprocess.run(
        cli("backbone", "allow", "add", username, "--data-dir", str(backbone.data),
            "--note", "demo volunteer", "--json"),
        capture_output=True, text=True, env=ENV, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"backbone allow add {username} failed ({result.returncode}): {result.stderr}")
    return str(json.loads(result.stdout)["invite"])


def start_volunteer(work: Path, name: str, run_id: str, address: str, code: str) -> Node:
    data = work / name
    argv = cli(
        "volunteer", "join", run_id, "--invite", code, "--data-dir", str(data),
        "--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peer", address, "--no-panel", "--threads", "1",
    )  # fmt: skip
    return spawn(name, argv, work, data)


def recent_steps(data: Path, count: int) -> list[dict[str, Any]]:
    """The last ``count`` lines of a volunteer's ``steps.jsonl`` (one per step it took)."""
    try:
        lines = (data / "steps.jsonl").read_text().splitlines()[-count:]
    except FileNotFoundError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written right now
            continue
    return steps


def samples_per_second(steps: list[dict[str, Any]]) -> float | None:
    """This volunteer's samples per wall-clock second over its last steps (averaging time included)."""
    if len(steps) < 2 or steps[-1]["time"] <= steps[0]["time"]:
        return None
    return float(sum(s["samples"] for s in steps[1:]) / (steps[-1]["time"] - steps[0]["time"]))


def _json_file(path: Path) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return found


def status(data: Path) -> dict[str, Any] | None:
    return _json_file(data / "status.json")


def swarm_status(data: Path) -> dict[str, Any] | None:
    """A swarm volunteer's ``swarm.json``: the stage it serves, its moves, its trainers' samples."""
    return _json_file(data / "swarm.json")


def stage_steps(volunteers: list[Node]) -> dict[int, int]:
    """Each stage's highest step any volunteer took (its steps.jsonl lines carry the stage)."""
    best: dict[int, int] = {}
    for v in volunteers:
        for row in recent_steps(v.data, 200):
            stage = row.get("stage")
            if isinstance(stage, int):
                best[stage] = max(best.get(stage, 0), int(row["step"]))
    return best


def _loss(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def table(
    volunteers: list[Node], latest: StepRow | None, elapsed: float, seconds: float, swarm: bool = False
) -> Table:
    t = Table(title=f"{RUN_NAME} on loopback — {elapsed:.0f} of {seconds:.0f} s (Ctrl+C stops now)")
    columns = ("node", *(("stage",) if swarm else ()), "step", "loss", "samples/s", "peers", "conns", "state")
    for column in columns:
        t.add_column(column, justify="left" if column in ("node", "state") else "right", no_wrap=True)
    total_sps = 0.0
    for v in volunteers:
        steps = recent_steps(v.data, SPS_WINDOW)
        last = steps[-1] if steps else None
        sps = samples_per_second(steps)
        total_sps += sps or 0.0
        node = status(v.data)
        code = v.proc.poll()
        state = f"exited {code}" if code is not None else "training" if last else "joining…"
        where: tuple[str, ...] = ()
        if swarm:
            facts = swarm_status(v.data)
            stage = None if facts is None else facts.get("stage")
            moves = [] if facts is None else facts.get("moves", [])
            formed = (facts or {}).get("formation") or {}
            tag = "*" if formed.get("by_scheduler") and not moves else ""  # placed by the scheduler
            where = ("—" if stage is None else f"{stage}{tag}" + "".join(f" (←{a})" for a, _ in moves[-1:]),)
            if facts is not None and code is None:
                state = str(facts.get("doing", state))
            last = last if last is None or last.get("stage") == stage else None  # a step of its old stage
        t.add_row(
            v.name,
            *where,
            "—" if last is None else str(last["step"]),
            "—" if last is None else _loss(last["loss"]),
            "—" if sps is None else f"{sps:.0f}",
            "—" if last is None else str(last["peers"]),
            "—" if node is None else str(node["connected_peers"]),
            state,
        )
    t.add_section()
    if swarm:
        steps_by_stage = stage_steps(volunteers)
        shown = " · ".join(f"{k}: {v}" for k, v in sorted(steps_by_stage.items())) or "—"
        t.add_row("stages", "", "", "", f"{total_sps:.0f}", "", "", f"steps {shown}")
    elif latest is None:
        t.add_row("collaboration", "—", "—", "", "", "", "(ledger)")
    else:
        t.add_row(
            "collaboration",
            str(latest.global_step),
            _loss(latest.loss),
            f"{total_sps:.0f}",
            str(latest.peers),
            "",
            "(ledger)",
        )
    return t


def watch(
    volunteers: list[Node],
    backbone: Node,
    seconds: float,
    until_step: int | None = None,
    swarm: bool = False,
) -> None:
    """Refresh the table every second until ``seconds`` pass, or until the ledger recorded ``until_step``
    (a swarm run: until every stage took it); raise SystemExit if a node dies. A swarm run loses a
    volunteer half-way (:func:`depart`)."""
    started = time.monotonic()
    ledger: LedgerStore | None = None
    latest: StepRow | None = None
    departed: Node | None = None

    def frame(elapsed: float) -> Table:
        return table(volunteers, latest, elapsed, seconds, swarm)

    try:
        with Live(frame(0), console=console, auto_refresh=False) as live:
            while (elapsed := time.monotonic() - started) < seconds:
                for node in [backbone, *volunteers]:
                    if node.proc.poll() is not None and not (node is departed and node.proc.returncode == 0):
                        live.update(frame(elapsed), refresh=True)
                        raise SystemExit(
                            f"{node.name} exited with {node.proc.returncode}; the end of {node.log}:\n"
                            f"{node.tail()}"
                        )
                if swarm:
                    steps = stage_steps(volunteers)
                    reached = min(steps.values()) if len(steps) == SWARM_STAGES else 0
                    halfway = elapsed >= seconds / 2 or (until_step is not None and 2 * reached >= until_step)
                    if departed is None and halfway:
                        departed = depart(volunteers, live)
                    live.update(frame(elapsed), refresh=True)
                    # the one stopped half-way has handed its stage over and exited
                    gone = departed is not None and departed.proc.poll() is not None
                    if until_step is not None and reached >= until_step and gone:
                        break
                    time.sleep(REFRESH_S)
                    continue
                if ledger is None:
                    ledger = LedgerStore.open(f"sqlite:///{backbone.data / 'ledger.sqlite3'}")
                recorded = ledger.recent_steps(limit=1)
                latest = recorded[0] if recorded else latest
                live.update(frame(elapsed), refresh=True)
                if until_step is not None and latest is not None and latest.global_step >= until_step:
                    break
                time.sleep(REFRESH_S)
    finally:
        if not console.is_terminal:
            console.print()  # Live's last frame ends without a newline when it is not on a terminal
        if ledger is not None:
            ledger.close()


def depart(volunteers: list[Node], live: Live) -> Node:
    """SIGTERM the volunteer serving a stage alone (any, if none is alone): it hands its stage over and
    exits, and rebalancing moves a server of another stage into the emptied one."""
    serving: dict[int, list[Node]] = {}
    for v in volunteers:
        facts = swarm_status(v.data)
        if facts is not None and v.proc.poll() is None and isinstance(facts.get("stage"), int):
            serving.setdefault(facts["stage"], []).append(v)
    alone = [nodes[0] for _, nodes in sorted(serving.items()) if len(nodes) == 1]
    chosen = (alone or [v for v in volunteers if v.proc.poll() is None])[0]
    stage = swarm_status(chosen.data) or {}
    live.console.print(
        f"stopping {chosen.name} (serving stage {stage.get('stage')}"
        + (" alone" if alone else "")
        + "): it hands the stage over, and rebalancing moves another volunteer in",
        highlight=False,
    )
    chosen.proc.send_signal(signal.SIGTERM)
    return chosen


def stop(nodes: list[Node], within: float) -> dict[str, int | None]:
    """SIGTERM every node that still runs, then wait for all of them; None: it had to be SIGKILLed."""
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)
    codes: dict[str, int | None] = {}
    deadline = time.monotonic() + within
    for node in nodes:
        try:
            codes[node.name] = node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()
            codes[node.name] = None
    return codes


def show_codes(codes: dict[str, int | None]) -> None:
    for name, code in codes.items():
        verdict = (
            "[green]ok[/]"
            if code == 0
            else "[red]killed after no exit[/]"
            if code is None
            else "[red]failed[/]"
        )
        console.print(f"  {name}: exit code {'—' if code is None else code} {verdict}")


# Run in a fresh interpreter, as a user of the exported folder would: transformers alone, no project code.
FILL_MASK = """
import sys, torch
from transformers import AutoModelForMaskedLM, AutoTokenizer
model = AutoModelForMaskedLM.from_pretrained(sys.argv[1]).eval()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
text = "the farmer feeds the hungry [MASK] in the barn."
ids = tokenizer(text, return_tensors="pt")
with torch.no_grad():
    logits = model(**ids).logits[0]
where = (ids["input_ids"][0] == tokenizer.mask_token_id).nonzero()[0, 0]
best = tokenizer.convert_ids_to_tokens(logits[where].topk(5).indices.tolist())
print(f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters; {text!r}: {best}")
"""


def export_and_load(backbone: Node, out: Path) -> bool:
    """A Hugging Face run: export the last checkpoint as a folder and load it with from_pretrained."""
    if not any((backbone.data / "checkpoints").glob("*.safetensors")):
        console.print("no checkpoint stored yet (a short run): nothing to export", highlight=False)
        return True
    argv = cli("backbone", "export", "--data-dir", str(backbone.data), "--format", "hf", "-o", str(out))
    exported = subprocess.run(argv, env=ENV, capture_output=True, text=True, check=False)
    if exported.returncode != 0:
        console.print(f"[red]backbone export --format hf failed:[/] {exported.stderr.strip()}")
        return False
    console.print(exported.stdout.strip(), highlight=False)
    loaded = subprocess.run(
        [sys.executable, "-c", FILL_MASK, str(out)], env=ENV, capture_output=True, text=True, check=False
    )
    if loaded.returncode != 0:
        console.print(f"[red]from_pretrained failed:[/] {loaded.stderr.strip()[-800:]}")
        return False
    console.print(f"loaded with from_pretrained: {loaded.stdout.strip()}", highlight=False)
    return True


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise Stop(signal.Signals(signum).name)


def diloco_manifest(recipe: str) -> str:
    """The recipe in the DiLoCo mode: rounds of ``DILOCO_ROUND`` target batches, 8-bit pseudo-gradients."""
    match = re.search(r"^target_batch = (\d+)$", recipe, flags=re.MULTILINE)
    if match is None or re.search(r"^(codec|\[sync\])", recipe, flags=re.MULTILINE):
        raise SystemExit("this recipe cannot be switched to --sync diloco (no top-level target_batch)")
    round_samples = DILOCO_ROUND * int(match.group(1))
    switched = recipe.replace(
        match.group(0),
        f"target_batch = {round_samples}  # diloco: samples per round, all volunteers' inner steps\n"
        'codec = "int8-blockwise"  # pseudo-gradients 8-bit, with error feedback',
    )
    # a round is many target batches: checkpoint every other round (the recipe's count is in batches)
    switched = re.sub(r"^checkpoint_every = \d+$", "checkpoint_every = 2", switched, flags=re.MULTILINE)
    return switched + '\n[sync]\nmode = "diloco"\n'


def swarm_manifest(recipe: str) -> str:
    """The tiny-mlm recipe in the swarm mode: its model with :data:`SWARM_STAGES` layers split into as many
    pipeline stages, rebalanced every :data:`SWARM_PERIOD` seconds."""
    if not re.search(r'^task = "tiny-mlm"$', recipe, flags=re.MULTILINE) or re.search(
        r"^\[(sync|task_options)\]", recipe, flags=re.MULTILINE
    ):
        raise SystemExit("--sync swarm runs the tiny-mlm recipe (its model is split into stages here)")
    switched = re.sub(
        r"^target_batch = \d+$", "target_batch = 64  # swarm: each stage steps every 64 samples", recipe,
        flags=re.MULTILINE,
    )  # fmt: skip
    return (
        switched
        + f"\n[task_options]\nlayers = {SWARM_STAGES}  # one transformer block per stage\n"
        + f'\n[sync]\nmode = "swarm"\nstages = {SWARM_STAGES}\nrebalance_period = {SWARM_PERIOD:g}\n'
        + f"formation_window = {SWARM_FORMATION:g}  # links measured, scheduler places\n"
    )


def prepare_work_dir(given: Path | None) -> Path:
    if given is None:
        return Path(tempfile.mkdtemp(prefix="dedloc-demo-"))
    if given.exists() and any(given.iterdir()):
        raise SystemExit(f"--work-dir {given} is not empty; give a new or empty directory")
    given.mkdir(parents=True, exist_ok=True)
    return given.resolve()


def main() -> int:
    parser = argparse.ArgumentParser(
        description="A backbone and N volunteers train a model on loopback, then print the ledger."
    )
    parser.add_argument("--seconds", type=float, default=180.0, help="how long to train (default 180)")
    recipes = sorted(p.stem for p in RECIPES.glob("*.toml"))
    parser.add_argument(
        "--recipe",
        default="tiny-mlm",
        choices=recipes,
        help="the run's manifest, from deploy/recipes (default tiny-mlm; albert-tiny: a Hugging Face "
        "ALBERT with a tokenizer the backbone trains)",
    )
    parser.add_argument(
        "--volunteers",
        type=int,
        help="how many volunteers (default 3; 4 with --sync swarm: one per stage and one more)",
    )
    parser.add_argument(
        "--sync",
        choices=("batch", "diloco", "swarm"),
        default="batch",
        help="batch: one optimizer step per global batch (default); diloco: local inner steps, "
        f"pseudo-gradients averaged every {DILOCO_ROUND} target batches; swarm: the model in "
        f"{SWARM_STAGES} pipeline stages served by the volunteers, one leaving half-way",
    )
    parser.add_argument(
        "--until-step",
        type=int,
        help="stop as soon as the ledger recorded this step (at most --seconds): as much training on a "
        "busy machine as on a quiet one",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="an empty dir for data and logs (default: a fresh temp dir)"
    )
    args = parser.parse_args()
    if args.volunteers is None:
        args.volunteers = SWARM_STAGES + 1 if args.sync == "swarm" else 3
    if args.volunteers < 1 or args.seconds <= 0:
        parser.error("--volunteers must be at least 1 and --seconds positive")
    if args.sync == "swarm" and args.volunteers <= SWARM_STAGES:
        parser.error(
            f"--sync swarm needs more than {SWARM_STAGES} volunteers (a server per stage, one leaves)"
        )
    if args.until_step is not None and args.until_step < 1:
        parser.error("--until-step must be at least 1")
    began = time.monotonic()
    swarm_run = args.sync == "swarm"
    work = prepare_work_dir(args.work_dir)
    manifest = work / "manifest.toml"
    recipe = (RECIPES / f"{args.recipe}.toml").read_text()
    switch = {"diloco": diloco_manifest, "swarm": swarm_manifest}.get(args.sync)
    manifest.write_text(switch(recipe) if switch is not None else recipe)
    console.print(f"work dir (data dirs, manifest, one log per process): {work}")
    signal.signal(signal.SIGTERM, _raise_stop)

    backbone: Node | None = None
    volunteers: list[Node] = []
    codes: dict[str, int | None] = {}
    ok = True
    try:
        backbone, address, run_id = start_backbone(work, manifest)
        console.print(
            f"backbone up: run id [bold]{run_id}[/] (pinned to its authority key), ledger in SQLite"
        )
        names = [f"volunteer{i}" for i in range(1, args.volunteers + 1)]
        codes_by_name = {name: invite(backbone, name) for name in names}
        console.print(f"invited {', '.join(names)} with `backbone allow add`; each joins with its code")
        volunteers = [start_volunteer(work, n, run_id, address, code) for n, code in codes_by_name.items()]
        console.print(
            "step, loss (of its own batches) and samples/s: each volunteer's steps.jsonl; peers: in its "
            "last averaging round; conns: open connections (its status.json)"
            + (
                "; stage: * placed by the scheduler as the run formed, (←k) moved from stage k"
                if swarm_run
                else ""
            ),
            highlight=False,
        )
        watch(volunteers, backbone, args.seconds, args.until_step, swarm=swarm_run)
    except (KeyboardInterrupt, Stop):
        console.print("interrupted: stopping now")
    except SystemExit as exc:
        console.print(f"[red]{exc}[/]")
        ok = False
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl+C must not leave orphans
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if volunteers:
            console.print("SIGTERM to every volunteer: each finishes its round, sends its reports, leaves")
            codes = stop(volunteers, VOLUNTEER_EXIT_S)
            show_codes(codes)
    if backbone is not None and backbone.proc.poll() is None:
        # Not on a terminal (a log, CI): wide enough that the tables need not abbreviate.
        env = ENV if console.is_terminal else {**ENV, "COLUMNS": "120"}
        for extra in ([], ["--steps", "--last", "10"]):
            argv = cli("backbone", "ledger", "--data-dir", str(backbone.data), *extra)
            subprocess.run(argv, env=env, check=False)
    if backbone is not None:
        console.print("stopping the backbone")
        backbone_code = stop([backbone], BACKBONE_EXIT_S)
        show_codes(backbone_code)
        codes |= backbone_code
    ok = ok and bool(codes) and all(code == 0 for code in codes.values())
    if ok and backbone is not None and '"hf-' in manifest.read_text():
        ok = export_and_load(backbone, work / "hf-export")
    console.print(f"logs: {work}/<node>.log; total time {time.monotonic() - began:.0f} s")
    console.print("[green]every node left cleanly[/]" if ok else "[red]some node failed; see its log[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
