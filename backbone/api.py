"""The backbone's HTTP API (see :mod:`protocols.api` for the endpoints and the trust model).

A Starlette app served by Hypercorn's trio worker in the backbone's own trio process. Database work goes
through ``trio.to_thread`` with the ledger limiters (one writer at a time). Every failure is a JSON
``ApiError`` with a 4xx status and one log line; nothing here raises into the server.
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from protocols.api import (
    ACCESS_SCHEME,
    MAX_BODY_BYTES,
    SESSION_TOKEN_PATTERN,
    ApiError,
    Invite,
    JoinRequest,
    JoinResponse,
    Manifest,
    RefreshRequest,
    RefreshResponse,
    ReportReceipt,
    RevocationList,
    SessionState,
    ShardInfo,
    ShardList,
    Username,
    api_request_payload,
    decode_api_credential,
    encode_invite,
    join_payload,
    refresh_payload,
)
from protocols.auth import DEFAULT_TOKEN_LIFETIME, MAX_CLOCK_SKEW, AccessToken, SignedRevocation
from protocols.errors import DECODE_FAILURES
from protocols.evaluation import EvaluationReceipt, SignedEvaluation
from protocols.ledger import (
    CapabilitiesReceipt,
    SignedCapabilities,
    SignedReport,
    capabilities_payload,
    decode_capabilities,
)
from protocols.peer_id import peer_id_from_public_key
from protocols.training import TrainingSpec
from shared.auth.authority import Authority
from shared.auth.keys import verify, verify_by_peer_id
from shared.data.heldout import HELDOUT_DIR, heldout_digest, read_heldout
from shared.data.shards import ShardCatalog
from shared.errors import AuthError, ConfigError, ProtocolError

from .ledger import (
    CapabilitiesRejected,
    EvaluationRejected,
    InviteRejected,
    LedgerStore,
    ReportRejected,
    UnknownPeer,
    UnknownUser,
    verify_report,
)
from .ledger.evaluations import check_evaluation, open_evaluation
from .live import LiveSources
from .ratelimit import RateLimiter

__all__ = ["DB_READ", "DB_WRITE", "SESSION_TIMEOUT", "ApiState", "build_app"]

logger = logging.getLogger("backbone.api")
DB_WRITE = trio.CapacityLimiter(1)
DB_READ = trio.CapacityLimiter(4)
FILES = trio.CapacityLimiter(2)  # listing and hashing dataset shards
#: how long after expiry a token may still be refreshed (a laptop that slept overnight)
REFRESH_GRACE = 24 * 3600.0
#: the longest invite lifetime the admin API grants (ten years)
MAX_INVITE_LIFETIME = 10 * 365 * 86400.0
#: seconds without a heartbeat after which a volunteer's session is closed (it heartbeats every ~1/4 of it)
SESSION_TIMEOUT = 90.0
_SESSION_TOKEN = re.compile(SESSION_TOKEN_PATTERN)
#: the API version in every path (``/v1/runs/...``); a request of another version is told who upgrades
API_VERSION = "1"
_API_VERSION = re.compile(r"^/v(\d{1,6})/")
T = TypeVar("T", bound=msgspec.Struct)


class HttpError(Exception):
    """A 4xx answer. ``close``: the request body was not read, so the connection cannot carry another
    request; the answer says ``Connection: close`` and the server closes it (a client that reused it
    would see its next request fail with "server disconnected")."""

    def __init__(self, status: int, code: str, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.close = status, code, message, close


@dataclass
class ApiState:
    """What the API needs from the running backbone."""

    run_id: str
    authority: Authority
    store: LedgerStore
    admin_token: str
    manifest: Callable[[], Manifest]
    revocations: Callable[[], list[SignedRevocation]]
    on_user_removed: Callable[[str], Awaitable[None]]
    peer_id: str = ""
    started_at: float = field(default_factory=time.time)
    token_lifetime: float = DEFAULT_TOKEN_LIFETIME
    clock: Callable[[], float] = time.time
    join_by_address: RateLimiter = field(default_factory=lambda: RateLimiter(rate=0.5, burst=10))
    join_by_invite: RateLimiter = field(default_factory=lambda: RateLimiter(rate=0.2, burst=5))
    #: refresh, reports and capabilities: per source address first (before the body is read), then
    #: per peer. A volunteer reports every ~10 s and flushes a backlog after an outage: the reports
    #: budget lets 120 go at once, then one a second (the rest wait for the volunteer's next try).
    posts_by_address: RateLimiter = field(default_factory=lambda: RateLimiter(rate=20.0, burst=200))
    refresh_by_peer: RateLimiter = field(default_factory=lambda: RateLimiter(rate=0.05, burst=5))
    reports_by_peer: RateLimiter = field(default_factory=lambda: RateLimiter(rate=1.0, burst=120))
    capabilities_by_peer: RateLimiter = field(default_factory=lambda: RateLimiter(rate=0.1, burst=10))
    sessions_by_peer: RateLimiter = field(default_factory=lambda: RateLimiter(rate=0.5, burst=10))
    #: held-out evaluations: one every ``dataset.eval_every`` steps per evaluator (a burst after an outage)
    evaluations_by_peer: RateLimiter = field(default_factory=lambda: RateLimiter(rate=0.2, burst=20))
    #: a volunteer process silent this long has its session closed (backbone.sessions sweeps)
    session_timeout: float = SESSION_TIMEOUT
    shards_dir: Path | None = None  # dataset shards served under ``shards`` (None: none)
    tokenizer: Path | None = None  # the run's tokenizer.json, served under ``tokenizer/<sha256>``
    #: the dashboard's per-user rows for everyone, not only the admin (``--public-leaderboard``)
    public_leaderboard: bool = False
    live: LiveSources = field(default_factory=LiveSources)  # node, aggregator, relay (backbone.dashboard)


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, media_type="application/json")


async def _body(request: Request, kind: type[T]) -> T:
    declared = request.headers.get("content-length")
    too_large = f"request bodies are limited to {MAX_BODY_BYTES} bytes"
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
        raise HttpError(413, "too_large", too_large, close=True)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HttpError(413, "too_large", too_large, close=True)
        chunks.append(chunk)
    try:
        return msgspec.json.decode(b"".join(chunks), type=kind)
    except msgspec.ValidationError as exc:
        raise HttpError(422, "invalid", f"invalid {kind.__name__}: {exc}") from exc
    except DECODE_FAILURES as exc:  # invalid UTF-8 in a string raises UnicodeDecodeError, not DecodeError
        raise HttpError(400, "bad_json", f"the body is not valid JSON: {str(exc)[:200]}") from exc


def _limit(limiter: RateLimiter, key: str, now: float, what: str) -> None:
    if not limiter.allow(key, now):
        raise HttpError(429, "rate_limited", f"too many {what}; retry later")


def build_app(state: ApiState) -> Starlette:
    from .dashboard import routes as dashboard_routes  # here: backbone.dashboard builds on this module

    def route(
        path: str, methods: list[str], admin: bool = False, access: bool = False
    ) -> Callable[[Callable[[Request], Awaitable[Response]]], Route]:
        """``admin``: the admin token only; ``access``: the admin token or a member's credential."""

        def wrap(handler: Callable[[Request], Awaitable[Response]]) -> Route:
            async def endpoint(request: Request) -> Response:
                client = request.client.host if request.client else "?"
                try:
                    if request.path_params.get("run_id") != state.run_id:
                        raise HttpError(404, "unknown_run", f"this backbone serves run {state.run_id}")
                    if admin:
                        _check_admin(request, state.admin_token)
                    elif access:
                        await check_access(request)
                    return await handler(request)
                except HttpError as exc:
                    logger.warning(
                        "%s %s from %s: %s %s", request.method, path, client, exc.status, exc.message
                    )
                    response = _json(ApiError(exc.code, exc.message), exc.status)
                    if exc.close:
                        response.headers["connection"] = "close"
                    return response

            return Route(f"/v1/runs/{{run_id}}/{path}", endpoint, methods=methods)

        return wrap

    async def db(fn: Callable[..., Any], *args: Any, write: bool = False, **kwargs: Any) -> Any:
        return await trio.to_thread.run_sync(
            lambda: fn(*args, **kwargs), limiter=DB_WRITE if write else DB_READ
        )

    async def check_access(request: Request, *, member: bool = False) -> AccessToken | None:
        """The member's verified token (None: the admin token, unless ``member`` demands a member)."""
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if scheme == "Bearer" and not member:
            _check_admin(request, state.admin_token)
            return None
        denied = "this needs a member's access credential (or the admin token)"
        if scheme != ACCESS_SCHEME:
            raise HttpError(401, "access_required", denied)
        now = state.clock()
        try:
            credential = decode_api_credential(value.strip())
            access = state.authority.key.verify_token(credential.token)
        except (ValueError, AuthError) as exc:
            raise HttpError(401, "bad_token", f"{denied}: {exc}") from exc
        if access.run_id != state.run_id or now >= access.expires_at:
            raise HttpError(401, "bad_token", "token of another run, or expired; refresh it")
        if not abs(now - credential.timestamp) <= MAX_CLOCK_SKEW:  # also NaN
            raise HttpError(401, "clock_skew", "the credential's timestamp is too far from our clock")
        path = request.url.path.removeprefix(f"/v1/runs/{state.run_id}/")
        payload = api_request_payload(state.run_id, request.method, path, credential.timestamp)
        if not verify(access.public_key, credential.signature, payload):
            raise HttpError(401, "bad_signature", "the credential is not signed by the token's key")
        if await db(state.store.active_user_of_peer, access.peer_id) != access.username:
            raise HttpError(403, "revoked", f"user {access.username} has been removed from this run")
        return access

    def address_of(request: Request) -> str:
        return request.client.host if request.client else "?"

    @route("health", ["GET"])
    async def health(request: Request) -> Response:
        return _json(
            {
                "ok": True,
                "run_id": state.run_id,
                "peer_id": state.peer_id,
                "uptime_s": state.clock() - state.started_at,
            }
        )

    @route("manifest", ["GET"])
    async def manifest(request: Request) -> Response:
        return _json(state.manifest())

    @route("join", ["POST"])
    async def join(request: Request) -> Response:
        now = state.clock()
        client = request.client.host if request.client else "?"
        if not state.join_by_address.allow(client, now):
            raise HttpError(429, "rate_limited", f"too many join attempts from {client}; retry later")
        body = await _body(request, JoinRequest)
        if not state.join_by_invite.allow(body.invite_secret, now):
            raise HttpError(429, "rate_limited", "too many join attempts with this invite; retry later")
        _check_proof(body.run_id, state.run_id, body.timestamp, now)
        if peer_id_from_public_key(body.public_key) != body.peer_id:
            raise HttpError(422, "invalid", "peer_id is not the id of public_key")
        if not verify(
            body.public_key,
            body.signature,
            join_payload(body.run_id, body.invite_secret, body.peer_id, body.timestamp),
        ):
            raise HttpError(401, "bad_signature", "the join request is not signed by public_key")
        try:
            username = await db(
                state.store.redeem_invite,
                body.invite_secret,
                body.peer_id,
                body.public_key,
                now=now,
                write=True,
            )
        except InviteRejected as exc:
            # The message is the ledger's ("this invite has expired"): the volunteer adds what to do.
            raise HttpError(403, "invite_rejected", str(exc)) from exc
        token = state.authority.issue_token(
            state.run_id, username, body.peer_id, body.public_key, now, state.token_lifetime
        )
        logger.info("admitted %s (user %s) from %s", body.peer_id, username, client)
        return _json(JoinResponse(username=username, token=token, manifest=state.manifest()))

    @route("refresh", ["POST"])
    async def refresh(request: Request) -> Response:
        now = state.clock()
        _limit(state.posts_by_address, address_of(request), now, "requests from your address")
        body = await _body(request, RefreshRequest)
        _check_proof(body.run_id, state.run_id, body.timestamp, now)
        try:
            access = state.authority.key.verify_token(body.token)
        except AuthError as exc:
            raise HttpError(401, "bad_token", str(exc)) from exc
        if access.run_id != state.run_id or now > access.expires_at + REFRESH_GRACE:
            raise HttpError(401, "bad_token", "token of another run, or expired too long ago; join again")
        if not verify(
            access.public_key, body.signature, refresh_payload(body.run_id, body.token, body.timestamp)
        ):
            raise HttpError(401, "bad_signature", "the refresh request is not signed by the token's key")
        # After the signature: tokens travel in every RPC, so whoever saw one must not spend its budget.
        _limit(state.refresh_by_peer, access.peer_id, now, "refreshes of this peer's token")
        username = await db(state.store.active_user_of_peer, access.peer_id)
        if username != access.username:
            raise HttpError(
                403, "revoked", f"user {access.username} has been removed from run {state.run_id}"
            )
        token = state.authority.issue_token(
            state.run_id, username, access.peer_id, access.public_key, now, state.token_lifetime
        )
        return _json(RefreshResponse(token=token))

    @route("revocations", ["GET"])
    async def revocations(request: Request) -> Response:
        return _json(RevocationList(revocations=state.revocations()))

    @route("ledger", ["GET"], access=True)
    async def ledger(request: Request) -> Response:
        return _json(await db(state.store.leaderboard))

    @route("reports", ["POST"])
    async def reports(request: Request) -> Response:
        now = state.clock()
        _limit(state.posts_by_address, address_of(request), now, "requests from your address")
        signed = await _body(request, SignedReport)
        try:
            report = verify_report(signed, state.run_id)
            _limit(state.reports_by_peer, report.peer_id, now, "reports from this peer")
            if await db(state.store.active_user_of_peer, report.peer_id) is None:
                raise HttpError(
                    403, "revoked", f"peer {report.peer_id} belongs to no active user of this run"
                )
            verdict = await db(state.store.assess_and_record, signed, report, now=state.clock(), write=True)
        except ReportRejected as exc:
            raise HttpError(422, "report_rejected", str(exc)) from exc
        except UnknownPeer as exc:
            raise HttpError(403, "unknown_peer", str(exc)) from exc
        if verdict is None:
            return _json(ReportReceipt(recorded=False, credited=False, reason="duplicate"))
        return _json(
            ReportReceipt(
                recorded=True,
                credited=verdict.credited,
                reason=verdict.reason,
                samples=verdict.samples,
                notes=verdict.notes,
            )
        )

    @route("capabilities", ["POST"])
    async def capabilities(request: Request) -> Response:
        now = state.clock()
        _limit(state.posts_by_address, address_of(request), now, "requests from your address")
        signed = await _body(request, SignedCapabilities)
        _check_proof(signed.run_id, state.run_id, signed.timestamp, now)
        try:
            measured = decode_capabilities(signed.capabilities)
        except ProtocolError as exc:
            raise HttpError(422, "invalid", str(exc)) from exc
        payload = capabilities_payload(signed.run_id, signed.peer_id, signed.timestamp, signed.capabilities)
        if not verify_by_peer_id(signed.peer_id, signed.signature, payload):
            raise HttpError(401, "bad_signature", f"the capabilities are not signed by peer {signed.peer_id}")
        _limit(state.capabilities_by_peer, signed.peer_id, now, "capability updates from this peer")
        if await db(state.store.active_user_of_peer, signed.peer_id) is None:
            raise HttpError(
                403, "unknown_peer", f"peer {signed.peer_id} belongs to no active user of this run"
            )
        try:
            held = await db(state.store.update_capabilities, signed.peer_id, measured, now=now, write=True)
        except UnknownPeer as exc:  # removed between the two calls
            raise HttpError(403, "unknown_peer", str(exc)) from exc
        except CapabilitiesRejected as exc:
            raise HttpError(422, "invalid", str(exc)) from exc
        logger.debug("capabilities of %s: %s (held: %s)", signed.peer_id, measured, held)
        return _json(CapabilitiesReceipt(peer_id=signed.peer_id, capabilities=held))

    @route("sessions/{token}/{event}", ["POST"])
    async def session(request: Request) -> Response:
        now = state.clock()
        _limit(state.posts_by_address, address_of(request), now, "requests from your address")
        token, event = request.path_params["token"], request.path_params["event"]
        if not _SESSION_TOKEN.match(token) or event not in ("alive", "leave"):
            raise HttpError(404, "not_found", "expected sessions/<32 hex digits>/alive or .../leave")
        access = await check_access(request, member=True)
        assert access is not None  # member=True: a member's token or HttpError
        _limit(state.sessions_by_peer, access.peer_id, now, "session notices from this peer")
        try:
            if event == "alive":
                is_open = await db(
                    state.store.session_heartbeat,
                    access.peer_id,
                    token,
                    address_of(request),
                    now=now,
                    write=True,
                )
            else:
                await db(state.store.leave_session, access.peer_id, token, now=now, write=True)
                is_open = False
                logger.info("%s (user %s) left (session %s)", access.peer_id, access.username, token[:8])
        except UnknownPeer as exc:
            raise HttpError(403, "unknown_peer", str(exc)) from exc
        return _json(SessionState(open=is_open, timeout_s=state.session_timeout))

    catalog = ShardCatalog(state.shards_dir) if state.shards_dir is not None else None

    @route("shards", ["GET"], access=True)
    async def list_shards(request: Request) -> Response:
        if catalog is None:
            return _json(ShardList(shards=[]))
        return _json(ShardList(shards=await trio.to_thread.run_sync(catalog.list, limiter=FILES)))

    @route("shards/{name:path}", ["GET"], access=True)  # ``:path`` so that ``a/../b`` gets the JSON 404 too
    async def get_shard(request: Request) -> Response:
        name = request.path_params["name"]
        found = await trio.to_thread.run_sync(catalog.find, name, limiter=FILES) if catalog else None
        if found is None:
            raise HttpError(404, "unknown_shard", f"this backbone serves no shard {name[:80]!r}")
        info, path = found
        return FileResponse(path, media_type="application/jsonl", headers={"x-sha256": info.sha256})

    @route("tokenizer/{digest}", ["GET"], access=True)
    async def get_tokenizer(request: Request) -> Response:
        # The spec served names the tokenizer by its SHA-256: asking for another one is a 404, never a guess.
        spec = state.manifest().training
        digest = spec.tokenizer.sha256 if spec is not None else ""
        if state.tokenizer is None or not digest or request.path_params["digest"] != digest:
            raise HttpError(404, "unknown_tokenizer", "this backbone serves no tokenizer of that SHA-256")
        return FileResponse(state.tokenizer, media_type="application/json", headers={"x-sha256": digest})

    @route("admin/users", ["POST"], admin=True)
    async def add_user(request: Request) -> Response:
        body = await _body(request, NewUser)
        now = state.clock()
        try:
            await db(state.store.add_user, body.username, note=body.note, now=now, write=True)
            secret = await db(
                state.store.create_invite,
                body.username,
                now=now,
                expires_at=now + body.expires_in if body.expires_in else None,
                write=True,
            )
        except UnknownUser as exc:
            raise HttpError(404, "unknown_user", str(exc)) from exc
        except ConfigError as exc:  # a reserved username, an invalid note
            raise HttpError(422, "invalid", str(exc)) from exc
        urls = state.manifest().api
        return _json({"username": body.username, "invite": encode_invite(Invite(state.run_id, urls, secret))})

    @route("admin/users", ["GET"], admin=True)
    async def list_users(request: Request) -> Response:
        return _json(await db(state.store.list_users))

    @route("admin/users/{username}", ["DELETE"], admin=True)
    async def remove_user(request: Request) -> Response:
        username = request.path_params["username"]
        if not await db(state.store.remove_user, username, now=state.clock(), write=True):
            raise HttpError(404, "unknown_user", f"no active user {username!r}")
        await state.on_user_removed(username)
        return _json({"username": username, "removed": True})

    heldout = ShardCatalog(state.shards_dir / HELDOUT_DIR) if state.shards_dir is not None else None
    digests: dict[tuple[object, ...], str | None] = {}

    def training() -> TrainingSpec:
        return state.manifest().training or TrainingSpec()

    def heldout_shards() -> list[ShardInfo]:
        """The held-out shards the run's evaluators read (``dataset.eval_files`` restricts the names)."""
        patterns = training().dataset.eval_files
        infos = heldout.list() if heldout is not None else []
        return [i for i in infos if not patterns or any(fnmatch.fnmatchcase(i.name, p) for p in patterns)]

    def served_eval_set() -> str | None:
        """The digest of the held-out examples we serve (None: the run reads none from us), cached by
        the shards' names and digests."""
        dataset = training().dataset
        if heldout is None or dataset.source != "backbone":
            return None
        infos = heldout_shards()
        key = (dataset.eval_examples, dataset.text_field, *((i.name, i.sha256) for i in infos))
        if key not in digests:
            try:
                files = [heldout.directory / i.name for i in infos]
                examples = read_heldout(files, dataset.eval_examples, dataset.text_field)
            except ConfigError as exc:
                logger.warning("the held-out shards cannot be read: %s", exc)
                examples = []
            complete = bool(examples) and len(examples) == dataset.eval_examples
            digests.clear()
            digests[key] = heldout_digest(examples) if complete else None
        return digests[key]

    @route("heldout", ["GET"], access=True)
    async def list_heldout(request: Request) -> Response:
        return _json(ShardList(shards=await trio.to_thread.run_sync(heldout_shards, limiter=FILES)))

    @route("heldout/{name:path}", ["GET"], access=True)
    async def get_heldout(request: Request) -> Response:
        name = request.path_params["name"]
        infos = await trio.to_thread.run_sync(heldout_shards, limiter=FILES)
        info = next((i for i in infos if i.name == name), None)
        if heldout is None or info is None:
            raise HttpError(404, "unknown_shard", f"this backbone serves no held-out shard {name[:80]!r}")
        path = heldout.directory / info.name
        return FileResponse(path, media_type="application/jsonl", headers={"x-sha256": info.sha256})

    @route("evaluations", ["POST"])
    async def evaluations(request: Request) -> Response:
        now = state.clock()
        _limit(state.posts_by_address, address_of(request), now, "requests from your address")
        signed = await _body(request, SignedEvaluation)
        statuses = {"bad_signature": 401, "clock_skew": 401, "unknown_run": 404}
        try:
            evaluation = open_evaluation(signed)
            # After the signature: only the key holder spends its peer's budget.
            _limit(state.evaluations_by_peer, evaluation.peer_id, now, "evaluations from this peer")
            check_evaluation(
                evaluation,
                run_id=state.run_id,
                now=now,
                examples=training().dataset.eval_examples,
                eval_set=await trio.to_thread.run_sync(served_eval_set, limiter=FILES),
                newest_step=await db(state.store.newest_step),
            )
        except EvaluationRejected as exc:
            raise HttpError(statuses.get(exc.code, 422), exc.code, str(exc)) from exc
        if await db(state.store.active_user_of_peer, evaluation.peer_id) is None:
            raise HttpError(
                403, "unknown_peer", f"peer {evaluation.peer_id} belongs to no active user of this run"
            )
        try:
            recorded = await db(state.store.record_evaluation, signed, evaluation, now=now, write=True)
        except UnknownPeer as exc:  # removed between the two calls
            raise HttpError(403, "unknown_peer", str(exc)) from exc
        if not recorded:
            raise HttpError(
                409, "duplicate", f"peer {evaluation.peer_id} has evaluated step {evaluation.step}"
            )
        summary = await db(state.store.step_evaluation, evaluation.step)
        assert summary is not None  # the claim just recorded is finite
        logger.info(
            "held-out loss %.4f of step %d from %s (the step's: %.4f, %d users)",
            evaluation.loss,
            evaluation.step,
            evaluation.peer_id,
            summary.loss,
            summary.users,
        )
        return _json(
            EvaluationReceipt(
                step=evaluation.step,
                loss=summary.loss,
                users=summary.users,
                agrees=evaluation.peer_id not in summary.outliers,
            )
        )

    async def not_routed(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        version = _API_VERSION.match(request.url.path)
        if version and version.group(1) != API_VERSION:  # another API version: say who must upgrade
            theirs = int(version.group(1))
            who = "upgrade dedloc" if theirs < int(API_VERSION) else "this backbone must be upgraded"
            message = f"{who}: this backbone speaks API v{API_VERSION}, the request v{theirs}"
            return _json(ApiError("wrong_version", message), 404)
        code = "method_not_allowed" if status == 405 else "not_found"
        return _json(ApiError(code, f"no {request.method} {request.url.path[:200]!r} here"), status)

    return Starlette(
        exception_handlers={404: not_routed, 405: not_routed},
        routes=[
            health,
            manifest,
            join,
            refresh,
            revocations,
            ledger,
            reports,
            capabilities,
            session,
            list_shards,
            get_tokenizer,
            get_shard,
            add_user,
            list_users,
            remove_user,
            list_heldout,
            get_heldout,
            evaluations,
            *dashboard_routes(state),
        ],
    )


class NewUser(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    username: Username
    note: Annotated[str, msgspec.Meta(max_length=512)] | None = None
    #: seconds until the invite expires (None: never)
    expires_in: Annotated[float, msgspec.Meta(gt=0, le=MAX_INVITE_LIFETIME)] | None = None


def _check_admin(request: Request, admin_token: str) -> None:
    header = request.headers.get("authorization", "")
    # Header values arrive as latin-1 text; compare bytes (compare_digest refuses non-ASCII str).
    given = header.removeprefix("Bearer ").strip().encode("utf-8", "surrogateescape")
    if not header.startswith("Bearer ") or not hmac.compare_digest(given, admin_token.encode()):
        raise HttpError(401, "admin_required", "this action needs the backbone's admin token")


def _check_proof(claimed_run: str, run_id: str, timestamp: float, now: float) -> None:
    if claimed_run != run_id:
        raise HttpError(404, "unknown_run", f"this backbone serves run {run_id}, not {claimed_run}")
    if not abs(now - timestamp) <= MAX_CLOCK_SKEW:  # also NaN
        raise HttpError(401, "clock_skew", f"your clock is {timestamp - now:+.0f} s off this backbone's")
