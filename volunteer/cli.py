"""``volunteer``: donate this machine to a collaborative training run."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated

import trio
import typer
from rich.console import Console

from shared.console import default_data_dir, locked_data_dir, run_service, setup_logging, validate_run_id
from shared.errors import ConfigError
from shared.lifecycle import Shutdown
from shared.manifest import load_training_spec
from shared.net.addresses import parse_multiaddr

from .capabilities import choose_device
from .daemon import VolunteerOptions, serve_volunteer

__all__ = ["app", "main"]

app = typer.Typer(
    help="Donate this machine's GPU/CPU and bandwidth to a collaborative training run.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Donate this machine's GPU/CPU and bandwidth to a collaborative training run."""


@app.command()
def join(
    run_id: Annotated[str, typer.Argument(help="The run to join, as its organizers published it.")],
    initial_peer: Annotated[
        list[str] | None,
        typer.Option(
            "--initial-peer", metavar="MADDR", help="A node of the run (repeatable); default: mDNS."
        ),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option("--data-dir", help="Identity and state (default: ~/.local/share/dedloc/volunteer)."),
    ] = None,
    listen: Annotated[
        list[str] | None,
        typer.Option(
            "--listen", metavar="MADDR", help="Accept peers here (repeatable). Default /ip4/0.0.0.0/tcp/0."
        ),
    ] = None,
    discovery_wait: Annotated[
        float, typer.Option("--discovery-wait", help="Seconds to look for the run on the LAN.")
    ] = 3.0,
    panel: Annotated[
        bool | None, typer.Option("--panel/--no-panel", help="Live panel (default: when on a terminal).")
    ] = None,
    invite: Annotated[
        str | None,
        typer.Option("--invite", envvar="VOLUNTEER_INVITE", help="Invite code from the run's organizers."),
    ] = None,
    manifest: Annotated[
        Path | None,
        typer.Option(
            "--manifest", help="Training spec file (TOML/JSON) for open runs; pinned runs get theirs."
        ),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="torch device: auto, cpu, cuda, cuda:1…")] = "auto",
    threads: Annotated[
        int, typer.Option("--threads", help="CPU threads for torch (0: torch's default).")
    ] = 0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Join a run: find it, get admitted, train with the others and show a live panel until Ctrl+C /
    SIGTERM (or the run's step limit)."""
    setup_logging(verbose)
    console = Console()

    async def body(shutdown: Shutdown) -> None:
        validate_run_id(run_id)
        listen_addrs = listen or ["/ip4/0.0.0.0/tcp/0"]
        for text in [*listen_addrs, *(initial_peer or [])]:
            parse_multiaddr(text)
        if not (math.isfinite(discovery_wait) and discovery_wait > 0):
            raise ConfigError(f"--discovery-wait must be a positive number of seconds, got {discovery_wait}")
        cpus = os.cpu_count() or 1
        if not 0 <= threads <= cpus:
            raise ConfigError(
                f"--threads {threads}: give 1 to {cpus} (this machine's CPUs), or 0 for torch's default"
            )
        if manifest is not None:
            load_training_spec(manifest)  # a spec no volunteer can train fails now, not after admission
        # Before the data dir, the invite or the network: a device this machine lacks fails here, in one line.
        chosen = await trio.to_thread.run_sync(choose_device, device)
        directory = data_dir or default_data_dir("volunteer")
        with locked_data_dir(directory):
            options = VolunteerOptions(
                run_id,
                directory,
                listen_addrs,
                initial_peer or [],
                discovery_wait,
                console.is_terminal if panel is None else panel,
                invite=invite,
                manifest=manifest,
                device=chosen,
                threads=threads,
            )
            await serve_volunteer(options, shutdown, console)

    run_service(body)


def main() -> None:
    app()
