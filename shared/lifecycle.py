"""Running a long-lived service under a process's signals: Ctrl+C and SIGTERM leave cleanly.

The first SIGINT/SIGTERM asks the service to stop (``shutdown.requested`` is set) once it is up, so it can
leave the DHT, finish a round, report; before it is up, or at a second signal, the body is cancelled at
once. Either way the process exits with code 0 and no traceback.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

__all__ = ["Shutdown", "run_until_signal"]


@dataclass
class Shutdown:
    requested: trio.Event = field(default_factory=trio.Event)
    signal_name: str | None = None
    graceful: bool = False  # set by the body once it can stop by itself when ``requested`` is set

    def ready(self) -> None:
        """The body is up: from now on a signal asks it to stop instead of cancelling it."""
        self.graceful = True


async def run_until_signal(body: Callable[[Shutdown], Awaitable[None]]) -> Shutdown:
    """Run ``body(shutdown)`` until it returns; SIGINT/SIGTERM stop it as described above."""
    shutdown = Shutdown()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            body_scope = trio.CancelScope()

            async def watch() -> None:
                async for signum in signals:
                    first = not shutdown.requested.is_set()
                    shutdown.signal_name = signal.Signals(signum).name
                    shutdown.requested.set()
                    if not (first and shutdown.graceful):
                        body_scope.cancel()

            nursery.start_soon(watch)
            with body_scope:
                await body(shutdown)
            nursery.cancel_scope.cancel()
    return shutdown
