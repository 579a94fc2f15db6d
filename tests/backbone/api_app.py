"""The backbone's API app in this process (no sockets, no TLS): httpx's ASGI transport in front of
``build_app`` with a SQLite ledger, two dataset shards and one admitted member, for fast API tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from backbone.api import ApiState, build_app
from backbone.ledger import LedgerStore
from protocols.api import (
    ACCESS_SCHEME,
    ApiCredential,
    Manifest,
    api_request_payload,
    encode_api_credential,
)
from protocols.auth import SignedToken
from shared.auth.authority import Authority, pin_run_id
from shared.auth.keys import Identity
from shared.data.corpus import write_shards

ADMIN = "the-admin-token"


@dataclass
class InProcessApi:
    state: ApiState
    member: Identity
    token: SignedToken

    @property
    def base(self) -> str:
        return f"/v1/runs/{self.state.run_id}"

    def credential(
        self,
        method: str,
        path: str,
        *,
        who: Identity | None = None,
        token: SignedToken | None = None,
        timestamp: float | None = None,
    ) -> dict[str, str]:
        """The ``authorization`` header of a member's signed GET of ``path`` (below the run's base)."""
        now = time.time() if timestamp is None else timestamp
        signer = who or self.member
        signature = signer.sign(api_request_payload(self.state.run_id, method, path, now))
        credential = ApiCredential(token=token or self.token, timestamp=now, signature=signature)
        return {"authorization": f"{ACCESS_SCHEME} {encode_api_credential(credential)}"}

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(self.state), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://backbone") as client:
            return await client.request(method, f"{self.base}/{path}", **kwargs)


@contextlib.contextmanager
def in_process_api(data_dir: Path, **limits: Any) -> Iterator[InProcessApi]:
    """``limits``: ApiState rate limiters to replace (``reports_by_peer=RateLimiter(...)``)."""
    authority = Authority.load_or_create(data_dir / "authority.key")
    run_id = pin_run_id("api-test", authority)
    write_shards(data_dir / "shards", 2, 5)
    member = Identity.generate()
    now = time.time()
    with LedgerStore.open(f"sqlite:///{data_dir / 'ledger.sqlite3'}") as store:
        store.add_user("alice", now=now)
        secret = store.create_invite("alice", now=now)
        store.redeem_invite(secret, member.peer_id, member.public_key_bytes, now=now)

        async def removed(username: str) -> None:
            return None

        state = ApiState(
            run_id=run_id,
            authority=authority,
            store=store,
            admin_token=ADMIN,
            manifest=lambda: Manifest(
                run_id=run_id,
                authority_public_key=authority.identity.public_key_bytes,
                api=["https://127.0.0.1:1"],
            ),
            revocations=list,
            on_user_removed=removed,
            shards_dir=data_dir / "shards",
            **limits,
        )
        token = authority.issue_token(run_id, "alice", member.peer_id, member.public_key_bytes, now, 3600)
        yield InProcessApi(state, member, token)


def run(fn: Any, *args: Any) -> Any:
    """``trio.run`` for hypothesis examples (one short event loop each)."""
    return trio.run(fn, *args)
