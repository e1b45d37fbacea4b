"""TOPR against a float64 loop reference written from the paper's gradient (arXiv 2503.14286), plus properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.masking import AGG_MODES
from steadyrl.core.objectives.topr import topr_loss
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import DT, Batch, assert_close, dims, grad_of, make_batch, ref_aggregate, seeds


def _ref_topr(b: Batch, *, weighted: bool, mode: str, value: str = "unit") -> torch.Tensor:
    """By hand: α_i = 1 if A_i ≥ 0 else min(1, Π_t π_θ/μ); term −w · α_i · A_i · u per trained token, u = log π_θ
    (``logp``) or π_θ/sg(π_θ) (``unit``: 1 in value, the same gradient)."""
    B, T = b.mask.shape
    terms = {}
    for i in range(B):
        toks = [t for t in range(T) if b.mask[i, t]]
        A = float(b.adv_seq[i])
        S = sum(float(b.logp[i, t].detach() - b.behav_logp[i, t]) for t in toks)
        alpha = 1.0 if A >= 0 else min(1.0, math.exp(max(min(S, 20.0), -20.0)))
        for t in toks:
            w = float(b.weights[i, t]) if weighted else 1.0
            lp = b.logp[i, t]
            u = lp if value == "logp" else torch.exp(lp - lp.detach())
            terms[(i, t)] = -w * alpha * A * u
    return ref_aggregate(terms, B, T, mode)


def _loss(b: Batch, **kw):
    return topr_loss(logp=b.logp, behav_logp=b.behav_logp, advantages=b.adv_seq, mask=b.mask, **kw)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("value", ["unit", "logp"])
@pytest.mark.parametrize("seed", [41, 42])
def test_matches_reference(mode: str, weighted: bool, value: str, seed: int) -> None:
    b = make_batch(seed, scale=0.5)
    out = _loss(b, weights=b.weights if weighted else None, agg=mode, value=value)
    ref = _ref_topr(b, weighted=weighted, mode=mode, value=value)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    assert_close(out.metrics["loss/policy"], ref)


def test_weights_by_sign_and_ratio() -> None:
    """Row 0: A > 0, far off-policy: plain REINFORCE. Row 1: A < 0, π(y) < μ(y): tapered by π/μ. Row 2: A < 0,
    π(y) > μ(y): truncated at 1."""
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -2.0], [-0.5, -0.5]], dtype=DT, requires_grad=True)
    behav = torch.tensor([[-5.0, -5.0], [-0.5, -1.5], [-1.0, -1.0]], dtype=DT)
    adv = torch.tensor([1.0, -2.0, -1.0], dtype=DT)
    out = topr_loss(logp=logp, behav_logp=behav, advantages=adv, mask=torch.ones(3, 2, dtype=torch.bool))
    alpha1 = math.exp(-1.0)  # S = −0.5 − 0.5
    g = grad_of(out.loss, logp)  # seq-mean-token-sum: (1/3) Σ_rows Σ_t −α A ∇log π
    assert_close(g, torch.tensor([[-1.0, -1.0], [2.0 * alpha1] * 2, [1.0, 1.0]], dtype=DT) / 3)
    assert_close(out.metrics["loss/neg_frac"].to(DT), 2 / 3, atol=1e-6)
    assert_close(out.metrics["loss/neg_weight_mean"], (alpha1 + 1.0) / 2)
    assert_close(out.metrics["loss/tapered_frac"].to(DT), 1 / 3, atol=1e-6)


@settings(max_examples=40)
@given(seed=seeds, B=dims, T=dims)
def test_on_policy_is_plain_reinforce(seed: int, B: int, T: int) -> None:
    """μ = π_θ: every α is 1: the gradient of −A·Σ_t log π_θ averaged over rows (REINFORCE on log π(y)); the value
    is −A·L_i averaged over rows (``unit``), or the paper's −A·log π(y) (``logp``)."""
    b = make_batch(seed, B, T, empty_row=B > 1)
    kw = {"logp": b.logp, "behav_logp": b.logp.detach(), "advantages": b.adv_seq, "mask": b.mask}
    out, out_logp = topr_loss(**kw), topr_loss(**kw, value="logp")
    pairs = b.mask.nonzero().tolist()
    ref = ref_aggregate({(i, t): -float(b.adv_seq[i]) * b.logp[i, t] for i, t in pairs}, B, T, "seq-mean-token-sum")
    assert_close(out_logp.loss, ref)
    unit = {(i, t): torch.tensor(-float(b.adv_seq[i]), dtype=DT) for i, t in pairs}
    assert_close(out.loss, ref_aggregate(unit, B, T, "seq-mean-token-sum"))
    for o in (out, out_logp):
        assert_close(grad_of(o.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    assert out.metrics["loss/tapered_frac"] == 0.0


@settings(max_examples=40)
@given(seed=seeds)
def test_positive_rows_ignore_the_behavior_policy(seed: int) -> None:
    b = make_batch(seed)
    shifted = b._replace(
        behav_logp=b.behav_logp
        + 3.0 * torch.randn(b.mask.shape, dtype=DT, generator=torch.Generator().manual_seed(seed))
    )
    pos = b.mask & (b.adv_seq > 0)[:, None]
    g1 = grad_of(_loss(b).loss, b.logp)
    g2 = grad_of(_loss(shifted).loss, b.logp)
    assert torch.equal(g1[pos], g2[pos])


@settings(max_examples=40)
@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_give_finite_loss_and_gradients(seed: int, B: int, T: int, sign: float) -> None:
    b = make_batch(seed, B, T)
    flips = hostile.random_signs(seed, B, T)
    out = _loss(b._replace(behav_logp=b.logp.detach() + sign * 1000.0 * flips), weights=b.weights)
    hostile.assert_finite(out, b.logp)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_masked_batch_is_zero_with_zero_grad(mode: str) -> None:
    b = make_batch(43)
    out = topr_loss(logp=b.logp, behav_logp=b.behav_logp, advantages=b.adv_seq, mask=torch.zeros_like(b.mask),
                    weights=b.weights, agg=mode)  # fmt: skip
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


@settings(max_examples=40)
@given(seed=seeds)
def test_gradient_flows_only_through_logp_and_garbage_never_leaks(seed: int) -> None:
    b = make_batch(seed)
    behav = b.behav_logp.clone().requires_grad_(True)
    adv = b.adv_seq.clone().requires_grad_(True)
    w = b.weights.clone().requires_grad_(True)
    out = topr_loss(logp=b.logp, behav_logp=behav, advantages=adv, mask=b.mask, weights=w)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [behav, adv, w])
