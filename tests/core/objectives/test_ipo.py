"""prime-rl's IPO loss against a float64 loop reference written from its public ``ipo_loss_fn`` (not installed
here), plus the catalog properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.masking import AGG_MODES
from steadyrl.core.objectives.ipo import ipo_loss
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import Batch, assert_close, dims, grad_of, make_batch, ref_aggregate, seeds


def _ref_ipo(b: Batch, *, eps: float, kappa: float, weighted: bool, mode: str) -> tuple[torch.Tensor, float]:
    """w·(−[|π_θ − π_prox| ≤ ε]·A·r + κ(log r)²) per trained token, and the fraction outside the trust region."""
    B, T = b.mask.shape
    terms, moved = {}, 0
    for i in range(B):
        for t in range(T):
            if not b.mask[i, t]:
                continue
            log_r = b.logp[i, t] - float(b.prox_logp[i, t])
            keep = abs(math.exp(float(b.logp[i, t])) - math.exp(float(b.prox_logp[i, t]))) <= eps
            moved += not keep
            pg = -float(b.adv_tok[i, t]) * torch.exp(log_r) if keep else 0.0 * log_r
            w = float(b.weights[i, t]) if weighted else 1.0
            terms[(i, t)] = w * (pg + kappa * log_r**2)
    return ref_aggregate(terms, B, T, mode), moved / max(len(terms), 1)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("eps", "kappa"), [(0.1, 1e-3), (0.05, 0.5)])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_reference(mode: str, eps: float, kappa: float, weighted: bool) -> None:
    b = make_batch(31, scale=0.5)
    out = ipo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask,
                   weights=b.weights if weighted else None, epsilon=eps, kl_coef=kappa, agg=mode)  # fmt: skip
    ref, frac = _ref_ipo(b, eps=eps, kappa=kappa, weighted=weighted, mode=mode)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    assert_close(out.metrics["loss/ipo_masked_frac"].double(), frac, atol=1e-6)
    assert 0.0 < frac < 1.0  # both branches are exercised


def test_trust_region_is_symmetric_in_the_advantage() -> None:
    """A token whose probability moved past ε loses its policy gradient for A > 0 and A < 0 alike (DPPO would keep
    one of the two)."""
    logp = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)).requires_grad_(True)
    prox = torch.log(torch.tensor([[0.3, 0.3]], dtype=torch.float64))
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    out = ipo_loss(logp=logp, prox_logp=prox, advantages=adv, mask=torch.ones(1, 2, dtype=torch.bool), kl_coef=1.0,
                   agg="token-sum")  # fmt: skip
    lr = math.log(0.5 / 0.3)
    assert_close(grad_of(out.loss, logp), torch.full((1, 2), 2 * lr, dtype=torch.float64))


@settings(max_examples=30)
@given(seed=seeds, B=dims, T=dims)
def test_on_policy_is_the_plain_policy_gradient(seed: int, B: int, T: int) -> None:
    b = make_batch(seed, B, T, empty_row=B > 1)
    out = ipo_loss(logp=b.logp, prox_logp=b.logp.detach(), advantages=b.adv_tok, mask=b.mask)
    terms = {(i, t): -float(b.adv_tok[i, t]) * b.logp[i, t] for i, t in b.mask.nonzero().tolist()}
    ref = ref_aggregate(terms, B, T, "token-mean")
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)


@settings(max_examples=30)
@given(seed=seeds, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_give_finite_loss_and_gradients(seed: int, sign: float) -> None:
    b = make_batch(seed)
    flips = hostile.random_signs(seed, *b.mask.shape)
    out = ipo_loss(logp=b.logp, prox_logp=b.logp.detach() + sign * 1000.0 * flips, advantages=b.adv_tok,
                   mask=b.mask, weights=b.weights)  # fmt: skip
    hostile.assert_finite(out, b.logp)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_masked_batch_is_zero_with_zero_grad(mode: str) -> None:
    b = make_batch(32)
    out = ipo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=torch.zeros_like(b.mask),
                   weights=b.weights, agg=mode)  # fmt: skip
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


def test_gradient_flows_only_through_logp_and_garbage_never_leaks() -> None:
    b = make_batch(33)
    prox = b.prox_logp.clone().requires_grad_(True)
    adv = b.adv_tok.clone().requires_grad_(True)
    w = b.weights.clone().requires_grad_(True)
    out = ipo_loss(logp=b.logp, prox_logp=prox, advantages=adv, mask=b.mask, weights=w)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [prox, adv, w])
