"""A run's authority key: pins run ids, signs access tokens and revocations (DESIGN D4, D8).

The authority is an Ed25519 key in the backbone's data dir (``authority.key``, mode 0600). Several
backbones of one run share it: copy the file into each backbone's data dir (or point
``--authority-key`` at one copy) before the first start; a backbone started without it would create a
*different* authority, hence a different run id.

The public side, :class:`AuthorityKey`, is all a volunteer needs: it is built from the key that travels
with a manifest/token/mDNS answer and is accepted only if its fingerprint is the one in the run id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import msgspec

from protocols.auth import (
    AccessToken,
    Revocation,
    SignedRevocation,
    SignedToken,
    authority_fingerprint,
    revocation_payload,
    split_run_id,
    token_payload,
)
from protocols.codes import ErrorCode
from protocols.errors import DECODE_FAILURES

from ..errors import AuthError, ConfigError
from .keys import Identity, verify

__all__ = ["AUTHORITY_FILE", "Authority", "AuthorityKey", "pin_run_id"]

AUTHORITY_FILE = "authority.key"
_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,96}$")


@dataclass(frozen=True)
class AuthorityKey:
    """The public authority key of a run, checked against the run id's fingerprint."""

    public_key: bytes

    @property
    def fingerprint(self) -> str:
        return authority_fingerprint(self.public_key)

    @classmethod
    def for_run(cls, run_id: str, public_key: bytes) -> AuthorityKey:
        """Accept ``public_key`` as ``run_id``'s authority only if the run id pins it.

        Raises:
            AuthError: ``BAD_TOKEN`` — the run id is open or names another key.
        """
        _, fingerprint = split_run_id(run_id)
        key = cls(bytes(public_key))
        if fingerprint is None or len(public_key) != 32 or key.fingerprint != fingerprint:
            raise AuthError(
                ErrorCode.BAD_TOKEN, f"authority key {key.fingerprint} is not the one run {run_id} pins"
            )
        return key

    def verify_token(self, signed: SignedToken) -> AccessToken:
        """Decode ``signed`` and check the authority's signature (not expiry, run or peer: see tokens).

        Raises:
            AuthError: ``BAD_TOKEN``.
        """
        if not verify(self.public_key, signed.signature, token_payload(signed.token)):
            raise AuthError(ErrorCode.BAD_TOKEN, "access token not signed by this run's authority")
        try:
            return msgspec.msgpack.decode(signed.token, type=AccessToken)
        except DECODE_FAILURES as exc:
            raise AuthError(ErrorCode.BAD_TOKEN, f"malformed access token: {exc}") from exc

    def verify_revocation(self, signed: SignedRevocation, run_id: str) -> Revocation:
        """Decode a revocation and check it is the authority's, for ``run_id``.

        Raises:
            AuthError: ``BAD_TOKEN`` for a forged, foreign or malformed revocation.
        """
        if not verify(self.public_key, signed.signature, revocation_payload(signed.revocation)):
            raise AuthError(ErrorCode.BAD_TOKEN, "revocation not signed by this run's authority")
        try:
            revocation = msgspec.msgpack.decode(signed.revocation, type=Revocation)
        except DECODE_FAILURES as exc:
            raise AuthError(ErrorCode.BAD_TOKEN, f"malformed revocation: {exc}") from exc
        if revocation.run_id != run_id:
            raise AuthError(ErrorCode.WRONG_RUN_TOKEN, f"revocation for run {revocation.run_id}")
        return revocation


@dataclass(frozen=True)
class Authority:
    """The private authority of a run (backbones only)."""

    identity: Identity

    @classmethod
    def load_or_create(cls, path: Path) -> Authority:
        """Load the authority key file at ``path``, creating it (mode 0600) if missing."""
        return cls(Identity.load_or_create(path.parent, path.name))

    @property
    def key(self) -> AuthorityKey:
        return AuthorityKey(self.identity.public_key_bytes)

    @property
    def fingerprint(self) -> str:
        return self.key.fingerprint

    def issue_token(
        self, run_id: str, username: str, peer_id: str, public_key: bytes, now: float, lifetime: float
    ) -> SignedToken:
        token = AccessToken(
            run_id=run_id,
            username=username,
            peer_id=peer_id,
            public_key=public_key,
            issued_at=now,
            expires_at=now + lifetime,
        )
        body = msgspec.msgpack.encode(token)
        return SignedToken(token=body, signature=self.identity.sign(token_payload(body)))

    def revoke(self, run_id: str, username: str, now: float) -> SignedRevocation:
        body = msgspec.msgpack.encode(Revocation(run_id=run_id, username=username, revoked_at=now))
        return SignedRevocation(revocation=body, signature=self.identity.sign(revocation_payload(body)))


def pin_run_id(run_id: str, authority: Authority) -> str:
    """The pinned form ``name@fingerprint`` of ``run_id`` under ``authority``.

    Raises:
        ConfigError: the run id names another authority, or its name is invalid.
    """
    name, fingerprint = split_run_id(run_id)
    if fingerprint is not None and fingerprint != authority.fingerprint:
        raise ConfigError(
            f"run id {run_id} pins authority {fingerprint}, but this backbone's authority key is "
            f"{authority.fingerprint}; copy the run's authority.key into the data dir"
        )
    if not _NAME.match(name):
        raise ConfigError(f"run name {name!r} is invalid: use 1-96 letters, digits and . _ : -")
    return f"{name}@{authority.fingerprint}"
