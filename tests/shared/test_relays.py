"""Relay discovery through the DHT (shared.relays): relays publish signed records under run.relays, one per
writer; find_relays lists them with the writer's peer id; a record under someone else's subkey is refused;
a volunteer's relay status shows in status.json's fields."""

from __future__ import annotations

import time

import msgspec
import pytest
import trio

from protocols.peer_id import PeerId
from protocols.relay import RELAY_RECORD_TTL, RELAYS_KEY, RelayRecord
from shared.auth.keys import Identity
from shared.errors import RecordRejected
from shared.net.relay import RelayService
from shared.node import Node, open_node
from shared.panel import status_view
from shared.relays import VOLUNTEER_RELAY_LIMITS, find_relays, publish_relay_forever

RUN_ID = "relays-test"


async def _start(nursery: trio.Nursery, initial: list[str]) -> Node:
    async def run(task_status: trio.TaskStatus[Node]) -> None:
        async with open_node(
            Identity.generate(), RUN_ID, "volunteer", listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial
        ) as node:
            task_status.started(node)
            await trio.sleep_forever()

    node: Node = await nursery.start(run)
    return node


async def test_relays_publish_records_that_others_find(nursery: trio.Nursery) -> None:
    first = await _start(nursery, [])
    seed = [first.host.listen_addrs[0]]
    second, plain, reader = [await _start(nursery, seed) for _ in range(3)]
    first.relay = RelayService(first.host)
    second.relay = RelayService(second.host, VOLUNTEER_RELAY_LIMITS)
    nursery.start_soon(publish_relay_forever, first)
    nursery.start_soon(publish_relay_forever, second)

    with trio.fail_after(20):
        while len(found := await find_relays(reader.dht)) < 2:
            await trio.sleep(0.2)
    by_peer = {a.peer_id: a for a in found}
    assert set(by_peer) == {first.peer_id, second.peer_id}  # not the plain node, which relays nothing
    for node in (first, second):
        address = by_peer[PeerId(node.peer_id)]
        assert address.relay is None and f"/tcp/{address.port}" in node.host.listen_addrs[0]

    status = await trio.to_thread.run_sync(second.status)  # status.json is written from a worker thread
    assert (status.relay_slots, status.relay_reservations) == (VOLUNTEER_RELAY_LIMITS.max_reservations, 0)
    assert plain.status().relay_slots == 0
    rows = {row.label: row.value for row in status_view(status, "member").rows}
    assert rows["relaying"] == "0 of 4 relay slots held by peers behind NAT"
    assert "relaying" not in {row.label for row in status_view(plain.status(), "member").rows}


async def test_a_relay_record_under_another_peers_subkey_is_refused(nursery: trio.Nursery) -> None:
    first = await _start(nursery, [])
    liar = await _start(nursery, [first.host.listen_addrs[0]])
    value = msgspec.msgpack.encode(RelayRecord(addrs=[liar.host.listen_addrs[0]]))
    expiration = time.time() + RELAY_RECORD_TTL
    with pytest.raises(RecordRejected):
        await liar.dht.store(RELAYS_KEY, value, expiration, subkey=first.peer_id.encode())
    assert await find_relays(first.dht) == []
