"""The pure cores of the low-communication (DiLoCo) synchronization mode (issue 16; torch, no trio).

It holds the arithmetic that every peer must perform identically, so that the wiring only moves vectors.
The wiring is :class:`~.diloco_trainer.DilocoTrainer` (``[sync] mode = "diloco"``, "The running mode"
below; ``[sync] overlap = true`` for the overlap rule).

**The algorithm** (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models"). The collaboration holds global parameters ``θ_t`` (``t``: outer rounds done) and the outer
optimizer's momentum buffer ``b_t``; both are bit-identical on every peer. Round ``t``:

1. Every worker ``i`` loads ``θ_t`` into its model and takes inner optimizer steps (AdamW, the run's
   optimizer spec) on its own data at its own pace, ``H_i`` steps over ``n_i`` samples, until the
   collaboration has processed the round's target samples (:mod:`shared.averaging.round_length`): fast
   workers take more inner steps than slow ones. Its inner optimizer state (AdamW moments) stays local and
   carries over to the next round; a newcomer starts a fresh one.
2. Its pseudo-gradient is the change it made, ``Δ_i = θ_t - θ_i`` (:func:`pseudo_gradient`; the sign makes
   it point uphill like a gradient).
3. The collaboration averages the pseudo-gradients weighted by the samples each processed:
   ``Δ̄ = Σ_i n_i Δ_i / Σ_i n_i`` (:func:`weighted_average` is the reference; the running system sends
   ``Δ_i`` with weight ``n_i`` through the existing averaging). A worker that dies mid-round contributes
   nothing: only its own inner work is lost.
4. Every peer applies the outer optimizer, SGD with Nesterov momentum (lr ``η = 0.7``, momentum
   ``μ = 0.9``), to ``θ_t`` with ``Δ̄`` as its gradient (:class:`OuterOptimizer`)::

       b_{t+1} = μ b_t + Δ̄                 (b_0 = 0, so b_1 = Δ̄, as torch.optim.SGD)
       θ_{t+1} = θ_t - η (Δ̄ + μ b_{t+1})

   This is torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True, dampening=0) fed ``.grad = Δ̄`` (tested:
   equal within a few float32 ulps; torch's kernels may fuse a multiply-add, these never do).
   The update is computed in numpy float32, one IEEE-rounded operation per ufunc (no fused multiply-add,
   no reduction, no threads changing the order), so identical ``(θ_t, b_t, Δ̄)`` give bit-identical
   ``(θ_{t+1}, b_{t+1})`` on every peer and every CPU. ``Δ̄`` itself is identical on every peer because the
   averaging hands every receiver the same decoded bytes.

**Compression with error feedback** (:class:`ErrorFeedback`). With a lossy codec ``Q`` (``decode ∘
encode``, e.g. 8-bit blockwise, :mod:`shared.averaging.compression`) a worker keeps a residual ``e``
(``e_0 = 0``) and sends, instead of ``Δ_t``::

       x_t = Δ_t + e_t ;   sent_t = Q(x_t) ;   e_{t+1} = x_t - sent_t

so ``Σ_{t<T} sent_t + e_T = Σ_{t<T} Δ_t`` (telescoping; tested with the real 8-bit codec): nothing is lost,
only delayed, and ``|e| <= a_b / 254`` per 8-bit block (the codec's bound on ``x``). ``parts`` splits the
vector exactly as the averaging's slices do, so the residual is computed from the very bytes the wire
carries (the codec's blocks restart at every part). The residual is local state like the inner optimizer's;
a newcomer starts with ``e = 0``. The *return* path (the aggregator's averaged slice, re-encoded) is
quantized once for everybody: every peer decodes the same bytes, so ``θ`` stays identical, but that error is
not fed back (the wiring may send averages in fp16 or carry an aggregator-side residual).

**Overlap** (optional; one round of staleness, the DiLoCo analogue of delayed parameter updates). A worker
does not wait for round ``t``'s average: it starts inner phase ``t + 1`` at once while that average is in
flight, from an *eager* outer step (Kale et al. 2025, "Eager updates for overlapped communication and
computation in DiLoCo") that takes its own pseudo-gradient for the average not yet there. With ``s_{i,t}``
where phase ``t`` starts, ``x_{i,t}`` where it ends, and ``OuterStep(θ, b, g) = (θ - η (g + μ b'), b')``,
``b' = μ b + g`` (the step above, :func:`outer_update`), exactly::

       s_{i,0} = θ_0
       Δ_{i,t} = s_{i,t} - x_{i,t}                  (the phase's own displacement, sent for round t)
       s_{i,t+1} = OuterStep(θ_t, b_t, Δ_{i,t}).θ   (eager: its own Δ for Δ̄_t; b_t is not advanced)
       θ_{t+1}, b_{t+1} = OuterStep(θ_t, b_t, Δ̄_t)   (applied to the global θ_t, as without overlap)

``θ_t, b_t`` are the newest global state at the end of phase ``t``: round ``t - 1``'s average was in flight
during phase ``t`` (the peer waits for it if it is late, so overlap hides at most one round of averaging);
``θ_0, b_0 = 0`` when ``t = 0``, so phase 1 starts at ``θ_0 - η (1 + μ) Δ_{i,0}``. The eager start is local:
the outer step is applied to the global parameters only, with the true average, and every peer's ``θ`` and
``b`` stay bit-identical as without overlap (a peer following another start rule stays in step). Re-basing:
at the end of phase ``t`` the local model is set to ``s_{i,t+1}`` (its end point ``x_{i,t}`` is replaced: its
displacement is the one the eager step applies); the average of round ``t``, when it arrives during phase
``t + 1``, is kept aside as ``θ_{t+1}, b_{t+1}`` and enters at the next re-base, never mid-phase (so ``Δ``
is one displacement from one start point). Staleness: phase ``t + 1`` computes its gradients from
``s_{i,t+1}``, whose error against ``θ_{t+1}`` is ``s_{i,t+1} - θ_{t+1} = η (1 + μ) (Δ̄_t - Δ_{i,t})``: only
how far the peer's own change is from the average (the shards' noise), while the outer momentum and the
extrapolation of the average are in the start, so the next phase's inner steps correct them as without
overlap. :class:`Overlap` holds this bookkeeping; the inner optimizer state carries across the re-base.

Why it is better, and what is left: the samples-weighted mean of the peers' eager starts is exactly
``θ_{t+1}`` (``OuterStep`` is affine in ``g``; up to float rounding), so what differs from the synchronous
run is only the peers' spread about it, ``η (1 + μ) (Δ̄_t - Δ_{i,t})``, which the inner phases pull back and
the averaging cancels to first order. On a task whose peers' changes are mostly their own noise that spread
still costs loss (below, K = 32).

Measured (``bench_lowcomm.py``'s tiny-mlm setup: 4 peers, budget 8,192 samples, AdamW 3e-3 inner, rounds of
32 and 64 target batches, i.e. 4 and 2 rounds; held-out loss of ``θ_T``). Deterministic, in one process with
4 real :class:`~.diloco_trainer.DilocoTrainer` and the averages computed in place (codec none), so no stall
of a loaded machine enters: the batch mode 4.824 (from the loopback run below); synchronous / eager / shift,
K = 32: 4.823 / 5.105 / 5.093; K = 64: 5.539 / 6.457 / 8.170. On loopback (``bench_lowcomm.py --overlap
--overlap-shift``, int8 with error feedback, one run under a load average of 8-13 on 2 cores, loss gap
against the batch mode and bytes ratio): diloco-32 +0.01 % / 76x, diloco-32+o (eager) +2.51 % / 40x,
diloco-32+s (shift) +6.60 % / 43x (both overlapped K = 32 runs had stalled members and lost samples, so
they are noisier than the in-process numbers); diloco-64 +14.6 % / 127x, diloco-64+o +33.8 % / 146x,
diloco-64+s +69.5 % / 125x.

*Rejected: the shift rule* ``s_{i,t+1} = θ_t - Δ_{i,t}`` (``[sync] overlap = "shift"``, the earlier rule,
kept for comparison: the newest global plus the peer's own change in flight). Its start misses
``η (1 + μ) Δ̄_t - Δ_{i,t} + η μ² b_t``, with ``η = 0.7, μ = 0.9`` about ``0.33 Δ̄_t + 0.57 b_t``: the outer
step's extrapolation, which no inner step ever sees, so ``θ_T`` carries the last rounds' extrapolations
uncorrected; with few rounds that dominates (K = 64 above: 8.17 against 6.46). On the test task (4 workers
of unequal speed, 10 rounds; worst held-out loss from round 4 on and final, synchronous / eager / shift):
inner lr 1e-3, 0.406 / 0.406 / 0.404 and 0.150 / 0.150 / 0.152 (all track); inner lr 1e-2, 0.119 / 0.252 /
0.464 and 0.093 / 0.171 / 0.284; inner lr 3e-2, 0.159 / 0.228 / 0.542 and 0.097 / 0.163 / 0.145.

*Rejected: restarting phase ``t + 1`` from ``θ_t`` itself* (the literal delayed update, which drops the
peer's own change in flight). Measured on the test task (4 workers of unequal speed, 10 rounds; worst
held-out loss after round 3, synchronous / shift / literal): inner lr 1e-3, 0.15 / 0.16 / 0.15 (both
track); inner lr 1e-2, 0.19 / 0.51 / 2.5; inner lr 3e-2, 0.13 / 0.33 / 14 (diverged).

*Rejected: other guesses of the average in the eager step* (the in-process tiny-mlm setup above). The
others' stale changes, ``(Δ_{i,t} + (M - 1) Δ̄_{t-1}) / M`` for ``M`` workers: K = 32 6.93 (eager 5.11),
and it diverges on the test task at inner lr 1e-2 and 3e-2 (worst 1.43 and 6.0). Our own change scaled,
``c Δ_{i,t}`` (less spread, but a start off ``θ_{t+1}`` on average): K = 64 with c = 0.25 / 0.5 / 1 / 1.5 /
2, 13.2 / 10.3 / 6.46 / 5.53 / 7.54, and K = 32 with c = 1.5, 5.40 (5.11 at c = 1): no other ``c`` is
better at both lengths. Scaled by the previous round's ``<Δ̄, Δ_i> / |Δ_i|²`` (clipped to [0, 1]): K = 32,
5.16.

*Not an overlap rule: a smaller outer momentum or lr.* ``μ = 0.5`` narrows the gap of both rules in these
short runs (in process, synchronous / eager / shift, K = 32: 4.849 / 4.882 / 4.949; K = 64: 4.978 / 5.107 /
5.184), but it helps the synchronous run as much at K = 64 (5.54 to 4.98) and slows the longer runs of the
test task (10 rounds at inner lr 1e-3: final 0.315 for every rule against 0.150 with ``μ = 0.9``). ``η =
0.35`` at K = 32: 5.102 synchronous and eager alike. The outer optimizer is the run's choice (``[sync]
outer_momentum``, ``outer_lr``); for short runs with overlap, ``outer_momentum = 0.5`` measured better here.

*Not changed: what the collaboration evaluates and publishes.* The state a peer serves at the end of a run
is ``θ_T``, the global parameters after ``T`` averaged rounds, with or without overlap: it is the only state
every peer holds alike; the work of the phase under way at the end (each peer's, from its own eager start) is
the next round's, and no peer's local model is the collaboration's.

Overlap is an option, off by default (it trades one round of staleness for hidden averaging time); its
default rule, ``overlap = true``, is the eager one. tests/volunteer/test_diloco.py pins it against a hand
simulation and the regime where it tracks the synchronous run.

**The running mode** (:class:`~.diloco_trainer.DilocoTrainer`). A round is one global step of the run:
step ``t`` holds ``θ_t``, and the machinery of the batch mode (:mod:`.step`) runs unchanged on top, with
``target_batch`` read as the round's samples and ``local_batch`` as the inner batch:

* ``accumulate`` runs forward/backward and takes an inner step whenever ``local_batch`` samples have
  accumulated (a device that fits smaller micro-batches accumulates several);
* ``take_gradients`` flushes a partial inner batch (one more inner step) and hands out ``Δ_i`` (plus the
  error-feedback residual) with weight ``n_i``; the parameters are not touched, so a failed round simply
  hands the samples back and inner training goes on from ``θ_i`` (the next attempt sends a longer ``Δ_i``);
* the averaging (LP roles, groups, codecs, robust rules, failure handling) averages ``Δ_i`` weighted by
  ``n_i`` like a gradient; ``apply(Δ̄)`` is the outer step, loads ``θ_{t+1}`` into the model and keeps the
  inner optimizer state; a lone step applies our own ``Δ``;
* the state a peer serves (``state_blob``) is ``θ_t`` (never its local parameters) and the outer momentum,
  no inner optimizer state; loading one starts a fresh inner optimizer and a zero residual
  (``discard_gradients``, the warm-up's and fitting's reset, does the same from our own ``θ_t``);
* the fingerprint hashes ``θ_t``, so peers in the middle of an inner phase still agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from shared.averaging.compression import Codec
from shared.averaging.partition import num_parts, part_bounds

__all__ = [
    "OUTER_LR",
    "OUTER_MOMENTUM",
    "ErrorFeedback",
    "OuterOptimizer",
    "Overlap",
    "OverlapRule",
    "flatten",
    "load_flat",
    "outer_update",
    "overlap_start",
    "pseudo_gradient",
    "weighted_average",
    "wire_layout",
]

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
Float32Array = npt.NDArray[np.float32]
#: where an overlapped inner phase starts (module docstring, "Overlap"): ``eager`` (``[sync] overlap = true``)
#: or the earlier ``shift``
OverlapRule = Literal["eager", "shift"]


def flatten(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The parameters as one flat float32 CPU tensor (a copy), in iteration order."""
    parts = [p.detach().to(device="cpu", dtype=torch.float32).reshape(-1) for p in params]
    if not parts:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def load_flat(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``params`` in place (so an optimizer holding them keeps its state).

    Raises:
        ValueError: ``flat`` does not have exactly as many elements as ``params``.
    """
    total = sum(p.numel() for p in params)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"flat vector has {flat.numel()} elements, the parameters {total}")
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def pseudo_gradient(global_params: torch.Tensor, local_params: Iterable[torch.Tensor]) -> torch.Tensor:
    """``Δ = θ_global - θ_local`` as a flat float32 CPU tensor.

    Args:
        global_params: the round's starting point (``base_t``), flat float32.
        local_params: the worker's parameters after its inner steps, in the same order.

    Raises:
        ValueError: the sizes differ.
    """
    local = flatten(local_params)
    base = _flat32(global_params, "global_params")
    if base.numel() != local.numel():
        raise ValueError(f"global vector has {base.numel()} elements, the local parameters {local.numel()}")
    return base - local


def weighted_average(deltas: Sequence[torch.Tensor], samples: Sequence[int]) -> torch.Tensor:
    """Reference average ``Σ_i n_i Δ_i / Σ_i n_i`` (float64 accumulation, float32 result).

    Raises:
        ValueError: no deltas, lengths differ, a negative weight, or all weights 0.
    """
    if not deltas or len(deltas) != len(samples):
        raise ValueError(f"need as many deltas as sample counts, got {len(deltas)} and {len(samples)}")
    if any(n < 0 for n in samples) or sum(samples) <= 0:
        raise ValueError(f"sample counts must be >= 0 with a positive sum, got {list(samples)}")
    total = torch.zeros_like(deltas[0], dtype=torch.float64)
    for delta, n in zip(deltas, samples, strict=True):
        total += float(n) * delta.to(torch.float64)
    return (total / float(sum(samples))).to(torch.float32)


def _flat32(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"{name} must be a 1-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    return x.detach().cpu()


def outer_update(
    theta: Float32Array, buffer: Float32Array, grad: Float32Array, lr: float, momentum: float
) -> tuple[Float32Array, Float32Array]:
    """``OuterStep(θ, b, g)``: ``(θ - η (g + μ b'), b')`` with ``b' = μ b + g``, in float32, one IEEE-rounded
    operation per ufunc (module docstring); the inputs are not changed."""
    mu, eta = np.float32(momentum), np.float32(lr)
    advanced = np.add(np.multiply(buffer, mu), grad)  # b' = μ b + g
    direction = np.add(grad, np.multiply(advanced, mu))  # g + μ b'
    updated = np.subtract(theta, np.multiply(direction, eta))  # θ - η (g + μ b')
    return updated, advanced


def overlap_start(
    rule: OverlapRule,
    theta: torch.Tensor,
    buffer: torch.Tensor,
    delta: torch.Tensor,
    lr: float = OUTER_LR,
    momentum: float = OUTER_MOMENTUM,
) -> torch.Tensor:
    """Where the next inner phase starts under overlap (module docstring, "Overlap"), a new tensor.

    ``"eager"``: ``s = OuterStep(θ_t, b_t, Δ_{i,t})``, the outer step with our own ``Δ`` in place of the
    average still in flight; ``"shift"`` (the earlier rule): ``s = θ_t - Δ_{i,t}``.

    Raises:
        ValueError: vectors not 1-D float32 of one size, or an unknown rule.
    """
    base = _flat32(theta, "theta")
    change = _flat32(delta, "delta")
    momentum_buffer = _flat32(buffer, "buffer")
    if not base.numel() == change.numel() == momentum_buffer.numel():
        raise ValueError(
            f"theta, delta and buffer differ in size: {base.numel()}, {change.numel()}, "
            f"{momentum_buffer.numel()}"
        )
    if rule == "shift":
        return base - change
    if rule != "eager":
        raise ValueError(f"unknown overlap rule {rule!r}")
    updated, _ = outer_update(base.numpy(), momentum_buffer.numpy(), change.numpy(), lr, momentum)
    return torch.from_numpy(updated)


def _check_hyper(lr: float, momentum: float) -> None:
    if not (0.0 < lr < float("inf") and 0.0 <= momentum < 1.0):
        raise ValueError(f"need lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")


class OuterOptimizer:
    """SGD with Nesterov momentum on the flat global vector, bit-reproducible (module docstring).

    Args:
        numel: elements of the global vector.
        lr: ``η`` (DiLoCo: 0.7).
        momentum: ``μ`` (DiLoCo: 0.9).
    """

    def __init__(self, numel: int, lr: float = OUTER_LR, momentum: float = OUTER_MOMENTUM) -> None:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        _check_hyper(lr, momentum)
        self.lr = lr
        self.momentum = momentum
        self.rounds = 0
        self._buffer: Float32Array = np.zeros(numel, dtype=np.float32)

    @property
    def numel(self) -> int:
        return int(self._buffer.size)

    def step(self, global_flat: torch.Tensor, averaged_delta: torch.Tensor) -> torch.Tensor:
        """One outer step: returns ``θ_{t+1}`` (a new tensor) and advances the momentum buffer.

        Raises:
            ValueError: the vectors are not 1-D float32 of ``numel`` elements, or ``averaged_delta`` holds
                NaN/Inf (the buffer is then left unchanged).
        """
        theta = _flat32(global_flat, "global_flat").numpy()
        grad = _flat32(averaged_delta, "averaged_delta").numpy()
        if theta.size != self.numel or grad.size != self.numel:
            raise ValueError(f"expected {self.numel} elements, got {theta.size} and {grad.size}")
        if not np.isfinite(grad).all():
            raise ValueError("the averaged pseudo-gradient holds NaN or Inf")
        updated, buffer = outer_update(theta, self._buffer, grad, self.lr, self.momentum)
        self._buffer = buffer
        self.rounds += 1
        return torch.from_numpy(updated)

    def lookahead(self, global_flat: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``OuterStep(θ, b, Δ)``'s ``θ`` with our buffer ``b``, which is left unchanged: the eager start of
        the overlap rule (module docstring, "Overlap").

        Raises:
            ValueError: as :meth:`step`.
        """
        theta = _flat32(global_flat, "global_flat").numpy()
        grad = _flat32(delta, "delta").numpy()
        if theta.size != self.numel or grad.size != self.numel:
            raise ValueError(f"expected {self.numel} elements, got {theta.size} and {grad.size}")
        if not np.isfinite(grad).all():
            raise ValueError("the pseudo-gradient holds NaN or Inf")
        updated, _ = outer_update(theta, self._buffer, grad, self.lr, self.momentum)
        return torch.from_numpy(updated)

    @property
    def buffer(self) -> torch.Tensor:
        """``b_t`` (a copy)."""
        return torch.from_numpy(self._buffer.copy())

    def state_dict(self) -> dict[str, Any]:
        """What a newcomer downloads with ``θ``: the buffer (a copy), hyper-parameters and rounds done."""
        return {
            "momentum_buffer": torch.from_numpy(self._buffer.copy()),
            "lr": self.lr,
            "momentum": self.momentum,
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: the buffer's size or dtype differs from this optimizer's, or it is not finite.
        """
        buffer = state["momentum_buffer"]
        if not isinstance(buffer, torch.Tensor):
            raise ValueError("momentum_buffer must be a tensor")
        flat = _flat32(buffer, "momentum_buffer")
        if flat.numel() != self.numel:
            raise ValueError(f"momentum_buffer has {flat.numel()} elements, expected {self.numel}")
        if not torch.isfinite(flat).all():
            raise ValueError("momentum_buffer holds NaN or Inf")
        lr, momentum, rounds = float(state["lr"]), float(state["momentum"]), int(state["rounds"])
        _check_hyper(lr, momentum)
        if rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {rounds}")
        self.lr, self.momentum, self.rounds = lr, momentum, rounds
        self._buffer = flat.numpy().copy()


@dataclass
class ErrorFeedback:
    """Error feedback for a lossy codec: ``x = Δ + e; sent = Q(x); e' = x - sent`` (module docstring).

    Args:
        codec: the wire codec (:func:`shared.averaging.compression.codec_by_name`).
        numel: elements of the pseudo-gradient.
    """

    codec: Codec
    numel: int
    residual: Float32Array = field(init=False)

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")
        self.residual = np.zeros(self.numel, dtype=np.float32)

    def compress(
        self, delta: torch.Tensor, parts: Sequence[int] | None = None
    ) -> tuple[list[bytes], Float32Array]:
        """Encode ``Δ + e`` part by part; keep and return the new residual.

        Args:
            delta: this round's pseudo-gradient, flat float32.
            parts: the sizes of the consecutive parts the wire encodes separately (the averaging's slices;
                they sum to ``numel``); one part by default.

        Returns:
            The encoded parts, and the new residual ``e' = (Δ + e) - decode(encode(Δ + e))``.

        Raises:
            ValueError: wrong size, parts that do not sum to ``numel``, or NaN/Inf in ``Δ + e``.
        """
        sizes = [self.numel] if parts is None else list(parts)
        corrected = self.corrected(delta)
        encoded = self._wire(corrected, [(n, True) for n in sizes])
        return encoded, self.residual.copy()

    def corrected(self, delta: torch.Tensor) -> Float32Array:
        """``x = Δ + e``, what is sent this round (the residual is not changed until :meth:`commit`).

        Raises:
            ValueError: wrong size, or NaN/Inf in ``Δ + e``.
        """
        x = _flat32(delta, "delta").numpy()
        if x.size != self.numel:
            raise ValueError(f"delta has {x.size} elements, expected {self.numel}")
        corrected: Float32Array = np.add(x, self.residual)
        if not np.isfinite(corrected).all():
            raise ValueError("the corrected pseudo-gradient holds NaN or Inf")
        return corrected

    def commit(self, corrected: Float32Array, layout: Sequence[tuple[int, bool]]) -> None:
        """The round that sent ``corrected`` completed: ``e' = x - sent``, part by part as the wire carried
        it (``layout``: ``(size, lossy)`` per consecutive part, :func:`wire_layout`; a part that is not
        lossy reached its aggregator exactly, e.g. our own slice, and leaves no residual)."""
        if corrected.shape != (self.numel,):
            raise ValueError(f"corrected has shape {corrected.shape}, expected ({self.numel},)")
        self._wire(corrected, layout)

    def _wire(self, corrected: Float32Array, layout: Sequence[tuple[int, bool]]) -> list[bytes]:
        sizes = [n for n, _ in layout]
        if any(n < 0 for n in sizes) or sum(sizes) != self.numel:
            raise ValueError(f"parts must be >= 0 and sum to {self.numel}, got {sizes}")
        encoded: list[bytes] = []
        sent = corrected.copy()
        offset = 0
        for n, lossy in layout:
            if lossy:
                piece = np.ascontiguousarray(corrected[offset : offset + n])
                data = self.codec.encode(piece)
                self.codec.decode(data, n, out=sent[offset : offset + n])
                encoded.append(data)
            offset += n
        self.residual = np.subtract(corrected, sent)
        return encoded

    def reset(self) -> None:
        """Forget the residual (a loaded state, a discarded inner phase: ``e = 0``)."""
        self.residual = np.zeros(self.numel, dtype=np.float32)

    def decode(self, encoded: Sequence[bytes], parts: Sequence[int] | None = None) -> Float32Array:
        """What the wire carries once decoded: the inverse of :meth:`compress`'s encoding."""
        sizes = [self.numel] if parts is None else list(parts)
        if len(sizes) != len(encoded):
            raise ValueError(f"{len(encoded)} encoded parts for {len(sizes)} sizes")
        out = np.empty(sum(sizes), dtype=np.float32)
        offset = 0
        for data, n in zip(encoded, sizes, strict=True):
            self.codec.decode(data, n, out=out[offset : offset + n])
            offset += n
        return out


def wire_layout(slice_sizes: Sequence[int], part_numel: int, me: int) -> list[tuple[int, bool]]:
    """How the averaging carries member ``me``'s vector: ``(size, lossy)`` per part, in vector order.

    Slice ``j`` goes to aggregator ``j`` in parts of ``part_numel`` elements, each encoded separately
    (:func:`shared.averaging.partition.part_bounds`); our own slice is added to our aggregation as it is,
    never encoded (:mod:`shared.averaging.allreduce`)."""
    layout: list[tuple[int, bool]] = []
    for j, size in enumerate(slice_sizes):
        for k in range(num_parts(size, part_numel)):
            lo, hi = part_bounds(size, part_numel, k)
            layout.append((hi - lo, j != me))
    return layout


@dataclass
class Overlap:
    """The overlap variant's bookkeeping for one peer (module docstring, "Overlap").

    ``start_phase()`` returns where the next inner phase starts (load it into the model): ``θ_0`` first,
    then :func:`overlap_start` of the newest global, its outer momentum and the peer's own change still in
    flight; ``end_phase(local_params)`` returns the phase's ``Δ`` measured from that start;
    ``arrived(theta, buffer)`` records the global parameters and the outer momentum once a round's average
    has been applied (call it after ``start_phase()`` of the phase it arrives in).
    """

    newest: torch.Tensor
    rule: OverlapRule = "eager"
    lr: float = OUTER_LR
    momentum: float = OUTER_MOMENTUM
    buffer: torch.Tensor | None = None  # ``b`` of ``newest`` (None: ``b_0 = 0``)
    start: torch.Tensor | None = None
    in_flight: torch.Tensor | None = None

    def start_phase(self) -> torch.Tensor:
        """``s_{i,t+1} = OuterStep(θ_t, b_t, Δ_{i,t})`` (``eager``) or ``θ_t - Δ_{i,t}`` (``shift``); ``θ_0``
        for the first phase."""
        if self.start is not None:
            raise RuntimeError("start_phase() twice without end_phase()")
        base = _flat32(self.newest, "newest")
        if self.in_flight is None:
            self.start = base.clone()
        else:
            buffer = torch.zeros_like(base) if self.buffer is None else self.buffer
            self.start = overlap_start(self.rule, base, buffer, self.in_flight, self.lr, self.momentum)
        return self.start.clone()

    def end_phase(self, local_params: Iterable[torch.Tensor]) -> torch.Tensor:
        """``Δ_{i,t} = s_{i,t} - x_{i,t}``; it is kept as the change in flight for the next start."""
        if self.start is None:
            raise RuntimeError("end_phase() without start_phase()")
        delta = pseudo_gradient(self.start, local_params)
        self.start = None
        self.in_flight = delta
        return delta.clone()

    def arrived(self, theta: torch.Tensor, buffer: torch.Tensor) -> None:
        """The global parameters and the outer momentum after the latest outer step."""
        self.newest = _flat32(theta, "theta")
        self.buffer = _flat32(buffer, "buffer").clone()
