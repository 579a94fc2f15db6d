"""Group formation, pure: how big groups are, who averages with whom, and how long a round may take.

**Group size** (seed 000 §3.2 "Node failures"). A failure spoils only its own group's round. If each peer
fails during a round with probability ``f``, a group of ``m`` peers completes with probability
``(1 - f)^m``. :func:`choose_group_size` picks the largest ``m <= max_size`` with
``(1 - f)^m >= 1 - max_spoil`` (at least ``min_size``, at most the number of peers): reliable swarms
average in big groups (fewer rounds to mix), flaky ones in small groups (fewer spoiled rounds).

**Moshpit groups** (Ryabinin et al., 2021). Peers sit on a virtual ``d``-dimensional grid with ``m`` cells
per side, ``d = ceil(log_m n)``; in round ``r`` a peer averages with the peers sharing all its coordinates
except coordinate ``r mod d``. On a full grid (``n = m^d``) every peer holds the exact global mean after
``d`` rounds; with gaps or failures the spread still shrinks geometrically. A peer's coordinates are the
base-``m`` digits of a hash of (peer id, epoch), so cells are balanced in expectation and change every epoch
(alternating membership).

**Deadlines** adapt to what rounds really took: :func:`adaptive_deadline` scales the LP's predicted
averaging time by the worst recent ratio of measured to predicted time (with headroom), so nobody tunes a
constant by hand, yet a round that hangs is still bounded.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

__all__ = ["adaptive_deadline", "choose_group_size", "group_key", "grid_coordinates", "grid_dims"]


def choose_group_size(
    n_peers: int, failure_rate: float, *, max_size: int = 32, min_size: int = 2, max_spoil: float = 0.1
) -> int:
    """The group size for ``n_peers`` peers that fail with probability ``failure_rate`` per round.

    Raises:
        ValueError: an argument is out of range.
    """
    if (
        n_peers < 1
        or not 0.0 <= failure_rate < 1.0
        or not 0.0 < max_spoil < 1.0
        or not 2 <= min_size <= max_size
    ):
        raise ValueError(
            f"invalid group sizing: n={n_peers}, f={failure_rate}, sizes [{min_size}, {max_size}], "
            f"max_spoil={max_spoil}"
        )
    # (1 - f)^m >= 1 - s  <=>  m <= log(1 - s) / log(1 - f)   (infinite for f = 0 or a subnormal f)
    with_f = math.log1p(-failure_rate)
    limit = math.log1p(-max_spoil) / with_f if with_f < 0 else math.inf
    best = max_size if limit >= max_size else math.floor(limit)
    return max(1, min(n_peers, max(min_size, min(max_size, best))))


def grid_dims(n_peers: int, group_size: int) -> int:
    """``d = ceil(log_m n)``: dimensions of a grid with ``m`` cells per side holding ``n`` peers."""
    if n_peers < 1 or group_size < 1:
        raise ValueError(f"need n_peers >= 1 and group_size >= 1, got {n_peers}, {group_size}")
    if group_size == 1 or n_peers <= group_size:
        return 1
    dims = 1
    while group_size**dims < n_peers:
        dims += 1
    return dims


def grid_coordinates(peer_id: str, epoch: int, dims: int, group_size: int) -> tuple[int, ...]:
    """The peer's cell for ``epoch``: base-``group_size`` digits of sha256(peer id, epoch)."""
    value = int.from_bytes(hashlib.sha256(f"moshpit:{epoch}:{peer_id}".encode()).digest(), "big")
    digits = []
    for _ in range(dims):
        value, digit = divmod(value, group_size)
        digits.append(digit)
    return tuple(digits)


def group_key(peer_id: str, epoch: int, round_: int, dims: int, group_size: int) -> str:
    """Peers with the same key average together in ``round_``: all coordinates but ``round_ mod dims``."""
    coords = grid_coordinates(peer_id, epoch, dims, group_size)
    free = round_ % dims
    return ".".join("*" if i == free else str(c) for i, c in enumerate(coords))


def adaptive_deadline(
    predicted_seconds: float,
    observed_ratios: Sequence[float],
    *,
    floor: float = 15.0,
    ceiling: float = 3600.0,
) -> float:
    """A round's deadline from the LP's prediction and recent ``measured / predicted`` ratios.

    ``deadline = floor + predicted * max(3, 2 * worst recent ratio)``, clamped to ``ceiling``; with no
    history the factor is 3. Non-finite predictions (a forced plan that cannot move data) give the ceiling.
    """
    if not math.isfinite(predicted_seconds) or predicted_seconds < 0:
        return ceiling
    recent = [r for r in observed_ratios[-16:] if math.isfinite(r) and r > 0]
    factor = max(3.0, 2.0 * max(recent)) if recent else 3.0
    return min(ceiling, floor + predicted_seconds * factor)
