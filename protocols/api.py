"""The backbone's HTTP API: JSON bodies (msgspec), served over HTTPS (DESIGN D4, D8).

All paths are under ``/v1/runs/<run-id>/``; a path naming another run answers 404 ``unknown_run``.
Errors are ``{"error": <code>, "message": <text>}`` with a 4xx/5xx status. Bytes travel as base64.

=======  ======================  =================================================================
GET      ``health``              liveness: run id, backbone peer id, uptime
GET      ``manifest``            :class:`Manifest` (authority key, backbone multiaddrs, API URLs)
POST     ``join``                :class:`JoinRequest` -> :class:`JoinResponse` (redeem an invite)
POST     ``refresh``             :class:`RefreshRequest` -> :class:`RefreshResponse`
GET      ``revocations``         :class:`RevocationList`
GET      ``shards``              :class:`ShardList`: the dataset shards this backbone serves (access)
GET      ``shards/<name>``       one shard's bytes (JSON lines; check them against its ShardInfo) (access)
GET      ``tokenizer/<sha256>``  the run's ``tokenizer.json``, named by the SHA-256 its training spec pins
                                 (``training.tokenizer.sha256``); check the bytes against it (access)
GET      ``ledger``              the leaderboard (see ``backbone ledger``) (access or admin)
POST     ``reports``             a signed contribution report -> :class:`ReportReceipt`
POST     ``evaluations``         a signed held-out evaluation (``protocols.evaluation``) -> its receipt
GET      ``heldout``             :class:`ShardList`: the held-out shards evaluators read (access)
GET      ``heldout/<name>``      one held-out shard's bytes (access)
POST     ``capabilities``        a peer's signed measured capabilities (``protocols.ledger``) -> receipt
POST     ``sessions/<t>/alive``  heartbeat of the volunteer process with session token ``t`` (access)
                                 -> :class:`SessionState`; the first one opens its session
POST     ``sessions/<t>/leave``  that process leaves cleanly: its session ends now (access)
POST     ``admin/users``         admin: allow a user, get an invite (Bearer admin token)
GET      ``admin/users``         admin: list users
DELETE   ``admin/users/<name>``  admin: remove a user (revokes at once)
=======  ======================  =================================================================

**HTTPS pinned by the run id.** The server certificate is self-signed by the run's *authority key*, so a
client that knows the run id (``name@fingerprint``) accepts exactly the server whose certificate key has
that fingerprint — no CA, no hostname. An organizer may put a CA-signed proxy in front; the pin still holds
for direct connections.

**Join.** The volunteer proves it holds its identity key by signing :func:`join_payload` (run id, the
invite's hash, its peer id, a timestamp within ``MAX_CLOCK_SKEW``); the backbone redeems the invite and
returns an access token for that peer. A replayed join request yields a token only its key holder can use.
**Refresh** is the same with the current (possibly expired for up to a day) token instead of an invite.

**Access** (the endpoints marked so above: a run's data and its ledger are for its members only): the
request carries ``Authorization: Dedloc <encode_api_credential(...)>``, an :class:`ApiCredential`: the
volunteer's access token, a timestamp and its identity key's signature over :func:`api_request_payload`
(run id, method, the path below ``/v1/runs/<run-id>/``, timestamp). The backbone answers 401 unless the
token verifies, is this run's and unexpired, the timestamp is within ``MAX_CLOCK_SKEW``, the signature
verifies with the token's key, and the token's user is still allowed. The admin token
(``Authorization: Bearer <admin token>``) is accepted too. A token alone is not enough: tokens travel
in every RPC to other peers, so any peer could replay one; the signature proves the key.

**Sessions.** Each volunteer process draws a random session token (:data:`SESSION_TOKEN_PATTERN`) and
sends a heartbeat at least every ``SessionState.timeout_s / 4`` seconds; the token and the event are in
the path, so the access credential's signature covers them (no body). A session silent for
``timeout_s`` is closed by the backbone at its last heartbeat; a new token of the same peer (a restart)
closes the peer's older open session. An older backbone answers 404 here: the volunteer carries on.

**Rate limits**: ``join``, ``refresh``, ``reports``, ``capabilities`` and ``evaluations`` answer 429
``rate_limited`` past a per-address budget and a per-peer (or per-invite) budget, before any database work.

**Invite codes** are ``dli1_`` + base64url(msgpack(:class:`Invite`)): the pinned run id, the API URLs,
and the one-time-shown secret. One code serves every machine of its user until it is revoked or expires,
or (``backbone allow add --max-uses N``) until N machines joined with it. The run id pins the run:
``volunteer join --invite CODE`` needs no other; a join answered 403 ``invite_rejected`` carries what
happened to the invite as its message (``"the invite has expired"``).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Annotated

import msgspec

from .auth import SignedRevocation, SignedToken
from .training import TrainingSpec
from .types import Bytes32, Bytes64, MultiaddrStr, PeerIdStr, RunIdStr

__all__ = [
    "ACCESS_SCHEME",
    "MAX_BODY_BYTES",
    "MAX_CREDENTIAL_CHARS",
    "ApiCredential",
    "ApiError",
    "Invite",
    "JoinRequest",
    "JoinResponse",
    "Manifest",
    "RefreshRequest",
    "RefreshResponse",
    "ReportReceipt",
    "RevocationList",
    "SESSION_TOKEN_PATTERN",
    "SessionState",
    "SHARD_NAME_PATTERN",
    "ShardInfo",
    "ShardList",
    "Username",
    "api_request_payload",
    "decode_api_credential",
    "decode_invite",
    "encode_api_credential",
    "encode_invite",
    "join_payload",
    "refresh_payload",
]

MAX_BODY_BYTES = 64 * 1024
ACCESS_SCHEME = "Dedloc"
MAX_CREDENTIAL_CHARS = 4096
_INVITE_PREFIX = "dli1_"
UrlStr = Annotated[str, msgspec.Meta(min_length=8, max_length=256, pattern=r"^https?://")]
Username = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._@+-]+$")]


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run_id: RunIdStr
    authority_public_key: Bytes32
    backbones: Annotated[list[MultiaddrStr], msgspec.Meta(max_length=64)] = []
    api: Annotated[list[UrlStr], msgspec.Meta(max_length=16)] = []
    training: TrainingSpec | None = None  # what the run trains (``backbone start --manifest FILE``)


class Invite(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    run_id: RunIdStr
    api: Annotated[list[UrlStr], msgspec.Meta(min_length=1, max_length=8)]
    secret: Annotated[str, msgspec.Meta(min_length=16, max_length=128)]


class JoinRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run_id: RunIdStr
    invite_secret: Annotated[str, msgspec.Meta(min_length=16, max_length=128)]
    peer_id: PeerIdStr
    public_key: Bytes32
    timestamp: float
    signature: Bytes64


class JoinResponse(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    username: Username
    token: SignedToken
    manifest: Manifest


class RefreshRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    run_id: RunIdStr
    token: SignedToken
    timestamp: float
    signature: Bytes64


class RefreshResponse(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token: SignedToken


class RevocationList(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    revocations: list[SignedRevocation]


SHARD_NAME_PATTERN = r"^[A-Za-z0-9._-]+$"


class ShardInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One dataset shard a backbone serves: ``nbytes`` bytes whose SHA-256 is ``sha256`` (hex)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=SHARD_NAME_PATTERN)]
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
    sha256: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class ShardList(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    shards: Annotated[list[ShardInfo], msgspec.Meta(max_length=100_000)]


class ReportReceipt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    recorded: bool  # False: this (peer, seq) was recorded before — nothing changed
    credited: bool  # False: flagged (``reason`` names the broken bounds); True: within bounds
    reason: str | None = None
    samples: float = 0.0  # what the ledger credited now (receipt-backed; see backbone.ledger.accounting)
    notes: str | None = None  # receipts / pull records that did not count, "code: n; ..."


SESSION_TOKEN_PATTERN = r"^[0-9a-f]{32}$"


class SessionState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The backbone's answer to a session heartbeat or leave."""

    open: bool  # False: the session has ended (left, or replaced by a newer process of the peer)
    timeout_s: float  # a session silent this long is closed: send heartbeats well within it


class ApiCredential(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A member's proof for an access-only endpoint (see **Access** above)."""

    token: SignedToken
    timestamp: float
    signature: Bytes64


def api_request_payload(run_id: str, method: str, path: str, timestamp: float) -> bytes:
    """What an :class:`ApiCredential` signs; ``path`` is below ``/v1/runs/<run-id>/`` (``shards/a.jsonl``)."""
    return b"dedloc-api-v1" + msgspec.msgpack.encode((run_id, method.upper(), path, timestamp))


def encode_api_credential(credential: ApiCredential) -> str:
    return base64.urlsafe_b64encode(msgspec.msgpack.encode(credential)).decode("ascii").rstrip("=")


def decode_api_credential(text: str) -> ApiCredential:
    """Raises ValueError for anything that is not a well-formed credential (its checks are the server's)."""
    if len(text) > MAX_CREDENTIAL_CHARS or not text.isascii():
        raise ValueError("not an access credential")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        return msgspec.msgpack.decode(raw, type=ApiCredential)
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise ValueError(f"access credential is damaged: {exc}") from exc


class ApiError(msgspec.Struct, frozen=True):
    error: str
    message: str


def join_payload(run_id: str, invite_secret: str, peer_id: str, timestamp: float) -> bytes:
    digest = hashlib.sha256(invite_secret.encode()).digest()
    return b"dedloc-join-v1" + msgspec.msgpack.encode((run_id, digest, peer_id, timestamp))


def refresh_payload(run_id: str, token: SignedToken, timestamp: float) -> bytes:
    return b"dedloc-refresh-v1" + msgspec.msgpack.encode((run_id, token.token, token.signature, timestamp))


def encode_invite(invite: Invite) -> str:
    raw = msgspec.msgpack.encode(invite)
    return _INVITE_PREFIX + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_invite(code: str) -> Invite:
    """Raises ValueError for anything that is not a well-formed invite code; its message says what is
    wrong in words for the person who pasted it (no decoder's internals)."""
    code = code.strip()
    if not code.startswith(_INVITE_PREFIX):
        raise ValueError(f"invite codes start with {_INVITE_PREFIX!r}")
    if len(code) > 2048:
        raise ValueError(f"it is {len(code)} characters long; invite codes are shorter")
    body = code[len(_INVITE_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        return msgspec.msgpack.decode(raw, type=Invite)
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise ValueError("it is damaged or cut short: copy the whole code again") from exc
