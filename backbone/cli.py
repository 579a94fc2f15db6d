"""``backbone``: run and administer backbone nodes of a training run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from shared.console import locked_data_dir, run_service, setup_logging, validate_run_id
from shared.lifecycle import Shutdown
from shared.net.addresses import parse_multiaddr

from .service import BackboneOptions, serve_backbone

__all__ = ["app", "main"]

app = typer.Typer(
    help="Backbone nodes keep a training run's DHT alive and welcome its volunteers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Backbone nodes keep a training run's DHT alive and welcome its volunteers."""


@app.command()
def start(
    run_id: Annotated[str, typer.Option("--run-id", help="The run this backbone serves.")],
    data_dir: Annotated[Path, typer.Option("--data-dir", help="Identity key, status and state live here.")],
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
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Start a backbone node; prints `listening on <multiaddr>` per address and runs until stopped."""
    setup_logging(verbose)

    async def body(shutdown: Shutdown) -> None:
        validate_run_id(run_id)
        listen_addrs = listen or ["/ip4/0.0.0.0/tcp/0"]
        for text in [*listen_addrs, *(initial_peer or [])]:
            parse_multiaddr(text)
        with locked_data_dir(data_dir):
            options = BackboneOptions(run_id, data_dir, listen_addrs, initial_peer or [], mdns)
            await serve_backbone(options, shutdown)

    run_service(body)


def main() -> None:
    app()
