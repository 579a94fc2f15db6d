"""The local store of signed DHT records: expiry, newest wins, per-writer quotas (Maymounkov & Mazières §2.5).

Kademlia nodes keep the ``(key, value)`` pairs that STORE RPCs hand them until they expire (§2.5: "each
key/value pair expires 24 hours after it was originally published"). Here a key holds a plain record
(``subkey`` ``None``) and a dictionary of records, one per subkey, each with its own expiration. For
every ``(key, subkey)`` slot the store keeps exactly one record, the newest by
:func:`shared.dht.records.newer`, so the outcome does not depend on arrival order.

Time is passed in (``now``, unix seconds). Expirations sit in a min-heap with lazy deletion, so
:meth:`RecordStore.remove_expired` costs ``O(log n)`` per record dropped, not a scan.

**Quotas (DESIGN D10a).** Every record is charged to its *owner*, the user it speaks for
(:func:`~shared.dht.admission.record_user`: the token's username in a pinned run, the writer's peer id in
an open run), at :func:`record_cost` bytes. :class:`StoreLimits` bounds

* each owner: ``owner_records`` records and ``owner_bytes`` bytes. A record that would take its owner
  past either is refused (``OWNER_QUOTA``); nothing is evicted for it. Honest peers hold a handful of
  slots (presence, progress, state, capabilities, a few matchmaking rounds) that they overwrite in place,
  far below the quota;
* the whole store: ``max_records`` and ``max_bytes``, and each key's dictionary: ``max_subkeys_per_key``.
  When one of these is full, room is made only at the expense of an owner that holds *strictly more*
  than the newcomer's owner will hold once the record is in (in the dimension that is full: records or
  bytes; for a key's dictionary, entries under that key): the soonest-expiring record of the largest such
  owner goes. Failing that, an owner may replace its *own* soonest-expiring record by a longer-lived one;
  otherwise the record is refused (``STORE_FULL``, ``KEY_FULL``). So a writer, or a crowd of writers,
  flooding the store can only push out each other's surplus, never the record of an owner holding no
  more than the newcomer — an honest peer's few presence and progress records stay.
* records under ``exempt_keys`` (a pinned run's revocations, authority statements whose number only the
  authority controls) are stored outside every limit and never evicted.

Refusals are counted by reason (:attr:`RecordStore.refusals`); :meth:`RecordStore.put` returns a
:class:`PutResult` that is truthy only for ``STORED``.

The store does not validate signatures or policy: run a :class:`~shared.dht.records.RecordValidator`
before :meth:`RecordStore.put` (the owner of an unvalidated record is whatever its token claims).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from protocols.dht import SignedRecord

from .admission import record_user
from .keys import ID_BYTES
from .records import newer

__all__ = ["PutResult", "RecordStore", "StoreLimits", "record_cost"]

_Slot = tuple[bytes, bytes | None]
# (expiration, insertion sequence, record); the unique sequence keeps heapq from comparing records
_HeapEntry = tuple[float, int, SignedRecord]
_RECORD_OVERHEAD = 256  # key, writer, signature, expiration and msgpack field names, rounded up


def record_cost(record: SignedRecord) -> int:
    """The bytes a record is charged (and, at most, takes on the wire)."""
    token = 0 if record.token is None else len(record.token.token) + 96
    return _RECORD_OVERHEAD + len(record.value) + len(record.subkey or b"") + token


@dataclass(frozen=True)
class StoreLimits:
    """Bounds of a :class:`RecordStore` (module docstring); every count and size at least 1."""

    max_records: int = 100_000
    max_bytes: int = 256 * 2**20
    max_subkeys_per_key: int = 4096
    owner_records: int = 4096
    owner_bytes: int = 16 * 2**20
    exempt_keys: frozenset[bytes] = frozenset()

    def __post_init__(self) -> None:
        for name in ("max_records", "max_bytes", "max_subkeys_per_key", "owner_records", "owner_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for key in self.exempt_keys:
            _check_key(key)


class PutResult(enum.Enum):
    """What :meth:`RecordStore.put` did; truthy only for ``STORED``."""

    STORED = "stored"
    EXPIRED = "expired"  # expired at or before now
    SUPERSEDED = "superseded"  # the slot holds the same or a newer record
    OWNER_QUOTA = "owner over quota"  # the record's owner would exceed its records or bytes
    KEY_FULL = "key dictionary full"  # the key's dictionary is full of owners holding no more
    STORE_FULL = "store full"  # the store is full of owners holding no more

    def __bool__(self) -> bool:
        return self is PutResult.STORED


@dataclass(eq=False)
class _Entry:
    record: SignedRecord
    owner: str
    cost: int
    exempt: bool

    @property
    def slot(self) -> _Slot:
        return (self.record.key, self.record.subkey)


@dataclass
class _Usage:
    records: int = 0
    bytes: int = 0
    entries: dict[_Slot, _Entry] = field(default_factory=dict)


def _check_key(key: bytes) -> None:
    if len(key) != ID_BYTES:
        raise ValueError(f"a key id has {ID_BYTES} bytes, got {len(key)}")


class RecordStore:
    """Signed records by ``(key, subkey)``, newest wins, expired ones dropped, owners held to quotas.

    Args:
        limits: the bounds; the defaults of :class:`StoreLimits` if omitted.
        max_records: shorthand overriding ``limits.max_records``.
        max_subkeys_per_key: shorthand overriding ``limits.max_subkeys_per_key``.

    Raises:
        ValueError: a limit is below 1.
    """

    def __init__(
        self,
        limits: StoreLimits | None = None,
        *,
        max_records: int | None = None,
        max_subkeys_per_key: int | None = None,
    ) -> None:
        limits = limits or StoreLimits()
        if max_records is not None:
            limits = dataclasses.replace(limits, max_records=max_records)
        if max_subkeys_per_key is not None:
            limits = dataclasses.replace(limits, max_subkeys_per_key=max_subkeys_per_key)
        self.limits = limits
        self.refusals: Counter[PutResult] = Counter()
        self._keys: dict[bytes, dict[bytes | None, _Entry]] = {}
        self._owners: dict[str, _Usage] = {}
        self._count = 0  # every record, exempt ones included
        self._records = 0  # records charged to owners
        self._bytes = 0
        self._heap: list[_HeapEntry] = []
        self._sequence = itertools.count()

    # ---------------------------------------------------------------- writing

    def put(self, record: SignedRecord, now: float) -> PutResult:
        """Store ``record`` unless it is expired, superseded, over its owner's quota, or there is no room.

        Returns:
            ``STORED`` (truthy) if the record is now stored, else the reason it is not (falsy), also counted
            in :attr:`refusals`.

        Raises:
            ValueError: the record's key is not a 20-byte key id.
        """
        result = self._put(record, now)
        if not result:
            self.refusals[result] += 1
        return result

    def _put(self, record: SignedRecord, now: float) -> PutResult:
        _check_key(record.key)
        if record.expiration <= now:
            return PutResult.EXPIRED
        self.remove_expired(now)
        slots = self._keys.get(record.key)
        current = None if slots is None else slots.get(record.subkey)
        if current is not None and not newer(record, current.record):
            return PutResult.SUPERSEDED
        entry = _Entry(
            record, record_user(record), record_cost(record), record.key in self.limits.exempt_keys
        )
        if entry.exempt:
            self._replace(current, entry)
            return PutResult.STORED
        planned = self._plan(entry, current, slots)
        if isinstance(planned, PutResult):
            return planned
        for victim in planned:
            self._discard(victim)
        self._replace(current, entry)
        return PutResult.STORED

    def _plan(
        self, new: _Entry, current: _Entry | None, slots: dict[bytes | None, _Entry] | None
    ) -> list[_Entry] | PutResult:
        """The records to evict so that ``new`` fits (replacing ``current``), or why it cannot."""
        limits = self.limits
        # what each owner would hold once ``new`` is in, before evictions
        delta: dict[str, tuple[int, int]] = {new.owner: (1, new.cost)}
        if current is not None and not current.exempt:
            r, b = delta.get(current.owner, (0, 0))
            delta[current.owner] = (r - 1, b - current.cost)
        mine = self._owners.get(new.owner, _Usage())
        mine_r, mine_b = mine.records + delta[new.owner][0], mine.bytes + delta[new.owner][1]
        if mine_r > limits.owner_records or mine_b > limits.owner_bytes:
            return PutResult.OWNER_QUOTA
        victims: list[_Entry] = []
        taken: set[_Slot] = set() if current is None else {current.slot}

        def evict(victim: _Entry) -> None:
            victims.append(victim)
            taken.add(victim.slot)
            r, b = delta.get(victim.owner, (0, 0))
            delta[victim.owner] = (r - 1, b - victim.cost)

        if (
            current is None
            and new.record.subkey is not None
            and slots is not None
            and len(slots) - (None in slots) >= limits.max_subkeys_per_key
        ):
            victim = self._key_victim([e for s, e in slots.items() if s is not None], new)
            if victim is None:
                return PutResult.KEY_FULL
            evict(victim)
        total_r = self._records + sum(r for r, _ in delta.values())
        total_b = self._bytes + sum(b for _, b in delta.values())
        while total_r > limits.max_records or total_b > limits.max_bytes:
            by_bytes = total_r <= limits.max_records
            victim = self._store_victim(new, delta, taken, by_bytes=by_bytes)
            if victim is None:
                return PutResult.STORE_FULL
            evict(victim)
            total_r, total_b = total_r - 1, total_b - victim.cost
        return victims

    def _key_victim(self, entries: list[_Entry], new: _Entry) -> _Entry | None:
        """The entry of a full key dictionary that ``new`` may displace, if any."""
        held = Counter(e.owner for e in entries if not e.exempt)
        others = [(count, owner) for owner, count in held.items() if owner != new.owner]
        if others:
            count, owner = max(others)
            if count > held[new.owner] + 1:
                return min((e for e in entries if e.owner == owner), key=lambda e: e.record.expiration)
        own = [e for e in entries if e.owner == new.owner]
        soonest = min(own, key=lambda e: e.record.expiration, default=None)
        return soonest if soonest is not None and soonest.record.expiration < new.record.expiration else None

    def _store_victim(
        self, new: _Entry, delta: dict[str, tuple[int, int]], taken: set[_Slot], *, by_bytes: bool
    ) -> _Entry | None:
        """The record a full store evicts for ``new``: the largest other owner's, if it holds more."""

        def held(owner: str) -> int:
            usage = self._owners.get(owner, _Usage())
            extra = delta.get(owner, (0, 0))
            return usage.bytes + extra[1] if by_bytes else usage.records + extra[0]

        newcomer = held(new.owner)
        candidates = [(held(owner), owner) for owner in self._owners if owner != new.owner]
        for amount, owner in sorted(candidates, reverse=True):
            if amount <= newcomer:
                break
            victim = self._soonest_of(owner, taken)
            if victim is not None:
                return victim
        victim = self._soonest_of(new.owner, taken)
        if victim is not None and victim.record.expiration < new.record.expiration:
            return victim
        return None

    def _soonest_of(self, owner: str, taken: set[_Slot]) -> _Entry | None:
        usage = self._owners.get(owner)
        if usage is None:
            return None
        live = (e for slot, e in usage.entries.items() if slot not in taken)
        return min(live, key=lambda e: e.record.expiration, default=None)

    def _replace(self, current: _Entry | None, entry: _Entry) -> None:
        """Put ``entry`` in its slot, dropping ``current`` (the slot's record, if any)."""
        if current is not None:
            self._discard(current)
        self._keys.setdefault(entry.record.key, {})[entry.record.subkey] = entry
        self._count += 1
        if not entry.exempt:
            usage = self._owners.setdefault(entry.owner, _Usage())
            usage.records += 1
            usage.bytes += entry.cost
            usage.entries[entry.slot] = entry
            self._records += 1
            self._bytes += entry.cost
        heapq.heappush(self._heap, (entry.record.expiration, next(self._sequence), entry.record))
        if len(self._heap) > 2 * self._count + 64:  # superseded records leave stale heap entries
            self._heap = [(r.expiration, next(self._sequence), r) for r in self.records()]
            heapq.heapify(self._heap)

    def _discard(self, entry: _Entry) -> None:
        """Remove a stored entry; its heap entry goes stale and is skipped later."""
        slots = self._keys[entry.record.key]
        del slots[entry.record.subkey]
        if not slots:
            del self._keys[entry.record.key]
        self._count -= 1
        if not entry.exempt:
            usage = self._owners[entry.owner]
            usage.records -= 1
            usage.bytes -= entry.cost
            del usage.entries[entry.slot]
            if not usage.entries:
                del self._owners[entry.owner]
            self._records -= 1
            self._bytes -= entry.cost

    def _stored_entry(self, record: SignedRecord) -> _Entry | None:
        slots = self._keys.get(record.key)
        entry = None if slots is None else slots.get(record.subkey)
        return entry if entry is not None and entry.record is record else None

    def drop_owner(self, owner: str) -> int:
        """Drop every (non-exempt) record charged to ``owner``, e.g. a revoked user; return how many."""
        usage = self._owners.get(owner)
        if usage is None:
            return 0
        entries = list(usage.entries.values())
        for entry in entries:
            self._discard(entry)
        return len(entries)

    def remove_expired(self, now: float) -> int:
        """Drop every record that expired at or before ``now``; return how many were dropped."""
        removed = 0
        while self._heap and self._heap[0][0] <= now:
            entry = self._stored_entry(heapq.heappop(self._heap)[2])
            if entry is not None:
                self._discard(entry)
                removed += 1
        return removed

    # ---------------------------------------------------------------- reading

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
        ordered = [] if plain is None else [plain.record]
        ordered += [slots[subkey].record for subkey in sorted(s for s in slots if s is not None)]
        return [record for record in ordered if record.expiration > now]

    def usage(self, owner: str) -> tuple[int, int]:
        """``(records, bytes)`` charged to ``owner``."""
        usage = self._owners.get(owner)
        return (0, 0) if usage is None else (usage.records, usage.bytes)

    @property
    def charged(self) -> tuple[int, int]:
        """``(records, bytes)`` charged to all owners (exempt records are not)."""
        return self._records, self._bytes

    def keys(self) -> list[bytes]:
        """Return the key ids with at least one stored record (expired ones linger until removed)."""
        return list(self._keys)

    def records(self) -> Iterator[SignedRecord]:
        """Iterate over a snapshot of every stored record, e.g. to hand them off before leaving.

        Call :meth:`remove_expired` first to leave out records that expired since the last cleanup.
        """
        return iter([entry.record for slots in self._keys.values() for entry in slots.values()])

    def __len__(self) -> int:
        return self._count
