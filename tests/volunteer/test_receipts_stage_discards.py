"""The receipt book at a swarm server's stage discard (volunteer.receipts, "Stage discards"): the fork's
stage part receipts are dropped, its trainer's receipts sealed (taken first by every report, their slot
freed for the stage step taken again), and a take holds back the stage and trainer's receipts of the
pending stage discards' steps (booked after the discard: the stage steps taken again); nothing else is
touched and nothing is lost."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.receipts import PartReceipt, PulledSlice, SignedReceipt, decode_receipt, sign_receipt
from tests.backbone.ledger.reports import identity, part_receipt
from volunteer.receipts import ReceiptBook

SENDER = identity(90).peer_id
SIGNERS = [identity(91), identity(92), identity(93)]
RUN = "stage-book"


def stage_receipt(
    signer_index: int, stage: int | None, step: int, weight: float, carried: bool
) -> SignedReceipt:
    """A stage part receipt (``carried`` False), a trainer's receipt (True), or with ``stage`` None a
    data-parallel part receipt, signed by ``SIGNERS[signer_index]``."""
    if stage is None:
        return part_receipt(SIGNERS[signer_index], SENDER, step, weight, RUN, 10, 1.0)
    signer = SIGNERS[signer_index]
    body = PartReceipt(
        run_id=RUN, aggregator=signer.peer_id, sender=SENDER, step=step, group_id=b"s", round=0,
        weight=weight, nbytes=10, issued_at=1.0, stage=stage, carried=carried,
    )  # fmt: skip
    return sign_receipt(body, signer.sign)


# a round: (stage or None, step, part receipts' signers, trainer's receipts' signers, weight, pull records)
ROUNDS = st.lists(
    st.tuples(
        st.sampled_from([None, 0, 1]),
        st.integers(1, 12),
        st.integers(0, 2),
        st.integers(0, 3),
        st.sampled_from([1.0, 2.0, 3.0]),
        st.integers(0, 1),
    ),
    max_size=25,
)
STAGE_RANGES = st.lists(
    st.tuples(st.integers(0, 1), st.integers(1, 12), st.integers(0, 4)).map(
        lambda t: (t[0], t[1], t[1] + t[2])
    ),
    max_size=3,
)


def booked(rounds: list[tuple[int | None, int, int, int, float, int]]) -> ReceiptBook:
    book = ReceiptBook(SENDER)
    for i, (stage, step, parts, trainers, weight, pulls) in enumerate(rounds):
        receipts = [(SIGNERS[j].peer_id, stage_receipt(j, stage, step, weight, False)) for j in range(parts)]
        if stage is not None:
            receipts += [
                (SIGNERS[j].peer_id, stage_receipt(j, stage, step, weight, True)) for j in range(trainers)
            ]
        book.add(step, receipts, [PulledSlice("agg", step, i) for _ in range(pulls)], stage=stage)
    return book


def items(book: ReceiptBook) -> Counter[object]:
    """What the book holds outside the sealed set."""
    return Counter(x for _, receipts, pulled in book.held() for x in [*receipts, *pulled])


def covered_by(
    stage_ranges: list[tuple[int, int, int]], *, carried: bool | None = None
) -> Callable[[object], bool]:
    """A stage's receipt (of the kind ``carried`` says; None: either) of a step in ``stage_ranges``."""

    def covered(x: object) -> bool:
        if not isinstance(x, SignedReceipt):
            return False
        r = decode_receipt(x.receipt)
        kind = carried is None or r.carried == carried
        return (
            r.stage is not None
            and kind
            and any(k == r.stage and a <= r.step <= b for k, a, b in stage_ranges)
        )

    return covered


@settings(max_examples=40, deadline=None)
@given(rounds=ROUNDS, stage=st.integers(0, 1), first=st.integers(1, 12), width=st.integers(0, 4))
def test_a_stage_discard_drops_the_forks_stage_receipts_and_seals_its_trainers(
    rounds: list[tuple[int | None, int, int, int, float, int]], stage: int, first: int, width: int
) -> None:
    book = booked(rounds)
    before = items(book)
    span = [(stage, first, first + width)]
    parts = Counter({x: n for x, n in before.items() if covered_by(span, carried=False)(x)})
    trainers = Counter({x: n for x, n in before.items() if covered_by(span, carried=True)(x)})
    assert book.drop_stage_steps(stage, first, first + width) == (sum(parts.values()), sum(trainers.values()))
    assert items(book) == before - parts - trainers  # data-parallel and other stages' receipts stay
    sealed = book.sealed
    assert Counter(sealed) == trainers
    assert len(book) == sum((before - parts).values())
    receipts, _ = book.take(max_receipts=len(sealed) + 1)
    assert receipts[: len(sealed)] == sealed and not book.sealed  # taken first


@settings(max_examples=40, deadline=None)
@given(rounds=ROUNDS, hold=STAGE_RANGES, sealed=st.integers(0, 3))
def test_take_holds_back_the_stage_steps_taken_again_and_loses_nothing(
    rounds: list[tuple[int | None, int, int, int, float, int]], hold: list[tuple[int, int, int]], sealed: int
) -> None:
    book = booked(rounds)
    fork = [stage_receipt(j, 1, 99, 5.0, True) for j in range(sealed)]  # a pending discard's fork
    book.seal(fork)
    held = covered_by(hold)
    before = items(book) + Counter(fork)
    taken: Counter[object] = Counter()
    while True:
        receipts, pulled = book.take(max_receipts=2, max_pulled=3, hold=[], hold_stages=hold)
        if not receipts and not pulled:
            break
        assert len(receipts) <= 2 and len(pulled) <= 3
        assert not any(held(r) for r in receipts if r not in fork)
        taken.update([*receipts, *pulled])
    assert fork == [r for r in taken if r in fork] and not book.sealed  # the sealed went first, all
    assert items(book) == Counter({x: n for x, n in before.items() if held(x) and x not in fork})
    while len(book):  # a report after the discard's
        receipts, pulled = book.take(max_receipts=2, max_pulled=3)
        taken.update([*receipts, *pulled])
    assert taken == before


def test_the_step_taken_again_is_booked_although_its_servers_tally_restarted_lower() -> None:
    """Without sealing, the fork's larger receipt kept the (stage, step, server) slot and the smaller one
    of the step taken again was ignored; and a take with the discard pending holds the new one back."""
    book = ReceiptBook(SENDER)
    fork, again = stage_receipt(0, 1, 5, 4.0, True), stage_receipt(0, 1, 5, 2.0, True)
    book.add(5, [(SIGNERS[0].peer_id, fork)], stage=1)
    assert book.drop_stage_steps(1, 5, 5) == (0, 1) and book.sealed == [fork]
    book.add(5, [(SIGNERS[0].peer_id, again)], stage=1)
    assert len(book) == 2
    assert book.take(hold_stages=[(1, 5, 5)]) == ([fork], [])
    assert book.take(hold_stages=[(1, 5, 5)]) == ([], []) and len(book) == 1
    assert book.take() == ([again], [])


def test_sealing_keeps_the_larger_per_server_and_step_and_refuses_other_receipts() -> None:
    book = ReceiptBook(SENDER)
    small, large = stage_receipt(0, 1, 5, 2.0, True), stage_receipt(0, 1, 5, 4.0, True)
    other = stage_receipt(1, 1, 5, 1.0, True)
    book.seal([small, large, small, other])
    book.seal([stage_receipt(0, 1, 5, 3.0, False), stage_receipt(0, None, 5, 3.0, False)])  # not a trainer's
    book.seal([SignedReceipt(receipt=b"garbage", signature=bytes(64))])
    assert book.sealed == [large, other] and len(book) == 2


def test_a_put_back_trainers_receipt_is_sealed_or_held_by_its_own_stage_step() -> None:
    """A given-up report's receipts sit under its report's step: a later stage discard judges each by the
    stage step it signs (a trainer's sealed, a stage part receipt dropped, others left)."""
    book = ReceiptBook(SENDER)
    trainer, part = stage_receipt(0, 1, 5, 4.0, True), stage_receipt(1, 1, 5, 4.0, False)
    stage0, data = stage_receipt(2, 0, 5, 4.0, True), stage_receipt(2, None, 5, 4.0, False)
    fork = stage_receipt(1, 1, 6, 1.0, True)
    book.put_back(40, [trainer, part, stage0, data], [], sealed=[fork])
    assert book.sealed == [fork] and len(book) == 5
    assert book.take(hold_stages=[(1, 5, 6)]) == ([fork, stage0, data], [])
    assert book.take() == ([trainer, part], [])
    book = ReceiptBook(SENDER)
    book.put_back(40, [trainer, part, stage0, data], [])
    assert book.drop_stage_steps(1, 1, 9) == (1, 1) and book.sealed == [trainer]
    assert book.take() == ([trainer, stage0, data], [])
