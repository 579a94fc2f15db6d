"""**Pure**: which held-out evaluations are believed, and a step's cross-checked held-out loss (DESIGN D10).

:func:`open_evaluation` (the signature), then :func:`check_evaluation` (the rest), check a
:class:`~protocols.evaluation.SignedEvaluation` against everything the backbone knows before anything is
stored (the rules are :mod:`protocols.evaluation`'s): the signature of the peer it names, this run, the
clock, the manifest's number of examples, the backbone's own held-out digest (when it serves the held-out
shards), and that the step is at most :data:`~protocols.evaluation.MAX_STEPS_AHEAD` past the newest step
its step log holds.

:func:`summarize` turns the stored claims of one step into the step's held-out loss:

1. **the evaluated thing**: claims name the parameters (fingerprint) and the held-out set (digest) they
   used; the pair that the most *users* claimed wins (ties: more claims, then the smaller pair), so a
   forked peer, or one that read other examples, cannot pull the number towards its own;
2. **one voice per user**: each user's value is the median of its peers' claims of that pair, so a user
   with many machines counts once;
3. **the loss** is the median of the users' values: with ``u`` users, fewer than ``u / 2`` liars cannot
   move it outside the range of the honest users' values (a median's breakdown point);
4. **outliers**: claims of another pair, and claims further than ``max(ABS_TOLERANCE, REL_TOLERANCE *
   |loss|)`` from the loss. Honest evaluators of the same parameters over the same examples agree to
   float rounding (the same device kind: bit for bit; CPU against GPU: ~1e-6 relative), far within it;
5. **single-sourced**: fewer than two users back the loss; it is shown, marked as not cross-checked.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from protocols.auth import MAX_CLOCK_SKEW
from protocols.evaluation import (
    MAX_STEPS_AHEAD,
    Evaluation,
    SignedEvaluation,
    decode_evaluation,
    evaluation_payload,
)
from shared.auth.keys import verify_by_peer_id
from shared.errors import ProtocolError

__all__ = [
    "ABS_TOLERANCE",
    "REL_TOLERANCE",
    "Claim",
    "EvaluationRejected",
    "StepEvaluation",
    "check_evaluation",
    "open_evaluation",
    "summarize",
]

#: Two losses of one step closer than this (absolute, or relative to the loss) agree.
ABS_TOLERANCE = 1e-4
REL_TOLERANCE = 1e-3


class EvaluationRejected(ValueError):
    """An evaluation breaks a rule (``code``: ``invalid``, ``bad_signature``, ``unknown_run``,
    ``clock_skew``, ``wrong_examples``, ``wrong_eval_set``, ``future_step``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def open_evaluation(signed: SignedEvaluation) -> Evaluation:
    """The evaluation inside ``signed``, signed by the peer it names (the checks that need nothing else,
    so a backbone can charge the peer's rate budget before any other work).

    Raises:
        EvaluationRejected: malformed (``invalid``) or not signed by its peer (``bad_signature``).
    """
    try:
        evaluation = decode_evaluation(signed.evaluation)
    except ProtocolError as exc:
        raise EvaluationRejected("invalid", str(exc)) from exc
    if not verify_by_peer_id(evaluation.peer_id, signed.signature, evaluation_payload(signed.evaluation)):
        raise EvaluationRejected("bad_signature", f"the evaluation is not signed by {evaluation.peer_id}")
    return evaluation


def check_evaluation(
    evaluation: Evaluation,
    *,
    run_id: str,
    now: float,
    examples: int,
    eval_set: str | None,
    newest_step: int | None,
) -> Evaluation:
    """``evaluation`` if it keeps the rules of the module docstring that need the backbone's knowledge.

    Args:
        examples: the manifest's ``dataset.eval_examples``.
        eval_set: the digest of the held-out set this backbone serves (None: it serves none).
        newest_step: the newest step in the backbone's step log (None: none yet).

    Raises:
        EvaluationRejected: which rule it breaks (its ``code``) and how.
    """
    if evaluation.run_id != run_id:
        raise EvaluationRejected("unknown_run", f"this backbone serves run {run_id}, not {evaluation.run_id}")
    if not abs(now - evaluation.timestamp) <= MAX_CLOCK_SKEW:
        raise EvaluationRejected(
            "clock_skew", f"the evaluation's time is {evaluation.timestamp - now:+.0f} s off this backbone's"
        )
    if evaluation.examples != examples:
        raise EvaluationRejected(
            "wrong_examples", f"the run evaluates {examples} held-out examples, not {evaluation.examples}"
        )
    if eval_set is not None and evaluation.eval_set != eval_set:
        raise EvaluationRejected(
            "wrong_eval_set", "the evaluation is not of the held-out examples this backbone serves"
        )
    frontier = newest_step or 0
    if evaluation.step > frontier + MAX_STEPS_AHEAD:
        raise EvaluationRejected(
            "future_step",
            f"step {evaluation.step} is more than {MAX_STEPS_AHEAD} steps past the newest step the run "
            f"has taken ({frontier})",
        )
    return evaluation


@dataclass(frozen=True)
class Claim:
    """One stored evaluation of a step: who (peer and user) saw which loss of which parameters."""

    peer_id: str
    user: str
    loss: float
    params: bytes
    eval_set: str


@dataclass(frozen=True)
class StepEvaluation:
    """A step's cross-checked held-out loss (see the module docstring)."""

    step: int
    loss: float
    #: users with a peer whose claim agrees with ``loss`` (0 or 1: not cross-checked)
    users: int
    #: peers whose claims agree with ``loss`` (within the tolerance)
    agreeing: int
    #: peers whose claims do not (another pair, or too far from ``loss``), sorted
    outliers: tuple[str, ...]

    @property
    def single_sourced(self) -> bool:
        return self.users < 2


def _median(values: Sequence[float]) -> float:
    """The median of finite ``values``, finite too: the two middle values are halved before they are added
    (``statistics.median`` of two values near the float maximum overflows to infinity)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return ordered[middle - 1] / 2 + ordered[middle] / 2


def summarize(step: int, claims: Sequence[Claim]) -> StepEvaluation | None:
    """The held-out loss of ``step`` from its ``claims`` (any order); None without a finite claim."""
    finite = [c for c in claims if math.isfinite(c.loss)]
    if not finite:
        return None
    by_pair: dict[tuple[bytes, str], list[Claim]] = defaultdict(list)
    for claim in finite:
        by_pair[(claim.params, claim.eval_set)].append(claim)
    pair = min(by_pair, key=lambda p: (-len({c.user for c in by_pair[p]}), -len(by_pair[p]), p))
    chosen = by_pair[pair]
    per_user: dict[str, list[float]] = defaultdict(list)
    for claim in chosen:
        per_user[claim.user].append(claim.loss)
    loss = _median([_median(values) for values in per_user.values()])
    tolerance = max(ABS_TOLERANCE, REL_TOLERANCE * abs(loss))
    agreeing = [c for c in chosen if abs(c.loss - loss) <= tolerance]
    outliers = sorted({c.peer_id for c in finite} - {c.peer_id for c in agreeing})
    return StepEvaluation(step, loss, len({c.user for c in agreeing}), len(agreeing), tuple(outliers))
