"""Who serves each pipeline stage, read from the DHT (issue 17 item 3; the record is
:class:`protocols.swarm.StageRecord`, published by :func:`volunteer.swarm.server.announce_forever`).

:func:`find_stage_servers` lists the servers announced under one stage's key: one entry per writer (an
entry whose subkey is not its writer's peer id is skipped, as the run's validator would), whose record
decodes, names that stage, and gives a usable direct address. A record is a hint: the trainer trusts a
server once the authenticated handshake of its first request proved the peer id, and a record that
points elsewhere costs one failed request (the server is then banned until it re-announces).

``announced`` is the record's expiration: a republished record has a strictly later one, which is what
lifts a trainer's ban (:meth:`shared.swarm.wiring.StageRouter.announce`).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.errors import DECODE_FAILURES, ProtocolError
from protocols.peer_id import PeerId
from protocols.swarm import StageRecord, decode_stage_record, stage_key

from ..dht.node import DHTNode
from ..errors import ConfigError
from ..net.addresses import PeerAddress, parse_multiaddr

__all__ = ["MAX_SERVERS_PER_STAGE", "StageServerEntry", "find_stage_servers"]

#: The most servers of one stage a trainer considers (the first ones in subkey order beyond are ignored).
MAX_SERVERS_PER_STAGE = 256
_RECORD_FAILURES: tuple[type[Exception], ...] = (ProtocolError, *DECODE_FAILURES)


@dataclass(frozen=True)
class StageServerEntry:
    peer_id: PeerId
    address: PeerAddress
    record: StageRecord
    #: the record's expiration (unix time): later after every republish
    announced: float


async def find_stage_servers(dht: DHTNode, stage: int, stages: int) -> dict[PeerId, StageServerEntry]:
    """The servers of ``stage`` (of a run of ``stages`` stages) the DHT names now (module docstring).

    Raises:
        whatever the DHT lookup raises (CALL_FAILURES).
    """
    found = await dht.get(stage_key(stage), latest=True)
    servers: dict[PeerId, StageServerEntry] = {}
    for subkey, signed in sorted(found.entries.items()) if found is not None else ():
        if subkey != signed.writer.encode():
            continue
        try:
            record = decode_stage_record(signed.value)
        except _RECORD_FAILURES:
            continue
        if record.stage != stage or record.stages != stages:
            continue
        peer = PeerId(signed.writer)
        for text in record.addrs:
            try:
                address = parse_multiaddr(text)
            except ConfigError:
                continue
            if address.relay is None and address.peer_id in (None, peer):
                servers[peer] = StageServerEntry(peer, address.with_peer(peer), record, signed.expiration)
                break
        if len(servers) >= MAX_SERVERS_PER_STAGE:
            break
    return servers
