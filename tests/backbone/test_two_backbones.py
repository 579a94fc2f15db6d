"""Issue 10 item 7: two backbones of one run keep one ledger (one database, SQLite file or PostgreSQL).

Two real pinned APIs in this process share the authority key and the ledger database, as
``backbone start --authority-key … --database-url …`` does; a volunteer's API client lists both URLs.
A report goes to whichever backbone answers; one retried at the other backbone after the first died (the
answer lost with it) is recorded once and credited once; and the client keeps to the backbone that last
answered instead of trying the dead one first on every request.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import trio

from backbone.ledger import LedgerStore
from shared.auth.authority import AUTHORITY_FILE
from shared.auth.keys import Identity
from tests.backbone.ledger.reports import make_report, part_receipt, sign

from .pinned_api import PinnedApi, member_client, serve_pinned_api


def admit(store: LedgerStore, username: str) -> Identity:
    peer = Identity.generate()
    now = time.time()
    store.add_user(username, now=now)
    secret = store.create_invite(username, now=now)
    store.redeem_invite(secret, peer.peer_id, peer.public_key_bytes, now=now)
    return peer


async def test_reports_go_to_whichever_backbone_answers_and_are_credited_once(
    tmp_path: Path, ledger_url: str
) -> None:
    stop_one, one_gone = trio.Event(), trio.Event()

    async def backbone_one(task_status: trio.TaskStatus[PinnedApi]) -> None:
        async with serve_pinned_api(tmp_path / "bb1", database_url=ledger_url) as api:
            task_status.started(api)
            await stop_one.wait()
        one_gone.set()

    async with trio.open_nursery() as nursery:
        one: PinnedApi = await nursery.start(backbone_one)
        (tmp_path / "bb2").mkdir(mode=0o700)
        shutil.copy(tmp_path / "bb1" / AUTHORITY_FILE, tmp_path / "bb2" / AUTHORITY_FILE)
        async with serve_pinned_api(tmp_path / "bb2", database_url=ledger_url) as two:
            await exchange(one, two, stop_one, one_gone)


async def exchange(one: PinnedApi, two: PinnedApi, stop_one: trio.Event, one_gone: trio.Event) -> None:
    assert two.run_id == one.run_id
    run_id = one.run_id

    client = member_client(one, "alice")
    client.urls = [*one.urls, *two.urls]
    alice = client.identity
    assert alice is not None
    bob = admit(one.store, "bob")
    now = time.time()
    for step in (1, 2):
        one.store.record_step(step, finished_at=now, loss=None, samples=64, peers=2)

    def report(seq: int) -> bytes | object:
        backed = part_receipt(bob, alice.peer_id, seq, 32.0, run_id, 10, now)
        return sign(
                alice,
                make_report(
                    alice, seq, start=now - 100 + 30 * seq, length=20, samples=32, compute_seconds=1.0,
                    global_step=seq, run_id=run_id, receipts=[backed],
                ),
            )  # fmt: skip

    answer = await client.report(report(1))  # type: ignore[arg-type]
    assert answer.recorded and answer.credited and answer.samples == 32.0

    stop_one.set()  # backbone 1 is gone for good (had it died before answering, the volunteer retries)
    await one_gone.wait()
    again = await client.report(report(1))  # type: ignore[arg-type]
    assert not again.recorded and again.samples == 0.0  # backbone 2 knows it: not credited twice
    answer = await client.report(report(2))  # type: ignore[arg-type]
    assert answer.recorded and answer.credited and answer.samples == 32.0

    board = {row.username: row for row in two.store.leaderboard()}
    assert board["alice"].samples == 64
    assert [r.seq for r in two.store.peer_reports(alice.peer_id)] == [1, 2]


async def test_the_client_keeps_to_the_backbone_that_answered(tmp_path: Path) -> None:
    """A dead first URL is tried once, not before every request (on the Internet each try of a dead
    backbone can cost the whole connect deadline)."""
    attempts = 0

    async def dead_backbone(stream: trio.SocketStream) -> None:
        nonlocal attempts
        attempts += 1
        await stream.aclose()

    async with serve_pinned_api(tmp_path / "bb") as api, trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, dead_backbone, 0)
        port = listeners[0].socket.getsockname()[1]
        client = member_client(api)
        client.urls = [f"https://127.0.0.1:{port}", *api.urls]
        await client.manifest()
        assert attempts == 1
        await client.manifest()
        await client.list_shards()
        assert attempts == 1
        nursery.cancel_scope.cancel()
