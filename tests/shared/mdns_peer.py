"""A tiny mDNS peer for tests that run it inside a network namespace (see ``tests/shared/test_mdns.py``).

    python mdns_peer.py advertise --run RUN --peer PEER_ID --port PORT --address IP
        prints "advertising" once registered, withdraws the record and exits 0 on SIGTERM or SIGINT
    python mdns_peer.py discover --run RUN --wait SECONDS
        prints one JSON object: {"elapsed": s, "found": [Advertisement as dict], "threads": [names]}

The repository root must be importable (the tests set ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import threading
from collections.abc import AsyncIterator

import trio

from shared.discovery import advertise_run, discover_run


async def _cancel_on_signal(signals: AsyncIterator[int], scope: trio.CancelScope) -> None:
    async for _ in signals:
        scope.cancel()
        return


async def advertise(run: str, peer: str, port: int, address: str) -> None:
    # The receiver is open before registering, so a SIGTERM at any point still ends in a clean withdrawal.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_signal, signals, nursery.cancel_scope)
            async with advertise_run(run, peer, port, [address]):
                print("advertising", flush=True)
                await trio.sleep_forever()


async def discover(run: str, wait: float) -> None:
    started = trio.current_time()
    found = await discover_run(run, wait=wait)
    elapsed = trio.current_time() - started
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    report = {"elapsed": elapsed, "found": [dataclasses.asdict(ad) for ad in found], "threads": threads}
    print(json.dumps(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    adv = commands.add_parser("advertise")
    adv.add_argument("--run", required=True)
    adv.add_argument("--peer", required=True)
    adv.add_argument("--port", type=int, required=True)
    adv.add_argument("--address", required=True)
    disc = commands.add_parser("discover")
    disc.add_argument("--run", required=True)
    disc.add_argument("--wait", type=float, default=3.0)
    args = parser.parse_args()
    if args.command == "advertise":
        trio.run(advertise, args.run, args.peer, args.port, args.address)
        print("stopped", flush=True)
    else:
        trio.run(discover, args.run, args.wait)


if __name__ == "__main__":
    main()
