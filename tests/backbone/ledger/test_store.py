"""LedgerStore against SQLite and a real PostgreSQL server (every test runs on both, see ``ledger_url``)."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import sqlalchemy
from hypothesis import given, settings
from hypothesis import strategies as st

from backbone.ledger import (
    Assessment,
    CapabilitiesRejected,
    InviteRejected,
    LedgerError,
    LedgerStore,
    PeerSeen,
    UnknownPeer,
    UnknownUser,
    Verdict,
    verify_report,
)
from backbone.ledger.accounting import CREDITED, reason_codes
from protocols.ledger import Capabilities
from protocols.receipts import PulledSlice
from shared.auth.keys import Identity
from shared.errors import ConfigError
from tests.pg import PostgresCluster

from .reports import CAPS, RUN_ID, T0, identity, make_report, receipt, sign

T = TypeVar("T")
LAPTOP, DESKTOP, SERVER, STRANGER = identity(11), identity(12), identity(13), identity(14)
FLAGGED = Assessment(credited=False, reason="test")


def join(store: LedgerStore, username: str, *machines: Identity, now: float = T0) -> str:
    """Allow ``username`` and admit each machine with one invite; returns the invite secret."""
    store.add_user(username, now=now)
    secret = store.create_invite(username, now=now)
    for machine in machines:
        assert store.redeem_invite(secret, machine.peer_id, machine.public_key_bytes, now=now) == username
        store.update_capabilities(machine.peer_id, CAPS, now=now)
    return secret


def race(n: int, fn: Callable[[int], T]) -> list[T]:
    """Run ``fn(0..n-1)`` in ``n`` threads released together; re-raise the first failure."""
    barrier = threading.Barrier(n)
    results: list[T | None] = [None] * n
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


# -------------------------------------------------------------------------------------- allowlist


def test_allowlist_lifecycle_add_invite_redeem_twice_remove(store: LedgerStore) -> None:
    store.add_user("alice", note="sahajBERT volunteer", now=T0)
    secret = store.create_invite("alice", now=T0 + 1)
    assert len(secret) == 43

    assert store.redeem_invite(secret, LAPTOP.peer_id, LAPTOP.public_key_bytes, now=T0 + 2) == "alice"
    assert store.redeem_invite(secret, DESKTOP.peer_id, DESKTOP.public_key_bytes, now=T0 + 3) == "alice"
    store.touch_peer(LAPTOP.peer_id, now=T0 + 10)

    [alice] = store.list_users()
    assert (alice.username, alice.note, alice.created_at, alice.revoked_at) == (
        "alice",
        "sahajBERT volunteer",
        T0,
        None,
    )
    assert alice.peers == (PeerSeen(LAPTOP.peer_id, T0 + 10), PeerSeen(DESKTOP.peer_id, T0 + 3))
    assert store.user_of_peer(DESKTOP.peer_id) == "alice"
    assert store.active_user_of_peer(DESKTOP.peer_id) == "alice"

    assert store.remove_user("alice", now=T0 + 20) is True
    assert store.remove_user("alice", now=T0 + 21) is False
    with pytest.raises(InviteRejected) as rejected:
        store.redeem_invite(secret, SERVER.peer_id, SERVER.public_key_bytes, now=T0 + 22)
    assert rejected.value.reason == "revoked user"
    assert store.revoked_users() == [("alice", T0 + 20)]
    assert store.user_of_peer(LAPTOP.peer_id) == "alice"
    assert store.active_user_of_peer(LAPTOP.peer_id) is None
    [alice] = store.list_users()
    assert alice.revoked_at == T0 + 20
    assert len(alice.peers) == 2


def test_add_user_again_is_idempotent_and_unrevokes_a_removed_user(store: LedgerStore) -> None:
    old_secret = join(store, "bob", LAPTOP)
    store.add_user("bob", now=T0 + 1)
    store.add_user("bob", note="new note", now=T0 + 2)
    [bob] = store.list_users()
    assert (bob.created_at, bob.note, bob.revoked_at) == (T0, "new note", None)

    store.remove_user("bob", now=T0 + 3)
    store.add_user("bob", now=T0 + 4)

    assert store.revoked_users() == []
    assert store.active_user_of_peer(LAPTOP.peer_id) == "bob"
    with pytest.raises(InviteRejected) as rejected:  # invites revoked with the user stay revoked
        store.redeem_invite(old_secret, DESKTOP.peer_id, DESKTOP.public_key_bytes, now=T0 + 5)
    assert rejected.value.reason == "revoked invite"
    fresh = store.create_invite("bob", now=T0 + 5)
    assert store.redeem_invite(fresh, DESKTOP.peer_id, DESKTOP.public_key_bytes, now=T0 + 6) == "bob"


def test_invite_expires_at_its_expiry_time(store: LedgerStore) -> None:
    store.add_user("carol", now=T0)
    secret = store.create_invite("carol", now=T0, expires_at=T0 + 10)
    assert store.redeem_invite(secret, LAPTOP.peer_id, LAPTOP.public_key_bytes, now=T0 + 9.9) == "carol"
    with pytest.raises(InviteRejected) as rejected:
        store.redeem_invite(secret, DESKTOP.peer_id, DESKTOP.public_key_bytes, now=T0 + 10)
    assert rejected.value.reason == "expired"
    assert [p.peer_id for p in store.list_users()[0].peers] == [LAPTOP.peer_id]


def test_redeem_unknown_code_is_rejected_as_unknown(store: LedgerStore) -> None:
    join(store, "dave")
    for secret in ("no-such-code", "x" * 10_000):
        with pytest.raises(InviteRejected) as rejected:
            store.redeem_invite(secret, LAPTOP.peer_id, LAPTOP.public_key_bytes, now=T0)
        assert rejected.value.reason == "unknown"
    assert store.user_of_peer(LAPTOP.peer_id) is None


def test_redeem_same_machine_again_refreshes_it_and_keeps_first_seen(store: LedgerStore) -> None:
    secret = join(store, "erin", LAPTOP)
    assert store.redeem_invite(f" {secret}\n", LAPTOP.peer_id, LAPTOP.public_key_bytes, now=T0 + 50) == "erin"
    [erin] = store.list_users()
    assert erin.peers == (PeerSeen(LAPTOP.peer_id, T0 + 50),)


def test_redeem_refuses_a_public_key_that_is_not_the_peer_ids(store: LedgerStore) -> None:
    secret = join(store, "frank")
    with pytest.raises(ValueError, match="public key"):
        store.redeem_invite(secret, LAPTOP.peer_id, DESKTOP.public_key_bytes, now=T0)


def test_create_invite_needs_an_active_user(store: LedgerStore) -> None:
    with pytest.raises(UnknownUser):
        store.create_invite("nobody", now=T0)
    store.add_user("gina", now=T0)
    store.remove_user("gina", now=T0)
    with pytest.raises(UnknownUser, match="revoked"):
        store.create_invite("gina", now=T0)
    store.add_user("gina", now=T0)
    with pytest.raises(ConfigError, match="future"):
        store.create_invite("gina", now=T0, expires_at=T0)


@pytest.mark.parametrize("username", ["", "x" * 65, " padded", "new\nline"])
def test_add_user_rejects_bad_usernames(store: LedgerStore, username: str) -> None:
    with pytest.raises(ConfigError, match="username"):
        store.add_user(username, now=T0)
    assert store.list_users() == []


def test_concurrent_add_user_and_redeem_of_one_name_and_machine(store: LedgerStore) -> None:
    race(6, lambda i: store.add_user("hana", now=T0 + i))
    secret = store.create_invite("hana", now=T0)
    names = race(6, lambda i: store.redeem_invite(secret, LAPTOP.peer_id, LAPTOP.public_key_bytes, now=T0))
    assert names == ["hana"] * 6
    [hana] = store.list_users()
    assert [p.peer_id for p in hana.peers] == [LAPTOP.peer_id]


# -------------------------------------------------------------------------------- peers, sessions


def test_capabilities_sessions_and_last_seen(store: LedgerStore) -> None:
    join(store, "ivan", LAPTOP)
    caps = Capabilities(samples_per_second=12.5, upload_bps=3e6, download_bps=4e6, device="RTX 3060")
    store.update_capabilities(LAPTOP.peer_id, caps, now=T0 + 1)
    assert store.capabilities(LAPTOP.peer_id) == caps

    first = store.open_session(LAPTOP.peer_id, "/ip4/192.0.2.1/tcp/4001", now=T0 + 2)
    second = store.open_session(LAPTOP.peer_id, "/ip4/192.0.2.1/tcp/4002", now=T0 + 3)
    assert first != second
    store.close_session(first, now=T0 + 30)
    store.close_session(first, now=T0 + 40)  # already closed: nothing happens
    store.close_session(10**9, now=T0 + 40)  # unknown: nothing happens
    assert store.list_users()[0].peers == (PeerSeen(LAPTOP.peer_id, T0 + 30),)
    store.touch_peer(LAPTOP.peer_id, now=T0 + 5)  # last seen never moves backwards
    assert store.list_users()[0].peers == (PeerSeen(LAPTOP.peer_id, T0 + 30),)


def test_peer_operations_on_an_unknown_peer_raise_unknown_peer(store: LedgerStore) -> None:
    with pytest.raises(UnknownPeer):
        store.update_capabilities(STRANGER.peer_id, CAPS, now=T0)
    with pytest.raises(UnknownPeer):
        store.touch_peer(STRANGER.peer_id, now=T0)
    with pytest.raises(UnknownPeer):
        store.open_session(STRANGER.peer_id, "/ip4/192.0.2.9/tcp/1", now=T0)
    report = make_report(STRANGER, 0)
    with pytest.raises(UnknownPeer):
        store.record_report(sign(STRANGER, report), report, CREDITED, now=T0)
    with pytest.raises(UnknownPeer):
        store.assess_and_record(sign(STRANGER, report), report, now=T0)
    assert store.capabilities(STRANGER.peer_id) is None
    assert store.report_counts() == {"credited": 0, "flagged": 0}


# ---------------------------------------------------------------------------------------- reports


def steps(store: LedgerStore, *numbers: int) -> None:
    for step in numbers:
        store.record_step(step, finished_at=T0 + step, loss=None, samples=0, peers=2)


def test_record_report_credits_a_duplicate_once(store: LedgerStore) -> None:
    join(store, "judy", LAPTOP)
    join(store, "bob", SERVER)
    steps(store, 0)
    report = make_report(LAPTOP, 0, receipts=[receipt(SERVER, LAPTOP, 0, 1000)])
    signed = sign(LAPTOP, report)

    assert store.record_report(signed, report, CREDITED, now=T0 + 61) is True
    assert store.record_report(signed, report, FLAGGED, now=T0 + 62) is False

    [stored] = store.peer_reports(LAPTOP.peer_id)
    assert (stored.seq, stored.status, stored.received_at, stored.signed) == (0, "credited", T0 + 61, signed)
    assert verify_report(stored.signed, RUN_ID) == report
    assert store.report_counts() == {"credited": 1, "flagged": 0}
    assert {r.username: r.samples for r in store.leaderboard()} == {"judy": report.samples, "bob": 0}


def test_record_report_refuses_a_report_that_is_not_the_signed_one(store: LedgerStore) -> None:
    join(store, "ken", LAPTOP)
    report = make_report(LAPTOP, 0)
    with pytest.raises(ValueError, match="verify_report"):
        store.record_report(sign(LAPTOP, make_report(LAPTOP, 1)), report, CREDITED, now=T0)
    assert store.peer_reports(LAPTOP.peer_id) == []


def test_record_report_eight_threads_racing_the_same_report_write_one_row(store: LedgerStore) -> None:
    join(store, "lena", LAPTOP)
    report = make_report(LAPTOP, 5)
    signed = sign(LAPTOP, report)

    results = race(8, lambda _: store.record_report(signed, report, CREDITED, now=T0))

    assert sorted(results) == [False] * 7 + [True]
    assert [r.seq for r in store.peer_reports(LAPTOP.peer_id)] == [5]
    assert store.report_counts() == {"credited": 1, "flagged": 0}


def test_assess_and_record_flags_against_the_previous_unflagged_report(store: LedgerStore) -> None:
    join(store, "mia", LAPTOP, DESKTOP)
    first = make_report(LAPTOP, 0)
    overlapping = make_report(LAPTOP, 1, start=first.interval_start + 30)
    endless = make_report(LAPTOP, 2, start=first.interval_end, length=7200.0)
    honest = make_report(LAPTOP, 3, start=first.interval_end)
    now = T0 + 3600

    assert credited(store.assess_and_record(sign(LAPTOP, first), first, now=now))
    assert store.assess_and_record(sign(LAPTOP, first), first, now=now) is None
    assert store.previous_end(LAPTOP.peer_id) == first.interval_end
    verdict = store.assess_and_record(sign(LAPTOP, overlapping), overlapping, now=now + 7200)
    assert verdict is not None and (verdict.reason or "").startswith("overlap:")
    verdict = store.assess_and_record(sign(LAPTOP, endless), endless, now=now + 7200)
    assert verdict is not None and (verdict.reason or "").startswith("too_long:")
    assert store.previous_end(LAPTOP.peer_id) == first.interval_end  # flagged reports do not count
    assert credited(store.assess_and_record(sign(LAPTOP, honest), honest, now=now))
    assert store.previous_end(LAPTOP.peer_id) == honest.interval_end
    assert store.previous_end(DESKTOP.peer_id) is None
    assert [r.status for r in store.peer_reports(LAPTOP.peer_id)] == [
        "credited",
        "flagged",
        "flagged",
        "credited",
    ]
    [mia] = store.leaderboard()
    assert (mia.flagged_reports, mia.flag_reasons) == (2, {"overlap": 1, "too_long": 1})


def credited(verdict: Verdict | None) -> bool:
    return verdict is not None and verdict.credited


def test_assess_and_record_racing_overlapping_reports_credits_one(store: LedgerStore) -> None:
    join(store, "omar", LAPTOP)
    reports = [make_report(LAPTOP, seq, start=T0) for seq in range(8)]  # eight claims on the same minute

    verdicts = race(8, lambda i: store.assess_and_record(sign(LAPTOP, reports[i]), reports[i], now=T0 + 60))

    assert sorted(v.credited for v in verdicts if v is not None) == [False] * 7 + [True]
    assert store.report_counts() == {"credited": 1, "flagged": 7}


# --------------------------------------------------------------------------- receipt-backed credit


def record(store: LedgerStore, who: Identity, seq: int, now: float = T0 + 3600, **fields: object) -> Verdict:
    report = make_report(who, seq, **fields)  # type: ignore[arg-type]
    verdict = store.assess_and_record(sign(who, report), report, now=now)
    assert verdict is not None
    return verdict


def board(store: LedgerStore) -> dict[str, tuple[int, int]]:
    return {row.username: (row.samples, row.bytes_aggregated) for row in store.leaderboard()}


def test_a_lone_volunteers_work_is_recorded_and_credited_nothing(store: LedgerStore) -> None:
    join(store, "nina", LAPTOP)
    steps(store, 0, 1)
    verdict = record(store, LAPTOP, 0, samples=10**6, bytes_aggregated=10**9)
    assert verdict.credited and verdict.samples == 0 and verdict.reason is None
    assert board(store) == {"nina": (0, 0)}


def test_an_honest_run_of_two_users_is_credited_what_the_receipts_back(store: LedgerStore) -> None:
    join(store, "alice", LAPTOP)
    join(store, "bob", SERVER)
    steps(store, 1, 2)
    # alice's laptop aggregated bob's parts of steps 1 and 2 and pulled bob's averaged slices, and back
    alice = record(
        store,
        LAPTOP,
        0,
        samples=300,
        bytes_aggregated=5000,
        receipts=[receipt(SERVER, LAPTOP, 1, 100), receipt(SERVER, LAPTOP, 2, 200)],
        pulled=[PulledSlice(SERVER.peer_id, 1, 1500), PulledSlice(SERVER.peer_id, 2, 1500)],
    )
    assert (alice.samples, alice.bytes_aggregated) == (300, 0)  # nobody reported pulling from alice yet
    bob = record(
        store,
        SERVER,
        0,
        samples=250,
        bytes_aggregated=2000,
        receipts=[receipt(LAPTOP, SERVER, 1, 120), receipt(LAPTOP, SERVER, 2, 130)],
        pulled=[PulledSlice(LAPTOP.peer_id, 1, 2500), PulledSlice(LAPTOP.peer_id, 2, 2500)],
    )
    assert (bob.samples, bob.bytes_aggregated) == (250, 2000)  # capped by its claim, not 3000 pulled
    # bob's pull records back alice's aggregation at once, though she never reports again (issue 11: a
    # volunteer that left showed "aggregated 0.0 MB": its evidence waited for a next report)
    assert board(store) == {"alice": (300, 5000), "bob": (250, 2000)}
    later = record(store, LAPTOP, 1, samples=0)
    assert later.bytes_aggregated == 0  # credited already: nothing twice
    assert board(store) == {"alice": (300, 5000), "bob": (250, 2000)}


def test_receipts_of_an_aggregating_backbone_credit_client_mode_volunteers(store: LedgerStore) -> None:
    """Issue 14: volunteers that all run in client mode average through a backbone, the only aggregator;
    its receipts count once the backbone is registered (before: ``receipt_unknown_aggregator``)."""
    backbone = identity(15)
    join(store, "alice", LAPTOP)
    steps(store, 1, 1)
    before = record(store, LAPTOP, 0, samples=100, receipts=[receipt(backbone, LAPTOP, 1, 100)])
    assert before.samples == 0
    store.register_backbone(backbone.peer_id, backbone.public_key_bytes, now=T0)
    store.register_backbone(backbone.peer_id, backbone.public_key_bytes, now=T0 + 1)  # idempotent
    steps(store, 2, 2)
    after = record(store, LAPTOP, 1, samples=100, receipts=[receipt(backbone, LAPTOP, 2, 100)])
    assert after.samples == 100
    assert [u.username for u in store.list_users()] == ["alice"]  # the reserved user is not listed
    with pytest.raises(ConfigError, match="another user"):
        store.register_backbone(LAPTOP.peer_id, LAPTOP.public_key_bytes, now=T0)  # alice's machine


def test_receipts_of_the_same_user_forged_or_unknown_are_not_credited(store: LedgerStore) -> None:
    join(store, "alice", LAPTOP, DESKTOP)
    join(store, "bob", SERVER)
    steps(store, 1, 2, 3, 4, 5)
    verdict = record(
        store,
        LAPTOP,
        0,
        samples=10**6,
        receipts=[
            receipt(DESKTOP, LAPTOP, 1, 10**5),  # alice's other machine vouches for alice
            receipt(LAPTOP, LAPTOP, 2, 10**5),  # alice vouches for herself
            receipt(SERVER, LAPTOP, 3, 10**5, signer=LAPTOP),  # forged: bob never signed it
            receipt(STRANGER, LAPTOP, 4, 10**5),  # a peer the ledger does not know
            receipt(SERVER, LAPTOP, 5, 10**5, run_id="another-run"),
            receipt(SERVER, DESKTOP, 5, 10**5),  # bob's receipt, but about alice's other machine
        ],
        pulled=[PulledSlice(DESKTOP.peer_id, 1, 10**9)],  # alice's own machine, pulled by alice
    )
    assert verdict.credited and verdict.samples == 0
    assert verdict.notes == (
        "pull_same_user: 1; receipt_bad_signature: 1; receipt_own: 1; receipt_same_user: 1; "
        "receipt_unknown_aggregator: 1; receipt_wrong_run: 1; receipt_wrong_sender: 1"
    )
    assert record(store, DESKTOP, 0, samples=0).bytes_aggregated == 0
    assert board(store) == {"alice": (0, 0), "bob": (0, 0)}


def test_each_sender_step_is_credited_once_and_held_until_the_step_is_recorded(store: LedgerStore) -> None:
    join(store, "alice", LAPTOP)
    join(store, "bob", SERVER, DESKTOP)
    steps(store, 1)
    first = record(
        store,
        LAPTOP,
        0,
        samples=200,
        receipts=[
            receipt(SERVER, LAPTOP, 1, 100),
            receipt(DESKTOP, LAPTOP, 1, 90),
            receipt(SERVER, LAPTOP, 2, 100),
        ],
    )
    assert first.samples == 100  # step 1 once (the larger weight), step 2 not recorded yet: held
    assert first.notes == "receipt_duplicate: 1; receipt_held: 1"
    replayed = record(
        store,
        LAPTOP,
        1,
        samples=100,
        receipts=[receipt(SERVER, LAPTOP, 1, 100), receipt(DESKTOP, LAPTOP, 1, 99)],
    )
    assert replayed.samples == 0 and replayed.notes == "receipt_duplicate: 2"  # within it, and stored
    steps(store, 2)
    assert board(store)["alice"] == (200, 0)  # the held receipt counts once its step is recorded
    assert record(store, LAPTOP, 2, samples=0).samples == 0  # and is not credited twice


def test_credit_never_exceeds_the_claims_nor_the_steps_recorded_samples(store: LedgerStore) -> None:
    join(store, "alice", LAPTOP)
    join(store, "bob", SERVER)
    store.record_step(1, finished_at=T0, loss=None, samples=64, peers=2)
    store.record_step(2, finished_at=T0, loss=None, samples=0, peers=0)  # jumped over: samples unknown
    verdict = record(store, LAPTOP, 0, samples=1000, receipts=[receipt(SERVER, LAPTOP, 1, 10**6)])
    assert verdict.samples == 64  # the whole collaboration's batch of step 1
    assert record(store, LAPTOP, 1, samples=10, receipts=[]).samples == 0
    verdict = record(store, LAPTOP, 2, samples=10**6, receipts=[receipt(SERVER, LAPTOP, 2, 10**6)])
    assert verdict.samples == 64  # the largest batch the run recorded


def test_a_same_user_receipt_does_not_shadow_another_users_of_the_same_step(store: LedgerStore) -> None:
    join(store, "alice", LAPTOP, DESKTOP)
    join(store, "bob", SERVER)
    steps(store, 1)
    receipts = [receipt(DESKTOP, LAPTOP, 1, 50), receipt(SERVER, LAPTOP, 1, 50)]
    verdict = record(store, LAPTOP, 0, samples=50, receipts=receipts)
    assert (verdict.samples, verdict.notes) == (50, "receipt_same_user: 1")


def test_an_interval_begun_long_ago_is_flagged_and_credits_nothing(store: LedgerStore) -> None:
    join(store, "alice", LAPTOP)
    join(store, "bob", SERVER)
    steps(store, 1)
    now = T0 + 10**9
    verdict = record(
        store,
        LAPTOP,
        0,
        now=now,
        start=T0,
        length=10**9,
        samples=10**12,
        receipts=[receipt(SERVER, LAPTOP, 1, 100)],
    )
    assert not verdict.credited and verdict.samples == 0
    assert set(reason_codes(verdict.reason)) == {"too_long"}  # it began when the peer joined
    assert board(store)["alice"] == (0, 0)


def test_capabilities_beyond_sane_limits_are_refused_and_claims_capped_by_history(store: LedgerStore) -> None:
    join(store, "alice", LAPTOP)
    join(store, "bob", SERVER)
    with pytest.raises(CapabilitiesRejected):
        store.update_capabilities(LAPTOP.peer_id, Capabilities(1e12, 1e6, 1e6, "liar"), now=T0)
    bold = Capabilities(5000.0, 1e6, 1e6, "gpu")
    assert store.update_capabilities(LAPTOP.peer_id, bold, now=T0) == bold  # no history yet
    steps(store, 1)
    record(store, LAPTOP, 0, samples=6000, receipts=[receipt(SERVER, LAPTOP, 1, 6000)])  # 100/s for 60 s
    held = store.update_capabilities(LAPTOP.peer_id, bold, now=T0)
    assert held.samples_per_second == pytest.approx(200.0)  # twice what its receipts show
    assert store.capabilities(LAPTOP.peer_id) == held


# ------------------------------------------------------------------------------ leaderboard, steps


def test_leaderboard_sums_credited_reports_and_counts_flagged_ones(store: LedgerStore) -> None:
    join(store, "alice", LAPTOP, DESKTOP)
    join(store, "bob", SERVER)
    store.add_user("carol", now=T0)
    steps(store, 1, 2, 3)
    for who, seq, samples, assessment in [
        (LAPTOP, 0, 1000, CREDITED),
        (LAPTOP, 1, 2000, CREDITED),
        (DESKTOP, 0, 500, CREDITED),
        (SERVER, 0, 3000, CREDITED),
        (SERVER, 1, 10**9, FLAGGED),
        (SERVER, 2, 10**9, FLAGGED),
    ]:
        other = SERVER if who is not SERVER else LAPTOP
        report = make_report(
            who,
            seq,
            samples=samples,
            bytes_relayed=seq,
            receipts=[receipt(other, who, seq + 1, samples)],
        )
        assert store.record_report(sign(who, report), report, assessment, now=T0 + 1000 + seq)

    alice, bob, carol = store.leaderboard()

    assert (alice.username, alice.samples, alice.bytes_relayed) == ("alice", 3500, 0)
    assert math.isclose(alice.compute_hours, 3 * 60 / 3600)
    assert (alice.peers, alice.last_seen, alice.flagged_reports) == (2, T0 + 1001, 0)
    assert (bob.username, bob.samples, bob.bytes_relayed) == ("bob", 3000, 0)
    assert (bob.peers, bob.last_seen, bob.flagged_reports) == (1, T0 + 1002, 2)
    assert bob.flag_reasons == {"other": 2}
    assert math.isclose(bob.compute_hours, 60 / 3600)
    assert (carol.username, carol.samples, carol.compute_hours, carol.peers, carol.last_seen) == (
        "carol",
        0,
        0.0,
        0,
        None,
    )
    assert store.report_counts() == {"credited": 4, "flagged": 2}


def test_leaderboard_keeps_credit_with_the_user_of_the_time(store: LedgerStore) -> None:
    join(store, "paul", LAPTOP)
    join(store, "bob", SERVER)
    steps(store, 0)
    report = make_report(LAPTOP, 0, receipts=[receipt(SERVER, LAPTOP, 0, 1000)])
    store.record_report(sign(LAPTOP, report), report, CREDITED, now=T0)
    secret = join(store, "quinn")
    store.redeem_invite(secret, LAPTOP.peer_id, LAPTOP.public_key_bytes, now=T0 + 1)  # the machine moves
    board = {row.username: row for row in store.leaderboard()}
    assert (board["paul"].samples, board["paul"].peers) == (report.samples, 0)
    assert (board["quinn"].samples, board["quinn"].peers) == (0, 1)


@pytest.mark.parametrize("username", ["backbone", "Backbone"])
def test_the_backbones_username_is_reserved(store: LedgerStore, username: str) -> None:
    with pytest.raises(ConfigError, match="reserved"):
        store.add_user(username, now=T0)
    assert store.list_users() == []


def test_record_step_is_idempotent(store: LedgerStore) -> None:
    assert store.record_step(1, finished_at=T0, loss=2.5, samples=4096, peers=3) is True
    assert store.record_step(1, finished_at=T0 + 9, loss=9.9, samples=1, peers=1) is False
    assert store.record_step(2, finished_at=T0 + 10, loss=math.nan, samples=4096, peers=2) is True
    assert (
        race(4, lambda i: store.record_step(3, finished_at=T0 + 20, loss=None, samples=i, peers=1)).count(
            True
        )
        == 1
    )
    with pytest.raises(ValueError, match="negative"):
        store.record_step(4, finished_at=T0, loss=None, samples=-1, peers=1)
    steps = store.recent_steps(limit=2)
    assert [(s.global_step, s.loss, s.peers) for s in steps] == [(3, None, 1), (2, None, 2)]
    assert store.recent_steps()[-1] == type(steps[0])(1, T0, 2.5, 4096, 3)


# ---------------------------------------------------------------------------------- open / close


def test_open_again_keeps_everything(ledger_url: str) -> None:
    with LedgerStore.open(ledger_url) as store:
        join(store, "rita", LAPTOP)
        report = make_report(LAPTOP, 0)
        store.record_report(sign(LAPTOP, report), report, CREDITED, now=T0)
    with LedgerStore.open(ledger_url) as store:
        assert store.user_of_peer(LAPTOP.peer_id) == "rita"
        assert store.record_report(sign(LAPTOP, report), report, CREDITED, now=T0) is False


def test_open_refuses_a_database_with_a_newer_schema(ledger_url: str) -> None:
    LedgerStore.open(ledger_url).close()
    engine = sqlalchemy.create_engine(ledger_url)
    try:
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text("UPDATE schema_version SET version = 99"))
    finally:
        engine.dispose()
    with pytest.raises(LedgerError, match="schema version 99"):
        LedgerStore.open(ledger_url)


def test_open_migrates_a_version_1_ledger_keeping_its_credit_as_history(ledger_url: str) -> None:
    with LedgerStore.open(ledger_url) as store:
        join(store, "alice", LAPTOP)
        join(store, "bob", SERVER)
        old = make_report(LAPTOP, 0, samples=777, bytes_aggregated=5)
        store.record_report(sign(LAPTOP, old), old, CREDITED, now=T0)
    engine = sqlalchemy.create_engine(ledger_url)
    try:  # make it the version-1 shape: no receipts or pulls tables, no credited_* columns
        with engine.begin() as conn:
            for table in ("receipts", "pulls"):
                conn.execute(sqlalchemy.text(f"DROP TABLE {table}"))
            for column in (
                "credited_samples",
                "credited_compute_seconds",
                "credited_bytes_aggregated",
                "scheme",
                "notes",
            ):
                conn.execute(sqlalchemy.text(f"ALTER TABLE reports DROP COLUMN {column}"))
            conn.execute(sqlalchemy.text("UPDATE schema_version SET version = 1"))
    finally:
        engine.dispose()
    with LedgerStore.open(ledger_url) as store:
        [alice, bob] = store.leaderboard()
        assert (alice.samples, alice.bytes_aggregated, bob.samples) == (777, 5, 0)  # version 1's credit
        steps(store, 1)
        new = make_report(LAPTOP, 1, samples=100, receipts=[receipt(SERVER, LAPTOP, 1, 100)])
        verdict = store.assess_and_record(sign(LAPTOP, new), new, now=T0 + 3600)
        assert verdict is not None and verdict.samples == 100  # history does not eat into new credit
        assert store.leaderboard()[0].samples == 877


def test_closed_store_raises_ledger_error(store: LedgerStore) -> None:
    store.close()
    store.close()
    with pytest.raises(LedgerError, match="closed"):
        store.list_users()


@pytest.mark.parametrize(
    "url",
    [
        "not a url",
        "sqlite://",
        "sqlite:///:memory:",
        "mysql://root@localhost/ledger",
        "postgresql+psycopg2://postgres@localhost/ledger",
        "sqlite+aiosqlite:///x.db",
    ],
)
def test_open_refuses_unsupported_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        LedgerStore.open(url)


def test_open_unreachable_postgresql_raises_ledger_error_without_the_password() -> None:
    with pytest.raises(LedgerError) as raised:
        LedgerStore.open("postgresql://postgres:hunter2@127.0.0.1:1/ledger")
    assert "hunter2" not in str(raised.value)
    assert "127.0.0.1" in str(raised.value)


def test_open_sqlite_creates_the_directory_and_uses_wal(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "ledger.sqlite3"
    with LedgerStore.open(f"sqlite:///{path}") as store:
        assert store.dialect == "sqlite"
        join(store, "sam", LAPTOP)
        secret = store.create_invite("sam", now=T0)
    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            hashes = conn.exec_driver_sql("SELECT code_hash FROM invites").scalars().all()
    finally:
        engine.dispose()
    assert secret not in path.read_bytes().decode("latin-1")  # only sha256(secret) is stored
    assert all(len(h) == 64 for h in hashes)


def test_open_postgresql_accepts_the_plain_postgresql_scheme(postgres: PostgresCluster) -> None:
    url = postgres.create_database()
    with LedgerStore.open(url.replace("postgresql+psycopg://", "postgresql://")) as store:
        assert store.dialect == "postgresql"


_events = st.lists(
    st.tuples(
        st.integers(0, 2),  # which of alice's machines reports (2: her second machine, same user)
        st.integers(0, 2000),  # claimed samples
        st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6), st.integers(0, 500)), max_size=4),
    ),
    min_size=1,
    max_size=6,
)


def test_credit_is_never_more_than_claims_nor_distinct_receipts_of_other_users(tmp_path: Path) -> None:
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as store:
        steps(store, *range(1, 7))
        users = itertools.count()

        @settings(max_examples=30, deadline=None)
        @given(events=_events)
        def check(events: list[tuple[int, int, list[tuple[int, int, int]]]]) -> None:
            # aggregators 0, 1: bob's machines; 2: alice's other machine; 3: unknown to the ledger
            n = next(users)
            alice = [Identity.generate() for _ in range(3)]
            bob = [Identity.generate() for _ in range(2)]
            join(store, f"alice{n}", *alice)
            join(store, f"bob{n}", *bob)
            aggregators = [bob[0], bob[1], alice[2], Identity.generate()]
            claims = {a.peer_id: 0 for a in alice}
            best: dict[tuple[str, int], int] = {}
            seqs = {a.peer_id: 0 for a in alice}
            for who, samples, receipts in events:
                peer = alice[who]
                seq = seqs[peer.peer_id]
                seqs[peer.peer_id] += 1
                signed = [receipt(aggregators[a], peer, s, w) for a, s, w in receipts]
                verdict = record(store, peer, seq, samples=samples, receipts=signed, now=T0 + 3600)
                assert verdict.credited and verdict.samples >= 0
                claims[peer.peer_id] += samples
                for a, s, _ in receipts:
                    if a < 2 and (peer.peer_id, s) not in best:
                        best[(peer.peer_id, s)] = max(w for a2, s2, w in receipts if a2 < 2 and s2 == s)
            for peer in alice:
                credited = sum(r.credited_samples for r in store.peer_reports(peer.peer_id))
                evidence = sum(w for (p, _), w in best.items() if p == peer.peer_id)
                assert credited == pytest.approx(min(claims[peer.peer_id], evidence))

        check()
