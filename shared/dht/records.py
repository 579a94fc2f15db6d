"""Signed DHT records: signing, the newest-wins order, and validators (DESIGN D3).

Kademlia stores plain ``(key, value)`` pairs and lets the newest STORE win (Maymounkov & Mazières 2002,
§2.3 "To store a (key,value) pair…", §2.5 republishing). In an open swarm anyone can send a STORE, so
here every value is a :class:`~protocols.dht.SignedRecord`:

* the writer signs :func:`~protocols.dht.record_payload` (every field but the signature) with its
  Ed25519 key, and the public key is inside the writer's peer id, so any node can check the signature
  without a lookup (:class:`SignatureValidator`);
* each record expires at an absolute unix time; nodes refuse records already expired or expiring
  implausibly far ahead (:class:`ExpiryValidator`), which bounds how long a bad write can linger;
* of two records for the same ``(key, subkey)``, the one that expires later wins, ties broken by the
  larger signature (:func:`newer`); this is a total order on distinct records, so every node keeps the
  same winner whatever order the records arrived in;
* a writer writes only its own subkeys: a subkey is the writer's peer id, and keys whose dictionary
  holds per-peer entries (presence, progress, ...) take no plain record (:class:`SubkeyOwnerValidator`);
* in a pinned run the record carries the writer's access token, covered by the signature, and only
  admitted, unrevoked writers are accepted (:mod:`shared.dht.admission`, which has the rule per key).

Validators raise :class:`~shared.errors.RecordRejected` with the reason; :class:`CompositeValidator`
chains them, cheapest first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import msgspec

from protocols.auth import SignedToken
from protocols.dht import SignedRecord, record_payload

from ..auth.keys import Identity, verify_by_peer_id
from ..errors import RecordRejected
from .admission import TokenlessValidator
from .keys import ID_BYTES

__all__ = [
    "CompositeValidator",
    "ExpiryValidator",
    "RecordValidator",
    "SignatureValidator",
    "SubkeyOwnerValidator",
    "default_validator",
    "newer",
    "sign_record",
]

_SIGNATURE_BYTES = 64


def _describe(record: SignedRecord) -> str:
    subkey = "" if record.subkey is None else f" subkey {record.subkey[:32]!r}"
    return f"record for key {record.key.hex()}{subkey} by {record.writer}"


def sign_record(
    identity: Identity,
    key: bytes,
    value: bytes,
    expiration: float,
    subkey: bytes | None = None,
    token: SignedToken | None = None,
) -> SignedRecord:
    """Return a record of ``value`` under ``(key, subkey)`` signed by ``identity``.

    Args:
        identity: the writer; its peer id becomes ``record.writer``.
        key: the 20-byte key id (see :func:`shared.dht.keys.key_id`).
        value: the payload, at most 64 KiB.
        expiration: absolute unix time after which nodes drop the record.
        subkey: ``None`` for the key's plain value, else the entry of the key's dictionary.
        token: the writer's access token in a pinned run (carried in the record, covered by the signature).

    Raises:
        ValueError: a field violates the wire limits (key length, value or subkey size, expiration).
    """
    unsigned = SignedRecord(
        key=key,
        subkey=subkey,
        value=value,
        expiration=expiration,
        writer=identity.peer_id,
        signature=bytes(_SIGNATURE_BYTES),
        token=token,
    )
    try:  # reuse the wire constraints instead of restating them here
        msgspec.msgpack.decode(msgspec.msgpack.encode(unsigned), type=SignedRecord)
    except msgspec.ValidationError as exc:
        raise ValueError(f"cannot sign record: {exc}") from exc
    return msgspec.structs.replace(unsigned, signature=identity.sign(record_payload(unsigned)))


def newer(a: SignedRecord, b: SignedRecord) -> bool:
    """True if ``a`` supersedes ``b``: it expires later, or as late with a larger signature.

    Distinct records never tie (a signature covers the payload), so all nodes agree on the winner.
    """
    return (a.expiration, a.signature) > (b.expiration, b.signature)


class RecordValidator(Protocol):
    """Something that decides whether a node accepts a record."""

    def validate(self, record: SignedRecord, now: float) -> None:
        """Return if ``record`` is acceptable at ``now``.

        Raises:
            RecordRejected: the record is not acceptable; the message says why.
        """
        ...


class SignatureValidator:
    """Rejects records whose signature was not made by the key inside ``record.writer``."""

    def validate(self, record: SignedRecord, now: float) -> None:
        if not verify_by_peer_id(record.writer, record.signature, record_payload(record)):
            raise RecordRejected(f"bad signature on {_describe(record)}")


class ExpiryValidator:
    """Rejects records already expired at ``now`` or expiring too far ahead.

    Args:
        max_ttl: the longest lifetime a record may ask for, in seconds.
        max_clock_skew: how far the writer's clock may run ahead of ours, in seconds.

    Raises:
        ValueError: a limit is negative or not finite.
    """

    def __init__(self, max_ttl: float = 24 * 3600, max_clock_skew: float = 300) -> None:
        for name, limit in (("max_ttl", max_ttl), ("max_clock_skew", max_clock_skew)):
            if not 0 <= limit < float("inf"):
                raise ValueError(f"{name} must be a non-negative finite number of seconds, got {limit!r}")
        self.max_ttl = max_ttl
        self.max_clock_skew = max_clock_skew

    def validate(self, record: SignedRecord, now: float) -> None:
        if record.expiration <= now:
            raise RecordRejected(f"{_describe(record)} expired at {record.expiration} (now {now})")
        horizon = now + self.max_ttl + self.max_clock_skew
        if record.expiration > horizon:
            raise RecordRejected(
                f"{_describe(record)} has expiry in the far future: {record.expiration} > {horizon}"
            )


class SubkeyOwnerValidator:
    """A writer writes only its own subkeys (DESIGN D10b).

    Every record with a subkey must have its writer's peer id (ASCII bytes) as subkey, except under
    ``exempt_keys`` (the revocations key of a pinned run, whose subkeys are usernames and whose content
    another validator checks). Under ``per_peer_keys`` a plain record (no subkey) is refused too.

    Raises:
        ValueError: a key id is not 20 bytes.
    """

    def __init__(self, per_peer_keys: Iterable[bytes], exempt_keys: Iterable[bytes] = ()) -> None:
        self.key_ids = frozenset(bytes(key) for key in per_peer_keys)
        self.exempt_keys = frozenset(bytes(key) for key in exempt_keys)
        for key in self.key_ids | self.exempt_keys:
            if len(key) != ID_BYTES:
                raise ValueError(f"a key id has {ID_BYTES} bytes, got {len(key)}: {key!r}")

    def validate(self, record: SignedRecord, now: float) -> None:
        if record.key in self.exempt_keys:
            return
        if record.subkey is None:
            if record.key in self.key_ids:
                raise RecordRejected(f"{_describe(record)} needs the writer's peer id as subkey")
            return
        if record.subkey != record.writer.encode("utf-8"):
            raise RecordRejected(f"{_describe(record)}: only the peer named by the subkey may write it")


class CompositeValidator:
    """Applies validators in order; the first rejection wins (put cheap checks first)."""

    def __init__(self, validators: Iterable[RecordValidator]) -> None:
        self.validators = tuple(validators)

    def validate(self, record: SignedRecord, now: float) -> None:
        for validator in self.validators:
            validator.validate(record, now)


def default_validator() -> CompositeValidator:
    """Return the checks of a bare open-run node: expiry and no token (cheap), then signature."""
    return CompositeValidator([ExpiryValidator(), TokenlessValidator(), SignatureValidator()])
