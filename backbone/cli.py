"""``backbone``: run and administer backbone nodes of a training run."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit

import msgspec
import typer
from rich import box
from rich.console import Console
from rich.table import Table

from protocols.api import Invite, encode_invite
from protocols.auth import split_run_id
from protocols.training import TrainingSpec
from shared.auth.authority import AUTHORITY_FILE, Authority, pin_run_id
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
from shared.errors import ConfigError, ProjectError
from shared.extras import role_installed
from shared.lifecycle import Shutdown
from shared.manifest import load_training_spec
from shared.net.addresses import expand_unspecified, parse_multiaddr

from .runinfo import RUN_INFO, RunInfo, check_held_run, read_run_info, write_run_info
from .startup import (
    MAX_PUBLIC_URLS,
    check_authority_key,
    check_listen,
    check_public_url,
    parse_api_listen,
    parse_dashboard_listen,
)

if TYPE_CHECKING:  # the ledger (SQLAlchemy) and the service (Hypercorn) load in the commands that use them
    from .ledger import LedgerStore, StepRow

__all__ = ["LossPoint", "app", "loss_curve", "main", "sparkline"]

_DATA_DIR = default_data_dir("backbone")
HELP = f"""Run a training run's backbone nodes and administer the run: who joins, the ledger, the model.

Backbone nodes keep the run's DHT alive, admit its volunteers, credit their work in the ledger and keep
checkpoints of the model. Start a run, invite a volunteer, see who contributed, export the model:

\b
    backbone start --run-id my-run --manifest run.toml
    backbone allow add alice      # prints alice's invite code
    backbone ledger
    backbone export -o model.safetensors

Every command takes --data-dir DIR, by default {shown_path(_DATA_DIR)}."""
# Click's plain layout: help text gets the width of the terminal, paragraphs are reflowed and nothing is
# truncated (Rich's boxed tables squeeze the help column at 80 columns).
app = typer.Typer(
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
allow_app = typer.Typer(
    help="Decide who may join the run: invite users, list them, remove them.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(allow_app, name="allow")
out = Console()
MAX_INVITE_URLS = 8  # protocols.api.Invite's bound
#: The ledger's bound on an invite's uses (``backbone.ledger.store``; the CLI loads no ledger for ``--help``).
MAX_INVITE_USES = 1_000_000

DataDir = Annotated[
    Path,
    typer.Option(
        "--data-dir",
        metavar="DIR",
        default_factory=lambda: default_data_dir("backbone"),
        show_default=False,
        help="The backbone's data dir (identity, the run's authority key, ledger, checkpoints).  "
        f"[default: {shown_path(_DATA_DIR)}]",
    ),
]
DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        metavar="URL",
        show_default=False,
        help="The ledger's database, e.g. postgresql+psycopg://user@host/dedloc to share one "
        "among the run's backbones.  [default: SQLite in the data dir]",
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON (for scripts) instead of a table.")]
Username = Annotated[
    str, typer.Argument(metavar="USER", help="A name for the person, e.g. alice.", show_default=False)
]


def _print_version(wanted: bool) -> None:
    if wanted:
        print(f"backbone (dedloc) {project_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    # A callback keeps every command a subcommand, even while there would be only one.
    del version  # its callback answers it


@app.command()
def start(
    run_id: Annotated[
        str,
        typer.Option(
            "--run-id",
            metavar="RUN_ID",
            help="The run's name, e.g. my-run. The first start prints the full run id, "
            "name@fingerprint, to publish; later starts and other backbones may give either.",
        ),
    ],
    data_dir: DataDir,
    listen: Annotated[
        list[str] | None,
        typer.Option(
            "--listen",
            metavar="MADDR",
            help="Accept peers' connections on this address (repeatable).  "
            "[default: /ip4/0.0.0.0/tcp/0, any interface and a free port]",
        ),
    ] = None,
    initial_peer: Annotated[
        list[str] | None,
        typer.Option(
            "--initial-peer",
            metavar="MADDR",
            help="Join the run through this node, e.g. another backbone's `listening on` address "
            "(repeatable). Without it this backbone starts the run's network (or rejoins the peers "
            "it knew).",
        ),
    ] = None,
    mdns: Annotated[
        bool,
        typer.Option(
            "--mdns/--no-mdns",
            help="Advertise the run on the local network, so volunteers there find it without "
            "--initial-peer.",
        ),
    ] = True,
    open_run: Annotated[
        bool,
        typer.Option(
            "--open",
            help="An open run for local experiments: no authority key, no invites, anyone who finds "
            "it may join.",
        ),
    ] = False,
    authority_key: Annotated[
        Path | None,
        typer.Option(
            "--authority-key",
            metavar="FILE",
            show_default=False,
            help="The run's authority key, which every backbone of the run shares: give the first "
            "backbone's file to the others.  [default: authority.key in the data dir, created by the "
            "first start]",
        ),
    ] = None,
    database_url: DatabaseUrl = None,
    api_listen: Annotated[
        str,
        typer.Option(
            "--api-listen",
            metavar="HOST:PORT",
            help="Serve the run's HTTPS API (admission, manifest, reports) here; port 0 picks a free one.",
        ),
    ] = "0.0.0.0:0",
    public_url: Annotated[
        list[str] | None,
        typer.Option(
            "--public-url",
            metavar="URL",
            help="The API's URL as volunteers reach it, e.g. https://bb.example.org:8443 behind NAT "
            "or a proxy (repeatable); listed before the addresses it listens on.",
        ),
    ] = None,
    manifest: Annotated[
        Path | None,
        typer.Option(
            "--manifest",
            metavar="FILE",
            show_default=False,
            help="The run's training spec, a TOML or JSON file: task, target batch size, optimizer, "
            "dataset…  [default: the built-in task, tiny-mlm]",
        ),
    ] = None,
    aggregate: Annotated[
        bool,
        typer.Option(
            "--aggregate/--no-aggregate",
            help="Take slices of the volunteers' gradient averaging (no GPU needed), so that volunteers "
            "that all run behind NAT still average; --no-aggregate leaves it to the volunteers.",
        ),
    ] = True,
    aggregate_bandwidth: Annotated[
        float,
        typer.Option(
            "--aggregate-bandwidth",
            metavar="MBPS",
            help="This server's upload and download bandwidth in MB/s (10^6 bytes/s), as stated to the "
            "averaging plan, which gives aggregators slices in proportion to it.",
        ),
    ] = 100.0,
    relay: Annotated[
        bool,
        typer.Option(
            "--relay/--no-relay",
            help="Offer relay slots to volunteers behind NAT: they become reachable through this node (the "
            "two ends run TLS through it, so it never sees their traffic) and punch direct links between "
            "them where their NATs allow.",
        ),
    ] = True,
    dashboard_listen: Annotated[
        str | None,
        typer.Option(
            "--dashboard-listen",
            metavar="HOST:PORT",
            help="Also serve the dashboard and /metrics over plain HTTP here (browsers cannot open the "
            "API's HTTPS: its certificate is the run's Ed25519 key). Keep it on 127.0.0.1 and reach it "
            "through an SSH tunnel or a TLS reverse proxy: the admin token would cross the network in "
            "clear.",
        ),
    ] = None,
    public_leaderboard: Annotated[
        bool,
        typer.Option(
            "--public-leaderboard",
            help="Show the dashboard's per-user rows (users, their hardware and contributions) to anyone "
            "who opens it; by default only the run-level view is public and those rows need the admin "
            "token.",
        ),
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log debug messages too.")] = False,
) -> None:
    """Start a backbone node of a run and serve it until Ctrl+C.

    Prints `listening on MADDR` for each address (volunteers and other backbones join through one with
    --initial-peer), then, for a pinned run, its run id (name@fingerprint: publish it) and API URLs.
    The first start of a data dir creates the run's authority key there.

    Exit codes: 0 on a clean stop; 1 when the network failed; 2 on unusable input (flags, manifest, data
    dir).

    \b
    Examples:
      backbone start --run-id my-run --manifest run.toml \\
          --listen /ip4/0.0.0.0/tcp/4001 --api-listen 0.0.0.0:8443
      backbone start --run-id my-run@4fT9… --data-dir ~/bb2 \\
          --authority-key ~/bb/authority.key --initial-peer /ip4/…/tcp/4001/p2p/…
    """
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
        if dashboard_listen is not None:
            if open_run:
                raise ConfigError("--dashboard-listen needs a pinned run: the dashboard reads the ledger")
            parse_dashboard_listen(dashboard_listen)
        if len(public_url or []) > MAX_PUBLIC_URLS:
            raise ConfigError(f"give at most {MAX_PUBLIC_URLS} --public-url: an invite carries that many")
        for url in public_url or []:
            check_public_url(url)
        check_authority_key(authority_key)
        if not 0 < aggregate_bandwidth <= 1e7:
            raise ConfigError(f"--aggregate-bandwidth must be in (0, 1e7] MB/s, got {aggregate_bandwidth:g}")
        training = load_training_spec(manifest) if manifest is not None else TrainingSpec()
        with locked_data_dir(data_dir):
            check_held_run(data_dir, run_id, open_run=open_run)
            from .service import BackboneOptions, serve_backbone

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
                aggregate,
                aggregate_bandwidth,
                relay,
                public_leaderboard,
                dashboard_listen,
            )
            await serve_backbone(options, shutdown)

    run_service(body)


@contextlib.contextmanager
def _ledger(data_dir: Path, database_url: str | None) -> Iterator[LedgerStore]:
    if not data_dir.is_dir() or (
        database_url is None
        and not (data_dir / "ledger.sqlite3").exists()
        and not (data_dir / RUN_INFO).exists()
    ):  # a mistyped --data-dir must not look like an empty run (nor get a ledger created in it)
        fail(f"{data_dir} is not a backbone data dir: give the --data-dir of `backbone start`", 2)
    try:
        from .ledger import LedgerStore

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
    username: Username,
    data_dir: DataDir,
    note: Annotated[
        str | None,
        typer.Option("--note", metavar="TEXT", help="Who this is, for your records (e.g. an email)."),
    ] = None,
    expires_in_days: Annotated[
        float | None,
        typer.Option(
            "--expires-in-days",
            metavar="DAYS",
            show_default=False,
            help="The invite code stops working after this many days.  [default: never]",
        ),
    ] = None,
    database_url: DatabaseUrl = None,
    as_json: Json = False,
    max_uses: Annotated[
        int | None,
        typer.Option(
            "--max-uses",
            metavar="N",
            min=1,
            max=MAX_INVITE_USES,
            help="At most N machines may join with this invite (default: any number; a machine "
            "joining again is not a new use). --max-uses 1 makes a single-use invite.",
        ),
    ] = None,
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id",
            metavar="NAME",
            help="The run's name, to invite before the backbone first starts (with --public-url): "
            "creates the run's authority key and ledger in the data dir.",
        ),
    ] = None,
    public_url: Annotated[
        list[str] | None,
        typer.Option(
            "--public-url",
            metavar="URL",
            help="API URL the invite sends volunteers to (repeatable; default: the running or last "
            "started backbone's).",
        ),
    ] = None,
) -> None:
    """Allow USER to join the run and print an invite code for them.

    Every machine that joins with the code becomes one of USER's peers, and its work is credited to
    USER. The code is shown once: send it to USER privately.

    Before the backbone's first start, give --run-id and --public-url: the run's authority key and
    ledger are created in the data dir.

    \b
    Examples:
      backbone allow add alice --note alice@example.org --expires-in-days 7
      backbone allow add bob --max-uses 1
    """
    if expires_in_days is not None and not 0 < expires_in_days < 1e6:
        fail(f"--expires-in-days must be positive, got {expires_in_days} (leave it out: it never expires)", 2)
    urls = _checked_urls(public_url or [])
    created = not (data_dir / RUN_INFO).exists()
    info = _new_run(data_dir, username, run_id, urls) if created else _existing_run(data_dir, run_id, urls)
    with _ledger(data_dir, database_url) as store:
        now = time.time()
        store.add_user(username, note=note, now=now)
        expires = None if expires_in_days is None else now + expires_in_days * 86400
        secret = store.create_invite(username, now=now, expires_at=expires, max_uses=max_uses)
    code = encode_invite(Invite(info.run_id, info.api, secret))
    if as_json:
        fields = {"username": username, "invite": code, "expires_at": expires, "max_uses": max_uses}
        print(msgspec.json.encode({**fields, "run_id": info.run_id, "api": info.api}).decode())
        return
    uses = (
        "any number of machines"
        if max_uses is None
        else f"at most {max_uses} machine{'s' if max_uses > 1 else ''}"
    )
    out.print(f"invite for [bold]{username}[/] ({uses}; shown once; keep it secret):", highlight=False)
    print(code)
    out.print(f"they join with:  volunteer join --invite {code}", highlight=False, soft_wrap=True)
    if created:
        port = urlsplit(info.api[0]).port or 443
        serve = " ".join(f"--public-url {url}" for url in info.api)
        out.print(
            f"start the run with:  backbone start --run-id {info.run_id} --data-dir {data_dir} "
            f"--api-listen 0.0.0.0:{port} {serve}",
            highlight=False,
            soft_wrap=True,
        )


def _checked_urls(urls: list[str]) -> list[str]:
    """``--public-url`` values as an invite carries them (``https://HOST[:PORT]``, at most 8)."""
    if len(urls) > MAX_INVITE_URLS:
        fail(f"an invite carries at most {MAX_INVITE_URLS} --public-url values, got {len(urls)}", 2)
    for url in urls:
        parts = urlsplit(url)
        try:
            parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
        except ValueError:
            fail(f"--public-url {url!r} has an invalid port", 2)
        if parts.scheme != "https" or not parts.hostname or len(url) > 256 or parts.path not in ("", "/"):
            fail(f"--public-url {url!r} is not an https://HOST[:PORT] URL", 2)
    return [url.rstrip("/") for url in urls]


def _existing_run(data_dir: Path, run_id: str | None, urls: list[str]) -> RunInfo:
    """The run of a data dir whose backbone has started (``run.json``); ``--run-id`` must name it."""
    info = _run_info(data_dir)
    if run_id is not None and run_id not in (info.run_id, split_run_id(info.run_id)[0]):
        fail(f"{data_dir} holds run {info.run_id}, not {run_id}: leave --run-id out or fix it", 2)
    return msgspec.structs.replace(info, api=urls) if urls else info


def _new_run(data_dir: Path, username: str, run_id: str | None, urls: list[str]) -> RunInfo:
    """A data dir whose backbone never started: with ``--run-id`` and ``--public-url``, create the run's
    authority key (pinning the run id) and ``run.json``, as ``backbone start`` would, so that the invite
    knows the run and where to join; without them, say the exact command that does."""
    if run_id is None or not urls:
        guess = f"https://{expand_unspecified('0.0.0.0')[0]}:8443"
        command = (
            f"backbone allow add {username} --data-dir {data_dir} --run-id {run_id or 'my-run'} "
            f"--public-url {urls[0] if urls else guess}"
        )
        fail(
            f"{data_dir} holds no run yet, and an invite must say which run to join and where: name the "
            f"run and the URL where volunteers will reach this backbone's API (`{command}`), or start "
            "the backbone once first",
            2,
        )
        raise AssertionError  # fail() exits
    try:
        validate_run_id(run_id)
        key = data_dir / AUTHORITY_FILE
        if split_run_id(run_id)[1] is not None and not key.exists():
            raise ConfigError(
                f"run id {run_id} pins an authority key that {data_dir} does not hold: copy the run's "
                f"authority.key into {data_dir}, or give the run's name without '@…'"
            )
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        data_dir.chmod(0o700)  # as `backbone start` makes it: it holds the authority key
        authority = Authority.load_or_create(key)
        info = RunInfo(
            run_id=pin_run_id(run_id, authority),
            api=urls,
            authority_public_key=authority.identity.public_key_bytes.hex(),
        )
        write_run_info(data_dir, info)
    except ConfigError as exc:
        fail(str(exc), 2)
        raise
    except OSError as exc:
        fail(f"cannot use data dir {data_dir}: {exc.strerror or exc}", 2)
        raise
    return info


@allow_app.command("remove")
def allow_remove(
    username: Username, data_dir: DataDir, database_url: DatabaseUrl = None, as_json: Json = False
) -> None:
    """Remove USER: their machines are cut off within seconds.

    A running backbone publishes the revocation to every peer; USER's work so far stays credited.
    """
    with _ledger(data_dir, database_url) as store:
        removed = store.remove_user(username, now=time.time())
    if as_json:
        print(msgspec.json.encode({"username": username, "removed": removed}).decode())
    elif removed:
        out.print(f"removed {username}; a running backbone revokes its peers within seconds", highlight=False)
    else:
        fail(f"no active user {username!r}; the users are: backbone allow list --data-dir {data_dir}", 1)


@allow_app.command("list")
def allow_list(data_dir: DataDir, database_url: DatabaseUrl = None, as_json: Json = False) -> None:
    """List users, their machines and when each was last seen.

    Removed users are listed too, with when they were removed.
    """
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
#: The most ``--last`` accepts (a larger N is a typo, not a request).
MAX_LAST_STEPS = 1_000_000
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
            max=MAX_LAST_STEPS,
            help=f"List the last N steps (implies --steps; default {DEFAULT_LAST_STEPS}).",
        ),
    ] = None,
    flags: Annotated[
        bool,
        typer.Option("--flags", help="Instead of the leaderboard: every flagged report and why."),
    ] = False,
    as_json: Json = False,
) -> None:
    """Show who contributed what, the recent steps or the flagged reports.

    The leaderboard: per user, the samples, compute time, time online and bytes aggregated that receipts
    of other users' peers back, and how many reports were flagged and why (rule codes). In a swarm run the
    samples are stage-samples: a sample through one pipeline stage, and "sent" the pipeline bytes
    (activations, gradients) its peers sent that the receiving peers signed. With --steps: the
    run's last global steps (finished at, loss, held-out loss, batch against the target, peers) and its loss
    curve. With --flags: each flagged report, the rules it broke and the details.

    \b
    Examples:
      backbone ledger
      backbone ledger --steps --last 50
      backbone ledger --flags --json
    """
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
        stages = store.swarm_stages()
    if as_json:
        print(msgspec.json.encode(rows).decode())
        return
    relaying = any(row.bytes_relayed for row in rows)  # credited relaying (accounting: "Relayed bytes")
    sending = bool(stages) or any(row.bytes_sent for row in rows)  # a swarm run's pipeline bytes
    table = Table(title="contributions", box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    columns = ["user", "samples", "compute", "online", "aggregated"]
    columns += ["relayed"] if relaying else []
    columns += ["sent"] if sending else []
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
        cells += [_size(row.bytes_sent)] if sending else []
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
    if stages:  # a swarm run (backbone.ledger.accounting, "Swarm runs")
        out.print(
            f"a swarm run of {len(stages)} stages: samples are stage-samples, a sample through one stage "
            "(a sample through every stage counts once for each stage's server, and once per stage for the "
            "trainer that carried it); sent: the activations and gradients its servers and trainers sent, "
            "as far as the receiving peers of other users signed they received them",
            highlight=False,
            soft_wrap=True,
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
        stage_rows = store.stage_steps() if not rows else []
    if stage_rows and not as_json:  # a swarm run: its stages step, the run takes no global step
        _stage_steps_table(stage_rows, last)
        return
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
    evaluated = any(r.eval_loss is not None for r in recent)  # the held-out loss, when there is one
    columns = ["step", "finished at", "loss", *(["eval loss"] if evaluated else []), "batch / target"]
    for column in [*columns, "peers", "seen by"]:
        table.add_column(column, justify="left" if column in ("finished at", "seen by") else "right")
    for row in recent:
        finished = datetime.fromtimestamp(row.finished_at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        loss = "—" if row.loss is None else f"{row.loss:.4f}"
        batch = f"{row.samples:,}" if row.samples > 0 else "—"
        if row.target_batch is not None:
            batch += f" / {row.target_batch:,}"
        cells = [str(row.global_step), finished, loss, *([_eval_loss(row)] if evaluated else []), batch]
        table.add_row(*cells, str(row.peers), _SEEN_BY[row.source])
    out.print(table)
    if any(r.eval_loss is not None and r.eval_users < 2 for r in recent):
        out.print(
            "eval loss: the held-out loss of the step's parameters; * computed by one user's evaluators "
            "only (not cross-checked)",
            highlight=False,
        )
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


def _stage_steps_table(rows: Sequence[tuple[int, int, int, int | None, str]], last: int) -> None:
    """A swarm run's recorded stage steps (``LedgerStore.stage_steps`` rows): per stage, how many, the
    last one and the batch of the last ``last`` against the target."""
    by_stage: dict[int, list[tuple[int, int, int | None, str]]] = {}
    for stage, step, samples, target, source in rows:
        by_stage.setdefault(stage, []).append((step, samples, target, source))
    table = Table(title=f"a swarm run: the steps of its {len(by_stage)} stages (no global step)")
    for column in ("stage", "steps recorded", "last step", f"median batch (last {last})", "target"):
        table.add_column(column, justify="right")
    for stage, steps in sorted(by_stage.items()):
        recent = steps[-last:]
        batches = [samples for _, samples, _, _ in recent if samples > 0]
        target = next((t for _, _, t, _ in reversed(recent) if t is not None), None)
        median = f"{statistics.median(batches):,.0f}" if batches else "—"
        table.add_row(
            str(stage), f"{len(steps):,}", str(steps[-1][0]), median, "—" if target is None else f"{target:,}"
        )
    out.print(table)


def _eval_loss(row: StepRow) -> str:
    """The step's held-out loss; ``*`` marks one that no second user's evaluator confirmed."""
    if row.eval_loss is None:
        return "—"
    return f"{row.eval_loss:.4f}" + ("*" if row.eval_users < 2 else "")


@app.command()
def export(
    data_dir: DataDir,
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            metavar="PATH",
            help="The file to write (model.safetensors), or with --format hf a new folder.",
        ),
    ],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            metavar="FORMAT",
            help="safetensors (the parameters), or hf: a Hugging Face folder (config, weights, tokenizer) "
            "that transformers' from_pretrained loads; for hf-mlm and hf-clm runs.",
        ),
    ] = "safetensors",
    step: Annotated[
        int | None,
        typer.Option(
            "--step",
            metavar="STEP",
            show_default=False,
            help="Export the checkpoint of this global step.  [default: the newest]",
        ),
    ] = None,
) -> None:
    """Write the trained model to a file or a Hugging Face folder.

    The model is that of the newest checkpoint (or --step's). The safetensors file holds the model's
    parameters as tensors named as in the model (without the `model/` prefix) and metadata with the
    step, run id and task. The hf folder holds config.json, model.safetensors and the run's tokenizer:
    AutoModelForMaskedLM.from_pretrained(folder) and AutoTokenizer.from_pretrained(folder) load it.

    \b
    Examples:
      backbone export -o model.safetensors
      backbone export --format hf -o sahajbert/
    """
    if fmt not in ("safetensors", "hf"):
        fail(f"--format {fmt!r} is not supported: use safetensors or hf", 2)
    try:
        from .export import export_checkpoint
        from .export_hf import export_hf
        from .service import CHECKPOINTS_DIR

        if fmt == "hf":
            written = export_hf(data_dir, data_dir / CHECKPOINTS_DIR, output, step)
        else:
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
    with role_installed("backbone"):  # pip install dedloc without [backbone]: one line, exit 2
        app()
