"""A volunteer whose wire protocol is older than the run's is told, in one line, to upgrade.

A fake node of a newer protocol version (real TLS with its identity certificate, then a ``ServerHello``
envelope of version ``PROTOCOL_VERSION + 1``) listens on loopback. Dialing it raises
:class:`~protocols.errors.WrongVersion` naming both versions; a real ``volunteer join`` process given it
as its initial peer exits 1 with exactly one error line, ending ``upgrade dedloc: this run speaks protocol
N, you speak M`` (after "no initial peer could be reached: <address>: "). No mock of the dialing side:
the newer peer is simulated by the bytes it sends.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

import msgspec
import pytest
import trio

from protocols.envelope import FRAME_HEADER, PROTOCOL_VERSION, Envelope, Flags, encode_payload
from protocols.errors import WrongVersion
from protocols.handshake import ServerHello
from shared.auth.keys import Identity
from shared.errors import PeerUnavailable
from shared.net.addresses import parse_multiaddr
from shared.net.connection import LocalEndpoint, dial
from shared.net.tls_socket import TlsSocket

RUN = "wire-version-test"
NEWER = PROTOCOL_VERSION + 1


async def serve_newer_node(endpoint: LocalEndpoint, *, task_status: trio.TaskStatus[str]) -> None:
    """Accept connections forever; greet each in protocol ``NEWER`` and wait for the dialer to leave."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    task_status.started(f"/ip4/127.0.0.1/tcp/{port}/p2p/{endpoint.peer_id}")
    hello = encode_payload(ServerHello(run_id=RUN, nonce=b"n" * 32))
    body = msgspec.msgpack.encode(Envelope(NEWER, ServerHello.kind, 0, int(Flags.NOTIFY), msgspec.Raw(hello)))
    with listener:
        while True:
            await trio.lowlevel.wait_readable(listener)
            raw, address = listener.accept()
            tls = await TlsSocket.handshake(raw, endpoint.server_ctx, server_side=True, peer=str(address))
            try:
                await tls.send_all(FRAME_HEADER.pack(len(body)) + body)
                with trio.move_on_after(30), contextlib.suppress(PeerUnavailable):
                    await tls.receive_into(memoryview(bytearray(1)))  # until the dialer hangs up
            finally:
                tls.close()


async def test_dialing_a_newer_node_says_upgrade_with_both_versions() -> None:
    newer = LocalEndpoint(Identity.generate(), RUN)
    async with trio.open_nursery() as nursery:
        maddr = await nursery.start(serve_newer_node, newer)
        me = LocalEndpoint(Identity.generate(), RUN)
        with pytest.raises(WrongVersion) as info:
            await dial(me, parse_multiaddr(maddr), "rpc")
        assert (
            str(info.value)
            == f"upgrade dedloc: this run speaks protocol {NEWER}, you speak {PROTOCOL_VERSION}"
        )
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_volunteer_join_against_a_newer_run_exits_with_one_upgrade_line(tmp_path: Path) -> None:
    newer = LocalEndpoint(Identity.generate(), RUN)
    async with trio.open_nursery() as nursery:
        maddr = await nursery.start(serve_newer_node, newer)
        with trio.fail_after(180):
            done = await trio.run_process(
                [
                    sys.executable,
                    "-m",
                    "volunteer",
                    "join",
                    RUN,
                    "--initial-peer",
                    maddr,
                    "--data-dir",
                    str(tmp_path / "vol"),
                    "--listen",
                    "/ip4/127.0.0.1/tcp/0",
                    "--no-panel",
                ],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env={**os.environ, "COLUMNS": "200"},
            )
        nursery.cancel_scope.cancel()
    lines = [line for line in done.stderr.decode().splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr.decode()
    [error] = [line for line in lines if line.startswith("error:")]
    assert error == lines[-1]
    assert error.endswith(f"upgrade dedloc: this run speaks protocol {NEWER}, you speak {PROTOCOL_VERSION}")
