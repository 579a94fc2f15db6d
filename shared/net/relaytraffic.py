"""What went through relays, for the ledger's credit of relaying (issue 14; the rule is in
:mod:`backbone.ledger.accounting`, "Relayed bytes").

Two counters, both *delta-readable*: each read returns what accumulated since the previous read, so the
contribution reporter (:mod:`volunteer.reporting`) puts every byte in exactly one report.

* :class:`RelayTraffic` (one per :class:`~shared.net.host.Host`, ``host.relay_traffic``) is the
  *evidence* side: the bytes this host received over connections that go through a relay's circuit, per
  relay peer id. Both ends register their connection: the dialer in :func:`shared.net.relay.relay_dial`,
  the target when it serves the circuit (:meth:`shared.net.host.Host.serve_socket` with ``relay``).
  Received bytes only: each direction of a circuit is then reported once, by the end it reached. They are
  TLS plaintext bytes (``TlsSocket.bytes_received``), a little less than the ciphertext the relay spliced.
* :func:`relayed_since` wraps a relay's :meth:`~shared.net.relay.RelayService.bytes_relayed` (cumulative,
  per ``(dialer, target)``) into the *claim* side: bytes spliced since the previous call.

Memory: a connection is held only while open; a closed one is folded into the per-relay totals the next
time anything is registered or read, so a host that never reads (a backbone) holds one counter per relay.
Bulk transfers count in worker threads; reading an ``int`` they write is safe in CPython, and a read
that races a write only moves bytes to the next read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .relay import RelayService
    from .tls_socket import TlsSocket

__all__ = ["RelayTraffic", "relayed_since"]


class RelayTraffic:
    """Bytes received through each relay (module docstring); :meth:`take` returns and resets them."""

    def __init__(self) -> None:
        self._open: dict[TlsSocket, tuple[str, int]] = {}  # connection -> (relay, bytes already counted)
        self._counted: Counter[str] = Counter()

    def track(self, relay: str, tls: TlsSocket) -> None:
        """Count what ``tls`` receives from now on (and what it received so far) as through ``relay``."""
        self._fold()
        self._open[tls] = (relay, 0)

    def take(self) -> dict[str, int]:
        """Bytes received through each relay since the previous call (relays with none are absent)."""
        self._fold()
        taken = {relay: n for relay, n in self._counted.items() if n > 0}
        self._counted.clear()
        return taken

    @property
    def connections(self) -> int:
        """Relayed connections open now (as last seen)."""
        return len(self._open)

    def _fold(self) -> None:
        for tls, (relay, seen) in list(self._open.items()):
            now = tls.bytes_received
            self._counted[relay] += now - seen
            if tls.closed:
                del self._open[tls]
            else:
                self._open[tls] = (relay, now)


def relayed_since(service: RelayService) -> Callable[[], int]:
    """A callable returning the bytes ``service`` spliced (both directions) since its previous call."""
    last = [sum(service.bytes_relayed().values())]

    def take() -> int:
        total = sum(service.bytes_relayed().values())
        delta, last[0] = max(0, total - last[0]), total
        return delta

    return take
