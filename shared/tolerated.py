"""Failures a background task tolerates, counted rather than dropped.

A publisher whose store found no live node, a poll whose read timed out, a probe nobody answered: such
failures are expected on the Internet and must not end the task, but swallowing them silently hides a
node that is failing every time (``contextlib.suppress(*CALL_FAILURES)`` did that). :class:`Tolerated`
suppresses the same exceptions, counts them per *site* (a short name of the place), and logs the first
one of a site and then at most one line per ``log_every`` seconds with the count so far. The counts go
into the owner's statistics (``snapshot()``), where the panel, the API and tests can see them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from .net.host import CALL_FAILURES

__all__ = ["Tolerated"]


class Tolerated:
    def __init__(self, logger: logging.Logger, *, log_every: float = 60.0) -> None:
        self.logger = logger
        self.log_every = log_every
        self.counts: Counter[str] = Counter()
        self._logged: dict[str, float] = {}

    @contextmanager
    def around(self, site: str, *kinds: type[BaseException]) -> Iterator[None]:
        """Suppress ``kinds`` (default: :data:`~shared.net.host.CALL_FAILURES`) raised in the block,
        counting each under ``site``."""
        caught = kinds or CALL_FAILURES
        try:
            yield
        except caught as exc:
            self.note(site, exc)

    def note(self, site: str, exc: BaseException) -> None:
        self.counts[site] += 1
        now = time.monotonic()
        last = self._logged.get(site)
        if last is None or now - last >= self.log_every:
            self._logged[site] = now
            self.logger.info("%s failed (%d so far): %s", site, self.counts[site], exc)

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
