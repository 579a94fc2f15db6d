"""Token-bucket rate limiting, pure (time passed in): join attempts per address and per invite.

Each key has a bucket of ``burst`` tokens refilled at ``rate`` per second; an attempt takes one token.
At most ``max_keys`` buckets are kept (least recently used evicted), so a flood of addresses costs
bounded memory; an evicted key simply starts again with a full bucket.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["RateLimiter"]


class RateLimiter:
    def __init__(self, rate: float, burst: float, max_keys: int = 100_000) -> None:
        if rate <= 0 or burst < 1 or max_keys < 1:
            raise ValueError(f"invalid rate limit: rate={rate}, burst={burst}, max_keys={max_keys}")
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, key: str, now: float) -> bool:
        """Take a token from ``key``'s bucket if it has one."""
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
        allowed = tokens >= 1
        self._buckets[key] = (tokens - 1 if allowed else tokens, now)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return allowed

    def retry_after(self, key: str, now: float) -> float:
        tokens, last = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate
