"""The training panel and its log line show what the issue asks for: role, global step, samples/s here
and in the collaboration, peers, traffic, ETA to the next step, download progress, why it waits."""

from __future__ import annotations

import io

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console

from shared.node import NodeStatus
from shared.panel import LivePanel, fit
from volunteer.panel import TrainingStatus, render_training, training_line, training_view

NODE = NodeStatus(
    run_id="run@abc",
    peer_id="12D3KooWpeer",
    role="volunteer",
    listen_addrs=["/ip4/127.0.0.1/tcp/1"],
    routing_table_size=3,
    connected_peers=2,
    dht_size_estimate=4,
    members_online=4,
    rpc_latency_ms=1.0,
    bytes_sent=2_500_000,
    bytes_received=1_000,
    uptime_s=10.0,
    updated_at=0.0,
)


def status(**changes: object) -> TrainingStatus:
    base = dict(
        role="compute + aggregate",
        step=41,
        collab_step=41,
        max_steps=100,
        local_sps=812.4,
        collab_sps=2405.0,
        samples=96.0,
        target_batch=128,
        peers=3,
        eta_s=0.013,
        loss=4.5678,
        last_round_s=0.9,
        waiting=None,
        download=None,
        reports_sent=7,
        reports_pending=1,
    )
    base.update(changes)
    return TrainingStatus(**base)  # type: ignore[arg-type]


def render(s: TrainingStatus) -> str:
    console = Console(width=120, record=True, color_system=None)
    console.print(render_training(NODE, s, "training"))
    return console.export_text()


def test_panel_shows_the_training_facts() -> None:
    text = render(status())
    for expected in (
        "compute + aggregate",
        "41 of 100",
        "812 here",
        "2405 collaboration",
        "96 / 128",
        "4.5678",
    ):
        assert expected in text, (expected, text)
    assert "2.5 MB" in text and "3 training" in text and "< 1 s" in text


def test_panel_shows_download_progress_and_why_it_waits() -> None:
    text = render(status(step=3, collab_step=41, download=(500, 1000), waiting="re-syncing: downloading"))
    assert "collaboration at 41" in text and "re-syncing: downloading" in text
    assert "━" in text  # the progress bar


def test_log_line_carries_the_same_facts() -> None:
    line = training_line(status(waiting="waiting for the first examples"))
    assert "step 41" in line and "812 samples/s here" in line and "96/128" in line
    assert line.endswith("waiting for the first examples")


def test_log_line_says_how_peers_reach_us_and_how_our_links_travel() -> None:
    """Issue 14 item 7: client mode, relayed, punched or direct, in the status line too."""
    assert training_line(status(network="direct")).endswith(", 3 peers, reachable directly")
    assert ", reachable through a relay" in training_line(status(network="relayed"))
    assert ", client mode" in training_line(status(network="client"))
    assert "reachability unknown" in training_line(status(network="unchecked"))
    assert "links" not in training_line(status(network="direct", links={"direct": 3}))  # nothing to say
    line = training_line(status(network="relayed", links={"direct": 2, "punched": 1, "relayed": 0}))
    assert line.endswith("reachable through a relay, links 2 direct · 1 punched")


def fitted_text(width: int, height: int, s: TrainingStatus) -> list[str]:
    """The lines a live display draws of the fitted panel (``Console.print`` would re-wrap a bare line)."""
    console = Console(width=width, height=height, color_system=None)
    lines = console.render_lines(fit(training_view(NODE, s, "training"), console, height), pad=False)
    return ["".join(segment.text for segment in line).rstrip() for line in lines]


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(min_value=20, max_value=200),
    height=st.integers(min_value=1, max_value=40),
    busy=st.booleans(),
)
def test_fit_never_exceeds_the_terminal_and_keeps_the_essentials(width: int, height: int, busy: bool) -> None:
    s = status(download=(5, 10), waiting="re-syncing: downloading") if busy else status()
    lines = fitted_text(width, height, s)
    assert len(lines) <= height
    assert all(cell_len(line) <= width for line in lines)
    assert "volunteer" in lines[0]  # the title, on the border or on its own line
    essentials = 3 + 2 + (2 if busy else 0)  # role, global step, loss; the border; the footer
    if height >= essentials and width >= 60:
        text = "\n".join(lines)
        assert "41 of 100" in text and "4.5678" in text and "compute + aggregate" in text, text


def test_fit_shows_every_row_when_the_terminal_is_tall_enough() -> None:
    text = "\n".join(fitted_text(120, 48, status()))
    for label in ("run", "peer id", "traffic", "last averaging", "reports", "Ctrl+C to leave"):
        assert label in text, (label, text)


def test_live_panel_off_a_terminal_prints_only_its_last_frame_without_the_hint() -> None:
    out = io.StringIO()
    console = Console(file=out, width=100, height=30, color_system=None)
    steps = iter(range(1, 100))
    with LivePanel(console, lambda: training_view(NODE, status(step=next(steps)), "training")) as panel:
        panel.refresh()
        panel.refresh()
    text = out.getvalue()
    assert text.count("volunteer · training") == 1, text
    assert "4 of 100" in text and "Ctrl+C" not in text, text
