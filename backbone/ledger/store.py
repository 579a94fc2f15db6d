"""The ledger's only SQL I/O: allowlist, peers and sessions, contribution reports, steps, leaderboard.

Crediting follows :mod:`backbone.ledger.accounting` (its docstring is the design): :meth:`LedgerStore.
assess_and_record` judges a report's bounds, stores its receipts (once per ``(sender, step)``), pull
records, relay records (once per ``(reporter, seq, relay)``) and swarm received records (once per
``(reporter, seq, server)``), and credits it the increase of
``min(claims, evidence)``, all in one transaction under the reporting peer's row lock, so two backbones on
one database cannot credit one receipt twice. A discard (``step_discards``) covers only the receipts of
its steps that the peer's reports up to the discarding one (by ``seq``) carried; a receipt of a later
report replaces a discarded receipt of its step (the step taken again after re-syncing) instead of being a
duplicate. A stage discard (``stage_discards``, swarm runs) does the same per stage, for the peer's stage
receipts and trainer's receipts.

:class:`LedgerStore` is synchronous and thread-safe (one engine and its connection pool). The trio side
calls it through ``trio.to_thread.run_sync(store.method, ..., limiter=DB_WRITE)`` with one
``DB_WRITE = trio.CapacityLimiter(1)`` for all writes (SQLite has one writer at a time anyway, and a
queue of waiting threads helps nobody); reads may use another limiter. Nothing here imports trio.

Databases (:meth:`LedgerStore.open`):

* ``sqlite:///PATH`` — the embedded default (the parent directory is created). WAL journal, so readers
  never block the writer; ``synchronous=NORMAL``, which in WAL mode loses no committed transaction when
  the *process* dies (kill -9), only possibly the last ones on power loss or an OS crash; foreign keys on.
  Writes begin with ``BEGIN IMMEDIATE`` so concurrent writers (threads, or ``backbone allow add`` next
  to a running backbone) queue on the lock for up to 30 s instead of failing half-way.
* ``postgresql+psycopg://USER[:PASSWORD]@HOST[:PORT]/DB`` (``postgresql://`` means the same) for
  organizers who outgrow one machine; several backbones may share one database.

Every write method runs in its own transaction and has committed when it returns. Exactly-once crediting
rests on the ``UNIQUE(peer_id, seq)`` constraint of ``reports``: a second insert of the same key fails
inside the database, whatever thread or process attempts it, and is answered ``False``/``None`` with
nothing changed. Database failures surface as :class:`~backbone.ledger.errors.LedgerError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import secrets
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast

import msgspec
from sqlalchemy import (
    URL,
    ColumnElement,
    Connection,
    Double,
    Engine,
    case,
    create_engine,
    event,
    func,
    insert,
    make_url,
    or_,
    select,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, SQLAlchemyError

from protocols.evaluation import Evaluation, SignedEvaluation
from protocols.ledger import Capabilities, ContributionReport, SignedReport
from protocols.peer_id import peer_id_from_public_key
from protocols.receipts import MAX_STAGES, PartReceipt
from shared.errors import ConfigError

from .accounting import (
    Assessment,
    Credit,
    assess,
    cap_capabilities,
    check_capabilities,
    credit_due,
    reason_codes,
    received_evidence,
    relay_evidence,
    split_receipts,
)
from .errors import InviteRejected, LedgerError, UnknownPeer, UnknownUser
from .evaluations import Claim, StepEvaluation, summarize
from .schema import (
    Discard,
    EvaluationRecord,
    Invite,
    Peer,
    PeerSession,
    Pull,
    Receipt,
    Relayed,
    Report,
    StageDiscard,
    StageReceipt,
    StageStep,
    Step,
    SwarmReceived,
    TrainerReceipt,
    User,
    create_schema,
)
from .views import (
    FlaggedReport,
    LeaderboardRow,
    PeerSeen,
    ReportStatus,
    SessionRow,
    StepRow,
    StoredReport,
    UserSummary,
    Verdict,
)

__all__ = ["BACKBONE_USERNAME", "MAX_INVITE_USES", "RESERVED_USERNAMES", "LedgerStore"]

T = TypeVar("T")

_SQLITE_BUSY_TIMEOUT_S = 30.0
_MAX_USERNAME = 64
#: The username in the access tokens backbones issue themselves: a user of that name would share the
#: backbones' fate (removing it revokes every backbone's token and cuts every volunteer off).
BACKBONE_USERNAME = "backbone"
#: Names no user may have (compared case-insensitively).
RESERVED_USERNAMES = frozenset({BACKBONE_USERNAME})
_MAX_NOTE = 1024
_MAX_ADDRESS = 256
_MAX_TOKEN = 64
_MAX_SECRET = 256
_INVITE_BYTES = 32
MAX_INVITE_USES = 1_000_000
_WRITE_OPTION = "dedloc_ledger_write"
_REPORT_DECODER = msgspec.msgpack.Decoder(ContributionReport)


class _Conflict(LedgerError):
    """A uniqueness or foreign-key constraint refused a write (handled inside this module)."""


class LedgerStore:
    """Allowlist, peers, sessions, reports and steps in one SQL database. Build with :meth:`open`."""

    def __init__(self, engine: Engine, name: str) -> None:
        self._engine = engine
        self._writer = engine.execution_options(**{_WRITE_OPTION: True})
        self._name = name
        self._closed = False

    @classmethod
    def open(cls, url: str) -> LedgerStore:
        """Connect to the database at ``url`` and create or upgrade its schema.

        Raises:
            ConfigError: ``url`` is not a supported database URL.
            LedgerError: the database cannot be reached or has a newer schema.
        """
        parsed = _parse_url(url)
        name = parsed.render_as_string(hide_password=True)
        if parsed.get_backend_name() == "sqlite":
            assert parsed.database is not None  # _parse_url refused in-memory databases
            try:
                _private_sqlite_file(Path(parsed.database))
            except OSError as exc:
                raise ConfigError(f"cannot create the directory of {parsed.database}: {exc}") from exc
            engine = create_engine(parsed, connect_args={"timeout": _SQLITE_BUSY_TIMEOUT_S})
            event.listen(engine, "connect", _sqlite_on_connect)
            event.listen(engine, "begin", _sqlite_on_begin)
        else:
            engine = create_engine(parsed, pool_pre_ping=True)
        store = cls(engine, name)
        opened = False
        try:
            with store._tx(write=True) as conn:
                create_schema(conn)
            opened = True
        finally:
            if not opened:
                store.close()
        return store

    def close(self) -> None:
        """Close every pooled connection; the store cannot be used afterwards. Idempotent."""
        self._closed = True
        self._engine.dispose()

    def __enter__(self) -> LedgerStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._engine.dialect.name

    # ---------------------------------------------------------------- allowlist

    def add_user(self, username: str, *, note: str | None = None, now: float) -> None:
        """Allow ``username``. Adding an active user again changes only its note (if given); adding a
        revoked user un-revokes it (its old invites stay revoked, its peers are its peers again).

        Raises:
            ConfigError: ``username`` is not 1-64 printable characters without surrounding spaces, or
                ``note`` is longer than 1024 characters.
        """
        _check_username(username)
        if note is not None and len(note) > _MAX_NOTE:
            raise ConfigError(f"a note has at most {_MAX_NOTE} characters, got {len(note)}")

        def body(conn: Connection) -> None:
            row = conn.execute(select(User.id).where(User.username == username)).one_or_none()
            if row is None:
                conn.execute(insert(User).values(username=username, note=note, created_at=now))
                return
            values: dict[str, Any] = {"revoked_at": None}
            if note is not None:
                values["note"] = note
            conn.execute(update(User).where(User.id == row.id).values(values))

        self._write_retrying(body)

    def create_invite(
        self, username: str, *, now: float, expires_at: float | None = None, max_uses: int | None = None
    ) -> str:
        """Create an invite code for ``username`` and return its secret (43 URL-safe characters).

        Only sha256(secret) is stored: show the secret to the organizer once; it cannot be recovered.
        Every machine that redeems it becomes another peer of the user, until the invite or the user is
        revoked, ``expires_at`` passes, or ``max_uses`` machines (None: no limit) have joined with it.

        Raises:
            UnknownUser: no such user, or it is revoked.
            ConfigError: ``expires_at`` is not after ``now``, or ``max_uses`` is below 1.
        """
        if expires_at is not None and not expires_at > now:
            raise ConfigError(f"an invite must expire in the future, got {expires_at} <= now {now}")
        if max_uses is not None and not 1 <= max_uses <= MAX_INVITE_USES:
            raise ConfigError(f"an invite's maximum number of uses is 1 to {MAX_INVITE_USES}, got {max_uses}")
        secret = secrets.token_urlsafe(_INVITE_BYTES)
        with self._tx(write=True) as conn:
            row = conn.execute(
                select(User.id, User.revoked_at).where(User.username == username)
            ).one_or_none()
            if row is None:
                raise UnknownUser(f"no user {username!r}; add it first")
            if row.revoked_at is not None:
                raise UnknownUser(f"user {username!r} is revoked; add it again first")
            conn.execute(
                insert(Invite).values(
                    user_id=row.id,
                    code_hash=_hash_secret(secret),
                    created_at=now,
                    expires_at=expires_at,
                    uses=0,
                    max_uses=max_uses,
                )
            )
        return secret

    def redeem_invite(self, secret: str, peer_id: str, public_key: bytes, *, now: float) -> str:
        """Admit machine ``peer_id`` under the invite's user and return the username.

        The caller must have checked that the joining machine holds the key of ``peer_id``. Redeeming
        again from the same machine only refreshes it; a machine that redeems another user's invite
        moves to that user (reports already recorded stay credited to the user of their time).

        **Uses.** A machine that is not a peer of the invite's user yet *uses* the invite; one that is
        (it joins again: a restart with ``VOLUNTEER_INVITE`` set, a lost credential) does not. With
        ``max_uses`` set, the use is taken by one statement, ``UPDATE invites SET uses = uses + 1 WHERE
        id = ? AND uses < max_uses``, in the transaction that admits the machine. Two joins racing for
        the last use therefore admit one: on SQLite the write transactions run one at a time (``BEGIN
        IMMEDIATE``); on PostgreSQL (READ COMMITTED, several backbones on one database) the second
        UPDATE waits for the first one's row lock and then re-evaluates its WHERE on the committed row,
        so it matches nothing. A machine refused that way that has meanwhile become the user's peer (the
        same machine joining twice at once) is a re-join, not a refusal.

        Raises:
            InviteRejected: reason ``'unknown'``, ``'revoked user'``, ``'revoked invite'``, ``'expired'``
                or ``'used up'`` (checked in that order).
            ValueError: ``public_key`` is not the Ed25519 key inside ``peer_id``.
        """
        if peer_id_from_public_key(public_key) != peer_id:
            raise ValueError(f"public key does not belong to peer {peer_id}")
        secret = secret.strip()
        if len(secret) > _MAX_SECRET:
            raise InviteRejected("unknown")
        code_hash = _hash_secret(secret)

        def user_of(conn: Connection) -> int | None:
            return conn.execute(select(Peer.user_id).where(Peer.peer_id == peer_id)).scalar_one_or_none()

        def body(conn: Connection) -> str:
            row = conn.execute(
                select(
                    Invite.id,
                    Invite.expires_at,
                    Invite.revoked_at,
                    Invite.max_uses,
                    User.id.label("user_id"),
                    User.username,
                    User.revoked_at.label("user_revoked_at"),
                )
                .join(User, Invite.user_id == User.id)
                .where(Invite.code_hash == code_hash)
            ).one_or_none()
            if row is None:
                raise InviteRejected("unknown")
            if row.user_revoked_at is not None:
                raise InviteRejected("revoked user")
            if row.revoked_at is not None:
                raise InviteRejected("revoked invite")
            if row.expires_at is not None and now >= row.expires_at:
                raise InviteRejected("expired")
            owner = user_of(conn)
            if owner != row.user_id:
                used = conn.execute(
                    update(Invite)
                    .where(
                        Invite.id == row.id,
                        or_(Invite.max_uses.is_(None), Invite.uses < Invite.max_uses),
                    )
                    .values(uses=Invite.uses + 1)
                )
                if used.rowcount != 1:
                    owner = user_of(conn)  # a fresh snapshot: a concurrent join of this machine won?
                    if owner != row.user_id:
                        raise InviteRejected("used up")
            if owner is None:
                conn.execute(
                    insert(Peer).values(
                        peer_id=peer_id,
                        user_id=row.user_id,
                        public_key=public_key,
                        first_seen=now,
                        last_seen=now,
                    )
                )
            else:
                conn.execute(
                    update(Peer)
                    .where(Peer.peer_id == peer_id)
                    .values(user_id=row.user_id, public_key=public_key, last_seen=_seen(now))
                )
            return str(row.username)

        return self._write_retrying(body)

    def register_backbone(self, peer_id: str, public_key: bytes, *, now: float) -> None:
        """Know ``peer_id`` as one of the run's backbones: a peer of the reserved user
        :data:`BACKBONE_USERNAME` (created here; nobody can be invited under that name). A backbone that
        aggregates (:mod:`backbone.aggregator`) signs part receipts, and a receipt counts only when its
        aggregator is a known peer of another user than its sender (:mod:`backbone.ledger.accounting`):
        without this, volunteers that all run in client mode, averaging through a backbone, would be
        credited nothing. Idempotent; ``backbone allow list`` does not show the reserved user."""

        def body(conn: Connection) -> None:
            row = conn.execute(select(User.id).where(User.username == BACKBONE_USERNAME)).one_or_none()
            if row is None:
                note = "the run's backbones"
                conn.execute(insert(User).values(username=BACKBONE_USERNAME, note=note, created_at=now))
                row = conn.execute(select(User.id).where(User.username == BACKBONE_USERNAME)).one()
            peer = conn.execute(select(Peer.user_id).where(Peer.peer_id == peer_id)).one_or_none()
            if peer is None:
                conn.execute(
                    insert(Peer).values(
                        peer_id=peer_id, user_id=row.id, public_key=public_key, first_seen=now, last_seen=now
                    )
                )
            elif peer.user_id != row.id:
                raise ConfigError(f"peer {peer_id} is already a peer of another user in this ledger")

        self._write_retrying(body)

    def remove_user(self, username: str, *, now: float) -> bool:
        """Revoke ``username`` and all its invites at ``now``.

        Returns:
            True if an active user was revoked; False if there is no such user or it was revoked already.
        """
        with self._tx(write=True) as conn:
            row = conn.execute(
                select(User.id, User.revoked_at).where(User.username == username)
            ).one_or_none()
            if row is None or row.revoked_at is not None:
                return False
            conn.execute(update(User).where(User.id == row.id).values(revoked_at=now))
            conn.execute(
                update(Invite)
                .where(Invite.user_id == row.id, Invite.revoked_at.is_(None))
                .values(revoked_at=now)
            )
            return True

    def revoked_users(self) -> list[tuple[str, float]]:
        """``(username, revoked_at)`` of every revoked user, by username."""
        with self._tx(write=False) as conn:
            rows = conn.execute(
                select(User.username, User.revoked_at)
                .where(User.revoked_at.is_not(None))
                .order_by(User.username)
            ).all()
        return [(row.username, cast(float, row.revoked_at)) for row in rows]

    def user_of_peer(self, peer_id: str) -> str | None:
        """The user ``peer_id`` belongs to, *revoked or not* (use :meth:`active_user_of_peer` to admit)."""
        with self._tx(write=False) as conn:
            return conn.execute(
                select(User.username).join(Peer, Peer.user_id == User.id).where(Peer.peer_id == peer_id)
            ).scalar_one_or_none()

    def active_user_of_peer(self, peer_id: str) -> str | None:
        """The user ``peer_id`` belongs to if that user is not revoked, else None: the admission check."""
        with self._tx(write=False) as conn:
            return conn.execute(
                select(User.username)
                .join(Peer, Peer.user_id == User.id)
                .where(Peer.peer_id == peer_id, User.revoked_at.is_(None))
            ).scalar_one_or_none()

    def list_users(self) -> list[UserSummary]:
        """Every user (revoked ones too) by username, with its peers and when each was last seen."""
        with self._tx(write=False) as conn:
            users = conn.execute(
                select(User.id, User.username, User.note, User.created_at, User.revoked_at)
                .where(User.username.not_in(sorted(RESERVED_USERNAMES)))  # the backbones: not invited
                .order_by(User.username)
            ).all()
            peers = conn.execute(
                select(Peer.user_id, Peer.peer_id, Peer.last_seen).order_by(
                    Peer.last_seen.desc(), Peer.peer_id
                )
            ).all()
        by_user: dict[int, list[PeerSeen]] = {}
        for peer in peers:
            by_user.setdefault(peer.user_id, []).append(PeerSeen(peer.peer_id, peer.last_seen))
        return [
            UserSummary(u.username, u.note, u.created_at, u.revoked_at, tuple(by_user.get(u.id, ())))
            for u in users
        ]

    # ------------------------------------------------------------ peers, sessions

    def update_capabilities(self, peer_id: str, capabilities: Capabilities, *, now: float) -> Capabilities:
        """Store what ``peer_id`` measured about itself, bounded by what it was seen to do
        (:func:`~backbone.ledger.accounting.cap_capabilities`); returns what is stored.

        Raises:
            CapabilitiesRejected: beyond the sane ceilings (accounting.check_capabilities).
            UnknownPeer: ``peer_id`` never redeemed an invite.
        """
        check_capabilities(capabilities)
        with self._tx(write=True) as conn:
            if _load_peer(conn, peer_id, for_update=True) is None:
                raise UnknownPeer(f"unknown peer {peer_id}")
            credited, compute = conn.execute(
                select(
                    func.coalesce(func.sum(Report.credited_samples), 0.0),
                    func.coalesce(func.sum(Report.compute_seconds), 0.0),
                ).where(Report.peer_id == peer_id, Report.status == "credited", Report.scheme == 2)
            ).one()
            held = cap_capabilities(capabilities, float(credited), float(compute))
            conn.execute(
                update(Peer)
                .where(Peer.peer_id == peer_id)
                .values(
                    device=held.device,
                    samples_per_second=held.samples_per_second,
                    upload_bps=held.upload_bps,
                    download_bps=held.download_bps,
                    last_seen=_seen(now),
                )
            )
        return held

    def capabilities(self, peer_id: str) -> Capabilities | None:
        """The capabilities ``peer_id`` last reported, or None if none (or no such peer)."""
        with self._tx(write=False) as conn:
            peer = _load_peer(conn, peer_id, for_update=False)
        return None if peer is None else peer.capabilities

    def open_session(self, peer_id: str, address: str, *, now: float) -> int:
        """Record a session of ``peer_id`` from ``address`` without a token (schema version 2's join-time
        session; volunteers now open theirs with :meth:`session_heartbeat`); returns its id for
        :meth:`close_session`.

        Raises:
            UnknownPeer: ``peer_id`` never redeemed an invite.
            ConfigError: ``address`` is longer than 256 characters.
        """
        _check_address(address)
        with self._tx(write=True) as conn:
            if not _touch(conn, peer_id, now):
                raise UnknownPeer(f"unknown peer {peer_id}")
            result = conn.execute(
                insert(PeerSession).values(peer_id=peer_id, started_at=now, last_seen_at=now, address=address)
            )
            key = result.inserted_primary_key
            assert key is not None  # a single-row INSERT always has one
            return int(key[0])

    def close_session(self, session_id: int, *, now: float) -> None:
        """Mark a session ended at ``now`` (a leave). Closing an unknown or closed session does nothing."""
        with self._tx(write=True) as conn:
            open_session = PeerSession.id == session_id, PeerSession.ended_at.is_(None)
            peer_id = conn.execute(select(PeerSession.peer_id).where(*open_session)).scalar_one_or_none()
            if peer_id is not None:
                conn.execute(
                    update(PeerSession)
                    .where(*open_session)
                    .values(ended_at=now, last_seen_at=now, end_reason="leave")
                )
                _touch(conn, peer_id, now)

    def session_heartbeat(self, peer_id: str, token: str, address: str, *, now: float) -> bool:
        """``peer_id``'s process with session ``token`` is alive (its heartbeat through the API).

        The first heartbeat of a token opens its session and closes the peer's other open sessions as
        ``replaced`` at their last heartbeat: a peer id is one identity key in one data dir, which one
        process at a time holds, so a new token means the old process is gone (a restart after a crash).
        A heartbeat of a session closed as ``timeout`` reopens it: it was alive, only unheard (a backbone
        was down). Several backbones on one database agree: ``(peer_id, token)`` is unique.

        Returns:
            True if the session is open now; False if it had ended by a leave or was replaced (nothing
            changes: a late heartbeat cannot reopen it).

        Raises:
            UnknownPeer: ``peer_id`` never redeemed an invite.
            ConfigError: ``address`` is longer than 256 characters, ``token`` longer than 64.
        """
        _check_address(address)
        if not 1 <= len(token) <= _MAX_TOKEN:
            raise ConfigError(f"a session token has 1-{_MAX_TOKEN} characters, got {len(token)}")

        def body(conn: Connection) -> bool:
            if not _touch(conn, peer_id, now):
                raise UnknownPeer(f"unknown peer {peer_id}")
            row = conn.execute(
                select(PeerSession.id, PeerSession.end_reason).where(
                    PeerSession.peer_id == peer_id, PeerSession.token == token
                )
            ).one_or_none()
            if row is not None and row.end_reason not in (None, "timeout"):
                return False
            if row is None:
                conn.execute(
                    update(PeerSession)
                    .where(PeerSession.peer_id == peer_id, PeerSession.ended_at.is_(None))
                    .values(ended_at=func.coalesce(PeerSession.last_seen_at, now), end_reason="replaced")
                )
                conn.execute(
                    insert(PeerSession).values(
                        peer_id=peer_id, token=token, started_at=now, last_seen_at=now, address=address
                    )
                )
            else:
                conn.execute(
                    update(PeerSession)
                    .where(PeerSession.id == row.id)
                    .values(last_seen_at=now, ended_at=None, end_reason=None, address=address)
                )
            return True

        return self._write_retrying(body)

    def leave_session(self, peer_id: str, token: str, *, now: float) -> bool:
        """``peer_id``'s process with session ``token`` is leaving cleanly: its session ends at ``now``.

        Returns:
            True if an open (or timed-out) session was closed as ``leave``; False if there is no such
            session or it had ended by a leave or was replaced.
        """
        with self._tx(write=True) as conn:
            result = conn.execute(
                update(PeerSession)
                .where(
                    PeerSession.peer_id == peer_id,
                    PeerSession.token == token,
                    (PeerSession.end_reason.is_(None)) | (PeerSession.end_reason == "timeout"),
                )
                .values(ended_at=now, last_seen_at=now, end_reason="leave")
            )
            if result.rowcount == 0:
                return False
            _touch(conn, peer_id, now)
            return True

    def close_silent_sessions(self, *, silent_since: float) -> int:
        """Close every open session not heard from since ``silent_since`` as ``timeout``, ended at its
        last heartbeat (the last time anyone knew it alive). Returns how many were closed."""
        with self._tx(write=True) as conn:
            result = conn.execute(
                update(PeerSession)
                .where(
                    PeerSession.ended_at.is_(None),
                    func.coalesce(PeerSession.last_seen_at, PeerSession.started_at) < silent_since,
                )
                .values(
                    ended_at=func.coalesce(PeerSession.last_seen_at, PeerSession.started_at),
                    end_reason="timeout",
                )
            )
            return int(result.rowcount)

    def sessions(self, peer_id: str | None = None) -> list[SessionRow]:
        """Every session (of ``peer_id``, if given), oldest first."""
        query = select(
            PeerSession.peer_id,
            PeerSession.token,
            PeerSession.address,
            PeerSession.started_at,
            PeerSession.last_seen_at,
            PeerSession.ended_at,
            PeerSession.end_reason,
        ).order_by(PeerSession.started_at, PeerSession.id)
        if peer_id is not None:
            query = query.where(PeerSession.peer_id == peer_id)
        with self._tx(write=False) as conn:
            rows = conn.execute(query).all()
        return [
            SessionRow(
                r.peer_id,
                r.token,
                r.address,
                r.started_at,
                r.last_seen_at if r.last_seen_at is not None else r.started_at,
                r.ended_at,
                r.end_reason,
            )
            for r in rows
        ]

    def touch_peer(self, peer_id: str, *, now: float) -> None:
        """Set the peer's last-seen time to ``now`` (it never moves backwards).

        Raises:
            UnknownPeer: ``peer_id`` never redeemed an invite.
        """
        with self._tx(write=True) as conn:
            if not _touch(conn, peer_id, now):
                raise UnknownPeer(f"unknown peer {peer_id}")

    # ------------------------------------------------------------------ reports

    def record_report(
        self, signed: SignedReport, report: ContributionReport, assessment: Assessment, *, now: float
    ) -> bool:
        """Record a verified report with the given bounds verdict, exactly once per ``(peer_id, seq)``,
        and credit it by its receipts (see :mod:`~backbone.ledger.accounting`).

        ``report`` must be ``verify_report(signed, run_id)``. Prefer :meth:`assess_and_record`, which
        assesses under the same lock so two reports of one peer cannot both claim the same time.

        Returns:
            True if recorded now; False if this ``(peer_id, seq)`` was recorded before (nothing changed).

        Raises:
            UnknownPeer: the reporting peer never redeemed an invite.
        """
        return self._record(signed, report, lambda _conn: assessment, now) is not None

    def assess_and_record(
        self, signed: SignedReport, report: ContributionReport, *, now: float
    ) -> Verdict | None:
        """Assess ``report`` (see :func:`~backbone.ledger.accounting.assess`) against the peer's latest
        unflagged report, record it, store its receipts and pull records and credit it, in one
        transaction that holds the peer's row lock: the way to credit reports, also with several
        backbones on one database.

        ``report`` must be ``verify_report(signed, run_id)``.

        Returns:
            The verdict recorded, or None if this ``(peer_id, seq)`` was recorded before.

        Raises:
            UnknownPeer: the reporting peer never redeemed an invite.
        """

        def judge(conn: Connection) -> Assessment:
            joined = conn.execute(select(Peer.first_seen).where(Peer.peer_id == report.peer_id)).scalar_one()
            return assess(report, _previous_end(conn, report.peer_id), now, joined_at=joined)

        return self._record(signed, report, judge, now)

    def _record(
        self,
        signed: SignedReport,
        report: ContributionReport,
        judge: Callable[[Connection], Assessment],
        now: float,
    ) -> Verdict | None:
        values = _report_values(signed, report, now)
        # signatures: outside the write lock
        split = split_receipts(report, report.run_id)
        receipts, stage_receipts, rejected = split.steps, split.stages, split.rejected
        try:
            with self._tx(write=True) as conn:
                peer = _load_peer(conn, report.peer_id, for_update=True)
                if peer is None:
                    raise UnknownPeer(f"report from unknown peer {report.peer_id}")
                if _report_exists(conn, report.peer_id, report.seq):
                    return None
                assessment = judge(conn)
                status = "credited" if assessment.credited else "flagged"
                # Insert first, touch the peer second: the same order in every writer, so no deadlock.
                result = conn.execute(
                    insert(Report).values(
                        user_id=peer.user_id, status=status, flag_reason=assessment.reason, **values
                    )
                )
                key = result.inserted_primary_key
                assert key is not None  # a single-row INSERT always has one
                report_id = int(key[0])
                _store_discards(conn, report, report_id)
                _store_stage_discards(conn, report, report_id)
                notes = rejected + _store_evidence(conn, report, receipts, peer.user_id, report_id)
                notes += _store_stage_receipts(conn, report, stage_receipts, peer.user_id, report_id)
                notes += _store_trainer_receipts(conn, report, split.carried, peer.user_id, report_id)
                relays, relay_notes = _store_relayed(
                    conn, report, peer.user_id, report_id, counts=assessment.credited
                )
                notes += relay_notes
                senders, received_notes = _store_received(
                    conn, report, peer.user_id, report_id, counts=assessment.credited
                )
                notes += received_notes
                evidenced = _record_evidenced_steps(conn, now)
                _refresh_evidenced_samples(conn, set(receipts) | evidenced)
                stage_evidenced = _record_evidenced_stage_steps(conn, now)
                _refresh_evidenced_stage_samples(conn, set(stage_receipts) | stage_evidenced)
                # Peers whose evidence this report made count: the aggregators of its pull records, and
                # everyone with receipts or pulls of the steps it just recorded. Credited below, each in
                # its own transaction (one row lock at a time: no deadlock between two backbones).
                settle = (
                    _evidenced_peers(conn, evidenced)
                    | _stage_evidenced_peers(conn, stage_evidenced)
                    | {p.aggregator for p in report.pulled}
                    | relays
                    | senders
                )
                credit = (
                    _credit(conn, report.peer_id, debit=bool(report.discarded or report.stage_discarded))
                    if assessment.credited
                    else Credit()
                )
                conn.execute(
                    update(Report)
                    .where(Report.id == report_id)
                    .values(
                        credited_samples=credit.samples,
                        credited_compute_seconds=credit.compute_seconds,
                        credited_bytes_aggregated=credit.bytes_aggregated,
                        credited_bytes_relayed=credit.bytes_relayed,
                        credited_bytes_sent=credit.bytes_sent,
                        notes=_format_notes(notes),
                    )
                )
                _touch(conn, report.peer_id, now)
        except _Conflict:
            if self._exists(lambda conn: _report_exists(conn, report.peer_id, report.seq)):
                return None
            raise
        self._settle(settle - {report.peer_id})
        return Verdict(
            credited=assessment.credited,
            reason=assessment.reason,
            samples=credit.samples,
            compute_seconds=credit.compute_seconds,
            bytes_aggregated=credit.bytes_aggregated,
            notes=_format_notes(notes),
            bytes_relayed=credit.bytes_relayed,
            bytes_sent=credit.bytes_sent,
        )

    def _settle(self, peer_ids: set[str]) -> None:
        """Credit late evidence (accounting's docstring, "late evidence") to each of ``peer_ids``, one
        transaction per peer under its row lock."""
        for peer_id in sorted(peer_ids):
            with self._tx(write=True) as conn:
                if _load_peer(conn, peer_id, for_update=True) is not None:
                    _credit_late(conn, peer_id)

    def previous_end(self, peer_id: str) -> float | None:
        """``interval_end`` of the peer's latest credited report, or None."""
        with self._tx(write=False) as conn:
            return _previous_end(conn, peer_id)

    def peer_reports(self, peer_id: str) -> list[StoredReport]:
        """Every recorded report of ``peer_id``, by ``seq``, with its signed bytes."""
        with self._tx(write=False) as conn:
            rows = conn.execute(
                select(
                    Report.seq,
                    Report.global_step,
                    Report.samples,
                    Report.status,
                    Report.flag_reason,
                    Report.received_at,
                    Report.report_bytes,
                    Report.signature,
                    Report.credited_samples,
                    Report.notes,
                )
                .where(Report.peer_id == peer_id)
                .order_by(Report.seq)
            ).all()
        return [
            StoredReport(
                r.seq,
                r.global_step,
                r.samples,
                cast(ReportStatus, r.status),
                r.flag_reason,
                r.received_at,
                SignedReport(report=r.report_bytes, signature=r.signature),
                r.credited_samples,
                r.notes,
            )
            for r in rows
        ]

    def report_counts(self) -> dict[str, int]:
        """How many reports are ``credited`` and ``flagged`` (both keys always present)."""
        with self._tx(write=False) as conn:
            rows = conn.execute(select(Report.status, func.count()).group_by(Report.status)).all()
        counts = {"credited": 0, "flagged": 0}
        counts.update({status: int(n) for status, n in rows})
        return counts

    # -------------------------------------------------------------------- steps

    def record_step(
        self,
        global_step: int,
        *,
        finished_at: float,
        loss: float | None,
        samples: int,
        peers: int,
        target_batch: int | None = None,
    ) -> bool:
        """Record that a backbone saw the collaboration take ``global_step`` (``source = 'tracker'``); the
        first record of a step wins, except that a row only receipts evidenced takes these numbers.

        A non-finite ``loss`` is stored as NULL (SQLite cannot store NaN).

        Returns:
            True if recorded now, False if the step was recorded before (nothing changed).

        The tracker (:mod:`backbone.steps`) records only steps it saw samples accumulated for, so its
        rows have samples and peers; 0 stays accepted here (a step whose batch is unknown: its receipts'
        weights are then capped by the largest batch recorded).

        Raises:
            ValueError: a negative number, or a target batch below 1.
        """
        if min(global_step, samples, peers) < 0 or (target_batch is not None and target_batch < 1):
            raise ValueError(f"negative step record: {global_step=}, {samples=}, {peers=}, {target_batch=}")
        if loss is not None and not math.isfinite(loss):
            loss = None
        values = {
            "finished_at": finished_at,
            "loss": loss,
            "samples": samples,
            "peers": peers,
            "target_batch": target_batch,
        }
        try:
            with self._tx(write=True) as conn:
                source = conn.execute(
                    select(Step.source).where(Step.global_step == global_step)
                ).scalar_one_or_none()
                if source == "receipts":  # evidenced by receipts first: the tracker knows more of it
                    conn.execute(
                        update(Step).where(Step.global_step == global_step).values(source="tracker", **values)
                    )
                elif source is not None:
                    return False
                else:
                    conn.execute(insert(Step).values(global_step=global_step, source="tracker", **values))
                # Receipts and pulls of this step stored before it was recorded count from now on (and
                # a receipt-evidenced step's cap is now the batch the tracker saw).
                settle = _evidenced_peers(conn, {global_step})
        except _Conflict:
            if self._exists(lambda conn: _step_exists(conn, global_step)):
                return False
            raise
        self._settle(settle)
        return True

    def record_stage_step(
        self,
        stage: int,
        step: int,
        *,
        finished_at: float,
        loss: float | None,
        samples: int,
        peers: int,
        target_batch: int | None = None,
    ) -> bool:
        """Record that a backbone saw stage ``stage`` of a swarm run take ``step`` (``source =
        'tracker'``; ``samples`` and ``target_batch`` in stage-samples): :meth:`record_step`, per stage
        (accounting's docstring, "Swarm runs"). Stage receipts of it held until now count from now on,
        and those of the stage's steps below it the tracker jumped over record their steps.

        Returns:
            True if recorded now, False if the stage's step was recorded before (nothing changed).

        Raises:
            ValueError: a negative number, a target batch below 1, or a stage out of range.
        """
        if not 0 <= stage < MAX_STAGES:
            raise ValueError(f"stage {stage} is outside [0, {MAX_STAGES})")
        if min(step, samples, peers) < 0 or (target_batch is not None and target_batch < 1):
            raise ValueError(f"negative stage step record: {step=}, {samples=}, {peers=}, {target_batch=}")
        if loss is not None and not math.isfinite(loss):
            loss = None
        values = {
            "finished_at": finished_at,
            "loss": loss,
            "samples": samples,
            "peers": peers,
            "target_batch": target_batch,
        }
        mine = (StageStep.stage == stage, StageStep.step == step)
        try:
            with self._tx(write=True) as conn:
                source = conn.execute(select(StageStep.source).where(*mine)).scalar_one_or_none()
                if source == "receipts":  # evidenced by receipts first: the tracker knows more of it
                    conn.execute(update(StageStep).where(*mine).values(source="tracker", **values))
                elif source is not None:
                    return False
                else:
                    conn.execute(insert(StageStep).values(stage=stage, step=step, source="tracker", **values))
                conn.execute(
                    update(StageReceipt)
                    .where(StageReceipt.stage == stage, StageReceipt.step == step, StageReceipt.held == 1)
                    .values(held=0)
                )
                evidenced = _record_evidenced_stage_steps(conn, finished_at)
                _refresh_evidenced_stage_samples(conn, evidenced)
                settle = _stage_evidenced_peers(conn, {(stage, step)} | evidenced)
        except _Conflict:
            if self._exists(lambda conn: _stage_step_exists(conn, stage, step)):
                return False
            raise
        self._settle(settle)
        return True

    def swarm_stages(self) -> list[int]:
        """The pipeline stages with recorded steps (a swarm run's; empty: a data-parallel run)."""
        with self._tx(write=False) as conn:
            found = conn.execute(select(StageStep.stage).distinct().order_by(StageStep.stage)).scalars()
            return [int(k) for k in found]

    def stage_steps(self, stage: int | None = None) -> list[tuple[int, int, int, int | None, str]]:
        """The recorded steps of a swarm run's stages (of ``stage``; None: all), as ``(stage, step,
        samples, target_batch, source)``, by stage and step."""
        query = select(
            StageStep.stage, StageStep.step, StageStep.samples, StageStep.target_batch, StageStep.source
        ).order_by(StageStep.stage, StageStep.step)
        if stage is not None:
            query = query.where(StageStep.stage == stage)
        with self._tx(write=False) as conn:
            return [(r[0], r[1], r[2], r[3], r[4]) for r in conn.execute(query).all()]

    def recent_steps(self, limit: int = 100) -> list[StepRow]:
        """The ``limit`` most recent finished steps, newest first."""
        with self._tx(write=False) as conn:
            rows = conn.execute(
                select(
                    Step.global_step,
                    Step.finished_at,
                    Step.loss,
                    Step.samples,
                    Step.peers,
                    Step.source,
                    Step.target_batch,
                )
                .order_by(Step.global_step.desc())
                .limit(limit)
            ).all()
            claims = _claims(conn, rows[-1].global_step, rows[0].global_step) if rows else {}
        evaluated = {step: summarize(step, found) for step, found in claims.items()}
        return [
            StepRow(
                r.global_step,
                r.finished_at,
                r.loss,
                r.samples,
                r.peers,
                r.source,
                r.target_batch,
                *_evaluated(evaluated.get(r.global_step)),
            )
            for r in rows
        ]

    def newest_step(self) -> int | None:
        """The newest step in the step log (None: no step recorded yet)."""
        with self._tx(write=False) as conn:
            newest: int | None = conn.execute(select(func.max(Step.global_step))).scalar_one_or_none()
        return newest

    # -------------------------------------------------------------- evaluations

    def record_evaluation(self, signed: SignedEvaluation, evaluation: Evaluation, *, now: float) -> bool:
        """Store a verified held-out evaluation (checked by backbone.ledger.evaluations).

        Returns:
            True if recorded now, False if ``(peer_id, step)`` was recorded before (nothing changed).

        Raises:
            UnknownPeer: ``evaluation.peer_id`` never redeemed an invite.
        """
        peer_id, step = evaluation.peer_id, evaluation.step

        def exists(conn: Connection) -> bool:
            found = conn.execute(
                select(EvaluationRecord.step).where(
                    EvaluationRecord.peer_id == peer_id, EvaluationRecord.step == step
                )
            ).first()
            return found is not None

        try:
            with self._tx(write=True) as conn:
                user_id = conn.execute(select(Peer.user_id).where(Peer.peer_id == peer_id)).scalar()
                if user_id is None:
                    raise UnknownPeer(f"unknown peer {peer_id}")
                if exists(conn):
                    return False
                conn.execute(
                    insert(EvaluationRecord).values(
                        peer_id=peer_id,
                        step=step,
                        user_id=user_id,
                        loss=evaluation.loss,
                        examples=evaluation.examples,
                        eval_set=evaluation.eval_set,
                        params=evaluation.params,
                        evaluated_at=evaluation.timestamp,
                        received_at=now,
                        evaluation_bytes=signed.evaluation,
                        signature=signed.signature,
                    )
                )
        except _Conflict:  # a concurrent insert of the same (peer, step) won
            if self._exists(exists):
                return False
            raise
        return True

    def step_evaluation(self, step: int) -> StepEvaluation | None:
        """The cross-checked held-out loss of ``step`` (None: nobody evaluated it)."""
        with self._tx(write=False) as conn:
            claims = _claims(conn, step, step)
        return summarize(step, claims.get(step, []))

    def discards(self, peer_id: str) -> list[tuple[int, int]]:
        """The step ranges ``peer_id`` reported discarded, by first step (each as often as reported)."""
        with self._tx(write=False) as conn:
            rows = conn.execute(
                select(Discard.first_step, Discard.last_step)
                .where(Discard.peer_id == peer_id)
                .order_by(Discard.first_step, Discard.seq)
            ).all()
        return [(r.first_step, r.last_step) for r in rows]

    def stage_discards(self, peer_id: str) -> list[tuple[int, int, int]]:
        """The stage step ranges ``peer_id`` reported discarded as ``(stage, first, last)``, by stage and
        first step (each as often as reported)."""
        with self._tx(write=False) as conn:
            rows = conn.execute(
                select(StageDiscard.stage, StageDiscard.first_step, StageDiscard.last_step)
                .where(StageDiscard.peer_id == peer_id)
                .order_by(StageDiscard.stage, StageDiscard.first_step, StageDiscard.seq)
            ).all()
        return [(r.stage, r.first_step, r.last_step) for r in rows]

    # ------------------------------------------------------------------ queries

    def leaderboard(self) -> list[LeaderboardRow]:
        """Every user's credited contribution, most samples first (ties by username)."""
        credited = Report.status == "credited"
        legacy = (Report.status == "credited") & (Report.scheme == 1)  # schema 1 credited relaying too

        def total(column: Any) -> ColumnElement[float]:
            # Summed as doubles: SQLite's integer SUM raises on overflow; exact below 2**53.
            return func.sum(sql_cast(column, Double))

        reports = (
            select(
                Report.user_id,
                total(Report.credited_samples).label("samples"),
                total(Report.credited_compute_seconds).label("compute_seconds"),
                total(Report.credited_bytes_aggregated).label("bytes_aggregated"),
                func.sum(
                    case(
                        (legacy, sql_cast(Report.bytes_relayed, Double)), else_=Report.credited_bytes_relayed
                    )
                ).label("bytes_relayed"),
                total(Report.credited_bytes_sent).label("bytes_sent"),
                func.sum(case((credited, 0), else_=1)).label("flagged"),
            )
            .group_by(Report.user_id)
            .subquery()
        )
        peers = (
            select(Peer.user_id, func.count().label("peers"), func.max(Peer.last_seen).label("last_seen"))
            .group_by(Peer.user_id)
            .subquery()
        )
        query = (
            select(
                User.username,
                reports.c.samples,
                reports.c.compute_seconds,
                reports.c.bytes_aggregated,
                reports.c.bytes_relayed,
                reports.c.bytes_sent,
                reports.c.flagged,
                peers.c.peers,
                peers.c.last_seen,
            )
            .select_from(User)
            .outerjoin(reports, reports.c.user_id == User.id)
            .outerjoin(peers, peers.c.user_id == User.id)
        )
        with self._tx(write=False) as conn:
            rows = conn.execute(query).all()
            flagged = conn.execute(
                select(User.username, Report.flag_reason)
                .join(Report, Report.user_id == User.id)
                .where(Report.status == "flagged")
            ).all()
            # Time in the run: each session from its start to its end (or last heartbeat, while open).
            ended = func.coalesce(PeerSession.ended_at, PeerSession.last_seen_at, PeerSession.started_at)
            online: dict[str, float | None] = dict(
                conn.execute(
                    select(User.username, func.sum(ended - PeerSession.started_at))
                    .join(Peer, Peer.user_id == User.id)
                    .join(PeerSession, PeerSession.peer_id == Peer.peer_id)
                    .group_by(User.username)
                ).all()
            )
            discarded: dict[str, float] = {}
            for table, who in (
                (Receipt, Receipt.sender),
                (StageReceipt, StageReceipt.sender),
                (TrainerReceipt, TrainerReceipt.trainer),
            ):
                for username, weight in conn.execute(
                    select(User.username, func.sum(sql_cast(table.weight, Double)))
                    .join(Peer, Peer.user_id == User.id)
                    .join(table, who == Peer.peer_id)
                    .where(table.discarded == 1)
                    .group_by(User.username)
                ).all():
                    discarded[username] = discarded.get(username, 0.0) + float(weight or 0.0)
        reasons: dict[str, Counter[str]] = {}
        for username, reason in flagged:
            reasons.setdefault(username, Counter()).update(set(reason_codes(reason)))
        board = [
            LeaderboardRow(
                username=row.username,
                samples=round(row.samples or 0),
                compute_hours=(row.compute_seconds or 0.0) / 3600.0,
                bytes_aggregated=round(row.bytes_aggregated or 0),
                bytes_relayed=round(row.bytes_relayed or 0),
                bytes_sent=round(row.bytes_sent or 0),
                peers=int(row.peers or 0),
                last_seen=row.last_seen,
                flagged_reports=int(row.flagged or 0),
                flag_reasons=dict(sorted(reasons.get(row.username, Counter()).items())),
                discarded_samples=round(discarded.get(row.username) or 0),
                online_hours=max(0.0, online.get(row.username) or 0.0) / 3600.0,
            )
            for row in rows
        ]
        board.sort(key=lambda r: (-r.samples, r.username))
        return board

    def flagged_reports(self, limit: int = 1000) -> list[FlaggedReport]:
        """The ``limit`` most recently received flagged reports, newest first, with why."""
        with self._tx(write=False) as conn:
            rows = conn.execute(
                select(
                    User.username,
                    Report.peer_id,
                    Report.seq,
                    Report.received_at,
                    Report.interval_start,
                    Report.interval_end,
                    Report.samples,
                    Report.compute_seconds,
                    Report.flag_reason,
                )
                .join(User, User.id == Report.user_id)
                .where(Report.status == "flagged")
                .order_by(Report.received_at.desc(), Report.id.desc())
                .limit(limit)
            ).all()
        return [
            FlaggedReport(
                username=r.username,
                peer_id=r.peer_id,
                seq=r.seq,
                received_at=r.received_at,
                interval_start=r.interval_start,
                interval_end=r.interval_end,
                samples=r.samples,
                compute_seconds=r.compute_seconds,
                codes=tuple(reason_codes(r.flag_reason)),
                reason=r.flag_reason or "",
            )
            for r in rows
        ]

    # ----------------------------------------------------------------- plumbing

    @contextlib.contextmanager
    def _tx(self, *, write: bool) -> Iterator[Connection]:
        """One transaction, committed on success; database errors become :class:`LedgerError`."""
        if self._closed:
            raise LedgerError(f"the ledger {self._name} is closed")
        try:
            with (self._writer if write else self._engine).begin() as conn:
                yield conn
        except IntegrityError as exc:
            raise _Conflict(f"ledger {self._name}: {_describe(exc)}") from exc
        except SQLAlchemyError as exc:
            raise LedgerError(f"ledger {self._name}: {_describe(exc)}") from exc

    def _write_retrying(self, body: Callable[[Connection], T]) -> T:
        """Run ``body`` in a write transaction; once more if a concurrent insert of the same key won."""
        try:
            with self._tx(write=True) as conn:
                return body(conn)
        except _Conflict:
            with self._tx(write=True) as conn:
                return body(conn)

    def _exists(self, check: Callable[[Connection], bool]) -> bool:
        """After a constraint refused a write: was it because the row is there already?"""
        with self._tx(write=False) as conn:
            return check(conn)


def _claims(conn: Connection, first: int, last: int) -> dict[int, list[Claim]]:
    """The held-out evaluations of the steps ``first..last``, by step, as claims of their users."""
    rows = conn.execute(
        select(
            EvaluationRecord.step,
            EvaluationRecord.peer_id,
            User.username,
            EvaluationRecord.loss,
            EvaluationRecord.params,
            EvaluationRecord.eval_set,
        )
        .join(User, User.id == EvaluationRecord.user_id)
        .where(EvaluationRecord.step.between(first, last))
    ).all()
    claims: dict[int, list[Claim]] = {}
    for r in rows:
        claims.setdefault(r.step, []).append(Claim(r.peer_id, r.username, r.loss, r.params, r.eval_set))
    return claims


def _evaluated(summary: StepEvaluation | None) -> tuple[float | None, int]:
    return (None, 0) if summary is None else (summary.loss, summary.users)


def _parse_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigError(
            "not a database URL; expected sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
        ) from exc
    # Read from the name, not get_driver_name(): that loads the dialect and raises for an unknown one.
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "sqlite":
        if driver not in ("", "pysqlite"):
            raise ConfigError(f"SQLite is supported through the standard sqlite3 module, not {driver!r}")
        if parsed.database in (None, "", ":memory:"):
            raise ConfigError("an in-memory SQLite ledger would lose everything; give a file path")
        return parsed
    if backend in ("postgresql", "postgres"):
        if parsed.drivername in ("postgresql", "postgres"):
            return parsed.set(drivername="postgresql+psycopg")
        if driver != "psycopg":
            raise ConfigError(
                f"PostgreSQL is supported through psycopg 3 (postgresql+psycopg://), not {driver!r}"
            )
        return parsed
    raise ConfigError(f"unsupported database {backend!r}; use sqlite:///PATH or postgresql+psycopg://...")


def _private_sqlite_file(path: Path) -> None:
    """Create the database file (and a missing directory, 0700) readable by its owner only: 0600 whatever
    the umask, also when it exists already. SQLite gives its -wal and -shm files the database's mode;
    existing ones are set too. A directory that exists is left as it is (it may be shared, e.g. /var/lib);
    the backbone's data dir is made 0700 by the backbone itself."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(file, 0o600)


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    conn = cast(sqlite3.Connection, dbapi_connection)
    # Let _sqlite_on_begin issue BEGIN: the sqlite3 module's implicit BEGIN is always DEFERRED.
    conn.isolation_level = None
    for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON"):
        conn.execute(f"PRAGMA {pragma}").close()


def _sqlite_on_begin(conn: Connection) -> None:
    # IMMEDIATE takes the write lock up front (waiting up to the busy timeout). A DEFERRED transaction
    # that reads first and writes later fails at once with SQLITE_BUSY if another writer got in between.
    immediate = conn.get_execution_options().get(_WRITE_OPTION, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _describe(exc: SQLAlchemyError) -> str:
    """The driver's message without the statement and parameters SQLAlchemy appends."""
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        return f"{type(exc.orig).__name__}: {str(exc.orig).strip()}"
    return f"{type(exc).__name__}: {exc}"


def _check_address(address: str) -> None:
    if len(address) > _MAX_ADDRESS:
        raise ConfigError(f"an address has at most {_MAX_ADDRESS} characters, got {len(address)}")


def _check_username(username: str) -> None:
    if username.casefold() in RESERVED_USERNAMES:
        raise ConfigError(f"the username {username!r} is reserved for the run's backbones")
    if not (1 <= len(username) <= _MAX_USERNAME and username.isprintable() and username.strip() == username):
        raise ConfigError(
            f"a username has 1-{_MAX_USERNAME} printable characters and no surrounding spaces: {username!r}"
        )


def _hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


def _seen(now: float) -> ColumnElement[float]:
    """``max(last_seen, now)``: clocks of several writers may disagree a little; last seen never regresses."""
    return case((Peer.last_seen < now, now), else_=Peer.last_seen)


def _touch(conn: Connection, peer_id: str, now: float) -> bool:
    result = conn.execute(update(Peer).where(Peer.peer_id == peer_id).values(last_seen=_seen(now)))
    return result.rowcount > 0


class _PeerRow(NamedTuple):
    user_id: int
    capabilities: Capabilities | None


def _load_peer(conn: Connection, peer_id: str, *, for_update: bool) -> _PeerRow | None:
    """The peer's user and capabilities; ``for_update`` locks its row (PostgreSQL; SQLite's write
    transactions lock the whole database anyway) until the transaction ends."""
    query = select(
        Peer.user_id, Peer.device, Peer.samples_per_second, Peer.upload_bps, Peer.download_bps
    ).where(Peer.peer_id == peer_id)
    row = conn.execute(query.with_for_update() if for_update else query).one_or_none()
    if row is None:
        return None
    if row.samples_per_second is None:
        return _PeerRow(row.user_id, None)
    capabilities = Capabilities(
        samples_per_second=row.samples_per_second,
        upload_bps=row.upload_bps or 0.0,
        download_bps=row.download_bps or 0.0,
        device=row.device or "",
    )
    return _PeerRow(row.user_id, capabilities)


def _previous_end(conn: Connection, peer_id: str) -> float | None:
    return conn.execute(
        select(func.max(Report.interval_end)).where(Report.peer_id == peer_id, Report.status == "credited")
    ).scalar_one()


def _report_exists(conn: Connection, peer_id: str, seq: int) -> bool:
    found = conn.execute(select(Report.id).where(Report.peer_id == peer_id, Report.seq == seq))
    return found.one_or_none() is not None


def _step_exists(conn: Connection, global_step: int) -> bool:
    found = conn.execute(select(Step.global_step).where(Step.global_step == global_step))
    return found.one_or_none() is not None


def _report_values(signed: SignedReport, report: ContributionReport, now: float) -> dict[str, Any]:
    try:
        matches = _REPORT_DECODER.decode(signed.report) == report
    except (msgspec.MsgspecError, RecursionError, UnicodeDecodeError):
        matches = False
    if not matches:
        raise ValueError("report is not the decoding of signed.report; pass verify_report(signed, run_id)")
    return {
        "peer_id": report.peer_id,
        "seq": report.seq,
        "global_step": report.global_step,
        "samples": report.samples,
        "compute_seconds": report.compute_seconds,
        "bytes_aggregated": report.bytes_aggregated,
        "bytes_relayed": report.bytes_relayed,
        "bytes_sent": report.bytes_sent,
        "interval_start": report.interval_start,
        "interval_end": report.interval_end,
        "received_at": now,
        "report_bytes": signed.report,
        "signature": signed.signature,
    }


def _users_of(conn: Connection, peer_ids: set[str]) -> dict[str, int]:
    if not peer_ids:
        return {}
    rows = conn.execute(select(Peer.peer_id, Peer.user_id).where(Peer.peer_id.in_(sorted(peer_ids)))).all()
    return {row.peer_id: row.user_id for row in rows}


def _recorded_steps(conn: Connection, steps: set[int]) -> set[int]:
    if not steps:
        return set()
    rows = conn.execute(select(Step.global_step).where(Step.global_step.in_(sorted(steps)))).all()
    return {row.global_step for row in rows}


def _store_evidence(
    conn: Connection,
    report: ContributionReport,
    valid: dict[int, list[PartReceipt]],
    user_id: int,
    report_id: int,
) -> Counter[str]:
    """Store the report's verified receipts (``valid``, by step) and its pull records that may count
    (accounting's docstring); returns how many did not, by code (``receipt_held``: stored, counted once
    its step is recorded), and ``receipt_retaken``: how many replaced a discarded receipt of their step
    (the step taken again after the sender re-synced; they count)."""
    notes: Counter[str] = Counter()
    aggregators = {r.aggregator for receipts in valid.values() for r in receipts}
    users = _users_of(conn, aggregators | {p.aggregator for p in report.pulled})
    recorded = _recorded_steps(conn, set(valid) | {p.step for p in report.pulled})
    for step, receipts in sorted(valid.items()):
        others = _of_other_users(receipts, users, user_id, notes, "receipt", "aggregator")
        if not others:
            continue
        receipt = max(others, key=lambda r: r.weight)
        notes["receipt_duplicate"] += len(others) - 1
        known = conn.execute(
            select(Receipt.discarded).where(Receipt.sender == report.peer_id, Receipt.step == step)
        ).one_or_none()
        discarded = _is_discarded(conn, report.peer_id, step, report.seq)
        if known is not None and (not known.discarded or discarded):
            notes["receipt_duplicate"] += 1
            continue
        if step not in recorded and step > _frontier(conn):
            notes["receipt_held"] += 1
        values = {
            "aggregator": receipt.aggregator,
            "weight": receipt.weight,
            "nbytes": receipt.nbytes,
            "report_id": report_id,
            "discarded": int(discarded),
            "held": int(step not in recorded),
        }
        if known is None:
            conn.execute(insert(Receipt).values(sender=report.peer_id, step=step, **values))
        else:  # the step taken again after the peer discarded it: the new receipt replaces the old one
            notes["receipt_retaken"] += 1
            conn.execute(
                update(Receipt).where(Receipt.sender == report.peer_id, Receipt.step == step).values(**values)
            )
    seen: set[tuple[str, int]] = set()
    for pulled in report.pulled:
        aggregator_user = users.get(pulled.aggregator)
        if pulled.aggregator == report.peer_id or aggregator_user == user_id:
            notes["pull_same_user"] += 1
            continue
        if aggregator_user is None:
            notes["pull_unknown_aggregator"] += 1
            continue
        key = (pulled.aggregator, pulled.step)
        known = conn.execute(
            select(Pull.step).where(
                Pull.puller == report.peer_id, Pull.aggregator == pulled.aggregator, Pull.step == pulled.step
            )
        ).one_or_none()
        if key in seen or known is not None:
            notes["pull_duplicate"] += 1
            continue
        seen.add(key)
        if pulled.step not in recorded:
            notes["pull_held"] += 1
        conn.execute(
            insert(Pull).values(
                puller=report.peer_id,
                aggregator=pulled.aggregator,
                step=pulled.step,
                nbytes=pulled.nbytes,
                report_id=report_id,
            )
        )
    return notes


def _of_other_users(
    receipts: Iterable[PartReceipt],
    users: Mapping[str, int],
    user_id: int,
    notes: Counter[str],
    kind: str,
    signer: str,
) -> list[PartReceipt]:
    """The receipts signed by an admitted peer of another user than ``user_id`` (``users``: signer peer id
    -> user id); the others are counted in ``notes`` as ``<kind>_unknown_<signer>`` and
    ``<kind>_same_user`` (accounting's docstring: one user cannot vouch for themself)."""
    counted = []
    for receipt in receipts:
        owner = users.get(receipt.aggregator)
        if owner is None:
            notes[f"{kind}_unknown_{signer}"] += 1
        elif owner == user_id:
            notes[f"{kind}_same_user"] += 1
        else:
            counted.append(receipt)
    return counted


def _store_relayed(
    conn: Connection, report: ContributionReport, user_id: int, report_id: int, *, counts: bool
) -> tuple[set[str], Counter[str]]:
    """Store the report's relay records that count (accounting.relay_evidence; none of a flagged report:
    ``counts`` False), once per ``(reporter, seq, relay)``; returns the relays they name (settled at once:
    late evidence) and how many did not count or were capped, by code."""
    if not report.relayed_through:
        return set(), Counter()
    if not counts:
        return set(), Counter({"relay_flagged": len(report.relayed_through)})
    users = _users_of(conn, {r.relay for r in report.relayed_through})
    counted, notes = relay_evidence(report, user_id, users)
    for record in counted:
        statement = _insert_ignore(conn, Relayed).values(
            reporter=record.reporter,
            seq=record.seq,
            relay=record.relay,
            nbytes=record.nbytes,
            report_id=report_id,
        )
        conn.execute(statement)
    return {r.relay for r in counted}, notes


def _store_received(
    conn: Connection, report: ContributionReport, user_id: int, report_id: int, *, counts: bool
) -> tuple[set[str], Counter[str]]:
    """Store the report's swarm received records that count (accounting.received_evidence; none of a
    flagged report: ``counts`` False), once per ``(reporter, seq, server)``; returns the servers they
    name (settled at once: late evidence) and how many did not count or were capped, by code."""
    if not report.received_from:
        return set(), Counter()
    if not counts:
        return set(), Counter({"received_flagged": len(report.received_from)})
    users = _users_of(conn, {r.server for r in report.received_from})
    counted, notes = received_evidence(report, user_id, users)
    for record in counted:
        statement = _insert_ignore(conn, SwarmReceived).values(
            reporter=record.reporter,
            seq=record.seq,
            server=record.server,
            nbytes=record.nbytes,
            report_id=report_id,
        )
        conn.execute(statement)
    return {r.server for r in counted}, notes


def _format_notes(notes: Counter[str]) -> str | None:
    return "; ".join(f"{code}: {count}" for code, count in sorted(notes.items())) or None


def _credit(conn: Connection, peer_id: str, *, debit: bool = False) -> Credit:
    """What the peer's newest report adds (accounting.credit_due), from the sums in the database; with
    ``debit`` (the report discards steps) it may take back what discarded receipts were credited."""
    mine = (Report.peer_id == peer_id, Report.status == "credited", Report.scheme == 2)
    totals = conn.execute(
        select(
            func.coalesce(func.sum(sql_cast(Report.samples, Double)), 0.0),
            func.coalesce(func.sum(Report.compute_seconds), 0.0),
            func.coalesce(func.sum(sql_cast(Report.bytes_aggregated, Double)), 0.0),
            func.coalesce(func.sum(Report.credited_samples), 0.0),
            func.coalesce(func.sum(Report.credited_compute_seconds), 0.0),
            func.coalesce(func.sum(Report.credited_bytes_aggregated), 0.0),
            func.coalesce(func.sum(sql_cast(Report.bytes_relayed, Double)), 0.0),
            func.coalesce(func.sum(Report.credited_bytes_relayed), 0.0),
            func.coalesce(func.sum(sql_cast(Report.bytes_sent, Double)), 0.0),
            func.coalesce(func.sum(Report.credited_bytes_sent), 0.0),
        ).where(*mine)
    ).one()
    # A receipt's weight is capped by the larger of its step's batch and target (accounting's
    # docstring), by its recorded samples for a step of schema version <= 4, or, for a step only
    # receipts evidenced (whose samples are those receipts' own sum) or recorded without samples, by the
    # largest cap of a recorded one.
    largest = _largest_batch(conn)
    capped: Any = Receipt.weight
    if largest > 0:
        unknown = (Step.source == "receipts") | (Step.target_batch.is_(None) & (Step.samples <= 0))
        bound = case((unknown, largest), else_=_step_cap())
        capped = case((Receipt.weight > bound, bound), else_=Receipt.weight)
    weights = conn.execute(
        select(func.coalesce(func.sum(sql_cast(capped, Double)), 0.0))
        .select_from(Receipt)
        .join(Step, Step.global_step == Receipt.step)
        .where(Receipt.sender == peer_id, Receipt.discarded == 0)
    ).scalar_one()
    weights += _stage_weights(conn, peer_id) + _carried_weights(conn, peer_id)
    pulled = conn.execute(
        select(func.coalesce(func.sum(sql_cast(Pull.nbytes, Double)), 0.0))
        .select_from(Pull)
        .join(Step, Step.global_step == Pull.step)
        .where(Pull.aggregator == peer_id)
    ).scalar_one()
    relayed = conn.execute(
        select(func.coalesce(func.sum(sql_cast(Relayed.nbytes, Double)), 0.0)).where(Relayed.relay == peer_id)
    ).scalar_one()
    sent = _sent_evidence(conn, peer_id)
    return credit_due(
        Credit(float(totals[0]), float(totals[1]), float(totals[2]), float(totals[6]), float(totals[8])),
        Credit(
            samples=float(weights),
            bytes_aggregated=float(pulled),
            bytes_relayed=float(relayed),
            bytes_sent=sent,
        ),
        Credit(float(totals[3]), float(totals[4]), float(totals[5]), float(totals[7]), float(totals[9])),
        debit=debit,
    )


def _sent_evidence(conn: Connection, peer_id: str) -> float:
    """The evidence of ``peer_id``'s swarm bytes sent (accounting, "Swarm bytes"): the counted received
    records naming it as a server, and the bytes of its counted carried receipts as a trainer (those of a
    recorded stage step)."""
    received = conn.execute(
        select(func.coalesce(func.sum(sql_cast(SwarmReceived.nbytes, Double)), 0.0)).where(
            SwarmReceived.server == peer_id
        )
    ).scalar_one()
    carried = conn.execute(
        select(func.coalesce(func.sum(sql_cast(TrainerReceipt.nbytes, Double)), 0.0))
        .select_from(TrainerReceipt)
        .join(StageStep, (StageStep.stage == TrainerReceipt.stage) & (StageStep.step == TrainerReceipt.step))
        .where(TrainerReceipt.trainer == peer_id)
    ).scalar_one()
    return float(received) + float(carried)


def _frontier(conn: Connection) -> int:
    """The highest step a backbone saw taken (``-1``: none): receipts fill steps at or below it."""
    top = conn.execute(select(func.max(Step.global_step)).where(Step.source != "receipts")).scalar_one()
    return -1 if top is None else int(top)


#: Steps one report's transaction records from stored receipts (the rest: with the next reports).
_EVIDENCED_PER_REPORT = 1024


def _step_cap() -> ColumnElement[float]:
    """The most one receipt of a recorded step may weigh (accounting's docstring)."""
    larger = case((Step.samples > Step.target_batch, Step.samples), else_=Step.target_batch)
    return case(
        (Step.target_batch.is_not(None), sql_cast(larger, Double)), else_=sql_cast(Step.samples, Double)
    )


def _largest_batch(conn: Connection) -> float:
    """The largest receipt cap of a step a backbone recorded (0: none yet)."""
    query = select(func.coalesce(func.max(_step_cap()), 0)).where(Step.source != "receipts")
    return float(conn.execute(query).scalar_one())


def _credit_late(conn: Connection, peer_id: str) -> None:
    """Add what ``peer_id`` is due now (its evidence grew after its last report) to its latest credited
    report; nothing if it has none (nothing claimed, nothing to credit)."""
    latest: int | None = conn.execute(
        select(func.max(Report.id)).where(
            Report.peer_id == peer_id, Report.status == "credited", Report.scheme == 2
        )
    ).scalar_one()
    if latest is None:
        return
    due = _credit(conn, peer_id)
    if max(due.samples, due.compute_seconds, due.bytes_aggregated, due.bytes_relayed, due.bytes_sent) <= 0:
        return
    conn.execute(
        update(Report)
        .where(Report.id == latest)
        .values(
            credited_samples=Report.credited_samples + due.samples,
            credited_compute_seconds=Report.credited_compute_seconds + due.compute_seconds,
            credited_bytes_aggregated=Report.credited_bytes_aggregated + due.bytes_aggregated,
            credited_bytes_relayed=Report.credited_bytes_relayed + due.bytes_relayed,
            credited_bytes_sent=Report.credited_bytes_sent + due.bytes_sent,
        )
    )


def _evidenced_peers(conn: Connection, steps: set[int]) -> set[str]:
    """The senders of receipts and the aggregators of pull records of ``steps``."""
    if not steps:
        return set()
    chosen = sorted(steps)
    senders = conn.execute(select(Receipt.sender).where(Receipt.step.in_(chosen)).distinct()).scalars()
    aggregators = conn.execute(select(Pull.aggregator).where(Pull.step.in_(chosen)).distinct()).scalars()
    return {*senders, *aggregators}


def _refresh_evidenced_samples(conn: Connection, steps: set[int]) -> None:
    """A step only receipts evidence holds the samples of its counted receipts (each weight capped by the
    largest batch a backbone recorded) and their distinct senders: what the peers averaged for it, as far
    as their reports arrived. Called for the steps of each report's receipts."""
    if not steps:
        return
    largest = _largest_batch(conn)
    weight: Any = Receipt.weight
    if largest > 0:
        weight = case((Receipt.weight > largest, largest), else_=Receipt.weight)
    rows = conn.execute(
        select(Receipt.step, func.sum(sql_cast(weight, Double)), func.count(func.distinct(Receipt.sender)))
        .join(Step, Step.global_step == Receipt.step)
        .where(Step.source == "receipts", Receipt.step.in_(sorted(steps)), Receipt.discarded == 0)
        .group_by(Receipt.step)
    ).all()
    for step, samples, senders in rows:
        peers = conn.execute(select(Step.peers).where(Step.global_step == step)).scalar_one()
        conn.execute(
            update(Step)
            .where(Step.global_step == step, Step.source == "receipts")
            .values(samples=round(samples or 0), peers=max(int(peers), int(senders)))
        )


def _record_evidenced_steps(conn: Connection, now: float) -> set[int]:
    """Record the steps at or below the frontier that counting receipts evidence and ``steps`` lacks
    (the tracker jumped over them): ``source = 'receipts'``, peers = distinct peers in those receipts.
    Only *held* receipts (stored while their step was not recorded) are looked at, so the work is
    bounded by what is missing, not by the size of the run. Returns the steps recorded now."""
    frontier = _frontier(conn)
    if frontier < 0:
        return set()
    rows = conn.execute(
        select(
            Receipt.step,
            func.count(func.distinct(Receipt.sender)),
            func.count(func.distinct(Receipt.aggregator)),
            func.count(Step.global_step),  # 0: the step is not recorded
        )
        .select_from(Receipt)
        .outerjoin(Step, Step.global_step == Receipt.step)
        .where(Receipt.held == 1, Receipt.step <= frontier, Receipt.discarded == 0, Receipt.weight > 0)
        .group_by(Receipt.step)
        .order_by(Receipt.step)
        .limit(_EVIDENCED_PER_REPORT)
    ).all()
    recorded_now: set[int] = set()
    for step, senders, aggregators, recorded in rows:
        if recorded == 0:
            recorded_now.add(step)
            conn.execute(
                _insert_ignore(conn, Step).values(
                    global_step=step,
                    finished_at=now,
                    loss=None,
                    samples=0,
                    peers=max(2, int(senders), int(aggregators)),
                    source="receipts",
                )
            )
    if rows:
        steps = [row[0] for row in rows]
        conn.execute(update(Receipt).where(Receipt.held == 1, Receipt.step.in_(steps)).values(held=0))
    return recorded_now


# ----------------------------------------------------------------- swarm stages (accounting: "Swarm runs")


def _stage_step_exists(conn: Connection, stage: int, step: int) -> bool:
    found = conn.execute(select(StageStep.step).where(StageStep.stage == stage, StageStep.step == step))
    return found.first() is not None


def _stage_frontiers(conn: Connection) -> dict[int, int]:
    """Per stage, the highest step a backbone saw it take (stages without one: absent)."""
    rows = conn.execute(
        select(StageStep.stage, func.max(StageStep.step))
        .where(StageStep.source != "receipts")
        .group_by(StageStep.stage)
    ).all()
    return {int(stage): int(top) for stage, top in rows}


def _stage_step_cap() -> ColumnElement[float]:
    """The most one receipt of a recorded stage step may weigh: the larger of its batch and target."""
    larger = case(
        (StageStep.samples > StageStep.target_batch, StageStep.samples), else_=StageStep.target_batch
    )
    return case(
        (StageStep.target_batch.is_not(None), sql_cast(larger, Double)),
        else_=sql_cast(StageStep.samples, Double),
    )


def _largest_stage_batches(conn: Connection) -> dict[int, float]:
    """Per stage, the largest receipt cap of a step of it a backbone recorded."""
    rows = conn.execute(
        select(StageStep.stage, func.max(_stage_step_cap()))
        .where(StageStep.source != "receipts")
        .group_by(StageStep.stage)
    ).all()
    return {int(stage): float(cap or 0) for stage, cap in rows}


def _stage_weights(conn: Connection, peer_id: str) -> float:
    """The sum of ``peer_id``'s counted stage receipt weights, each capped by its stage step's cap (a
    step only receipts evidence, or recorded without samples nor target: by the largest cap of its
    stage; no cap known: uncapped, as for data-parallel steps before the tracker recorded any)."""
    largest = (
        select(StageStep.stage.label("stage"), func.max(_stage_step_cap()).label("cap"))
        .where(StageStep.source != "receipts")
        .group_by(StageStep.stage)
        .subquery()
    )
    unknown = (StageStep.source == "receipts") | (StageStep.target_batch.is_(None) & (StageStep.samples <= 0))
    bound = case((unknown, func.coalesce(largest.c.cap, 0.0)), else_=_stage_step_cap())
    capped = case(((bound > 0) & (StageReceipt.weight > bound), bound), else_=StageReceipt.weight)
    total = conn.execute(
        select(func.coalesce(func.sum(sql_cast(capped, Double)), 0.0))
        .select_from(StageReceipt)
        .join(StageStep, (StageStep.stage == StageReceipt.stage) & (StageStep.step == StageReceipt.step))
        .outerjoin(largest, largest.c.stage == StageReceipt.stage)
        .where(StageReceipt.sender == peer_id, StageReceipt.discarded == 0)
    ).scalar_one()
    return float(total)


def _store_stage_receipts(
    conn: Connection,
    report: ContributionReport,
    valid: dict[tuple[int, int], list[PartReceipt]],
    user_id: int,
    report_id: int,
) -> Counter[str]:
    """Store the report's verified stage receipts (``valid``, by ``(stage, step)``) once per ``(sender,
    stage, step)``, signed by an admitted peer of another user; returns how many did not count, by code
    (``stage_receipt_held``: stored, counted once its stage step is recorded)."""
    notes: Counter[str] = Counter()
    if not valid:
        return notes
    users = _users_of(conn, {r.aggregator for receipts in valid.values() for r in receipts})
    frontiers = _stage_frontiers(conn)
    for (stage, step), receipts in sorted(valid.items()):
        others = _of_other_users(receipts, users, user_id, notes, "stage_receipt", "aggregator")
        if not others:
            continue
        receipt = max(others, key=lambda r: r.weight)
        notes["stage_receipt_duplicate"] += len(others) - 1
        mine = (StageReceipt.sender == report.peer_id, StageReceipt.stage == stage, StageReceipt.step == step)
        known = conn.execute(select(StageReceipt.discarded).where(*mine)).one_or_none()
        discarded = _is_stage_discarded(conn, report.peer_id, stage, step, report.seq)
        if known is not None and (not known.discarded or discarded):
            notes["stage_receipt_duplicate"] += 1
            continue
        recorded = _stage_step_exists(conn, stage, step)
        if not recorded and step > frontiers.get(stage, -1):
            notes["stage_receipt_held"] += 1
        values = {
            "aggregator": receipt.aggregator,
            "weight": receipt.weight,
            "nbytes": receipt.nbytes,
            "report_id": report_id,
            "discarded": int(discarded),
            "held": int(not recorded),
        }
        if known is None:
            conn.execute(insert(StageReceipt).values(sender=report.peer_id, stage=stage, step=step, **values))
        else:  # the stage step taken again after the peer discarded it: the new receipt replaces the old
            notes["stage_receipt_retaken"] += 1
            conn.execute(update(StageReceipt).where(*mine).values(**values))
    return notes


def _record_evidenced_stage_steps(conn: Connection, now: float) -> set[tuple[int, int]]:
    """Record the stage steps at or below their stage's frontier that held stage receipts evidence and
    ``stage_steps`` lacks (``source = 'receipts'``), and mark held receipts of recorded steps counted
    (:func:`_record_evidenced_steps`, per stage). Returns the ``(stage, step)`` recorded now."""
    frontiers = _stage_frontiers(conn)
    if not frontiers:
        return set()
    rows = conn.execute(
        select(
            StageReceipt.stage,
            StageReceipt.step,
            func.count(func.distinct(StageReceipt.sender)),
            func.count(func.distinct(StageReceipt.aggregator)),
            func.count(StageStep.step),  # 0: the stage step is not recorded
        )
        .select_from(StageReceipt)
        .outerjoin(StageStep, (StageStep.stage == StageReceipt.stage) & (StageStep.step == StageReceipt.step))
        .where(
            StageReceipt.held == 1,
            StageReceipt.discarded == 0,
            StageReceipt.weight > 0,
            or_(*((StageReceipt.stage == k) & (StageReceipt.step <= top) for k, top in frontiers.items())),
        )
        .group_by(StageReceipt.stage, StageReceipt.step)
        .order_by(StageReceipt.stage, StageReceipt.step)
        .limit(_EVIDENCED_PER_REPORT)
    ).all()
    recorded_now: set[tuple[int, int]] = set()
    for stage, step, senders, aggregators, recorded in rows:
        if recorded == 0:
            recorded_now.add((int(stage), int(step)))
            conn.execute(
                _insert_ignore(conn, StageStep).values(
                    stage=stage,
                    step=step,
                    finished_at=now,
                    loss=None,
                    samples=0,
                    peers=max(2, int(senders), int(aggregators)),
                    source="receipts",
                )
            )
        conn.execute(
            update(StageReceipt)
            .where(StageReceipt.held == 1, StageReceipt.stage == stage, StageReceipt.step == step)
            .values(held=0)
        )
    return recorded_now


def _refresh_evidenced_stage_samples(conn: Connection, steps: set[tuple[int, int]]) -> None:
    """A stage step only receipts evidence holds the samples of its counted receipts (each capped by its
    stage's largest recorded batch) and their distinct senders (:func:`_refresh_evidenced_samples`)."""
    if not steps:
        return
    largest = _largest_stage_batches(conn)
    for stage, step in sorted(steps):
        mine = (StageStep.stage == stage, StageStep.step == step, StageStep.source == "receipts")
        peers = conn.execute(select(StageStep.peers).where(*mine)).scalar_one_or_none()
        if peers is None:
            continue
        rows = conn.execute(
            select(StageReceipt.sender, StageReceipt.weight).where(
                StageReceipt.stage == stage, StageReceipt.step == step, StageReceipt.discarded == 0
            )
        ).all()
        cap = largest.get(stage, 0.0)
        samples = sum(min(w, cap) if cap > 0 else w for _, w in rows)
        senders = len({sender for sender, _ in rows})
        conn.execute(update(StageStep).where(*mine).values(samples=round(samples), peers=max(peers, senders)))


def _stage_evidenced_peers(conn: Connection, steps: set[tuple[int, int]]) -> set[str]:
    """The senders of stage receipts of ``steps`` (``(stage, step)``), and the trainers with receipts of
    them (accounting, "Swarm trainers": their evidence counts once the step is recorded)."""
    senders: set[str] = set()
    for stage, step in sorted(steps):
        found = conn.execute(
            select(StageReceipt.sender)
            .where(StageReceipt.stage == stage, StageReceipt.step == step)
            .distinct()
        ).scalars()
        senders.update(found)
        trainers = conn.execute(
            select(TrainerReceipt.trainer)
            .where(TrainerReceipt.stage == stage, TrainerReceipt.step == step)
            .distinct()
        ).scalars()
        senders.update(trainers)
    return senders


# ------------------------------------------------------------- swarm trainers (accounting: "Swarm trainers")


def _store_trainer_receipts(
    conn: Connection,
    report: ContributionReport,
    valid: dict[tuple[int, int], list[PartReceipt]],
    user_id: int,
    report_id: int,
) -> Counter[str]:
    """Store the report's verified trainer's receipts (``valid``, by ``(stage, step)``): one row per
    ``(trainer, server, stage, step)``, signed by an admitted peer of another user, replaced only by a
    larger (cumulative) weight; returns how many did not count or add anything, by code
    (``trainer_receipt_held``: stored, counted once its stage step is recorded)."""
    notes: Counter[str] = Counter()
    if not valid:
        return notes
    users = _users_of(conn, {r.aggregator for receipts in valid.values() for r in receipts})
    for (stage, step), receipts in sorted(valid.items()):
        largest: dict[str, PartReceipt] = {}
        for candidate in _of_other_users(receipts, users, user_id, notes, "trainer_receipt", "server"):
            held = largest.get(candidate.aggregator)
            if held is not None:
                notes["trainer_receipt_duplicate"] += 1
            if held is None or candidate.weight > held.weight:
                largest[candidate.aggregator] = candidate
        recorded = _stage_step_exists(conn, stage, step) if largest else True
        for server, receipt in sorted(largest.items()):
            mine = (
                TrainerReceipt.trainer == report.peer_id,
                TrainerReceipt.server == server,
                TrainerReceipt.stage == stage,
                TrainerReceipt.step == step,
            )
            stored = conn.execute(
                select(TrainerReceipt.weight, TrainerReceipt.discarded).where(*mine)
            ).first()
            discarded = _is_stage_discarded(conn, report.peer_id, stage, step, report.seq)
            values = {
                "weight": receipt.weight,
                "nbytes": receipt.nbytes,
                "report_id": report_id,
                "discarded": int(discarded),
            }
            if stored is None:
                conn.execute(
                    insert(TrainerReceipt).values(
                        trainer=report.peer_id, server=server, stage=stage, step=step, **values
                    )
                )
            elif stored.discarded and not discarded:  # the stage step taken again after the discard
                notes["trainer_receipt_retaken"] += 1
                conn.execute(update(TrainerReceipt).where(*mine).values(**values))
            elif receipt.weight > stored.weight and discarded == bool(stored.discarded):
                conn.execute(update(TrainerReceipt).where(*mine).values(**values))
            else:  # not larger, or a discarded step's receipt arriving after the step taken again
                notes["trainer_receipt_duplicate"] += 1
                continue
            if not recorded:
                notes["trainer_receipt_held"] += 1
    return notes


def _carried_weights(conn: Connection, peer_id: str) -> float:
    """The sum of ``peer_id``'s counted trainer's receipt weights: per recorded ``(stage, step)``, the
    weights of all its servers' receipts together, capped by the stage step's cap as in
    :func:`_stage_weights`."""
    per_step = (
        select(
            TrainerReceipt.stage.label("stage"),
            TrainerReceipt.step.label("step"),
            func.sum(sql_cast(TrainerReceipt.weight, Double)).label("weight"),
        )
        .where(TrainerReceipt.trainer == peer_id, TrainerReceipt.discarded == 0)
        .group_by(TrainerReceipt.stage, TrainerReceipt.step)
        .subquery()
    )
    largest = (
        select(StageStep.stage.label("stage"), func.max(_stage_step_cap()).label("cap"))
        .where(StageStep.source != "receipts")
        .group_by(StageStep.stage)
        .subquery()
    )
    unknown = (StageStep.source == "receipts") | (StageStep.target_batch.is_(None) & (StageStep.samples <= 0))
    bound = case((unknown, func.coalesce(largest.c.cap, 0.0)), else_=_stage_step_cap())
    capped = case(((bound > 0) & (per_step.c.weight > bound), bound), else_=per_step.c.weight)
    total = conn.execute(
        select(func.coalesce(func.sum(sql_cast(capped, Double)), 0.0))
        .select_from(per_step)
        .join(StageStep, (StageStep.stage == per_step.c.stage) & (StageStep.step == per_step.c.step))
        .outerjoin(largest, largest.c.stage == per_step.c.stage)
    ).scalar_one()
    return float(total)


def _insert_ignore(conn: Connection, table: Any) -> Any:
    """An INSERT that does nothing when the key exists (another backbone won the race)."""
    if conn.dialect.name == "postgresql":
        return postgresql_insert(table).on_conflict_do_nothing()
    return sqlite_insert(table).on_conflict_do_nothing()


def _is_discarded(conn: Connection, peer_id: str, step: int, seq: int) -> bool:
    """A receipt of ``step`` carried by ``peer_id``'s report ``seq`` is covered by one of its discards:
    one listed by a report with a seq at least ``seq`` (accounting's docstring)."""
    found = conn.execute(
        select(Discard.first_step).where(
            Discard.peer_id == peer_id,
            Discard.seq >= seq,
            Discard.first_step <= step,
            Discard.last_step >= step,
        )
    ).first()
    return found is not None


def _store_discards(conn: Connection, report: ContributionReport, report_id: int) -> None:
    """The report's discarded step ranges: stored with its seq, and the sender's stored receipts in them
    that its reports up to this one carried marked discarded (not those of later reports that arrived
    first: the steps taken again)."""
    earlier = select(Report.id).where(Report.peer_id == report.peer_id, Report.seq <= report.seq)
    for span in report.discarded:
        conn.execute(
            _insert_ignore(conn, Discard).values(
                peer_id=report.peer_id,
                seq=report.seq,
                first_step=span.first,
                last_step=span.last,
                report_id=report_id,
            )
        )
        conn.execute(
            update(Receipt)
            .where(
                Receipt.sender == report.peer_id,
                Receipt.step.between(span.first, span.last),
                Receipt.report_id.in_(earlier),
            )
            .values(discarded=1)
        )


def _is_stage_discarded(conn: Connection, peer_id: str, stage: int, step: int, seq: int) -> bool:
    """A receipt of ``stage``'s ``step`` carried by ``peer_id``'s report ``seq`` is covered by one of its
    stage discards: one of that stage listed by a report with a seq at least ``seq`` (:func:`_is_discarded`,
    per stage)."""
    found = conn.execute(
        select(StageDiscard.first_step).where(
            StageDiscard.peer_id == peer_id,
            StageDiscard.stage == stage,
            StageDiscard.seq >= seq,
            StageDiscard.first_step <= step,
            StageDiscard.last_step >= step,
        )
    ).first()
    return found is not None


def _store_stage_discards(conn: Connection, report: ContributionReport, report_id: int) -> None:
    """The report's discarded stage step ranges (:func:`_store_discards`, per stage): stored with its seq,
    and the sender's stored stage receipts and trainer's receipts of those stage steps that its reports
    up to this one carried marked discarded. A range is two numbers whatever it spans: it is never
    expanded, and it marks only receipts others signed for this sender (accounting, "Swarm runs")."""
    if not report.stage_discarded:
        return
    earlier = select(Report.id).where(Report.peer_id == report.peer_id, Report.seq <= report.seq)
    for span in report.stage_discarded:
        conn.execute(
            _insert_ignore(conn, StageDiscard).values(
                peer_id=report.peer_id,
                seq=report.seq,
                stage=span.stage,
                first_step=span.first,
                last_step=span.last,
                report_id=report_id,
            )
        )
        conn.execute(
            update(StageReceipt)
            .where(
                StageReceipt.sender == report.peer_id,
                StageReceipt.stage == span.stage,
                StageReceipt.step.between(span.first, span.last),
                StageReceipt.report_id.in_(earlier),
            )
            .values(discarded=1)
        )
        conn.execute(
            update(TrainerReceipt)
            .where(
                TrainerReceipt.trainer == report.peer_id,
                TrainerReceipt.stage == span.stage,
                TrainerReceipt.step.between(span.first, span.last),
                TrainerReceipt.report_id.in_(earlier),
            )
            .values(discarded=1)
        )
