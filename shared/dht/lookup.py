"""The iterative node lookup as a state machine, with no I/O (Maymounkov & Mazières 2002, §2.3).

A lookup searches for the ``k`` nodes closest to a ``target`` id. It keeps a candidate set sorted by XOR
distance to the target, seeded from the routing table, and repeats:

1. :meth:`Lookup.next_queries` picks the closest candidates not yet contacted among the ``k`` closest
   candidates that have not failed, up to ``alpha`` queries in flight at once (§2.3's parallelism).
2. The caller sends each one a FIND_NODE (or FIND_VALUE) and reports the outcome:
   :meth:`Lookup.on_response` adds the contacts the node returned as new candidates;
   :meth:`Lookup.on_failure` drops the node from consideration.
3. The lookup is :attr:`~Lookup.finished` when the ``k`` closest non-failed candidates have all
   responded (the paper's "the initiator has received responses from the k closest nodes it has seen"),
   or when nothing is left to query and nothing is in flight.

The result, :meth:`Lookup.closest`, is the responders sorted by distance. A contact is never queried
twice and our own id is never a candidate. Because the state machine only sees values, the caller
decides timeouts and concurrency (trio, or an instant simulation in tests).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable

from .keys import check_id
from .routing import Contact

__all__ = ["Lookup"]


class _State(enum.Enum):
    NEW = enum.auto()
    IN_FLIGHT = enum.auto()
    RESPONDED = enum.auto()
    FAILED = enum.auto()


class Lookup:
    """One iterative lookup of the ``k`` nodes closest to ``target`` (§2.3).

    Args:
        target: the id searched for (a node id or a key id as an integer).
        seeds: the first candidates, usually ``routing_table.nearest(target, k)``.
        k: how many closest nodes to find, at least 1.
        alpha: the most queries in flight at once, at least 1.
        own_id: the searching node's id, never queried even if a peer returns it.

    Raises:
        ValueError: an argument is out of range.
    """

    def __init__(
        self,
        target: int,
        seeds: Iterable[Contact],
        *,
        k: int = 20,
        alpha: int = 3,
        own_id: int | None = None,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if alpha < 1:
            raise ValueError(f"alpha must be at least 1, got {alpha}")
        self.target = check_id(target, "target")
        self.k = k
        self.alpha = alpha
        self.own_id = own_id
        self._contacts: dict[int, Contact] = {}
        self._state: dict[int, _State] = {}
        self._order: list[tuple[int, int]] = []  # (distance, node id), closest first
        self._in_flight = 0
        self._failed: set[int] = set()
        for contact in seeds:
            self._add(contact)

    def _add(self, contact: Contact) -> None:
        node_id = contact.node_id
        if node_id == self.own_id or node_id in self._state:
            return
        self._contacts[node_id] = contact
        self._state[node_id] = _State.NEW
        bisect.insort(self._order, (node_id ^ self.target, node_id))

    def _closest_alive(self) -> list[int]:
        """The ids of the ``k`` closest candidates that have not failed, closest first."""
        alive: list[int] = []
        for _, node_id in self._order:
            if self._state[node_id] is not _State.FAILED:
                alive.append(node_id)
                if len(alive) == self.k:
                    break
        return alive

    def next_queries(self) -> list[Contact]:
        """Return the contacts to query now and mark them in flight.

        They are the closest never-contacted candidates among the ``k`` closest non-failed ones, at most
        ``alpha`` minus the queries already in flight. An empty list means: wait for outstanding replies,
        or stop if :attr:`finished`.
        """
        budget = self.alpha - self._in_flight
        chosen: list[Contact] = []
        for node_id in self._closest_alive():
            if budget <= 0:
                break
            if self._state[node_id] is _State.NEW:
                self._state[node_id] = _State.IN_FLIGHT
                chosen.append(self._contacts[node_id])
                budget -= 1
        self._in_flight += len(chosen)
        return chosen

    def _settle(self, contact: Contact, state: _State) -> None:
        if self._state.get(contact.node_id) is not _State.IN_FLIGHT:
            raise ValueError(f"no query to node {contact.node_id:#x} is in flight")
        self._state[contact.node_id] = state
        self._in_flight -= 1

    def on_response(self, contact: Contact, closer: Iterable[Contact]) -> None:
        """Record that ``contact`` answered with the contacts ``closer`` (new ones become candidates).

        Raises:
            ValueError: ``contact`` was not in flight (not returned by :meth:`next_queries`, or settled).
        """
        self._settle(contact, _State.RESPONDED)
        for candidate in closer:
            self._add(candidate)

    def on_failure(self, contact: Contact) -> None:
        """Record that ``contact`` did not answer; it is no longer a candidate.

        Raises:
            ValueError: ``contact`` was not in flight (not returned by :meth:`next_queries`, or settled).
        """
        self._settle(contact, _State.FAILED)
        self._failed.add(contact.node_id)

    @property
    def finished(self) -> bool:
        """True once the ``k`` closest non-failed candidates have responded, or nothing is left to do."""
        # "Nothing left to query and nothing in flight" needs no test of its own: then every non-failed
        # candidate has responded. Conversely, while not finished, some close candidate is new (so
        # next_queries() has work) or in flight, so a lookup never stalls.
        return all(self._state[node_id] is _State.RESPONDED for node_id in self._closest_alive())

    def closest(self, count: int | None = None) -> list[Contact]:
        """Return up to ``count`` (default ``k``) responders, closest to the target first.

        Raises:
            ValueError: ``count`` is negative.
        """
        count = self.k if count is None else count
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count}")
        result: list[Contact] = []
        for _, node_id in self._order:
            if len(result) >= count:
                break
            if self._state[node_id] is _State.RESPONDED:
                result.append(self._contacts[node_id])
        return result

    @property
    def in_flight(self) -> int:
        """How many queries were handed out and not yet settled."""
        return self._in_flight

    @property
    def failed(self) -> frozenset[int]:
        """The node ids that failed to answer."""
        return frozenset(self._failed)

    @property
    def contacted(self) -> int:
        """How many distinct nodes were queried so far (for statistics)."""
        return sum(state is not _State.NEW for state in self._state.values())
