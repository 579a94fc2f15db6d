"""A stage server's cumulative tally of what trainers carried through it, and the trainer's check of the
receipts it signs (shared.swarm.carried): forged signer, another trainer's, another stage's, another
run's, not a trainer's receipt, fewer samples than the backward, garbage bytes; bounded tally."""

from __future__ import annotations

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.errors import ProtocolError
from protocols.receipts import PartReceipt, SignedReceipt, decode_receipt, sign_receipt
from shared.auth.keys import Identity
from shared.swarm.carried import KEEP_STEPS, CarriedTally, check_carried


def ident(seed: int) -> Identity:
    return Identity(Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32))


SERVER, TRAINER, OTHER = ident(61), ident(62), ident(63)


def tally(stage: int = 1, **kwargs: int) -> CarriedTally:
    return CarriedTally("run", SERVER.peer_id, stage, SERVER.sign, **kwargs)


def check(signed: SignedReceipt, **overrides: object) -> PartReceipt:
    args: dict[str, object] = {
        "run_id": "run",
        "server": SERVER.peer_id,
        "trainer": TRAINER.peer_id,
        "stage": 1,
        "samples": 4,
    }
    args.update(overrides)
    return check_carried(signed, **args)  # type: ignore[arg-type]


def test_receipts_are_cumulative_per_trainer_and_step() -> None:
    counts = tally()
    first = check(counts.receipt(TRAINER.peer_id, 5, 4, 100))
    assert (first.weight, first.nbytes, first.step, first.stage, first.carried) == (4, 100, 5, 1, True)
    second = check(counts.receipt(TRAINER.peer_id, 5, 4, 100))
    assert (second.weight, second.nbytes) == (8, 200)
    assert counts.count(OTHER.peer_id, 5, 2, 10) == (2, 10)  # another trainer: its own count
    assert check(counts.receipt(TRAINER.peer_id, 6, 4, 100)).weight == 4  # the next step starts anew


def test_old_steps_are_forgotten_and_the_tally_is_bounded() -> None:
    counts = tally(max_keys=3)
    for step in range(10):
        counts.count(TRAINER.peer_id, step, 1, 1)
    assert len(counts) <= KEEP_STEPS + 1
    for n in range(10):
        counts.count(f"t{n}", 9, 1, 1)
    assert len(counts) == 3


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 4), st.integers(1, 9)), max_size=40))
def test_a_count_is_the_sum_of_its_keys_backwards(events: list[tuple[int, int, int]]) -> None:
    """Within the tally's bounds (steps advance, so only recent keys are asked), every returned count is
    exactly the sum of that key's backwards so far."""
    counts = tally()
    sums: dict[tuple[int, int], int] = {}
    for trainer, step, samples in sorted(events, key=lambda e: e[1]):
        sums[trainer, step] = sums.get((trainer, step), 0) + samples
        assert counts.count(str(trainer), step, samples, 0) == (sums[trainer, step], 0)


def test_the_trainer_refuses_what_it_must_not_keep() -> None:
    counts = tally()
    good = counts.receipt(TRAINER.peer_id, 5, 4, 100)
    assert check(good).sender == TRAINER.peer_id
    with pytest.raises(ProtocolError, match="not the server called"):
        check(good, server=OTHER.peer_id)  # another server's receipt passed off as this one's
    with pytest.raises(ProtocolError, match="stage"):
        check(good, stage=0)
    with pytest.raises(ProtocolError, match="run"):
        check(good, run_id="other")
    with pytest.raises(ProtocolError, match="trainer"):
        check(tally().receipt(OTHER.peer_id, 5, 4, 100))  # another trainer's
    with pytest.raises(ProtocolError, match="fewer"):
        check(good, samples=5)
    # forged: the body names the server, a stranger signed it
    forged = sign_receipt(decode_receipt(good.receipt), OTHER.sign)
    with pytest.raises(ProtocolError, match="signature"):
        check(forged)
    # the body altered after signing (more samples)
    raised = msgspec.structs.replace(decode_receipt(good.receipt), weight=400.0)
    tampered = SignedReceipt(receipt=msgspec.msgpack.encode(raised), signature=good.signature)
    with pytest.raises(ProtocolError, match="signature"):
        check(tampered)
    # a stage server's part receipt (not carried) is no trainer's receipt
    part = sign_receipt(msgspec.structs.replace(decode_receipt(good.receipt), carried=False), SERVER.sign)
    with pytest.raises(ProtocolError, match="carried"):
        check(part)
    with pytest.raises(ProtocolError):
        check(SignedReceipt(receipt=b"\xc1garbage", signature=good.signature))
    with pytest.raises(ProtocolError):
        check(SignedReceipt(receipt=b"x" * 600, signature=good.signature))  # oversize
