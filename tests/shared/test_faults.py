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


def test_a_scoped_point_fires_only_for_the_tagged_task() -> None:
    fired: list[str] = []

    async def member(tag: str) -> None:
        with faults.scope(tag):
            for _ in range(3):
                try:
                    await faults.point("p")
                except faults.FaultInjected:
                    fired.append(tag)

    async def main() -> None:
        faults.arm("p", "raise", on_hit=2, where="b")
        async with trio.open_nursery() as nursery:
            for tag in ("a", "b", "c"):
                nursery.start_soon(member, tag)

    trio.run(main)
    assert fired == ["b"]  # on b's own second hit, whatever the others did meanwhile
    assert faults.hits("p") == 9


def test_stop_freezes_a_child_process_with_its_connections_open() -> None:
    code = (
        "from shared import faults\n"
        "print('before', flush=True)\nfaults.hit('x')\nprint('resumed', flush=True)"
    )
    env = {**os.environ, faults.ENV: "x=stop"}
    with subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "before\n"
            _, status = os.waitpid(child.pid, os.WUNTRACED)  # returns once the child is stopped
            assert os.WIFSTOPPED(status)
            os.kill(child.pid, signal.SIGCONT)
            assert child.stdout.readline() == "resumed\n"
            assert child.wait(timeout=120) == 0
        finally:
            if child.poll() is None:
                child.kill()
