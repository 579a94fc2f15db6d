"""LAMB: Adam with a per-tensor trust ratio (You et al. 2020, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes", Algorithm 2), the optimizer of the sahajBERT/ALBERT recipes.

**The update.** For each parameter tensor ``x`` (a "layer" in the paper) with gradient ``g``, at step
``t = 1, 2, …`` with learning rate ``η`` (the schedule's value for that step), betas ``β1, β2``, ``ε`` and
weight decay ``λ``; ``m_0 = v_0 = 0``, ``‖·‖`` is the L2 norm of the whole tensor, operations are
elementwise::

    m_t = β1 · m_{t-1} + (1 - β1) · g
    v_t = β2 · v_{t-1} + (1 - β2) · g²
    u_t = (m_t / (1 - β1^t)) / (sqrt(v_t / (1 - β2^t)) + ε)  +  λ · x_{t-1}
    trust_t = ‖x_{t-1}‖ / ‖u_t‖      if ‖x_{t-1}‖ > 0 and ‖u_t‖ > 0, else 1
    x_t = x_{t-1} - η · trust_t · u_t

The Adam-style bias correction sits inside ``u_t`` (as in the paper, ALBERT's and NVIDIA's LAMB), so the
decoupled weight decay ``λ · x`` weighs the same against the Adam direction at every step. The trust ratio
makes each tensor move by ``η · ‖x‖`` whatever the gradient's scale; the convention ``trust = 1`` covers a
tensor that is all zeros (it then moves by the plain ``η · u``, so it can leave zero) and a zero update
(nothing to scale; ``x`` stays).

**No clamp of ‖x‖.** The paper scales by ``φ(‖x‖)`` with ``φ`` clipping to ``[lower, upper]``;
torch-optimizer's LAMB clamps at 10 by default, and the hivemind ALBERT example (which sahajBERT ran)
set that clamp to 10 000, far above an ALBERT tensor's norm (about 40 for a 30 000 x 128 embedding at
initial std 0.02), i.e. off. So ``φ`` is the identity here; adding a bound would be a new
``OptimizerSpec`` field, since every peer must apply the same one.

**Determinism.** No randomness; the arithmetic is a fixed sequence of float32 tensor operations per
tensor, so peers that apply the same averaged gradient to the same state compute the same bits (on the
same device kind and torch build, as for torch's AdamW). The norms and ``trust`` stay tensors on the
parameter's device: no host synchronization per tensor on CUDA.

**State.** Per parameter: ``exp_avg`` (``m``), ``exp_avg_sq`` (``v``) and ``step`` (``t``, a 0-dim
int64 CPU tensor). All three are tensors, so :meth:`LocalTrainer.state_blob
<volunteer.collab.trainer.LocalTrainer.state_blob>` saves them and a loaded state resumes bit-identically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    """LAMB with the update in the module docstring; one trust ratio per parameter tensor."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        if not lr > 0.0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps > 0.0:
            raise ValueError(f"eps must be positive, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0, dtype=torch.int64)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                _update(p, p.grad, state, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        return loss


def _update(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    state["step"] += 1
    t = int(state["step"])  # a CPU tensor: no device synchronization
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denominator = (exp_avg_sq / (1.0 - beta2**t)).sqrt_().add_(eps)
    update = (exp_avg / (1.0 - beta1**t)).div_(denominator)
    if weight_decay:
        update.add_(p, alpha=weight_decay)
    weight_norm = torch.linalg.vector_norm(p)
    update_norm = torch.linalg.vector_norm(update)
    trust = torch.where(
        (weight_norm > 0) & (update_norm > 0), weight_norm / update_norm, torch.ones_like(weight_norm)
    )
    p.add_(update.mul_(trust), alpha=-lr)
