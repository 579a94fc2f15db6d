"""Which answers of a stage server a trainer refuses (issue 17 item 3: "activations and gradients that come
back non-finite, mis-shaped or with absurd norms ban their server like a failure"; pure: no torch).

A trainer checks every tensor a server sends back (the stage's activations in the forward pass, the
gradient of the stage's input in the backward pass) before passing it on; a refused answer bans the
server (:meth:`.wiring.StageRouter.fail`) and the micro-batch is retried elsewhere, so no sample is lost.
The caller reduces the tensor to three facts and :meth:`AnswerCheck.problem` decides:

1. *Shape.* An answer's shape must equal the one the contract fixes (:mod:`volunteer.tasks.stages`:
   ``(samples, length, width)`` forward; the input's shape backward).
2. *Finite.* Every element must be finite (no NaN, no inf).
3. *Scale.* Its root mean square ``rms = ||x|| / sqrt(numel)`` (so micro-batch size does not matter) must
   not exceed ``k · lmed(R)``, where ``R`` holds the RMS of the last :attr:`AnswerLimits.window` answers
   this check accepted *for the same stage and direction* (from any server) and ``lmed`` is the lower
   median; ``k`` = :attr:`AnswerLimits.factor` (10, as the averaging's norm bound,
   :mod:`shared.averaging.robust`, which measured honest gradient norms within 2.6x of their lower
   median on tiny-mlm). Until :attr:`AnswerLimits.warmup` answers are accepted only the absolute cap
   :attr:`AnswerLimits.max_rms` applies.

**Why a median of accepted answers.** Honest servers of a stage compute the same function of the same
parameters, so their answers' scales agree up to the data's own variation; a lying or broken server
either stands out (refused) or stays within ``k`` honest scales. While honest answers are the majority of
the window, the lower median stays within the honest range, so a minority cannot raise the bound by
feeding it large accepted answers (each is at most ``k`` times the median it was compared with, and the
median does not move by more than the honest spread). What passes all three checks can still be wrong
(a server that returns plausible garbage); that is what averaging's robust aggregation and the ledger's
receipts are for, not this check.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["AnswerCheck", "AnswerLimits"]


@dataclass(frozen=True)
class AnswerLimits:
    """Tunables of :class:`AnswerCheck` (module docstring).

    Attributes:
        factor: ``k``, how many lower-median RMS an answer may reach (``> 1``).
        window: how many accepted RMS values the median is taken over.
        warmup: accepted answers before the relative bound applies (``<= window``).
        max_rms: an absolute cap on the RMS, always applied (float16 overflows at 65504).
    """

    factor: float = 10.0
    window: int = 64
    warmup: int = 8
    max_rms: float = 6e4

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor > 1.0):
            raise ValueError(f"factor must be finite and > 1, got {self.factor}")
        if not (1 <= self.warmup <= self.window):
            raise ValueError(f"need 1 <= warmup <= window, got warmup={self.warmup}, window={self.window}")
        if not (math.isfinite(self.max_rms) and self.max_rms > 0.0):
            raise ValueError(f"max_rms must be finite and > 0, got {self.max_rms}")


@dataclass
class AnswerCheck:
    """The answer check of one stage and direction, as one trainer sees it (module docstring)."""

    limits: AnswerLimits = field(default_factory=AnswerLimits)
    _accepted: deque[float] = field(default_factory=deque)

    def bound(self) -> float:
        """The largest RMS accepted now: ``min(max_rms, k · lmed(R))``, or ``max_rms`` during warm-up."""
        if len(self._accepted) < self.limits.warmup:
            return self.limits.max_rms
        ordered = sorted(self._accepted)
        lower_median = ordered[(len(ordered) - 1) // 2]
        return min(self.limits.max_rms, self.limits.factor * lower_median)

    def problem(
        self, shape: tuple[int, ...], expected: tuple[int, ...], *, finite: bool, rms: float
    ) -> str | None:
        """Why the answer is refused (the server is then banned), or ``None``: it is accepted and its RMS
        joins the window.

        Args:
            shape: the answer's shape.
            expected: the shape the stage contract fixes.
            finite: whether every element is finite.
            rms: ``||x|| / sqrt(numel)`` (ignored when ``finite`` is false).
        """
        if tuple(shape) != tuple(expected):
            return f"shape {tuple(shape)} is not the expected {tuple(expected)}"
        if not finite or not math.isfinite(rms):
            return "non-finite values"
        if rms < 0.0:
            return f"negative RMS {rms}"
        limit = self.bound()
        if rms > limit:
            return f"RMS {rms:.3g} exceeds the bound {limit:.3g}"
        self._accepted.append(rms)
        if len(self._accepted) > self.limits.window:
            self._accepted.popleft()
        return None
