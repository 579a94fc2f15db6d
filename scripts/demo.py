"""A local collaboration on loopback: one backbone, N volunteers, a live table, a clean stop.

Each node is a real process started with the real CLIs; the table is read from the ``status.json`` each
node writes into its data dir. At the end every process gets SIGTERM and must exit 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

RUN_ID = "demo-run"
console = Console()


def start_backbone(data: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "backbone",
            "start",
            "--run-id",
            RUN_ID,
            "--data-dir",
            str(data / "backbone"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--no-mdns",
        ],
        stdout=subprocess.PIPE,
        stderr=open(data / "backbone.log", "w"),
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit(f"backbone did not start; see {data / 'backbone.log'}")
    return proc, line.removeprefix("listening on ").strip()


def start_volunteer(data: Path, index: int, backbone: str) -> subprocess.Popen[str]:
    name = f"volunteer{index}"
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "volunteer",
            "join",
            RUN_ID,
            "--initial-peer",
            backbone,
            "--data-dir",
            str(data / name),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--no-panel",
        ],
        stdout=open(data / f"{name}.log", "w"),
        stderr=subprocess.STDOUT,
        text=True,
    )


def table(data: Path, names: list[str], remaining: float) -> Table:
    t = Table(title=f"run {RUN_ID} on loopback — stopping in {remaining:.0f} s (Ctrl+C to stop now)")
    for column in ("node", "peer id", "peers", "conns", "DHT", "online", "RPC latency", "traffic ↑/↓"):
        t.add_column(column, justify="right" if column not in ("node", "peer id") else "left", no_wrap=True)
    for name in names:
        try:
            s = json.loads((data / name / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            t.add_row(name, "starting…", *[""] * 6)
            continue
        latency = "—" if s["rpc_latency_ms"] is None else f"{s['rpc_latency_ms']:.2f} ms"
        traffic = f"{s['bytes_sent'] / 1e3:.1f}/{s['bytes_received'] / 1e3:.1f} kB"
        t.add_row(
            name,
            s["peer_id"][:12] + "…",
            str(s["routing_table_size"]),
            str(s["connected_peers"]),
            f"≈{s['dht_size_estimate']}",
            str(s["members_online"]),
            latency,
            traffic,
        )
    return t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to run before stopping")
    parser.add_argument("--volunteers", type=int, default=3)
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="dedloc-demo-"))
    console.print(f"data dirs and logs: {data}")
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        procs["backbone"], address = start_backbone(data)
        console.print(f"backbone listening on {address}")
        for i in range(1, args.volunteers + 1):
            procs[f"volunteer{i}"] = start_volunteer(data, i, address)
        deadline = time.monotonic() + args.seconds
        with Live(table(data, list(procs), args.seconds), console=console, refresh_per_second=2) as live:
            while (left := deadline - time.monotonic()) > 0:
                dead = [n for n, p in procs.items() if p.poll() is not None]
                if dead:
                    raise SystemExit(f"{', '.join(dead)} stopped unexpectedly; logs are in {data}")
                live.update(table(data, list(procs), left))
                time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("interrupted")
    finally:
        console.print("stopping every node with SIGTERM…")
        for proc in reversed(procs.values()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        for name, code in codes.items():
            console.print(f"  {name}: exit code {code}")
    ok = all(code == 0 for code in codes.values())
    console.print("[green]all nodes left cleanly[/]" if ok else f"[red]some nodes failed; logs in {data}[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
