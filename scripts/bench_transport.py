"""Transport benchmark: bulk throughput of the engine's secure path vs trio's SSLStream vs raw TCP.

All in one process on loopback, same run, each repeated and reported as the median MB/s (1 MB = 1e6 B):

* ``secure_MBps`` — the engine's bulk lane: ``Host.send_bulk`` to a handler that reads into a
  preallocated buffer (TLS 1.3, identity-authenticated, C-level SSL in worker threads).
* ``trio_sslstream_MBps`` — ``trio.SSLStream`` over trio TCP with the same TLS contexts.
* ``raw_tcp_MBps`` — plain TCP, blocking sockets in two threads (the ceiling on this machine).
* ``rpc_roundtrip_us_median`` — one small RPC on a warm connection.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols.bulk import BulkHeader
from protocols.dht import PingRequest, PingResponse
from shared.auth.keys import Identity
from shared.net.addresses import parse_multiaddr
from shared.net.bulk import BulkReader
from shared.net.host import Host
from shared.net.rpc import RequestContext
from shared.net.tls import client_context, server_context

CHUNK = 1 << 20


async def bench_secure(payload: memoryview, repeats: int) -> tuple[list[float], list[float]]:
    sender, receiver = Host(Identity.generate(), "bench"), Host(Identity.generate(), "bench")
    sink = bytearray(len(payload))

    async def read_all(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
        await reader.read_into(memoryview(sink)[: header.nbytes])
        return b"ok"

    async def pong(ctx: RequestContext, request: PingRequest) -> PingResponse:
        return PingResponse()

    receiver.bulk_handlers["bench"] = read_all
    receiver.registry.add(PingRequest, pong)
    times, rtts = [], []
    async with trio.open_nursery() as nursery:
        await nursery.start(sender.run)
        await nursery.start(receiver.run)
        address = parse_multiaddr(receiver.listen_addrs[0])
        await sender.send_bulk(address, "bench", payload[:CHUNK])  # connect and warm up
        for _ in range(repeats):
            t0 = time.perf_counter()
            await sender.send_bulk(address, "bench", payload)
            times.append(time.perf_counter() - t0)
        if sink != payload:
            raise SystemExit("secure path corrupted the payload")
        for _ in range(2000):
            t0 = time.perf_counter()
            await sender.call(address, PingRequest())
            rtts.append(time.perf_counter() - t0)
        nursery.cancel_scope.cancel()
    return times, rtts


async def bench_sslstream(payload: memoryview, repeats: int) -> list[float]:
    server_ctx, _ = server_context(Identity.generate())
    client_ctx = client_context()
    times: list[float] = []
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    done = trio.Event()

    async def serve(stream: trio.SocketStream) -> None:
        tls = trio.SSLStream(stream, server_ctx, server_side=True)
        await tls.do_handshake()
        for _ in range(repeats):
            remaining = len(payload)
            while remaining:
                remaining -= len(await tls.receive_some(256 * 1024))
            await tls.send_all(b"k")
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve, listeners)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        tls = trio.SSLStream(stream, client_ctx, server_side=False)
        await tls.do_handshake()
        for _ in range(repeats):
            t0 = time.perf_counter()
            for start in range(0, len(payload), CHUNK):
                await tls.send_all(payload[start : start + CHUNK])
            await tls.receive_some(1)
            times.append(time.perf_counter() - t0)
        await done.wait()
        nursery.cancel_scope.cancel()
    return times


def bench_raw_tcp(payload: memoryview, repeats: int) -> list[float]:
    listener = socket.create_server(("127.0.0.1", 0))
    times: list[float] = []

    def serve() -> None:
        conn, _ = listener.accept()
        buf = bytearray(CHUNK * 4)
        with conn:
            for _ in range(repeats):
                remaining = len(payload)
                while remaining:
                    remaining -= conn.recv_into(buf, min(len(buf), remaining))
                conn.sendall(b"k")

    thread = threading.Thread(target=serve)
    thread.start()
    with socket.create_connection(listener.getsockname()) as client:
        for _ in range(repeats):
            t0 = time.perf_counter()
            client.sendall(payload)
            client.recv(1)
            times.append(time.perf_counter() - t0)
    thread.join()
    listener.close()
    return times


def mbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=256, help="megabytes per transfer")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    payload = memoryview(os.urandom(args.mb * 1_000_000))
    secure, rtts = trio.run(bench_secure, payload, args.repeats)
    sslstream = trio.run(bench_sslstream, payload, args.repeats)
    raw = bench_raw_tcp(payload, args.repeats)
    result = {
        "mb": args.mb,
        "repeats": args.repeats,
        "secure_MBps": mbps(len(payload), secure),
        "trio_sslstream_MBps": mbps(len(payload), sslstream),
        "raw_tcp_MBps": mbps(len(payload), raw),
        "secure_vs_sslstream": statistics.median(sslstream) / statistics.median(secure),
        "rpc_roundtrip_us_median": statistics.median(rtts) * 1e6,
        "all_MBps": {
            "secure": [len(payload) / t / 1e6 for t in secure],
            "trio_sslstream": [len(payload) / t / 1e6 for t in sslstream],
            "raw_tcp": [len(payload) / t / 1e6 for t in raw],
        },
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
