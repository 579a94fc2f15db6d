"""The Kademlia routing table: k-buckets over the 160-bit id space (Maymounkov & Mazières 2002, §2.2, §2.4).

A bucket covers a half-open id range ``[lo, hi)`` and holds at most ``k`` contacts, least-recently seen
first (§2.2). The table starts as one bucket covering the whole space. When a contact arrives for a full
bucket, the bucket is split in half if its range contains our own id (§2.4, the classic rule), so the
table keeps fine-grained knowledge near us and ``k`` contacts per "distance octave" farther away; the
buckets always partition ``[0, 2**160)``.

If the full bucket cannot be split, Kademlia prefers old contacts, which are likelier to stay online
(§2.2): the newcomer goes into the bucket's replacement cache (§4.1) and :meth:`RoutingTable.add_or_update`
*returns* the least-recently seen contact. The caller pings it and then calls :meth:`~RoutingTable.mark_seen`
if it answered, or :meth:`~RoutingTable.remove` if not, which promotes the most recent replacement. The
table never does I/O itself.

Buckets remember when a lookup or an add last went through them; :meth:`RoutingTable.buckets_needing_refresh`
names the idle ones so the service can look up a random id in each (§2.3, "bucket refresh").
"""

from __future__ import annotations

import bisect
import functools
import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from protocols.dht import NodeInfo
from protocols.peer_id import PeerId, validate_peer_id

from ..errors import ConfigError
from ..net.addresses import parse_multiaddr
from .keys import KEY_BITS, check_id, node_id_of

__all__ = ["BucketInfo", "Contact", "RoutingTable", "random_id_in"]


@functools.lru_cache(maxsize=4096)  # bounded; every lookup re-checks the same few addresses
def _dialable(text: str) -> bool:
    try:
        parse_multiaddr(text)
    except ConfigError:
        return False
    return True


_ID_LIMIT = 1 << KEY_BITS


@dataclass(frozen=True)
class Contact:
    """A DHT node we can talk to: its id in the key space, its peer id, and where to dial it.

    Build contacts with :meth:`of` or :meth:`from_info`, which derive ``node_id`` from ``peer_id``; the
    plain constructor trusts the id it is given (handy for simulations).
    """

    node_id: int
    peer_id: PeerId
    addrs: tuple[str, ...]

    def __post_init__(self) -> None:
        check_id(self.node_id, "node id")
        if not isinstance(self.addrs, tuple) or not self.addrs:
            raise ValueError(f"a contact needs a non-empty tuple of addresses, got {self.addrs!r}")

    @classmethod
    def of(cls, peer_id: str, addrs: tuple[str, ...]) -> Contact:
        """Return the contact for ``peer_id`` with its derived node id.

        Raises:
            ValueError: ``peer_id`` is not a valid peer id, or ``addrs`` is empty.
        """
        valid = validate_peer_id(peer_id)
        return cls(node_id_of(valid), valid, tuple(addrs))

    @classmethod
    def from_info(cls, info: NodeInfo) -> Contact:
        """Return the contact described by a wire :class:`~protocols.dht.NodeInfo`, keeping only the
        addresses this node can dial (a peer's reply may name any string that starts with ``/``).

        Raises:
            ValueError: the peer id is malformed or no address is dialable.
        """
        usable = tuple(a for a in info.addrs if _dialable(a))
        if not usable:
            raise ValueError(f"no dialable address among {info.addrs[:4]!r}")
        return cls.of(info.peer_id, usable)

    def to_info(self) -> NodeInfo:
        """Return this contact as a wire :class:`~protocols.dht.NodeInfo`."""
        return NodeInfo(peer_id=self.peer_id, addrs=list(self.addrs))


@dataclass(frozen=True)
class BucketInfo:
    """A read-only view of one k-bucket, for tests and ``statistics()``."""

    lo: int
    hi: int
    contacts: tuple[Contact, ...]
    replacements: tuple[Contact, ...]
    last_touched: float


@dataclass(eq=False)
class _Bucket:
    lo: int
    hi: int
    last_touched: float = float("-inf")
    # node id -> (contact, last seen), least-recently seen first
    contacts: OrderedDict[int, tuple[Contact, float]] = field(default_factory=OrderedDict)
    # node id -> (contact, last seen), most recent last
    replacements: OrderedDict[int, tuple[Contact, float]] = field(default_factory=OrderedDict)

    def covers(self, node_id: int) -> bool:
        return self.lo <= node_id < self.hi

    def split(self) -> tuple[_Bucket, _Bucket]:
        mid = (self.lo + self.hi) // 2
        low, high = _Bucket(self.lo, mid, self.last_touched), _Bucket(mid, self.hi, self.last_touched)
        for node_id, entry in self.contacts.items():  # iteration order keeps each half's LRU order
            (low if node_id < mid else high).contacts[node_id] = entry
        for node_id, entry in self.replacements.items():
            (low if node_id < mid else high).replacements[node_id] = entry
        return low, high


def random_id_in(lo: int, hi: int, rng: random.Random) -> int:
    """Return a uniformly random id in ``[lo, hi)``, e.g. the target of a bucket refresh (§2.3).

    Raises:
        ValueError: the range is empty or not inside ``[0, 2**160]``.
    """
    if not 0 <= lo < hi <= _ID_LIMIT:
        raise ValueError(f"[{lo}, {hi}) is not a non-empty range inside [0, 2**{KEY_BITS})")
    return rng.randrange(lo, hi)


class RoutingTable:
    """k-buckets of the contacts a node knows, keyed by XOR distance from ``own_id`` (§2.2, §2.4).

    Args:
        own_id: this node's id; it is never added to the table.
        k: the bucket size (Kademlia's replication parameter), at least 1.
        replacement_cache: how many newcomers a full bucket remembers as replacements (§4.1), at least 0.

    Raises:
        ValueError: an argument is out of range.
    """

    def __init__(self, own_id: int, *, k: int = 20, replacement_cache: int = 8) -> None:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if replacement_cache < 0:
            raise ValueError(f"replacement_cache must be non-negative, got {replacement_cache}")
        self.own_id = check_id(own_id, "own id")
        self.k = k
        self.replacement_cache = replacement_cache
        self._buckets = [_Bucket(0, _ID_LIMIT)]
        self._los = [0]  # bucket lower bounds, kept parallel to _buckets for bisect
        self._size = 0

    def _index(self, node_id: int) -> int:
        return bisect.bisect_right(self._los, check_id(node_id)) - 1

    def _bucket(self, node_id: int) -> _Bucket:
        return self._buckets[self._index(node_id)]

    def add_or_update(self, contact: Contact, now: float) -> Contact | None:
        """Record that ``contact`` was just heard from (§2.2).

        A known contact moves to the tail of its bucket with the new addresses. A new one is added if its
        bucket has room or can be split. Otherwise it goes into the bucket's replacement cache and the
        bucket's least-recently seen contact is returned: ping it, then call :meth:`mark_seen` if it
        answers or :meth:`remove` if it does not. Contacts with our own id are ignored.

        Returns:
            The contact to ping, or ``None`` when nothing needs checking.
        """
        node_id = contact.node_id
        if node_id == self.own_id:
            return None
        while True:
            index = self._index(node_id)
            bucket = self._buckets[index]
            bucket.last_touched = max(bucket.last_touched, now)
            if node_id in bucket.contacts:
                bucket.contacts[node_id] = (contact, now)
                bucket.contacts.move_to_end(node_id)
                return None
            if len(bucket.contacts) < self.k:
                bucket.replacements.pop(node_id, None)
                bucket.contacts[node_id] = (contact, now)
                self._size += 1
                return None
            if bucket.covers(self.own_id) and bucket.hi - bucket.lo > 1:
                self._buckets[index : index + 1] = bucket.split()
                self._los.insert(index + 1, self._buckets[index + 1].lo)
                continue
            if self.replacement_cache:
                bucket.replacements.pop(node_id, None)
                bucket.replacements[node_id] = (contact, now)
                while len(bucket.replacements) > self.replacement_cache:
                    bucket.replacements.popitem(last=False)
            return next(iter(bucket.contacts.values()))[0]

    def remove(self, node_id: int) -> None:
        """Forget ``node_id`` (it failed to answer, or left) and promote the newest replacement (§4.1).

        Unknown ids are ignored; an id only in a replacement cache is dropped from it.
        """
        bucket = self._bucket(node_id)
        if bucket.contacts.pop(node_id, None) is None:
            bucket.replacements.pop(node_id, None)
            return
        self._size -= 1
        if bucket.replacements:
            promoted_id, entry = bucket.replacements.popitem(last=True)
            bucket.contacts[promoted_id] = entry
            self._size += 1

    def mark_seen(self, node_id: int, now: float) -> None:
        """Record that a known contact answered at ``now``: it becomes the most recently seen."""
        bucket = self._bucket(node_id)
        entry = bucket.contacts.get(node_id)
        if entry is not None:
            bucket.contacts[node_id] = (entry[0], now)
            bucket.contacts.move_to_end(node_id)

    def touch(self, target: int, now: float) -> None:
        """Record that a lookup for ``target`` went through its bucket at ``now`` (§2.3)."""
        bucket = self._bucket(target)
        bucket.last_touched = max(bucket.last_touched, now)

    def get(self, node_id: int) -> Contact | None:
        """Return the contact with ``node_id``, or ``None`` if it is not in a bucket."""
        entry = self._bucket(node_id).contacts.get(node_id)
        return None if entry is None else entry[0]

    def last_seen(self, node_id: int) -> float | None:
        """Return when ``node_id`` was last heard from, or ``None`` if it is not in a bucket."""
        entry = self._bucket(node_id).contacts.get(node_id)
        return None if entry is None else entry[1]

    def nearest(self, target: int, count: int, *, exclude: int | None = None) -> list[Contact]:
        """Return up to ``count`` contacts closest to ``target`` by XOR distance, closest first.

        Args:
            target: the id to measure distances from.
            count: how many contacts to return at most.
            exclude: a node id to leave out (typically the requester's own id).

        Raises:
            ValueError: ``count`` is negative or ``target`` is not an id.
        """
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count}")
        check_id(target, "target")
        candidates = (c for c in self.contacts() if c.node_id != exclude)
        return heapq.nsmallest(count, candidates, key=lambda c: c.node_id ^ target)

    def contacts(self) -> list[Contact]:
        """Return every contact in the buckets, bucket by bucket, least-recently seen first."""
        return [entry[0] for bucket in self._buckets for entry in bucket.contacts.values()]

    def buckets(self) -> list[BucketInfo]:
        """Return a view of every bucket, in id order."""
        return [
            BucketInfo(
                b.lo,
                b.hi,
                tuple(e[0] for e in b.contacts.values()),
                tuple(e[0] for e in b.replacements.values()),
                b.last_touched,
            )
            for b in self._buckets
        ]

    def buckets_needing_refresh(self, now: float, interval: float) -> list[tuple[int, int]]:
        """Return the ``[lo, hi)`` ranges of buckets with no lookup or add for ``interval`` seconds (§2.3).

        A fresh table's buckets have never been touched, so they all need a refresh.
        """
        return [(b.lo, b.hi) for b in self._buckets if now - b.last_touched >= interval]

    def __len__(self) -> int:
        return self._size

    def __contains__(self, node_id: object) -> bool:
        return (
            isinstance(node_id, int)
            and 0 <= node_id < _ID_LIMIT
            and node_id in self._bucket(node_id).contacts
        )
