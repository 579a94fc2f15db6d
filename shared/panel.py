"""The live status panel (rich) shown by ``volunteer join`` and, in plain lines, when not on a terminal."""

from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table

from .node import NodeStatus

__all__ = ["format_bytes", "render_status", "status_line"]


def format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def _latency(status: NodeStatus) -> str:
    return "—" if status.rpc_latency_ms is None else f"{status.rpc_latency_ms:.2f} ms"


def render_status(status: NodeStatus, headline: str) -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold cyan", justify="right")
    table.add_column()
    table.add_row("run", status.run_id)
    table.add_row("peer id", status.peer_id)
    table.add_row("listening", "\n".join(status.listen_addrs) or "(client mode)")
    table.add_row("peers known", str(status.routing_table_size))
    table.add_row("connected", str(status.connected_peers))
    table.add_row("DHT size", f"≈ {status.dht_size_estimate} nodes")
    table.add_row("online now", f"{status.members_online} nodes publish presence")
    table.add_row("RPC latency", _latency(status))
    table.add_row("traffic", f"↑ {format_bytes(status.bytes_sent)}  ↓ {format_bytes(status.bytes_received)}")
    table.add_row("uptime", f"{status.uptime_s:.0f} s")
    return Panel(Group(table), title=f"[bold]{status.role}[/] · {headline}", border_style="green")


def status_line(status: NodeStatus) -> str:
    return (
        f"peers known {status.routing_table_size}, connected {status.connected_peers}, "
        f"DHT size ≈ {status.dht_size_estimate}, online {status.members_online}, "
        f"RPC latency {_latency(status)}"
    )
