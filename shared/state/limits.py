"""Bounds on a state download, decided before anything is allocated, and memory of bad sources (DESIGN D10
(a), (f); issue 9, finding 2).

**Sizes.** An announcement's ``nbytes`` is a remote claim. A download starts only if it is within

1. the wire ceiling :data:`~protocols.state.MAX_STATE_BYTES` (the decoder enforces it), and
2. what the caller expects, ``max_bytes``:

   * a **volunteer** builds the run's model, the same on every peer, so it knows the largest state of the
     run: :func:`state_size_bound` of the model's tensors plus the optimizer's slots per parameter (two for
     Adam/AdamW's moments, plus a step scalar). Its own blob is no guide (at step 0 the optimizer state is
     still empty); the bound is derived from the parameters and is tight: a real state of the same model
     is at most a few hundred bytes of header below it.
   * a **backbone** (no torch, no model) takes :func:`checkpoint_size_limit`: a configured maximum; at
     most :data:`STATE_GROWTH` times the largest checkpoint it keeps (a state is the model plus optimizer
     slots proportional to it: from step 0, when Adam's moments do not exist yet, to any later step it
     grows about 3x, never more; nothing else in a run changes its size); and what the disk can take
     beyond a reserve.

Nothing is sized by the claim: :func:`~shared.state.transfer.fetch_state` writes each verified-length
chunk (at most :data:`~protocols.state.MAX_CHUNK_BYTES`, at most what was asked for) to a file, hashes the
file, and only a blob whose SHA-256 matches -- and which is at most ``max_bytes`` -- is read into memory.

**Sources.** :class:`SourceBook` is what one process learned from its downloads: every failure of a peer
is counted; the first of a streak is logged (then the peer is skipped for a cool-down that doubles with
each further failure); a peer that *misbehaved* (a malformed or lying reply, bytes that do not hash to
the digest) is skipped for :attr:`SourceBook.fault_cooldown`; and an announcement refused outright (too
large, not a state) is remembered per writer until that writer announces something else, so a record
that lives for a day is not retried every period.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from protocols.state import MAX_STATE_BYTES
from protocols.training import StateAnnouncement

from ..errors import StateError

__all__ = [
    "DISK_RESERVE",
    "STATE_GROWTH",
    "SourceBook",
    "SourceBookStatistics",
    "check_announced_size",
    "checkpoint_size_limit",
    "state_size_bound",
]

logger = logging.getLogger("shared.state")

#: A state is at most this many times larger than an earlier state of the same run (see the docstring).
STATE_GROWTH = 4
#: Bytes of disk a backbone leaves free when it accepts a download.
DISK_RESERVE = 256 * 1024 * 1024
#: JSON header bytes per tensor besides its name: ``{"dtype":"F32","shape":[],"data_offsets":[a,b]}``
#: with two 20-digit offsets, plus quotes, colon and comma.
_TENSOR_HEADER = 96
#: Header bytes per dimension of a shape (a 20-digit number and a comma).
_DIM_HEADER = 21
#: The ``__metadata__`` object besides the run id and task name (format, step, keys, braces).
_METADATA_HEADER = 256


def state_size_bound(tensors: Iterable[tuple[str, int, int]], metadata: Iterable[str]) -> int:
    """The largest safetensors state blob (:func:`~shared.state.blob.encode_state`) holding ``tensors``.

    Args:
        tensors: ``(name, data bytes, number of dimensions)`` of every tensor the state may hold.
        metadata: the metadata values besides format and step (the run id, the task name).

    Returns:
        8 bytes of header length, the JSON header (each name and value as JSON with ASCII escapes, fixed
        bytes per tensor and dimension, padding to 8 bytes) and the tensors' bytes.
    """
    data = header = 0
    for name, nbytes, ndim in tensors:
        data += nbytes
        header += _json_len(name) + _TENSOR_HEADER + _DIM_HEADER * ndim
    header += _METADATA_HEADER + sum(_json_len(value) for value in metadata) + 7
    return 8 + header + data


def _json_len(text: str) -> int:
    return len(json.dumps(text, ensure_ascii=True))


def checkpoint_size_limit(
    configured: int, kept: Sequence[int], free_disk: int, *, reserve: int = DISK_RESERVE
) -> int:
    """The largest state a backbone accepts now (see the module docstring).

    Args:
        configured: the organizer's maximum.
        kept: the sizes of the checkpoints it holds (none: only the maximum and the disk bound it).
        free_disk: bytes available on the checkpoint store's file system.
        reserve: bytes to leave free.
    """
    limit = min(configured, MAX_STATE_BYTES, free_disk - reserve)
    if kept:
        limit = min(limit, STATE_GROWTH * max(kept))
    return max(0, limit)


def check_announced_size(announcement: StateAnnouncement, max_bytes: int) -> None:
    """Refuse an announcement whose size is out of bounds, before anything is allocated for it.

    Raises:
        StateError: ``nbytes`` is not in ``[1, min(max_bytes, MAX_STATE_BYTES)]``.
    """
    limit = min(max_bytes, MAX_STATE_BYTES)
    if not 0 < announcement.nbytes <= limit:
        raise StateError(
            f"state of step {announcement.step} announced as {announcement.nbytes} bytes;"
            f" at most {limit} expected"
        )


@dataclass(frozen=True)
class SourceBookStatistics:
    failures: int  # every failed download attempt from a peer, counted
    faults: int  # of which the peer misbehaved
    refused: int  # announcements refused outright (remembered until they change)
    cooling: int  # peers skipped right now


@dataclass
class _Peer:
    streak: int = 0
    until: float = 0.0
    unreachable: bool = False  # the last failure was no answer at all (refused, reset, stalled)


class SourceBook:
    """Failures of state sources and refused announcements (see the module docstring).

    Args:
        clock: monotonic seconds (tests pass their own).
        base_cooldown: seconds a peer is skipped after its first unavailability; doubled per further one.
        max_cooldown: the longest skip for unavailability.
        fault_cooldown: seconds a peer that misbehaved is skipped.
        max_entries: peers and refused announcements remembered (oldest forgotten first).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        base_cooldown: float = 2.0,
        max_cooldown: float = 60.0,
        fault_cooldown: float = 600.0,
        max_entries: int = 4096,
    ) -> None:
        self.clock = clock
        self.base_cooldown = base_cooldown
        self.max_cooldown = max_cooldown
        self.fault_cooldown = fault_cooldown
        self.max_entries = max_entries
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._refused: OrderedDict[str, tuple[int, bytes, int]] = OrderedDict()
        self._failures = self._faults = self._refusals = 0

    def usable(self, peer: str) -> bool:
        """Whether ``peer`` may be asked for a state now."""
        entry = self._peers.get(peer)
        return entry is None or entry.until <= self.clock()

    def failing(self, peer: str) -> bool:
        """Whether the last download we tried from ``peer`` failed without an answer (connection refused
        or reset, stalled) and it has not served us since. A peer that answered -- "no such state here",
        say, because it moved on from the state it announced -- is alive, and is not failing: it may hold
        a newer state (:func:`shared.alone.state_lost` must not take it for a dead holder)."""
        entry = self._peers.get(peer)
        return entry is not None and entry.streak > 0 and entry.unreachable

    def failed(self, peer: str, reason: str, *, fault: bool = False, unreachable: bool = False) -> None:
        """Count a failed download from ``peer``; log the first of a streak; skip the peer for a while.
        ``unreachable``: it gave no answer at all (:meth:`failing`)."""
        entry = self._peers.pop(peer, None) or _Peer()
        self._peers[peer] = entry  # most recently failing last
        entry.streak += 1
        entry.unreachable = unreachable
        self._failures += 1
        if fault:
            self._faults += 1
            cooldown = self.fault_cooldown
        else:
            cooldown = min(self.max_cooldown, self.base_cooldown * 2 ** min(entry.streak - 1, 30))
        entry.until = max(entry.until, self.clock() + cooldown)
        if entry.streak == 1:
            log = logger.warning if fault else logger.info
            log("state source %s failed (%s); skipping it for %.0f s", peer, reason, cooldown)
        else:
            logger.debug("state source %s failed again (%d in a row): %s", peer, entry.streak, reason)
        self._trim(self._peers)

    def succeeded(self, peer: str) -> None:
        """``peer`` served a verified state: forget its failures."""
        self._peers.pop(peer, None)

    def refuse(self, writer: str, announcement: StateAnnouncement, reason: str) -> None:
        """Remember that ``writer``'s ``announcement`` was refused (logged once)."""
        key = (announcement.step, announcement.digest, announcement.nbytes)
        if self._refused.get(writer) == key:
            return
        self._refused.pop(writer, None)
        self._refused[writer] = key
        self._refusals += 1
        logger.warning("refusing the state announced by %s: %s", writer, reason)
        self._trim(self._refused)

    def refused(self, writer: str, announcement: StateAnnouncement) -> bool:
        """Whether ``writer`` still announces what was refused."""
        return self._refused.get(writer) == (announcement.step, announcement.digest, announcement.nbytes)

    def statistics(self) -> SourceBookStatistics:
        now = self.clock()
        return SourceBookStatistics(
            failures=self._failures,
            faults=self._faults,
            refused=self._refusals,
            cooling=sum(1 for e in self._peers.values() if e.until > now),
        )

    def _trim(self, entries: OrderedDict[str, _Peer] | OrderedDict[str, tuple[int, bytes, int]]) -> None:
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
