"""A real pinned backbone API in the test's own trio run: Hypercorn over HTTPS with the authority's
certificate (the backbone's own ``_serve_api``), a SQLite ledger, and an optional shard directory;
:func:`member_client` admits a machine and gives it an API client that signs its requests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import trio

from backbone.api import ApiState
from backbone.ledger import LedgerStore
from backbone.service import BackboneOptions, _serve_api
from protocols.api import Manifest
from protocols.training import TrainingSpec
from shared.auth.authority import AUTHORITY_FILE, Authority, pin_run_id
from shared.auth.keys import Identity
from volunteer.api_client import ApiClient


@dataclass(frozen=True)
class PinnedApi:
    run_id: str  # pinned: name@fingerprint
    urls: list[str]  # https://127.0.0.1:PORT
    authority: Authority
    store: LedgerStore
    admin_token: str = "test-admin-token"


@contextlib.asynccontextmanager
async def serve_pinned_api(
    data_dir: Path,
    shards_dir: Path | None = None,
    run_id: str = "api-run",
    database_url: str | None = None,
    *,
    training: TrainingSpec | None = None,
    tokenizer: Path | None = None,
) -> AsyncIterator[PinnedApi]:
    """``database_url``: the ledger (default: SQLite in ``data_dir``); two APIs of one run share the
    authority key in their ``data_dir`` and one ``database_url``, as two backbones do. ``training`` is
    the spec the manifest serves, ``tokenizer`` the file served as the run's tokenizer."""
    authority = await trio.to_thread.run_sync(Authority.load_or_create, data_dir / AUTHORITY_FILE)
    pinned = pin_run_id(run_id, authority)
    url = database_url or f"sqlite:///{data_dir / 'ledger.sqlite3'}"
    store = await trio.to_thread.run_sync(LedgerStore.open, url)
    urls: list[str] = []

    async def no_op(username: str) -> None:
        return None

    state = ApiState(
        run_id=pinned,
        authority=authority,
        store=store,
        admin_token="test-admin-token",
        manifest=lambda: Manifest(
            run_id=pinned,
            authority_public_key=authority.identity.public_key_bytes,
            api=urls,
            training=training,
        ),
        revocations=list,
        on_user_removed=no_op,
        shards_dir=shards_dir,
        tokenizer=tokenizer,
    )
    options = BackboneOptions(
        run_id=pinned, data_dir=data_dir, listen=(), initial_peers=(), api_listen="127.0.0.1:0"
    )
    try:
        async with trio.open_nursery() as nursery:
            served: list[str] = await nursery.start(_serve_api, state, authority, options)
            urls.extend(u for u in served if "127.0.0.1" in u)
            yield PinnedApi(pinned, urls, authority, store)
            nursery.cancel_scope.cancel()
    finally:
        await trio.to_thread.run_sync(store.close)


def member_client(api: PinnedApi, username: str = "alice") -> ApiClient:
    """Admit a new machine of ``username`` and return its client (with its identity and a token)."""
    member = Identity.generate()
    now = time.time()
    api.store.add_user(username, now=now)
    secret = api.store.create_invite(username, now=now)
    api.store.redeem_invite(secret, member.peer_id, member.public_key_bytes, now=now)
    token = api.authority.issue_token(api.run_id, username, member.peer_id, member.public_key_bytes, now, 600)
    return ApiClient(api.run_id, api.urls, identity=member, token=lambda: token)
