"""Admission and per-request authentication (DESIGN D4, D8; seed 000 §3.3 "Collaborator authentication").

**Authority and pinned run ids.** Each run has an Ed25519 *authority* key held by its backbones. Its
fingerprint is ``base58(sha256(public key)[:12])``. A *pinned* run id is ``<name>@<fingerprint>``: a
volunteer that joins ``name@fp`` trusts only tokens, manifests, revocations, HTTPS certificates and mDNS
answers that check out against the key whose fingerprint is ``fp`` (the key itself travels beside them).
A run id without ``@`` is an *open* run: no authority, no admission, requests carry no credentials —
for local experiments only.

**Access token** (issued by a backbone's HTTP API after the volunteer redeemed an invite and proved it
holds its identity key): ``SignedToken{token: msgpack(AccessToken), signature}``, the signature made by
the authority over ``"dedloc-token-v1" || token``. Default lifetime 6 h; refreshed at 2/3 of it.

**Every request** of a pinned run carries in its envelope's ``auth`` field a :class:`RequestAuth`:
the sender's token, a timestamp, a 16-byte random nonce, and an Ed25519 signature by the sender's
identity key over :func:`request_payload` — the domain, run id, the receiver's peer id (so it cannot be
replayed at anyone else), message kind, request id, timestamp, nonce and the payload bytes. The receiver
rejects, each with its own error code and log line, in this order:

=====================  ============================================================================
``BAD_TOKEN``          the token is malformed or its authority signature does not verify
``WRONG_RUN_TOKEN``    the token was issued for another run
``TOKEN_EXPIRED``      ``now >= token.expires_at``
``TOKEN_PEER``         the token's peer id is not the TLS-proven peer of this connection
``CLOCK_SKEW``         ``|now - timestamp| > MAX_CLOCK_SKEW`` (60 s)
``BAD_SIGNATURE``      the request signature does not verify with the token's key
``REPLAYED``           this (peer, nonce) was seen in the last ``2 * MAX_CLOCK_SKEW`` seconds
``REVOKED``            the token's user has been revoked
``UNAUTHENTICATED``    a pinned run's request came with no credentials at all
=====================  ============================================================================

**Responses** of a pinned run carry a :class:`ResponseAuth`: the responder's own token and its signature
over :func:`response_payload` (domain, run id, the requester's nonce, kind, payload). A requester refuses
an answer from a peer that is not admitted, and an answer not bound to its own request.

**Revocation** is a :class:`SignedRevocation` by the authority, stored in the DHT under
:data:`REVOCATIONS_KEY` (subkey = username) and served by the backbone API; every node polls it every few
seconds, so removing a user cuts all of its peers off within seconds, not at token expiry.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import base58
import msgspec

from .types import Bytes32, Bytes64, PeerIdStr, RunIdStr

__all__ = [
    "DEFAULT_TOKEN_LIFETIME",
    "MAX_CLOCK_SKEW",
    "REVOCATIONS_KEY",
    "AccessToken",
    "RequestAuth",
    "ResponseAuth",
    "Revocation",
    "SignedRevocation",
    "SignedToken",
    "authority_fingerprint",
    "request_payload",
    "response_payload",
    "revocation_payload",
    "split_run_id",
    "token_payload",
]

MAX_CLOCK_SKEW = 60.0
DEFAULT_TOKEN_LIFETIME = 6 * 3600.0
REVOCATIONS_KEY = "run.revocations"
UsernameStr = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._@+-]+$")]


def authority_fingerprint(public_key: bytes) -> str:
    """The short name of an authority key that pinned run ids carry after ``@``."""
    return base58.b58encode(hashlib.sha256(public_key).digest()[:12]).decode("ascii")


def split_run_id(run_id: str) -> tuple[str, str | None]:
    """``("name", "fingerprint")`` for a pinned run id, ``(run_id, None)`` for an open one."""
    name, sep, fingerprint = run_id.rpartition("@")
    return (name, fingerprint) if sep and name and fingerprint else (run_id, None)


class AccessToken(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run_id: RunIdStr
    username: UsernameStr
    peer_id: PeerIdStr
    public_key: Bytes32
    issued_at: float
    expires_at: float


class SignedToken(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token: Annotated[bytes, msgspec.Meta(max_length=1024)]  # msgpack(AccessToken)
    signature: Bytes64


class RequestAuth(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token: SignedToken
    timestamp: float
    nonce: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    signature: Bytes64


class ResponseAuth(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token: SignedToken
    signature: Bytes64


class Revocation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run_id: RunIdStr
    username: UsernameStr
    revoked_at: float


class SignedRevocation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    revocation: Annotated[bytes, msgspec.Meta(max_length=512)]  # msgpack(Revocation)
    signature: Bytes64


def token_payload(token_bytes: bytes) -> bytes:
    return b"dedloc-token-v1" + token_bytes


def revocation_payload(revocation_bytes: bytes) -> bytes:
    return b"dedloc-revocation-v1" + revocation_bytes


def request_payload(
    run_id: str, receiver: str, kind: str, request_id: int, timestamp: float, nonce: bytes, payload: bytes
) -> bytes:
    header = msgspec.msgpack.encode((run_id, receiver, kind, request_id, timestamp, nonce))
    return b"dedloc-request-v1" + len(header).to_bytes(4, "big") + header + payload


def response_payload(run_id: str, request_nonce: bytes, kind: str, payload: bytes) -> bytes:
    header = msgspec.msgpack.encode((run_id, request_nonce, kind))
    return b"dedloc-response-v1" + len(header).to_bytes(4, "big") + header + payload
