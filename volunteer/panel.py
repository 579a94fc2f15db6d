"""The volunteer's live panel while training (rich), and the same facts as one log line."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import RenderableType
from rich.progress_bar import ProgressBar
from rich.text import Text

from shared.node import NodeStatus
from shared.panel import HINT, PanelView, Row, draw, format_bytes, links_text, relay_text

if TYPE_CHECKING:  # the optimizer imports torch: the panel's code and its tests need not
    from .collab.optimizer import CollaborativeOptimizer

__all__ = ["TrainingStatus", "render_training", "training_line", "training_status", "training_view"]


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
    #: how peers reach us: "direct", "relayed", "client" or "unchecked" (shared.net.reachability)
    network: str = ""
    links: dict[str, int] = field(default_factory=dict)  # our RPC connections: direct, relayed, punched
    #: diloco mode: our inner steps so far (a step is a round of them); None in the batch mode
    inner_steps: int | None = None
    planned: bool = False  # the round's length was planned (diloco with min_round)


def training_status(
    collab: CollaborativeOptimizer,
    reports_sent: int = 0,
    reports_pending: int = 0,
    network: str = "",
    links: dict[str, int] | None = None,
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
        target_batch=collab.target,
        peers=view.peers if view is not None else 1,
        eta_s=view.eta(collab.target) if view is not None else None,
        loss=view.loss if view is not None and view.loss is not None else None,
        last_round_s=collab.mode.stats.last_round_seconds,
        waiting=waiting,
        download=collab.sync.download,
        reports_sent=reports_sent,
        reports_pending=reports_pending,
        network=network,
        links=dict(links or {}),
        inner_steps=getattr(collab.trainer, "inner_steps", None),
        planned=collab.mode.planned() > 0,
    )


def training_view(node: NodeStatus, status: TrainingStatus, headline: str) -> PanelView:
    """The training panel's facts; on a short terminal the higher-ranked rows give way first."""
    limit = f" of {status.max_steps}" if status.max_steps else ""
    rows = [
        Row("run", node.run_id, 2),
        Row("peer id", node.peer_id, 3),
        Row("role", status.role),
        Row("global step", f"{status.step}{limit}" + _behind(status)),
        Row("samples/s", f"{status.local_sps:.0f} here · {status.collab_sps:.0f} collaboration", 1),
        Row(
            "next step" if status.inner_steps is None else "next round",
            f"{min(status.samples, status.target_batch):.0f} / {status.target_batch} samples"
            + (" (planned)" if status.planned else "")
            + ("" if status.inner_steps is None else f" · {status.inner_steps} inner steps here")
            + f" · ETA {_eta_text(status.eta_s)}",
            1,
        ),
        Row("loss", "—" if status.loss is None else f"{status.loss:.4f}"),
        Row("peers", f"{status.peers} training · {node.connected_peers} connected", 1),
        Row("traffic", f"↑ {format_bytes(node.bytes_sent)}  ↓ {format_bytes(node.bytes_received)}", 3),
    ]
    if node.reachability_note:
        rows.append(Row("network", node.reachability_note, 1))
    if node.links:
        rows.append(Row("links", links_text(node.links), 2))
    if node.relay_slots:
        rows.append(Row("relaying", relay_text(node), 2))
    if status.last_round_s is not None:
        rows.append(Row("last averaging", f"{status.last_round_s:.2f} s", 2))
    rows.append(Row("reports", f"{status.reports_sent} sent · {status.reports_pending} pending", 2))
    footer: list[RenderableType] = []
    if status.download is not None:
        done, total = status.download
        footer.append(ProgressBar(total=max(total, 1), completed=done))
    if status.waiting:
        footer.append(Text(status.waiting, style="yellow"))
    return PanelView(f"[bold]volunteer[/] · {headline}", rows, training_line(status), footer, HINT)


def render_training(node: NodeStatus, status: TrainingStatus, headline: str) -> RenderableType:
    return draw(training_view(node, status, headline))


def training_line(status: TrainingStatus) -> str:
    waiting = f" — {status.waiting}" if status.waiting else ""
    loss = "—" if status.loss is None else f"{status.loss:.4f}"
    peers = f"{status.peers} peer" + ("" if status.peers == 1 else "s")
    network = _NETWORK_TEXT.get(status.network, "") + _links_text(status.links)
    return (
        f"step {status.step}{_behind(status)}, {status.role}, {status.local_sps:.0f} samples/s here, "
        f"{status.collab_sps:.0f} collaboration, {status.samples:.0f}/{status.target_batch} toward the next "
        f"step (ETA {_eta_text(status.eta_s)}), loss {loss}, {peers}{network}{waiting}"
    )


_NETWORK_TEXT = {
    "direct": ", reachable directly",
    "relayed": ", reachable through a relay",
    "client": ", client mode",
    "unchecked": ", client mode (reachability unknown)",
}


def _links_text(links: dict[str, int]) -> str:
    """Our connections by kind when any is not direct: ``", links 2 direct · 1 punched"`` (the panel's
    links row, :func:`shared.panel.links_text`)."""
    shown = {kind: n for kind, n in links.items() if n}
    return ", links " + links_text(shown) if any(kind != "direct" for kind in shown) else ""


def _behind(status: TrainingStatus) -> str:
    return f" (collaboration at {status.collab_step})" if status.collab_step > status.step else ""


def _eta_text(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "—"
    return f"{seconds:.0f} s" if seconds >= 1 else "< 1 s"
