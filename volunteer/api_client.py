"""Client of a backbone's HTTPS API, with the server pinned by the run id (see :mod:`protocols.api`).

Before any request the client fetches the server's certificate and accepts it only if its key has the
fingerprint the run id carries; httpx then trusts exactly that certificate. URLs are tried in order
until one answers, and the client keeps to the URL that last answered (a run with several backbones:
once one is gone, a request does not first wait out the dead server). A client made with the volunteer's
identity and (a getter of) its current access token
signs its GET requests (``Authorization: Dedloc ...``, see :mod:`protocols.api`): the shards and the
ledger of a run are for its members only.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import httpx
import msgspec
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocols.api import (
    ACCESS_SCHEME,
    ApiCredential,
    ApiError,
    JoinRequest,
    JoinResponse,
    Manifest,
    RefreshRequest,
    RefreshResponse,
    ReportReceipt,
    SessionState,
    ShardInfo,
    ShardList,
    api_request_payload,
    encode_api_credential,
    join_payload,
    refresh_payload,
)
from protocols.auth import SignedToken, authority_fingerprint, split_run_id
from protocols.errors import DECODE_FAILURES
from protocols.evaluation import EvaluationReceipt, SignedEvaluation
from protocols.ledger import (
    Capabilities,
    CapabilitiesReceipt,
    SignedCapabilities,
    SignedReport,
    capabilities_payload,
)
from shared.auth.keys import Identity
from shared.errors import AdmissionError, PeerUnavailable, ProtocolError
from shared.tokenizer import MAX_TOKENIZER_BYTES

__all__ = ["ApiClient", "Refused"]

logger = logging.getLogger(__name__)
T = TypeVar("T", bound=msgspec.Struct)
REQUEST_DEADLINE = 15.0


class Refused(AdmissionError):
    """A backbone of the run answered with a refusal (401/403/...): ``code`` is its error code
    (``invite_rejected``, ``revoked``, ...), ``reason`` its message, at most 200 characters."""

    def __init__(self, error: ApiError) -> None:
        self.code = error.error[:64]
        self.reason = error.message[:200]
        super().__init__(f"the backbone refused: {self.reason} ({self.code})")


class ApiClient:
    def __init__(
        self,
        run_id: str,
        urls: Sequence[str],
        *,
        identity: Identity | None = None,
        token: Callable[[], SignedToken | None] | None = None,
    ) -> None:
        """``identity`` and ``token`` (a getter: tokens are refreshed) sign the member-only GETs."""
        _, fingerprint = split_run_id(run_id)
        if fingerprint is None:
            raise AdmissionError(f"run {run_id} is open: it has no API to join through")
        self.run_id = run_id
        self.fingerprint = fingerprint
        self.urls = list(urls)
        self.preferred: str | None = None  # the URL that answered last: tried first
        self.identity = identity
        self.token = token

    def _access_headers(self, method: str, path: str) -> dict[str, str]:
        token = self.token() if self.token is not None else None
        if self.identity is None or token is None:
            return {}
        now = time.time()
        signature = self.identity.sign(api_request_payload(self.run_id, method, path, now))
        credential = ApiCredential(token=token, timestamp=now, signature=signature)
        return {"authorization": f"{ACCESS_SCHEME} {encode_api_credential(credential)}"}

    async def _pinned_context(self, url: str) -> ssl.SSLContext:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or 443

        def fetch() -> str:
            return ssl.get_server_certificate((host, port), timeout=REQUEST_DEADLINE)

        pem = await trio.to_thread.run_sync(fetch)
        key = x509.load_pem_x509_certificate(pem.encode()).public_key()
        raw = (
            key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            if isinstance(key, Ed25519PublicKey)
            else b""
        )
        if authority_fingerprint(raw) != self.fingerprint:
            raise AdmissionError(
                f"{url} is not a backbone of run {self.run_id}: its certificate key does not match"
            )
        context = ssl.create_default_context(cadata=pem)
        context.check_hostname = False
        return context

    async def _request(
        self, method: str, path: str, body: msgspec.Struct | None, refusals: tuple[int, ...]
    ) -> bytes:
        """The body of the first 200 answer, trying :attr:`preferred` first, then the URLs in order; a
        status in ``refusals`` ends the search with :class:`AdmissionError`, any other failure moves on to
        the next URL. A URL that answers 200 becomes :attr:`preferred`."""
        errors: list[str] = []
        first = self.preferred
        order = [first] if first is not None and first in self.urls else []
        for url in [*order, *(u for u in self.urls if u not in order)]:
            try:
                context = await self._pinned_context(url)
                headers = (
                    self._access_headers(method, path)
                    if body is None
                    else {"content-type": "application/json"}
                )
                async with httpx.AsyncClient(verify=context, timeout=REQUEST_DEADLINE) as client:
                    response = await client.request(
                        method,
                        f"{url}/v1/runs/{self.run_id}/{path}",
                        content=None if body is None else msgspec.json.encode(body),
                        headers=headers,
                    )
            except (OSError, httpx.HTTPError, ValueError) as exc:
                errors.append(f"{url}: {exc or type(exc).__name__}")
                continue
            if response.status_code == 200:
                self.preferred = url  # a live backbone of the run (its certificate is pinned)
                return response.content
            try:
                error = msgspec.json.decode(response.content, type=ApiError)
            except DECODE_FAILURES:
                error = ApiError("http_error", f"HTTP {response.status_code}")
            if response.status_code in refusals:
                raise Refused(error)
            errors.append(f"{url}: {error.message}")
        raise PeerUnavailable(f"no backbone API of run {self.run_id} answered: " + "; ".join(errors))

    async def _post(self, path: str, body: msgspec.Struct, reply: type[T]) -> T:
        content = await self._request("POST", path, body, refusals=(401, 403, 404, 422))
        try:
            return msgspec.json.decode(content, type=reply)
        except DECODE_FAILURES as exc:
            raise ProtocolError(f"the backbone's answer to {path} is malformed: {str(exc)[:200]}") from exc

    async def _get(self, path: str) -> bytes:
        """GET ``path`` from the first backbone that has it: a 404 moves on to the next URL (backbones of
        one run may serve different shards); 401 and 403 end the search with :class:`AdmissionError`."""
        return await self._request("GET", path, None, refusals=(401, 403))

    async def list_shards(self) -> ShardList:
        """The dataset shards the first answering backbone serves (DESIGN D6).

        Raises:
            PeerUnavailable: no API URL answered.
            ProtocolError: the answer is not a valid shard list.
        """
        return await self._shard_list("shards", "shard list")

    async def fetch_shard(self, info: ShardInfo) -> bytes:
        """The bytes of a shard, checked against ``info``'s length and SHA-256.

        Raises:
            PeerUnavailable: no backbone could serve it.
            ProtocolError: the bytes served are not the shard announced (length or digest differ).
        """
        return await self._checked_shard("shards", info, "shard")

    async def _shard_list(self, path: str, what: str) -> ShardList:
        content = await self._get(path)
        try:
            return msgspec.json.decode(content, type=ShardList)
        except DECODE_FAILURES as exc:
            raise ProtocolError(f"the backbone's {what} is malformed: {exc}") from exc

    async def _checked_shard(self, folder: str, info: ShardInfo, what: str) -> bytes:
        content = await self._get(f"{folder}/{info.name}")
        if len(content) != info.nbytes:
            raise ProtocolError(
                f"{what} {info.name} should be {info.nbytes} bytes long, the backbone sent {len(content)}"
            )
        digest = await trio.to_thread.run_sync(lambda: hashlib.sha256(content).hexdigest())
        if digest != info.sha256:
            raise ProtocolError(f"{what} {info.name} does not match its SHA-256 (the backbone sent {digest})")
        return content

    async def fetch_tokenizer(self, sha256: str) -> bytes:
        """The run's ``tokenizer.json``, checked against the SHA-256 its training spec pins.

        Raises:
            PeerUnavailable: no backbone could serve it.
            ProtocolError: the bytes served hash to something else (or are too long to be one).
        """
        content = await self._get(f"tokenizer/{sha256}")
        if len(content) > MAX_TOKENIZER_BYTES:
            raise ProtocolError(f"the backbone sent a tokenizer of {len(content)} bytes; too long to be one")
        digest = await trio.to_thread.run_sync(lambda: hashlib.sha256(content).hexdigest())
        if digest != sha256:
            raise ProtocolError(
                f"the backbone sent a tokenizer whose SHA-256 is {digest[:12]}…, not the run's {sha256[:12]}…"
            )
        return content

    async def manifest(self) -> Manifest:
        """The run's current manifest (training spec, backbones, API URLs) from a backbone of the run.

        Raises:
            PeerUnavailable: no API URL answered.
            ProtocolError: the answer is not a valid manifest of this run.
        """
        content = await self._get("manifest")
        try:
            manifest = msgspec.json.decode(content, type=Manifest)
        except DECODE_FAILURES as exc:
            raise ProtocolError(f"the backbone's manifest is malformed: {exc}") from exc
        if (
            manifest.run_id != self.run_id
            or authority_fingerprint(manifest.authority_public_key) != self.fingerprint
        ):
            raise ProtocolError(f"the manifest served is not one of run {self.run_id}")
        return manifest

    async def join(self, invite_secret: str, identity: Identity) -> JoinResponse:
        """Redeem an invite for ``identity``'s peer.

        Raises:
            Refused: the invite was refused (code ``invite_rejected``: unknown, expired, used up, user
                removed).
            AdmissionError: the server is an impostor.
            PeerUnavailable: no API URL answered.
        """
        now = time.time()
        signature = identity.sign(join_payload(self.run_id, invite_secret, identity.peer_id, now))
        request = JoinRequest(
            run_id=self.run_id,
            invite_secret=invite_secret,
            peer_id=identity.peer_id,
            public_key=identity.public_key_bytes,
            timestamp=now,
            signature=signature,
        )
        return await self._post("join", request, JoinResponse)

    async def capabilities(self, identity: Identity, capabilities: Capabilities) -> CapabilitiesReceipt:
        """Record ``identity``'s measured capabilities in the ledger (signed; see
        :class:`protocols.ledger.SignedCapabilities`).

        Raises:
            AdmissionError: refused (not an admitted peer, removed user, bad clock) or an impostor server.
            PeerUnavailable: no API URL answered.
        """
        now = time.time()
        data = msgspec.msgpack.encode(capabilities)
        signed = SignedCapabilities(
            run_id=self.run_id,
            peer_id=identity.peer_id,
            timestamp=now,
            capabilities=data,
            signature=identity.sign(capabilities_payload(self.run_id, identity.peer_id, now, data)),
        )
        return await self._post("capabilities", signed, CapabilitiesReceipt)

    async def report(self, signed: SignedReport) -> ReportReceipt:
        """Submit a signed contribution report; resubmitting the same one changes nothing."""
        return await self._post("reports", signed, ReportReceipt)

    async def session(self, token: str, event: str) -> SessionState:
        """Tell the backbone that this process (session ``token``) is ``"alive"`` or ``"leave"``-ing
        (signed with the access credential, which covers the path; see :mod:`protocols.api`).

        Raises:
            AdmissionError: refused (not an admitted peer, removed user) or an impostor server.
            PeerUnavailable: no API URL answered (also: only backbones too old to know sessions).
            ProtocolError: the answer is malformed.
        """
        content = await self._request("POST", f"sessions/{token}/{event}", None, refusals=(401, 403))
        try:
            return msgspec.json.decode(content, type=SessionState)
        except DECODE_FAILURES as exc:
            raise ProtocolError(f"the backbone's answer to a session notice is malformed: {exc}") from exc

    async def refresh(self, token: SignedToken, identity: Identity) -> SignedToken:
        now = time.time()
        signature = identity.sign(refresh_payload(self.run_id, token, now))
        request = RefreshRequest(run_id=self.run_id, token=token, timestamp=now, signature=signature)
        return (await self._post("refresh", request, RefreshResponse)).token

    async def list_heldout(self) -> ShardList:
        """The held-out shards the first answering backbone serves (``protocols.evaluation``).

        Raises:
            PeerUnavailable: no API URL answered (also: only backbones too old to serve held-out shards).
            ProtocolError: the answer is not a valid shard list.
        """
        return await self._shard_list("heldout", "held-out shard list")

    async def fetch_heldout(self, info: ShardInfo) -> bytes:
        """The bytes of a held-out shard, checked against ``info``'s length and SHA-256.

        Raises:
            PeerUnavailable: no backbone could serve it.
            ProtocolError: the bytes served are not the shard announced.
        """
        return await self._checked_shard("heldout", info, "held-out shard")

    async def evaluation(self, signed: SignedEvaluation) -> EvaluationReceipt:
        """Publish a signed held-out evaluation (``protocols.evaluation``).

        Raises:
            Refused: the backbone refused it (its ``code``: ``duplicate``, ``future_step``,
                ``wrong_eval_set``, ``rate_limited``, ...).
            PeerUnavailable: no API URL answered.
            ProtocolError: the answer is malformed.
        """
        content = await self._request(
            "POST", "evaluations", signed, refusals=(401, 403, 404, 409, 413, 422, 429)
        )
        try:
            return msgspec.json.decode(content, type=EvaluationReceipt)
        except DECODE_FAILURES as exc:
            raise ProtocolError(f"the backbone's answer to an evaluation is malformed: {exc}") from exc
