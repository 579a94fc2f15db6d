"""Revocations in the DHT: authority-signed records that every node polls (see :mod:`protocols.auth`).

Key :data:`~protocols.auth.REVOCATIONS_KEY`, subkey = the revoked username (UTF-8), value =
msgpack(:class:`~protocols.auth.SignedRevocation`). Any admitted node may *carry* such a record (backbones
write them), but a node accepts it only if the authority signed it for this run and that username, so a
volunteer cannot revoke anyone, and nobody can un-revoke (newest-wins keeps the latest expiry of the same
authority statement).
"""

from __future__ import annotations

import msgspec

from protocols.auth import REVOCATIONS_KEY, SignedRevocation
from protocols.dht import SignedRecord
from protocols.errors import ProtocolError, decode_typed

from ..dht.keys import key_id
from ..errors import AuthError, RecordRejected
from .authority import AuthorityKey

__all__ = ["RevocationValidator", "decode_revocation"]

_DECODER = msgspec.msgpack.Decoder(SignedRevocation)


def decode_revocation(record: SignedRecord, run_id: str, authority: AuthorityKey) -> str:
    """The username a revocation record revokes.

    Raises:
        RecordRejected: not a valid authority revocation for this run and subkey.
    """
    try:
        signed = decode_typed(_DECODER, record.value, "revocation record")
        revocation = authority.verify_revocation(signed, run_id)
    except (ProtocolError, AuthError) as exc:
        raise RecordRejected(f"invalid revocation record: {exc}") from exc
    if record.subkey != revocation.username.encode():
        raise RecordRejected(f"revocation of {revocation.username!r} stored under another subkey")
    return revocation.username


class RevocationValidator:
    """DHT record validator: records under the revocations key must be authority revocations."""

    def __init__(self, run_id: str, authority: AuthorityKey) -> None:
        self._key = key_id(REVOCATIONS_KEY)
        self._run_id = run_id
        self._authority = authority

    def validate(self, record: SignedRecord, now: float) -> None:
        if record.key == self._key:
            decode_revocation(record, self._run_id, self._authority)
