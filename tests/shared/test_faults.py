"""Named fault points (shared.faults) and counted tolerated failures (shared.tolerated)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest
import trio

from shared import faults
from shared.errors import PeerUnavailable
from shared.tolerated import Tolerated


@pytest.fixture(autouse=True)
def _clean() -> None:
    faults.disarm()


def test_parse_accepts_entries_and_refuses_garbage() -> None:
    assert faults.parse(" a=kill@2, b=raise ,") == {"a": ("kill", 2), "b": ("raise", 1)}
    for bad in ("a", "a=explode", "=kill", "a=kill@x", "a=kill@0"):
        with pytest.raises(ValueError, match="fault entry"):
            faults.parse(bad)


def test_a_point_fires_once_on_the_chosen_hit() -> None:
    faults.arm("p", "raise", on_hit=2)
    faults.hit("p")
    with pytest.raises(faults.FaultInjected):
        faults.hit("p")
    faults.hit("p")  # once only
    assert faults.hits("p") == 3


def test_async_hang_blocks_until_cancelled() -> None:
    async def main() -> bool:
        faults.arm("h", "hang")
        with trio.move_on_after(0.2) as scope:
            await faults.point("h")
        await faults.point("h")  # fired once: passes now
        return scope.cancelled_caught

    assert trio.run(main)


def test_the_environment_arms_a_child_process_that_kills_itself() -> None:
    code = (
        "from shared import faults\n"
        "faults.hit('x')\nprint('after first', flush=True)\nfaults.hit('x')\nprint('never')"
    )
    env = {**os.environ, faults.ENV: "x=kill@2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert done.stdout == "after first\n"


def test_tolerated_counts_what_it_suppresses_and_passes_the_rest() -> None:
    tolerated = Tolerated(logging.getLogger("test"))
    for _ in range(3):
        with tolerated.around("publish"):
            raise PeerUnavailable("nobody")
    with pytest.raises(KeyError), tolerated.around("publish"):
        raise KeyError("a bug is not a tolerated failure")
    assert tolerated.snapshot() == {"publish": 3}
