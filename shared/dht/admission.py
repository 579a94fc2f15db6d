"""Who may write to the DHT: admitted, unrevoked writers, each only under its own subkeys (DESIGN D3, D10b).

**The problem.** The RPC guard (``shared.auth.guard``) proves who *sends* a STORE, but Kademlia records
travel: nodes re-store what they hold when they leave (hand-off), writers re-publish, lookups return
records that third parties stored. So the sender of a STORE is often not the writer of its records, and
checking the caller's token says nothing about the writer. A storing node (or a reader) must be able to
decide from the record alone, with no lookup, whether its writer was admitted.

**The rule (pinned runs).** A record carries its writer's access token
(:attr:`protocols.dht.SignedRecord.token`, the ``SignedToken`` the authority issued, ≤ 1,088 bytes), and
the writer's record signature covers it. :class:`AdmissionValidator` accepts a record only if

1. the token verifies under the run's authority key (verified tokens are cached by their bytes, so a
   writer's thousand records cost one authority-signature check);
2. the token is for this run, and its peer id is the record's writer (so a token cannot be lent: the
   record signature is checked against the writer's key by :class:`~shared.dht.records.SignatureValidator`);
3. the token's user is not revoked (the node's live revocation set, the same set the RPC guard uses;
   when a user is revoked the node also drops the user's stored records, see ``shared.node``);
4. the token had not expired when the record could have been written: ``now < expires_at``, or else
   ``record.expiration <= expires_at + token_grace``. A record written while its token was valid with a
   lifetime of at most ``token_grace`` passes this test until it expires; a writer whose token lapsed can
   write new records for at most ``token_grace`` seconds past expiry (revocation, not expiry, is what cuts
   a bad user off at once). ``token_grace`` (1 h) exceeds every TTL the system uses except revocations
   (presence 60 s, progress 30 s, state 60 s, capabilities 900 s, matchmaking ~10 min); honest writers
   refresh their token at 2/3 of its 6 h life and sign new records with the fresh one, and re-sign their
   own records with the current token when they re-publish them.

**Revocations are always accepted.** Records under :data:`~protocols.auth.REVOCATIONS_KEY` are
self-authenticating: the value must be an authority-signed :class:`~protocols.auth.SignedRevocation` of
this run, stored under the revoked username as subkey. Such a record is accepted whoever carries it and
whatever the carrier's token says (a backbone whose own token lapsed still spreads revocations), storage
exempts it from every quota (only the authority can make one, so their number is bounded by the
authority), and anything else under that key is refused.

**Own subkeys only** (:class:`~shared.dht.records.SubkeyOwnerValidator`, open and pinned runs). A subkey
is the writer's peer id (UTF-8), except under the revocations key (pinned runs). The keys in use:

=========================  ==============================================================================
``run.presence``           per peer: subkey = writer's peer id, a plain record refused
``train.progress``         per peer: subkey = writer's peer id, a plain record refused
``train.state``            per peer (state announcements): subkey = writer's peer id, a plain record refused
``train.capabilities``     per peer: subkey = writer's peer id, a plain record refused
``run.revocations``        subkey = revoked username, value = authority revocation, any carrier
``avg.<round>.<group>``    matchmaking tickets: subkey = writer's peer id
``avg.<...>.plan``         the leader's plan: subkey = the leader's peer id (per-writer, like tickets)
anything else              a subkey, if any, is the writer's peer id; a plain record is allowed
=========================  ==============================================================================

A plain record (``subkey`` ``None``) has no owner: any admitted writer may supersede it with a later
expiry, so readers must check its writer (matchmaking does) and a key whose value matters should be
written under the writer's own subkey instead.

**Identity for majorities.** Readers that count votes (state announcements, parameter fingerprints) must
count distinct *users*, not peer ids: one user may hold several admitted peer ids (devices), and in an
open run identities are free. :func:`record_user` gives the user of a validated record — the username of
its token in a pinned run, the writer's peer id in an open run (every peer its own user; open runs refuse
records that carry a token they cannot check, see :class:`TokenlessValidator`). ``DHTValue.users``
(``shared.dht.node``) exposes it for the records a lookup returns.

**Open runs** (no authority) keep their behaviour: signature, expiry and own-subkey checks only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

import msgspec

from protocols.auth import REVOCATIONS_KEY, AccessToken, SignedRevocation, SignedToken
from protocols.dht import SignedRecord
from protocols.errors import DECODE_FAILURES

from ..auth.authority import AuthorityKey
from ..errors import AuthError, RecordRejected
from .keys import key_id

_REVOCATION_FAILURES: tuple[type[Exception], ...] = (AuthError, *DECODE_FAILURES)

__all__ = ["TOKEN_GRACE", "AdmissionValidator", "TokenlessValidator", "record_user"]

TOKEN_GRACE = 3600.0
_TOKEN_CACHE = 4096
_ACCESS = msgspec.msgpack.Decoder(AccessToken)
_REVOCATION = msgspec.msgpack.Decoder(SignedRevocation)


def _describe(record: SignedRecord) -> str:
    subkey = "" if record.subkey is None else f" subkey {record.subkey[:32]!r}"
    return f"record for key {record.key.hex()}{subkey} by {record.writer}"


def record_user(record: SignedRecord) -> str:
    """The user a *validated* record speaks for: its token's username, else its writer's peer id.

    Only meaningful for records that passed this node's validator (which verified the token in a pinned
    run, and refused tokens in an open run).
    """
    if record.token is not None:
        try:
            return _ACCESS.decode(record.token.token).username
        except DECODE_FAILURES:  # includes validation errors; a validated record never gets here
            pass
    return record.writer


class TokenlessValidator:
    """Open runs: refuses records that carry a token (nobody here can check it, so it must not count)."""

    def validate(self, record: SignedRecord, now: float) -> None:
        if record.token is not None:
            raise RecordRejected(f"{_describe(record)} carries an access token in an open run")


class AdmissionValidator:
    """Pinned runs: accepts records of admitted, unrevoked writers and authority revocations only.

    Args:
        run_id: the pinned run id tokens and revocations must name.
        authority: the run's authority key.
        revoked: the live set of revoked usernames (shared with the RPC guard; read at each check).
        token_grace: how long past its token's expiry a record may still expire (module docstring, rule 4).

    Raises:
        ValueError: ``token_grace`` is negative or not finite.
    """

    def __init__(
        self,
        run_id: str,
        authority: AuthorityKey,
        revoked: Collection[str],
        *,
        token_grace: float = TOKEN_GRACE,
    ) -> None:
        if not 0 <= token_grace < float("inf"):
            raise ValueError(
                f"token_grace must be a non-negative finite number of seconds, got {token_grace!r}"
            )
        self.run_id = run_id
        self.authority = authority
        self.revoked = revoked
        self.token_grace = token_grace
        self.revocations_key = key_id(REVOCATIONS_KEY)
        self._verified: OrderedDict[bytes, AccessToken] = OrderedDict()

    def validate(self, record: SignedRecord, now: float) -> None:
        if record.key == self.revocations_key:
            self._check_revocation(record)
            return
        if record.token is None:
            raise RecordRejected(f"{_describe(record)}: writer not admitted (the record carries no token)")
        access = self._access(record.token, record)
        if access.run_id != self.run_id:
            raise RecordRejected(f"{_describe(record)}: token of run {access.run_id}, not {self.run_id}")
        if access.peer_id != record.writer:
            raise RecordRejected(f"{_describe(record)}: token of peer {access.peer_id}, not of its writer")
        if access.username in self.revoked:
            # No name: nodes log rejected records, and who was removed is the organizers' business.
            raise RecordRejected(f"{_describe(record)}: its writer's user has been removed from the run")
        if now >= access.expires_at and record.expiration > access.expires_at + self.token_grace:
            raise RecordRejected(
                f"{_describe(record)}: its writer's token expired at {access.expires_at:.0f}, "
                f"too long before the record's expiry {record.expiration:.0f} "
                f"(grace {self.token_grace:.0f} s)"
            )

    def _access(self, signed: SignedToken, record: SignedRecord) -> AccessToken:
        cache_key = signed.token + signed.signature
        access = self._verified.get(cache_key)
        if access is not None:
            self._verified.move_to_end(cache_key)
            return access
        try:
            access = self.authority.verify_token(signed)
        except AuthError as exc:
            raise RecordRejected(f"{_describe(record)}: writer not admitted: {exc}") from exc
        self._verified[cache_key] = access
        if len(self._verified) > _TOKEN_CACHE:
            self._verified.popitem(last=False)
        return access

    def _check_revocation(self, record: SignedRecord) -> None:
        try:
            revocation = self.authority.verify_revocation(_REVOCATION.decode(record.value), self.run_id)
        except _REVOCATION_FAILURES as exc:
            raise RecordRejected(f"{_describe(record)}: not an authority revocation: {exc}") from exc
        if record.subkey != revocation.username.encode():
            raise RecordRejected(f"revocation of {revocation.username!r} stored under another subkey")
