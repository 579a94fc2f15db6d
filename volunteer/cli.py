"""``volunteer``: donate this machine to a collaborative training run.

Importing this module stays cheap (typer, rich, trio): ``volunteer --help`` and a mistyped flag answer at
once. The daemon (torch, datasets, the network stack) is imported by ``join`` only once its flags are checked;
``tests/system/test_cli_help.py`` holds this module to that.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Annotated

import trio
import typer
import typer.main
from rich.console import Console

from shared.console import (
    default_data_dir,
    fail,
    locked_data_dir,
    project_version,
    run_service,
    setup_logging,
    shown_path,
    validate_run_id,
)
from shared.errors import ConfigError
from shared.extras import role_installed
from shared.lifecycle import Shutdown

from .config import CONFIG_NAME, join_defaults
from .precision import PRECISIONS

__all__ = ["app", "main"]

HELP = """Donate this machine's GPU or CPU and bandwidth to a collaborative training run.

Ask the run's organizers for its run id and an invite code, then join it:

\b
    volunteer join my-run@4fT9… --invite dli1_…
    volunteer join my-run@4fT9…    # later joins need no invite

Ctrl+C leaves the run cleanly; what this machine contributed stays credited."""

app = typer.Typer(
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's plain layout: help text gets the width of the terminal, paragraphs are reflowed and
    # nothing is truncated (Rich's boxed tables squeeze the help column at 80 columns).
    rich_markup_mode=None,
)

_DATA_DIR = default_data_dir("volunteer")


def _print_version(wanted: bool) -> None:
    if wanted:
        print(f"volunteer (dedloc) {project_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    # A callback keeps `join` a subcommand: `volunteer join RUN_ID`, not `volunteer RUN_ID`.
    del version  # its callback answers it


@app.command()
def join(
    data_dir: Annotated[
        Path,
        typer.Option(
            "--data-dir",
            metavar="DIR",
            default_factory=lambda: default_data_dir("volunteer"),
            show_default=False,
            help="This machine's identity, its credential for the run and its training state "
            f"(one running volunteer per data dir).  [default: {shown_path(_DATA_DIR)}]",
        ),
    ],
    run_id: Annotated[
        str | None,
        typer.Argument(
            metavar="RUN_ID",
            help="The run's id as its organizers published it, e.g. my-run@4fT9… (the part after @ "
            "pins the run's key, so nobody else can pose as the run). Default: the invite's run, or "
            "the run this data dir joined before.",
            show_default=False,
        ),
    ] = None,
    invite: Annotated[
        str | None,
        typer.Option(
            "--invite",
            metavar="CODE",
            envvar="VOLUNTEER_INVITE",
            help="Invite code from the run's organizers. Needed the first time this data dir joins a "
            "pinned run; later joins reuse the credential it earned.",
        ),
    ] = None,
    initial_peer: Annotated[
        list[str] | None,
        typer.Option(
            "--initial-peer",
            metavar="MADDR",
            help="Join through this node of the run, e.g. /ip4/203.0.113.7/tcp/4001/p2p/12D3KooW… as "
            "`backbone start` printed it (repeatable). Default: the nodes the run's backbones list, "
            "else a backbone found on the local network (mDNS).",
        ),
    ] = None,
    listen: Annotated[
        list[str] | None,
        typer.Option(
            "--listen",
            metavar="MADDR",
            help="Accept other peers' connections on this address (repeatable).  "
            "[default: /ip4/0.0.0.0/tcp/0, any interface and a free port]",
        ),
    ] = None,
    discovery_wait: Annotated[
        float,
        typer.Option(
            "--discovery-wait",
            metavar="SECONDS",
            help="How long to look for the run's backbones on the local network (when no node is known).",
        ),
    ] = 3.0,
    device: Annotated[
        str,
        typer.Option(
            "--device",
            metavar="DEVICE",
            help="Where to train: auto (a CUDA GPU if torch finds one, else Apple's MPS, else the CPU), "
            "cpu, cuda, cuda:1, mps.",
        ),
    ] = "auto",
    precision: Annotated[
        str,
        typer.Option(
            "--precision",
            metavar="PRECISION",
            help="What the model computes in: auto (bf16 on GPUs that have it, fp16 with loss scaling on "
            "older ones, fp32 on the CPU and MPS), fp32, bf16 or fp16. Parameters and averaging stay fp32.",
        ),
    ] = "auto",
    micro_batch: Annotated[
        int,
        typer.Option(
            "--micro-batch",
            metavar="N",
            help="Samples per forward/backward pass (at most the run's target batch). 0: the largest that "
            "fits the GPU's memory, found at warm-up (the run's own size on a CPU).",
        ),
    ] = 0,
    threads: Annotated[
        int,
        typer.Option(
            "--threads", metavar="N", help="CPU threads torch may use (0: torch's default, all cores)."
        ),
    ] = 0,
    evaluate: Annotated[
        bool,
        typer.Option(
            "--evaluate",
            help="Also compute the held-out loss of the run's parameters every N steps and publish it "
            "(signed) to the run's ledger.",
        ),
    ] = False,
    evaluate_every: Annotated[
        int | None,
        typer.Option(
            "--evaluate-every",
            metavar="N",
            min=1,
            help="Evaluate every N-th step (implies --evaluate).  [default: the run's dataset.eval_every]",
        ),
    ] = None,
    manifest: Annotated[
        Path | None,
        typer.Option(
            "--manifest",
            metavar="FILE",
            help="Training spec (TOML or JSON: task, batch size, optimizer, dataset) for an open run. "
            "A pinned run's backbones serve theirs.",
        ),
    ] = None,
    panel: Annotated[
        bool | None,
        typer.Option(
            "--panel/--no-panel",
            show_default=False,
            help="Show a live panel of the run, or log plain lines.  [default: a panel on a terminal]",
        ),
    ] = None,
    aux: Annotated[
        bool,
        typer.Option(
            "--aux",
            help="Do not train: take slices of the others' gradient averaging (no GPU needed), so that "
            "volunteers behind NAT average through this machine. It must be reachable from the run.",
        ),
    ] = False,
    swarm_role: Annotated[
        str,
        typer.Option(
            "--swarm-role",
            metavar="ROLE",
            help='In a swarm run ([sync] mode = "swarm": the model split into pipeline stages): server '
            "(serve the stage that needs it most), trainer (carry micro-batches of data through the "
            "stages' servers; any machine, no GPU needed) or auto (both). Ignored in other runs.",
        ),
    ] = "auto",
    trainers: Annotated[
        int,
        typer.Option(
            "--trainers",
            metavar="N",
            help="In a swarm run: how many micro-batches this machine carries through the stages at once.",
        ),
    ] = 1,
    idle_only_after: Annotated[
        float | None,
        typer.Option(
            "--idle-only-after",
            metavar="MINUTES",
            help="Train only after nobody used the keyboard, mouse or a terminal for MINUTES (where this "
            "system tells; elsewhere the rule is reported and ignored).",
        ),
    ] = None,
    max_other_cpu: Annotated[
        float | None,
        typer.Option(
            "--max-other-cpu",
            metavar="PERCENT",
            help="Pause while other programs use more than PERCENT of all CPUs.",
        ),
    ] = None,
    pause_while: Annotated[
        list[str] | None,
        typer.Option(
            "--pause-while",
            metavar="NAME",
            help="Pause while a program of this name runs, e.g. steam (repeatable).",
        ),
    ] = None,
    active_hours: Annotated[
        str | None,
        typer.Option(
            "--active-hours",
            metavar="HH:MM-HH:MM",
            help="Train only in this daily window of local time, e.g. 22:00-07:00 (wraps midnight).",
        ),
    ] = None,
    gpu_memory_fraction: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory-fraction",
            metavar="F",
            help="Use at most this share (0 to 1) of the GPU's memory; the micro-batch is fitted to it.",
        ),
    ] = None,
    max_upload: Annotated[
        float | None,
        typer.Option(
            "--max-upload",
            metavar="MBPS",
            help="Send at most MBPS MB/s (10^6 bytes/s), all of this volunteer's traffic together; the run "
            "is told, and gives it a share it can carry.",
        ),
    ] = None,
    max_download: Annotated[
        float | None,
        typer.Option(
            "--max-download", metavar="MBPS", help="Receive at most MBPS MB/s (10^6 bytes/s), likewise."
        ),
    ] = None,
    relay: Annotated[
        bool,
        typer.Option(
            "--relay",
            help="Also offer a few relay slots, so that volunteers behind NAT become reachable through this "
            "machine. Takes effect only if a backbone can dial this machine directly (see --listen).",
        ),
    ] = False,
    metrics_listen: Annotated[
        str | None,
        typer.Option(
            "--metrics-listen",
            metavar="HOST:PORT",
            help="Serve Prometheus metrics (step, samples, averaging rounds, traffic, peers, reachability, "
            "paused) at http://HOST:PORT/metrics. A bare PORT means 127.0.0.1:PORT; a host other than "
            "loopback is served only when given, and lets other machines read them.  [default: off]",
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            metavar="FILE",
            show_default=False,
            help="Read flags from this TOML file (keys: the long flags without dashes, e.g. "
            "micro-batch = 8; run-id for RUN_ID). Environment variables VOLUNTEER_<KEY> override it, the "
            f"command line overrides both.  [default: {CONFIG_NAME} in the data dir, if there]",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log debug messages too.")] = False,
) -> None:
    """Join a training run and train with its other peers until Ctrl+C.

    Finds the run, gets admitted (with --invite the first time), downloads the model's current state and
    trains it together with the run's other peers, showing a live panel. Ctrl+C or SIGTERM leaves cleanly;
    at the run's step limit it hands its final state to a backbone and exits. `volunteer pause`, `resume`
    and `status` control it while it runs; the --idle-only-after, --max-other-cpu, --pause-while and
    --active-hours rules pause and resume it by themselves; --max-upload and --max-download cap its
    bandwidth at all times.

    Exit codes: 0 on a clean stop; 1 when the run refused this machine or the network failed; 2 on unusable
    input (flags, data dir).
    """
    del config  # read before parsing (main): its values are the defaults of the flags above
    setup_logging(verbose)
    console = Console()

    async def body(shutdown: Shutdown) -> None:
        from shared.net.addresses import parse_multiaddr

        from .admission import run_to_join

        run = validate_run_id(run_to_join(run_id, invite, data_dir))
        listen_addrs = listen or ["/ip4/0.0.0.0/tcp/0"]
        for text in [*listen_addrs, *(initial_peer or [])]:
            parse_multiaddr(text)
        if not (math.isfinite(discovery_wait) and discovery_wait > 0):
            raise ConfigError(f"--discovery-wait must be a positive number of seconds, got {discovery_wait}")
        if precision.strip().lower() not in PRECISIONS:
            raise ConfigError(f"--precision {precision!r}: use auto, fp32, bf16 or fp16")
        if not 0 <= micro_batch <= 2**20:
            raise ConfigError(f"--micro-batch {micro_batch}: give a number of samples, 1 to 2**20, or 0")
        if swarm_role not in ("auto", "server", "trainer"):
            raise ConfigError(f"--swarm-role {swarm_role!r}: use server, trainer or auto")
        if not 1 <= trainers <= 64:
            raise ConfigError(f"--trainers {trainers}: give 1 to 64 micro-batches in flight")
        cpus = os.cpu_count() or 1
        if not 0 <= threads <= cpus:
            raise ConfigError(
                f"--threads {threads}: give 1 to {cpus} (this machine's CPUs), or 0 for torch's default"
            )
        from .policy import bandwidth_caps, rules_from_flags

        rules = rules_from_flags(idle_only_after, max_other_cpu, pause_while, active_hours)
        max_upload_bps, max_download_bps = bandwidth_caps(max_upload, max_download)
        if gpu_memory_fraction is not None and not 0 < gpu_memory_fraction <= 1:
            raise ConfigError(
                f"--gpu-memory-fraction {gpu_memory_fraction:g}: give a share above 0, at most 1"
            )
        from shared.metrics_server import parse_listen

        metrics_at = None if metrics_listen is None else parse_listen(metrics_listen)
        if manifest is not None:
            from shared.manifest import load_training_spec

            load_training_spec(manifest)  # a spec no volunteer can train fails now, not after admission
        # Before the data dir, the invite or the network: a device this machine lacks fails here, in one line.
        from .capabilities import choose_device, choose_precision  # torch: only once the flags are usable
        from .daemon import VolunteerOptions, serve_volunteer

        chosen, computes_in = "auto", "auto"
        if not aux:  # an auxiliary peer computes nothing: it needs no device
            chosen = await trio.to_thread.run_sync(choose_device, device)
            computes_in = await trio.to_thread.run_sync(choose_precision, precision, chosen)
        with locked_data_dir(data_dir):
            options = VolunteerOptions(
                run,
                data_dir,
                listen_addrs,
                initial_peer or [],
                discovery_wait,
                console.is_terminal if panel is None else panel,
                invite=invite,
                manifest=manifest,
                device=chosen,
                threads=threads,
                precision=computes_in,
                micro_batch=micro_batch,
                evaluate=evaluate or evaluate_every is not None,
                evaluate_every=evaluate_every,
                aux=aux,
                rules=rules,
                gpu_memory_fraction=gpu_memory_fraction,
                relay=relay,
                metrics_listen=metrics_at,
                max_upload_bps=max_upload_bps,
                max_download_bps=max_download_bps,
                swarm_role=swarm_role,
                trainers=trainers,
            )
            await serve_volunteer(options, shutdown, console)

    run_service(body)


_CONTROL_DATA_DIR = typer.Option(
    "--data-dir",
    metavar="DIR",
    envvar="VOLUNTEER_DATA_DIR",
    default_factory=lambda: default_data_dir("volunteer"),
    show_default=False,
    help=f"The data dir of the running volunteer.  [default: {shown_path(_DATA_DIR)}]",
)


def _control(data_dir: Path, command: str) -> dict[str, object]:
    from .control import ControlError, request

    try:
        return request(data_dir, command)
    except ControlError as exc:
        fail(str(exc), 1)
        raise  # not reached: fail exits


def _describe(reply: dict[str, object]) -> str:
    state = "paused" if reply.get("paused") else str(reply.get("state", "?"))
    why = f": {reply.get('reason')}" if reply.get("paused") else ""
    doing = f" ({reply['doing']})" if reply.get("doing") and not reply.get("paused") else ""
    step = reply.get("step")
    return (
        f"{state}{why}{doing}\n"
        f"step {'-' if step is None else step}, {reply.get('peers_online', 0)} peers online, "
        f"{reply.get('connected', 0)} connected\n"
        f"peer {reply.get('peer_id', '?')} in run {reply.get('run_id', '?')} (pid {reply.get('pid', '?')})"
    )


@app.command()
def pause(data_dir: Annotated[Path, _CONTROL_DATA_DIR]) -> None:
    """Pause training; stay in the run.

    The running volunteer leaves the current round cleanly and stops training, but keeps its place in
    the run (same peer id, credit kept) until `volunteer resume`. Exit 1 if no volunteer runs there."""
    reply = _control(data_dir, "pause")
    print(_describe(reply).splitlines()[0])


@app.command()
def resume(data_dir: Annotated[Path, _CONTROL_DATA_DIR]) -> None:
    """Train again after `volunteer pause`.

    The volunteer re-syncs the run's state from its peers and trains again, unless one of its rules
    (--idle-only-after, --pause-while, ...) still holds it: `volunteer status` says why. Exit 1 if no
    volunteer runs there."""
    reply = _control(data_dir, "resume")
    print(_describe(reply).splitlines()[0])


@app.command()
def status(
    data_dir: Annotated[Path, _CONTROL_DATA_DIR],
    as_json: Annotated[bool, typer.Option("--json", help="Print the daemon's reply as JSON.")] = False,
) -> None:
    """Show whether the volunteer trains or why not.

    Training or paused (and why), its step, its peers, its peer id. Exit 1 if no volunteer runs there."""
    reply = _control(data_dir, "status")
    if as_json:
        import json

        print(json.dumps(reply, indent=2))
    else:
        print(_describe(reply))


def main() -> None:
    with role_installed("volunteer"):  # pip install dedloc without [volunteer]: one line, exit 2
        group = typer.main.get_command(app)
        argv = sys.argv[1:]
        defaults: dict[str, object] = {}
        if "join" in argv:  # the config file and VOLUNTEER_* variables hold join's flags
            try:
                defaults = join_defaults(group.commands["join"], argv, os.environ)  # type: ignore[attr-defined]
            except ConfigError as exc:
                print(f"volunteer join: {exc}", file=sys.stderr)
                raise SystemExit(2) from exc
        group(args=argv, prog_name="volunteer", default_map={"join": defaults})
