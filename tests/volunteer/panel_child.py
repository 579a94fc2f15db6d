"""A volunteer's live panel on a terminal while log lines arrive, for tests/volunteer/test_panel_terminal.py.

Usage (from the repository root, on a pseudo-terminal that becomes this process's controlling terminal):
``python -m tests.volunteer.panel_child member|training DATA_DIR LINES``

``member``: what ``volunteer join`` runs for a plain run member: the CLI's logging and Console, a real node
(alone, on loopback) and the daemon's panel task (``volunteer.daemon._show_forever``), redrawn every 20 ms.
``training``: the training panel (``volunteer.panel.training_view`` in a ``LivePanel``, as the training
session shows it) whose height changes while it is live: a download bar and a waiting line come and go.

Meanwhile LINES log lines arrive, from the trio thread and from worker threads (as the trainer's do), with
redraws between them. Then it logs ``READY``, sets the terminal's title to ``READY`` (an escape sequence
that draws nothing: the test reads the screen up to it, when no redraw is half written), keeps redrawing,
and stops at Ctrl+C as the CLI does (``run_service``: exit 0).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import sys
import termios
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio
from rich.console import Console

from shared.auth.keys import Identity
from shared.console import run_service, setup_logging
from shared.lifecycle import Shutdown
from shared.node import NodeStatus, open_node

try:
    from shared.console import TERMINAL_LOCK
except ImportError:  # before issue 11 nothing serialized the terminal's writers
    TERMINAL_LOCK = threading.RLock()

REFRESH = 0.02
logger = logging.getLogger("volunteer")


async def emit_lines(count: int) -> None:
    for i in range(1, count + 1):
        message = "line %d of %d: step done, 3 peers, loss %.4f, params %016x"
        args = (i, count, 6.0 - i / count, 0x9D9F78B60D655B6F + i)
        if i % 2:
            logger.info(message, *args)
        else:
            await trio.to_thread.run_sync(functools.partial(logger.info, message, *args))
        await trio.sleep(REFRESH * 1.5)


async def member(data_dir: Path, lines: int, shutdown: Shutdown, console: Console) -> None:
    import volunteer.daemon  # imports torch (the training session): only here

    volunteer.daemon.REFRESH = REFRESH
    options = volunteer.daemon.VolunteerOptions("panel-run@child", data_dir, ["/ip4/127.0.0.1/tcp/0"], [])
    identity = Identity.generate()
    async with (
        open_node(identity, options.run_id, "volunteer", listen=options.listen) as node,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(volunteer.daemon._show_forever, node, options, console)
        await run_lines(lines, shutdown)
        nursery.cancel_scope.cancel()


async def training(lines: int, shutdown: Shutdown, console: Console) -> None:
    from shared.panel import LivePanel, PanelView
    from volunteer.panel import TrainingStatus, training_view

    ticks = 0

    def view() -> PanelView:
        nonlocal ticks
        ticks += 1
        phase = ticks // 7 % 3  # the panel grows and shrinks: nothing, a download bar, both
        status = TrainingStatus(
            role="compute + aggregate",
            step=ticks,
            collab_step=ticks + (5 if phase else 0),
            max_steps=1000,
            local_sps=812.4,
            collab_sps=2405.0,
            samples=96.0,
            target_batch=128,
            peers=3,
            eta_s=0.5,
            loss=4.5678,
            last_round_s=0.9 if phase != 1 else None,
            waiting="re-syncing: downloading the collaboration's state" if phase == 2 else None,
            download=(ticks % 100, 100) if phase else None,
            reports_sent=ticks // 10,
            reports_pending=1,
        )
        return training_view(node_status(), status, "training (press Ctrl+C to leave)")

    with LivePanel(console, view) as panel:
        async with trio.open_nursery() as nursery:

            async def redraw() -> None:
                while True:
                    panel.refresh()
                    await trio.sleep(REFRESH)

            nursery.start_soon(redraw)
            await run_lines(lines, shutdown)
            nursery.cancel_scope.cancel()


def node_status() -> NodeStatus:
    return NodeStatus(
        run_id="panel-run@child",
        peer_id="12D3KooWGBFBW5eQWhiPTgsTA3jD5KbfMmCaqAhDdD83ptzAR29M",
        role="volunteer",
        listen_addrs=["/ip4/127.0.0.1/tcp/4001"],
        routing_table_size=3,
        connected_peers=2,
        dht_size_estimate=4,
        members_online=4,
        rpc_latency_ms=1.2,
        bytes_sent=2_500_000,
        bytes_received=1_000_000,
        uptime_s=10.0,
        updated_at=0.0,
    )


async def run_lines(lines: int, shutdown: Shutdown) -> None:
    shutdown.ready()
    await emit_lines(lines)
    await trio.sleep(REFRESH * 10)
    logger.info("READY for Ctrl+C")
    with TERMINAL_LOCK:
        os.write(1, b"\x1b]2;READY\x07")
    await shutdown.requested.wait()


def main(mode: str, data_dir: str, lines: int) -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # a ^C typed on the terminal reaches us as SIGINT, echo and all
    setup_logging(False)
    console = Console()  # as the CLI's: stdout
    bodies: dict[str, Callable[[Shutdown], Awaitable[None]]] = {
        "member": lambda shutdown: member(Path(data_dir), lines, shutdown, console),
        "training": lambda shutdown: training(lines, shutdown, console),
    }
    run_service(bodies[mode])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
