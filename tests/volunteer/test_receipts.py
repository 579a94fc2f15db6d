from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.receipts import RECEIPTS_PER_STEP, PartReceipt, PulledSlice, SignedReceipt, sign_receipt
from tests.backbone.ledger.reports import identity, part_receipt
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


AGGREGATORS = [identity(81), identity(82), identity(83)]
SENDER = identity(80).peer_id


def booked(rounds: list[tuple[int, int, int]]) -> tuple[ReceiptBook, dict[SignedReceipt, int]]:
    """A book of real part receipts (``nrec`` aggregators each) and ``npull`` pull records per round, and
    the step of each receipt."""
    book = ReceiptBook(SENDER)
    steps: dict[SignedReceipt, int] = {}
    for i, (step, nrec, npull) in enumerate(rounds):
        receipts = [
            (a.peer_id, part_receipt(a, SENDER, step, 1.0, "r", 10, float(i))) for a in AGGREGATORS[:nrec]
        ]
        steps.update((r, step) for _, r in receipts)
        book.add(step, receipts, [PulledSlice("agg", step, i) for _ in range(npull)])
    return book, steps


def held_items(book: ReceiptBook) -> Counter[object]:
    return Counter(x for _, receipts, pulled in book.held() for x in [*receipts, *pulled])


def covered(steps: dict[SignedReceipt, int], ranges: list[tuple[int, int]]) -> Callable[[object], bool]:
    return lambda x: isinstance(x, SignedReceipt) and any(a <= steps[x] <= b for a, b in ranges)


ROUNDS = st.lists(st.tuples(st.integers(1, 20), st.integers(0, 3), st.integers(0, 2)), max_size=30)
RANGES = st.lists(
    st.tuples(st.integers(1, 20), st.integers(0, 5)).map(lambda t: (t[0], t[0] + t[1])), max_size=3
)


@settings(max_examples=40, deadline=None)
@given(rounds=ROUNDS, hold=RANGES)
def test_take_holds_back_the_receipts_of_discarded_steps_and_loses_nothing(
    rounds: list[tuple[int, int, int]], hold: list[tuple[int, int]]
) -> None:
    book, steps = booked(rounds)
    held = covered(steps, hold)
    before = held_items(book)
    taken: Counter[object] = Counter()
    while True:
        receipts, pulled = book.take(max_receipts=5, max_pulled=4, hold=hold)
        if not receipts and not pulled:
            break
        assert len(receipts) <= 5 and len(pulled) <= 4
        assert not any(held(r) for r in receipts)
        taken.update([*receipts, *pulled])
    assert held_items(book) == Counter({x: n for x, n in before.items() if held(x)})  # only those left
    while len(book):  # the next report's, without a discard
        receipts, pulled = book.take(max_receipts=5, max_pulled=4)
        taken.update([*receipts, *pulled])
    assert taken == before


@settings(max_examples=40, deadline=None)
@given(rounds=ROUNDS, first=st.integers(1, 20), width=st.integers(0, 5))
def test_drop_steps_drops_only_the_part_receipts_of_those_steps(
    rounds: list[tuple[int, int, int]], first: int, width: int
) -> None:
    book, steps = booked(rounds)
    before = held_items(book)
    gone = Counter({x: n for x, n in before.items() if covered(steps, [(first, first + width)])(x)})
    assert book.drop_steps(first, first + width) == sum(gone.values())
    assert held_items(book) == before - gone


def test_a_stage_receipt_is_never_held_nor_dropped() -> None:
    """A data-parallel discard covers no stage's receipt (stage discards: module docstring)."""
    book = ReceiptBook(SENDER)
    stage = sign_receipt(
        PartReceipt(
            run_id="r",
            aggregator=AGGREGATORS[0].peer_id,
            sender=SENDER,
            step=3,
            group_id=b"g",
            round=0,
            weight=1.0,
            nbytes=10,
            issued_at=1.0,
            stage=1,
        ),
        AGGREGATORS[0].sign,
    )
    book.add(3, [(AGGREGATORS[0].peer_id, stage)], stage=1)
    assert book.drop_steps(1, 5) == 0 and book.take(hold=[(1, 5)]) == ([stage], [])
