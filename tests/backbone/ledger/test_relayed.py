"""Relayed bytes in the ledger (issue 14): a relay is credited min(its claim, what peers of other users
received through it), late evidence included, on SQLite and PostgreSQL (``ledger_url``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backbone.ledger import LedgerStore
from backbone.ledger.accounting import RelayEvidence, credited_relayed

from .reports import identity, make_report, sign
from .test_store import join

RELAY, RELAY_TWIN, CLIENT, OTHER_CLIENT = identity(61), identity(62), identity(63), identity(64)


def record(store: LedgerStore, who, seq: int, **fields):  # type: ignore[no-untyped-def]
    report = make_report(who, seq, **fields)
    return store.assess_and_record(sign(who, report), report, now=report.interval_end + 1)


def relayed_of(store: LedgerStore, username: str) -> int:
    return next(r.bytes_relayed for r in store.leaderboard() if r.username == username)


def test_a_relay_is_credited_what_peers_of_other_users_received_through_it(store: LedgerStore) -> None:
    join(store, "rita", RELAY, RELAY_TWIN)
    join(store, "carl", CLIENT)
    join(store, "olga", OTHER_CLIENT)
    # the clients report first: the relay has no report yet, so nothing is credited
    verdict = record(store, CLIENT, 0, samples=0, relayed={RELAY.peer_id: 3000})
    assert verdict is not None and verdict.notes is None and verdict.bytes_relayed == 0
    # the relay claims 10 000: credited what carl received (3000)
    verdict = record(store, RELAY, 0, samples=0, bytes_relayed=10_000)
    assert verdict is not None and verdict.bytes_relayed == 3000
    # its own user's machine vouches for nothing
    verdict = record(store, RELAY_TWIN, 0, samples=0, relayed={RELAY.peer_id: 5000})
    assert verdict is not None and verdict.notes == "relay_same_user: 1"
    assert relayed_of(store, "rita") == 3000
    # late evidence: olga's report arrives after the relay's and is credited to it at once
    record(store, OTHER_CLIENT, 0, samples=0, relayed={RELAY.peer_id: 4000})
    assert relayed_of(store, "rita") == 7000
    # never beyond the claim: more evidence adds nothing until the relay claims more
    record(store, CLIENT, 1, samples=0, relayed={RELAY.peer_id: 9000})
    assert relayed_of(store, "rita") == 10_000
    record(store, RELAY, 1, samples=0, bytes_relayed=2000)
    assert relayed_of(store, "rita") == 12_000
    # a replayed report (same peer id and seq) is credited once
    report = make_report(CLIENT, 1, samples=0, relayed={RELAY.peer_id: 9000})
    assert store.assess_and_record(sign(CLIENT, report), report, now=report.interval_end + 1) is None
    record(store, RELAY, 2, samples=0, bytes_relayed=10**9)
    assert relayed_of(store, "rita") == 16_000  # 3000 + 4000 + 9000, each report once
    assert {r.username: r.bytes_relayed for r in store.leaderboard()} == {
        "rita": 16_000,
        "carl": 0,
        "olga": 0,
    }


def test_records_naming_unknown_peers_or_the_reporter_itself_count_nothing(store: LedgerStore) -> None:
    join(store, "rita", RELAY)
    join(store, "carl", CLIENT)
    stranger = identity(65)
    verdict = record(store, CLIENT, 0, samples=0, relayed={stranger.peer_id: 10, CLIENT.peer_id: 10})
    assert verdict is not None and verdict.notes == "relay_same_user: 1; relay_unknown: 1"
    record(store, RELAY, 0, samples=0, bytes_relayed=100)
    assert relayed_of(store, "rita") == 0


def test_a_flagged_relay_report_is_credited_nothing(store: LedgerStore) -> None:
    join(store, "rita", RELAY)
    join(store, "carl", CLIENT)
    record(store, CLIENT, 0, samples=0, relayed={RELAY.peer_id: 500})
    verdict = record(store, RELAY, 0, samples=0, bytes_relayed=500, length=2 * 3600.0)  # too_long
    assert verdict is not None and not verdict.credited and verdict.bytes_relayed == 0
    assert relayed_of(store, "rita") == 0


def test_a_flagged_client_report_is_no_evidence(store: LedgerStore) -> None:
    join(store, "rita", RELAY)
    join(store, "carl", CLIENT)
    record(store, RELAY, 0, samples=0, bytes_relayed=10_000)
    record(store, CLIENT, 0, samples=0, relayed={RELAY.peer_id: 1000})
    overlapping = make_report(
        CLIENT, 1, start=make_report(CLIENT, 0).interval_start, samples=0, relayed={RELAY.peer_id: 5000}
    )
    verdict = store.assess_and_record(
        sign(CLIENT, overlapping), overlapping, now=overlapping.interval_end + 1
    )
    assert verdict is not None and not verdict.credited and verdict.notes == "relay_flagged: 1"
    assert relayed_of(store, "rita") == 1000


def test_a_version_7_ledger_gains_relay_records_keeping_its_rows(ledger_url: str) -> None:
    import sqlalchemy

    from backbone.ledger.schema import SCHEMA_VERSION

    with LedgerStore.open(ledger_url) as store:
        join(store, "rita", RELAY)
        join(store, "carl", CLIENT)
        record(store, RELAY, 0, samples=0, bytes_relayed=700)
    engine = sqlalchemy.create_engine(ledger_url)
    try:
        with engine.begin() as conn:  # what schema version 7 had: no relay records, no credited relaying
            conn.execute(sqlalchemy.text("DROP TABLE relayed"))
            conn.execute(sqlalchemy.text("ALTER TABLE reports DROP COLUMN credited_bytes_relayed"))
            conn.execute(sqlalchemy.text("UPDATE schema_version SET version = 7"))
        with LedgerStore.open(ledger_url) as store:
            assert relayed_of(store, "rita") == 0  # the old report is kept, credited no relaying
            assert [r.seq for r in store.peer_reports(RELAY.peer_id)] == [0]
            record(store, CLIENT, 0, samples=0, relayed={RELAY.peer_id: 300})  # late evidence
            assert relayed_of(store, "rita") == 300
        with engine.connect() as conn:
            version = conn.execute(sqlalchemy.text("SELECT version FROM schema_version")).scalar()
            assert version == SCHEMA_VERSION >= 8  # 9: the stage tables (issue 17)
    finally:
        engine.dispose()


_CLIENTS = [identity(n) for n in (70, 71, 72)]
_event = st.one_of(
    st.tuples(st.just("claim"), st.integers(0, 10**9)),
    st.tuples(st.just("client"), st.integers(0, 2), st.integers(0, 10**9)),
    st.tuples(st.just("replay"), st.integers(0, 2)),
)


@settings(max_examples=25, deadline=None)
@given(events=st.lists(_event, max_size=12), same_user=st.integers(0, 2))
def test_the_store_credits_each_relay_what_the_pure_rule_says_in_any_arrival_order(
    tmp_path_factory: pytest.TempPathFactory, events: list[tuple[int | str, ...]], same_user: int
) -> None:
    """Relay claims and client reports arrive interleaved (late evidence), clients resend reports
    (replays): the relay's credited total is always credited_relayed(claims, counted records), where the
    client ``same_user`` belongs to the relay's user (its records never count)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('relayed') / 'ledger.sqlite3'}"
    with LedgerStore.open(url) as store:
        join(store, "rita", RELAY, _CLIENTS[same_user])
        for i, client in enumerate(_CLIENTS):
            if i != same_user:
                join(store, f"user{i}", client)
        seqs = {i: 0 for i in range(3)}
        last: dict[int, tuple[int, int]] = {}  # client -> (seq, bytes) of its latest report
        relay_seq = claimed = 0
        evidence = []
        for event in events:
            if event[0] == "claim":
                record(store, RELAY, relay_seq, samples=0, bytes_relayed=int(event[1]))
                relay_seq += 1
                claimed += int(event[1])
            elif event[0] == "client":
                i, nbytes = int(event[1]), int(event[2])
                record(store, _CLIENTS[i], seqs[i], samples=0, relayed={RELAY.peer_id: nbytes})
                last[i] = (seqs[i], nbytes)
                if i != same_user:
                    evidence.append(RelayEvidence(_CLIENTS[i].peer_id, seqs[i], RELAY.peer_id, nbytes))
                seqs[i] += 1
            elif int(event[1]) in last:  # the same report again: recorded before, nothing new
                i = int(event[1])
                seq, nbytes = last[i]
                assert record(store, _CLIENTS[i], seq, samples=0, relayed={RELAY.peer_id: nbytes}) is None
            assert relayed_of(store, "rita") == round(credited_relayed(claimed, evidence))
