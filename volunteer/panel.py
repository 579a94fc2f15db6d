"""The volunteer's live panel while training (rich), and the same facts as one log line."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table

from shared.node import NodeStatus
from shared.panel import format_bytes

from .collab.optimizer import CollaborativeOptimizer, eta_text

__all__ = ["TrainingStatus", "render_training", "training_line", "training_status"]


@dataclass(frozen=True)
class TrainingStatus:
    role: str
    step: int
    collab_step: int
    max_steps: int
    local_sps: float
    collab_sps: float
    samples: float
    target_batch: int
    peers: int
    eta_s: float | None
    loss: float | None
    last_round_s: float | None
    waiting: str | None
    download: tuple[int, int] | None
    reports_sent: int
    reports_pending: int


def training_status(
    collab: CollaborativeOptimizer, reports_sent: int = 0, reports_pending: int = 0
) -> TrainingStatus:
    view = collab.view
    stats = collab.stats
    waiting = stats.waiting
    if waiting is None and view is not None and view.peers <= 1 and collab.trainer.step == 0:
        waiting = None  # alone is fine: we train and step by ourselves until others come
    return TrainingStatus(
        role="averaging"
        if collab.averaging
        else ("re-syncing" if collab.syncing else collab.mode.stats.role),
        step=collab.trainer.step,
        collab_step=view.step if view is not None else collab.trainer.step,
        max_steps=collab.spec.max_steps,
        local_sps=stats.local_sps,
        collab_sps=view.samples_per_second if view is not None else stats.local_sps,
        samples=view.samples if view is not None else float(collab.trainer.samples),
        target_batch=collab.spec.target_batch,
        peers=view.peers if view is not None else 1,
        eta_s=view.eta(collab.spec.target_batch) if view is not None else None,
        loss=view.loss if view is not None and view.loss is not None else None,
        last_round_s=collab.mode.stats.last_round_seconds,
        waiting=waiting,
        download=collab.sync.download,
        reports_sent=reports_sent,
        reports_pending=reports_pending,
    )


def render_training(node: NodeStatus, status: TrainingStatus, headline: str) -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold cyan", justify="right")
    table.add_column()
    table.add_row("run", node.run_id)
    table.add_row("peer id", node.peer_id)
    table.add_row("role", status.role)
    limit = f" of {status.max_steps}" if status.max_steps else ""
    table.add_row("global step", f"{status.step}{limit}" + _behind(status))
    table.add_row("samples/s", f"{status.local_sps:.0f} here · {status.collab_sps:.0f} collaboration")
    table.add_row(
        "next step",
        f"{min(status.samples, status.target_batch):.0f} / {status.target_batch} samples · "
        f"ETA {eta_text(status.eta_s)}",
    )
    table.add_row("loss", "—" if status.loss is None else f"{status.loss:.4f}")
    table.add_row("peers", f"{status.peers} training · {node.connected_peers} connected")
    table.add_row("traffic", f"↑ {format_bytes(node.bytes_sent)}  ↓ {format_bytes(node.bytes_received)}")
    if status.last_round_s is not None:
        table.add_row("last averaging", f"{status.last_round_s:.2f} s")
    table.add_row("reports", f"{status.reports_sent} sent · {status.reports_pending} pending")
    parts: list[RenderableType] = [table]
    if status.download is not None:
        done, total = status.download
        parts.append(ProgressBar(total=max(total, 1), completed=done))
    if status.waiting:
        parts.append(f"[yellow]{status.waiting}[/]")
    return Panel(Group(*parts), title=f"[bold]volunteer[/] · {headline}", border_style="green")


def training_line(status: TrainingStatus) -> str:
    waiting = f" — {status.waiting}" if status.waiting else ""
    loss = "—" if status.loss is None else f"{status.loss:.4f}"
    return (
        f"step {status.step}{_behind(status)}, {status.role}, {status.local_sps:.0f} samples/s here, "
        f"{status.collab_sps:.0f} collaboration, {status.samples:.0f}/{status.target_batch} toward the next "
        f"step (ETA {eta_text(status.eta_s)}), loss {loss}, {status.peers} peers{waiting}"
    )


def _behind(status: TrainingStatus) -> str:
    return f" (collaboration at {status.collab_step})" if status.collab_step > status.step else ""
