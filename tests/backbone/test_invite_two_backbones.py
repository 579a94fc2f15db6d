"""A single-use invite at two backbones of one run sharing one ledger (SQLite file or PostgreSQL): machines
joining through either backbone at once get one admission between them; the others are answered 403
``invite_rejected`` with what happened to the invite. (The database-level race, two stores on one
PostgreSQL without the backbones' write limiter in between: ``ledger/test_invite_uses.py``.)"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import trio

from shared.auth.authority import AUTHORITY_FILE
from shared.auth.keys import Identity
from volunteer.api_client import ApiClient, Refused

from .pinned_api import PinnedApi, serve_pinned_api

MACHINES = 6


async def test_a_single_use_invite_admits_one_machine_across_two_backbones(
    tmp_path: Path, ledger_url: str
) -> None:
    stop_one = trio.Event()  # not a cancellation: the store must close (its connections) on the way out
    async with trio.open_nursery() as nursery:

        async def backbone_one(task_status: trio.TaskStatus[PinnedApi]) -> None:
            async with serve_pinned_api(tmp_path / "bb1", database_url=ledger_url) as api:
                task_status.started(api)
                await stop_one.wait()

        one: PinnedApi = await nursery.start(backbone_one)
        (tmp_path / "bb2").mkdir(mode=0o700)
        shutil.copy(tmp_path / "bb1" / AUTHORITY_FILE, tmp_path / "bb2" / AUTHORITY_FILE)
        async with serve_pinned_api(tmp_path / "bb2", database_url=ledger_url) as two:
            one.store.add_user("alice", now=time.time())
            secret = one.store.create_invite("alice", now=time.time(), max_uses=1)
            outcomes: list[str] = []

            async def join(n: int) -> None:
                api = (one, two)[n % 2]
                try:
                    response = await ApiClient(api.run_id, api.urls).join(secret, Identity.generate())
                    outcomes.append(response.username)
                except Refused as exc:
                    outcomes.append(f"{exc.code}: {exc.reason}")

            async with trio.open_nursery() as joins:
                for n in range(MACHINES):
                    joins.start_soon(join, n)
        stop_one.set()
    used_up = "invite_rejected: the invite has been used by as many machines as it allows"
    assert sorted(outcomes) == sorted(["alice"] + [used_up] * (MACHINES - 1))
