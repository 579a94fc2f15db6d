"""Bounds decided before a download and the SourceBook of failed sources (pure; property tests)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.state import MAX_STATE_BYTES
from protocols.training import StateAnnouncement
from shared.errors import StateError
from shared.state.blob import encode_state
from shared.state.limits import (
    STATE_GROWTH,
    SourceBook,
    check_announced_size,
    checkpoint_size_limit,
    state_size_bound,
)

_DTYPES = [np.float32, np.float16, np.float64, np.int64, np.int32, np.uint8, np.bool_]
_tensor = st.tuples(
    st.text(min_size=1, max_size=40).filter(lambda n: n != "__metadata__"),
    st.sampled_from(_DTYPES),
    st.lists(st.integers(0, 5), max_size=4),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_tensor, max_size=8, unique_by=lambda t: t[0]), st.text(max_size=30), st.integers(0, 10**19))
def test_state_size_bound_holds_every_encoded_state(
    tensors: list[tuple[str, type, list[int]]], run_id: str, step: int
) -> None:
    arrays = {name: np.zeros(shape, dtype=dtype) for name, dtype, shape in tensors}
    blob = encode_state(arrays, {"step": str(step), "run_id": run_id, "task": "tiny-mlm"})
    bound = state_size_bound(((n, a.nbytes, a.ndim) for n, a in arrays.items()), (run_id, "tiny-mlm"))
    assert len(blob) <= bound


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 2 * MAX_STATE_BYTES),
    st.lists(st.integers(1, 1 << 36), max_size=4),
    st.integers(0, 1 << 45),
    st.integers(0, 1 << 32),
)
def test_checkpoint_size_limit_is_within_every_bound(
    configured: int, kept: list[int], free: int, reserve: int
) -> None:
    limit = checkpoint_size_limit(configured, kept, free, reserve=reserve)
    assert 0 <= limit <= min(configured, MAX_STATE_BYTES)
    assert limit <= max(0, free - reserve)
    if kept:
        assert limit <= STATE_GROWTH * max(kept)


def test_check_announced_size_refuses_zero_and_above_the_limit() -> None:
    ok = StateAnnouncement(step=1, digest=b"\1" * 32, nbytes=100, time=0.0)
    check_announced_size(ok, 100)
    check_announced_size(StateAnnouncement(1, b"\1" * 32, MAX_STATE_BYTES, 0.0), 2 * MAX_STATE_BYTES)
    for nbytes, limit in [(101, 100), (0, 100), (MAX_STATE_BYTES, MAX_STATE_BYTES - 1)]:
        with pytest.raises(StateError, match="at most"):
            check_announced_size(StateAnnouncement(step=1, digest=b"\1" * 32, nbytes=nbytes, time=0.0), limit)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_source_book_cools_a_failing_peer_down_longer_each_time_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    book = SourceBook(clock=clock, base_cooldown=2.0, max_cooldown=10.0, fault_cooldown=600.0)
    with caplog.at_level(logging.DEBUG, logger="shared.state"):
        for expected in (2.0, 4.0, 8.0, 10.0, 10.0):
            book.failed("p", "unreachable")
            assert not book.usable("p")
            clock.now += expected - 0.01
            assert not book.usable("p")
            clock.now += 0.01
            assert book.usable("p")
    logged = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(logged) == 1 and "p failed" in logged[0].getMessage()
    assert book.statistics().failures == 5
    book.succeeded("p")
    book.failed("p", "unreachable")  # a new streak: logged again, short cool-down again
    clock.now += 2.0
    assert book.usable("p")

    book.failed("liar", "lied about its chunk", fault=True)
    clock.now += 599.0
    assert not book.usable("liar") and book.usable("other")
    stats = book.statistics()
    assert (stats.faults, stats.cooling) == (1, 1)


def test_source_book_remembers_a_refused_announcement_until_it_changes() -> None:
    book = SourceBook(max_entries=2)
    huge = StateAnnouncement(step=5, digest=b"\1" * 32, nbytes=1 << 40, time=0.0)
    book.refuse("w", huge, "too large")
    book.refuse("w", huge, "too large")  # the same record read again: counted once
    assert book.refused("w", huge)
    assert not book.refused("w", StateAnnouncement(step=6, digest=b"\1" * 32, nbytes=1 << 40, time=0.0))
    assert not book.refused("v", huge)
    assert book.statistics().refused == 1
    for writer in ("a", "b"):  # bounded: the oldest is forgotten
        book.refuse(writer, huge, "too large")
    assert not book.refused("w", huge) and book.refused("b", huge)


def test_a_source_that_answered_no_is_not_failing_only_one_that_gave_no_answer() -> None:
    """Rule (d) of shared.alone takes a failing holder for a dead one: a peer that answered "no such
    state here" (it moved on from what it announced) is alive; only a refused, reset or stalled
    download makes it failing, until it serves us again."""
    book = SourceBook()
    book.failed("moved-on", "NOT_FOUND: no state here")
    book.failed("dead", "connection refused", unreachable=True)
    assert not book.failing("moved-on")
    assert book.failing("dead")
    assert not book.failing("never-asked")
    book.failed("dead", "NOT_FOUND: no state here")  # it answered this time: alive again
    assert not book.failing("dead")
    book.failed("dead", "stalled", unreachable=True)
    book.succeeded("dead")
    assert not book.failing("dead")
