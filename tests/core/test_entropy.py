"""Entropy bonus and adaptive entropy coefficient against float64 references written from TRL 1.16.0's documented
rule (``GRPOConfig``: entropy_coef, use_adaptive_entropy, entropy_target, entropy_coef_delta/min/max) and
Skywork-OR1 (arXiv 2505.22312)."""

from __future__ import annotations

import math

import pytest
import torch

from steadyrl.control.adaptive_entropy import AdaptiveEntropyController
from steadyrl.core.entropy import entropy_bonus

DT = torch.float64


def test_bonus_is_minus_coef_times_the_token_mean_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.rand(3, 4, generator=g, dtype=DT) * 3
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    x = h.masked_fill(~mask, float("nan")).requires_grad_(True)
    out = entropy_bonus(entropy=x, mask=mask, coef=0.05)
    vals = [float(h[i, t]) for i in range(3) for t in range(4) if mask[i, t]]
    assert math.isclose(float(out.loss), -0.05 * sum(vals) / len(vals), rel_tol=1e-12)
    (gx,) = torch.autograd.grad(out.loss, x)
    assert torch.equal(gx, torch.where(mask, torch.full_like(h, -0.05 / len(vals)), 0.0))
    assert math.isclose(float(out.metrics["entropy/mean"]), sum(vals) / len(vals), rel_tol=1e-12)


def test_all_masked_is_an_exact_zero_with_zero_gradient() -> None:
    x = torch.rand(2, 3, dtype=DT, requires_grad=True)
    out = entropy_bonus(entropy=x, mask=torch.zeros(2, 3, dtype=torch.bool), coef=0.1)
    out.loss.backward()
    assert float(out.loss) == 0.0 and torch.equal(x.grad, torch.zeros_like(x))
    assert float(out.metrics["loss/all_masked"]) == 1.0


def _ref_trajectory(c: float, entropies: list[float], target: float, delta: float, lo: float, hi: float):
    applied, coefs, last = [], [], math.inf
    for h in entropies:
        applied.append(c if last <= target else 0.0)
        c = min(c + delta, hi) if h <= target else max(c - delta, lo)
        coefs.append(c)
        last = h
    return applied, coefs


@pytest.mark.parametrize("seed", range(5))
def test_adaptive_coefficient_follows_the_rule(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    entropies = (torch.rand(30, generator=g, dtype=DT) * 2).tolist()
    ctrl = AdaptiveEntropyController(0.01, target=1.0, delta=0.003, coef_min=0.001, coef_max=0.02)
    applied, coefs = [], []
    for h in entropies:
        applied.append(ctrl.applied)
        coefs.append(ctrl.step(h))
    ref_applied, ref_coefs = _ref_trajectory(0.01, entropies, 1.0, 0.003, 0.001, 0.02)
    assert applied == pytest.approx(ref_applied, abs=1e-15) and coefs == pytest.approx(ref_coefs, abs=1e-15)
    assert min(coefs) >= 0.001 and max(coefs) <= 0.02


def test_constant_coefficient_and_state_round_trip() -> None:
    ctrl = AdaptiveEntropyController(0.03, adaptive=False)
    assert ctrl.applied == 0.03 and ctrl.step(5.0) == 0.03 and ctrl.applied == 0.03
    a = AdaptiveEntropyController(0.01, target=1.0)
    a.step(0.5)
    b = AdaptiveEntropyController(0.5, target=1.0)
    b.load_state_dict(a.state_dict())
    assert (b.coef, b.applied) == (a.coef, a.applied)
    with pytest.raises(ValueError, match="coef_min"):
        AdaptiveEntropyController(0.1, coef_min=0.5, coef_max=0.2)
