"""A userspace delay wire: the latency emulation of ``tests/netns.py`` on a kernel without ``netem``.

**Why userspace.** This kernel has no ``netem``, ``fq`` or ``fq_codel`` (only ``tbf``, ``htb`` and ``pfifo``),
so no qdisc can hold a packet back for a fixed time, and a BPF program that sets departure times would need
``fq`` to honour them. What remains is a process that holds frames in memory: this one.

**The wire.** ``python netdelay.py A B DELAY_MS`` joins two network devices ``A`` and ``B`` (in the namespace
it runs in) like a cable of one-way latency ``DELAY_MS`` in each direction: every frame received on one is
sent on the other ``DELAY_MS`` later, first in first out. It opens one ``AF_PACKET``/``SOCK_RAW`` socket per
device, bound to ``ETH_P_ALL``, with

* ``PACKET_VNET_HDR``: each frame carries a ``virtio_net_hdr`` with its segmentation-offload (GSO) and
  checksum-offload state, and is sent with it, so a 64 KiB TCP super-packet crosses whole and is cut into
  MTU-sized segments (if ever) where the kernel would cut it anyway; without it such frames cannot be sent
  back (``EMSGSIZE``) and partial checksums would arrive unfinished;
* ``PACKET_IGNORE_OUTGOING``: the socket does not see frames leaving its own device (the ones this wire
  sends, or anything the namespace's own stack might send), so nothing loops;
* ``SO_RCVBUFFORCE`` of 8 MiB, so a burst that arrives while the process waits for the CPU queues in the
  kernel instead of being dropped.

The socket is created listening to no protocol and bound to ``ETH_P_ALL`` on its device only after its
options are set, so it never sees another device's frames.

**Timing.** A frame's due time is its kernel receive time (``SO_TIMESTAMPNS``, converted to
``time.monotonic``) plus the delay, so a frame that waits in the socket buffer keeps its place in time. With
nothing queued the loop sleeps in ``poll`` on both sockets; with frames queued it sleeps only until the
earliest is due (arrivals do not wake it: their timestamps say when they came), then drains both sockets
without blocking (up to :data:`DRAIN` frames each) and sends every frame due within :data:`EARLY`. The
``poll`` timeout is rounded to the nearest millisecond, so each frame leaves within about half a millisecond
of its due time, early or late, with a mean error near zero (rounding up instead made every round trip,
which crosses four wires, ~4 ms long; aligning departures to a 2 ms grid saved no measurable CPU). The
delay line is unbounded: it is a cable, not a bottleneck, and holds ``rate x delay`` bytes; rate limits and
their queues belong to ``tbf``. Frames are late by the process's scheduling latency, which is why
``tests/netns.py`` starts it with a raised priority (``--nice``).

**Cost.** Every frame costs a ``recvmsg``, a ``send`` and, at these rates, mostly a wake-up of its own:
30-70 us of CPU per frame on a 2-core VM, about half of it system time, which includes the kernel forwarding
the sent frame onward (work the sender's own ``send`` would do without a wire). Measured there under a load
average of 8-17 (other jobs): one 100 Mbit/s TCP flow on 50 ms, ~1500 frames/s, ~8-10% of a core per wire
(user ~4-5%); one 10 Mbit/s flow ~5%; 12 hosts each sending and receiving 10 Mbit/s at once ~0.7 core for
all 12 wires together, 24 such hosts ~0.7 (the machine saturated: more frames per wake-up), 24 at 2 Mbit/s
~0.5. TCP frames are not MTU-sized: segmentation offload hands the wire up to 64 KiB at a time, fewer bytes
the lower the rate.

**Lifetime.** It prints ``ready`` once both sockets are bound, and runs until its standard input reaches end
of file (the parent closed it, or died), then exits 0. Any socket error (a device deleted, a frame the
kernel refuses) ends it with status 1 and the error on stderr: a dead wire is a broken link, and its
parent's check (``tests/netns.py``) reports it rather than letting the link go silently dark.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
SO_SNDBUFFORCE = 32  # Linux values; the socket module lacks these two
SO_RCVBUFFORCE = 33
SO_TIMESTAMPNS = 35
BUFFER = 8 << 20
"""Kernel receive and send buffer of each socket, bytes."""
FRAME_MAX = 1 << 18
"""Largest frame read: a GSO super-packet (64 KiB on veth) plus its headers fits with room to spare."""
DRAIN = 256
"""Most frames read from one socket per wake-up (the rest wait, keeping their receive times)."""
EARLY = 0.0005
"""A frame may leave this much before its due time, so that frames due within one poll tick share a
wake-up."""

T = TypeVar("T")


@dataclass
class DelayLine(Generic[T]):
    """A FIFO that releases each item ``delay`` seconds after it was pushed.

    Pure: the caller passes the clock. Items pushed with non-decreasing ``now`` come out in push order,
    none before its due time ``now + delay``, each exactly once.
    """

    delay: float
    _queue: deque[tuple[float, T]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if not (self.delay >= 0 and self.delay < 3600):
            raise ValueError(f"a delay must be in [0, 3600) seconds, got {self.delay!r}")

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, item: T, now: float) -> None:
        """Queue ``item``, received at ``now`` (due no earlier than the item before it: a FIFO)."""
        due = now + self.delay
        if self._queue and due < self._queue[-1][0]:
            due = self._queue[-1][0]
        self._queue.append((due, item))

    def next_due(self) -> float | None:
        """When the oldest item is due; ``None`` if empty."""
        return self._queue[0][0] if self._queue else None

    def pop_due(self, now: float) -> list[T]:
        """Remove and return, oldest first, every item due at or before ``now``."""
        out: list[T] = []
        queue = self._queue
        while queue and queue[0][0] <= now:
            out.append(queue.popleft()[1])
        return out


def poll_timeout_ms(due: float | None, now: float) -> int | None:
    """``poll`` timeout until ``due`` (``None``: none), in milliseconds rounded to the nearest: with
    :data:`EARLY` of slack on sending, a wake-up is within half a millisecond of each due time, and
    never a zero timeout with nothing yet to send (no spinning)."""
    if due is None:
        return None
    return max(0, int((due - now) * 1000 + 0.5))


def open_port(device: str) -> socket.socket:
    """A raw packet socket on ``device`` that carries the offload state (see the module docstring)."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    try:
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, BUFFER)
        sock.bind((device, ETH_P_ALL))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"packet socket on {device}: {exc.strerror}") from exc
    return sock


def arrival(ancdata: list[tuple[int, int, bytes]], real_now: float, mono_now: float) -> float:
    """A frame's kernel receive time (``SCM_TIMESTAMPNS``, wall clock) on the monotonic clock; ``mono_now``
    if it has none or it lies in the future (a wall-clock step)."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack_from("qq", data)
            stamp = float(sec) + float(nsec) * 1e-9
            return mono_now - max(0.0, real_now - stamp)
    return mono_now


def run_wire(a: str, b: str, delay_s: float, control: int) -> None:
    """Forward frames between devices ``a`` and ``b`` with ``delay_s`` one way, until ``control`` (a file
    descriptor) reaches end of file."""
    ports = (open_port(a), open_port(b))
    names = (a, b)
    lines: tuple[DelayLine[bytes], DelayLine[bytes]] = (DelayLine(delay_s), DelayLine(delay_s))
    # lines[k] holds frames received on ports[k], to be sent on ports[1 - k]
    idle = select.poll()  # nothing queued: wait for a frame (or the end)
    for port in ports:
        idle.register(port.fileno(), select.POLLIN)
    idle.register(control, select.POLLIN)
    timed = select.poll()  # frames queued: wait for the next due time (or the end), not for arrivals
    timed.register(control, select.POLLIN)
    buf = bytearray(FRAME_MAX)
    view = memoryview(buf)
    anc = socket.CMSG_SPACE(16)
    flags = socket.MSG_DONTWAIT | socket.MSG_TRUNC
    print("ready", flush=True)
    while True:
        dues = [d for d in (lines[0].next_due(), lines[1].next_due()) if d is not None]
        events = timed.poll(poll_timeout_ms(min(dues), time.monotonic())) if dues else idle.poll()
        for fd, mask in events:
            if fd == control:
                if not os.read(control, 4096):
                    return
            elif mask & (select.POLLERR | select.POLLNVAL):
                raise OSError(f"packet socket on {names[[p.fileno() for p in ports].index(fd)]} failed")
        real_now, mono_now = time.time(), time.monotonic()
        for k in (0, 1):
            sock, line = ports[k], lines[k]
            for _ in range(DRAIN):
                try:
                    n, ancdata, _, _ = sock.recvmsg_into([buf], anc, flags)
                except BlockingIOError:
                    break
                if n > FRAME_MAX:
                    raise OSError(f"a {n}-byte frame on {names[k]} exceeds the {FRAME_MAX}-byte buffer")
                line.push(bytes(view[:n]), arrival(ancdata, real_now, mono_now))
        horizon = time.monotonic() + EARLY
        for k in (0, 1):
            out = ports[1 - k]
            for frame in lines[k].pop_due(horizon):
                out.send(frame)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Join two network devices with a delay (see docstring).")
    parser.add_argument("a", help="one device")
    parser.add_argument("b", help="the other device")
    parser.add_argument("delay_ms", type=float, help="one-way delay in each direction, milliseconds")
    parser.add_argument("--nice", type=int, default=0, help="added to the process's nice value first")
    args = parser.parse_args(argv)
    try:
        if args.nice:
            os.nice(args.nice)
        run_wire(args.a, args.b, args.delay_ms / 1000, sys.stdin.fileno())
    except (OSError, ValueError) as exc:
        print(f"netdelay {args.a}<->{args.b}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
