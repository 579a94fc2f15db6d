"""When a swarm volunteer's trainers take the run's step limit as reached (volunteer.swarm.session
.limit_reached): only when the stages' records agree, never on one stranger's claim."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from volunteer.swarm.session import limit_reached


def test_the_limit_is_reached_when_one_stage_is_at_it_and_the_others_a_step_short() -> None:
    assert limit_reached({0: [10], 1: [9, 9], 2: [9]}, 3, 10)
    assert not limit_reached({0: [9], 1: [9], 2: [9]}, 3, 10)  # nobody at the limit yet
    assert not limit_reached({0: [10], 1: [8], 2: [9]}, 3, 10)  # a stage two steps short still trains
    assert not limit_reached({0: [10], 1: [9]}, 3, 10)  # a stage never read
    assert not limit_reached({0: [10], 1: [10], 2: [10]}, 3, 0)  # no limit


@given(st.lists(st.integers(0, 8), min_size=3, max_size=3), st.integers(0, 2), st.integers(10, 10**12))
def test_a_lying_server_cannot_end_the_run_early(honest: list[int], stage: int, claim: int) -> None:
    # beside every stage's honest server far from the limit, a stranger announces a huge step in one
    # stage (or in all of them): the run goes on
    one = {k: [step, claim] if k == stage else [step] for k, step in enumerate(honest)}
    assert not limit_reached(one, 3, 10)
    assert not limit_reached({k: [step, claim] for k, step in enumerate(honest)}, 3, 10)
