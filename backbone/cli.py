"""``backbone``: run and administer backbone nodes of a training run."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

import msgspec
import typer
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
from .runinfo import RunInfo, check_held_run, read_run_info
from .service import CHECKPOINTS_DIR, BackboneOptions, serve_backbone
from .startup import (
    MAX_PUBLIC_URLS,
    check_authority_key,
    check_listen,
    check_public_url,
    parse_api_listen,
)

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
        # Every input is checked before the data dir is touched (see backbone.startup for the order).
        validate_run_id(run_id)
        listen_addrs = listen or ["/ip4/0.0.0.0/tcp/0"]
        for text in [*listen_addrs, *(initial_peer or [])]:
            parse_multiaddr(text)
        for text in listen_addrs:
            check_listen(parse_multiaddr(text), text)
        parse_api_listen(api_listen)
        if len(public_url or []) > MAX_PUBLIC_URLS:
            raise ConfigError(f"give at most {MAX_PUBLIC_URLS} --public-url: an invite carries that many")
        for url in public_url or []:
            check_public_url(url)
        check_authority_key(authority_key)
        training = load_training_spec(manifest) if manifest is not None else TrainingSpec()
        with locked_data_dir(data_dir):
            check_held_run(data_dir, run_id, open_run=open_run)
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


@app.command()
def ledger(
    data_dir: DataDir,
    database_url: DatabaseUrl = None,
    steps: Annotated[
        int | None,
        typer.Option(
            "--steps",
            metavar="N",
            min=1,
            help="Instead of the leaderboard: the last N global steps and the run's loss curve.",
        ),
    ] = None,
    as_json: Json = False,
) -> None:
    """The contribution leaderboard per user: samples, compute hours, bytes aggregated and relayed, peers,
    as backed by receipts of other users' peers, and how many reports were flagged and why (rule codes).
    With `--steps N`: the run's last N global steps (finished at, loss, samples, peers) and its loss curve."""
    if steps is not None:
        _ledger_steps(data_dir, database_url, steps, as_json)
        return
    with _ledger(data_dir, database_url) as store:
        rows = store.leaderboard()
    if as_json:
        print(msgspec.json.encode(rows).decode())
        return
    table = Table(title="contributions")
    columns = (
        "user",
        "samples",
        "compute h",
        "aggregated",
        "relayed",
        "peers",
        "last seen",
        "flagged",
        "why",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("user", "why") else "right")
    for row in rows:
        table.add_row(
            row.username,
            f"{row.samples:,}",
            f"{row.compute_hours:.2f}",
            f"{row.bytes_aggregated / 1e6:.1f} MB",
            f"{row.bytes_relayed / 1e6:.1f} MB",
            str(row.peers),
            _when(row.last_seen),
            str(row.flagged_reports),
        )
    out.print(table)
    for row in rows:
        if row.flag_reasons:
            why = ", ".join(f"{code} {count}" for code, count in row.flag_reasons.items())
            out.print(f"flagged reports of {row.username}: {why}", highlight=False, soft_wrap=True)
    out.print(
        "credit counts only work that receipts of other users' peers back; flag codes: "
        "future, too_old, too_long, overlap, compute (see backbone.ledger.accounting)",
        highlight=False,
    )


#: The loss curve covers at most this many of the run's latest steps (one query, a few MB at most).
CURVE_STEPS = 100_000
CURVE_POINTS = 8
SPARKLINE_WIDTH = 48
_SPARKS = "▁▂▃▄▅▆▇█"


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
    if as_json:
        print(msgspec.json.encode({"steps": recent, "curve": curve, "curve_steps": len(rows)}).decode())
        return
    recorded = str(len(rows)) if len(rows) < limit else f"at least {len(rows):,}"
    table = Table(title=f"global steps (the last {len(recent)} of {recorded} recorded)")
    for column in ("step", "finished at", "loss", "samples", "peers"):
        table.add_column(column, justify="left" if column == "finished at" else "right")
    for row in recent:
        finished = datetime.fromtimestamp(row.finished_at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        loss = "—" if row.loss is None else f"{row.loss:.4f}"
        table.add_row(str(row.global_step), finished, loss, f"{row.samples:,}", str(row.peers))
    out.print(table)
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
