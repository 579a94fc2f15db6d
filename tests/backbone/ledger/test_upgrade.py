"""A ledger and data dirs made by the code before issue 10 (commit b253b6f; ``tests/fixtures/b253b6f``,
made by its ``make_old.py``) open with this code: the ledger is migrated to the current schema version
keeping every row and every credit, on SQLite and (its rows copied into the old shape) on PostgreSQL."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy

from backbone.ledger import InviteRejected, LedgerStore
from backbone.ledger.schema import SCHEMA_VERSION
from shared.auth.authority import Authority
from tests.pg import PostgresCluster
from volunteer.journal import JOURNAL_FILE
from volunteer.reporting import Reporter

from .reports import T0, identity, make_report, receipt, sign
from .test_store import join, record

FIXTURE = Path(__file__).parents[2] / "fixtures" / "b253b6f"
ALICE, BOB, CAROL, DAVE, ERIN = identity(21), identity(22), identity(23), identity(24), identity(25)
#: the old code's leaderboard of the fixture: (username, samples, bytes aggregated, flagged reports)
OLD_BOARD = [("alice", 200, 0, 0), ("bob", 150, 1000, 0), ("carol", 0, 0, 1)]
TABLES = ("users", "invites", "peers", "sessions", "reports", "receipts", "pulls", "steps")


def old_rows() -> dict[str, list[tuple[object, ...]]]:
    with sqlite3.connect(FIXTURE / "backbone" / "ledger.sqlite3") as db:
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in TABLES}


def rows_now(url: str) -> dict[str, list[tuple[object, ...]]]:
    """The rows of each old table, the old columns only, in the old order."""
    old = {t: len(r[0]) if r else 0 for t, r in old_rows().items()}
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as conn:
            out = {}
            for table in TABLES:
                names = [c["name"] for c in sqlalchemy.inspect(conn).get_columns(table)][: old[table]]
                query = f"SELECT {', '.join(names)} FROM {table} ORDER BY 1, 2"
                out[table] = [tuple(r) for r in conn.execute(sqlalchemy.text(query))]
            return out
    finally:
        engine.dispose()


def check_upgraded(url: str) -> None:
    before = old_rows()
    LedgerStore.open(url).close()  # the migration
    after = rows_now(url)
    for table in TABLES:
        assert before[table] == after[table], table
    with LedgerStore.open(url) as store:
        board = [(r.username, r.samples, r.bytes_aggregated, r.flagged_reports) for r in store.leaderboard()]
        assert board == OLD_BOARD
        [alice_session] = store.sessions(ALICE.peer_id)
        [bob_session] = store.sessions(BOB.peer_id)
        assert (alice_session.end_reason, alice_session.ended_at) == ("leave", T0 + 50)
        assert bob_session.ended_at is None and bob_session.last_seen_at == T0 + 100  # bob's last seen
        assert store.close_silent_sessions(silent_since=T0 + 1000) == 1  # the sweep closes it
        assert {r.global_step: r.source for r in store.recent_steps()} == {
            1: "legacy",
            2: "legacy",
            3: "legacy",
        }
        # the upgraded ledger keeps working: a new report, a new session, a new step
        store.record_step(4, finished_at=T0 + 30, loss=None, samples=256, peers=2, target_batch=256)
        assert [r.target_batch for r in store.recent_steps()] == [256, None, None, None]  # version 5
        report = make_report(ALICE, 1, receipts=[receipt(BOB, ALICE, 4, 50)])
        verdict = store.assess_and_record(sign(ALICE, report), report, now=T0 + 3600)
        assert verdict is not None and verdict.samples == 50
        # schema 8: bob's machine received bytes through alice's (a relay): credited to alice
        relayed = make_report(BOB, 7, samples=0, relayed={ALICE.peer_id: 400})
        assert store.assess_and_record(sign(BOB, relayed), relayed, now=T0 + 3600) is not None
        claim = make_report(ALICE, 2, samples=0, bytes_relayed=1000)
        verdict = store.assess_and_record(sign(ALICE, claim), claim, now=T0 + 3600)
        assert verdict is not None and verdict.bytes_relayed == 400
        assert {r.username: r.bytes_relayed for r in store.leaderboard()}["alice"] == 400
        assert store.session_heartbeat(ALICE.peer_id, "c" * 32, "127.0.0.1", now=T0 + 3600)
        # schema 5: invites count their uses; a new one with a maximum admits that many machines
        secret = store.create_invite("bob", now=T0 + 3600, max_uses=1)
        assert store.redeem_invite(secret, DAVE.peer_id, DAVE.public_key_bytes, now=T0 + 3601) == "bob"
        with pytest.raises(InviteRejected, match="as many machines as it allows"):
            store.redeem_invite(secret, ERIN.peer_id, ERIN.public_key_bytes, now=T0 + 3602)
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as conn:
            assert (
                conn.execute(sqlalchemy.text("SELECT version FROM schema_version")).scalar() == SCHEMA_VERSION
            )
            old_invites = len(before["invites"])
            limits = conn.execute(sqlalchemy.text("SELECT uses, max_uses FROM invites ORDER BY id")).all()
            assert [tuple(r) for r in limits] == [(0, None)] * old_invites + [(1, 1)]  # old ones: no limit
            indexes = {
                i["name"] for t in ("receipts", "pulls") for i in sqlalchemy.inspect(conn).get_indexes(t)
            }
            assert {"ix_receipts_step", "ix_pulls_step"} <= indexes  # version 6
            assert "evaluations" in sqlalchemy.inspect(conn).get_table_names()  # version 7
            assert "relayed" in sqlalchemy.inspect(conn).get_table_names()  # version 8
            columns = {c["name"] for c in sqlalchemy.inspect(conn).get_columns("reports")}
            assert "credited_bytes_relayed" in columns
    finally:
        engine.dispose()


def test_a_sqlite_ledger_of_the_old_code_is_migrated_keeping_every_row(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE / "backbone", tmp_path / "bb")
    check_upgraded(f"sqlite:///{tmp_path / 'bb' / 'ledger.sqlite3'}")
    # the old backbone data dir's authority key still pins the same run
    old = Authority.load_or_create(FIXTURE / "backbone" / "authority.key")
    assert Authority.load_or_create(tmp_path / "bb" / "authority.key").fingerprint == old.fingerprint


def test_a_postgresql_ledger_of_the_old_code_is_migrated_keeping_every_row(postgres: PostgresCluster) -> None:
    url = postgres.create_database()
    source = sqlalchemy.create_engine(f"sqlite:///{FIXTURE / 'backbone' / 'ledger.sqlite3'}")
    target = sqlalchemy.create_engine(url)
    try:
        old = sqlalchemy.MetaData()
        old.reflect(source)
        for table in old.tables.values():  # SQLite's reflected types, in PostgreSQL's words
            for column in table.columns:
                if isinstance(column.type, sqlalchemy.LargeBinary):
                    column.type = sqlalchemy.LargeBinary()
                elif isinstance(column.type, sqlalchemy.Float):
                    column.type = sqlalchemy.Double()
        old.create_all(target)
        with source.connect() as src, target.begin() as dst:
            for table in old.sorted_tables:
                rows = [dict(r._mapping) for r in src.execute(table.select())]
                if rows:
                    dst.execute(table.insert(), rows)
                if "id" in table.columns and table.name != "schema_version":  # as if it had made them
                    dst.execute(
                        sqlalchemy.text(
                            f"SELECT setval(pg_get_serial_sequence('{table.name}', 'id'), "
                            f"(SELECT max(id) FROM {table.name}))"
                        )
                    )
    finally:
        source.dispose()
        target.dispose()
    check_upgraded(url)


def test_a_volunteer_data_dir_of_the_old_code_keeps_its_report_seq(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE / "volunteer", tmp_path / "vol")
    reporter = Reporter("r@x", ALICE, None, tmp_path / "vol")
    assert reporter.recovered == (0, 0) and (tmp_path / "vol" / JOURNAL_FILE).exists()
    reporter.book.add(1, [(BOB.peer_id, receipt(BOB, ALICE, 1, 1.0, run_id="r@x"))])
    reporter.close_interval()
    assert [r.seq for _, r in reporter._pending] == [7]  # report.seq of the old code said 7
    assert (tmp_path / "vol" / "report.seq").read_text().strip() == "8"


@pytest.mark.parametrize("table", TABLES)
def test_the_fixture_holds_rows_of_every_table(table: str) -> None:
    assert old_rows()[table]


def test_a_schema_3_ledger_gets_its_discards_bounded_by_their_report_seq(ledger_url: str) -> None:
    """Version 3 stored discards unbounded (``discards``) and so marked a receipt of a step taken again
    after the discard as discarded; version 4 moves each discard over with its report's seq and
    unmarks such receipts, which then count from their sender's next report."""
    with LedgerStore.open(ledger_url) as store:
        join(store, "alice", ALICE)
        join(store, "bob", BOB)
        for step in (1, 2, 3):
            assert store.record_step(step, finished_at=T0 + step, loss=None, samples=64, peers=2)
        forked = [receipt(BOB, ALICE, s, 32) for s in (1, 2)]
        assert record(store, ALICE, 0, samples=4 * 32, receipts=forked).samples == 2 * 32
        assert record(store, ALICE, 1, samples=0, discarded=[(1, 3)]).samples == -2 * 32
        assert record(store, ALICE, 2, samples=0, receipts=[receipt(BOB, ALICE, 3, 32)]).samples == 32
    engine = sqlalchemy.create_engine(ledger_url)
    try:
        with engine.begin() as conn:  # back into version 3's shape, as version 3 would have stored it
            for statement in (
                "CREATE TABLE discards (peer_id VARCHAR(64) NOT NULL, first_step BIGINT NOT NULL, "
                "last_step BIGINT NOT NULL, report_id BIGINT NOT NULL REFERENCES reports (id), "
                "PRIMARY KEY (peer_id, first_step))",
                "INSERT INTO discards SELECT peer_id, first_step, last_step, report_id FROM step_discards",
                "DROP TABLE step_discards",
                "UPDATE receipts SET discarded = 1 WHERE step = 3",
                "UPDATE reports SET credited_samples = 0 WHERE seq = 2",
                "UPDATE schema_version SET version = 3",
            ):
                conn.execute(sqlalchemy.text(statement))
    finally:
        engine.dispose()
    with LedgerStore.open(ledger_url) as store:
        assert store.discards(ALICE.peer_id) == [(1, 3)]
        [alice] = [row for row in store.leaderboard() if row.username == "alice"]
        assert (alice.samples, alice.discarded_samples) == (0, 2 * 32)
        assert record(store, ALICE, 3, samples=0).samples == 32  # step 3, taken again, counts now
        assert record(store, ALICE, 4, samples=0, discarded=[(3, 3)]).samples == -32  # bounded by seq
