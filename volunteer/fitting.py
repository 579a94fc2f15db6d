"""Fitting the local micro-batch to the accelerator's memory at warm-up (issue 12, item 4).

**What the micro-batch is.** ``spec.local_batch`` is the run's micro-batch: samples per forward/backward.
It is a local choice, not part of the collaboration's math: a peer's gradient is the *sum* over its
samples whatever their split into micro-batches (:mod:`volunteer.collab.trainer`), its share of a step is
cut to the sample (:func:`shared.progress.micro_batch_budget`), and the matchmaking's weight bound uses the
*spec's* ``local_batch`` on every member (it must be identical on all), which holds since no peer ever
accumulates more than the target batch. So a peer may use another size: on a GPU the one that fills its
memory (more samples/s), and never more than ``target_batch`` (one micro-batch must not overshoot the
global batch, the rule ``shared.tasks`` enforces for ``local_batch``). ``--micro-batch N`` overrides;
on a CPU or MPS the spec's size is kept (a CPU has no memory limit to probe: an allocation that does not
fit ends the process rather than raising).

**The search** (:func:`largest_fitting`, pure): starting at the spec's size, double while the size fits
(until the cap), or halve until it fits, then bisect between the largest size that fit and the smallest
that did not. It assumes that a size fits if a larger one does, and returns the largest fitting size in
``[1, cap]`` (0 if not even one sample fits) after at most about ``2 log2(cap)`` probes.

**A probe** (:func:`fit_micro_batch`) runs one real forward/backward of the run's model on a batch of that
size (the first real batch, its examples repeated) while holding back the memory training will need
beyond it: the optimizer's state (not allocated before the first step; ``OPTIMIZER_COPIES`` times the
parameters), a second copy of the gradients (delayed parameter updates keep the pending ones while a step
is applied) and :data:`HEADROOM` of the device's memory for the allocator's fragmentation. An out-of-memory
error (``torch.OutOfMemoryError``) means "does not fit": the probe's gradients are dropped and the cache is
emptied before the next one. The gradients of every probe are discarded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .collab.trainer import LocalTrainer

__all__ = ["HEADROOM", "OPTIMIZER_COPIES", "fit_micro_batch", "largest_fitting", "repeat_batch"]

logger = logging.getLogger(__name__)
#: Share of the device's memory left free during a probe (fragmentation, the averaging's staging buffers).
HEADROOM = 0.1
#: Tensors per parameter the optimizer keeps (Adam's two moments; SGD's momentum is one).
OPTIMIZER_COPIES = {"sgd": 1, "adam": 2, "adamw": 2, "lamb": 2}
OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError}
)


def largest_fitting(fits: Callable[[int], bool], start: int, cap: int) -> int:
    """The largest ``n`` in ``[1, cap]`` with ``fits(n)`` (0 if none), for a ``fits`` that holds for every
    size below one that fits; see the module docstring. ``fits`` is never called outside ``[1, cap]``."""
    if cap < 1:
        return 0
    n = min(max(1, start), cap)
    if fits(n):
        lo, hi = n, cap + 1  # lo fits; hi is the smallest size known not to (cap + 1: none known)
        while lo < cap:
            trial = min(cap, 2 * lo)
            if not fits(trial):
                hi = trial
                break
            lo = trial
    else:
        lo, hi = 0, n
        while hi > 1:
            trial = hi // 2
            if fits(trial):
                lo = trial
                break
            hi = trial
        if lo == 0:
            return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def repeat_batch(batch: Mapping[str, Any], size: int) -> dict[str, Any]:
    """``batch`` grown (or cut) to ``size`` samples by repeating its examples: the same shapes per sample,
    so the same memory per sample. Values that are not batch-first tensors are kept as they are."""
    lengths = {len(v) for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(lengths) != 1:
        raise ValueError("the batch has no single batch dimension to repeat")
    n = lengths.pop()
    index = torch.arange(size) % n
    return {
        k: v[index.to(v.device)] if isinstance(v, torch.Tensor) and v.dim() > 0 and len(v) == n else v
        for k, v in batch.items()
    }


def fit_micro_batch(
    trainer: LocalTrainer,
    sample: Mapping[str, Any],
    cap: int,
    *,
    dpu: bool = False,
    headroom: float = HEADROOM,
    memory_fraction: float = 1.0,
) -> int:
    """The largest micro-batch (at most ``cap``) whose forward/backward fits the trainer's device beside
    the memory training needs besides (module docstring), starting from ``trainer.micro_batch``; 0 if not
    even one sample fits. ``memory_fraction``: the share of the device's memory this process may use
    (``--gpu-memory-fraction``, set with ``torch.cuda.set_per_process_memory_fraction``, beyond which
    allocations fail as out of memory); the headroom is taken from that share. Blocking: run it on the
    torch thread."""
    device = trainer.device
    param_bytes = sum(p.numel() * p.element_size() for p in trainer.params)
    copies = OPTIMIZER_COPIES.get(trainer.spec.optimizer.name, 2) + (1 if dpu else 0)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    total = int(total * min(1.0, max(0.0, memory_fraction)))
    reserve = copies * param_bytes + int(headroom * total)
    tried: dict[int, bool] = {}

    def fits(size: int) -> bool:
        held: torch.Tensor | None = None
        try:
            if reserve:
                held = torch.empty(reserve, dtype=torch.uint8, device=device)
            trainer.accumulate(repeat_batch(sample, size))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            tried[size] = True
        except OOM_ERRORS:
            tried[size] = False
        finally:
            del held
            trainer.discard_gradients()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return tried[size]

    size = largest_fitting(fits, trainer.micro_batch, cap)
    logger.info(
        "micro-batch fitted to %s: %d samples (tried %s)",
        device,
        size,
        ", ".join(f"{n}{'' if ok else ' (out of memory)'}" for n, ok in tried.items()),
    )
    return size
