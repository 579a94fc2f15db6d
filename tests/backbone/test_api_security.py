"""Issue 9, findings 10 and 11 against the API: bad credentials and bodies get 4xx (never 500), posts are
rate-limited, the ledger and the shards are for members (and the admin) only, the backbones' username is
reserved, TLS 1.2 is refused; and a contribution report is credited by its receipts end to end."""

from __future__ import annotations

import os
import ssl
import stat
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest
import trio

from backbone.api import build_app
from backbone.ratelimit import RateLimiter
from backbone.runinfo import RunInfo, write_run_info
from protocols.api import RefreshRequest, refresh_payload
from protocols.ledger import Capabilities, ContributionReport, SignedCapabilities, capabilities_payload
from protocols.receipts import SignedReceipt
from shared.auth.keys import Identity
from volunteer.api_client import ApiClient

from .api_app import ADMIN, InProcessApi, in_process_api
from .ledger.reports import part_receipt, sign
from .pinned_api import member_client, serve_pinned_api


def bearer(token: bytes) -> dict[str, bytes]:
    return {"authorization": b"Bearer " + token}


async def test_a_non_ascii_bearer_token_is_a_401_not_a_500(tmp_path: Path) -> None:
    with in_process_api(tmp_path) as api:
        for token in ("é".encode("latin-1"), b"\xff\xfe", "ключ".encode(), ADMIN.encode() + b"\xe9"):
            response = await api.request("GET", "admin/users", headers=bearer(token))
            assert (response.status_code, response.json()["error"]) == (401, "admin_required")
            response = await api.request("GET", "ledger", headers=bearer(token))
            assert response.status_code == 401
        assert (await api.request("GET", "admin/users", headers=bearer(ADMIN.encode()))).status_code == 200


@pytest.mark.parametrize("expires_in", [-1, -1e300, 0, 1e300, "soon"])
async def test_admin_api_refuses_a_non_positive_or_absurd_invite_lifetime(
    tmp_path: Path, expires_in: object
) -> None:
    with in_process_api(tmp_path) as api:
        body = msgspec.json.encode({"username": "bob", "expires_in": expires_in})
        response = await api.request("POST", "admin/users", content=body, headers=bearer(ADMIN.encode()))
        assert (response.status_code, response.json()["error"]) == (422, "invalid")
        good = msgspec.json.encode({"username": "bob", "expires_in": 3600})
        response = await api.request("POST", "admin/users", content=good, headers=bearer(ADMIN.encode()))
        assert response.status_code == 200


@pytest.mark.parametrize("username", ["backbone", "BackBone"])
async def test_admin_api_refuses_the_backbones_username(tmp_path: Path, username: str) -> None:
    with in_process_api(tmp_path) as api:
        body = msgspec.json.encode({"username": username})
        response = await api.request("POST", "admin/users", content=body, headers=bearer(ADMIN.encode()))
        assert response.status_code == 422 and "reserved" in response.json()["message"]
        assert [u.username for u in api.state.store.list_users()] == ["alice"]


def _refresh(api: InProcessApi) -> bytes:
    now = time.time()
    signature = api.member.sign(refresh_payload(api.state.run_id, api.token, now))
    return msgspec.json.encode(
        RefreshRequest(run_id=api.state.run_id, token=api.token, timestamp=now, signature=signature)
    )


def _capabilities(api: InProcessApi, caps: Capabilities) -> bytes:
    now, data = time.time(), msgspec.msgpack.encode(caps)
    payload = capabilities_payload(api.state.run_id, api.member.peer_id, now, data)
    return msgspec.json.encode(
        SignedCapabilities(
            run_id=api.state.run_id,
            peer_id=api.member.peer_id,
            timestamp=now,
            capabilities=data,
            signature=api.member.sign(payload),
        )
    )


def _report(api: InProcessApi, seq: int, **fields: object) -> bytes:
    now = time.time()
    values: dict[str, object] = {
        "run_id": api.state.run_id,
        "peer_id": api.member.peer_id,
        "seq": seq,
        "global_step": 1,
        "samples": 10,
        "compute_seconds": 1.0,
        "bytes_aggregated": 0,
        "bytes_relayed": 0,
        "interval_start": now - 10 + seq * 0.01,
        "interval_end": now - 10 + (seq + 1) * 0.01,
    }
    values.update(fields)
    report = ContributionReport(**values)  # type: ignore[arg-type]
    return msgspec.json.encode(sign(api.member, report))


CAPS = Capabilities(samples_per_second=50.0, upload_bps=1e6, download_bps=1e6, device="cpu")


@pytest.mark.parametrize("endpoint", ["refresh", "reports", "capabilities"])
async def test_refresh_reports_and_capabilities_are_rate_limited_per_peer(
    tmp_path: Path, endpoint: str
) -> None:
    limits = {
        "refresh": "refresh_by_peer",
        "reports": "reports_by_peer",
        "capabilities": "capabilities_by_peer",
    }
    with in_process_api(tmp_path, **{limits[endpoint]: RateLimiter(rate=1e-6, burst=3)}) as api:
        statuses = []
        for seq in range(5):
            body = {
                "refresh": lambda: _refresh(api),
                "reports": lambda: _report(api, seq),  # noqa: B023 (called at once)
                "capabilities": lambda: _capabilities(api, CAPS),
            }[endpoint]()
            statuses.append((await api.request("POST", endpoint, content=body)).status_code)
        assert statuses == [200, 200, 200, 429, 429]


async def test_a_replayed_token_does_not_spend_its_peers_refresh_budget(tmp_path: Path) -> None:
    with in_process_api(tmp_path, refresh_by_peer=RateLimiter(rate=1e-6, burst=2)) as api:
        mallory = Identity.generate()  # saw alice's token in an RPC, holds no key of hers
        now = time.time()
        forged = RefreshRequest(
            run_id=api.state.run_id,
            token=api.token,
            timestamp=now,
            signature=mallory.sign(refresh_payload(api.state.run_id, api.token, now)),
        )
        for _ in range(4):
            response = await api.request("POST", "refresh", content=msgspec.json.encode(forged))
            assert (response.status_code, response.json()["error"]) == (401, "bad_signature")
        assert (await api.request("POST", "refresh", content=_refresh(api))).status_code == 200


async def test_posts_are_rate_limited_per_address_before_the_body_is_read(tmp_path: Path) -> None:
    with in_process_api(tmp_path, posts_by_address=RateLimiter(rate=1e-6, burst=2)) as api:
        statuses = [(await api.request("POST", "reports", content=b"{}")).status_code for _ in range(4)]
        assert statuses == [422, 422, 429, 429]


async def test_capabilities_of_1e12_samples_per_second_are_refused(tmp_path: Path) -> None:
    # finding 9: 1e12 samples/s was accepted (and then believed)
    with in_process_api(tmp_path) as api:
        liar = Capabilities(samples_per_second=1e12, upload_bps=1e6, download_bps=1e6, device="x")
        response = await api.request("POST", "capabilities", content=_capabilities(api, liar))
        assert (response.status_code, response.json()["error"]) == (422, "invalid")
        assert api.state.store.capabilities(api.member.peer_id) is None


async def test_ledger_and_shards_need_a_members_credential_or_the_admin_token(tmp_path: Path) -> None:
    with in_process_api(tmp_path) as api:
        for path in ("ledger", "shards", "shards/shard-00000.jsonl"):
            refused = await api.request("GET", path)
            assert (refused.status_code, refused.json()["error"]) == (401, "access_required"), path
            assert (await api.request("GET", path, headers=api.credential("GET", path))).status_code == 200
            assert (await api.request("GET", path, headers=bearer(ADMIN.encode()))).status_code == 200
        path = "shards/shard-00000.jsonl"
        stranger = Identity.generate()
        cases = [
            (api.credential("GET", "shards/shard-00001.jsonl"), 401, "bad_signature"),  # another path
            (api.credential("GET", path, who=stranger), 401, "bad_signature"),  # a replayed token
            (api.credential("GET", path, timestamp=time.time() - 3600), 401, "clock_skew"),
            ({"authorization": "Dedloc AAAA"}, 401, "bad_token"),
            ({"authorization": "Dedloc " + "A" * 5000}, 401, "bad_token"),
            ({"authorization": b"Dedloc \xff\xfe"}, 401, "bad_token"),
        ]
        expired = api.state.authority.issue_token(
            api.state.run_id, "alice", api.member.peer_id, api.member.public_key_bytes, time.time() - 7200, 60
        )
        cases.append((api.credential("GET", path, token=expired), 401, "bad_token"))
        for headers, status, code in cases:
            response = await api.request("GET", path, headers=headers)
            assert (response.status_code, response.json()["error"]) == (status, code), headers
        api.state.store.remove_user("alice", now=time.time())
        response = await api.request("GET", path, headers=api.credential("GET", path))
        assert (response.status_code, response.json()["error"]) == (403, "revoked")


async def test_a_volunteer_streams_shards_with_its_credential_over_https(tmp_path: Path) -> None:
    from shared.data.corpus import write_shards

    await trio.to_thread.run_sync(write_shards, tmp_path / "bb" / "shards", 1, 5)
    async with serve_pinned_api(tmp_path / "bb", tmp_path / "bb" / "shards") as api:
        client = member_client(api)
        [info] = (await client.list_shards()).shards
        assert len(await client.fetch_shard(info)) == info.nbytes
        from shared.errors import AdmissionError

        with pytest.raises(AdmissionError, match="access_required"):
            await ApiClient(api.run_id, api.urls).list_shards()


async def test_the_https_api_refuses_tls_1_2(tmp_path: Path) -> None:
    async with serve_pinned_api(tmp_path / "bb") as api:
        parts = urlsplit(api.urls[0])

        def handshake(version: ssl.TLSVersion) -> str:
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            context.maximum_version = version
            import socket

            with (
                socket.create_connection((parts.hostname, parts.port), timeout=10) as sock,
                context.wrap_socket(sock) as tls,
            ):
                return str(tls.version())

        assert await trio.to_thread.run_sync(handshake, ssl.TLSVersion.TLSv1_3) == "TLSv1.3"
        with pytest.raises(ssl.SSLError):
            await trio.to_thread.run_sync(handshake, ssl.TLSVersion.TLSv1_2)


def _receipt(aggregator: Identity, sender: Identity, run_id: str, step: int, weight: float) -> SignedReceipt:
    return part_receipt(aggregator, sender.peer_id, step, weight, run_id, 100, time.time())


async def test_a_report_is_credited_what_receipts_of_another_user_back(tmp_path: Path) -> None:
    with in_process_api(tmp_path) as api:
        store, run_id = api.state.store, api.state.run_id
        bob = Identity.generate()
        now = time.time()
        store.add_user("bob", now=now)
        store.redeem_invite(store.create_invite("bob", now=now), bob.peer_id, bob.public_key_bytes, now=now)
        store.record_step(1, finished_at=now, loss=None, samples=0, peers=2)
        receipts = [
            _receipt(bob, api.member, run_id, 1, 8.0),
            _receipt(api.member, api.member, run_id, 1, 99),
        ]
        response = await api.request(
            "POST", "reports", content=_report(api, 0, samples=10, receipts=receipts)
        )
        answer = response.json()
        assert response.status_code == 200, answer
        assert (answer["credited"], answer["samples"], answer["notes"]) == (True, 8.0, "receipt_own: 1")
        board = await api.request("GET", "ledger", headers=bearer(ADMIN.encode()))
        assert {row["username"]: row["samples"] for row in board.json()} == {"alice": 8, "bob": 0}


def test_run_info_and_the_sqlite_ledger_are_private_whatever_the_umask(tmp_path: Path) -> None:
    from backbone.ledger import LedgerStore

    old = os.umask(0o022)
    try:
        shared_dir = tmp_path / "data"
        shared_dir.mkdir(mode=0o755)
        write_run_info(shared_dir, RunInfo(run_id="r", api=[], authority_public_key=""))
        with LedgerStore.open(f"sqlite:///{shared_dir / 'ledger.sqlite3'}") as store:
            store.add_user("alice", now=0.0)
        fresh = tmp_path / "fresh" / "deeper"
        LedgerStore.open(f"sqlite:///{fresh / 'ledger.sqlite3'}").close()
    finally:
        os.umask(old)
    for path in (shared_dir / "run.json", shared_dir / "ledger.sqlite3", shared_dir / "ledger.sqlite3-wal"):
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert stat.S_IMODE((fresh / "ledger.sqlite3").stat().st_mode) == 0o600


@pytest.mark.parametrize("path", ["join", "refresh", "reports", "capabilities"])
def test_invalid_utf8_inside_a_json_string_is_a_400_not_a_500(tmp_path: Path, path: str) -> None:
    # msgspec raises UnicodeDecodeError (not DecodeError) for these bytes inside a JSON string
    body = b'{"\xff\xfe\xfd": "\xc0"}'
    with in_process_api(tmp_path) as api:
        response = trio.run(lambda: api.request("POST", path, content=body))
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "bad_json"


async def test_a_request_of_another_api_version_is_told_who_must_upgrade(tmp_path: Path) -> None:
    with in_process_api(tmp_path) as api:
        for version, expected in ((0, "upgrade dedloc"), (2, "this backbone must be upgraded")):
            transport = httpx.ASGITransport(app=build_app(api.state), raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://backbone") as client:
                answer = await client.get(f"/v{version}/runs/{api.state.run_id}/manifest")
            assert answer.status_code == 404
            error = answer.json()
            assert error["error"] == "wrong_version"
            assert error["message"] == f"{expected}: this backbone speaks API v1, the request v{version}"


async def test_session_notices_need_a_members_signature_over_the_token_and_event(tmp_path: Path) -> None:
    with in_process_api(tmp_path) as api:
        token = "0123456789abcdef" * 2
        path = f"sessions/{token}/alive"
        admin = await api.request("POST", path, headers={"authorization": f"Bearer {ADMIN}"})
        assert admin.status_code == 401  # a session is a member's process, not the organizer's
        other = api.credential("POST", f"sessions/{token}/leave")  # signed for another path
        assert (await api.request("POST", path, headers=other)).status_code == 401
        bad = f"sessions/{token[:-1]}/alive"
        assert (await api.request("POST", bad, headers=api.credential("POST", bad))).status_code == 404
        alive = await api.request("POST", path, headers=api.credential("POST", path))
        assert alive.status_code == 200 and alive.json() == {"open": True, "timeout_s": 90.0}
        leave = f"sessions/{token}/leave"
        left = await api.request("POST", leave, headers=api.credential("POST", leave))
        assert left.json()["open"] is False
        [session] = api.state.store.sessions(api.member.peer_id)
        assert (session.token, session.end_reason) == (token, "leave")
