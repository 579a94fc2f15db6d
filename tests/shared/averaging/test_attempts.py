"""shared.averaging.attempts: which key a step's next attempt uses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
from hypothesis import given
from hypothesis import strategies as st

from shared.averaging.attempts import MAX_SKIP, AttemptKeys, attempt_key, next_index


def spent_of(keys: set[int]) -> Callable[[str], Awaitable[bool]]:
    async def spent(key: str) -> bool:
        return int(key.removeprefix("a")) in keys

    return spent


@given(st.integers(0, 50), st.sets(st.integers(0, 200), max_size=80))
def test_the_next_index_is_the_lowest_unspent_key_at_or_above_the_start(start: int, spent: set[int]) -> None:
    index = trio.run(next_index, start, spent_of(spent))
    assert start <= index <= start + MAX_SKIP
    assert all(k in spent for k in range(start, index))  # everything skipped was spent
    assert index == start + MAX_SKIP or index not in spent


@given(st.lists(st.tuples(st.sets(st.integers(0, 30), max_size=20), st.booleans()), max_size=20))
def test_a_members_index_only_grows_and_comes_back_only_after_being_alone(
    attempts: list[tuple[set[int], bool]],
) -> None:
    keys, spent, last = AttemptKeys(), set[int](), -1
    for more, alone in attempts:
        spent |= more
        index = trio.run(keys.next, 7, spent_of(spent))
        assert index >= last and index not in spent
        keys.done(7, index, alone=alone)
        assert keys.index == (index if alone else index + 1)
        last = index
    assert trio.run(keys.next, 8, spent_of(set())) == 0  # a new step starts at a0
    assert attempt_key(3) == "a3"


def test_members_out_of_phase_meet_under_the_lowest_unspent_key() -> None:
    """Two members whose indices differ: the one behind skips the keys spent by plans and stops where
    the one ahead waits alone (the key no plan has spent), not at a key of its own."""
    ahead, behind = AttemptKeys(), AttemptKeys()
    spent = {0, 1, 2}  # plans of failed rounds, and of the round the late member came to after its plan
    at = trio.run(ahead.next, 5, spent_of(spent))
    ahead.done(5, at, alone=True)
    assert trio.run(ahead.next, 5, spent_of(spent)) == at == 3  # it waits there
    assert trio.run(behind.next, 5, spent_of(spent)) == 3
