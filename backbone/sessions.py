"""The backbone closes the sessions of volunteer processes that went silent (schema's ``sessions``).

A volunteer process opens its session with its first heartbeat (``POST sessions/<token>/alive``, see
:mod:`protocols.api`), heartbeats every ~``timeout / 4`` and ends it with ``.../leave``. A process that
dies without leaving (SIGKILL, a pulled plug, a lost network) stops heartbeating; this sweep closes its
session as ``timeout`` at its last heartbeat, the last time anyone knew it alive. A restart of the same
peer (new process, new token) closes the old session at once (``replaced``, in the store).

The sweep starts only after one full ``timeout`` of this backbone's own uptime: while the backbone was
down, nobody could heartbeat to it, and closing every session the moment it comes back would record
departures that never happened (the volunteers heartbeat again within ``timeout / 4``). With several
backbones on one database each sweeps; closing is idempotent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from shared.tolerated import Tolerated

from .api import DB_WRITE
from .ledger import LedgerError, LedgerStore

__all__ = ["close_silent_sessions_forever"]

logger = logging.getLogger(__name__)


async def close_silent_sessions_forever(
    store: LedgerStore, silence: float, clock: Callable[[], float] = time.time
) -> None:
    """Every ``silence / 4`` seconds (after a first ``silence``), close sessions silent for ``silence``."""
    tolerated = Tolerated(logger)
    await trio.sleep(silence)
    while True:
        with tolerated.around("closing silent sessions", LedgerError):
            closed = await trio.to_thread.run_sync(
                lambda: store.close_silent_sessions(silent_since=clock() - silence), limiter=DB_WRITE
            )
            if closed:
                logger.info("closed %d silent volunteer sessions (no heartbeat for %.0f s)", closed, silence)
        await trio.sleep(silence / 4)
