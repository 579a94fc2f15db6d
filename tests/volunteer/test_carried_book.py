"""A swarm trainer's receipts in the reporter's book (volunteer.receipts, "carried"): the latest (largest)
per (server, stage, step), apart from part receipts, bounded per stage step, taken into reports, put back
when a report fails, and replayed by the journal as the book held them."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from protocols.receipts import PartReceipt, SignedReceipt, decode_receipt, sign_receipt
from tests.backbone.ledger.reports import identity, part_receipt
from volunteer.receipts import CARRIED_PER_STEP, ReceiptBook
from volunteer.training import Reporter

TRAINER, BOB, CAROL = identity(71), identity(72), identity(73)
SERVERS = [identity(80 + n) for n in range(CARRIED_PER_STEP + 2)]
RUN = "carried-book-test"


def carried(server=BOB, stage=0, step=1, weight=4.0) -> SignedReceipt:  # type: ignore[no-untyped-def]
    body = PartReceipt(
        run_id=RUN, aggregator=server.peer_id, sender=TRAINER.peer_id, step=step, group_id=b"", round=0,
        weight=weight, nbytes=10, issued_at=1.0, stage=stage, carried=True,
    )  # fmt: skip
    return sign_receipt(body, server.sign)


def weights(receipts: list[SignedReceipt]) -> list[tuple[str, float]]:
    bodies = [decode_receipt(r.receipt) for r in receipts]
    return sorted((b.aggregator, b.weight) for b in bodies if b.carried)


def test_the_book_keeps_each_servers_largest_apart_from_part_receipts() -> None:
    book = ReceiptBook(TRAINER.peer_id)
    book.add(1, [(BOB.peer_id, carried(BOB, weight=4))], stage=0)
    book.add(1, [(BOB.peer_id, carried(BOB, weight=8))], stage=0)
    book.add(1, [(BOB.peer_id, carried(BOB, weight=6))], stage=0)  # an older one arriving late
    book.add(1, [(CAROL.peer_id, carried(CAROL, weight=2))], stage=0)
    part = part_receipt(BOB, TRAINER.peer_id, 1, 8.0, RUN, 10, 1.0)
    book.add(1, [(BOB.peer_id, part)], stage=0)  # a stage server's part receipt of the same key
    [(stage, step, receipts, _)] = book.held_by_stage()
    assert (stage, step) == (0, 1) and part in receipts
    assert weights(receipts) == sorted([(BOB.peer_id, 8.0), (CAROL.peer_id, 2.0)])
    assert len(book) == 3
    taken, _ = book.take()
    assert len(taken) == 3 and len(book) == 0


def test_servers_beyond_the_bound_are_dropped_and_counted() -> None:
    book = ReceiptBook(TRAINER.peer_id)
    for server in SERVERS:
        book.add(1, [(server.peer_id, carried(server))], stage=2)
    assert len(book) == CARRIED_PER_STEP and book.dropped_carried == 2
    book.add(1, [(SERVERS[0].peer_id, carried(SERVERS[0], stage=2, weight=9))], stage=2)  # held: replaced
    assert (SERVERS[0].peer_id, 9.0) in weights(book.held_by_stage()[0][2])


@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 1), st.integers(0, 3), st.integers(0, 20)), max_size=40
    )
)
def test_taking_in_small_reports_loses_no_largest_receipt(adds: list[tuple[int, int, int, int]]) -> None:
    """Whatever the order of receipts and small takes, the largest weight of every (server, stage, step)
    that was added reaches some report."""
    servers = (BOB, CAROL, TRAINER)  # the trainer's own server too: the book keeps, the ledger refuses
    book = ReceiptBook(TRAINER.peer_id)
    best: dict[tuple[str, int, int], float] = {}
    sent: dict[tuple[str, int, int], float] = {}
    for n, (server, stage, step, weight) in enumerate(adds):
        book.add(
            step, [(servers[server].peer_id, carried(servers[server], stage, step, weight))], stage=stage
        )
        key = (servers[server].peer_id, stage, step)
        best[key] = max(best.get(key, 0.0), float(weight))
        if n % 3 == 2:
            taken, _ = book.take(max_receipts=2)
            for body in map(decode_receipt, (r.receipt for r in taken)):
                key = (body.aggregator, body.stage or 0, body.step)
                sent[key] = max(sent.get(key, 0.0), body.weight)
    while len(book):
        taken, _ = book.take(max_receipts=2)
        for body in map(decode_receipt, (r.receipt for r in taken)):
            key = (body.aggregator, body.stage or 0, body.step)
            sent[key] = max(sent.get(key, 0.0), body.weight)
    assert sent == best


def test_the_journal_replays_and_a_failed_report_puts_back(tmp_path: Path) -> None:
    reporter = Reporter(RUN, TRAINER, None, tmp_path, interval=3600.0)
    reporter.book.add(3, [(BOB.peer_id, carried(BOB, 1, 3, 4))], stage=1)
    reporter.book.add(3, [(BOB.peer_id, carried(BOB, 1, 3, 12))], stage=1)
    before = reporter.book.held_by_stage()
    assert weights(before[0][2]) == [(BOB.peer_id, 12.0)]
    again = Reporter(RUN, TRAINER, None, tmp_path, interval=3600.0)  # a new process in the same data dir
    assert again.book.held_by_stage() == before
    again._compact()
    assert Reporter(RUN, TRAINER, None, tmp_path, interval=3600.0).book.held_by_stage() == before
    # a report that carried it and failed for good: the receipt goes out again later
    again.close_interval()
    assert len(again.book) == 0
    _, report = again._pending.popleft()
    again._give_up(report)
    assert weights([r for _, _, rs, _ in again.book.held_by_stage() for r in rs]) == [(BOB.peer_id, 12.0)]
