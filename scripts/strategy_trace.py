"""Where one averaging round's time goes on an emulated network: ``bench_strategies.py --trace``.

Two sources, both on one clock (``time.time()`` of one machine):

* **link counters** — a sampler process inside the LAN's switch namespace reads every bridge port's
  ``rx_bytes`` (what host ``i`` uploaded) and ``tx_bytes`` (what was delivered to host ``i``, its
  download) every few milliseconds (:class:`LinkSampler`); that is each peer's access link, measured
  where the emulation shapes it (``tests/netns.py``). Its first reading is taken before the peers are
  told to go and its last after every peer reported its end, so the byte totals of the round are these
  two readings' difference, exact whatever the scheduling; the readings between, which a loaded machine
  may take late or seldom (a starved sampler interpolated across the end of a burst and counted 91 % of
  a slow peer's upload), only draw the rates over time;
* **protocol events** — each peer process records every bulk exchange it starts (``push`` of a part to an
  aggregator, ``pull`` of an averaged part: start, end, bytes, the other peer, the part index), every push
  it serves (``recv``), every pull it answers (``serve``: from the request's arrival until the averaged
  part is ready to be written) and the moment each part of its own slice is reduced (``reduced``)
  (:func:`instrument`, which wraps the host's ``send_bulk`` and bulk handlers; nothing in the protocol
  changes).

:func:`analyze` sets these against the plan. For peer ``i`` with slice fraction ``f_i`` of a gradient of
``P`` bytes, in a group of ``n`` members of which ``k`` compute (``c_i`` = 1 if ``i`` computes), the LP's
model (``shared.averaging.load_balance``) moves, each way, ``P · (c_i (1 - f_i) + (k - c_i) f_i)`` bytes
through ``i``'s link; the protocol moves ``P · (c_i (1 - f_i) + (n - 1) f_i)`` out (every member pulls
every averaged slice, auxiliary members too) and ``P · ((1 - f_i) + (k - c_i) f_i)`` in. Per peer it
reports the bytes counted on the link, the seconds they need at the link's cap (``*_busy_s``) and the
share of the round the link was actually busy (``*_utilization``: busy seconds / round seconds); the
bottleneck link of an exact execution of the model is busy for the whole predicted time. :func:`write_svg`
draws each peer's upload and download rate over the round as a fraction of its cap, with the model's
predicted end as a vertical line.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.net.addresses import PeerAddress
    from shared.net.bulk import ReplySink

SAMPLE_S = 0.005
_SAMPLER = r"""
import select, sys, time
ports, interval = sys.argv[1].split(","), float(sys.argv[2])
out = open(sys.argv[3], "w")  # a file, not a pipe nobody reads until the end
stats = "/sys/class/net/{}/statistics/{}_bytes"
files = [(open(stats.format(p, "rx"), "rb", 0), open(stats.format(p, "tx"), "rb", 0)) for p in ports]
def sample():
    row = [time.time()]
    for rx, tx in files:
        rx.seek(0); tx.seek(0)
        row.append(int(rx.read())); row.append(int(tx.read()))
    out.write(" ".join(map(str, row)) + "\n")
sample()  # before "ready": the caller starts the round only after this reading
print("ready", flush=True)
while True:
    ready, _, _ = select.select([sys.stdin], [], [], interval)
    if ready and not sys.stdin.readline():
        break
    sample()
sample()  # after the caller's stop: every peer has reported the end of its round
out.flush()
"""


class LinkSampler:
    """Samples every bridge port's byte counters in ``switch`` until :meth:`stop`."""

    def __init__(self, switch: str, ports: Sequence[str], interval: float = SAMPLE_S) -> None:
        self.out = tempfile.NamedTemporaryFile("w+", prefix="link-samples-", suffix=".txt")
        argv = ["ip", "netns", "exec", switch, sys.executable, "-c", _SAMPLER, ",".join(ports), str(interval)]
        argv.append(self.out.name)
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"link sampler did not start: {self.proc.communicate()[1][-500:]}")
        self.n = len(ports)

    def stop(self) -> list[list[float]]:
        """Rows ``[t, up_0, down_0, up_1, down_1, ...]`` (cumulative bytes): the first read before this
        sampler was ready, the last after this call (module docstring)."""
        _, err = self.proc.communicate(input="", timeout=30)
        with self.out:
            if self.proc.returncode != 0:
                raise RuntimeError(f"link sampler failed: {err[-500:]}")
            self.out.seek(0)
            return [[float(v) for v in line.split()] for line in self.out if line.strip()]


# ---------------------------------------------------------------------------------------------- peer side


@dataclass
class Recorder:
    """The protocol events of one peer in the round being traced: ``[kind, peer, part, t0, t1, nbytes]``."""

    ranks: dict[str, int]
    events: list[list[Any]] = field(default_factory=list)

    def add(self, kind: str, peer: object, part: int, t0: float, t1: float, nbytes: int) -> None:
        self.events.append([kind, self.ranks.get(str(peer), -1), part, t0, t1, nbytes])


def instrument(host: Any, averager: Any, recorder: Recorder) -> None:
    """Record what :class:`Recorder` lists, by wrapping ``host.send_bulk``, the averaging bulk handlers and
    ``averager._maybe_finalize`` of this process (the benchmark's peers only)."""
    from protocols.averaging import decode_part_header, decode_pull_request
    from shared.averaging.allreduce import PULL, PUSH

    send_bulk: Callable[[PeerAddress, str, memoryview | bytes, bytes, ReplySink | None], Awaitable[bytes]] = (
        host.send_bulk
    )

    async def traced_send_bulk(
        address: PeerAddress,
        topic: str,
        data: memoryview | bytes,
        meta: bytes = b"",
        sink: ReplySink | None = None,
    ) -> bytes:
        t0, got = time.time(), [0]
        counting = None
        if sink is not None:

            def counting(reply_meta: bytes, nbytes: int) -> memoryview:
                got[0] = nbytes
                return sink(reply_meta, nbytes)

        try:
            return await send_bulk(address, topic, data, meta, counting)
        finally:
            if topic == PUSH:
                kind, part, nbytes = "push", decode_part_header(meta).part_index, len(data)
            elif topic == PULL:
                kind, part, nbytes = "pull", decode_pull_request(meta).part_index, got[0]
            else:
                kind, part, nbytes = topic, -1, len(data) + got[0]
            recorder.add(kind, address.peer_id, part, t0, time.time(), nbytes)

    host.send_bulk = traced_send_bulk

    def wrap(topic: str, kind: str, decode: Any) -> None:
        handler = host.bulk_handlers[topic]

        async def traced(ctx: Any, header: Any, reader: Any) -> Any:
            t0 = time.time()
            try:
                return await handler(ctx, header, reader)
            finally:
                part = decode(header.meta).part_index
                recorder.add(kind, ctx.peer_id, part, t0, time.time(), header.nbytes)

        host.bulk_handlers[topic] = traced

    wrap(PUSH, "recv", decode_part_header)
    wrap(PULL, "serve", decode_pull_request)

    finalize = averager._maybe_finalize

    async def traced_finalize(duty: Any, k: int) -> None:
        await finalize(duty, k)
        part = duty.parts[k]
        if part.done.is_set() and not getattr(part, "_traced", False):
            part._traced = True
            now = time.time()
            recorder.add("reduced", host.peer_id, k, now, now, 0)

    averager._maybe_finalize = traced_finalize


# ---------------------------------------------------------------------------------------------- analysis


def model_bytes(
    fractions: Sequence[float], compute: Sequence[bool], gradient_bytes: float
) -> list[dict[str, float]]:
    """Per peer: the bytes each way in the LP's model, and what the protocol sends and receives."""
    n, k = len(fractions), sum(compute)
    rows = []
    for f, c in zip(fractions, compute, strict=True):
        ci = 1 if c else 0
        rows.append(
            {
                "model_each_way": gradient_bytes * (ci * (1 - f) + (k - ci) * f),
                "protocol_up": gradient_bytes * (ci * (1 - f) + (n - 1) * f),
                "protocol_down": gradient_bytes * ((1 - f) + (k - ci) * f),
            }
        )
    return rows


def analyze(
    samples: list[list[float]],
    events: list[list[list[Any]]],
    reports: list[dict[str, Any]],
    caps_mbps: Sequence[tuple[float, float]],
    fractions: Sequence[float],
    compute: Sequence[bool],
    gradient_bytes: float,
    predicted_s: float,
) -> dict[str, Any]:
    """The per-peer summary described in the module docstring (``events[i]``: peer ``i``'s events).

    ``samples``: :meth:`LinkSampler.stop`'s rows, whose first and last readings bracket the round: the
    byte totals are their difference, not counters interpolated at the round's ends."""
    if not samples:
        raise RuntimeError("no link samples")
    start = min(r["start"] for r in reports)
    end = max(r["end"] for r in reports)
    seconds = end - start
    first, last = samples[0], samples[-1]
    model = model_bytes(fractions, compute, gradient_bytes)
    peers = []
    for i, (down_mbps, up_mbps) in enumerate(caps_mbps):
        up = last[1 + 2 * i] - first[1 + 2 * i]
        down = last[2 + 2 * i] - first[2 + 2 * i]
        up_busy = up / (up_mbps * 1e6 / 8)
        down_busy = down / (down_mbps * 1e6 / 8)
        mine = events[i]
        pulls = [e for e in mine if e[0] == "pull"]
        pushes = [e for e in mine if e[0] == "push"]
        peers.append(
            {
                "peer": i,
                "fraction": round(fractions[i], 6),
                "computes": bool(compute[i]),
                "round_s": round(reports[i]["end"] - reports[i]["start"], 3),
                "ended_at_s": round(reports[i]["end"] - start, 3),
                "cpu_s": reports[i].get("cpu_s"),
                "up_bytes": int(up),
                "down_bytes": int(down),
                "protocol_up_bytes": int(model[i]["protocol_up"]),
                "protocol_down_bytes": int(model[i]["protocol_down"]),
                "model_bytes_each_way": int(model[i]["model_each_way"]),
                "up_busy_s": round(up_busy, 3),
                "down_busy_s": round(down_busy, 3),
                "up_utilization": round(up_busy / seconds, 3) if seconds > 0 else None,
                "down_utilization": round(down_busy / seconds, 3) if seconds > 0 else None,
                "pushes_done_at_s": round(max((e[4] for e in pushes), default=start) - start, 3),
                "pulls_done_at_s": round(max((e[4] for e in pulls), default=start) - start, 3),
                "pull_wait_s_total": round(sum(e[4] - e[3] for e in pulls), 3),
            }
        )
    busiest = max(peers, key=lambda p: max(p["up_busy_s"], p["down_busy_s"]))
    return {
        "round_s": round(seconds, 3),
        "predicted_s": round(predicted_s, 3),
        "bottleneck_peer": busiest["peer"],
        "bottleneck_busy_s": max(busiest["up_busy_s"], busiest["down_busy_s"]),
        "bottleneck_utilization": round(max(busiest["up_busy_s"], busiest["down_busy_s"]) / seconds, 3),
        "peers": peers,
    }


def _at(samples: list[list[float]], t: float) -> list[float]:
    """The counters at time ``t``, linearly interpolated between the two samples around it."""
    if not samples:
        raise RuntimeError("no link samples")
    if t <= samples[0][0]:
        return samples[0]
    for a, b in itertools.pairwise(samples):
        if a[0] <= t <= b[0]:
            w = (t - a[0]) / (b[0] - a[0]) if b[0] > a[0] else 0.0
            return [x + w * (y - x) for x, y in zip(a, b, strict=True)]
    return samples[-1]


def rates(
    samples: list[list[float]], start: float, caps_mbps: Sequence[tuple[float, float]], bin_s: float
) -> list[dict[str, list[float]]]:
    """Per peer, upload and download rate as a fraction of the cap, in bins of ``bin_s`` from ``start``."""
    end = samples[-1][0]
    edges = [start + bin_s * b for b in range(int((end - start) / bin_s) + 2)]
    points = [_at(samples, t) for t in edges]
    out = []
    for i, (down_mbps, up_mbps) in enumerate(caps_mbps):
        up_cap, down_cap = up_mbps * 1e6 / 8 * bin_s, down_mbps * 1e6 / 8 * bin_s
        out.append(
            {
                "up": [
                    round((b[1 + 2 * i] - a[1 + 2 * i]) / up_cap, 3) for a, b in itertools.pairwise(points)
                ],
                "down": [
                    round((b[2 + 2 * i] - a[2 + 2 * i]) / down_cap, 3) for a, b in itertools.pairwise(points)
                ],
            }
        )
    return out


def write_svg(
    path: Path,
    title: str,
    series: list[dict[str, list[float]]],
    bin_s: float,
    predicted_s: float,
    ends: Sequence[float],
) -> None:
    """One row per peer: upload (filled) and download (line) rate as a fraction of its cap over time."""
    row_h, left, width = 28, 60, 900
    bins = max((len(s["up"]) for s in series), default=1)
    span = max(bins * bin_s, predicted_s, max(ends, default=0.0)) * 1.02

    def x(t: float) -> float:
        return left + width * t / span

    height = 40 + row_h * len(series) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
        'font-family="sans-serif" font-size="10">',
        f'<text x="{left}" y="14" font-size="12">{_escape(title)}</text>',
        f'<text x="{left}" y="28">upload (blue, filled) and download (orange line) as a fraction of the '
        "link's cap; red: the LP's predicted end; black tick: the peer's round end</text>",
    ]
    for i, s in enumerate(series):
        y0 = 40 + row_h * (i + 1)
        parts.append(f'<text x="4" y="{y0 - 8}">peer {i}</text>')
        parts.append(f'<line x1="{left}" y1="{y0}" x2="{left + width}" y2="{y0}" stroke="#ccc"/>')
        up = [(x(b * bin_s), y0 - (row_h - 4) * min(v, 1.2) / 1.2) for b, v in enumerate(s["up"])]
        if up:
            pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in [(x(0), y0), *up, (up[-1][0], y0)])
            parts.append(f'<polygon points="{pts}" fill="#4a90d9" fill-opacity="0.6"/>')
        down = [(x(b * bin_s), y0 - (row_h - 4) * min(v, 1.2) / 1.2) for b, v in enumerate(s["down"])]
        if down:
            pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in down)
            parts.append(f'<polyline points="{pts}" fill="none" stroke="#e8891c" stroke-width="1"/>')
        if i < len(ends):
            parts.append(
                f'<line x1="{x(ends[i]):.1f}" y1="{y0 - row_h + 4}" x2="{x(ends[i]):.1f}" y2="{y0}" '
                'stroke="black" stroke-width="2"/>'
            )
    bottom = 40 + row_h * len(series)
    parts.append(
        f'<line x1="{x(predicted_s):.1f}" y1="36" x2="{x(predicted_s):.1f}" y2="{bottom}" stroke="red"/>'
    )
    for t in range(int(span) + 1):
        parts.append(f'<text x="{x(t):.1f}" y="{bottom + 14}">{t}s</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def dump(path: Path, trace: dict[str, Any]) -> None:
    path.write_text(json.dumps(trace))
