"""The dashboard's JSON and /metrics against the API app with a real SQLite ledger: what is public,
what needs the admin token or --public-leaderboard, the numbers against the ledger's, the page's
security headers and assets, and the exposition text parsed back strictly."""

from __future__ import annotations

import math
import re
import time
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from backbone.api import build_app
from backbone.dashboard import active_peers, ledger_counts, peer_roles, step_rates
from backbone.ledger import LedgerStore, StepRow
from backbone.startup import bind_dashboard, parse_dashboard_listen
from protocols.ledger import Capabilities
from protocols.probe import CapabilityRecord
from shared.auth.keys import Identity
from shared.errors import ConfigError
from shared.prometheus import Family, Sample, render
from tests.backbone.api_app import ADMIN, InProcessApi, in_process_api
from tests.backbone.dashboard_seed import (
    HOSTILE_DEVICE,
    HOSTILE_USER,
    admit,
    parse_metrics,
    record_steps,
    seed,
)


async def get(api: InProcessApi, path: str, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(api.state), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://backbone") as client:
        return await client.get(path, headers=headers)


async def data(api: InProcessApi, **headers: str) -> dict[str, Any]:
    response = await get(api, "/dashboard/data.json", **headers)
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    body: dict[str, Any] = response.json()
    return body


async def test_public_view_is_run_level_and_matches_the_ledger(tmp_path: Path) -> None:
    with in_process_api(tmp_path) as api:
        store = api.state.store
        seeded = seed(store, time.time())
        body = await data(api)
        assert body["access"] == {"per_user": False, "public_leaderboard": False}
        assert body["peers"] is None and body["leaderboard"] is None
        text = str(body)
        assert HOSTILE_USER not in text and "bob" not in text and HOSTILE_DEVICE not in text
        assert seeded.hostile_peer not in text and "192.0.2.7" not in text  # no peer ids, no addresses
        rows = list(reversed(store.recent_steps(500)))
        assert [s["step"] for s in body["steps"]] == [r.global_step for r in rows]
        assert [s["loss"] for s in body["steps"]] == [r.loss for r in rows]
        assert [s["samples"] for s in body["steps"]] == [r.samples for r in rows]
        assert body["steps"][0]["samples_per_second"] is None
        assert body["steps"][1]["samples_per_second"] == pytest.approx(32 / 2.0)
        summary = body["summary"]
        assert summary["global_step"] == store.newest_step() == seeded.steps
        assert summary["loss"] == pytest.approx(4.0 / math.sqrt(seeded.steps))
        assert summary["samples_per_second"] == pytest.approx(16.0)
        assert summary["active_peers"] == 2 and summary["active_users"] == 2
        assert summary["users"] == 3 and summary["open_sessions"] == 2  # alice (no session), bob, hostile
        held = [store.capabilities(p) for p in (seeded.hostile_peer, seeded.bob_peer)]
        assert summary["measured_samples_per_second"] == pytest.approx(
            sum(c.samples_per_second for c in held if c)
        )
        assert summary["roles"]["compute"] == 2  # no node here: no capability records, no aggregator
        assert summary["reports"] == store.report_counts()
        assert body["health"]["dht_size"] is None and body["health"]["aggregator"] is None


async def test_admin_token_shows_per_user_rows_and_a_wrong_one_is_refused(tmp_path: Path) -> None:
    with in_process_api(tmp_path) as api:
        store = api.state.store
        seeded = seed(store, time.time())
        body = await data(api, authorization=f"Bearer {ADMIN}")
        assert body["access"]["per_user"] is True
        peers = {p["peer_id"]: p for p in body["peers"]}
        assert set(peers) == {seeded.hostile_peer, seeded.bob_peer}
        hostile = peers[seeded.hostile_peer]
        held = store.capabilities(seeded.hostile_peer)
        assert held is not None
        assert hostile["user"] == HOSTILE_USER and hostile["device"] == HOSTILE_DEVICE == held.device
        assert hostile["samples_per_second"] == held.samples_per_second
        assert hostile["roles"] == ["compute"] and hostile["reachability"] == "unknown"
        assert "address" not in hostile and "192.0.2.7" not in str(body)
        board = {r["user"]: r for r in body["leaderboard"]}
        assert set(board) == {r.username for r in store.leaderboard()}
        assert board[HOSTILE_USER]["samples"] == next(
            r.samples for r in store.leaderboard() if r.username == HOSTILE_USER
        )
        for headers in ({"authorization": "Bearer wrong"}, {"authorization": ADMIN}, {"authorization": ""}):
            refused = await get(api, "/dashboard/data.json", **headers)
            assert refused.status_code == 401 and refused.json()["error"] == "admin_required"
        member = api.credential("GET", "dashboard/data.json")  # a member's credential is not the admin's
        assert (await get(api, "/dashboard/data.json", **member)).status_code == 401


async def test_public_leaderboard_shows_per_user_rows_to_everyone(tmp_path: Path) -> None:
    with in_process_api(tmp_path, public_leaderboard=True) as api:
        seed(api.state.store, time.time())
        body = await data(api)
        assert body["access"] == {"per_user": True, "public_leaderboard": True}
        assert {p["user"] for p in body["peers"]} == {HOSTILE_USER, "bob"}
        assert {r["user"] for r in body["leaderboard"]} >= {HOSTILE_USER, "bob", "alice"}


async def test_page_assets_and_headers(tmp_path: Path) -> None:
    with in_process_api(tmp_path) as api:
        page = await get(api, "/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
        assert page.headers["x-content-type-options"] == "nosniff"
        # every script and style the page names is served here (no CDN)
        for src in re.findall(r'(?:src|href)="([^"]+)"', page.text):
            assert src.startswith("/dashboard/static/"), src
            asset = await get(api, src)
            assert asset.status_code == 200 and asset.content
        for bad in (
            "/dashboard/static/dashboard.py",
            "/dashboard/static/..%2Fapi.py",
            "/dashboard/static/x.js",
        ):
            assert (await get(api, bad)).status_code == 404
        home = await get(api, "/")
        assert home.status_code == 302 and home.headers["location"] == "/dashboard"


def test_the_page_script_builds_the_dom_with_text_only() -> None:
    """No HTML parsing of data anywhere in the script (the browser test renders a hostile name)."""
    text = (resources.files("backbone") / "static" / "dashboard.js").read_text()
    script = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "Function("):
        assert sink not in script, sink
    html = (resources.files("backbone") / "static" / "dashboard.html").read_text()
    tags = re.findall(r"<[^>]*>", html)
    assert all(" src=" in tag for tag in tags if tag.startswith("<script")), "inline script"
    assert not [tag for tag in tags if re.search(r"\son\w+=", tag)], "inline event handler"


async def test_metrics_parse_strictly_and_match_the_ledger(tmp_path: Path) -> None:
    with in_process_api(tmp_path) as api:
        store = api.state.store
        seeded = seed(store, time.time())
        response = await get(api, "/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        families = parse_metrics(response.text)
        for name, family in families.items():
            assert name.startswith("dedloc_")
            assert family["type"] in ("counter", "gauge")
            assert (family["type"] == "counter") == name.endswith("_total"), name

        def value(name: str, **labels: str) -> float:
            samples = families[name]["samples"]
            assert isinstance(samples, list)
            return float(next(v for ls, v in samples if ls == labels))

        assert value("dedloc_global_step") == seeded.steps == store.newest_step()
        assert value("dedloc_step_loss") == pytest.approx(4.0 / math.sqrt(seeded.steps))
        assert value("dedloc_step_samples_per_second") == pytest.approx(16.0)
        assert value("dedloc_users") == 3 and value("dedloc_sessions_open") == 2
        assert value("dedloc_peers_active") == 2
        counts = store.report_counts()
        assert value("dedloc_reports_total", status="credited") == counts["credited"]
        assert value("dedloc_backbone_info", run_id=api.state.run_id, peer_id="") == 1
        assert HOSTILE_USER not in response.text and seeded.bob_peer not in response.text  # run-level only
        record_steps(store, seeded.steps + 1, seeded.steps + 1, time.time() - 100)
        assert value("dedloc_global_step") == seeded.steps  # (the parsed text, not live)
        again = parse_metrics((await get(api, "/metrics")).text)
        assert again["dedloc_global_step"]["samples"] == [({}, float(seeded.steps + 1))]


@given(st.lists(st.text(max_size=20), min_size=1, max_size=4), st.floats(allow_nan=False))
def test_label_values_and_numbers_round_trip(values: list[str], number: float) -> None:
    family = Family(
        "dedloc_x",
        "gauge",
        'help with \\ and "quotes"\nand a line',
        [Sample(number, {"v": value, "i": str(i)}) for i, value in enumerate(values)],
    )
    parsed = parse_metrics(render([family]))["dedloc_x"]
    assert parsed["help"] == family.help
    assert parsed["samples"] == [({"v": value, "i": str(i)}, number) for i, value in enumerate(values)]


def test_families_refuse_bad_names() -> None:
    with pytest.raises(ValueError, match="_total"):
        Family("dedloc_rounds", "counter", "", [])
    with pytest.raises(ValueError, match="not dedloc_"):
        Family("rounds_total", "counter", "", [])
    with pytest.raises(ValueError, match="label name"):
        Family("dedloc_x", "gauge", "", [Sample(1, {"bad-label": "x"})])
    with pytest.raises(ValueError, match="twice"):
        render([Family("dedloc_x", "gauge", "", []), Family("dedloc_x", "gauge", "", [])])


def _row(step: int, at: float, samples: int) -> StepRow:
    return StepRow(step, at, None, samples, 1)


@given(st.lists(st.tuples(st.integers(1, 3), st.floats(0, 10), st.integers(0, 1000)), max_size=30))
def test_step_rates_are_batches_over_the_time_since_the_step_before(
    increments: list[tuple[int, float, int]],
) -> None:
    rows, step, at = [], 0, 1000.0
    for gap, elapsed, samples in increments:
        step, at = step + gap, at + elapsed
        rows.append(_row(step, at, samples))
    rates = step_rates(rows)
    assert len(rates) == len(rows)
    for i, rate in enumerate(rates):
        consecutive = i > 0 and rows[i].global_step == rows[i - 1].global_step + 1
        elapsed = rows[i].finished_at - rows[i - 1].finished_at if i else 0.0
        if consecutive and elapsed > 0:
            assert rate == pytest.approx(rows[i].samples / elapsed)
        else:
            assert rate is None


def test_peer_roles_from_the_capability_record() -> None:
    caps = Capabilities(1.0, 1e6, 1e6, "cpu")
    direct = CapabilityRecord(
        caps, reachable=["/ip4/192.0.2.1/tcp/1"], client_mode=False, connectivity="direct"
    )
    client = CapabilityRecord(caps, connectivity="client")
    assert peer_roles(None) == ["compute"]
    assert peer_roles(CapabilityRecord(caps)) == ["compute"]  # unchecked
    assert peer_roles(direct) == ["compute", "aggregate"]
    assert peer_roles(client) == ["compute", "client"]


def test_dashboard_listen_errors_name_the_flag() -> None:
    assert parse_dashboard_listen("127.0.0.1:8080") == ("127.0.0.1", 8080)
    with pytest.raises(ConfigError, match="--dashboard-listen 'localhost:80'"):
        parse_dashboard_listen("localhost:80")
    with bind_dashboard("127.0.0.1:0") as taken:
        port = taken.getsockname()[1]
        with pytest.raises(
            ConfigError, match=f"cannot serve the dashboard on 127.0.0.1:{port}: the port is in use"
        ):
            bind_dashboard(f"127.0.0.1:{port}")


def test_active_peers_and_counts_on_both_databases(store: LedgerStore) -> None:
    """The dashboard's own queries (backbone.dashboard) on SQLite and PostgreSQL: one row per peer (its
    newest open session), none for a closed, silent or removed one; the backbones are not users."""
    now = time.time()
    seeded = seed(store, now - 10)
    carol = admit(store, "carol", now)
    store.session_heartbeat(carol, "c" * 32, "192.0.2.9", now=now - 1000)  # silent since
    dave = admit(store, "dave", now)
    store.session_heartbeat(dave, "d" * 32, "192.0.2.9", now=now)
    store.leave_session(dave, "d" * 32, now=now)  # left
    erin = admit(store, "erin", now)
    store.session_heartbeat(erin, "e" * 32, "192.0.2.9", now=now)
    store.remove_user("erin", now=now)
    store.session_heartbeat(seeded.bob_peer, "b" * 32, "192.0.2.8", now=now)  # bob restarted: a new session
    active = active_peers(store, since=now - 90)
    assert sorted((p.username, p.peer_id) for p in active) == sorted(
        [(HOSTILE_USER, seeded.hostile_peer), ("bob", seeded.bob_peer)]
    )
    bob = next(p for p in active if p.username == "bob")
    held = store.capabilities(seeded.bob_peer)
    assert held is not None and bob.started_at == pytest.approx(now) and bob.device == held.device
    store.register_backbone(Identity.generate().peer_id, Identity.generate().public_key_bytes, now=now)
    counts = ledger_counts(store)
    assert counts == {"users": 4, "peers": 5, "open_sessions": 4}  # erin removed; carol's still open


async def test_a_flood_of_requests_costs_one_ledger_read_per_view_and_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """data.json is public: 20 requests at once (and more within a second) are answered from one
    computation per view, so strangers cannot take the API's ledger read slots; a second later the
    answer is computed again, so updates still arrive."""
    import trio

    import backbone.dashboard as dashboard

    computed: list[bool] = []
    real = dashboard.dashboard_data

    async def counting(*args: Any, per_user: bool, **kwargs: Any) -> dict[str, Any]:
        computed.append(per_user)
        await trio.sleep(0.05)  # the others arrive while it runs: they wait for it, not compute again
        return await real(*args, per_user=per_user, **kwargs)

    monkeypatch.setattr(dashboard, "dashboard_data", counting)
    with in_process_api(tmp_path) as api:
        seed(api.state.store, time.time())
        transport = httpx.ASGITransport(app=build_app(api.state), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://backbone") as client:
            answers: list[httpx.Response] = []

            async def ask(**headers: str) -> None:
                answers.append(await client.get("/dashboard/data.json", headers=headers))

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(
                        lambda i=i: ask(**({"authorization": f"Bearer {ADMIN}"} if i % 2 else {}))
                    )
            assert all(a.status_code == 200 for a in answers)
            assert sorted(computed) == [False, True]  # one computation per view
            public = [a.json() for a in answers if a.json()["access"]["per_user"] is False]
            assert len(public) == 10 and all(p == public[0] for p in public)
            await trio.sleep(dashboard.ANSWER_TTL_S)
            await ask()
            assert sorted(computed) == [False, False, True]
