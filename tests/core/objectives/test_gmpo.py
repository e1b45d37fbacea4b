"""GMPO against a float64 loop reference written from the paper's objective (arXiv 2507.20673), plus properties.

The reference is the paper's form, (Π_t |min(r_t A, clip(r_t, e^{−ε_low}, e^{ε_high}) A)|)^{1/L} · sgn(A), computed
as a product of token terms (not through the code's log-space rewrite), so the equivalence is tested too.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.objectives.gmpo import GMPO_CLIP_HIGH, GMPO_CLIP_LOW, gmpo_loss
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import DT, Batch, assert_close, dims, grad_of, make_batch, ref_aggregate, seeds

ROW_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _ref_gmpo(b: Batch, *, el: float, eh: float, weighted: bool, mode: str):
    """Per row: −w̄ · sgn(A) · (Π_t |min(r_t A, clip(r_t, e^{−εl}, e^{εh}) A)|)^{1/L}, broadcast; clip fraction."""
    B, T = b.mask.shape
    terms, active, n = {}, 0, 0
    for i in range(B):
        toks = [t for t in range(T) if b.mask[i, t]]
        if not toks:
            continue
        A = float(b.adv_seq[i])
        prod = torch.ones((), dtype=DT)
        for t in toks:
            r = torch.exp(b.logp[i, t] - b.prox_logp[i, t])
            r_clip = torch.clamp(r, math.exp(-el), math.exp(eh))
            prod = prod * torch.abs(torch.minimum(r * A, r_clip * A))
            lr = float(b.logp[i, t].detach() - b.prox_logp[i, t])
            active += int((A > 0 and lr > eh) or (A < 0 and lr < -el))
            n += 1
        geo = prod ** (1.0 / len(toks)) if A != 0 else torch.zeros((), dtype=DT)
        w_bar = math.exp(sum(math.log(float(b.weights[i, t])) for t in toks) / len(toks)) if weighted else 1.0
        seq = -w_bar * math.copysign(1.0, A) * geo
        for t in toks:
            terms[(i, t)] = seq
    return ref_aggregate(terms, B, T, mode), active / max(n, 1)


def _loss(b: Batch, **kw):
    return gmpo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_seq, mask=b.mask, **kw)


@pytest.mark.parametrize("mode", ROW_MODES)
@pytest.mark.parametrize(("el", "eh"), [(GMPO_CLIP_LOW, GMPO_CLIP_HIGH), (0.1, 0.3)])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_the_papers_product_form(mode: str, el: float, eh: float, weighted: bool) -> None:
    b = make_batch(31, scale=0.6)
    out = _loss(b, weights=b.weights if weighted else None, clip_low=el, clip_high=eh, agg=mode)
    ref, clip_frac = _ref_gmpo(b, el=el, eh=eh, weighted=weighted, mode=mode)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    assert_close(out.metrics["loss/clip_frac"].to(DT), clip_frac, atol=1e-6)
    assert 0.0 < clip_frac < 1.0


def test_gradient_is_shared_by_the_rows_unclipped_tokens() -> None:
    """One row, A = 1, nothing clipped: ∂L/∂log π_θ(y_t) = −s/L for every token (s = the geometric-mean ratio)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=DT, requires_grad=True)
    delta = torch.tensor([[0.1, -0.3, 0.2]], dtype=DT)
    out = gmpo_loss(logp=logp, prox_logp=logp.detach() - delta, advantages=torch.ones(1, dtype=DT),
                    mask=torch.ones(1, 3, dtype=torch.bool))  # fmt: skip
    s = torch.exp(delta.mean())
    assert_close(out.loss, -s)
    assert_close(grad_of(out.loss, logp), (-s / 3).expand(1, 3))
    clipped = gmpo_loss(logp=logp, prox_logp=logp.detach() - 2 * delta - torch.tensor([[0.0, 0.0, 0.1]], dtype=DT),
                        advantages=torch.ones(1, dtype=DT), mask=torch.ones(1, 3, dtype=torch.bool))  # fmt: skip
    g = grad_of(clipped.loss, logp)  # token 2: ℓ = 0.5 > 0.4 with A > 0, clipped: no gradient
    assert g[0, 2] == 0.0 and g[0, 0] < 0 and g[0, 1] < 0


@settings(max_examples=40)
@given(seed=seeds, B=dims, T=dims)
def test_on_policy_is_grpo_with_sequence_means(seed: int, B: int, T: int) -> None:
    """s = 1: value −A_i per row, gradient −(A_i/L_i) ∇log π_θ per token: REINFORCE at r = 1, seq-mean-token-mean."""
    b = make_batch(seed, B, T, empty_row=B > 1)
    out = gmpo_loss(logp=b.logp, prox_logp=b.logp.detach(), advantages=b.adv_seq, mask=b.mask)
    pairs = b.mask.nonzero().tolist()
    grad_terms = {(i, t): -float(b.adv_seq[i]) * b.logp[i, t] for i, t in pairs}
    assert_close(grad_of(out.loss, b.logp), grad_of(ref_aggregate(grad_terms, B, T, "seq-mean-token-mean"), b.logp))
    value = {(i, t): torch.tensor(-float(b.adv_seq[i]), dtype=DT) for i, t in pairs}
    assert_close(out.loss, ref_aggregate(value, B, T, "seq-mean-token-mean"))
    assert out.metrics["loss/clip_frac"] == 0.0


def test_counting_empty_rows_matches_a_mean_over_every_row() -> None:
    b = make_batch(32)  # row 0 empty
    """(1/B) Σ over the non-empty rows of the row loss, B counting the empty row too (TRL's and verl's mean)."""
    b = make_batch(32)  # row 0 empty
    out = _loss(b, empty_rows="count")
    B = b.mask.shape[0]
    ref, _ = _ref_gmpo(b, el=GMPO_CLIP_LOW, eh=GMPO_CLIP_HIGH, weighted=False, mode="seq-mean-token-mean")
    ref = ref * int(b.mask.any(-1).sum()) / B  # the reference's mean over non-empty rows, re-divided by B
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    with pytest.raises(ValueError, match="empty_rows"):
        _loss(b, agg="token-mean", empty_rows="count")


@settings(max_examples=40)
@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_give_finite_loss_and_gradients(seed: int, B: int, T: int, sign: float) -> None:
    b = make_batch(seed, B, T)
    flips = hostile.random_signs(seed, B, T)
    out = _loss(b._replace(prox_logp=b.logp.detach() + sign * 1000.0 * flips), weights=b.weights)
    hostile.assert_finite(out, b.logp)


@pytest.mark.parametrize(("mode", "empty_rows"), [(m, "skip") for m in ROW_MODES] + [("seq-mean-token-mean", "count")])
def test_fully_masked_batch_is_zero_with_zero_grad(mode: str, empty_rows: str) -> None:
    b = make_batch(33)
    out = gmpo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_seq, mask=torch.zeros_like(b.mask),
                    weights=b.weights, agg=mode, empty_rows=empty_rows)  # fmt: skip
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


@settings(max_examples=40)
@given(seed=seeds)
def test_gradient_flows_only_through_logp_and_garbage_never_leaks(seed: int) -> None:
    b = make_batch(seed)
    prox = b.prox_logp.clone().requires_grad_(True)
    adv = b.adv_seq.clone().requires_grad_(True)
    w = b.weights.clone().requires_grad_(True)
    out = gmpo_loss(logp=b.logp, prox_logp=prox, advantages=adv, mask=b.mask, weights=w)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [prox, adv, w])
