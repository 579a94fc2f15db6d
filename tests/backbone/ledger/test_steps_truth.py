"""Only steps the collaboration really took are run progress: steps the tracker jumped over are recorded
from receipts of two users (below the tracker's frontier), a lone fork earns nothing, and steps a peer
reports discarded are taken back (SQLite and PostgreSQL, see ``ledger_url``)."""

from __future__ import annotations

from backbone.ledger import LedgerStore

from .reports import T0, identity, receipt
from .test_store import board, join, record

LAPTOP, DESKTOP, SERVER = identity(51), identity(52), identity(53)


def tracked(store: LedgerStore, *numbers: int, peers: int = 2) -> None:
    for step in numbers:
        assert store.record_step(step, finished_at=T0 + step, loss=None, samples=64, peers=peers)


def sources(store: LedgerStore) -> dict[int, str]:
    return {row.global_step: row.source for row in store.recent_steps(1000)}


def test_a_lone_fork_earns_no_run_progress_credit(store: LedgerStore) -> None:
    """alice and bob average steps 1-3; then alice's two machines step alone (4-40), vouching for each
    other; the tracker even follows her fork. Only steps 1-3 are credited."""
    join(store, "alice", LAPTOP, DESKTOP)
    join(store, "bob", SERVER)
    tracked(store, 1, 2, 3)
    together = [receipt(SERVER, LAPTOP, s, 32) for s in (1, 2, 3)]
    assert record(store, LAPTOP, 0, samples=96, receipts=together).samples == 96
    tracked(store, *range(4, 41), peers=1)  # a backbone that followed the fork records its steps
    alone = [receipt(DESKTOP, LAPTOP, s, 32) for s in range(4, 36)]  # her other machine vouches
    verdict = record(store, LAPTOP, 1, samples=37 * 32, receipts=alone)
    assert verdict.samples == 0 and verdict.notes == "receipt_same_user: 32"
    assert record(store, DESKTOP, 0, samples=37 * 32, receipts=[receipt(LAPTOP, DESKTOP, 5, 32)]).samples == 0
    assert board(store) == {"alice": (96, 0), "bob": (0, 0)}


def test_steps_jumped_over_are_recorded_from_receipts_of_two_users_below_the_frontier(
    store: LedgerStore,
) -> None:
    join(store, "alice", LAPTOP)
    join(store, "bob", SERVER)
    tracked(store, 1, 10)  # the tracker saw 1 and 10 taken, jumped over 2-9
    verdict = record(
        store,
        LAPTOP,
        0,
        samples=96,
        receipts=[
            receipt(SERVER, LAPTOP, 5, 32),
            receipt(SERVER, LAPTOP, 7, 32),
            receipt(SERVER, LAPTOP, 50, 32),
        ],
    )
    assert verdict.samples == 64 and verdict.notes == "receipt_held: 1"  # 50 is beyond the frontier
    assert sources(store) == {1: "tracker", 5: "receipts", 7: "receipts", 10: "tracker"}
    # issue 11: such rows showed 0 samples; they hold their receipts' sum, as the reports arrive
    assert {r.global_step: (r.samples, r.peers) for r in store.recent_steps(100)}[5] == (32, 2)
    assert record(store, SERVER, 0, samples=40, receipts=[receipt(LAPTOP, SERVER, 5, 40)]).samples == 40
    assert {r.global_step: (r.samples, r.peers) for r in store.recent_steps(100)}[5] == (72, 2)
    tracked(store, 60)  # the collaboration went past 50: the next report's transaction records it
    assert record(store, LAPTOP, 1, samples=0).samples == 32
    assert sources(store)[50] == "receipts"
    # the tracker's numbers replace what receipts alone knew of a step
    assert store.record_step(7, finished_at=T0, loss=2.0, samples=128, peers=3) is True
    assert sources(store)[7] == "tracker"
    assert store.record_step(7, finished_at=T0, loss=9.0, samples=1, peers=1) is False
    assert board(store) == {"alice": (96, 0), "bob": (40, 0)}


def test_steps_a_peer_reports_discarded_are_taken_back_and_shown_apart(store: LedgerStore) -> None:
    """alice and bob were a partition's minority for steps 4-6; alice re-synced to the survivors' state
    and reports them discarded: what they were credited is taken back, a receipt of one of them carried
    by a report sent before the discard but delivered after it counts nothing, and the leaderboard
    shows them as discarded work."""
    join(store, "alice", LAPTOP)
    join(store, "bob", SERVER)
    tracked(store, *range(1, 8))
    receipts = [receipt(SERVER, LAPTOP, s, 32) for s in range(1, 6)]
    assert record(store, LAPTOP, 0, samples=7 * 32, receipts=receipts).samples == 5 * 32
    verdict = record(store, LAPTOP, 2, samples=0, compute_seconds=0.0, discarded=[(4, 6)])
    assert verdict.samples == -2 * 32 and verdict.compute_seconds < 0
    late = record(store, LAPTOP, 1, samples=0, receipts=[receipt(SERVER, LAPTOP, 6, 32)])
    assert late.samples == 0 and late.notes is None  # stored, as discarded
    assert store.discards(LAPTOP.peer_id) == [(4, 6)]
    [alice, bob] = store.leaderboard()
    assert (alice.username, alice.samples, alice.discarded_samples) == ("alice", 3 * 32, 3 * 32)
    assert (bob.samples, bob.discarded_samples) == (0, 0)


def test_steps_taken_again_after_a_discard_are_credited_and_the_discarded_receipts_are_not(
    store: LedgerStore,
) -> None:
    """alice's laptop was in a fork that got ahead to step 13; it re-synced to the survivors at step 9
    (the merge rule lets a peer that was ahead load a lower step), reported steps 10-13 discarded and
    then took steps 10-13 again, for real, with the survivors. A discard covers only receipts its
    report and earlier ones carried: the receipts of the steps taken again are credited (each replaces
    the discarded one of its step, if any), the fork's are not, and a stale one later changes nothing."""
    join(store, "alice", LAPTOP)
    join(store, "bob", SERVER)
    join(store, "carol", DESKTOP)
    tracked(store, *range(1, 14))
    fork = [receipt(SERVER, LAPTOP, s, 32) for s in range(1, 12)]
    assert record(store, LAPTOP, 0, samples=13 * 32, receipts=fork).samples == 11 * 32
    # the discarding report carries the fork's receipt of step 12, still in the book: covered too
    last = receipt(SERVER, LAPTOP, 12, 32)
    dropped = record(store, LAPTOP, 1, samples=0, receipts=[last], discarded=[(10, 13)])
    assert dropped.samples == -2 * 32 and dropped.notes is None
    again = [receipt(DESKTOP, LAPTOP, s, 16) for s in range(10, 14)]
    taken = record(store, LAPTOP, 2, samples=4 * 16, receipts=again[:2])
    assert taken.samples == 2 * 16 and taken.notes == "receipt_retaken: 2"
    later = record(store, LAPTOP, 3, samples=0, receipts=again[2:])  # 12 replaces, 13 is new
    assert later.samples == 2 * 16 and later.notes == "receipt_retaken: 1"
    replayed = record(store, LAPTOP, 4, samples=0, receipts=[*again, receipt(SERVER, LAPTOP, 11, 32)])
    assert replayed.samples == 0 and replayed.notes == "receipt_duplicate: 5"
    alice = next(row for row in store.leaderboard() if row.username == "alice")
    assert (alice.samples, alice.discarded_samples) == (9 * 32 + 4 * 16, 0)
    assert store.discards(LAPTOP.peer_id) == [(10, 13)]
    # a second fork over some of those steps discards the receipts taken again as well
    assert record(store, LAPTOP, 5, samples=0, discarded=[(11, 13)]).samples == -3 * 16
    assert store.discards(LAPTOP.peer_id) == [(10, 13), (11, 13)]


def test_a_receipt_is_capped_by_the_larger_of_the_steps_batch_and_target(
    store: LedgerStore,
) -> None:
    """The tracker may record a lower bound of the batch (what the progress records said: the last
    contributions land between two polls); an honest part may weigh up to the target then. A colluding
    aggregator's receipt of 1000 for a step of 48 is credited 48, not the 4x ceiling of progress."""
    join(store, "alice", LAPTOP)
    join(store, "bob", SERVER)
    assert store.record_step(1, finished_at=T0, loss=5.0, samples=32, peers=2, target_batch=48)
    assert store.record_step(2, finished_at=T0, loss=5.0, samples=48, peers=2, target_batch=48)
    receipts = [receipt(SERVER, LAPTOP, 1, 48), receipt(SERVER, LAPTOP, 2, 1000)]
    assert record(store, LAPTOP, 0, samples=2000, receipts=receipts).samples == 48 + 48
