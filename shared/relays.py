"""Relay discovery (issue 14 item 3): who offers relay slots in this run, told through the DHT.

Every node that serves relay slots (:class:`~shared.net.relay.RelayService`: backbones unless started with
``--no-relay``, volunteers started with ``--relay`` once a backbone proved them directly reachable)
publishes a :class:`~protocols.relay.RelayRecord` under :data:`~protocols.relay.RELAYS_KEY`, subkey its own
peer id (the run's validator takes such an entry only from that peer, signed, and in a pinned run only
from an admitted one), with its direct addresses. Records expire after
:data:`~protocols.relay.RELAY_RECORD_TTL` and are refreshed every third of that (at once when the
addresses change), so a relay that died drops out within two minutes.

:func:`find_relays` reads them for :func:`shared.net.reachability.keep_relayed`, which tries them after
the relay that checked its reachability. A record is only a hint: a client trusts a relay once a
reservation there succeeded over the authenticated handshake, which proves the peer id the record names;
a record that points elsewhere costs one failed dial.

**Volunteer relays** serve :data:`VOLUNTEER_RELAY_LIMITS`: few reservations and circuits, bounded bytes
and seconds per circuit, so relaying for others cannot eat the volunteer's own role (a circuit is cut at
its limit; the two peers then redial, and most relayed links are replaced by punched ones anyway).
"""

from __future__ import annotations

import logging
import time

import msgspec
import trio

from protocols.errors import DECODE_FAILURES
from protocols.peer_id import PeerId
from protocols.relay import RELAY_RECORD_TTL, RELAYS_KEY, RelayRecord

from .dht.node import DHTNode
from .errors import ConfigError
from .net.addresses import PeerAddress, parse_multiaddr
from .net.relay import RelayLimits
from .node import Node

__all__ = ["MAX_RELAYS", "VOLUNTEER_RELAY_LIMITS", "find_relays", "publish_relay_forever"]

logger = logging.getLogger(__name__)

#: What a ``--relay`` volunteer offers (a backbone offers :class:`RelayLimits`'s defaults).
VOLUNTEER_RELAY_LIMITS = RelayLimits(
    max_reservations=4,
    max_circuits=8,
    max_circuit_bytes=256 << 20,
    max_circuit_seconds=300.0,
)
#: At most this many relays are taken from the DHT per lookup.
MAX_RELAYS = 16
_RECORD = msgspec.msgpack.Decoder(RelayRecord)


def relay_record(node: Node) -> RelayRecord:
    """Our record: the addresses we advertise that are direct (a relayed one cannot carry a relay)."""
    direct = [a for a in node.host.advertised_addrs if "/p2p-circuit" not in a]
    return RelayRecord(addrs=direct[:8])


async def publish_relay_forever(node: Node) -> None:
    """Keep our relay record fresh (every third of its TTL, at once when our addresses change)."""
    published: RelayRecord | None = None
    next_publish = trio.current_time()
    while True:
        record = relay_record(node)
        if record.addrs and (trio.current_time() >= next_publish or record != published):
            with node.tolerated.around("relay record publish"):
                await node.dht.store(
                    RELAYS_KEY,
                    msgspec.msgpack.encode(record),
                    time.time() + RELAY_RECORD_TTL,
                    subkey=node.peer_id.encode(),
                )
                published = record
                next_publish = trio.current_time() + RELAY_RECORD_TTL / 3
        await trio.sleep(1.0)


async def find_relays(dht: DHTNode) -> list[PeerAddress]:
    """The relays the DHT's records name: one address per writer (its first usable one, with the writer's
    peer id), entries whose subkey is not their writer's skipped, at most :data:`MAX_RELAYS`.

    Raises:
        whatever the DHT lookup raises (CALL_FAILURES).
    """
    found = await dht.get(RELAYS_KEY, latest=True)
    relays: list[PeerAddress] = []
    for subkey, signed in found.entries.items() if found is not None else ():
        if subkey != signed.writer.encode():
            continue
        try:
            record = _RECORD.decode(signed.value)
        except DECODE_FAILURES:
            continue
        for text in record.addrs:
            try:
                address = parse_multiaddr(text)
            except ConfigError:
                continue
            if address.relay is None and address.peer_id in (None, signed.writer):
                relays.append(address.with_peer(PeerId(signed.writer)))
                break
        if len(relays) >= MAX_RELAYS:
            break
    return relays
