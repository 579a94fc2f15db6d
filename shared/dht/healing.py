"""Pure rules of how a DHT heals after a node restarts: whom to re-announce to, what, and how often.

**When a contact comes back.** A node that restarts loses every record it held (the store is in memory),
and its peers may have dropped it from their routing tables while it was down. We say a contact *comes
back* when an RPC connection with it opens (either side dialed) and we had known it before: it is in our
routing table, or we held a connection with it earlier in this process (:class:`ComebackDetector`).
This covers a restart (its old connections broke, its new process dials us or answers our dial), and also,
harmlessly, a connection closed for idleness and reopened. There is no session nonce on the wire: a new
connection is the session, which needs no protocol change and cannot be forged by a third party (the
connection's peer id is proven by its handshake).

**What we re-announce.** To a contact that came back, we store (STORE, as anyone would) every record we
hold or own for whose key it is among the ``replicas`` closest nodes we know, ourselves and itself
included (:func:`is_replica_for`, Kademlia's "store on the k closest", §2.5: a node that joins must get
the records it is now responsible for). Records it already has are accepted as held, so repeating costs
bandwidth only.

**Bounds (peers are strangers).** A peer that "restarts" every second must not make us re-send
everything each time: :class:`ReannounceLimiter` lets at most one re-announce per contact per
``interval`` seconds and remembers at most ``max_peers`` contacts (the oldest entries are forgotten,
which can only allow a re-announce early, never block one forever). The node also caps how many
re-announces run at once and how many records one sends (``DHTNode``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["ComebackDetector", "ReannounceLimiter", "is_replica_for"]


class ReannounceLimiter:
    """At most one re-announce per peer per ``interval`` seconds, remembering ``max_peers`` peers.

    Raises:
        ValueError: ``interval`` is negative or ``max_peers`` is below 1.
    """

    def __init__(self, interval: float, max_peers: int = 4096) -> None:
        if interval < 0 or max_peers < 1:
            raise ValueError(f"need interval >= 0 and max_peers >= 1, got {interval}, {max_peers}")
        self.interval = interval
        self.max_peers = max_peers
        self._last: OrderedDict[str, float] = OrderedDict()

    def allow(self, peer: str, now: float) -> bool:
        """True (and remember ``now``) if ``peer`` got no re-announce in the last ``interval`` seconds."""
        last = self._last.get(peer)
        if last is not None and now - last < self.interval:
            return False
        self._last[peer] = now
        self._last.move_to_end(peer)
        while len(self._last) > self.max_peers:
            self._last.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._last)


class ComebackDetector:
    """Tells, from connections and authenticated messages, which peers come back.

    The host reports every new connection (:meth:`connection_opened`), but a connection's peer has only
    proven its key, not that it is admitted; so a peer counts as *heard from* only through an
    authenticated message (:meth:`authenticated`): a request that passed the run's checks, or an answer
    to our call. The first such message on a new connection from a peer we had heard from before (or
    that the caller ``known``s, e.g. from its routing table) means it comes back. Both memories are
    bounded (``max_peers``, least recent forgotten first).

    Raises:
        ValueError: ``max_peers`` is below 1.
    """

    def __init__(self, max_peers: int = 4096) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, got {max_peers}")
        self.max_peers = max_peers
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._fresh: OrderedDict[str, None] = OrderedDict()

    def connection_opened(self, peer: str) -> None:
        """A new connection with ``peer`` opened (not yet trusted)."""
        _remember(self._fresh, peer, self.max_peers)

    def authenticated(self, peer: str, *, known: bool = False) -> bool:
        """``peer`` sent an authenticated message; True if it comes back (see the class docstring)."""
        fresh = peer in self._fresh
        if fresh:
            del self._fresh[peer]
        back = fresh and (known or peer in self._seen)
        _remember(self._seen, peer, self.max_peers)
        return back


def _remember(memory: OrderedDict[str, None], peer: str, limit: int) -> None:
    memory[peer] = None
    memory.move_to_end(peer)
    while len(memory) > limit:
        memory.popitem(last=False)


def is_replica_for(key: int, peer: int, own: int, known: Iterable[int], replicas: int) -> bool:
    """True if ``peer`` is among the ``replicas`` ids closest to ``key`` (XOR) among ``known`` (distinct
    ids), ``own`` and ``peer`` itself, i.e. it should hold the key's records as far as we can tell."""
    closer = 0
    mine = peer ^ key
    for node in itertools.chain(known, (own,)):
        if node != peer and node ^ key < mine:
            closer += 1
            if closer >= replicas:
                return False
    return True
