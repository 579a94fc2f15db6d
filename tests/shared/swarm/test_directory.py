"""The stage directory (shared.swarm.directory): servers announce signed records under their stage's key,
one per writer; a record under another peer's subkey is refused by the run's validator; records of
another stage, another stage count or with no usable address are skipped; a republish is newer."""

from __future__ import annotations

import time

import msgspec
import pytest
import trio

from protocols.swarm import STAGE_RECORD_TTL, StageRecord, stage_key
from shared.errors import RecordRejected
from shared.node import Node
from shared.swarm.directory import find_stage_servers
from tests.swarmkit import start_node

RUN_ID = "directory-test"


async def _announce(node: Node, record: StageRecord, stage: int, ttl: float = STAGE_RECORD_TTL) -> None:
    value = msgspec.msgpack.encode(record)
    await node.dht.store(stage_key(stage), value, time.time() + ttl, subkey=node.peer_id.encode())


async def test_servers_announce_and_trainers_find_them(nursery: trio.Nursery) -> None:
    seed = (await start_node(nursery, RUN_ID, []))[0]
    initial = [seed.host.listen_addrs[0]]
    good, other_stage, other_count, no_address, reader = [
        (await start_node(nursery, RUN_ID, initial))[0] for _ in range(5)
    ]
    await _announce(good, StageRecord(stage=1, stages=3, addrs=[good.host.listen_addrs[0]]), 1)
    await _announce(other_stage, StageRecord(stage=2, stages=3, addrs=[other_stage.host.listen_addrs[0]]), 1)
    await _announce(other_count, StageRecord(stage=1, stages=4, addrs=[other_count.host.listen_addrs[0]]), 1)
    await _announce(no_address, StageRecord(stage=1, stages=3, addrs=["/dns4/nowhere/bogus"]), 1)
    found = await find_stage_servers(reader.dht, 1, 3)
    assert list(found) == [good.peer_id]
    entry = found[good.peer_id]
    assert entry.address.peer_id == good.peer_id and entry.record.stage == 1
    assert await find_stage_servers(reader.dht, 0, 3) == {}

    await trio.sleep(0.01)
    await _announce(good, StageRecord(stage=1, stages=3, addrs=[good.host.listen_addrs[0]], step=4), 1)
    again = (await find_stage_servers(reader.dht, 1, 3))[good.peer_id]
    assert again.announced > entry.announced and again.record.step == 4  # lifts a trainer's ban


async def test_a_stage_record_under_another_peers_subkey_is_refused(nursery: trio.Nursery) -> None:
    first = (await start_node(nursery, RUN_ID, []))[0]
    liar = (await start_node(nursery, RUN_ID, [first.host.listen_addrs[0]]))[0]
    value = msgspec.msgpack.encode(StageRecord(stage=0, stages=2, addrs=[liar.host.listen_addrs[0]]))
    with pytest.raises(RecordRejected):
        await liar.dht.store(stage_key(0), value, time.time() + 30, subkey=first.peer_id.encode())
    with pytest.raises(RecordRejected):  # and no plain record under a stage key either
        await liar.dht.store(stage_key(0), value, time.time() + 30)
    assert await find_stage_servers(first.dht, 0, 2) == {}
