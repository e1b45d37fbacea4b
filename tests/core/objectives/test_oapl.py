"""OAPL's soft-max value and squared-error loss against float64 loop references from docs/algorithms.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.objectives.oapl import oapl_loss, oapl_value
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import DT, Batch, assert_close, dims, grad_of, make_batch, seeds


def _ref_value(rewards: torch.Tensor, group_ids: torch.Tensor, beta1: float) -> list[float]:
    out = []
    for i in range(len(rewards)):
        group = [float(rewards[j]) for j in range(len(rewards)) if group_ids[j] == group_ids[i]]
        top = max(group)  # shift for a stable log-sum-exp in the reference too
        out.append(top + beta1 * math.log(sum(math.exp((r - top) / beta1) for r in group) / len(group)))
    return out


def _ref_loss(b: Batch, beta1: float, beta2: float) -> torch.Tensor:
    B, T = b.mask.shape
    value = _ref_value(b.rewards, b.group_ids, beta1)
    terms = []
    for i in range(B):
        toks = [t for t in range(T) if b.mask[i, t]]
        if toks:
            seq = sum(b.logp[i, t] - float(b.behav_logp[i, t]) for t in toks)  # Σ_t m (log π_θ − log μ)
            terms.append((beta2 * seq - (float(b.rewards[i]) - value[i])) ** 2)
    return sum(terms) / len(terms)


@pytest.mark.parametrize("beta1", [1.0, 0.3, 5.0])
def test_value_matches_reference(beta1: float) -> None:
    b = make_batch(41, B=9)
    group_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    got = oapl_value(rewards=b.rewards, group_ids=group_ids, beta1=beta1)
    assert_close(got, torch.tensor(_ref_value(b.rewards, group_ids, beta1), dtype=DT))


@given(seed=seeds, G=st.integers(1, 5))
def test_value_limits_are_max_and_mean(seed: int, G: int) -> None:
    rewards = torch.randn(2 * G, generator=torch.Generator().manual_seed(seed), dtype=DT)
    group_ids = torch.arange(2 * G) // G
    groups = [rewards[:G], rewards[G:]]
    cold = oapl_value(rewards=rewards, group_ids=group_ids, beta1=1e-6)
    hot = oapl_value(rewards=rewards, group_ids=group_ids, beta1=1e6)
    assert_close(cold, torch.cat([g.max().expand(G) for g in groups]), atol=1e-4)  # β1 → 0: max R
    assert_close(hot, torch.cat([g.mean().expand(G) for g in groups]), atol=1e-5)  # β1 → ∞: mean R


@pytest.mark.parametrize(("beta1", "beta2"), [(1.0, 1e-3), (0.5, 0.2)])
def test_loss_matches_reference(beta1: float, beta2: float) -> None:
    b = make_batch(42, B=8, scale=0.6)
    out = oapl_loss(
        logp=b.logp, behav_logp=b.behav_logp, rewards=b.rewards, group_ids=b.group_ids, mask=b.mask, beta1=beta1,
        beta2=beta2,
    )
    ref = _ref_loss(b, beta1, beta2)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp))


@given(seed=seeds, B=dims, T=dims)
def test_on_policy_is_squared_advantage_with_its_gradient(seed: int, B: int, T: int) -> None:
    b = make_batch(seed, B, T, empty_row=B > 1)
    group_ids = torch.zeros(B, dtype=torch.long)
    out = oapl_loss(logp=b.logp, behav_logp=b.logp.detach(), rewards=b.rewards, group_ids=group_ids, mask=b.mask)
    value = _ref_value(b.rewards, group_ids, 1.0)
    rows = [i for i in range(B) if b.mask[i].any()]
    adv = {i: float(b.rewards[i]) - value[i] for i in rows}
    assert_close(out.loss, sum(a * a for a in adv.values()) / len(rows))
    expect = torch.zeros(B, T, dtype=DT)
    for i in rows:
        expect[i, b.mask[i]] = -2.0 * 1e-3 * adv[i] / len(rows)  # ∂/∂log π_θ of (β2 Σ ℓ − Â)² at ℓ = 0
    assert_close(grad_of(out.loss, b.logp), expect)


@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_give_finite_loss_and_gradients(seed: int, B: int, T: int, sign: float) -> None:
    b = make_batch(seed, B, T)
    out = oapl_loss(
        logp=b.logp, behav_logp=b.logp.detach() + sign * 1000.0, rewards=b.rewards, group_ids=b.group_ids, mask=b.mask
    )
    hostile.assert_finite(out, b.logp)


def test_fully_masked_batch_is_zero_with_zero_grad() -> None:
    b = make_batch(43)
    out = oapl_loss(
        logp=b.logp, behav_logp=b.behav_logp, rewards=b.rewards, group_ids=b.group_ids, mask=torch.zeros_like(b.mask)
    )
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


@given(seed=seeds)
def test_gradient_flows_only_through_logp(seed: int) -> None:
    b = make_batch(seed)
    behav = b.behav_logp.clone().requires_grad_(True)
    rewards = b.rewards.clone().requires_grad_(True)
    out = oapl_loss(logp=b.logp, behav_logp=behav, rewards=rewards, group_ids=b.group_ids, mask=b.mask)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [behav, rewards])


def test_nonpositive_beta1_is_rejected() -> None:
    b = make_batch(0)
    with pytest.raises(ValueError, match="beta1"):
        oapl_value(rewards=b.rewards, group_ids=b.group_ids, beta1=0.0)
