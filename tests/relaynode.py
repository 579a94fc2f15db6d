"""One network node for the relay and hole-punching tests and ``scripts/bench_relay.py``, run in a namespace.

``python -m tests.relaynode ROLE ...`` prints one JSON line when it is ready and, for the serving roles,
one more when its stdin closes (then it exits):

* ``relay --listen IP``: a Host running :class:`~shared.net.relay.RelayService` (generous limits), also
  serving the echo RPC and the ``sink`` bulk topic; prints ``{"addr": multiaddr}``.
* ``target --listen IP [--relay MULTIADDR]``: a Host serving echo and ``sink``, holding a reservation at
  the relay (renewed) and answering hole punches; prints ``{"addr": direct, "relayed": relayed}``, and at
  the end ``{"kinds": {peer: kind}, "punch": PunchStatistics}``.
* ``dial --listen IP --target MULTIADDR [--relay MULTIADDR] [--rpcs N] [--bulk-mb M] [--punch]``: connects
  (one echo), times ``N`` sequential echo calls, sends ``M`` MiB to ``sink``, then, with ``--punch``, punches
  and times the echo calls (and, with ``--punch``, the transfer: over a punched bulk connection when the
  punch worked) again; prints everything measured as one JSON object and exits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import sys
from dataclasses import asdict
from typing import Any, ClassVar

import trio

from protocols.bulk import BulkHeader
from protocols.envelope import Message, Request, register
from shared.auth.keys import Identity
from shared.net.addresses import PeerAddress, parse_multiaddr
from shared.net.bulk import BulkReader
from shared.net.host import Host, HostConfig
from shared.net.punch import HolePuncher
from shared.net.relay import RelayClient, RelayLimits, RelayService
from shared.net.rpc import RequestContext

RUN_ID = "relaynode"
MiB = 1 << 20


@register
class NodeEchoReply(Message, frozen=True, kw_only=True):
    kind: ClassVar[str] = "test.relaynode.echo.ok"
    text: str
    via: str  # how the server sees the connection the request came on
    seen_from: str  # ... and the ip:port it comes from, as the server's kernel has it


@register
class NodeEcho(Request, frozen=True, kw_only=True):
    kind: ClassVar[str] = "test.relaynode.echo"
    response: ClassVar[type[Message]] = NodeEchoReply
    text: str


def _serve_echo_and_sink(host: Host) -> None:
    async def echo(ctx: RequestContext, request: NodeEcho) -> NodeEchoReply:
        channel = host.channel_for(ctx.peer_id)
        if channel is None:
            return NodeEchoReply(text=request.text, via="?", seen_from="")
        return NodeEchoReply(
            text=request.text, via=channel.conn.via, seen_from=channel.conn.tls.socket_peer()
        )

    async def sink(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
        buffer = bytearray(header.nbytes)
        await reader.read_into(memoryview(buffer))
        return hashlib.sha256(buffer).digest()

    host.registry.add(NodeEcho, echo)
    host.bulk_handlers["sink"] = sink


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def _stdin_closed() -> None:
    await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


def _config() -> HostConfig:
    return HostConfig(dial_deadline=10.0, accept_deadline=10.0, bulk_stall=20.0)


async def _relay(args: argparse.Namespace) -> None:
    host = Host(Identity.generate(), RUN_ID, _config())
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run, [f"/ip4/{args.listen}/tcp/0"])
        service = RelayService(host, RelayLimits(max_circuit_bytes=1 << 34))
        _serve_echo_and_sink(host)
        _emit({"addr": host.listen_addrs[0]})
        await _stdin_closed()
        stats = service.statistics()
        _emit({"relay": asdict(stats)})
        nursery.cancel_scope.cancel()


async def _target(args: argparse.Namespace) -> None:
    host = Host(Identity.generate(), RUN_ID, _config())
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run, [f"/ip4/{args.listen}/tcp/0"])
        _serve_echo_and_sink(host)
        out: dict[str, Any] = {"addr": host.listen_addrs[0], "peer_id": host.peer_id}
        puncher = None
        if args.relay:
            relay = parse_multiaddr(args.relay)
            client = RelayClient(host)
            puncher = HolePuncher(host, relay)
            await nursery.start(client.keep, relay)
            out["relayed"] = str(client.addresses()[0])
        _emit(out)
        await _stdin_closed()
        kinds = {peer: host.connection_kind(peer) for peer in host.connected_peers()}
        peers = {peer: _socket_peer(host, peer) for peer in host.connected_peers()}
        _emit(
            {
                "kinds": kinds,
                "socket_peers": peers,
                "punch": asdict(puncher.statistics()) if puncher else None,
            }
        )
        nursery.cancel_scope.cancel()


def _socket_peer(host: Host, peer: Any) -> str:
    channel = host.channel_for(peer)
    return channel.conn.tls.socket_peer() if channel is not None else ""


async def _echo_ms(host: Host, address: PeerAddress, n: int) -> list[float]:
    times = []
    for i in range(n):
        start = trio.current_time()
        reply = await host.call(address, NodeEcho(text=str(i)))
        assert isinstance(reply, NodeEchoReply) and reply.text == str(i)
        times.append((trio.current_time() - start) * 1000)
    return times


async def _bulk_MBps(host: Host, target: PeerAddress, mb: int) -> float:
    data = bytes(mb * MiB)
    start = trio.current_time()
    ack = await host.send_bulk(target, "sink", data)
    seconds = trio.current_time() - start
    assert ack == hashlib.sha256(data).digest()
    return mb * MiB / 1e6 / seconds


async def _dial(args: argparse.Namespace) -> None:
    host = Host(Identity.generate(), RUN_ID, _config())
    target = parse_multiaddr(args.target)
    assert target.peer_id is not None
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run, [f"/ip4/{args.listen}/tcp/0"])
        _serve_echo_and_sink(host)
        puncher = HolePuncher(host, parse_multiaddr(args.relay)) if args.relay else None
        with trio.fail_after(args.deadline):
            start = trio.current_time()
            reply = await host.call(target, NodeEcho(text="hello"))
            assert isinstance(reply, NodeEchoReply)
            out["connect_ms"] = (trio.current_time() - start) * 1000
            out["kind"] = host.connection_kind(target.peer_id)
            out["server_sees"] = reply.via
            out["server_seen_from"] = reply.seen_from
            if args.rpcs:
                times = await _echo_ms(host, target, args.rpcs)
                out["rpc_ms_median"] = statistics.median(times)
                out["rpc_ms_max"] = max(times)
            if args.bulk_mb and not args.punch:
                out["bulk_MBps"] = await _bulk_MBps(host, target, args.bulk_mb)
            if args.punch and puncher is not None:
                start = trio.current_time()
                out["punched"] = await puncher.punch(target.peer_id)
                out["punch_ms"] = (trio.current_time() - start) * 1000
                out["punch"] = asdict(puncher.statistics())
                out["kind_after"] = host.connection_kind(target.peer_id)
                out["socket_peer_after"] = _socket_peer(host, target.peer_id)
                reply = await host.call(target, NodeEcho(text="after"))
                assert isinstance(reply, NodeEchoReply)
                out["server_sees_after"] = reply.via
                out["server_seen_from_after"] = reply.seen_from
                if args.rpcs:
                    times = await _echo_ms(host, target, args.rpcs)
                    out["rpc_ms_median_after"] = statistics.median(times)
                    out["rpc_ms_max_after"] = max(times)
                if args.bulk_mb:
                    out["bulk_MBps_after"] = await _bulk_MBps(host, target, args.bulk_mb)
                    out["punch_after_bulk"] = asdict(puncher.statistics())
        _emit(out)
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tests.relaynode")
    parser.add_argument("role", choices=["relay", "target", "dial"])
    parser.add_argument("--listen", default="0.0.0.0")
    parser.add_argument("--relay", default="")
    parser.add_argument("--target", default="")
    parser.add_argument("--rpcs", type=int, default=0)
    parser.add_argument("--bulk-mb", type=int, default=0)
    parser.add_argument("--punch", action="store_true")
    parser.add_argument("--deadline", type=float, default=120.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run({"relay": _relay, "target": _target, "dial": _dial}[args.role], args)


if __name__ == "__main__":
    main()
