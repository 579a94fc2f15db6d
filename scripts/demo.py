"""A local collaboration on loopback: one backbone, N invited volunteers, a live table, a clean stop.

Each node is a real process started with the real CLIs: the backbone pins the run to its authority key,
``backbone allow add`` mints one invite per volunteer, and each ``volunteer join <run-id> --invite``
redeems it over the backbone's HTTPS API before joining the DHT. The table is read from the
``status.json`` each node writes into its data dir. At the end every process gets SIGTERM and must exit
0, and the allowlist is printed.
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

RUN_NAME = "demo-run"
console = Console()


def start_backbone(data: Path) -> tuple[subprocess.Popen[str], str]:
    """Start the backbone; return it and the pinned run id it prints."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "backbone",
            "start",
            "--run-id",
            RUN_NAME,
            "--data-dir",
            str(data / "backbone"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--api-listen",
            "127.0.0.1:0",
            "--no-mdns",
        ],
        stdout=subprocess.PIPE,
        stderr=open(data / "backbone.log", "w"),
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("run id "):
            return proc, line.removeprefix("run id ").strip()
    proc.kill()
    raise SystemExit(f"backbone did not start; see {data / 'backbone.log'}")


def invite(data: Path, username: str) -> str:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "backbone",
            "allow",
            "add",
            username,
            "--data-dir",
            str(data / "backbone"),
            "--note",
            "demo volunteer",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return str(json.loads(result.stdout)["invite"])


def start_volunteer(data: Path, name: str, run_id: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "volunteer",
            "join",
            run_id,
            "--invite",
            invite(data, name),
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


def table(data: Path, names: list[str], remaining: float, run_id: str) -> Table:
    t = Table(title=f"run {run_id} on loopback — stopping in {remaining:.0f} s (Ctrl+C to stop now)")
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


def stop_all(procs: dict[str, subprocess.Popen[str]]) -> dict[str, int]:
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
    return codes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to run before stopping")
    parser.add_argument("--volunteers", type=int, default=3)
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="dedloc-demo-"))
    console.print(f"data dirs and logs: {data}")
    procs: dict[str, subprocess.Popen[str]] = {}
    failed: list[str] = []
    try:
        procs["backbone"], run_id = start_backbone(data)
        console.print(f"backbone up: run id [bold]{run_id}[/] (pinned to its authority key)")
        for i in range(1, args.volunteers + 1):
            procs[f"volunteer{i}"] = start_volunteer(data, f"volunteer{i}", run_id)
        console.print(
            f"invited {args.volunteers} volunteers with `backbone allow add`; they join with their codes"
        )
        deadline = time.monotonic() + args.seconds
        with Live(
            table(data, list(procs), args.seconds, run_id), console=console, refresh_per_second=2
        ) as live:
            while (left := deadline - time.monotonic()) > 0:
                failed = [n for n, p in procs.items() if p.poll() is not None]
                if failed:
                    break
                live.update(table(data, list(procs), left, run_id))
                time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("interrupted")
    finally:
        codes = stop_all(procs)
    for name, code in codes.items():
        console.print(f"  {name}: exit code {code}")
    if procs:
        subprocess.run(
            [sys.executable, "-m", "backbone", "allow", "list", "--data-dir", str(data / "backbone")]
        )
    ok = not failed and all(code == 0 for code in codes.values())
    console.print(
        "[green]all nodes left cleanly[/]" if ok else f"[red]some nodes failed; logs are in {data}[/]"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
