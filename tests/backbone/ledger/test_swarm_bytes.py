"""Swarm bytes in the ledger (issue 17 item 6; accounting's docstring, "Swarm bytes"), on SQLite and
PostgreSQL (``store``): a stage server is credited min(its claim, the answer bytes trainers of other users
say they received from it); a trainer min(its claim, the request bytes servers of other users signed in
their carried receipts of recorded stage steps). Lying claims, replays, own-user and unknown signers."""

from __future__ import annotations

import sqlalchemy

from backbone.ledger import LedgerStore, Verdict
from backbone.ledger.accounting import Credit, credit_due, received_evidence, relay_cap
from backbone.ledger.schema import SCHEMA_VERSION
from protocols.receipts import PartReceipt, SignedReceipt, sign_receipt
from shared.auth.keys import Identity

from .reports import RUN_ID, T0, identity, make_report, sign
from .test_stage_credit import join, stage_steps

SERVER, SERVER_TWIN, TRAINER, OTHER_TRAINER = identity(71), identity(72), identity(73), identity(74)


def record(store: LedgerStore, who: Identity, seq: int, **fields: object) -> Verdict | None:
    report = make_report(who, seq, samples=0, **fields)  # type: ignore[arg-type]
    return store.assess_and_record(sign(who, report), report, now=report.interval_end + 1)


def sent(store: LedgerStore) -> dict[str, int]:
    return {row.username: row.bytes_sent for row in store.leaderboard()}


def carried(
    server: Identity, trainer: Identity, stage: int, step: int, weight: float, nbytes: int
) -> SignedReceipt:
    body = PartReceipt(
        run_id=RUN_ID,
        aggregator=server.peer_id,
        sender=trainer.peer_id,
        step=step,
        group_id=b"",
        round=0,
        weight=weight,
        nbytes=nbytes,
        issued_at=T0,
        stage=stage,
        carried=True,
    )
    return sign_receipt(body, server.sign)


def test_schema_11_has_the_swarm_received_table_and_the_sent_columns(
    store: LedgerStore, ledger_url: str
) -> None:
    assert SCHEMA_VERSION >= 11
    engine = sqlalchemy.create_engine(ledger_url)
    try:
        with engine.connect() as conn:
            inspector = sqlalchemy.inspect(conn)
            assert "swarm_received" in inspector.get_table_names()
            columns = {c["name"] for c in inspector.get_columns("reports")}
    finally:
        engine.dispose()
    assert {"bytes_sent", "credited_bytes_sent"} <= columns


def test_received_evidence_counts_only_admitted_servers_of_other_users_capped_by_the_link() -> None:
    report = make_report(
        TRAINER,
        0,
        length=10.0,
        received={
            SERVER.peer_id: 500,
            SERVER_TWIN.peer_id: 10**15,
            OTHER_TRAINER.peer_id: 7,
            TRAINER.peer_id: 9,
        },
    )
    users = {SERVER.peer_id: 1, SERVER_TWIN.peer_id: 1, TRAINER.peer_id: 2}  # OTHER_TRAINER: not admitted
    counted, notes = received_evidence(report, 2, users)
    assert {(e.server, e.nbytes) for e in counted} == {
        (SERVER.peer_id, 500),
        (SERVER_TWIN.peer_id, relay_cap(10.0)),
    }
    assert notes == {"received_capped": 1, "received_unknown_server": 1, "received_same_user": 1}
    # the same records from a peer of the servers' own user vouch for nothing (nor one about itself)
    counted, notes = received_evidence(report, 1, users)
    assert counted == []
    assert notes == {"received_same_user": 3, "received_unknown_server": 1}


def test_credit_due_bounds_bytes_sent_by_claim_and_evidence() -> None:
    due = credit_due(Credit(bytes_sent=10_000), Credit(bytes_sent=3000), Credit())
    assert due.bytes_sent == 3000  # a lying claim gets what others signed
    due = credit_due(Credit(bytes_sent=1000), Credit(bytes_sent=3000), Credit(bytes_sent=400))
    assert due.bytes_sent == 600  # never beyond the claim, less what was credited already
    assert credit_due(Credit(bytes_sent=5), Credit(bytes_sent=3), Credit(bytes_sent=9)).bytes_sent == 0


def test_a_server_is_credited_what_trainers_of_other_users_received_from_it(store: LedgerStore) -> None:
    join(store, "sam", SERVER, SERVER_TWIN)
    join(store, "tina", TRAINER)
    join(store, "otto", OTHER_TRAINER)
    # the trainer reports first: nothing to credit yet (the server claimed nothing)
    verdict = record(store, TRAINER, 0, received={SERVER.peer_id: 3000})
    assert verdict is not None and verdict.notes is None and verdict.bytes_sent == 0
    # the server lies: it claims 10 000 and is credited what tina received (3000)
    verdict = record(store, SERVER, 0, bytes_sent=10_000)
    assert verdict is not None and verdict.bytes_sent == 3000
    # its own user's other machine vouches for nothing
    verdict = record(store, SERVER_TWIN, 0, received={SERVER.peer_id: 5000})
    assert verdict is not None and verdict.notes == "received_same_user: 1"
    assert sent(store)["sam"] == 3000
    # late evidence: otto's report arrives after the server's, credited to it at once
    record(store, OTHER_TRAINER, 0, received={SERVER.peer_id: 4000})
    assert sent(store)["sam"] == 7000
    # a replayed report (same peer id and seq) adds nothing
    report = make_report(OTHER_TRAINER, 0, samples=0, received={SERVER.peer_id: 4000})
    assert store.assess_and_record(sign(OTHER_TRAINER, report), report, now=report.interval_end + 1) is None
    # never beyond the claim: more evidence waits for a larger claim
    record(store, TRAINER, 1, received={SERVER.peer_id: 9000})
    assert sent(store)["sam"] == 10_000
    record(store, SERVER, 1, bytes_sent=10**9)
    assert sent(store) == {"sam": 16_000, "tina": 0, "otto": 0}  # 3000 + 4000 + 9000, each report once


def test_a_flagged_trainer_report_is_no_evidence_and_a_flagged_server_report_gets_nothing(
    store: LedgerStore,
) -> None:
    join(store, "sam", SERVER)
    join(store, "tina", TRAINER)
    record(store, SERVER, 0, bytes_sent=10_000)
    record(store, TRAINER, 0, received={SERVER.peer_id: 1000})
    overlapping = make_report(
        TRAINER, 1, start=make_report(TRAINER, 0).interval_start, samples=0, received={SERVER.peer_id: 5000}
    )
    verdict = store.assess_and_record(
        sign(TRAINER, overlapping), overlapping, now=overlapping.interval_end + 1
    )
    assert verdict is not None and not verdict.credited and verdict.notes == "received_flagged: 1"
    assert sent(store)["sam"] == 1000
    verdict = record(store, SERVER, 1, bytes_sent=500, length=2 * 3600.0)  # too_long: flagged
    assert verdict is not None and not verdict.credited and verdict.bytes_sent == 0


def test_a_trainer_is_credited_the_bytes_servers_of_other_users_signed_once_per_key(
    store: LedgerStore,
) -> None:
    join(store, "sam", SERVER, SERVER_TWIN)
    join(store, "tina", TRAINER)
    join(store, "otto", OTHER_TRAINER)
    stage_steps(store, 0, 1)
    # a lying claim: credited what sam's server signed it received (700), held stage 1 not yet
    verdict = record(
        store,
        TRAINER,
        0,
        bytes_sent=10**6,
        receipts=[carried(SERVER, TRAINER, 0, 1, 4, 700), carried(SERVER, TRAINER, 1, 1, 4, 300)],
    )
    assert verdict is not None and verdict.bytes_sent == 700
    assert verdict.notes == "trainer_receipt_held: 1"
    stage_steps(store, 1, 1)  # recorded later: the held receipt's bytes are settled at once
    assert sent(store)["tina"] == 1000
    # the same receipt replayed in a later report adds nothing; a larger cumulative one replaces it
    verdict = record(store, TRAINER, 1, receipts=[carried(SERVER, TRAINER, 0, 1, 4, 700)])
    assert verdict is not None and verdict.notes == "trainer_receipt_duplicate: 1" and verdict.bytes_sent == 0
    verdict = record(store, TRAINER, 2, receipts=[carried(SERVER, TRAINER, 0, 1, 6, 900)])
    assert verdict is not None and verdict.bytes_sent == 200  # 900 replaces 700: not 1600
    assert sent(store)["tina"] == 1200
    # a server of the trainer's own user, or one never admitted, vouches for nothing
    stranger = identity(79)
    join(store, "otto2", identity(78))
    verdict = record(
        store,
        OTHER_TRAINER,
        0,
        bytes_sent=10**6,
        receipts=[carried(stranger, OTHER_TRAINER, 0, 1, 4, 800)],
    )
    assert verdict is not None and verdict.bytes_sent == 0
    assert verdict.notes == "trainer_receipt_unknown_server: 1"
    store.redeem_invite(
        store.create_invite("otto", now=T0), stranger.peer_id, stranger.public_key_bytes, now=T0
    )
    verdict = record(store, OTHER_TRAINER, 1, receipts=[carried(stranger, OTHER_TRAINER, 0, 1, 5, 800)])
    assert verdict is not None and verdict.bytes_sent == 0 and verdict.notes == "trainer_receipt_same_user: 1"
    assert sent(store) == {"sam": 0, "tina": 1200, "otto": 0, "otto2": 0}


def test_a_volunteer_that_serves_and_trains_claims_both_directions_in_one_total(store: LedgerStore) -> None:
    join(store, "sam", SERVER)
    join(store, "tina", TRAINER)
    stage_steps(store, 0, 1)
    # sam serves (tina received 2000 from it) and trains through tina's server (which signed 500)
    record(store, TRAINER, 0, received={SERVER.peer_id: 2000})
    verdict = record(store, SERVER, 0, bytes_sent=2200, receipts=[carried(TRAINER, SERVER, 0, 1, 4, 500)])
    assert verdict is not None and verdict.bytes_sent == 2200  # min(2200, 2000 + 500)


def test_a_version_10_ledger_gains_swarm_bytes_keeping_its_rows(ledger_url: str) -> None:
    with LedgerStore.open(ledger_url) as store:
        join(store, "sam", SERVER)
        join(store, "tina", TRAINER)
        record(store, SERVER, 0, bytes_sent=0)
    engine = sqlalchemy.create_engine(ledger_url)
    try:
        with engine.begin() as conn:  # what schema version 10 had: no swarm bytes
            conn.execute(sqlalchemy.text("DROP TABLE swarm_received"))
            conn.execute(sqlalchemy.text("ALTER TABLE reports DROP COLUMN bytes_sent"))
            conn.execute(sqlalchemy.text("ALTER TABLE reports DROP COLUMN credited_bytes_sent"))
            conn.execute(sqlalchemy.text("UPDATE schema_version SET version = 10"))
        with LedgerStore.open(ledger_url) as store:
            assert sent(store)["sam"] == 0
            assert [r.seq for r in store.peer_reports(SERVER.peer_id)] == [0]  # the old report is kept
            record(store, TRAINER, 0, received={SERVER.peer_id: 300})
            record(store, SERVER, 1, bytes_sent=1000)
            assert sent(store)["sam"] == 300
        with engine.connect() as conn:
            assert (
                conn.execute(sqlalchemy.text("SELECT version FROM schema_version")).scalar() == SCHEMA_VERSION
            )
    finally:
        engine.dispose()
