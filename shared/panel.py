"""Live status panels (rich) shown by ``volunteer join``, and the same facts as plain log lines when not on a
terminal.

How a live panel stays in place (issue 11: copies of it piled up in the scrollback, log lines printed under
it). A redraw moves the cursor up over the lines it drew last and draws again, so these must hold:

1. Nothing else writes between two redraws without going through the panel's Console, which prints it
   above the panel and redraws the panel below. Log records, ``print`` and warnings are routed so while a
   panel is live (:func:`shared.console.output_above`), and every write and redraw holds
   :data:`shared.console.TERMINAL_LOCK`, so threads never interleave. The panel has no refresh thread of
   its own: its owner's task redraws it.
2. The panel is never taller than the terminal: the cursor cannot move above the screen's top row, so a
   taller panel leaves its top in the scrollback at each redraw. :func:`fit` measures the panel at the
   terminal's current size before each redraw and, while it does not fit, drops the least important rows,
   then the border, and last shows one cropped line. One row is left free for the newest log line.
3. The keyboard does not echo while the panel is live: the terminal would echo a Ctrl+C as ``^C`` at the
   cursor, past the panel's last column, which wraps to a new line, and an Enter moves the cursor down;
   either way the next redraw starts a line too low and leaves the panel's top line behind. And a Ctrl+C
   does not flush the terminal's output queue (``NOFLSH``): that would drop the rest of a frame being
   written, and the next redraw, moving up by a whole frame, would erase log lines above it. Both come
   back at exit; keys typed meanwhile are discarded, not handed to the shell unseen.
4. A frame is written whole: unbuffered (``PYTHONUNBUFFERED=1``, common in containers), ``sys.stdout``
   silently drops the rest of a write that a signal cut short (see :class:`_WholeWrites`).
5. At exit the last frame stays (fitted too, without the hint), the cursor is shown again, and the next
   output starts on a fresh line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import termios
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, cast

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .console import TERMINAL_LOCK, output_above, same_terminal
from .node import NodeStatus

__all__ = [
    "HINT",
    "LivePanel",
    "PanelView",
    "Row",
    "draw",
    "fit",
    "format_bytes",
    "relay_text",
    "render_status",
    "status_line",
    "status_view",
]

logger = logging.getLogger(__name__)
HINT = "Ctrl+C to leave"


@dataclass(frozen=True)
class Row:
    """One labelled fact of a panel. ``rank`` 0 is always shown; higher ranks go first when space is short."""

    label: str
    value: RenderableType
    rank: int = 0


@dataclass(frozen=True)
class PanelView:
    """What a panel shows, before it is fitted to a terminal.

    Attributes:
        title: rich markup, on the border (or the first line once the border is dropped).
        rows: in display order.
        summary: the same facts as one plain line: all that is left on a terminal too small for rows.
        footer: lines under the rows (a progress bar, why we wait), kept while the rows are.
        hint: on the bottom border while the panel is live (how to stop it); not on the last frame.
    """

    title: str
    rows: Sequence[Row]
    summary: str
    footer: Sequence[RenderableType] = field(default=())
    hint: str = ""


def _table(rows: Sequence[Row]) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold cyan", justify="right", no_wrap=True)
    table.add_column()
    for row in rows:
        table.add_row(row.label, row.value)
    return table


def draw(view: PanelView, max_rank: int | None = None, border: bool = True) -> RenderableType:
    """``view`` as a bordered panel (or a bare title and table), with the rows of rank <= ``max_rank``."""
    rows = [row for row in view.rows if max_rank is None or row.rank <= max_rank]
    body = Group(_table(rows), *view.footer)
    if border:
        return Panel(body, title=view.title, subtitle=view.hint or None, border_style="green")
    return Group(Text.from_markup(view.title, style="bold green"), body)


def fit(view: PanelView, console: Console, height: int) -> RenderableType:
    """The fullest form of ``view`` at most ``height`` lines tall at ``console``'s width (module doc, 2)."""
    options = console.options
    ranks = sorted({row.rank for row in view.rows}, reverse=True) or [0]
    candidates = [draw(view, rank) for rank in ranks] + [draw(view, 0, border=False)]
    for candidate in candidates:
        if len(console.render_lines(candidate, options, pad=False)) <= height:
            return candidate
    title = Text.from_markup(view.title).plain
    return Text(f"{title}: {view.summary}", no_wrap=True, overflow="ellipsis", end="")


class LivePanel:
    """A panel redrawn in place at the bottom of ``console``'s terminal, output scrolling above it.

    Use it as a context manager and call :meth:`refresh` from the owning task (there is no refresh
    thread). ``view`` is called at each refresh; on a console that is not a terminal only the last frame
    is printed, at exit.
    """

    def __init__(self, console: Console, view: Callable[[], PanelView]) -> None:
        self._console = console
        self._view = view
        self._live = Live(
            console=console,
            auto_refresh=False,
            redirect_stdout=False,  # output_above does it, under TERMINAL_LOCK
            redirect_stderr=False,
            vertical_overflow="crop",  # never needed: fit() keeps the panel a row shorter than the screen
        )
        self._routes = contextlib.ExitStack()  # what __exit__ undoes

    def _fitted(self, last: bool = False) -> RenderableType:
        view = self._view()
        if last:
            view = dataclasses.replace(view, hint="")
        return fit(view, self._console, max(1, self._console.height - 1))

    def __enter__(self) -> LivePanel:
        with TERMINAL_LOCK, contextlib.ExitStack() as stack:
            stack.enter_context(_whole_writes(self._console))
            stack.enter_context(output_above(self._console))
            stack.enter_context(_no_echo(self._console))
            self._live.update(self._fitted())
            self._live.start(refresh=True)
            stack.callback(self._live.stop)  # draws the last frame, shows the cursor, ends the line
            self._routes = stack.pop_all()
        return self

    def refresh(self) -> None:
        """Draw the current view over the last one."""
        with TERMINAL_LOCK:
            self._live.update(self._fitted(), refresh=True)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with TERMINAL_LOCK, self._routes:
            self._live.update(self._fitted(last=True))  # at the size the terminal has now


class _WholeWrites:
    """A text stream's file descriptor, written to the last byte.

    Under ``PYTHONUNBUFFERED=1`` (common in containers) ``sys.stdout`` writes straight to the descriptor
    and silently drops the rest of a write that a signal cut short: a Ctrl+C while a redraw waits for a
    slow terminal left half a frame, and the next redraw, moving up by a whole one, erased log lines.
    """

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._fd = stream.fileno()
        self.encoding: str = getattr(stream, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        self._stream.flush()  # what it holds goes first
        data = memoryview(text.encode(self.encoding))
        while data:
            data = data[os.write(self._fd, data) :]
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)


@contextlib.contextmanager
def _whole_writes(console: Console) -> Iterator[None]:
    """``console`` writes whole frames while in the block (see :class:`_WholeWrites`)."""
    stream = console.file
    try:
        whole = _WholeWrites(stream)
    except (AttributeError, OSError, ValueError):  # no file descriptor: nothing can cut its writes
        yield
        return
    console.file = cast("IO[str]", whole)
    try:
        yield
    finally:
        console.file = stream


@contextlib.contextmanager
def _no_echo(console: Console) -> Iterator[None]:
    """Typed keys are not echoed on ``console``'s terminal, and Ctrl+C does not flush its output, while in
    the block (module doc, 3)."""
    try:
        fd = sys.stdin.fileno()
        ours = same_terminal(sys.stdin, console.file) and os.tcgetpgrp(fd) == os.getpgrp()
    except (AttributeError, OSError, ValueError):  # no stdin, or not a terminal
        ours = False
    if not ours:  # not our terminal, or we run in the background: leave the terminal alone
        yield
        return
    try:
        saved = termios.tcgetattr(fd)
        quiet = termios.tcgetattr(fd)
        quiet[3] = (quiet[3] & ~termios.ECHO) | termios.NOFLSH
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
    except termios.error as exc:
        logger.warning("cannot turn off the terminal's echo (%s): typed keys may shift the panel", exc)
        yield
        return
    try:
        yield
    finally:
        # Moved to the background meanwhile (Ctrl+Z, bg), changing the terminal would stop us with
        # SIGTTOU, unless that signal is blocked.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
        try:
            termios.tcsetattr(fd, termios.TCSANOW, saved)  # not TCSAFLUSH: it waits for a stuck terminal
            termios.tcflush(fd, termios.TCIFLUSH)
        except termios.error as exc:
            logger.warning("cannot turn the terminal's echo back on (%s): run `stty echo`", exc)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def _latency(status: NodeStatus) -> str:
    return "—" if status.rpc_latency_ms is None else f"{status.rpc_latency_ms:.2f} ms"


def status_view(status: NodeStatus, headline: str) -> PanelView:
    """A plain member's panel: who we are in the run and how the DHT looks from here."""
    rows = [
        Row("run", status.run_id, 1),
        Row("peer id", status.peer_id, 2),
        Row("reachable at", "\n".join(status.advertised_addrs) or "(client mode: nobody can dial us)", 3),
        Row("peers known", str(status.routing_table_size), 1),
        Row("connected", str(status.connected_peers)),
        Row("DHT size", f"≈ {status.dht_size_estimate} nodes", 1),
        Row("online now", f"{status.members_online} nodes publish presence"),
        Row("RPC latency", _latency(status), 2),
        Row("traffic", f"↑ {format_bytes(status.bytes_sent)}  ↓ {format_bytes(status.bytes_received)}", 2),
        Row("uptime", f"{status.uptime_s:.0f} s", 3),
    ]
    if status.reachability_note:
        rows.append(Row("network", status.reachability_note, 1))
    if status.links:
        rows.append(Row("links", links_text(status.links), 2))
    if status.relay_slots:
        rows.append(Row("relaying", relay_text(status), 2))
    return PanelView(f"[bold]{status.role}[/] · {headline}", rows, status_line(status), hint=HINT)


def relay_text(status: NodeStatus) -> str:
    """Our relay slots for the panel: how many others hold one of ours."""
    return f"{status.relay_reservations} of {status.relay_slots} relay slots held by peers behind NAT"


def render_status(status: NodeStatus, headline: str) -> RenderableType:
    return draw(status_view(status, headline))


def status_line(status: NodeStatus) -> str:
    return (
        f"peers known {status.routing_table_size}, connected {status.connected_peers}, "
        f"DHT size ≈ {status.dht_size_estimate}, online {status.members_online}, "
        f"RPC latency {_latency(status)}"
    )


def links_text(links: dict[str, int]) -> str:
    """``"3 direct · 1 punched · 1 relayed"`` (our RPC connections by how they travel)."""
    order = {"direct": 0, "punched": 1, "relayed": 2}
    return " · ".join(f"{n} {kind}" for kind, n in sorted(links.items(), key=lambda kv: order.get(kv[0], 9)))
