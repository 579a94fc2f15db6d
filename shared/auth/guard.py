"""Per-request authentication for the RPC and bulk lanes (the checks of :mod:`protocols.auth`).

An :class:`Authenticator` signs what this node sends and checks what it receives. Two kinds exist:

* :class:`OpenAuthenticator` — open runs (run id without ``@``): no credentials, everything accepted;
* :class:`RunAuthenticator` — pinned runs: every request and notification carries a
  :class:`~protocols.auth.RequestAuth`, every response a :class:`~protocols.auth.ResponseAuth`, and the
  checks run in the documented order, each failure raising :class:`~shared.errors.AuthError` with its
  own code. Pure apart from the injected clock and nonce source; the services call it inline (an Ed25519
  verification is tens of microseconds).

Verified tokens are cached by their bytes (a cache hit skips only the authority signature check; the
expiry, run, peer and revocation checks run every time).

**Credentials are wire input.** :func:`decode_request_auth` and :func:`decode_response_auth` raise only
:class:`~protocols.errors.ProtocolError`, whatever the bytes; the checks turn that into ``BAD_TOKEN``.

**Error replies are signed too** (DESIGN D4). A refusal is signed like any response, over the
``error`` kind and the reply's payload, bound to the nonce the request carried (:meth:`sign_error`) —
also when the request itself was refused, as long as its credentials were readable enough to name a
nonce. The requester checks it with :meth:`check_response` like any answer, so a forged or unsigned
refusal (``REVOKED`` to make a node believe it was removed, ``OVERLOADED`` to make it back off) is a
protocol failure of that peer, not believed. (A refusal's token is not checked for expiry: a requester
whose own clock is off must still be able to read ``CLOCK_SKEW``.) A node that cannot sign (no token of
its own yet, or a request without a nonce) sends its refusal unsigned; a requester in a pinned run
refuses it.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from protocols.auth import (
    MAX_CLOCK_SKEW,
    AccessToken,
    RequestAuth,
    ResponseAuth,
    SignedToken,
    request_payload,
    response_payload,
)
from protocols.codes import ErrorCode
from protocols.errors import ProtocolError, decode_typed

from ..errors import AuthError
from .authority import AuthorityKey
from .keys import Identity, verify

__all__ = [
    "Authenticator",
    "OpenAuthenticator",
    "ReplayCache",
    "RunAuthenticator",
    "Verified",
    "decode_request_auth",
    "decode_response_auth",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verified:
    """Who sent an accepted request: the admitted username (``None`` in open runs) and its nonce, which the
    response signature binds to."""

    username: str | None
    nonce: bytes


_OPEN = Verified(None, b"")


class Authenticator(Protocol):
    """What the RPC and bulk lanes need from authentication."""

    def sign_request(self, receiver: str, kind: str, request_id: int, payload: bytes) -> tuple[bytes, bytes]:
        """Return ``(auth field, nonce)`` for an outgoing request or notification."""
        ...

    def check_request(self, sender: str, kind: str, request_id: int, payload: bytes, auth: bytes) -> Verified:
        """Return who sent the request or raise :class:`AuthError`."""
        ...

    def sign_response(self, request_nonce: bytes, kind: str, payload: bytes) -> bytes:
        """Return the auth field of a response to a request that carried ``request_nonce``."""
        ...

    def check_response(
        self, responder: str, request_nonce: bytes, kind: str, payload: bytes, auth: bytes
    ) -> None:
        """Raise :class:`AuthError` unless the response is a signed answer of an admitted peer."""
        ...

    def sign_error(self, request_auth: bytes, payload: bytes) -> bytes:
        """Return the auth field of an error reply (payload ``payload``) to a request whose auth field was
        ``request_auth``; ``b""`` when it cannot be signed."""
        ...

    def note_refused(self, code: int) -> None:
        """A peer refused one of our requests with an authentication ``code``."""
        ...


class OpenAuthenticator:
    """Open runs: nothing is signed, everything is accepted."""

    def sign_request(self, receiver: str, kind: str, request_id: int, payload: bytes) -> tuple[bytes, bytes]:
        return b"", b""

    def check_request(self, sender: str, kind: str, request_id: int, payload: bytes, auth: bytes) -> Verified:
        return _OPEN

    def sign_response(self, request_nonce: bytes, kind: str, payload: bytes) -> bytes:
        return b""

    def sign_error(self, request_auth: bytes, payload: bytes) -> bytes:
        return b""

    def check_response(
        self, responder: str, request_nonce: bytes, kind: str, payload: bytes, auth: bytes
    ) -> None:
        return None

    def note_refused(self, code: int) -> None:
        return None


class ReplayCache:
    """Remembers (peer, nonce) pairs for ``window`` seconds, in bounded memory."""

    def __init__(self, window: float, max_entries: int = 1_000_000) -> None:
        self.window = window
        self.max_entries = max_entries
        self._seen: set[tuple[str, bytes]] = set()
        self._order: deque[tuple[float, tuple[str, bytes]]] = deque()

    def check_and_add(self, peer: str, nonce: bytes, now: float) -> bool:
        """True if new (and now remembered); False if seen within the window."""
        while self._order and (self._order[0][0] < now - self.window or len(self._order) >= self.max_entries):
            self._seen.discard(self._order.popleft()[1])
        key = (peer, nonce)
        if key in self._seen:
            return False
        self._seen.add(key)
        self._order.append((now, key))
        return True


_REQUEST_AUTH = msgspec.msgpack.Decoder(RequestAuth)
_RESPONSE_AUTH = msgspec.msgpack.Decoder(ResponseAuth)
_ENCODER = msgspec.msgpack.Encoder()
#: The kind an error reply is signed under (``protocols.envelope.ErrorReply.kind``).
ERROR_KIND = "error"


def decode_request_auth(auth: bytes) -> RequestAuth:
    """Decode a request's credentials.

    Raises:
        ProtocolError: whatever is wrong with the bytes (never anything else).
    """
    return decode_typed(_REQUEST_AUTH, auth, "request credentials")


def decode_response_auth(auth: bytes) -> ResponseAuth:
    """Decode a response's credentials.

    Raises:
        ProtocolError: whatever is wrong with the bytes (never anything else).
    """
    return decode_typed(_RESPONSE_AUTH, auth, "response credentials")


class RunAuthenticator:
    """Pinned runs: sign with our identity and token; check everything we receive."""

    def __init__(
        self,
        run_id: str,
        authority: AuthorityKey,
        identity: Identity,
        token: SignedToken | None = None,
        *,
        clock: Callable[[], float] = time.time,
        nonce: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        self.run_id = run_id
        self.authority = authority
        self.identity = identity
        self._token = token
        self._clock = clock
        self._nonce = nonce
        self.revoked: set[str] = set()
        #: a peer answered one of our requests ``REVOKED``: our own user has been removed (we cannot
        #: read the revocation record itself any more, since nobody answers us)
        self.refused_as_revoked = False
        self._replays = ReplayCache(2 * MAX_CLOCK_SKEW)
        self._verified: OrderedDict[bytes, AccessToken] = OrderedDict()

    # ---------------------------------------------------------------- own credentials

    @property
    def token(self) -> SignedToken | None:
        return self._token

    def set_token(self, token: SignedToken) -> None:
        """Swap in a fresh token (refresh); requests already signed keep the old one, which is still valid."""
        access = self.authority.verify_token(token)
        if access.peer_id != self.identity.peer_id or access.run_id != self.run_id:
            raise AuthError(ErrorCode.TOKEN_PEER, "this token was issued to another peer or run")
        self._token = token

    def note_refused(self, code: int) -> None:
        if code == ErrorCode.REVOKED:
            self.refused_as_revoked = True

    def _require_token(self) -> SignedToken:
        if self._token is None:
            raise AuthError(ErrorCode.UNAUTHENTICATED, f"not admitted to run {self.run_id}: no access token")
        return self._token

    def sign_request(self, receiver: str, kind: str, request_id: int, payload: bytes) -> tuple[bytes, bytes]:
        token = self._require_token()
        nonce = self._nonce(16)
        timestamp = self._clock()
        message = request_payload(self.run_id, receiver, kind, request_id, timestamp, nonce, payload)
        auth = RequestAuth(
            token=token, timestamp=timestamp, nonce=nonce, signature=self.identity.sign(message)
        )
        return _ENCODER.encode(auth), nonce

    def sign_response(self, request_nonce: bytes, kind: str, payload: bytes) -> bytes:
        token = self._require_token()
        signature = self.identity.sign(response_payload(self.run_id, request_nonce, kind, payload))
        return _ENCODER.encode(ResponseAuth(token=token, signature=signature))

    def sign_error(self, request_auth: bytes, payload: bytes) -> bytes:
        if self._token is None or not request_auth:
            return b""
        try:
            nonce = decode_request_auth(request_auth).nonce
        except ProtocolError:
            return b""  # no nonce to bind to: the requester refuses the unsigned reply, as it should
        return self.sign_response(nonce, ERROR_KIND, payload)

    # ---------------------------------------------------------------- checks

    def _access(
        self, signed: SignedToken, peer: str, now: float, *, check_expiry: bool = True
    ) -> AccessToken:
        key = signed.token + signed.signature  # a cache hit means these exact bytes verified before
        access = self._verified.get(key)
        if access is None:
            access = self.authority.verify_token(signed)
            self._verified[key] = access
            if len(self._verified) > 4096:
                self._verified.popitem(last=False)
        else:
            self._verified.move_to_end(key)
        if access.run_id != self.run_id:
            raise AuthError(ErrorCode.WRONG_RUN_TOKEN, f"token of run {access.run_id}, not {self.run_id}")
        if check_expiry and now >= access.expires_at:
            raise AuthError(
                ErrorCode.TOKEN_EXPIRED,
                f"token of {access.username} expired {now - access.expires_at:.0f} s ago",
            )
        if access.peer_id != peer:
            raise AuthError(ErrorCode.TOKEN_PEER, f"token of peer {access.peer_id} presented by {peer}")
        return access

    def check_request(self, sender: str, kind: str, request_id: int, payload: bytes, auth: bytes) -> Verified:
        if not auth:
            raise AuthError(ErrorCode.UNAUTHENTICATED, f"{kind} from {sender} carries no credentials")
        try:
            request = decode_request_auth(auth)
        except ProtocolError as exc:
            raise AuthError(ErrorCode.BAD_TOKEN, f"malformed credentials from {sender}: {exc}") from exc
        now = self._clock()
        access = self._access(request.token, sender, now)
        if abs(now - request.timestamp) > MAX_CLOCK_SKEW:
            raise AuthError(
                ErrorCode.CLOCK_SKEW,
                f"{sender}'s clock is {request.timestamp - now:+.0f} s off (limit {MAX_CLOCK_SKEW:.0f} s)",
            )
        message = request_payload(
            self.run_id, self.identity.peer_id, kind, request_id, request.timestamp, request.nonce, payload
        )
        if not verify(access.public_key, request.signature, message):
            raise AuthError(ErrorCode.BAD_SIGNATURE, f"{kind} from {sender}: signature does not verify")
        if not self._replays.check_and_add(sender, request.nonce, now):
            raise AuthError(ErrorCode.REPLAYED, f"{kind} from {sender}: nonce already seen")
        if access.username in self.revoked:
            # No name: refusals are logged, and who was removed is the organizers' business.
            raise AuthError(
                ErrorCode.REVOKED, f"{kind} from {sender}: its user has been removed from the run"
            )
        return Verified(access.username, request.nonce)

    def check_response(
        self, responder: str, request_nonce: bytes, kind: str, payload: bytes, auth: bytes
    ) -> None:
        if not auth:
            raise AuthError(ErrorCode.UNAUTHENTICATED, f"{kind} from {responder} is not signed")
        try:
            response = decode_response_auth(auth)
        except ProtocolError as exc:
            raise AuthError(
                ErrorCode.BAD_TOKEN, f"malformed response credentials from {responder}: {exc}"
            ) from exc
        # A refusal is believed from an admitted peer even if its token looks expired to us: our clock may
        # be the one that is off, and then CLOCK_SKEW is exactly what we must be able to read. A refusal
        # only makes us give up a call; it cannot make us accept anything.
        access = self._access(response.token, responder, self._clock(), check_expiry=kind != ERROR_KIND)
        if not verify(
            access.public_key, response.signature, response_payload(self.run_id, request_nonce, kind, payload)
        ):
            raise AuthError(
                ErrorCode.BAD_SIGNATURE, f"{kind} from {responder}: response signature does not verify"
            )
        if access.username in self.revoked:
            raise AuthError(
                ErrorCode.REVOKED, f"{kind} from {responder}: its user has been removed from the run"
            )
