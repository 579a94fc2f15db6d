from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protocols.receipts import RECEIPTS_PER_STEP, PulledSlice, SignedReceipt
from volunteer.receipts import ReceiptBook

ME = "12D3KooWMe"


def signed(n: int) -> SignedReceipt:
    return SignedReceipt(receipt=n.to_bytes(8, "big"), signature=bytes(64))


def test_keeps_receipts_of_other_aggregators_first_and_at_most_per_step() -> None:
    book = ReceiptBook(ME)
    book.add(7, [(ME, signed(0)), ("other1", signed(1)), ("other2", signed(2)), ("other3", signed(3))])
    receipts, pulled = book.take()
    assert receipts == [signed(1), signed(2)][:RECEIPTS_PER_STEP] and pulled == []
    assert len(book) == 0


def test_overflow_drops_the_oldest_steps_and_counts_them() -> None:
    book = ReceiptBook(ME, max_steps=3)
    for step in range(5):
        book.add(step, [("a", signed(step))])
    assert book.dropped == 2
    assert book.take()[0] == [signed(2), signed(3), signed(4)]


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 3), st.integers(0, 3)), max_size=60))
def test_take_never_loses_and_respects_report_limits(rounds: list[tuple[int, int, int]]) -> None:
    book = ReceiptBook(ME)
    expected_pulled = 0
    for i, (step, nrec, npull) in enumerate(rounds):
        book.add(
            step,
            [(f"agg{j}", signed(1000 * i + j)) for j in range(nrec)],
            [PulledSlice("agg", step, i) for _ in range(npull)],
        )
        expected_pulled += npull
    held = len(book)
    got_r, got_p = 0, 0
    while len(book):
        receipts, pulled = book.take(max_receipts=5, max_pulled=4)
        assert len(receipts) <= 5 and len(pulled) <= 4 and (receipts or pulled)
        got_r += len(receipts)
        got_p += len(pulled)
    assert got_r + got_p == held and got_p == expected_pulled


def test_put_back_returns_a_failed_reports_load_first() -> None:
    book = ReceiptBook(ME)
    book.add(1, [("a", signed(1))])
    book.add(2, [("a", signed(2))])
    first = book.take(max_receipts=1)
    book.put_back(1, *first)
    assert book.take()[0] == [signed(1), signed(2)]
