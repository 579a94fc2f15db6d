"""``backbone``: run and administer backbone nodes of a training run."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

import msgspec
import typer
from rich import box
from rich.console import Console
from rich.table import Table

from protocols.api import Invite, encode_invite
from protocols.training import TrainingSpec
from shared.console import fail, locked_data_dir, run_service, setup_logging, validate_run_id
from shared.errors import ConfigError, ProjectError
from shared.lifecycle import Shutdown
from shared.manifest import load_training_spec
from shared.net.addresses import parse_multiaddr

from .export import export_checkpoint
from .ledger import LedgerStore, StepRow
from .runinfo import RunInfo, read_run_info
from .service import CHECKPOINTS_DIR, BackboneOptions, serve_backbone

__all__ = ["LossPoint", "app", "loss_curve", "main", "sparkline"]

HELP = "Backbone nodes keep a training run's DHT alive, admit its volunteers and credit their work."
app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
allow_app = typer.Typer(
    help="Manage who may join the run (works whether or not the backbone runs).", no_args_is_help=True
)
app.add_typer(allow_app, name="allow")
out = Console()

DataDir = Annotated[
    Path, typer.Option("--data-dir", help="The backbone's data dir (identity, keys, ledger).")
]
DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", help="postgresql+psycopg://… (default: SQLite in the data dir)."),
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


@app.callback()
def _root() -> None:
    """Backbone nodes keep a training run's DHT alive, admit its volunteers and credit their work."""


@app.command()
def start(
    run_id: Annotated[str, typer.Option("--run-id", help="The run's name (or name@fingerprint).")],
    data_dir: DataDir,
    listen: Annotated[
        list[str] | None,
        typer.Option(
            "--listen", metavar="MADDR", help="Listen here (repeatable). Default /ip4/0.0.0.0/tcp/0."
        ),
    ] = None,
    initial_peer: Annotated[
        list[str] | None,
        typer.Option(
            "--initial-peer", metavar="MADDR", help="Join the run's DHT through this node (repeatable)."
        ),
    ] = None,
    mdns: Annotated[bool, typer.Option("--mdns/--no-mdns", help="Advertise the run on the LAN.")] = True,
    open_run: Annotated[
        bool, typer.Option("--open", help="An open run: no authority, no admission (local experiments).")
    ] = False,
    authority_key: Annotated[
        Path | None,
        typer.Option("--authority-key", help="The run's authority key (shared by its backbones)."),
    ] = None,
    database_url: DatabaseUrl = None,
    api_listen: Annotated[
        str, typer.Option("--api-listen", help="HOST:PORT of the HTTPS API.")
    ] = "0.0.0.0:0",
    public_url: Annotated[
        list[str] | None, typer.Option("--public-url", help="API URL volunteers should use (repeatable).")
    ] = None,
    manifest: Annotated[
        Path | None,
        typer.Option(
            "--manifest",
            help="TOML/JSON file: the task, target batch, optimizer, dataset… (default: the built-in task).",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Start a backbone node. Prints `listening on <multiaddr>` per address, then (pinned runs) the run id
    and the API URLs, and runs until stopped."""
    setup_logging(verbose)

    async def body(shutdown: Shutdown) -> None:
        validate_run_id(run_id)
        listen_addrs = listen or ["/ip4/0.0.0.0/tcp/0"]
        for text in [*listen_addrs, *(initial_peer or [])]:
            parse_multiaddr(text)
        training = load_training_spec(manifest) if manifest is not None else TrainingSpec()
        with locked_data_dir(data_dir):
            options = BackboneOptions(
                run_id,
                data_dir,
                listen_addrs,
                initial_peer or [],
                mdns,
                open_run,
                authority_key,
                database_url,
                api_listen,
                public_url or [],
                training,
            )
            await serve_backbone(options, shutdown)

    run_service(body)


@contextlib.contextmanager
def _ledger(data_dir: Path, database_url: str | None) -> Iterator[LedgerStore]:
    if not data_dir.is_dir():
        fail(f"{data_dir} is not a backbone data dir", 2)
    try:
        store = LedgerStore.open(database_url or f"sqlite:///{data_dir / 'ledger.sqlite3'}")
    except ProjectError as exc:
        fail(str(exc), 2)
    try:
        yield store
    except ConfigError as exc:
        fail(str(exc), 2)
    except ProjectError as exc:
        fail(str(exc), 1)
    finally:
        store.close()


def _when(ts: float | None) -> str:
    return "—" if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


@allow_app.command("add")
def allow_add(
    username: str,
    data_dir: DataDir,
    note: Annotated[str | None, typer.Option("--note", help="Who this is, for your records.")] = None,
    expires_in_days: Annotated[float | None, typer.Option("--expires-in-days", help="Invite expiry.")] = None,
    database_url: DatabaseUrl = None,
    as_json: Json = False,
) -> None:
    """Allow USER and print an invite code; every machine that redeems it becomes a peer of USER."""
    info = _run_info(data_dir)
    with _ledger(data_dir, database_url) as store:
        now = time.time()
        store.add_user(username, note=note, now=now)
        expires = now + expires_in_days * 86400 if expires_in_days else None
        secret = store.create_invite(username, now=now, expires_at=expires)
    code = encode_invite(Invite(info.run_id, info.api, secret))
    if as_json:
        print(msgspec.json.encode({"username": username, "invite": code, "expires_at": expires}).decode())
    else:
        out.print(f"invite for [bold]{username}[/] (shown once; keep it secret):", highlight=False)
        print(code)
        out.print(f"they join with:  volunteer join {info.run_id} --invite <code>", highlight=False)


@allow_app.command("remove")
def allow_remove(
    username: str, data_dir: DataDir, database_url: DatabaseUrl = None, as_json: Json = False
) -> None:
    """Remove USER: its peers are cut off within seconds (a running backbone publishes the revocation)."""
    with _ledger(data_dir, database_url) as store:
        removed = store.remove_user(username, now=time.time())
    if as_json:
        print(msgspec.json.encode({"username": username, "removed": removed}).decode())
    elif removed:
        out.print(f"removed {username}; a running backbone revokes its peers within seconds", highlight=False)
    else:
        fail(f"no active user {username!r}", 1)


@allow_app.command("list")
def allow_list(data_dir: DataDir, database_url: DatabaseUrl = None, as_json: Json = False) -> None:
    """List allowed and removed users, their peers and when each was last seen."""
    with _ledger(data_dir, database_url) as store:
        users = store.list_users()
    if as_json:
        print(msgspec.json.encode(users).decode())
        return
    table = Table(title="allowlist")
    for column in ("user", "note", "added", "removed", "peers", "last seen"):
        table.add_column(column)
    for user in users:
        seen = max((p.last_seen for p in user.peers), default=None)
        table.add_row(
            user.username,
            user.note or "",
            _when(user.created_at),
            _when(user.revoked_at),
            "\n".join(p.peer_id for p in user.peers) or "—",
            _when(seen),
        )
    out.print(table)


#: ``backbone ledger --steps`` lists this many steps unless ``--last`` says otherwise.
DEFAULT_LAST_STEPS = 20
#: How many flagged reports ``--flags`` lists (the newest).
FLAGS_SHOWN = 1000


@app.command()
def ledger(
    data_dir: DataDir,
    database_url: DatabaseUrl = None,
    steps: Annotated[
        bool,
        typer.Option(
            "--steps", help="Instead of the leaderboard: the run's last global steps and its loss curve."
        ),
    ] = False,
    last: Annotated[
        int | None,
        typer.Option(
            "--last",
            metavar="N",
            min=1,
            help=f"List the last N steps (implies --steps; default {DEFAULT_LAST_STEPS}).",
        ),
    ] = None,
    flags: Annotated[
        bool,
        typer.Option("--flags", help="Instead of the leaderboard: every flagged report and why."),
    ] = False,
    as_json: Json = False,
) -> None:
    """The contribution leaderboard per user: samples, compute time, time online and bytes aggregated, as
    backed by receipts of other users' peers, and how many reports were flagged and why (rule codes).
    With `--steps`: the run's last global steps (finished at, loss, batch against the target, peers) and
    its loss curve. With `--flags`: each flagged report, the rules it broke and the details."""
    if (steps or last is not None) and flags:
        fail("--steps (or --last) and --flags are two views: give one of them", 2)
    if steps or last is not None:
        _ledger_steps(data_dir, database_url, last or DEFAULT_LAST_STEPS, as_json)
        return
    if flags:
        _ledger_flags(data_dir, database_url, as_json)
        return
    with _ledger(data_dir, database_url) as store:
        rows = store.leaderboard()
    if as_json:
        print(msgspec.json.encode(rows).decode())
        return
    relaying = any(row.bytes_relayed for row in rows)  # no relay role yet: only legacy rows have any
    table = Table(title="contributions", box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    columns = ["user", "samples", "compute", "online", "aggregated"]
    columns += ["relayed"] if relaying else []
    columns += ["peers", "last seen", "flagged"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("user", "last seen") else "right", no_wrap=True)
    for row in rows:
        cells = [
            row.username,
            f"{row.samples:,}",
            _duration(row.compute_hours * 3600),
            _duration(row.online_hours * 3600),
            _size(row.bytes_aggregated),
        ]
        cells += [_size(row.bytes_relayed)] if relaying else []
        cells += [str(row.peers), _short_when(row.last_seen), str(row.flagged_reports)]
        table.add_row(*cells)
    out.print(table)
    for row in rows:
        if row.flagged_reports:
            why = ", ".join(f"{code} {count}" for code, count in row.flag_reasons.items())
            out.print(
                f"flagged reports of {row.username}: {row.flagged_reports} ({why})",
                highlight=False,
                soft_wrap=True,
            )
        if row.discarded_samples:
            out.print(
                f"{row.username}: {row.discarded_samples:,} samples on steps a re-sync discarded "
                "(shown, not credited)",
                highlight=False,
                soft_wrap=True,
            )
    out.print(
        "credit counts only work that receipts of other users' peers back; compute: time spent computing "
        "gradients; online: time in the run",
        highlight=False,
    )
    if any(row.flagged_reports for row in rows):
        out.print(
            f"each flagged report and why: backbone ledger --data-dir {data_dir} --flags",
            highlight=False,
            soft_wrap=True,
        )


def _short_when(ts: float | None) -> str:
    return "—" if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime("%m-%d %H:%M")


def _duration(seconds: float) -> str:
    """A human time: ``—`` for none, seconds below a minute, minutes below an hour, then hours."""
    if seconds <= 0:
        return "—"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _size(nbytes: float) -> str:
    """Bytes in the largest decimal unit that keeps a digit before the point (``—`` for none)."""
    if nbytes <= 0:
        return "—"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _ledger_flags(data_dir: Path, database_url: str | None, as_json: bool) -> None:
    with _ledger(data_dir, database_url) as store:
        flagged = store.flagged_reports(limit=FLAGS_SHOWN)
    if as_json:
        print(msgspec.json.encode(flagged).decode())
        return
    if not flagged:
        out.print("no report was flagged", highlight=False)
        return
    out.print(f"flagged reports (the newest {len(flagged)} first):", highlight=False)
    for report in flagged:
        out.print(
            f"{report.username}  peer …{report.peer_id[-8:]}  report {report.seq}  received "
            f"{_when(report.received_at)}  {report.samples:,} samples in "
            f"{report.interval_end - report.interval_start:,.0f} s",
            highlight=False,
            soft_wrap=True,
        )
        for part in report.reason.split("; "):
            out.print(f"    {part}", highlight=False, soft_wrap=True)
    out.print(
        "a flagged report is kept as evidence and credited nothing; the rules are in "
        "backbone/ledger/accounting.py",
        highlight=False,
    )


#: The loss curve covers at most this many of the run's latest steps (one query, a few MB at most).
CURVE_STEPS = 100_000
CURVE_POINTS = 8
SPARKLINE_WIDTH = 48
_SPARKS = "▁▂▃▄▅▆▇█"
_SEEN_BY = {"tracker": "backbone", "receipts": "receipts", "legacy": "backbone (old)"}


@dataclass(frozen=True)
class LossPoint:
    """The mean loss of the steps ``first_step`` to ``last_step`` (those with a known loss)."""

    first_step: int
    last_step: int
    loss: float


def loss_curve(steps: Sequence[StepRow], points: int) -> list[LossPoint]:
    """The loss of ``steps`` (any order) as ``points`` (or fewer) evenly spaced buckets, oldest first.

    Steps without a loss (jumped over, or not finite) are left out; the rest are split by step order into
    ``min(points, len(known))`` consecutive buckets whose sizes differ by at most one, and each bucket's
    mean loss is one point: means, not single steps, because one step's loss is one batch's and noisy.
    """
    if points < 1:
        raise ValueError(f"a loss curve needs at least one point, got {points}")
    known = sorted((s for s in steps if s.loss is not None), key=lambda s: s.global_step)
    count = min(points, len(known))
    curve = []
    for i in range(count):
        bucket = known[i * len(known) // count : (i + 1) * len(known) // count]
        losses = [s.loss for s in bucket if s.loss is not None]
        curve.append(LossPoint(bucket[0].global_step, bucket[-1].global_step, sum(losses) / len(losses)))
    return curve


def sparkline(values: Sequence[float]) -> str:
    """One block character per value, its height scaled between the smallest and largest value."""
    if not values:
        return ""
    low, high = min(values), max(values)
    if high == low:
        return _SPARKS[len(_SPARKS) // 2] * len(values)
    top = len(_SPARKS) - 1
    return "".join(_SPARKS[round((v - low) / (high - low) * top)] for v in values)


def _ledger_steps(data_dir: Path, database_url: str | None, last: int, as_json: bool) -> None:
    limit = max(last, CURVE_STEPS)
    with _ledger(data_dir, database_url) as store:
        rows = store.recent_steps(limit=limit)  # newest first
    recent = sorted(rows[:last], key=lambda r: r.global_step)
    curve = loss_curve(rows, CURVE_POINTS)
    batches = [r.samples for r in recent if r.samples > 0]
    median = statistics.median(batches) if batches else None
    targets = [r.target_batch for r in recent if r.target_batch is not None]
    target = targets[-1] if targets else None
    if as_json:
        summary = {"median_batch": median, "target_batch": target, "curve_steps": len(rows)}
        print(msgspec.json.encode({"steps": recent, "curve": curve, **summary}).decode())
        return
    recorded = str(len(rows)) if len(rows) < limit else f"at least {len(rows):,}"
    table = Table(title=f"global steps (the last {len(recent)} of {recorded} recorded)")
    for column in ("step", "finished at", "loss", "batch / target", "peers", "seen by"):
        table.add_column(column, justify="left" if column in ("finished at", "seen by") else "right")
    for row in recent:
        finished = datetime.fromtimestamp(row.finished_at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        loss = "—" if row.loss is None else f"{row.loss:.4f}"
        batch = f"{row.samples:,}" if row.samples > 0 else "—"
        if row.target_batch is not None:
            batch += f" / {row.target_batch:,}"
        table.add_row(str(row.global_step), finished, loss, batch, str(row.peers), _SEEN_BY[row.source])
    out.print(table)
    if median is not None:
        ratio = f" ({median / target:.2f}x)" if target else ""
        versus = f" / target {target:,}{ratio}" if target else ""
        out.print(f"median batch of these steps: {median:,.0f}{versus}", highlight=False)
    unseen = sum(r.source == "receipts" for r in recent)
    if unseen:
        out.print(
            f"{unseen} of these steps no backbone saw taken (it was down, or they passed within its 1 s "
            "poll): receipts of two users evidence them, so their batch is those receipts' sum and their "
            "loss is unknown",
            highlight=False,
        )
    if not curve:
        out.print("no step has a recorded loss yet", highlight=False)
        return
    known = sorted((r for r in rows if r.loss is not None), key=lambda r: r.global_step)
    fine = loss_curve(known, SPARKLINE_WIDTH)
    first, final = known[0], known[-1]
    out.print(
        f"loss curve, steps {first.global_step}-{final.global_step} (mean loss per span of steps):",
        highlight=False,
    )
    losses = [p.loss for p in fine]
    out.print(
        f"  {sparkline(losses)}  ({_SPARKS[0]} {min(losses):.2f}, {_SPARKS[-1]} {max(losses):.2f})",
        highlight=False,
    )
    for point in curve:
        out.print(
            f"  steps {point.first_step:>6}-{point.last_step:<6}  loss {point.loss:.4f}", highlight=False
        )
    out.print(
        f"loss at step {first.global_step}: {first.loss:.4f}; at step {final.global_step}: {final.loss:.4f}",
        highlight=False,
    )


@app.command()
def export(
    data_dir: DataDir,
    output: Annotated[Path, typer.Option("--output", "-o", help="The file to write.")],
    fmt: Annotated[
        str, typer.Option("--format", help="Output format (only `safetensors` for now).")
    ] = "safetensors",
    step: Annotated[
        int | None, typer.Option("--step", help="Export this step's checkpoint (default: the newest).")
    ] = None,
) -> None:
    """Write a stored checkpoint's model parameters to a file: tensors named as in the model (without the
    `model/` prefix), metadata with the step, run id and task."""
    if fmt != "safetensors":
        fail(f"--format {fmt!r} is not supported: only 'safetensors' is, for now", 2)
    try:
        written = export_checkpoint(data_dir / CHECKPOINTS_DIR, output, step)
    except ConfigError as exc:
        fail(str(exc), 2)
        raise
    print(written)


def _run_info(data_dir: Path) -> RunInfo:
    try:
        return read_run_info(data_dir)
    except ConfigError as exc:
        fail(str(exc), 2)
        raise


def main() -> None:
    app()
