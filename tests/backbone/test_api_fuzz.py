"""Fuzzing every API endpoint in this process (issue 9, "Fuzzing in CI": API bodies): structured bodies
(the endpoint's own fields with hostile values, and reports validly signed by a member around random
contents and receipts), random JSON and random bytes, with random credentials. Every answer is a 2xx or
4xx with a JSON body (a shard's bytes excepted), never a 500."""

from __future__ import annotations

import base64
import functools
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backbone.api import NewUser
from protocols.api import JoinRequest, RefreshRequest
from protocols.ledger import SignedCapabilities, SignedReport, report_payload
from protocols.receipts import receipt_payload

from .api_app import ADMIN, InProcessApi, in_process_api, run

ENDPOINTS: list[tuple[str, str, type[msgspec.Struct] | None]] = [
    ("GET", "health", None),
    ("GET", "manifest", None),
    ("GET", "revocations", None),
    ("GET", "ledger", None),
    ("GET", "shards", None),
    ("GET", "shards/shard-00000.jsonl", None),
    ("GET", "admin/users", None),
    ("POST", "join", JoinRequest),
    ("POST", "refresh", RefreshRequest),
    ("POST", "reports", SignedReport),
    ("POST", "capabilities", SignedCapabilities),
    ("POST", "admin/users", NewUser),
    ("DELETE", "admin/users/alice", None),
]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([2**53, 2**64, -1, 0, 1e308, -0.0, 1e-320])
    | st.text(max_size=40)
    | st.sampled_from(["", "backbone", "é" * 100, "\x00", "../../etc/passwd", "A" * 200, "AAAA" * 30])
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=16,
)
_b64 = st.binary(max_size=300).map(lambda b: base64.b64encode(b).decode())


def _structured(kind: type[msgspec.Struct]) -> st.SearchStrategy[bytes]:
    """The endpoint's own field names, each with a hostile value (or missing), plus an unknown field."""
    names = list(kind.__struct_fields__)
    value = _json | _b64
    fields = st.dictionaries(st.sampled_from([*names, "extra"]), value, max_size=len(names) + 1)
    full = st.fixed_dictionaries({name: value for name in names})
    return (fields | full).map(lambda d: json.dumps(d).encode())


_report_values = {
    "seq": st.integers(-1, 2**64 - 1),
    "global_step": st.integers(-1, 2**64 - 1),
    "samples": st.integers(-1, 2**64 - 1),
    "compute_seconds": st.floats(-1, 1e13) | st.sampled_from([float("nan"), float("inf")]),
    "bytes_aggregated": st.integers(-1, 2**64 - 1),
    "bytes_relayed": st.integers(0, 2**53),
    "interval_start": st.floats(-1e13, 1e13) | st.just(float("nan")),
    "interval_end": st.floats(-1e13, 1e13) | st.just(float("nan")),
}


@st.composite
def _signed_reports(draw: st.DrawFn, api: InProcessApi) -> bytes:
    """Reports a member really signed, around random contents, receipts and pull records."""
    now = time.time()
    fields: dict[str, Any] = {
        "run_id": draw(st.sampled_from([api.state.run_id, "other-run", ""])),
        "peer_id": api.member.peer_id,
        "seq": draw(st.integers(0, 50)),
        "global_step": 1,
        "samples": draw(st.integers(0, 2**53)),
        "compute_seconds": 1.0,
        "bytes_aggregated": 0,
        "bytes_relayed": 0,
        "interval_start": now - 5,
        "interval_end": now,
    }
    for name in draw(st.lists(st.sampled_from(sorted(_report_values)), max_size=3)):
        fields[name] = draw(_report_values[name])
    receipt_fields = {
        "run_id": api.state.run_id,
        "aggregator": api.member.peer_id,
        "sender": api.member.peer_id,
        "step": draw(st.integers(-1, 2**64 - 1)),
        "group_id": b"g",
        "round": 0,
        "weight": draw(st.floats(allow_nan=True)),
        "nbytes": 1,
        "issued_at": now,
    }
    receipts = []
    for body in draw(
        st.lists(st.binary(max_size=600) | st.just(msgspec.msgpack.encode(receipt_fields)), max_size=3)
    ):
        receipts.append([body, api.member.sign(receipt_payload(body))])  # a SignedReceipt is an array
    fields["receipts"] = receipts
    fields["pulled"] = draw(
        st.lists(
            st.tuples(
                st.sampled_from([api.member.peer_id, "x"]),
                st.integers(-1, 2**64 - 1),
                st.integers(-1, 2**64 - 1),
            ),
            max_size=3,
        )
    )
    data = msgspec.msgpack.encode(fields)
    signature = api.member.sign(report_payload(data))
    return msgspec.json.encode({"report": data, "signature": signature})


_headers = st.fixed_dictionaries(
    {},
    optional={
        "authorization": st.one_of(
            st.just(f"Bearer {ADMIN}".encode()),
            st.binary(max_size=80).map(lambda b: b"Bearer " + b.replace(b"\r", b"").replace(b"\n", b"")),
            st.binary(max_size=200).map(lambda b: b"Dedloc " + base64.urlsafe_b64encode(b)),
            st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=60).map(
                lambda t: t.encode("latin-1")
            ),
        ),
        "content-type": st.sampled_from([b"application/json", b"text/plain", b"\xff"]),
    },
)


def _check(response: Any, path: str) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code == 200 and path.startswith("shards/"):
        return  # the shard's bytes
    assert response.headers["content-type"].startswith("application/json"), response.headers
    json.loads(response.content)


@pytest.mark.parametrize(("method", "path", "kind"), ENDPOINTS, ids=[f"{m} {p}" for m, p, _ in ENDPOINTS])
def test_every_endpoint_answers_any_body_with_2xx_or_4xx_json(
    tmp_path: Path, method: str, path: str, kind: type[msgspec.Struct] | None
) -> None:
    with in_process_api(tmp_path) as api:
        bodies = st.binary(max_size=3000) | _json.map(lambda v: json.dumps(v).encode())
        if kind is not None:
            bodies = bodies | _structured(kind)
        if kind is SignedReport:
            bodies = bodies | _signed_reports(api) | _signed_reports(api)

        @settings(
            max_examples=60 if kind is SignedReport else 25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(body=bodies, headers=_headers, verb=st.sampled_from([method, method, method, "PUT", "GET"]))
        def fuzz(body: bytes, headers: dict[str, bytes], verb: str) -> None:
            response = run(functools.partial(api.request, verb, path, content=body, headers=headers))
            _check(response, path)

        fuzz()


def test_unknown_paths_and_runs_answer_json_404(tmp_path: Path) -> None:
    with in_process_api(tmp_path) as api:

        async def ask(url: str) -> Any:
            return await api.request("GET", url)

        for path in ("nothing", "admin", "shards/../../x", "%ff", "ledger/x"):
            _check(run(ask, path), path)
        _check(run(api.request, "GET", "/../../other-run/ledger"), "")
