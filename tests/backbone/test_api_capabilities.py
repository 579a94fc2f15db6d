"""``POST capabilities`` on a real HTTPS API in this process: signed, measured capabilities reach the ledger;
forged, stale, foreign and unknown ones are refused (backbone.api, volunteer.api_client)."""

from __future__ import annotations

import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from backbone.api import ApiState
from backbone.ledger import LedgerStore
from backbone.service import BackboneOptions, _serve_api
from protocols.api import Manifest
from protocols.ledger import Capabilities, SignedCapabilities, capabilities_payload
from shared.auth.authority import AUTHORITY_FILE, Authority, pin_run_id
from shared.auth.keys import Identity
from shared.errors import AdmissionError
from volunteer.api_client import ApiClient

CAPS = Capabilities(
    samples_per_second=321.0, upload_bps=2.5e6, download_bps=1.25e7, device="CPU: test, 2 cores"
)


@dataclass
class Api:
    run_id: str
    url: str
    store: LedgerStore
    cert: Path

    def client(self) -> ApiClient:
        return ApiClient(self.run_id, [self.url])

    async def post(self, body: object) -> httpx.Response:
        context = ssl.create_default_context(cafile=str(self.cert))
        context.check_hostname = False
        async with httpx.AsyncClient(verify=context) as client:
            return await client.post(
                f"{self.url}/v1/runs/{self.run_id}/capabilities",
                content=msgspec.json.encode(body),
                headers={"content-type": "application/json"},
            )


@pytest.fixture
async def api(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Api]:
    authority = Authority.load_or_create(tmp_path / AUTHORITY_FILE)
    run_id = pin_run_id("caps-run", authority)
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:

        async def nothing(username: str) -> None:
            return None

        state = ApiState(
            run_id=run_id,
            authority=authority,
            store=store,
            admin_token="admin",
            manifest=lambda: Manifest(
                run_id=run_id, authority_public_key=authority.identity.public_key_bytes
            ),
            revocations=list,
            on_user_removed=nothing,
        )
        options = BackboneOptions(
            run_id=run_id, data_dir=tmp_path, listen=(), initial_peers=(), api_listen="127.0.0.1:0"
        )
        urls: list[str] = await nursery.start(_serve_api, state, authority, options)
        yield Api(run_id, urls[0], store, tmp_path / "api-cert.pem")


def admit(store: LedgerStore, who: Identity, username: str = "alice") -> None:
    now = time.time()
    store.add_user(username, now=now)
    store.redeem_invite(store.create_invite(username, now=now), who.peer_id, who.public_key_bytes, now=now)


def signed(
    who: Identity, run_id: str, caps: Capabilities = CAPS, timestamp: float | None = None
) -> SignedCapabilities:
    now = time.time() if timestamp is None else timestamp
    data = msgspec.msgpack.encode(caps)
    signature = who.sign(capabilities_payload(run_id, who.peer_id, now, data))
    return SignedCapabilities(
        run_id=run_id, peer_id=who.peer_id, timestamp=now, capabilities=data, signature=signature
    )


async def test_post_capabilities_stores_a_peers_signed_measurements_in_the_ledger(api: Api) -> None:
    alice = Identity.generate()
    admit(api.store, alice)
    assert api.store.capabilities(alice.peer_id) is None

    receipt = await api.client().capabilities(alice, CAPS)

    assert (receipt.peer_id, receipt.capabilities) == (alice.peer_id, CAPS)
    assert api.store.capabilities(alice.peer_id) == CAPS
    newer = Capabilities(
        samples_per_second=99.0, upload_bps=1.0, download_bps=2.0, device="NVIDIA T4, 14.6 GiB"
    )
    await api.client().capabilities(alice, newer)
    assert api.store.capabilities(alice.peer_id) == newer


async def test_post_capabilities_refuses_a_bad_signature(api: Api) -> None:
    alice, mallory = Identity.generate(), Identity.generate()
    admit(api.store, alice)
    forged = msgspec.structs.replace(
        signed(alice, api.run_id), signature=signed(mallory, api.run_id).signature
    )
    tampered = msgspec.structs.replace(
        signed(alice, api.run_id),
        capabilities=msgspec.msgpack.encode(msgspec.structs.replace(CAPS, upload_bps=1e12)),
    )

    for body in (forged, tampered):
        response = await api.post(body)
        assert response.status_code == 401
        assert response.json()["error"] == "bad_signature"
    assert api.store.capabilities(alice.peer_id) is None


async def test_post_capabilities_refuses_an_unknown_or_removed_peer_with_403(api: Api) -> None:
    stranger, bob = Identity.generate(), Identity.generate()
    admit(api.store, bob, "bob")
    api.store.remove_user("bob", now=time.time())

    for who in (stranger, bob):
        with pytest.raises(AdmissionError, match="unknown_peer"):
            await api.client().capabilities(who, CAPS)
        response = await api.post(signed(who, api.run_id))
        assert response.status_code == 403
    assert api.store.capabilities(bob.peer_id) is None


async def test_post_capabilities_refuses_stale_foreign_and_malformed_bodies(api: Api) -> None:
    alice = Identity.generate()
    admit(api.store, alice)
    garbage = signed(alice, api.run_id)
    garbage = msgspec.structs.replace(
        garbage,
        capabilities=b"\x81\xa3bad\x01",
        signature=alice.sign(
            capabilities_payload(api.run_id, alice.peer_id, garbage.timestamp, b"\x81\xa3bad\x01")
        ),
    )
    cases = [
        (signed(alice, api.run_id, timestamp=time.time() - 3600), 401, "clock_skew"),  # a replay, later
        (signed(alice, "other-run"), 404, "unknown_run"),
        (garbage, 422, "invalid"),
    ]
    for body, status, code in cases:
        response = await api.post(body)
        assert (response.status_code, response.json()["error"]) == (status, code)
    response = await api.post({"peer_id": alice.peer_id})
    assert response.status_code == 422
    assert api.store.capabilities(alice.peer_id) is None
