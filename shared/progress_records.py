"""Reading the run's progress records from the DHT (the I/O half of :mod:`shared.progress`).

:func:`read_progress_everywhere` is the read behind the lone-step evidence of :mod:`shared.alone`: besides
the lookup through our own routing table it runs, for each backbone we know, a value lookup that *starts
at that backbone* (instead of at the contacts our routing table holds), so that a DHT split in two -- the
failure after a backbone restart -- still shows us the other side's records as long as we can dial one of
its backbones. Each lookup is the iterative one of :mod:`shared.dht.lookup`, bounded by the DHT's own
``num_replicas``/``alpha`` and ``rpc_deadline`` per request; every record goes through our node's
validator, as records of our own lookups do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import msgspec
import trio

from protocols.dht import FindValueRequest, FindValueResponse, SignedRecord
from protocols.errors import DECODE_FAILURES
from protocols.peer_id import PeerId
from protocols.presence import PRESENCE_KEY, Presence
from protocols.training import PROGRESS_KEY, Progress

from .alone import Reading
from .dht.admission import record_user
from .dht.keys import key_id, key_int
from .dht.lookup import Lookup
from .dht.node import DHTNode
from .dht.records import newer
from .dht.routing import Contact
from .errors import ConfigError, RecordRejected
from .net.addresses import PeerAddress, parse_multiaddr
from .net.host import CALL_FAILURES
from .node import Node

__all__ = [
    "MAX_SEEDS",
    "known_backbones",
    "read_progress",
    "read_progress_everywhere",
    "read_progress_seeded",
    "read_progress_with_users",
]

logger = logging.getLogger(__name__)
_PROGRESS = msgspec.msgpack.Decoder(Progress)
_PRESENCE = msgspec.msgpack.Decoder(Presence)
#: The most backbones a read is seeded at (each is one lookup).
MAX_SEEDS = 8


async def read_progress(dht: DHTNode, key: str = PROGRESS_KEY) -> dict[str, Progress]:
    """Every peer's progress by peer id (entries under another peer's subkey or malformed are skipped).

    Raises:
        whatever the DHT lookup raises (CALL_FAILURES).
    """
    return (await read_progress_with_users(dht, key))[0]


async def read_progress_with_users(
    dht: DHTNode, key: str = PROGRESS_KEY
) -> tuple[dict[str, Progress], dict[str, str]]:
    """Every peer's progress by peer id, and the user each of those peers speaks for (pass it as
    ``summarize(..., users=...)`` so that majorities are counted in users, not peer ids).

    Raises:
        whatever the DHT lookup raises (CALL_FAILURES).
    """
    found = await dht.get(key, latest=True)
    return _decode(found.entries.values() if found is not None else ())


async def read_progress_everywhere(
    node: Node, backbones: Sequence[PeerAddress], key: str = PROGRESS_KEY
) -> list[Reading]:
    """The progress records as read through our DHT (``source`` "dht") and through a lookup seeded at each
    of ``backbones`` (``source``: its address), all in parallel; a source that fails is a reading with
    ``answered=False``. Addresses without a peer id, or of ourselves, are skipped. Callers bound the whole
    read with a cancel scope; each request is bounded by the DHT's ``rpc_deadline``."""
    readings: list[Reading] = []

    async def own() -> None:
        try:
            records, users = await read_progress_with_users(node.dht, key)
        except CALL_FAILURES as exc:
            logger.debug("reading the progress records failed: %s", exc)
            readings.append(Reading("dht", False, {}, {}))
            return
        readings.append(Reading("dht", True, records, users))

    async def seeded(address: PeerAddress) -> None:
        readings.append(await read_progress_seeded(node, address, key))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(own)
        for address in backbones:
            if address.peer_id is not None and address.peer_id != node.peer_id:
                nursery.start_soon(seeded, address)
    return readings


async def known_backbones(dht: DHTNode, listed: Sequence[str] = ()) -> list[PeerAddress]:
    """Where to seed :func:`read_progress_everywhere`: the backbones ``listed`` (the run manifest's
    multiaddrs; ones without a peer id or malformed are skipped), then peers whose presence record says
    ``backbone`` (self-declared, which is harmless here: a seed can only add records that pass our
    validator, or withhold some), one address per peer, at most :data:`MAX_SEEDS`.

    Raises:
        whatever the DHT lookup raises (CALL_FAILURES).
    """
    seeds: dict[str, PeerAddress] = {}
    for text in listed:
        try:
            address = parse_multiaddr(text)
        except ConfigError:
            continue
        if address.peer_id is not None:
            seeds.setdefault(address.peer_id, address)
    found = await dht.get(PRESENCE_KEY, latest=True)
    for subkey, record in found.entries.items() if found is not None else ():
        if subkey != record.writer.encode():
            continue
        try:
            presence = _PRESENCE.decode(record.value)
        except DECODE_FAILURES:
            continue
        if presence.role != "backbone" or record.writer in seeds:
            continue
        for text in presence.addrs:
            try:
                seeds[record.writer] = parse_multiaddr(text).with_peer(PeerId(record.writer))
                break
            except ConfigError:
                continue
    return list(seeds.values())[:MAX_SEEDS]


async def read_progress_seeded(node: Node, seed: PeerAddress, key: str = PROGRESS_KEY) -> Reading:
    dht = node.dht
    kid = key_id(key)
    assert seed.peer_id is not None
    try:
        first = Contact.of(seed.peer_id, (str(seed),))
    except ValueError:
        return Reading(str(seed), False, {}, {})
    lookup = Lookup(
        key_int(kid), [first], k=dht.config.num_replicas, alpha=dht.config.alpha, own_id=dht.node_id
    )
    request = FindValueRequest(key=kid)
    found: list[SignedRecord] = []
    answered = False

    async def query(contact: Contact) -> None:
        nonlocal answered
        try:
            address = parse_multiaddr(contact.addrs[0]).with_peer(contact.peer_id)
            with trio.fail_after(dht.config.rpc_deadline):
                reply = await node.host.call(address, request)
        except (*CALL_FAILURES, ConfigError) as exc:
            logger.debug("progress lookup: %s failed: %s", contact.peer_id, exc)
            lookup.on_failure(contact)
            return
        if not isinstance(reply, FindValueResponse):
            lookup.on_failure(contact)
            return
        answered |= contact.peer_id == first.peer_id
        learned = []
        for info in reply.nodes:
            try:
                learned.append(Contact.from_info(info))
            except ValueError:
                continue
        lookup.on_response(contact, learned)
        now = time.time()
        for record in reply.records:
            if record.key != kid:
                continue
            try:
                dht.validator.validate(record, now)
            except RecordRejected as exc:
                logger.debug("progress lookup: ignoring a record of %s: %s", record.writer, exc)
                continue
            found.append(record)

    while not lookup.finished:
        batch = lookup.next_queries()
        if not batch:
            break
        async with trio.open_nursery() as nursery:
            for contact in batch:
                nursery.start_soon(query, contact)
    records, users = _decode(_newest(found))
    return Reading(str(seed), answered, records, users)


def _newest(records: Iterable[SignedRecord]) -> list[SignedRecord]:
    """One record per subkey: the newest (as a DHT lookup merges replicas)."""
    best: dict[bytes | None, SignedRecord] = {}
    for record in records:
        current = best.get(record.subkey)
        if current is None or newer(record, current):
            best[record.subkey] = record
    return list(best.values())


def _decode(entries: Iterable[SignedRecord]) -> tuple[dict[str, Progress], dict[str, str]]:
    records: dict[str, Progress] = {}
    users: dict[str, str] = {}
    for record in entries:
        if record.subkey != record.writer.encode():
            continue
        try:
            records[record.writer] = _PROGRESS.decode(record.value)
        except DECODE_FAILURES:
            logger.debug("ignoring a malformed progress record of %s", record.writer)
            continue
        users[record.writer] = record_user(record)
    return records, users
