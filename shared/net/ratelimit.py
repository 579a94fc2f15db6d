"""Upload and download caps for a whole node: one token bucket each way, shared by all its connections
(issue 15: a volunteer's ``--max-upload`` / ``--max-download``, as BOINC's network preferences).

**The bucket** (:class:`TokenBucket`, pure: the caller passes the time). It holds ``tokens`` bytes, at most
``burst``, refilled at ``rate`` bytes/s. A request for ``n`` bytes at time ``t`` (``0 < n <= burst``)::

    tokens <- min(burst, tokens + rate * (t - last)) - n        (may go below 0: a queue of reservations)
    delay  <- max(0, -tokens / rate);   the bytes may move at  g = t + delay

**The bound.** For any schedule of requests, the bytes granted in any interval ``[a, b]`` of grant times
are at most ``rate * (b - a) + burst``. Why: with ``V(s)`` the bucket as it would be at time ``s`` had no
later request come (tokens refilled to ``s``), every grant at ``g`` leaves ``V(g) >= 0`` after its
deduction (the delay is exactly what refills the debt), grants happen in request order (a queued request
is granted ``n / rate`` after the one before it; the bucket never returns a grant before the previous
one, which float rounding alone could do by an ulp), and between grants ``V`` grows by at most
``rate * (b - a)`` and never exceeds ``burst``; so what the grants in ``[a, b]`` took is at most
``V(a) + rate * (b - a) - V(b) <= burst + rate * (b - a)``. Over a long busy stretch the rate is therefore
``rate``, and it is also reached: a request that finds ``tokens >= n`` waits 0, and queued ones are
granted exactly ``n / rate`` apart (tests/shared/net/test_ratelimit.py checks both with hypothesis).

**Where the bytes are held** (:class:`Throttle`, the trio side; sleeps are ``trio.sleep``, never a busy
loop). :class:`~shared.net.tls_socket.TlsSocket` is the one place every byte of a peer connection passes
(RPC frames, bulk transfers, the DHT, state downloads, averaging; relayed and punched connections too), and
each socket of a host holds that host's throttle:

* *upload*: before sending a piece of at most :attr:`RateLimit.quantum` bytes, :meth:`RateLimit.acquire`
  reserves it and sleeps until its grant; so sends obey the bound above.
* *download*: a read cannot know its size before it happens, and a read's bytes must never be lost to a
  cancelled sleep. So a read first waits until the bucket is out of debt (:meth:`RateLimit.wait_ready`,
  cancellable: nothing read yet), then reads at most ``quantum`` bytes and charges what came
  (:meth:`RateLimit.charge`, no wait). The next read of any connection pays the debt. The long-run rate is
  the same; a short window may see ``k`` extra quanta for ``k`` connections reading at once. Reading
  slower leaves the bytes in the kernel's receive buffer, TCP's flow control closes the window, and the
  sender slows down: the cap holds on the wire, give or take one receive buffer.
* bulk transfers (worker threads, :mod:`shared.net.bulk`) are cut into quanta that are acquired on the
  trio side before each piece is handed to a thread (a bulk read's size is known, so it is reserved
  before it is read).

Not capped: bytes a ``--relay`` volunteer splices between two other peers (:mod:`shared.net.relay`), and
the TLS handshake's few kilobytes.

**Sizes.** ``burst = max(64 KiB, rate x 0.1 s)``: the cap holds within a tenth of a second, and one
piece always fits. ``quantum = clamp(rate x 0.02 s, 16 KiB, 1 MiB)``: small enough for smooth pacing,
large enough that a bulk transfer costs few thread hand-offs (at 100 MB/s: 100 per second).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import trio

__all__ = ["BURST_SECONDS", "RateLimit", "Throttle", "TokenBucket", "burst_for", "quantum_for"]

#: The bucket holds this much of the rate (module docstring, "Sizes").
BURST_SECONDS = 0.1
MIN_BURST = 64 * 1024
QUANTUM_SECONDS = 0.02
MIN_QUANTUM = 16 * 1024
MAX_QUANTUM = 1024 * 1024


def burst_for(rate: float) -> float:
    """The bucket's size for ``rate`` bytes/s."""
    return max(float(MIN_BURST), rate * BURST_SECONDS)


def quantum_for(rate: float) -> int:
    """The largest piece sent or read at once under a cap of ``rate`` bytes/s (never above the burst)."""
    return int(min(MAX_QUANTUM, max(MIN_QUANTUM, rate * QUANTUM_SECONDS)))


def _check_rate(rate: float) -> None:
    if not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"a rate limit must be a finite number of bytes/s above 0, got {rate!r}")


class TokenBucket:
    """The pure bucket of the module docstring: no clock, no I/O. Times are seconds on any monotonic clock.

    Raises:
        ValueError: ``rate`` or ``burst`` is not finite and above 0.
    """

    def __init__(self, rate: float, burst: float) -> None:
        _check_rate(rate)
        if not (math.isfinite(burst) and burst > 0):
            raise ValueError(f"a burst must be a finite number of bytes above 0, got {burst!r}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = self.burst  # full at first: a fresh node may send its first burst at once
        self._last: float | None = None
        self._granted = -math.inf  # the latest grant time so far

    def tokens(self, now: float) -> float:
        """The tokens at ``now`` (negative: reservations are queued); ``now`` never goes back."""
        if self._last is None:
            return self._tokens
        return min(self.burst, self._tokens + self.rate * max(0.0, now - self._last))

    def _refill(self, now: float) -> None:
        self._tokens = self.tokens(now)
        self._last = now if self._last is None else max(self._last, now)

    def reserve(self, n: float, now: float) -> float:
        """Take ``n`` bytes (``0 <= n <= burst``) at ``now``; the seconds to wait before they may move."""
        if not 0 <= n <= self.burst:
            raise ValueError(f"a reservation is 0 to {self.burst:.0f} bytes (the burst), got {n!r}")
        self._refill(now)
        self._tokens -= n
        # in request order exactly: the delay's rounding alone may put a grant an ulp before the last one
        self._granted = max(now + max(0.0, -self._tokens / self.rate), self._granted)
        return self._granted - now

    def charge(self, n: float, now: float) -> None:
        """Take ``n >= 0`` bytes that already moved (a read: its size is known only afterwards)."""
        if not n >= 0:
            raise ValueError(f"a charge is 0 bytes or more, got {n!r}")
        self._refill(now)
        self._tokens -= n

    def delay(self, now: float) -> float:
        """The seconds until the bucket is out of debt (0: it is)."""
        return max(0.0, -self.tokens(now) / self.rate)


class RateLimit:
    """A :class:`TokenBucket` for trio tasks: ``rate`` bytes/s, burst and quantum from the module docstring.

    All its methods run on the trio thread (bulk worker threads never touch it), so it needs no lock.
    ``clock`` is injectable for tests; it defaults to trio's.

    Raises:
        ValueError: ``rate`` is not finite and above 0.
    """

    def __init__(self, rate: float, clock: Callable[[], float] = trio.current_time) -> None:
        _check_rate(rate)
        self.bucket = TokenBucket(rate, burst_for(rate))
        self.quantum = quantum_for(rate)
        self._clock = clock

    @property
    def rate(self) -> float:
        return self.bucket.rate

    async def acquire(self, n: int) -> None:
        """Sleep until ``n`` bytes may move (pieces of at most a burst are reserved one after another)."""
        while n > 0:
            piece = min(n, int(self.bucket.burst))
            delay = self.bucket.reserve(piece, self._clock())
            if delay > 0:
                await trio.sleep(delay)
            n -= piece
        await trio.lowlevel.checkpoint_if_cancelled()

    async def wait_ready(self) -> None:
        """Sleep until the bucket is out of debt (before a read)."""
        delay = self.bucket.delay(self._clock())
        if delay > 0:
            await trio.sleep(delay)

    def charge(self, n: int) -> None:
        """Count ``n`` bytes just read."""
        self.bucket.charge(n, self._clock())


@dataclass(frozen=True)
class Throttle:
    """A node's caps: one limit each way (None: that way is not capped)."""

    upload: RateLimit | None = None
    download: RateLimit | None = None

    @classmethod
    def from_rates(cls, upload_bps: float | None, download_bps: float | None) -> Throttle | None:
        """The throttle for these caps in bytes/s, or None when neither is set.

        Raises:
            ValueError: a cap that is set is not finite and above 0.
        """
        if upload_bps is None and download_bps is None:
            return None
        return cls(
            None if upload_bps is None else RateLimit(upload_bps),
            None if download_bps is None else RateLimit(download_bps),
        )

    def cap(self, upload_bps: float, download_bps: float) -> tuple[float, float]:
        """A measured ``(upload, download)`` in bytes/s as this node will use it: at most its caps."""
        return (
            upload_bps if self.upload is None else min(upload_bps, self.upload.rate),
            download_bps if self.download is None else min(download_bps, self.download.rate),
        )
