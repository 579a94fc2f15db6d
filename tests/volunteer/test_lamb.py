"""LAMB (volunteer.collab.lamb): each step equals the docstring's formula computed in float64, the trust
ratio's corner cases, and a state that goes through LocalTrainer's blob resumes bit-identically."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
import torch

from protocols.training import OptimizerSpec, ScheduleSpec, TrainingSpec
from volunteer.collab.lamb import Lamb
from volunteer.collab.trainer import LocalTrainer, make_optimizer
from volunteer.tasks import make_task

F64 = npt.NDArray[np.float64]


class Reference:
    """The module docstring's update, line by line, in float64."""

    def __init__(self, x: F64, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        self.x, self.m, self.v, self.t = x.astype(np.float64), np.zeros_like(x), np.zeros_like(x), 0
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay

    def step(self, g: F64, lr: float) -> F64:
        self.t += 1
        self.m = self.beta1 * self.m + (1 - self.beta1) * g
        self.v = self.beta2 * self.v + (1 - self.beta2) * g**2
        m_hat = self.m / (1 - self.beta1**self.t)
        v_hat = self.v / (1 - self.beta2**self.t)
        u = m_hat / (np.sqrt(v_hat) + self.eps) + self.weight_decay * self.x
        x_norm, u_norm = np.linalg.norm(self.x), np.linalg.norm(u)
        trust = x_norm / u_norm if x_norm > 0 and u_norm > 0 else 1.0
        self.x = self.x - lr * trust * u
        return self.x


def test_lamb_steps_equal_the_docstring_formula_in_float64() -> None:
    # betas far from 1 and a large weight decay: a missing bias correction, or weight decay applied outside
    # the trust ratio, changes the mix of Adam direction and decay and so the result by far more than rtol
    spec = OptimizerSpec(name="lamb", lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3)
    rng = np.random.default_rng(7)
    shapes = [(6, 5), (5,), (3, 2, 2)]
    params = [torch.nn.Parameter(torch.from_numpy(rng.normal(size=s).astype(np.float32))) for s in shapes]
    references = [Reference(p.detach().numpy(), spec.betas, spec.eps, spec.weight_decay) for p in params]
    optimizer = make_optimizer(spec, params)
    assert isinstance(optimizer, Lamb)
    for lr in (0.05, 0.02, 0.1, 0.01, 0.05):  # a schedule: the lr changes between steps
        for group in optimizer.param_groups:
            group["lr"] = lr
        grads = [rng.normal(scale=10.0, size=s).astype(np.float32) for s in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = torch.from_numpy(g)
        optimizer.step()
        for p, g, reference in zip(params, grads, references, strict=True):
            expected = reference.step(g.astype(np.float64), lr)
            np.testing.assert_allclose(p.detach().numpy(), expected, rtol=2e-6, atol=1e-7)


def _one_step(x: torch.Tensor, g: torch.Tensor, weight_decay: float, lr: float = 0.1) -> torch.Tensor:
    p = torch.nn.Parameter(x.clone())
    optimizer = Lamb([p], lr=lr, eps=1e-6, weight_decay=weight_decay)
    p.grad = g.clone()
    optimizer.step()
    return p.detach()


def test_trust_ratio_is_one_for_zero_weights() -> None:
    g = torch.tensor([3.0, -0.5, 0.0, 2e-3])
    x = _one_step(torch.zeros(4), g, weight_decay=0.01)
    # step 1: m_hat = g, v_hat = g², so u = g / (|g| + eps); trust = 1 moves a zero tensor by -lr·u
    expected = -0.1 * g.double() / (g.double().abs() + 1e-6)
    assert torch.isfinite(x).all()
    torch.testing.assert_close(x.double(), expected, rtol=1e-6, atol=1e-9)


def test_zero_gradient_without_decay_leaves_the_weights_and_zero_stays_zero() -> None:
    x = torch.tensor([1.0, -2.0, 0.5])
    assert torch.equal(_one_step(x, torch.zeros(3), weight_decay=0.0), x)  # u = 0: trust = 1, nothing moves
    assert torch.equal(_one_step(torch.zeros(3), torch.zeros(3), weight_decay=0.5), torch.zeros(3))


def test_zero_gradient_with_decay_shrinks_by_exactly_the_learning_rate() -> None:
    # u = λx, trust = ‖x‖/‖λx‖ = 1/λ, so x - lr·(1/λ)·λx = (1 - lr)·x whatever λ is
    x = torch.tensor([1.0, -2.0, 0.5])
    for weight_decay in (1e-3, 0.5):
        torch.testing.assert_close(_one_step(x, torch.zeros(3), weight_decay), 0.9 * x)


def _trainer(run_id: str) -> LocalTrainer:
    spec = TrainingSpec(
        task_options={"d_model": 16, "layers": 1, "heads": 2, "ffn": 32, "seq_len": 16},
        optimizer=OptimizerSpec(name="lamb", lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01),
        schedule=ScheduleSpec(kind="linear", warmup_steps=2, total_steps=10),
    )
    return LocalTrainer(make_task(spec), spec, run_id)


def test_state_blob_round_trip_resumes_bit_identically() -> None:
    original = _trainer("run")
    rng = np.random.default_rng(3)
    gradients = [rng.normal(size=original.numel).astype(np.float32) for _ in range(5)]
    for g in gradients[:3]:
        original.apply(g)
    resumed = _trainer("run")
    assert resumed.load_state_blob(original.state_blob()) == 3
    # every LAMB state entry is a tensor, so the blob carries all of it (the step too: bias correction)
    keys = {key for state in resumed.optimizer.state.values() for key in state}
    assert keys == {"step", "exp_avg", "exp_avg_sq"}
    for g in gradients[3:]:
        original.apply(g)
        resumed.apply(g)
        assert np.array_equal(original.parameter_vector(), resumed.parameter_vector())
    assert original.fingerprint() == resumed.fingerprint()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lamb_on_cuda_matches_the_reference() -> None:
    rng = np.random.default_rng(11)
    x0 = rng.normal(size=(64, 32)).astype(np.float32)
    p = torch.nn.Parameter(torch.from_numpy(x0).cuda())
    optimizer = Lamb([p], lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3)
    reference = Reference(x0, (0.8, 0.95), 1e-6, 0.3)
    for _ in range(3):
        g = rng.normal(size=x0.shape).astype(np.float32)
        p.grad = torch.from_numpy(g).cuda()
        optimizer.step()
        expected = reference.step(g.astype(np.float64), 0.05)
    np.testing.assert_allclose(p.detach().cpu().numpy(), expected, rtol=2e-6, atol=1e-6)
