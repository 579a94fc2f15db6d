"""The ledger's SQL tables (SQLAlchemy 2 typed declarative) and their versioning. DDL only: no engines.

Tables::

    users          one row per allowlisted person; revoked_at set by ``backbone allow remove``
    invites        invite codes of a user, stored only as sha256(secret) in hex; ``uses`` counts the
                   machines it admitted that were not a peer of its user already, ``max_uses`` (NULL: no
                   limit) bounds it (schema 5)
    peers          one row per machine (peer id) that redeemed an invite; its measured capabilities
    sessions       one row per volunteer *process* (its random session token): opened by its first
                   heartbeat, closed by its leave notice, by a newer session of the same peer
                   (``replaced``: a restart), or by the backbone's sweep after SESSION_TIMEOUT of silence
                   (``timeout``); ``ended_at`` is then the last time it was heard from
    reports        signed contribution reports; UNIQUE(peer_id, seq) makes crediting exactly-once;
                   the credited_* columns hold what receipts backed (backbone.ledger.accounting)
    receipts       part receipts that count, one per (sender, step) ever; ``discarded`` once its
                   sender reported the step discarded (a fork it left)
    pulls          pull records about aggregators, one per (puller, aggregator, step)
    relayed        relay records (schema 8): ``reporter``'s report ``seq`` says it received ``nbytes``
                   through relay ``relay`` (a peer of another user), one per (reporter, seq, relay);
                   the evidence of that relay's ``bytes_relayed`` (``reports.credited_bytes_relayed``)
    step_discards  step ranges a peer reported discarded (it re-synced to another state), each bounded
                   by the ``seq`` of the report that listed it: it covers only that peer's receipts
                   carried by reports with a seq up to it (schema 3 had ``discards``, unbounded)
    steps          one row per global step the collaboration really took: ``source`` says how the ledger
                   knows (``tracker``: a backbone saw it taken; ``receipts``: a counting receipt of it,
                   for a step below the tracker's frontier; ``legacy``: recorded by schema version <= 2,
                   which also wrote rows for steps it jumped over); ``target_batch``: the run's target
                   batch when the tracker recorded it (NULL: receipts, or schema version <= 4)
    evaluations    signed held-out evaluations, one per (peer, step) ever (schema 7): the loss a peer
                   computed over the run's held-out examples with the parameters of a step, their
                   fingerprint and the held-out set's digest; a step's loss is the cross-check of
                   its rows (backbone.ledger.evaluations), computed when read
    stage_steps    one row per (stage, step) a swarm run's stage really took (schema 9): as ``steps``,
                   per pipeline stage (each stage counts its own steps); ``samples`` and
                   ``target_batch`` are stage-samples (backbone.ledger.accounting, "Swarm runs")
    stage_receipts part receipts of stage aggregators that count, one per (sender, stage, step) ever
                   (schema 9): as ``receipts``, counted once their (stage, step) is in ``stage_steps``;
                   ``discarded`` once its sender reported the stage step discarded (schema 12)
    trainer_receipts
                   stage servers' receipts for swarm trainers that count (schema 10), one per
                   (trainer, server, stage, step), holding the largest cumulative weight seen; counted
                   while their (stage, step) is in ``stage_steps`` (accounting, "Swarm trainers");
                   ``discarded`` once the trainer reported the stage step discarded (schema 12)
    stage_discards stage step ranges a swarm peer reported discarded (schema 12): as ``step_discards``,
                   per stage, each bounded by the ``seq`` of the report that listed it
    swarm_received swarm trainers' records of the answer bytes they received from stage servers (schema
                   11): ``reporter``'s report ``seq`` says it received ``nbytes`` from ``server`` (a peer
                   of another user), one per (reporter, seq, server); the evidence of that server's
                   ``bytes_sent`` (``reports.credited_bytes_sent``; accounting, "Swarm bytes")
    schema_version exactly one row: the schema version this database has

Portability: every time is a float of unix seconds (``DOUBLE PRECISION`` / ``REAL``), counts are 64-bit
integers, and nothing depends on a dialect's date, enum or JSON types, so the same code runs on SQLite
and PostgreSQL. Leaderboard sums cast counts to double first: SQLite's integer ``SUM`` raises on
overflow, a float sum does not, and it is exact below 2**53.

Migrations: :func:`create_schema` is idempotent (``create_all`` creates only missing tables) and runs in
one transaction, serialized between processes (``BEGIN IMMEDIATE`` on SQLite, an advisory lock on
PostgreSQL). To change the schema later:

1. change the table classes here (new databases are created in the new shape directly);
2. bump :data:`SCHEMA_VERSION` to ``N + 1`` and add ``MIGRATIONS[N] = _migrate_N_to_N_plus_1``, a
   function of a ``Connection`` that brings a version-``N`` database to ``N + 1`` with plain DDL valid on
   both dialects (new columns through ``_add_column``, which skips a table ``create_all`` has just made
   in the newest shape);
3. :func:`create_schema` runs the missing steps in order and updates ``schema_version``; a database
   newer than this code is refused rather than written to.

4. add a fixture made by the previous release's code and a test that opens it (``tests/fixtures/<commit>``,
   ``tests/backbone/ledger/test_upgrade.py``: every old row is kept).

When migrations outgrow this, Alembic can take over with ``schema_version`` as its baseline.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Connection,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from .errors import LedgerError

__all__ = [
    "SCHEMA_VERSION",
    "Base",
    "Invite",
    "Peer",
    "PeerSession",
    "Pull",
    "Discard",
    "EvaluationRecord",
    "StageDiscard",
    "Receipt",
    "Relayed",
    "SwarmReceived",
    "Report",
    "SchemaVersion",
    "StageReceipt",
    "StageStep",
    "Step",
    "TrainerReceipt",
    "User",
    "create_schema",
]

SCHEMA_VERSION = 12
#: pg_advisory_xact_lock key serializing schema creation between processes ("dedloc" in ASCII).
_SCHEMA_LOCK_KEY = 0x646564_6C6F63

#: 64-bit ids, except on SQLite where only INTEGER PRIMARY KEY auto-increments (and is 64-bit anyway).
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    type_annotation_map = {int: BigInteger(), float: Double(), bytes: LargeBinary(), str: Text()}


class User(Base):
    __tablename__ = "users"
    __table_args__ = (CheckConstraint("length(username) BETWEEN 1 AND 64", name="username_length"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    username: Mapped[str] = mapped_column(String(64), unique=True)
    note: Mapped[str | None]
    created_at: Mapped[float]
    revoked_at: Mapped[float | None]


class Invite(Base):
    __tablename__ = "invites"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    #: sha256 of the secret, lowercase hex; the secret itself is never stored.
    code_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float]
    expires_at: Mapped[float | None]
    revoked_at: Mapped[float | None]
    #: machines admitted through this invite that were not a peer of its user already (schema 5)
    uses: Mapped[int] = mapped_column(default=0)
    #: at most this many uses (NULL: no limit); enforced by one conditional UPDATE (store.redeem_invite)
    max_uses: Mapped[int | None]


class Peer(Base):
    __tablename__ = "peers"

    peer_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    public_key: Mapped[bytes]
    #: measured capabilities (protocols.ledger.Capabilities); NULL until the peer reports them
    device: Mapped[str | None] = mapped_column(String(128))
    samples_per_second: Mapped[float | None]
    upload_bps: Mapped[float | None]
    download_bps: Mapped[float | None]
    first_seen: Mapped[float]
    last_seen: Mapped[float]


class PeerSession(Base):
    __tablename__ = "sessions"

    __table_args__ = (UniqueConstraint("peer_id", "token"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    peer_id: Mapped[str] = mapped_column(ForeignKey("peers.peer_id"), index=True)
    started_at: Mapped[float]
    ended_at: Mapped[float | None]
    address: Mapped[str] = mapped_column(String(256))
    #: the volunteer process's random session token (NULL: opened at join by schema version <= 2)
    token: Mapped[str | None] = mapped_column(String(64))
    #: the last heartbeat (or the leave); a session silent for SESSION_TIMEOUT is closed at this time
    last_seen_at: Mapped[float | None]
    #: ``leave``, ``replaced`` or ``timeout``; NULL while open
    end_reason: Mapped[str | None] = mapped_column(String(16))


class Report(Base):
    __tablename__ = "reports"
    __table_args__ = (
        UniqueConstraint("peer_id", "seq"),
        CheckConstraint("status IN ('credited', 'flagged')", name="status"),
        # previous_end(): the latest credited interval of one peer
        Index(None, "peer_id", "status", "interval_end"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    peer_id: Mapped[str] = mapped_column(ForeignKey("peers.peer_id"))
    seq: Mapped[int]
    #: the user the peer belonged to when the report arrived: credit stays where it was earned
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    global_step: Mapped[int]
    samples: Mapped[int]
    compute_seconds: Mapped[float]
    bytes_aggregated: Mapped[int]
    bytes_relayed: Mapped[int]
    #: swarm bytes sent, claimed (schema 11; 0 in older rows and outside swarm runs)
    bytes_sent: Mapped[int] = mapped_column(default=0)
    interval_start: Mapped[float]
    interval_end: Mapped[float]
    received_at: Mapped[float]
    #: the signed msgpack bytes and signature exactly as received, so any row can be re-verified
    report_bytes: Mapped[bytes]
    signature: Mapped[bytes]
    status: Mapped[str] = mapped_column(String(16))
    flag_reason: Mapped[str | None]
    #: what receipts and pull records backed (see backbone.ledger.accounting); 0 when flagged
    credited_samples: Mapped[float] = mapped_column(default=0.0)
    credited_compute_seconds: Mapped[float] = mapped_column(default=0.0)
    credited_bytes_aggregated: Mapped[float] = mapped_column(default=0.0)
    #: relayed bytes its relay records backed (schema 8; 0 in older rows: relaying was not credited)
    credited_bytes_relayed: Mapped[float] = mapped_column(default=0.0)
    #: swarm bytes sent that received records and carried receipts backed (schema 11)
    credited_bytes_sent: Mapped[float] = mapped_column(default=0.0)
    #: 1: credited by the claims-based rules of schema version 1 (kept as history); 2: by receipts
    scheme: Mapped[int] = mapped_column(Integer, default=2)
    #: receipts and pull records that did not count, ``"code: count; ..."``
    notes: Mapped[str | None]


class Receipt(Base):
    """A part receipt that counts: ``aggregator`` (a peer of another user) averaged ``sender``'s parts
    of ``step`` with ``weight``. Counted as evidence only once ``step`` is in ``steps``."""

    __tablename__ = "receipts"
    # (step): whose evidence a newly recorded step makes count (version 5)
    __table_args__ = (Index(None, "held", "step"), Index(None, "step"))

    sender: Mapped[str] = mapped_column(String(64), primary_key=True)
    step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    aggregator: Mapped[str] = mapped_column(String(64))
    weight: Mapped[float]
    nbytes: Mapped[int]
    report_id: Mapped[int] = mapped_column(ForeignKey("reports.id"))
    #: 1 once the sender reported ``step`` discarded: not run progress, not credited
    discarded: Mapped[int] = mapped_column(Integer, default=0)
    #: 1 while ``step`` is not in ``steps`` (the store records it once the collaboration went past it)
    held: Mapped[int] = mapped_column(Integer, default=0)


class Discard(Base):
    """``peer_id`` reported, in its report ``seq``, that its steps ``first_step..last_step`` were
    discarded: it re-synced to a state that replaced them (a fork that did not survive). It covers the
    peer's receipts of those steps carried by its reports with a seq up to ``seq`` only: the same step
    numbers taken again later, with the survivors, are new work (``backbone.ledger.accounting``)."""

    __tablename__ = "step_discards"

    peer_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    first_step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    last_step: Mapped[int]
    report_id: Mapped[int] = mapped_column(ForeignKey("reports.id"))


class Pull(Base):
    """``puller`` (a peer of another user than ``aggregator``'s) pulled ``nbytes`` from ``aggregator``."""

    __tablename__ = "pulls"
    __table_args__ = (Index(None, "aggregator", "step"), Index(None, "step"))

    puller: Mapped[str] = mapped_column(String(64), primary_key=True)
    aggregator: Mapped[str] = mapped_column(String(64), primary_key=True)
    step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    nbytes: Mapped[int]
    report_id: Mapped[int] = mapped_column(ForeignKey("reports.id"))


class Relayed(Base):
    """``reporter`` received ``nbytes`` through relay ``relay`` (a peer of another user) in its report
    ``seq`` (schema 8; see backbone.ledger.accounting, "Relayed bytes")."""

    __tablename__ = "relayed"
    __table_args__ = (Index(None, "relay"),)

    reporter: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    relay: Mapped[str] = mapped_column(String(64), primary_key=True)
    nbytes: Mapped[int]
    report_id: Mapped[int] = mapped_column(ForeignKey("reports.id"))


class SwarmReceived(Base):
    """``reporter`` (a swarm trainer) received ``nbytes`` of answers from stage server ``server`` (a peer
    of another user) in its report ``seq`` (schema 11; see backbone.ledger.accounting, "Swarm bytes")."""

    __tablename__ = "swarm_received"
    __table_args__ = (Index(None, "server"),)

    reporter: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    server: Mapped[str] = mapped_column(String(64), primary_key=True)
    nbytes: Mapped[int]
    report_id: Mapped[int] = mapped_column(ForeignKey("reports.id"))


class Step(Base):
    __tablename__ = "steps"

    global_step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    finished_at: Mapped[float]
    loss: Mapped[float | None]
    samples: Mapped[int]
    peers: Mapped[int] = mapped_column(Integer)
    source: Mapped[str] = mapped_column(String(16), default="tracker")
    #: the run's target batch when a backbone recorded the step (``backbone ledger --steps`` shows the
    #: batch against it); NULL for steps only receipts evidenced and rows of schema version <= 4
    target_batch: Mapped[int | None] = mapped_column(Integer)


class StageStep(Base):
    """A step a swarm run's stage ``stage`` took (schema 9): ``steps``' columns, in stage-samples."""

    __tablename__ = "stage_steps"

    stage: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    finished_at: Mapped[float]
    loss: Mapped[float | None]
    samples: Mapped[int]
    peers: Mapped[int] = mapped_column(Integer)
    #: ``tracker`` (a backbone saw the stage take it) or ``receipts`` (a counting receipt, at or below
    #: the highest step of the stage a backbone saw taken)
    source: Mapped[str] = mapped_column(String(16), default="tracker")
    #: the run's target batch when the tracker recorded it (NULL: receipts)
    target_batch: Mapped[int | None] = mapped_column(Integer)


class StageReceipt(Base):
    """A receipt of a stage aggregator that counts (schema 9): ``aggregator`` (a peer of another user)
    averaged ``sender``'s parts of stage ``stage``'s ``step`` with ``weight`` stage-samples."""

    __tablename__ = "stage_receipts"
    __table_args__ = (Index(None, "held", "stage", "step"), Index(None, "stage", "step"))

    sender: Mapped[str] = mapped_column(String(64), primary_key=True)
    stage: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    aggregator: Mapped[str] = mapped_column(String(64))
    weight: Mapped[float]
    nbytes: Mapped[int]
    report_id: Mapped[int] = mapped_column(ForeignKey("reports.id"))
    #: 1 once the sender reported this stage step discarded (``stage_discards``): not credited
    discarded: Mapped[int] = mapped_column(Integer, default=0)
    #: 1 while (stage, step) is not in ``stage_steps``
    held: Mapped[int] = mapped_column(Integer, default=0)


class TrainerReceipt(Base):
    """A stage server's receipt for a swarm trainer that counts (schema 10): ``server`` (a peer of another
    user than ``trainer``'s) completed backwards of ``weight`` samples (cumulative) for ``trainer`` at stage
    ``stage`` toward its ``step``, receiving ``nbytes`` request bytes; ``report_id``: the report that
    brought the stored (largest) weight."""

    __tablename__ = "trainer_receipts"
    __table_args__ = (Index(None, "stage", "step"),)

    trainer: Mapped[str] = mapped_column(String(64), primary_key=True)
    server: Mapped[str] = mapped_column(String(64), primary_key=True)
    stage: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    weight: Mapped[float]
    nbytes: Mapped[int]
    report_id: Mapped[int] = mapped_column(ForeignKey("reports.id"))
    #: 1 once the trainer reported this stage step discarded (``stage_discards``, schema 12): its
    #: samples are not credited (its bytes still are: accounting, "Swarm runs")
    discarded: Mapped[int] = mapped_column(Integer, default=0)


class StageDiscard(Base):
    """``peer_id`` reported, in its report ``seq``, that its steps ``first_step..last_step`` of pipeline
    stage ``stage`` were discarded (schema 12): a stage state it loaded replaced them. As a
    :class:`Discard`, per stage: it covers the peer's stage and trainer's receipts of those stage steps
    carried by its reports with a seq up to ``seq`` only (``backbone.ledger.accounting``, "Swarm runs")."""

    __tablename__ = "stage_discards"

    peer_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    stage: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    first_step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    last_step: Mapped[int]
    report_id: Mapped[int] = mapped_column(ForeignKey("reports.id"))


class EvaluationRecord(Base):
    """``peer_id`` (of user ``user_id`` when it arrived) computed held-out loss ``loss`` over ``examples``
    examples (digest ``eval_set``) with the parameters of ``step`` (fingerprint ``params``); the signed
    bytes are kept as received, so any row can be re-verified."""

    __tablename__ = "evaluations"
    __table_args__ = (Index(None, "step"),)

    peer_id: Mapped[str] = mapped_column(ForeignKey("peers.peer_id"), primary_key=True)
    step: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    loss: Mapped[float]
    examples: Mapped[int]
    eval_set: Mapped[str] = mapped_column(String(64))
    params: Mapped[bytes]
    evaluated_at: Mapped[float]
    received_at: Mapped[float]
    evaluation_bytes: Mapped[bytes]
    signature: Mapped[bytes]


class SchemaVersion(Base):
    __tablename__ = "schema_version"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(Integer)


def _migrate_1_to_2(conn: Connection) -> None:
    """Version 2 credits reports by receipts. The new tables are made by ``create_all``; old reports get
    the credited_* columns holding what version 1 credited (claims-based: kept as history, scheme 1)."""
    for column, kind in (
        ("credited_samples", "DOUBLE PRECISION NOT NULL DEFAULT 0"),
        ("credited_compute_seconds", "DOUBLE PRECISION NOT NULL DEFAULT 0"),
        ("credited_bytes_aggregated", "DOUBLE PRECISION NOT NULL DEFAULT 0"),
        ("scheme", "INTEGER NOT NULL DEFAULT 2"),
        ("notes", "TEXT"),
    ):
        _add_column(conn, "reports", column, kind)
    conn.execute(
        text(
            "UPDATE reports SET scheme = 1, credited_samples = CASE WHEN status = 'credited' THEN samples "
            "ELSE 0 END, credited_compute_seconds = CASE WHEN status = 'credited' THEN compute_seconds "
            "ELSE 0 END, credited_bytes_aggregated = CASE WHEN status = 'credited' THEN bytes_aggregated "
            "ELSE 0 END"
        )
    )


def _migrate_2_to_3(conn: Connection) -> None:
    """Version 3: sessions per volunteer process (token, heartbeats, why it ended), steps with their
    source, receipts that can be discarded (their discards: ``step_discards``, version 4).

    Every row is kept. Old sessions (opened at join, never closed) get the peer's last-seen time as
    their last heartbeat, so the backbone's sweep closes them as ``timeout`` at that time; old steps are
    ``legacy`` (version 2 also wrote rows for steps it jumped over, which stay as they were credited)."""
    for table, column, kind in (
        ("sessions", "token", "VARCHAR(64)"),
        ("sessions", "last_seen_at", "DOUBLE PRECISION"),
        ("sessions", "end_reason", "VARCHAR(16)"),
        ("receipts", "discarded", "INTEGER NOT NULL DEFAULT 0"),
        ("receipts", "held", "INTEGER NOT NULL DEFAULT 0"),
        ("steps", "source", "VARCHAR(16) NOT NULL DEFAULT 'tracker'"),
    ):
        _add_column(conn, table, column, kind)
    conn.execute(
        text(
            "UPDATE sessions SET last_seen_at = COALESCE(ended_at, (SELECT peers.last_seen FROM peers "
            "WHERE peers.peer_id = sessions.peer_id), started_at)"
        )
    )
    conn.execute(text("UPDATE sessions SET end_reason = 'leave' WHERE ended_at IS NOT NULL"))
    conn.execute(text("UPDATE steps SET source = 'legacy'"))
    conn.execute(text("UPDATE receipts SET held = 1 WHERE step NOT IN (SELECT global_step FROM steps)"))
    if "ix_receipts_held_step" not in {i["name"] for i in inspect(conn).get_indexes("receipts")}:
        conn.execute(text("CREATE INDEX ix_receipts_held_step ON receipts (held, step)"))
    if "uq_sessions_peer_id_token" not in {i["name"] for i in inspect(conn).get_indexes("sessions")}:
        conn.execute(text("CREATE UNIQUE INDEX uq_sessions_peer_id_token ON sessions (peer_id, token)"))


def _migrate_3_to_4(conn: Connection) -> None:
    """Version 4 bounds each discard by the seq of the report that listed it (``step_discards``, made by
    ``create_all``): version 3's ``discards`` covered every later receipt of its steps, so steps a peer
    took again after re-syncing were never credited. Its rows move over with their report's seq (every
    row kept), and receipts it marked though a later report carried them are unmarked: they count from
    their sender's next report on (accounting's ``credit_due``)."""
    if "discards" not in inspect(conn).get_table_names():
        return
    conn.execute(
        text(
            "INSERT INTO step_discards (peer_id, seq, first_step, last_step, report_id) "
            "SELECT d.peer_id, r.seq, d.first_step, d.last_step, d.report_id "
            "FROM discards d JOIN reports r ON r.id = d.report_id"
        )
    )
    conn.execute(text("DROP TABLE discards"))
    conn.execute(
        text(
            "UPDATE receipts SET discarded = 0 WHERE discarded = 1 AND NOT EXISTS (SELECT 1 FROM "
            "step_discards d JOIN reports r ON r.id = receipts.report_id WHERE d.peer_id = receipts.sender "
            "AND receipts.step BETWEEN d.first_step AND d.last_step AND r.seq <= d.seq)"
        )
    )


def _migrate_4_to_5(conn: Connection) -> None:
    """Version 5 bounds how many machines an invite admits (``backbone allow add --max-uses N``). Old
    invites keep serving any number of machines (``max_uses`` NULL) and start counting from 0: which of
    the user's invites admitted which old peer was never recorded."""
    _add_column(conn, "invites", "uses", "BIGINT NOT NULL DEFAULT 0")
    _add_column(conn, "invites", "max_uses", "BIGINT")


def _migrate_5_to_6(conn: Connection) -> None:
    """Version 6 (issue 11): ``steps.target_batch`` (the step view shows each batch against it; NULL in
    old rows, whose target is not known), and indexes on the step of receipts and pull records (a step
    recorded late credits at once whoever they evidence)."""
    _add_column(conn, "steps", "target_batch", "INTEGER")
    for table in ("receipts", "pulls"):
        if f"ix_{table}_step" not in {i["name"] for i in inspect(conn).get_indexes(table)}:
            conn.execute(text(f"CREATE INDEX ix_{table}_step ON {table} (step)"))


def _migrate_6_to_7(conn: Connection) -> None:
    """Version 7 (issue 12): held-out evaluations, a new table (made by ``create_all``); no old row
    changes. Nothing else to do: the function marks the version step (and is where a change would go)."""


def _migrate_7_to_8(conn: Connection) -> None:
    """Version 8 (issue 14): relayed bytes are credited from relay records (table ``relayed``, made by
    ``create_all``) into ``reports.credited_bytes_relayed``; old reports were credited none by receipts
    (schema 1's claims-based credit stays in ``bytes_relayed``, shown for scheme 1 rows)."""
    _add_column(conn, "reports", "credited_bytes_relayed", "DOUBLE PRECISION NOT NULL DEFAULT 0")


def _migrate_8_to_9(conn: Connection) -> None:
    """Version 9 (issue 17 item 6): a swarm run's stage steps and stage receipts, two new tables (made by
    ``create_all``); no old row changes, so data-parallel credit is untouched."""


def _migrate_9_to_10(conn: Connection) -> None:
    """Version 10 (issue 17 item 6): swarm trainers' receipts, a new table (made by ``create_all``); no
    old row changes."""


def _migrate_10_to_11(conn: Connection) -> None:
    """Version 11 (issue 17 item 6): swarm bytes sent are claimed (``reports.bytes_sent``) and credited
    (``reports.credited_bytes_sent``) from trainers' received records (table ``swarm_received``, made by
    ``create_all``) and carried receipts' bytes; old reports claimed and were credited none."""
    _add_column(conn, "reports", "bytes_sent", "BIGINT NOT NULL DEFAULT 0")
    _add_column(conn, "reports", "credited_bytes_sent", "DOUBLE PRECISION NOT NULL DEFAULT 0")


def _migrate_11_to_12(conn: Connection) -> None:
    """Version 12 (issue 17, stage discards): the stage step ranges swarm peers report discarded (table
    ``stage_discards``, made by ``create_all``) and trainers' receipts that can be discarded
    (``trainer_receipts.discarded``). No report of an older version listed any, so every old row stays
    counted as it was."""
    _add_column(conn, "trainer_receipts", "discarded", "INTEGER NOT NULL DEFAULT 0")


def _add_column(conn: Connection, table: str, column: str, kind: str) -> None:
    """``ALTER TABLE table ADD COLUMN column kind`` unless the table has it: a table the upgrade's
    ``create_all`` just made (it did not exist in the old version) is in the newest shape already."""
    if column not in {c["name"] for c in inspect(conn).get_columns(table)}:
        conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {kind}"))


#: version N -> function bringing a version-N database to N + 1.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _migrate_1_to_2,
    2: _migrate_2_to_3,
    3: _migrate_3_to_4,
    4: _migrate_4_to_5,
    5: _migrate_5_to_6,
    6: _migrate_6_to_7,
    7: _migrate_7_to_8,
    8: _migrate_8_to_9,
    9: _migrate_9_to_10,
    10: _migrate_10_to_11,
    11: _migrate_11_to_12,
}


def create_schema(conn: Connection) -> None:
    """Create missing tables and bring the database to :data:`SCHEMA_VERSION`, in ``conn``'s transaction.

    Raises:
        LedgerError: the database has a newer schema than this code knows.
    """
    if conn.dialect.name == "postgresql":
        # Two processes opening a fresh database at once would both try CREATE TABLE.
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
    Base.metadata.create_all(conn)
    version = conn.execute(select(SchemaVersion.version)).scalar_one_or_none()
    if version is None:
        conn.execute(insert(SchemaVersion).values(id=1, version=SCHEMA_VERSION))
        return
    if version > SCHEMA_VERSION:
        raise LedgerError(
            f"the ledger database has schema version {version}, newer than this program's "
            f"{SCHEMA_VERSION}; upgrade the program"
        )
    for step in range(version, SCHEMA_VERSION):
        MIGRATIONS[step](conn)
    if version != SCHEMA_VERSION:
        conn.execute(update(SchemaVersion).values(version=SCHEMA_VERSION))
