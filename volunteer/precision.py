"""Mixed precision and the collaboration's loss scale (issue 12, item 4).

**Precision** (:func:`resolve_precision`). ``--precision auto`` is bf16 on a CUDA device that supports it,
fp16 on an older CUDA device (a T4), and fp32 on the CPU and Apple's MPS; ``bf16``, ``fp16`` and ``fp32`` are
taken as asked where torch can autocast to them on the device. Only the task's forward pass and loss run
under autocast (:func:`autocast`); parameters, their gradients, the vector sent to averaging and the
optimizer state stay float32, so every member still applies the same averaged float32 vector to the same
float32 state: peers stay bit-identical after each step, and collaborative training still equals
large-batch training (to the float tolerance autocast itself introduces).

**Loss scaling is collective.** An fp16 backward pass underflows small gradients unless the loss is
multiplied by a scale S first (and the gradients divided by S after); too large an S overflows (Inf/NaN).
A single process halves S and skips the step on overflow, and doubles S after ``G`` clean steps. In a
collaboration S is part of the training state (``loss_scale`` in the state's metadata, :class:`LossScale`),
so it must change identically on every member, from what every member saw identically. The rule:

1. A member whose gradient (divided by its S) is not finite says so in its round ticket: it joins to
   receive only (weight 0, norm 0, as any member with a non-finite gradient does) with
   ``JoinTicket.overflow`` set. Only members that scale the loss (fp16) set it; a bf16/fp32 member's
   non-finite gradient is its own problem (it receives only), not a reason to change a scale.
2. The flag travels in the ticket and is copied into the group's plan, which followers check against the
   signed tickets like the norm (:mod:`shared.averaging.matchmaking`). Every member of the round runs the
   same plan, so each computes the same ``claimed = any member's overflow flag``.
3. :func:`after_round` is a pure function of (the state's :class:`LossScale`, ``claimed``, ``usable``): an
   overflow claim is **believed** only while the scale is above its floor. Believed: every member skips
   the step (no optimizer step, gradients of the round dropped), S halves and the count of clean steps
   restarts. Not believed, or no claim: the step is taken as usual (the claimant received only) and counts
   as clean; after ``G`` clean steps in a row S doubles, up to its initial value (the ceiling).
   ``usable`` is False only when the vector to apply is itself not finite (a lone member's own overflow):
   that step is skipped too, without a scale change beyond the claim's.
4. Members that do not scale the loss (bf16, fp32) run the same bookkeeping on the same inputs, so the
   state -- scale included -- stays identical on every member whatever precision each one uses.

When a claim is believed the members skip *without averaging* (the plan already told them all): no
bandwidth is spent on a step nobody applies, and a round where every sender overflowed (all weights 0)
still ends.

**A skipped step advances the step counter** with parameters and optimizer state unchanged. Every
record keyed by the step (matchmaking keys, receipts, the ledger's steps, progress records, the state's
lineage of fingerprints) then stays unique and monotone, as it is for a step taken; otherwise a skipped
round would be retried under its own keys and a backbone would see two rounds of one step. The learning
rate schedule advances with it, as ``scheduler.step()`` does after a skipped ``GradScaler`` step in a
single process.

**Liars** (DESIGN D10). A member may claim overflow falsely. Each believed claim halves S, and S is
never halved below the floor, so believed claims number at most ``log2(S_0 / floor)`` plus one per
doubling, and a doubling takes ``G`` clean steps: over ``T`` steps a liar (or many) makes the
collaboration skip at most ``INITIAL_EXPONENT - FLOOR_EXPONENT + T / (G + 1)`` of them (16 + T/201 with
the defaults), however often it claims, and never more than ``CEILING_EXPONENT - FLOOR_EXPONENT`` (16) in a
row: S never grows past its initial 2**16, so a long clean stretch (a bf16 or fp32 run, where S is never
used) banks no credit for a burst of skips. At the floor a claim changes nothing at all: the step is taken
without the claimant's samples, which is what any member with a bad gradient already costs. A claim
cannot be forged for another member (tickets are signed, the plan is checked against them), and a ticket
that claims overflow with a positive weight or norm is malformed.

S is a power of two (``2 ** exponent``), so scaling and unscaling are exact in binary floating point;
the exponent is an integer in the state's metadata (no float formatting between peers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from shared.errors import ConfigError

__all__ = [
    "FLOOR_EXPONENT",
    "GROWTH_INTERVAL",
    "INITIAL_EXPONENT",
    "PRECISIONS",
    "LossScale",
    "Precision",
    "after_round",
    "autocast",
    "believed",
    "resolve_precision",
]

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
#: S_0 = 2**16, torch's GradScaler default.
INITIAL_EXPONENT = 16
#: No claim is believed at S = 2**0: at most 16 skips before the floor binds (module docstring, "Liars").
FLOOR_EXPONENT = 0
#: S never grows past its initial 2**16: a liar's longest burst of skips is 16 (module docstring, "Liars").
CEILING_EXPONENT = INITIAL_EXPONENT
#: Clean steps before S doubles; a liar can cost at most one step in ``GROWTH_INTERVAL + 1``.
GROWTH_INTERVAL = 200


@dataclass(frozen=True)
class LossScale:
    """The collaboration's loss scale ``2 ** exponent`` and the clean steps since it last changed."""

    exponent: int = INITIAL_EXPONENT
    clean: int = 0

    @property
    def scale(self) -> float:
        return float(2.0**self.exponent)

    def encode(self) -> str:
        """The state metadata value: ``"<exponent>/<clean>"``."""
        return f"{self.exponent}/{self.clean}"

    @classmethod
    def decode(cls, text: str | None) -> LossScale:
        """A state's ``loss_scale`` metadata; absent (a state older than loss scaling): the initial scale.

        Raises:
            ValueError: malformed, or outside the floor and ceiling.
        """
        if text is None:
            return cls()
        exponent, sep, clean = text.partition("/")
        if not sep or len(text) > 32 or not all(part.lstrip("-").isdigit() for part in (exponent, clean)):
            raise ValueError(f"loss scale {text!r} is not <exponent>/<clean steps>")
        value = cls(int(exponent), int(clean))
        if not FLOOR_EXPONENT <= value.exponent <= CEILING_EXPONENT or not 0 <= value.clean < GROWTH_INTERVAL:
            raise ValueError(f"loss scale {text!r} is outside its bounds")
        return value


def believed(state: LossScale, claimed: bool) -> bool:
    """An overflow claim is believed only while the scale is above its floor (module docstring)."""
    return claimed and state.exponent > FLOOR_EXPONENT


def after_round(
    state: LossScale, claimed: bool, usable: bool = True, *, growth_interval: int = GROWTH_INTERVAL
) -> tuple[LossScale, bool]:
    """Rule 3 of the module docstring: (the scale after this round, whether the round's step is skipped).

    ``claimed``: a member of the round claimed overflow (identical on every member); ``usable``: the
    vector to apply is finite (always for an averaged one)."""
    if believed(state, claimed):
        return LossScale(state.exponent - 1, 0), True
    if not usable:
        return state, True
    clean = state.clean + 1
    if clean >= growth_interval:
        return LossScale(min(CEILING_EXPONENT, state.exponent + 1), 0), False
    return LossScale(state.exponent, clean), False


def resolve_precision(choice: str, device: str, bf16_supported: bool = False) -> Precision:
    """The precision ``--precision choice`` means on ``device`` (a resolved torch device string).

    ``bf16_supported``: the CUDA device computes in bf16 (compute capability 8.0 and later).

    Raises:
        ConfigError: an unknown choice, or a precision this device cannot autocast to.
    """
    text = choice.strip().lower()
    kind = device.partition(":")[0]
    if text not in PRECISIONS:
        raise ConfigError(f"--precision {choice!r}: use auto, fp32, bf16 or fp16")
    if text == "auto":
        if kind == "cuda":
            return "bf16" if bf16_supported else "fp16"
        return "fp32"
    if text == "bf16" and kind == "cuda" and not bf16_supported:
        raise ConfigError(f"--precision bf16: {device} has no bf16 support; use fp16 (or auto)")
    if text == "bf16" and kind == "mps":
        raise ConfigError("--precision bf16 is not available on MPS; use fp16 or fp32")
    return "fp16" if text == "fp16" else "bf16" if text == "bf16" else "fp32"


@contextlib.contextmanager
def autocast(device: str, precision: Precision) -> Iterator[None]:
    """Autocast the block to ``precision`` on ``device`` (nothing for fp32). Imports torch."""
    if precision == "fp32":
        yield
        return
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    with torch.autocast(device_type=device.partition(":")[0], dtype=dtype):
        yield
