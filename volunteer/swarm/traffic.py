"""What a swarm volunteer's pipeline traffic adds to its contribution reports (issue 17 item 6; the
ledger's rule: :mod:`backbone.ledger.accounting`, "Swarm bytes").

:class:`TrafficReader` is the reporter's ``swarm_traffic`` source (:mod:`volunteer.reporting`, "Swarm
bytes"): each call returns what accumulated since the previous one, read from cumulative counters

* of the stage server we serve now (:attr:`.server.StageServerStatistics.bytes_sent`: the payload bytes
  of its answers; our claim). A server that rebalancing replaced is read one last time, after which it
  is forgotten, so a move loses at most what the old server sent after it stopped being the current one
  and before the next read (it is closed by then: nothing);
* of our trainers (:attr:`.client.SwarmStatistics.bytes_sent`: the payload bytes of their requests that
  a server answered, our claim; :attr:`.client.SwarmStatistics.received`: per server, the payload bytes
  of the answers they accepted, the evidence of that server's sending).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

__all__ = ["TrafficReader"]


class _ServerStats(Protocol):
    bytes_sent: int


class _ClientStats(Protocol):
    bytes_sent: int
    received: dict[str, int]


class _Client(Protocol):
    @property
    def stats(self) -> _ClientStats: ...


class TrafficReader:
    """Delta reads of the pipeline bytes this volunteer sent and received (module docstring).

    Args:
        server: the statistics of the stage server we serve now, or None (none now).
        clients: our trainers' clients (the list may grow).
    """

    def __init__(self, server: Callable[[], _ServerStats | None], clients: Sequence[_Client]) -> None:
        self.server = server
        self.clients = clients
        self._servers: list[tuple[_ServerStats, int]] = []  # (statistics, bytes read of them)
        self._clients: dict[int, tuple[int, Counter[str]]] = {}  # client index -> what was read

    def __call__(self) -> tuple[int, dict[str, int]]:
        """Bytes sent since the previous call, and answer bytes received per stage server."""
        sent = 0
        current = self.server()
        if current is not None and not any(stats is current for stats, _ in self._servers):
            self._servers.append((current, 0))
        kept = []
        for stats, read in self._servers:
            sent += max(0, stats.bytes_sent - read)
            if stats is current:
                kept.append((stats, max(read, stats.bytes_sent)))
        self._servers = kept
        received: Counter[str] = Counter()
        for index, client in enumerate(self.clients):
            stats = client.stats
            read_sent, read_received = self._clients.get(index, (0, Counter()))
            sent += max(0, stats.bytes_sent - read_sent)
            now = Counter(stats.received)
            received.update({s: n - read_received[s] for s, n in now.items() if n > read_received[s]})
            self._clients[index] = (max(read_sent, stats.bytes_sent), now)
        return sent, dict(received)
