"""Reading the run's progress records from the DHT (the I/O half of :mod:`shared.progress`)."""

from __future__ import annotations

import logging

import msgspec

from protocols.errors import DECODE_FAILURES
from protocols.training import PROGRESS_KEY, Progress

from .dht.node import DHTNode

__all__ = ["read_progress", "read_progress_with_users"]

logger = logging.getLogger(__name__)
_PROGRESS = msgspec.msgpack.Decoder(Progress)


async def read_progress(dht: DHTNode) -> dict[str, Progress]:
    """Every peer's progress by peer id (entries under another peer's subkey or malformed are skipped).

    Raises:
        whatever the DHT lookup raises (CALL_FAILURES).
    """
    return (await read_progress_with_users(dht))[0]


async def read_progress_with_users(dht: DHTNode) -> tuple[dict[str, Progress], dict[str, str]]:
    """Every peer's progress by peer id, and the user each of those peers speaks for (pass it as
    ``summarize(..., users=...)`` so that majorities are counted in users, not peer ids).

    Raises:
        whatever the DHT lookup raises (CALL_FAILURES).
    """
    found = await dht.get(PROGRESS_KEY, latest=True)
    records: dict[str, Progress] = {}
    users: dict[str, str] = {}
    for subkey, record in found.entries.items() if found is not None else ():
        if subkey != record.writer.encode():
            continue
        try:
            records[record.writer] = _PROGRESS.decode(record.value)
        except DECODE_FAILURES:
            logger.debug("ignoring a malformed progress record of %s", record.writer)
            continue
        users[record.writer] = found.users[subkey] if found is not None else record.writer
    return records, users
