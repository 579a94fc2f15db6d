"""The local store of signed DHT records, with expiry and bounded size (Maymounkov & Mazières 2002, §2.5).

Kademlia nodes keep the ``(key, value)`` pairs that STORE RPCs hand them until they expire (§2.5: "each
key/value pair expires 24 hours after it was originally published"). Here a key holds a plain record
(``subkey`` ``None``) and a dictionary of records, one per subkey, each with its own expiration. For
every ``(key, subkey)`` slot the store keeps exactly one record, the newest by
:func:`shared.dht.records.newer`, so the outcome does not depend on arrival order.

Time is passed in (``now``, unix seconds). Expirations sit in a min-heap with lazy deletion, so
:meth:`RecordStore.remove_expired` costs ``O(log n)`` per record dropped, not a scan. The store is
bounded: past ``max_records`` a new record evicts the soonest-expiring one if it outlives it, else it is
refused; a key's dictionary is bounded the same way by ``max_subkeys_per_key``.

The store does not validate signatures or policy: run a :class:`~shared.dht.records.RecordValidator`
before :meth:`RecordStore.put`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from protocols.dht import SignedRecord

from .keys import ID_BYTES
from .records import newer

__all__ = ["RecordStore"]

# (expiration, insertion sequence, record); the unique sequence keeps heapq from comparing records
_HeapEntry = tuple[float, int, SignedRecord]


def _check_key(key: bytes) -> None:
    if len(key) != ID_BYTES:
        raise ValueError(f"a key id has {ID_BYTES} bytes, got {len(key)}")


class RecordStore:
    """Signed records by ``(key, subkey)``, newest wins, expired ones dropped.

    Args:
        max_records: the most records held in all, at least 1.
        max_subkeys_per_key: the most dictionary entries (non-``None`` subkeys) under one key, at least 1.

    Raises:
        ValueError: a limit is below 1.
    """

    def __init__(self, *, max_records: int = 100_000, max_subkeys_per_key: int = 4096) -> None:
        if max_records < 1:
            raise ValueError(f"max_records must be at least 1, got {max_records}")
        if max_subkeys_per_key < 1:
            raise ValueError(f"max_subkeys_per_key must be at least 1, got {max_subkeys_per_key}")
        self.max_records = max_records
        self.max_subkeys_per_key = max_subkeys_per_key
        self._keys: dict[bytes, dict[bytes | None, SignedRecord]] = {}
        self._count = 0
        self._heap: list[_HeapEntry] = []
        self._sequence = itertools.count()

    def put(self, record: SignedRecord, now: float) -> bool:
        """Store ``record`` unless it is expired, superseded, or there is no room for it.

        Returns:
            True if the record is now stored; False if it expired at or before ``now``, the store already
            holds the same or a newer record for its ``(key, subkey)``, or the store (or the key's
            dictionary) is full of records that expire no sooner than this one.

        Raises:
            ValueError: the record's key is not a 20-byte key id.
        """
        _check_key(record.key)
        if record.expiration <= now:
            return False
        self.remove_expired(now)
        slots = self._keys.get(record.key)
        current = None if slots is None else slots.get(record.subkey)
        if current is not None:
            if not newer(record, current):
                return False
            self._place(record)
            return True
        if slots is not None and record.subkey is not None:
            subkeyed = [r for subkey, r in slots.items() if subkey is not None]
            if len(subkeyed) >= self.max_subkeys_per_key:
                victim = min(subkeyed, key=lambda r: r.expiration)
                if record.expiration <= victim.expiration:
                    return False
                self._discard(victim)
        if self._count >= self.max_records:
            victim = self._soonest()
            if record.expiration <= victim.expiration:
                return False
            self._discard(victim)
        self._place(record)
        self._count += 1
        return True

    def _place(self, record: SignedRecord) -> None:
        """Put ``record`` in its slot (replacing any record there) and schedule its expiry."""
        self._keys.setdefault(record.key, {})[record.subkey] = record
        heapq.heappush(self._heap, (record.expiration, next(self._sequence), record))
        if len(self._heap) > 2 * self._count + 64:  # superseded records leave stale heap entries
            self._heap = [(r.expiration, next(self._sequence), r) for r in self.records()]
            heapq.heapify(self._heap)

    def _is_stored(self, record: SignedRecord) -> bool:
        slots = self._keys.get(record.key)
        return slots is not None and slots.get(record.subkey) is record

    def _soonest(self) -> SignedRecord:
        """The stored record that expires first (the store must not be empty)."""
        while not self._is_stored(self._heap[0][2]):
            heapq.heappop(self._heap)
        return self._heap[0][2]

    def _discard(self, record: SignedRecord) -> None:
        """Remove a stored record; its heap entry goes stale and is skipped later."""
        slots = self._keys[record.key]
        del slots[record.subkey]
        if not slots:
            del self._keys[record.key]
        self._count -= 1

    def get(self, key: bytes, now: float) -> list[SignedRecord]:
        """Return the unexpired records under ``key``: the plain record first, then subkeys in byte order.

        Raises:
            ValueError: ``key`` is not a 20-byte key id.
        """
        _check_key(key)
        slots = self._keys.get(key)
        if slots is None:
            return []
        plain = slots.get(None)
        ordered = [] if plain is None else [plain]
        ordered += [slots[subkey] for subkey in sorted(s for s in slots if s is not None)]
        return [record for record in ordered if record.expiration > now]

    def remove_expired(self, now: float) -> int:
        """Drop every record that expired at or before ``now``; return how many were dropped."""
        removed = 0
        while self._heap and self._heap[0][0] <= now:
            record = heapq.heappop(self._heap)[2]
            if self._is_stored(record):
                self._discard(record)
                removed += 1
        return removed

    def keys(self) -> list[bytes]:
        """Return the key ids with at least one stored record (expired ones linger until removed)."""
        return list(self._keys)

    def records(self) -> Iterator[SignedRecord]:
        """Iterate over a snapshot of every stored record, e.g. to hand them off before leaving.

        Call :meth:`remove_expired` first to leave out records that expired since the last cleanup.
        """
        return iter([record for slots in self._keys.values() for record in slots.values()])

    def __len__(self) -> int:
        return self._count
