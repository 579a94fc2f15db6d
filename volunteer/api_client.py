"""Client of a backbone's HTTPS API, with the server pinned by the run id (see :mod:`protocols.api`).

Before any request the client fetches the server's certificate and accepts it only if its key has the
fingerprint the run id carries; httpx then trusts exactly that certificate. URLs are tried in order
until one answers.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import httpx
import msgspec
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocols.api import (
    ApiError,
    JoinRequest,
    JoinResponse,
    RefreshRequest,
    RefreshResponse,
    ReportReceipt,
    join_payload,
    refresh_payload,
)
from protocols.auth import SignedToken, authority_fingerprint, split_run_id
from protocols.ledger import SignedReport
from shared.auth.keys import Identity
from shared.errors import AdmissionError, PeerUnavailable

__all__ = ["ApiClient"]

logger = logging.getLogger(__name__)
T = TypeVar("T", bound=msgspec.Struct)
REQUEST_DEADLINE = 15.0


class ApiClient:
    def __init__(self, run_id: str, urls: Sequence[str]) -> None:
        _, fingerprint = split_run_id(run_id)
        if fingerprint is None:
            raise AdmissionError(f"run {run_id} is open: it has no API to join through")
        self.run_id = run_id
        self.fingerprint = fingerprint
        self.urls = list(urls)

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

    async def _post(self, path: str, body: msgspec.Struct, reply: type[T]) -> T:
        errors: list[str] = []
        for url in self.urls:
            try:
                context = await self._pinned_context(url)
                async with httpx.AsyncClient(verify=context, timeout=REQUEST_DEADLINE) as client:
                    response = await client.post(
                        f"{url}/v1/runs/{self.run_id}/{path}",
                        content=msgspec.json.encode(body),
                        headers={"content-type": "application/json"},
                    )
            except (OSError, httpx.HTTPError, ValueError) as exc:
                errors.append(f"{url}: {exc or type(exc).__name__}")
                continue
            if response.status_code == 200:
                return msgspec.json.decode(response.content, type=reply)
            try:
                error = msgspec.json.decode(response.content, type=ApiError)
            except msgspec.DecodeError:
                error = ApiError("http_error", f"HTTP {response.status_code}")
            if response.status_code in (401, 403, 404, 422):
                raise AdmissionError(f"the backbone refused: {error.message} ({error.error})")
            errors.append(f"{url}: {error.message}")
        raise PeerUnavailable(f"no backbone API of run {self.run_id} answered: " + "; ".join(errors))

    async def join(self, invite_secret: str, identity: Identity) -> JoinResponse:
        """Redeem an invite for ``identity``'s peer.

        Raises:
            AdmissionError: the invite was refused (unknown, expired, user removed) or the server is an
                impostor.
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

    async def report(self, signed: SignedReport) -> ReportReceipt:
        """Submit a signed contribution report; resubmitting the same one changes nothing."""
        return await self._post("reports", signed, ReportReceipt)

    async def refresh(self, token: SignedToken, identity: Identity) -> SignedToken:
        now = time.time()
        signature = identity.sign(refresh_payload(self.run_id, token, now))
        request = RefreshRequest(run_id=self.run_id, token=token, timestamp=now, signature=signature)
        return (await self._post("refresh", request, RefreshResponse)).token
