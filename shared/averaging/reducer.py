"""The aggregator's weighted reduction of one slice, and what a round did to every peer's vector.

**Math.** Sender ``i`` delivers its copy ``x_i`` of the slice (as parts) with weight ``w_i`` (its sample
count; 0 for auxiliary peers). Over the senders ``C`` that delivered the *complete* slice::

    avg = Σ_{i∈C} w_i x_i / W,        W = Σ_{i∈C} w_i  (must be > 0)

**Determinism.** Parts are kept per sender as they arrive (no copies) and summed only in :meth:`finalize`,
in sorted peer-id order, part by part, in float64: ``acc = w_a x_a; acc += w_b x_b; …; avg = f32(acc / W)``.
The bytes of ``avg`` therefore depend only on the set of contributions, never on arrival order or timing.
float64 rather than float32 with Kahan summation: one multiply-add per element and sender, 29 spare bits
over the float32 result, so the only rounding that usually shows is the final one to float32 (with
cancellation the absolute error stays below ``|C|·2**-52·Σ w_i|x_i| / W``). Senders of weight 0 are skipped:
their parts are validated, but they cannot change a single bit of the result.

**Rules.** ``rule`` (:class:`protocols.training.AveragingSpec`, from the manifest's ``[averaging]`` table
through the group plan) picks the weighted mean above, CenteredClip or the coordinate-wise trimmed mean
(:mod:`shared.averaging.robust` for their math); the robust rules take the complete senders' slices in the
same sorted order and are as deterministic.

**Norm bound** (issue 9 finding 6; on by default). At :meth:`finalize`, once every sender's parts are in, part
``p`` of sender ``i`` is rejected when ``||x_ip|| > k · a_i · lmed_j ||x_jp||`` over the complete senders of
positive weight (``k = rule.norm_factor``, ``a_i`` the weight allowance; the rule, why it is robust, and the
one- and two-sender cases are in :mod:`shared.averaging.robust`). The norms are the ones taken when each part
was checked (a float32 dot product, recomputed in float64 when it overflows). Such a sender is banned for the
round (``RejectReason.OUTLIER_NORM`` in :class:`Completeness`, one log line) and left out of every part of the
slice. Deciding this needs all inputs of a part, which the reducer keeps anyway until the deterministic sum:
memory is bounded by ``senders x slice size x 4`` bytes (the all-reduce gives each part its own reducer:
``senders x 4 MiB`` at most per part in flight).

**Validation.** :meth:`SliceReducer.add_part` raises :class:`PartRejected` and *bans the sender for the
round* for a part that is not float32/1-D, is not in the slice's canonical layout (``partition``), is a
duplicate, has a weight that is negative, non-finite or differs from the sender's announced or earlier
weight, holds NaN/Inf, has an element above ``max_abs`` or an L2 norm above ``max_norm``. A banned sender's
earlier parts are forgotten, so it contributes nothing. Parts from unknown senders, from dropped senders
and after :meth:`finalize` are rejected without a ban.

**Faults** (issue 4 item 6; DESIGN §6). A sender that dies mid-round is dropped (:meth:`drop_sender`) and
the mean renormalizes over the rest; a sender still incomplete at finalize is excluded the same way. An
aggregator that dies leaves its slice *un-averaged*: every peer keeps its own local values for that range,
and :class:`RoundOutcome` names exactly those ranges. :func:`apply_outcome` writes an averaged slice only
when it is complete and checked, so no vector is ever left half-written. With a lossy codec on the return
path the aggregator must also keep ``decode(encode(avg))`` of its own slice, as every receiver does.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protocols.averaging import MAX_WEIGHT, PartHeader
from protocols.peer_id import PeerId
from protocols.training import AveragingSpec
from shared.errors import ProjectError

from .partition import DEFAULT_PART_NUMEL, Slice, num_parts, part_bounds, slice_views
from .robust import SMALLEST_EXACT_SQUARE, ClipReport, aggregate, norm_outliers, sq_norm

__all__ = [
    "DEFAULT_RULE",
    "Completeness",
    "NothingToAverage",
    "PartRejected",
    "RejectReason",
    "RoundOutcome",
    "SliceOutcome",
    "SliceReducer",
    "apply_outcome",
]

logger = logging.getLogger(__name__)
Float32Array = npt.NDArray[np.float32]
#: Weighted mean, relative norm bound on with k = 10. ``AveragingSpec(norm_factor=math.inf)`` turns the
#: bound off; a manifest cannot (its decoder caps k at 1e6): for tests of the arithmetic and baselines.
DEFAULT_RULE = AveragingSpec()
_NOT_BANNING = ("UNKNOWN_SENDER", "DROPPED", "FINALIZED", "BANNED")


class RejectReason(enum.Enum):
    """Why a part was refused; every reason but the first four also bans the sender for the round."""

    UNKNOWN_SENDER = "not a sender of this slice"
    DROPPED = "sender was dropped from this round"
    FINALIZED = "the slice was already finalized"
    BANNED = "sender is banned for this round"
    BAD_DTYPE = "values are not a 1-D float32 array"
    BAD_PART = "part index, offset or length does not match the slice's layout"
    DUPLICATE = "part delivered twice"
    BAD_WEIGHT = "weight is negative, non-finite or inconsistent"
    NON_FINITE = "values hold NaN or Inf"
    ABSURD_VALUE = "an element's magnitude exceeds the limit"
    ABSURD_NORM = "the part's L2 norm exceeds the limit"
    OUTLIER_NORM = "the part's L2 norm exceeds norm_factor times the group's median part norm"

    @property
    def bans(self) -> bool:
        return self.name not in _NOT_BANNING


class PartRejected(ProjectError):
    """A gradient part was refused by :meth:`SliceReducer.add_part`; ``reason.bans`` says whether the
    sender is now excluded from the round (its earlier parts are forgotten)."""

    def __init__(self, sender: PeerId, reason: RejectReason, detail: str = "") -> None:
        super().__init__(f"part from {sender} rejected: {reason.value}" + (f" ({detail})" if detail else ""))
        self.sender = sender
        self.reason = reason


class NothingToAverage(ProjectError):
    """:meth:`SliceReducer.finalize` found no weight to divide by: every sender was dropped, banned or
    incomplete, or only weight-0 (auxiliary) senders delivered. ``completeness`` says which."""

    def __init__(self, completeness: Completeness) -> None:
        super().__init__(f"nothing to average: {completeness}")
        self.completeness = completeness


@dataclass(frozen=True)
class Completeness:
    """Who made it into a slice's average. All peer tuples are sorted."""

    contributors: tuple[PeerId, ...]  # delivered the whole slice (weight-0 ones included)
    total_weight: float  # Σ w_i over contributors
    incomplete: tuple[PeerId, ...]  # had not delivered every part: excluded
    dropped: tuple[tuple[PeerId, str], ...]  # died mid-round (why, as the caller said): excluded
    banned: tuple[tuple[PeerId, RejectReason], ...]  # sent a bad part: excluded

    @property
    def complete(self) -> bool:
        """Every listed sender contributed."""
        return not (self.incomplete or self.dropped or self.banned)


class SliceReducer:
    """The aggregator's state for one round of one slice (module docstring for math and rules).

    Args:
        numel: elements in the slice.
        senders: every peer expected to send, with its announced weight, or ``None`` to take the weight
            from its first part (later parts must repeat it). Peers that only receive are not listed.
        max_norm: largest acceptable L2 norm of one part (``math.inf``: no limit).
        part_numel: the round's part size, which fixes the canonical layout.
        max_abs: largest acceptable element magnitude (``None``: only ``max_norm`` applies).
        rule: the aggregation rule and the factor of the relative norm bound (the manifest's
            ``[averaging]``; default: weighted mean, bound on with k = 10).
    """

    def __init__(
        self,
        numel: int,
        senders: Mapping[PeerId, float | None],
        max_norm: float,
        *,
        part_numel: int = DEFAULT_PART_NUMEL,
        max_abs: float | None = None,
        rule: AveragingSpec = DEFAULT_RULE,
    ) -> None:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        if not max_norm > 0 or (max_abs is not None and not max_abs > 0):
            raise ValueError(f"limits must be positive, got max_norm={max_norm}, max_abs={max_abs}")
        for peer, weight in senders.items():
            if weight is not None and not (math.isfinite(weight) and 0.0 <= weight <= MAX_WEIGHT):
                raise ValueError(f"announced weight {weight!r} of {peer} is not finite in [0, 2**53]")
        self.numel = numel
        self.part_numel = part_numel
        self.max_norm = max_norm
        self.max_abs = max_abs
        self.rule = rule
        self.clip_report: ClipReport | None = None  # what CenteredClip did at finalize, for logs
        self._nparts = num_parts(numel, part_numel)
        self._weights: dict[PeerId, float | None] = dict(senders)
        self._parts: dict[PeerId, dict[int, Float32Array]] = {peer: {} for peer in senders}
        self._norms: dict[PeerId, dict[int, float]] = {peer: {} for peer in senders}  # from _check
        self._dropped: dict[PeerId, str] = {}
        self._banned: dict[PeerId, RejectReason] = {}
        self._final: Completeness | None = None
        self.outliers: dict[PeerId, str] = {}  # banned at finalize by the norm bound: why, for logs

    def add_part(self, sender: PeerId, header: PartHeader, values: Float32Array) -> None:
        """Accept one decoded part of ``sender``'s slice; ``values`` is kept by reference until
        :meth:`finalize`, so its buffer must not be reused.

        Raises:
            PartRejected: see :class:`RejectReason`; for banning reasons the sender is now excluded.
        """
        if sender not in self._parts:
            raise PartRejected(sender, RejectReason.UNKNOWN_SENDER)
        if self._final is not None:
            raise PartRejected(sender, RejectReason.FINALIZED)
        if sender in self._banned:
            raise PartRejected(sender, RejectReason.BANNED, self._banned[sender].value)
        if sender in self._dropped:
            raise PartRejected(sender, RejectReason.DROPPED)
        reason, detail, norm = self._check(sender, header, values)
        if reason is not None:
            self._banned[sender] = reason
            self._parts[sender].clear()
            raise PartRejected(sender, reason, detail)
        self._weights[sender] = header.weight
        self._parts[sender][header.part_index] = values
        self._norms[sender][header.part_index] = norm

    def _check(
        self, sender: PeerId, header: PartHeader, values: Float32Array
    ) -> tuple[RejectReason | None, str, float]:
        """Why the part is refused (``None``: accepted), details, and its L2 norm."""
        if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.ndim != 1:
            return RejectReason.BAD_DTYPE, f"{getattr(values, 'dtype', type(values))}", math.nan
        if not 0 <= header.part_index < self._nparts:
            return RejectReason.BAD_PART, f"part {header.part_index} of {self._nparts}", math.nan
        start, stop = part_bounds(self.numel, self.part_numel, header.part_index)
        if (header.offset, header.numel, values.size) != (start, stop - start, stop - start):
            detail = f"offset {header.offset}, numel {header.numel}, {values.size} values"
            return (
                RejectReason.BAD_PART,
                f"part {header.part_index} is [{start}, {stop}); got {detail}",
                math.nan,
            )
        if header.part_index in self._parts[sender]:
            return RejectReason.DUPLICATE, f"part {header.part_index}", math.nan
        weight, expected = header.weight, self._weights[sender]
        if not (math.isfinite(weight) and 0.0 <= weight <= MAX_WEIGHT) or (
            expected is not None and weight != expected
        ):
            return RejectReason.BAD_WEIGHT, f"weight {weight!r}, expected {expected!r}", math.nan
        with np.errstate(over="ignore", invalid="ignore"):
            square = float(np.dot(values, values))  # NaN/Inf in, NaN/Inf out: one pass in the common case
        if not math.isfinite(square) and not (
            values.size == 0 or (np.isfinite(values.min()) and np.isfinite(values.max()))
        ):
            return RejectReason.NON_FINITE, "", math.nan
        # float32 overflow of finite values, or underflow of tiny ones (squares below ~1e-38 lose their
        # digits, and a part of 1e-34s would measure 0, so the relative bound would have no scale to apply
        # to a liar): recomputed in float64, where both are exact enough to compare
        wide = not (SMALLEST_EXACT_SQUARE <= square < math.inf) and values.any()
        norm = math.sqrt(sq_norm(values)) if wide else math.sqrt(square)
        if norm > self.max_norm:
            return RejectReason.ABSURD_NORM, f"{norm:.3g} > {self.max_norm:.3g}", norm
        if self.max_abs is not None and values.size:
            magnitude = max(float(values.max()), -float(values.min()))
            if magnitude > self.max_abs:
                return RejectReason.ABSURD_VALUE, f"{magnitude:.3g} > {self.max_abs:.3g}", norm
        return None, "", norm

    def drop_sender(self, sender: PeerId, reason: str = "unreachable") -> None:
        """Exclude a sender that died mid-round (``reason`` goes into the report); the average
        renormalizes over the others.

        A no-op for banned senders and after :meth:`finalize` (the result is already fixed).

        Raises:
            ValueError: ``sender`` is not a sender of this slice.
        """
        if sender not in self._parts:
            raise ValueError(f"{sender} is not a sender of this slice")
        if self._final is None and sender not in self._banned:
            self._dropped[sender] = reason
            self._parts[sender].clear()

    def _complete(self, peer: PeerId) -> bool:
        excluded = peer in self._banned or peer in self._dropped
        return not excluded and len(self._parts[peer]) == self._nparts

    def missing(self) -> set[PeerId]:
        """Senders that are neither complete nor excluded: the ones the round still waits for."""
        excluded = self._dropped.keys() | self._banned.keys()
        return {peer for peer in self._parts if peer not in excluded and not self._complete(peer)}

    def completeness(self) -> Completeness:
        """Who is in the average: the final report after :meth:`finalize`, the current state before it."""
        if self._final is not None:
            return self._final
        contributors = tuple(sorted(peer for peer in self._parts if self._complete(peer)))
        return Completeness(
            contributors=contributors,
            total_weight=math.fsum(self._weights[peer] or 0.0 for peer in contributors),
            incomplete=tuple(sorted(self.missing())),
            dropped=tuple(sorted(self._dropped.items())),
            banned=tuple(sorted(self._banned.items())),
        )

    def _ban_norm_outliers(self) -> None:
        """Ban every complete sender of positive weight with a part above the relative bound (module
        docstring); all parts are judged against the same senders, so the order of parts does not matter."""
        peers = [p for p in sorted(self._parts) if self._complete(p) and (self._weights[p] or 0.0) > 0.0]
        if len(peers) < 2 or not math.isfinite(self.rule.norm_factor):
            return
        weights = [self._weights[p] or 0.0 for p in peers]
        outliers: dict[PeerId, str] = {}
        for index in range(self._nparts):
            norms = [self._norms[p][index] for p in peers]
            for i in norm_outliers(norms, weights, self.rule.norm_factor):
                outliers.setdefault(peers[i], f"part {index}: norm {norms[i]:.3g}, weight {weights[i]:g}")
        for peer in outliers:
            self._banned[peer] = RejectReason.OUTLIER_NORM
            self._parts[peer].clear()
        if outliers:
            logger.warning(
                "norm bound (k=%g) banned %d of %d senders: %s",
                self.rule.norm_factor,
                len(outliers),
                len(peers),
                "; ".join(f"{peer}: {why}" for peer, why in outliers.items()),
            )
        self.outliers = outliers

    def finalize(self) -> Float32Array:
        """Close the round: ban senders above the norm bound, then return the rule's aggregate (by default
        the weighted mean) over the complete senders (module docstring).

        An empty slice (``numel == 0``) yields an empty array whoever delivered.

        Raises:
            NothingToAverage: the slice is not empty and the total weight of complete senders is 0.
            RuntimeError: called twice.
        """
        if self._final is not None:
            raise RuntimeError("slice already finalized")
        try:
            if self.numel:
                self._ban_norm_outliers()
            report = self._final = self.completeness()
            summands = [(p, w) for p in report.contributors if (w := self._weights[p] or 0.0) > 0.0]
            if self.numel == 0:
                return np.empty(0, dtype=np.float32)
            if not report.total_weight > 0.0:
                raise NothingToAverage(report)
            if self.rule.rule != "mean" and len(summands) > 1:
                return self._robust(summands)
            out = np.empty(self.numel, dtype=np.float32)
            acc = np.empty(min(self.part_numel, self.numel), dtype=np.float64)
            term = np.empty_like(acc)
            for index in range(self._nparts):
                start, stop = part_bounds(self.numel, self.part_numel, index)
                a, t = acc[: stop - start], term[: stop - start]
                for k, (peer, weight) in enumerate(summands):
                    np.multiply(self._parts[peer][index], np.float64(weight), out=a if k == 0 else t)
                    if k:
                        a += t
                np.divide(a, report.total_weight, out=a)
                out[start:stop] = a
            return out
        finally:
            for parts in self._parts.values():
                parts.clear()

    def _robust(self, summands: Sequence[tuple[PeerId, float]]) -> Float32Array:
        """The robust rule over whole slices (a sender's parts are joined, a copy, when there are several)."""
        inputs = [
            parts[0] if self._nparts == 1 else np.concatenate([parts[k] for k in range(self._nparts)])
            for parts in (self._parts[peer] for peer, _ in summands)
        ]
        result, self.clip_report = aggregate(inputs, [w for _, w in summands], self.rule)
        return result.astype(np.float32)


@dataclass(frozen=True)
class SliceOutcome:
    """Whether a slice was averaged in this round, and if not, why (for logs and statistics)."""

    slice: Slice
    averaged: bool
    reason: str = ""


@dataclass(frozen=True)
class RoundOutcome:
    """What one round did to a peer's flat vector: one :class:`SliceOutcome` per slice, in order."""

    slices: tuple[SliceOutcome, ...]

    @classmethod
    def of(cls, slices: Sequence[Slice], failed: Mapping[int, str]) -> RoundOutcome:
        """Outcome where the slices of the aggregators in ``failed`` (index -> reason) were not averaged."""
        return cls(
            tuple(
                SliceOutcome(s, s.aggregator_index not in failed, failed.get(s.aggregator_index, ""))
                for s in slices
            )
        )

    def unaveraged(self) -> list[tuple[int, int]]:
        """``[start, stop)`` ranges that kept the peer's own local values, ascending; empty slices omitted."""
        return [(o.slice.start, o.slice.stop) for o in self.slices if not o.averaged and o.slice.numel]

    @property
    def complete(self) -> bool:
        """Every element was averaged."""
        return not self.unaveraged()


def apply_outcome(
    local: Float32Array, averaged_slices: Mapping[int, Float32Array], outcome: RoundOutcome
) -> list[tuple[int, int]]:
    """Write every averaged slice (aggregator index -> complete slice) into ``local`` in place; leave the
    un-averaged ranges untouched. Everything is checked before the first write: all or nothing.

    Returns:
        The un-averaged ``[start, stop)`` ranges (:meth:`RoundOutcome.unaveraged`).

    Raises:
        ValueError: the outcome's slices do not tile ``local``, or an averaged slice is missing or has
            the wrong shape or dtype.
    """
    views = slice_views(local, [o.slice for o in outcome.slices])
    writes = []
    for view, slice_outcome in zip(views, outcome.slices, strict=True):
        if not slice_outcome.averaged:
            continue
        index = slice_outcome.slice.aggregator_index
        values = averaged_slices.get(index)
        if values is None or values.dtype != np.float32 or values.shape != view.shape:
            raise ValueError(f"averaged slice of aggregator {index} is missing or not float32 {view.shape}")
        writes.append((view, values))
    for view, values in writes:
        view[...] = values
    return outcome.unaveraged()
