"""The bulk lane between two Hosts on loopback (shared.net.bulk, shared.net.host, TlsSocket threads)."""

from __future__ import annotations

import array
import hashlib
import os
import random
import threading
from typing import Any

import pytest
import trio
import trio.testing

from protocols.bulk import BulkHeader
from protocols.codes import ErrorCode
from protocols.errors import ProtocolError
from shared.errors import PeerUnavailable, RemoteError
from shared.net.bulk import BulkReader
from shared.net.host import Host, HostConfig
from shared.net.rpc import RequestContext
from shared.net.tls_socket import TlsSocket

from .conftest import StartHost, address_of

HANG_GUARD_S = 10  # only a guard against hangs; no test depends on how long anything takes
MiB = 1 << 20


class Sink:
    """A bulk handler that reads the whole transfer (or only ``read_limit`` bytes of it) and acks with
    the sha256 of what it read."""

    def __init__(self, read_limit: int | None = None) -> None:
        self.read_limit = read_limit
        self.received: list[tuple[RequestContext, BulkHeader, bytes]] = []

    async def __call__(self, ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
        n = header.nbytes if self.read_limit is None else min(self.read_limit, header.nbytes)
        buffer = bytearray(n)
        await reader.read_into(memoryview(buffer))
        self.received.append((ctx, header, bytes(buffer)))
        return b"sha256:" + hashlib.sha256(buffer).digest()


def _ack(data: bytes) -> bytes:
    return b"sha256:" + hashlib.sha256(data).digest()


async def _pair(start_host: StartHost, topic: str = "sink") -> tuple[Host, Host, Sink]:
    sender, receiver = await start_host(), await start_host()
    sink = Sink()
    receiver.bulk_handlers[topic] = sink
    return sender, receiver, sink


async def test_host_send_bulk_delivers_16_mib_intact_and_returns_ack_meta(start_host: StartHost) -> None:
    sender, receiver, sink = await _pair(start_host)
    data = random.Random(16).randbytes(16 * MiB)

    with trio.fail_after(HANG_GUARD_S):
        ack = await sender.send_bulk(address_of(receiver), "sink", data, meta=b"round 7")

    assert ack == _ack(data)
    [(ctx, header, received)] = sink.received
    assert hashlib.sha256(received).digest() == hashlib.sha256(data).digest()
    assert (header.topic, header.nbytes, header.meta) == ("sink", len(data), b"round 7")
    assert ctx.peer_id == sender.peer_id


async def test_host_statistics_count_the_bytes_of_bulk_lanes_too(start_host: StartHost) -> None:
    """The panel's traffic row and the metrics read these: the averaging's bulk transfers are most of a
    volunteer's traffic, and only RPC channels used to be counted."""
    sender, receiver, _ = await _pair(start_host)
    data = random.Random(3).randbytes(4 * MiB)
    before = (sender.statistics().bytes_sent, receiver.statistics().bytes_received)
    with trio.fail_after(HANG_GUARD_S):
        await sender.send_bulk(address_of(receiver), "sink", data)
        await sender.send_bulk(address_of(receiver), "sink", data)  # the same lane again
    sent = sender.statistics().bytes_sent - before[0]
    received = receiver.statistics().bytes_received - before[1]
    assert 2 * len(data) <= sent < 2 * len(data) + 64 * 1024, sent  # payload plus framing and handshakes
    assert 2 * len(data) <= received < 2 * len(data) + 64 * 1024, received


async def test_host_send_bulk_reuses_one_bulk_connection_for_sequential_transfers(
    start_host: StartHost,
) -> None:
    sender, receiver, sink = await _pair(start_host)
    payloads = [random.Random(i).randbytes(size) for i, size in enumerate((1, 300 * 1024, 3 * MiB, 17))]

    with trio.fail_after(HANG_GUARD_S):
        for data in payloads:
            assert await sender.send_bulk(address_of(receiver), "sink", data) == _ack(data)
            assert sender.statistics().idle_bulk_connections == 1

    assert [received for _, _, received in sink.received] == payloads
    assert sender.statistics().rpc_connections == 0  # bulk lanes are not RPC channels


async def test_host_send_bulk_raises_unknown_kind_for_unknown_topic_and_can_send_afterwards(
    start_host: StartHost,
) -> None:
    sender, receiver, _ = await _pair(start_host)

    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(RemoteError, match="no bulk handler for topic 'nobody-home'") as info:
            await sender.send_bulk(address_of(receiver), "nobody-home", b"x" * (8 << 20))  # > socket buffers
        assert sender.statistics().idle_bulk_connections == 0  # the refused lane was closed

        assert await sender.send_bulk(address_of(receiver), "sink", b"y" * 1024) == _ack(b"y" * 1024)

    assert info.value.code == ErrorCode.UNKNOWN_KIND


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ProtocolError("bad meta"), ErrorCode.BAD_REQUEST),
        (RemoteError(ErrorCode.FORBIDDEN, "no"), ErrorCode.FORBIDDEN),
    ],
)
async def test_host_send_bulk_raises_handler_refusal_as_remote_error(
    start_host: StartHost, error: Exception, code: ErrorCode
) -> None:
    sender, receiver, _ = await _pair(start_host)

    async def refuse(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
        raise error

    receiver.bulk_handlers["refuse"] = refuse

    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(RemoteError) as info:
            await sender.send_bulk(address_of(receiver), "refuse", b"z" * (8 << 20))
        assert await sender.send_bulk(address_of(receiver), "sink", b"ok") == _ack(b"ok")

    assert info.value.code == code


async def test_bulk_lane_discards_what_handler_leaves_unread_and_stays_consistent(
    start_host: StartHost,
) -> None:
    sender, receiver, sink = await _pair(start_host)
    partial = Sink(read_limit=1000)
    receiver.bulk_handlers["partial"] = partial
    first = random.Random(1).randbytes(2 * MiB + 5)
    second = random.Random(2).randbytes(MiB + 3)

    with trio.fail_after(HANG_GUARD_S):
        assert await sender.send_bulk(address_of(receiver), "partial", first) == _ack(first[:1000])
        assert await sender.send_bulk(address_of(receiver), "sink", second) == _ack(second)

    assert partial.received[0][2] == first[:1000]
    assert sink.received[0][2] == second
    assert sender.statistics().idle_bulk_connections == 1  # both transfers used the same lane


async def test_bulk_reader_refuses_to_read_past_the_transfer(start_host: StartHost) -> None:
    sender, receiver, _ = await _pair(start_host)
    errors: list[Exception] = []

    async def greedy(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
        try:
            await reader.read_into(memoryview(bytearray(header.nbytes + 1)))
        except ValueError as exc:
            errors.append(exc)
        buffer = bytearray(header.nbytes)
        await reader.read_into(memoryview(buffer))
        return bytes(buffer)

    receiver.bulk_handlers["greedy"] = greedy

    with trio.fail_after(HANG_GUARD_S):
        assert await sender.send_bulk(address_of(receiver), "greedy", b"exactly this") == b"exactly this"

    assert len(errors) == 1
    assert "only 12 remain" in str(errors[0])


async def test_host_send_bulk_sends_zero_bytes(start_host: StartHost) -> None:
    sender, receiver, sink = await _pair(start_host)

    with trio.fail_after(HANG_GUARD_S):
        assert await sender.send_bulk(address_of(receiver), "sink", b"", meta=b"empty") == _ack(b"")
        assert await sender.send_bulk(address_of(receiver), "sink", b"after") == _ack(b"after")

    assert [(header.nbytes, data) for _, header, data in sink.received] == [(0, b""), (5, b"after")]
    assert sender.statistics().idle_bulk_connections == 1


async def test_host_send_bulk_sends_typed_buffer_as_its_raw_bytes(start_host: StartHost) -> None:
    sender, receiver, sink = await _pair(start_host)
    values = array.array("f", [float(i) for i in range(100_000)])

    with trio.fail_after(HANG_GUARD_S):
        await sender.send_bulk(address_of(receiver), "sink", memoryview(values))

    assert sink.received[0][2] == values.tobytes()


# ---------------------------------------------------------------- cancellation


async def test_host_send_bulk_cancelled_midway_raises_cancelled_and_host_can_send_afterwards(
    start_host: StartHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender, receiver, _ = await _pair(start_host)
    entered, release = trio.Event(), trio.Event()
    worker_outcomes: list[BaseException | None] = []
    worker_sending, worker_done = threading.Event(), threading.Event()
    real_send = TlsSocket.send_all_blocking

    def observed_send(self: TlsSocket, data: Any, stall: float) -> None:
        worker_sending.set()
        try:
            real_send(self, data, stall)
        except BaseException as exc:
            worker_outcomes.append(exc)
            raise
        else:
            worker_outcomes.append(None)
        finally:
            worker_done.set()

    monkeypatch.setattr(TlsSocket, "send_all_blocking", observed_send)

    async def stalled_reader(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
        entered.set()
        await release.wait()  # read nothing: the sender's thread fills the socket buffers and blocks
        return b""

    receiver.bulk_handlers["stalled"] = stalled_reader
    big = bytes(64 * MiB)  # far more than loopback socket buffers hold

    with trio.fail_after(HANG_GUARD_S):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender.send_bulk, address_of(receiver), "stalled", big)
                await entered.wait()
                # the thread has the socket (a cancel before that would spare it the send altogether)
                assert await trio.to_thread.run_sync(worker_sending.wait, HANG_GUARD_S)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
        assert scope.cancelled_caught

        assert await trio.to_thread.run_sync(worker_done.wait, HANG_GUARD_S)  # it let go: not leaked
        release.set()
        assert sender.statistics().idle_bulk_connections == 0

        data = random.Random(3).randbytes(2 * MiB)
        assert await sender.send_bulk(address_of(receiver), "sink", data) == _ack(data)

    assert len(worker_outcomes) == 2
    assert isinstance(worker_outcomes[0], PeerUnavailable)  # aborted midway, not completed
    assert worker_outcomes[1] is None


async def test_bulk_send_cancelled_while_worker_blocked_closes_socket_only_after_worker_lets_go(
    start_host: StartHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fd must stay open while a worker thread may still use it, or the number can be reused by a
    # new connection under the thread's feet. A worker stuck in a syscall is modelled by one that waits.
    sender, receiver, _ = await _pair(start_host)
    started, resume = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}
    closed_by_worker = threading.Event()
    real_close_from_thread = TlsSocket.close_from_thread

    def stuck_send(self: TlsSocket, data: Any, stall: float) -> None:
        seen["tls"] = self
        started.set()
        resume.wait(HANG_GUARD_S)
        seen["fileno_when_worker_resumed"] = self._sock.fileno()
        raise PeerUnavailable("the shutdown made the blocked send fail")

    def observed_close_from_thread(self: TlsSocket) -> None:
        real_close_from_thread(self)
        closed_by_worker.set()

    monkeypatch.setattr(TlsSocket, "send_all_blocking", stuck_send)
    monkeypatch.setattr(TlsSocket, "close_from_thread", observed_close_from_thread)

    with trio.fail_after(HANG_GUARD_S):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender.send_bulk, address_of(receiver), "sink", b"x" * 1024)
                await trio.to_thread.run_sync(started.wait)
                scope.cancel()
        assert scope.cancelled_caught  # promptly, although the worker is still blocked

        tls: TlsSocket = seen["tls"]
        assert tls.closed  # no one may use it any more ...
        resume.set()
        assert await trio.to_thread.run_sync(closed_by_worker.wait, HANG_GUARD_S)

    assert seen["fileno_when_worker_resumed"] != -1  # ... but the fd stayed the worker's until it let go
    assert tls._sock.fileno() == -1  # and then it was closed


async def test_host_send_bulk_downloads_a_reply_payload_into_the_sink(start_host: StartHost) -> None:
    from shared.net.bulk import BulkReply

    sender, receiver = await start_host(), await start_host()
    reply = os.urandom(3 << 20)

    async def echo_back(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> BulkReply:
        buf = bytearray(header.nbytes)
        await reader.read_into(memoryview(buf))
        return BulkReply(b"here" + bytes(buf[:4]), memoryview(reply))

    receiver.bulk_handlers["swap"] = echo_back
    got = bytearray(len(reply))
    seen: list[tuple[bytes, int]] = []

    def sink(meta: bytes, nbytes: int) -> memoryview:
        seen.append((meta, nbytes))
        return memoryview(got)

    with trio.fail_after(HANG_GUARD_S):
        meta = await sender.send_bulk(address_of(receiver), "swap", b"abcd" * 1000, sink=sink)
        assert meta == b"hereabcd"
        assert got == reply
        assert seen == [(b"hereabcd", len(reply))]
        with pytest.raises(ProtocolError, match="unexpected reply payload"):
            await sender.send_bulk(address_of(receiver), "swap", b"x" * 10)  # no sink for the reply
        assert await sender.send_bulk(address_of(receiver), "swap", b"y" * 10, sink=sink) == b"hereyyyy"


async def test_abort_ends_accepted_bulk_lanes_so_a_waiting_sender_fails_at_once(
    start_host: StartHost,
) -> None:
    """A crash ends every connection, the ones others opened to us included: a sender waiting on our
    handler sees its connection end instead of waiting out its stall timeout."""
    sender, receiver = await start_host(), await start_host(HostConfig(bulk_stall=600))
    entered = trio.Event()

    async def wait_forever(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
        entered.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    receiver.bulk_handlers["wait"] = wait_forever
    async with trio.open_nursery() as nursery:

        async def abort_when_waiting() -> None:
            await entered.wait()
            receiver.abort()

        nursery.start_soon(abort_when_waiting)
        with trio.fail_after(HANG_GUARD_S), pytest.raises(PeerUnavailable):
            await sender.send_bulk(address_of(receiver), "wait", b"")


async def test_bulk_reader_notices_the_sender_closing_while_its_handler_waits(start_host: StartHost) -> None:
    """A handler that waits before answering learns when nobody waits for the answer any more."""
    sender, receiver = await start_host(), await start_host()
    noticed = trio.Event()

    async def wait_for_close(ctx: RequestContext, header: BulkHeader, reader: BulkReader) -> bytes:
        await reader.peer_closed()
        noticed.set()
        return b""

    receiver.bulk_handlers["wait"] = wait_for_close
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                with pytest.raises(PeerUnavailable):
                    await sender.send_bulk(address_of(receiver), "wait", b"")

            nursery.start_soon(send)
            await trio.sleep(0.2)
            assert not noticed.is_set()  # a live sender that sends nothing more is not "closed"
            sender.abort()
            await noticed.wait()
