"""Every torch call of a volunteer runs on one long-lived worker thread.

Why one thread and not trio's thread cache: torch's OpenMP runtime gives each thread that runs torch
operations its own team of threads, and once a process holds more OpenMP threads than cores, libgomp stops
spin-waiting between parallel regions, so every small operation pays a futex wake-up. Measured with
``scripts/bench_overhead.py`` on 2 cores: micro-batches of tiny-mlm took 17 ms instead of 6.8 ms when trio
ran them on two different worker threads. Torch calls never ran in parallel anyway (the trainer locks).

A call awaited here is not interrupted by cancellation: the awaiting task stops waiting, the call finishes
on the thread (the trainer's methods are short, one micro-batch at most).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import trio

__all__ = ["run_torch"]

T = TypeVar("T")
_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")


async def run_torch(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the torch thread; raises what it raises."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: Future[T]) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    future = _EXECUTOR.submit(fn, *args)
    future.add_done_callback(wake)
    await done.wait()
    return future.result()
