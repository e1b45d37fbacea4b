"""DRO's policy loss against a float64 loop reference written from arXiv 2405.19107 Eq. 6 (as verl 0.9.1 writes its
policy term), plus the catalog properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.masking import AGG_MODES
from steadyrl.core.objectives.dro import dro_loss
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import Batch, assert_close, dims, grad_of, make_batch, ref_aggregate, seeds


def _ref_dro(b: Batch, *, beta: float, weighted: bool, mode: str) -> torch.Tensor:
    """w · (−A·log π_θ + ½β(log π_θ − log π_prox)²) per trained token, reduced by ``mode``."""
    B, T = b.mask.shape
    terms = {}
    for i in range(B):
        for t in range(T):
            if b.mask[i, t]:
                w = float(b.weights[i, t]) if weighted else 1.0
                log_r = b.logp[i, t] - float(b.prox_logp[i, t])
                terms[(i, t)] = w * (-float(b.adv_tok[i, t]) * b.logp[i, t] + 0.5 * beta * log_r**2)
    return ref_aggregate(terms, B, T, mode)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("beta", [0.1, 2.0])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_reference(mode: str, beta: float, weighted: bool) -> None:
    b = make_batch(21, scale=0.8)
    out = dro_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask,
                   weights=b.weights if weighted else None, beta=beta, agg=mode)  # fmt: skip
    ref = _ref_dro(b, beta=beta, weighted=weighted, mode=mode)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)


def test_penalty_gradient_pulls_back_to_the_proximal_policy() -> None:
    """∇ = −A + β·log r per token: with A = 0 the gradient is β·log r, its sign that of the drift."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    prox = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    out = dro_loss(logp=logp, prox_logp=prox, advantages=torch.zeros(1, 2, dtype=torch.float64),
                   mask=torch.ones(1, 2, dtype=torch.bool), beta=2.0, agg="token-sum")  # fmt: skip
    assert_close(grad_of(out.loss, logp), torch.tensor([[1.0, -2.0]], dtype=torch.float64))
    assert_close(out.loss, 0.5 * 2.0 * (0.25 + 1.0))


@settings(max_examples=30)
@given(seed=seeds, B=dims, T=dims)
def test_on_policy_is_the_plain_policy_gradient(seed: int, B: int, T: int) -> None:
    b = make_batch(seed, B, T, empty_row=B > 1)
    out = dro_loss(logp=b.logp, prox_logp=b.logp.detach(), advantages=b.adv_tok, mask=b.mask, beta=1.0)
    terms = {(i, t): -float(b.adv_tok[i, t]) * b.logp[i, t] for i, t in b.mask.nonzero().tolist()}
    ref = ref_aggregate(terms, B, T, "token-mean")
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)


@settings(max_examples=30)
@given(seed=seeds, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_give_finite_loss_and_gradients(seed: int, sign: float) -> None:
    b = make_batch(seed)
    flips = hostile.random_signs(seed, *b.mask.shape)
    out = dro_loss(logp=b.logp, prox_logp=b.logp.detach() + sign * 1000.0 * flips, advantages=b.adv_tok,
                   mask=b.mask, weights=b.weights)  # fmt: skip
    hostile.assert_finite(out, b.logp)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_masked_batch_is_zero_with_zero_grad(mode: str) -> None:
    b = make_batch(22)
    out = dro_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=torch.zeros_like(b.mask),
                   weights=b.weights, agg=mode)  # fmt: skip
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


def test_gradient_flows_only_through_logp_and_garbage_never_leaks() -> None:
    b = make_batch(23)
    prox = b.prox_logp.clone().requires_grad_(True)
    adv = b.adv_tok.clone().requires_grad_(True)
    w = b.weights.clone().requires_grad_(True)
    out = dro_loss(logp=b.logp, prox_logp=prox, advantages=adv, mask=b.mask, weights=w)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [prox, adv, w])
