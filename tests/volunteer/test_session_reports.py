"""The volunteer's contribution reports carry its receipt book (volunteer.training.Reporter) to a real
pinned API in this process: receipts of another user's peer are credited, what a refused report carried
goes back into the book, a full book closes a report early, and no interval exceeds the ledger's bound."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import trio

from protocols.ledger import MAX_INTERVAL_S, ContributionReport
from protocols.receipts import PulledSlice, SignedReceipt
from shared.auth.keys import Identity
from tests.backbone.ledger.reports import part_receipt
from tests.backbone.pinned_api import PinnedApi, member_client, serve_pinned_api
from volunteer.api_client import ApiClient
from volunteer.collab.optimizer import StepRecord
from volunteer.training import Reporter


def step(number: int, finished_at: float, samples: int = 32) -> StepRecord:
    return StepRecord(
        step=number,
        samples=samples,
        compute_seconds=1.0,
        bytes_aggregated=0,
        peers=2,
        loss=None,
        seconds=0.1,
        finished_at=finished_at,
        fingerprint=b"f",
    )


def receipt(aggregator: Identity, sender: str, run_id: str, number: int, weight: float) -> SignedReceipt:
    return part_receipt(aggregator, sender, number, weight, run_id, 10, time.time())


def admit(api: PinnedApi, username: str) -> Identity:
    peer = Identity.generate()
    now = time.time()
    api.store.add_user(username, now=now)
    secret = api.store.create_invite(username, now=now)
    api.store.redeem_invite(secret, peer.peer_id, peer.public_key_bytes, now=now)
    return peer


def sent(reporter: Reporter) -> list[ContributionReport]:
    return [msgspec.msgpack.decode(s.report, type=ContributionReport) for s, _ in reporter._pending]


async def test_reports_carry_receipts_and_the_ledger_credits_them(tmp_path: Path) -> None:
    async with serve_pinned_api(tmp_path / "bb") as api:
        client = member_client(api, "alice")
        alice = client.identity
        assert alice is not None
        bob = admit(api, "bob")
        now = time.time()
        api.store.record_step(1, finished_at=now, loss=None, samples=0, peers=2)
        reporter = Reporter(api.run_id, alice, client, tmp_path / "alice", interval=10.0)
        (tmp_path / "alice").mkdir()
        reporter.book.add(1, [(bob.peer_id, receipt(bob, alice.peer_id, api.run_id, 1, 32.0))])
        reporter.book.add(1, [], [PulledSlice(bob.peer_id, 1, 500)])
        reporter.record(step(1, now))
        reporter.close_interval()
        [report] = sent(reporter)
        assert len(report.receipts) == 1 and len(report.pulled) == 1 and len(reporter.book) == 0
        await reporter.flush()
        assert (reporter.sent, reporter.pending) == (1, 0)
        assert {row.username: row.samples for row in api.store.leaderboard()} == {"alice": 32, "bob": 0}


async def test_a_refused_report_puts_its_receipts_back_and_an_unsent_one_keeps_them(tmp_path: Path) -> None:
    async with serve_pinned_api(tmp_path / "bb") as api:
        client = member_client(api, "alice")
        alice = client.identity
        assert alice is not None
        bob = admit(api, "bob")
        (tmp_path / "alice").mkdir()
        offline = ApiClient(api.run_id, ["https://127.0.0.1:9"])
        reporter = Reporter(api.run_id, alice, offline, tmp_path / "alice")
        signed = receipt(bob, alice.peer_id, api.run_id, 1, 32.0)
        reporter.book.add(1, [(bob.peer_id, signed)])
        reporter.record(step(1, time.time()))
        reporter.close_interval()
        await reporter.flush()  # no backbone answers: the report (and its receipt) waits
        assert reporter.pending == 1 and len(reporter.book) == 0
        api.store.remove_user("alice", now=time.time())
        reporter.client = client
        await reporter.flush()  # refused (403): the report is given up, its receipt goes back
        assert reporter.pending == 0 and len(reporter.book) == 1
        assert reporter.book.take()[0] == [signed]


async def test_a_full_book_closes_a_report_early_and_intervals_stay_within_the_bound(tmp_path: Path) -> None:
    alice, bob = Identity.generate(), Identity.generate()
    run_id = "r@x"
    reporter = Reporter(run_id, alice, None, tmp_path, interval=1e9)
    start = time.time()
    reporter._last_end = start - 5 * MAX_INTERVAL_S  # a long wait before the first step
    reporter.record(step(1, start))
    assert reporter.pending == 0  # the interval is not over and the book is empty
    for number in range(2, 40):
        reporter.book.add(number, [(bob.peer_id, receipt(bob, alice.peer_id, run_id, number, 1.0))])
        reporter.record(step(number, start + number))
        if reporter.pending:
            break
    [first] = sent(reporter)
    assert len(first.receipts) == 32  # closed as soon as the book held a report's worth
    assert first.interval_end - first.interval_start <= MAX_INTERVAL_S
    assert first.compute_seconds <= first.interval_end - first.interval_start
    await trio.lowlevel.checkpoint()


def test_leaving_reports_the_receipts_that_arrived_after_the_last_step(tmp_path: Path) -> None:
    alice, bob = Identity.generate(), Identity.generate()
    reporter = Reporter("r@x", alice, None, tmp_path)
    reporter.record(step(7, time.time()))
    reporter.close_interval()
    for number in range(7, 7 + 40):  # the last rounds' receipts (and more than one report's worth)
        reporter.book.add(number, [(bob.peer_id, receipt(bob, alice.peer_id, "r@x", number, 1.0))])
    reporter.close_all()
    first, *rest = sent(reporter)
    assert first.samples == 32 and not first.receipts
    assert [len(r.receipts) for r in rest] == [32, 8]
    assert all(r.samples == 0 and r.global_step == 7 for r in rest) and len(reporter.book) == 0
    assert [r.seq for r in sent(reporter)] == [0, 1, 2]


def test_leaving_with_a_full_queue_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the queue full, each new report evicts an old one whose receipts go back to the book: leaving
    once looped forever on the trio thread."""
    import volunteer.reporting as reporting

    monkeypatch.setattr(reporting, "MAX_PENDING_REPORTS", 2)
    alice, bob = Identity.generate(), Identity.generate()
    reporter = Reporter("r@x", alice, None, tmp_path)
    for number in range(1, 80):
        reporter.book.add(number, [(bob.peer_id, receipt(bob, alice.peer_id, "r@x", number, 1.0))])
    reporter.close_all()  # returns
    assert len(sent(reporter)) == 2
