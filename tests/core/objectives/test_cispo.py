"""CISPO against a float64 loop reference written from MiniMax-M1's Eq. 4 (arXiv 2506.13585), plus properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.masking import AGG_MODES
from steadyrl.core.objectives.cispo import CISPO_CLIP_HIGH, cispo_loss
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import (
    DT,
    Batch,
    assert_close,
    clamp20,
    dims,
    grad_of,
    make_batch,
    ref_aggregate,
    seeds,
)


def _ref_cispo(b: Batch, *, el: float | None, eh: float | None, weighted: bool, mode: str):
    """Eq. 4 by hand: −w · sg(clip(r, 1 − ε_low, 1 + ε_high)) · A · log π_θ per trained token, and the clip fraction."""
    B, T = b.mask.shape
    terms, clipped = {}, 0
    for i in range(B):
        for t in range(T):
            if not b.mask[i, t]:
                continue
            r = float(torch.exp(clamp20(b.logp[i, t].detach() - b.prox_logp[i, t])))
            r_hat = r
            if el is not None and r < 1.0 - el:
                r_hat, clipped = 1.0 - el, clipped + 1
            elif eh is not None and r > 1.0 + eh:
                r_hat, clipped = 1.0 + eh, clipped + 1
            w = float(b.weights[i, t]) if weighted else 1.0
            terms[(i, t)] = -w * r_hat * float(b.adv_tok[i, t]) * b.logp[i, t]
    return ref_aggregate(terms, B, T, mode), clipped / max(len(terms), 1)


def _loss(b: Batch, **kw):
    return cispo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask, **kw)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("el", "eh"), [(None, CISPO_CLIP_HIGH), (0.2, 0.28), (None, 0.1), (0.5, None), (None, None)])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_reference(mode: str, el: float | None, eh: float | None, weighted: bool) -> None:
    b = make_batch(11, scale=0.6)
    out = _loss(b, weights=b.weights if weighted else None, clip_low=el, clip_high=eh, agg=mode)
    ref, clip_frac = _ref_cispo(b, el=el, eh=eh, weighted=weighted, mode=mode)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    assert_close(out.metrics["loss/clip_frac"].to(DT), clip_frac, atol=1e-6)
    assert_close(out.metrics["loss/policy"], ref)


def test_the_default_clips_above_only_and_both_branches_are_exercised() -> None:
    b = make_batch(12, scale=1.5)
    ref, clip_frac = _ref_cispo(b, el=None, eh=CISPO_CLIP_HIGH, weighted=False, mode="token-mean")
    out = _loss(b)  # defaults: no lower bound, cap 5, token-mean (the paper's 1/Σ|o_i|)
    assert_close(out.loss, ref)
    assert 0.0 < clip_frac < 1.0


def test_clipped_tokens_keep_their_gradient() -> None:
    """CISPO's point: a token whose ratio is clipped still gets −r̂·A·∇log π_θ (PPO would give it zero)."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=DT, requires_grad=True)
    prox = torch.tensor([[-3.0, -2.0]], dtype=DT)  # token 0: r = e² ≈ 7.4 > 1.2; token 1: r = 1
    adv = torch.tensor([[1.0, -1.0]], dtype=DT)
    out = cispo_loss(logp=logp, prox_logp=prox, advantages=adv, mask=torch.ones(1, 2), clip_high=0.2,
                     agg="seq-mean-token-sum")  # fmt: skip
    assert_close(grad_of(out.loss, logp), torch.tensor([[-1.2, 1.0]], dtype=DT))
    assert_close(out.loss, -1.2 * -1.0 + 1.0 * -2.0)
    assert out.metrics["loss/clip_frac"] == 0.5


@settings(max_examples=40)
@given(seed=seeds, B=dims, T=dims)
def test_on_policy_is_the_plain_policy_gradient(seed: int, B: int, T: int) -> None:
    """r = 1: the weight is 1 (inside any clip range), so ∇ = −A·∇log π_θ and the value is −A·log π_θ."""
    b = make_batch(seed, B, T, empty_row=B > 1)
    out = cispo_loss(logp=b.logp, prox_logp=b.logp.detach(), advantages=b.adv_tok, mask=b.mask, clip_high=0.1)
    terms = {(i, t): -float(b.adv_tok[i, t]) * b.logp[i, t] for i, t in b.mask.nonzero().tolist()}
    ref = ref_aggregate(terms, B, T, "token-mean")
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    assert out.metrics["loss/clip_frac"] == 0.0


@settings(max_examples=40)
@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_give_finite_loss_and_gradients(seed: int, B: int, T: int, sign: float) -> None:
    b = make_batch(seed, B, T)
    flips = hostile.random_signs(seed, B, T)
    out = _loss(b._replace(prox_logp=b.logp.detach() + sign * 1000.0 * flips), weights=b.weights, clip_low=0.2)
    hostile.assert_finite(out, b.logp)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_masked_batch_is_zero_with_zero_grad(mode: str) -> None:
    b = make_batch(13)
    out = cispo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=torch.zeros_like(b.mask),
                     weights=b.weights, agg=mode)  # fmt: skip
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


@settings(max_examples=40)
@given(seed=seeds)
def test_gradient_flows_only_through_logp_and_garbage_never_leaks(seed: int) -> None:
    b = make_batch(seed)
    prox = b.prox_logp.clone().requires_grad_(True)
    adv = b.adv_tok.clone().requires_grad_(True)
    w = b.weights.clone().requires_grad_(True)
    out = cispo_loss(logp=b.logp, prox_logp=prox, advantages=adv, mask=b.mask, weights=w, clip_low=0.2)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [prox, adv, w])
