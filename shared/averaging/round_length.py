"""How many samples one low-communication round should take (issue 16, DiLoCo mode; pure, no torch).

In the DiLoCo mode (:mod:`volunteer.collab.diloco`) the members train locally and average their
pseudo-gradients once per *round*; a round ends when the collaboration has processed its target number of
samples ``N`` (as DeDLOC's target batch: fast members take more inner steps than slow ones). A longer round
sends fewer bytes per sample but averages less often; this module picks the shortest round whose averaging
stays a small share of its compute.

**Inputs.** The members' measured throughputs ``s_i`` (samples/s, as in :class:`.load_balance.PeerSpec`;
``S = Σ_i s_i``), the predicted seconds ``A`` to average one pseudo-gradient vector (the plan's
``averaging_seconds = P / X`` from :func:`.load_balance.plan_averaging` with ``P`` the vector's bytes as
sent), a target fraction ``f`` (default :data:`DEFAULT_FRACTION` = 5 %) and the organizer's bounds
``[n_min, n_max]``.

**The rule.** The collaboration fills ``N`` samples in ``T(N) = N / S`` seconds of compute, so the averaging
costs the fraction ``φ(N) = A / T(N) = A S / N`` of it. ``φ(N) <= f`` holds exactly when ``N >= A S / f``;
the smallest such whole number is::

    N* = ceil(A S / f)            (0 when A = 0: averaging is free)
    N  = min(n_max, max(n_min, N*))

``bound`` says which bound decided ``N`` (``"min"``: ``N* < n_min``, a shorter round would already meet
``f``; ``"max"``: ``N* > n_max``, the fraction cannot be met and ``φ(N) > f`` is reported as predicted;
``None``: ``N = N*``). Properties (tested): ``N`` is non-decreasing in ``A`` and in ``S`` and non-increasing
in ``f``; ``n_min <= N <= n_max``; ``φ(N) <= f`` whenever ``N* <= n_max``.

**In the running system** (``[sync] min_round > 0`` in a ``diloco`` run; :class:`~volunteer.collab.step
.BatchStep`). The manifest's ``target_batch`` is then ``n_max`` (also what every plausibility cap on
progress claims uses), ``min_round`` is ``n_min`` and ``round_fraction`` is ``f``. Every peer must end a
round at the same number of samples, so ``N`` is computed only from what every member of a round holds
identically, the group's plan:

* ``S`` = the sum of the members' ticket throughputs (the rates the quotas use), ``A`` = the plan's
  ``predicted_seconds`` plus the matchmaking window (the round's fixed cost, which the LP does not see; on
  loopback it is most of the round). Every member computes ``N_{t+1}`` when it adopts round ``t``'s plan
  and publishes it in its progress record (``Progress.target``) once it steps.
* A peer that was not in the round (a newcomer, a peer back from a download) takes the value most users
  at its step publish (ties: the larger; a larger target never cuts the others' round short, they enter
  and it follows); with no such record, ``n_min`` (the start of a run: the shortest round measures first,
  and every peer at step 0 uses the same rule).
* Disagreement (members of different groups, a different matchmaking window, a liar) cannot fork the
  run: the first peer to reach its target enters the round, and the others follow a peer that entered
  (:mod:`shared.progress`); it only changes how long that one round is. A claim outside ``[n_min, n_max]``
  is not counted.

**What it does not model.** With overlap (:mod:`volunteer.collab.diloco`) the averaging runs during the
next inner phase, so ``φ`` is the share of *bandwidth time* per compute time rather than idle time; the
same rule keeps the averaging hidden when ``φ <= 1``. ``A`` comes from the plan for the round's group, whose
compute set may depend on the target batch passed to the LP; the caller re-plans when membership or
measurements change and recomputes ``N`` then (a fixed point is not searched for).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["DEFAULT_FRACTION", "RoundLength", "round_length"]

DEFAULT_FRACTION = 0.05


@dataclass(frozen=True)
class RoundLength:
    """The chosen round length and what it predicts.

    Attributes:
        target_samples: ``N``, samples the collaboration processes per round.
        required_samples: ``A S / f``, the (real-valued) length at which the fraction is exactly met.
        compute_seconds: ``N / S``, predicted compute time of the round.
        averaging_seconds: ``A``, as given.
        fraction: ``φ = A S / N``, the predicted share of averaging per compute time (``inf`` if ``A`` is).
        bound: ``"min"`` or ``"max"`` when an organizer bound decided ``N``; ``None`` otherwise.
    """

    target_samples: int
    required_samples: float
    compute_seconds: float
    averaging_seconds: float
    fraction: float
    bound: Literal["min", "max"] | None


def round_length(
    samples_per_second: Sequence[float],
    averaging_seconds: float,
    *,
    fraction: float = DEFAULT_FRACTION,
    min_samples: int = 1,
    max_samples: int,
) -> RoundLength:
    """The round's target samples so that averaging stays under ``fraction`` of compute (module docstring).

    Args:
        samples_per_second: the members' measured ``s_i`` (>= 0, finite, at least one positive).
        averaging_seconds: ``A`` (>= 0; ``inf`` allowed: the round then takes ``max_samples``).
        fraction: ``f`` in (0, 1].
        min_samples: ``n_min`` >= 1.
        max_samples: ``n_max`` >= ``min_samples``.

    Raises:
        ValueError: an argument outside the ranges above.
    """
    rates = [float(s) for s in samples_per_second]
    if not rates or any(not math.isfinite(s) or s < 0.0 for s in rates):
        raise ValueError(f"samples_per_second must be finite and >= 0, got {rates}")
    total = math.fsum(rates)
    if total <= 0.0:
        raise ValueError("no member computes (every samples_per_second is 0)")
    if math.isnan(averaging_seconds) or averaging_seconds < 0.0:
        raise ValueError(f"averaging_seconds must be >= 0, got {averaging_seconds}")
    if not (math.isfinite(fraction) and 0.0 < fraction <= 1.0):
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if min_samples < 1 or max_samples < min_samples:
        raise ValueError(f"need 1 <= min_samples <= max_samples, got [{min_samples}, {max_samples}]")

    required = averaging_seconds * total / fraction
    bound: Literal["min", "max"] | None = None
    if required > max_samples:  # inf included
        target, bound = max_samples, "max"
    else:
        target = math.ceil(required)
        if target < min_samples:
            target, bound = min_samples, "min"
    return RoundLength(
        target_samples=target,
        required_samples=required,
        compute_seconds=target / total,
        averaging_seconds=averaging_seconds,
        fraction=averaging_seconds * total / target,
        bound=bound,
    )
