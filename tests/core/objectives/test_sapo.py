"""SAPO against a float64 loop reference written from the paper's gate (arXiv 2511.20347), plus properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.masking import AGG_MODES
from steadyrl.core.objectives.sapo import SAPO_TAU_NEG, SAPO_TAU_POS, sapo_gate, sapo_loss
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


def _ref_sapo(b: Batch, *, tp: float, tn: float, weighted: bool, mode: str) -> torch.Tensor:
    """By hand: −w · σ(τ (r − 1)) · 4/τ · A, τ = τ_pos where A > 0 else τ_neg, r with gradient."""
    B, T = b.mask.shape
    terms = {}
    for i, t in b.mask.nonzero().tolist():
        r = torch.exp(clamp20(b.logp[i, t] - b.prox_logp[i, t]))
        A = float(b.adv_tok[i, t])
        tau = tp if A > 0 else tn
        gate = 4.0 / tau / (1.0 + torch.exp(-tau * (r - 1.0)))
        terms[(i, t)] = -(float(b.weights[i, t]) if weighted else 1.0) * gate * A
    return ref_aggregate(terms, B, T, mode)


def _loss(b: Batch, **kw):
    return sapo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask, **kw)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("tp", "tn"), [(SAPO_TAU_POS, SAPO_TAU_NEG), (0.5, 3.0)])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_reference(mode: str, tp: float, tn: float, weighted: bool) -> None:
    b = make_batch(21, scale=0.7)
    out = _loss(b, weights=b.weights if weighted else None, tau_pos=tp, tau_neg=tn, agg=mode)
    ref = _ref_sapo(b, tp=tp, tn=tn, weighted=weighted, mode=mode)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    assert_close(out.metrics["loss/policy"], ref)


def test_gate_value_and_gradient_weight() -> None:
    """f_τ(1) = 2/τ; f'_τ(r) = 4σ(1 − σ), 1 at r = 1 and sech²(τ(r − 1)/2) elsewhere."""
    tau = torch.tensor([0.5, 1.0, 1.05, 4.0], dtype=DT)
    r = torch.ones(4, dtype=DT, requires_grad=True)
    f = sapo_gate(r, tau)
    assert_close(f, 2.0 / tau, atol=1e-15)
    assert_close(grad_of(f.sum(), r), torch.ones(4, dtype=DT), atol=1e-15)
    r2 = torch.tensor([0.3, 1.7, 2.5, 9.0], dtype=DT, requires_grad=True)
    expect = 1.0 / torch.cosh(tau * (r2.detach() - 1.0) / 2.0) ** 2
    assert_close(grad_of(sapo_gate(r2, tau).sum(), r2), expect, atol=1e-14)


@settings(max_examples=40)
@given(seed=seeds, B=dims, T=dims)
def test_on_policy_gradient_is_the_plain_policy_gradient(seed: int, B: int, T: int) -> None:
    """r = 1: ∇ = −w·A·∇log π_θ whatever τ (the 4/τ normalization), and the value is −w·A·2/τ."""
    b = make_batch(seed, B, T, empty_row=B > 1)
    out = sapo_loss(logp=b.logp, prox_logp=b.logp.detach(), advantages=b.adv_tok, mask=b.mask, weights=b.weights,
                    tau_pos=0.7, tau_neg=2.0, agg="token-mean")  # fmt: skip
    pairs = b.mask.nonzero().tolist()
    grad_terms = {(i, t): -float(b.weights[i, t]) * float(b.adv_tok[i, t]) * b.logp[i, t] for i, t in pairs}
    assert_close(grad_of(out.loss, b.logp), grad_of(ref_aggregate(grad_terms, B, T, "token-mean"), b.logp))
    value = {(i, t): torch.tensor(-float(b.weights[i, t]) * float(b.adv_tok[i, t]) * 2.0
                                  / (0.7 if b.adv_tok[i, t] > 0 else 2.0), dtype=DT) for i, t in pairs}  # fmt: skip
    assert_close(out.loss, ref_aggregate(value, B, T, "token-mean"))
    assert_close(out.metrics["loss/ratio_mean"], 1.0 if b.mask.any() else 0.0)


def test_counting_empty_rows_divides_by_every_row() -> None:
    b = make_batch(22)  # row 0 is empty
    skip = _loss(b, agg="seq-mean-token-mean")
    count = _loss(b, agg="seq-mean-token-mean", empty_rows="count")
    n_rows = int(b.mask.any(-1).sum())
    assert_close(count.loss, skip.loss * n_rows / b.mask.shape[0], atol=1e-14)
    assert_close(grad_of(count.loss, b.logp), grad_of(skip.loss, b.logp) * n_rows / b.mask.shape[0], atol=1e-14)
    with pytest.raises(ValueError, match="empty_rows"):
        _loss(b, agg="token-mean", empty_rows="count")


def test_temperatures_must_be_positive() -> None:
    b = make_batch(23)
    with pytest.raises(ValueError, match="positive"):
        _loss(b, tau_neg=0.0)


@settings(max_examples=40)
@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_give_finite_loss_and_gradients(seed: int, B: int, T: int, sign: float) -> None:
    b = make_batch(seed, B, T)
    flips = hostile.random_signs(seed, B, T)
    out = _loss(b._replace(prox_logp=b.logp.detach() + sign * 1000.0 * flips), weights=b.weights)
    hostile.assert_finite(out, b.logp)


@pytest.mark.parametrize(
    ("mode", "empty_rows"),
    [(m, "skip") for m in AGG_MODES] + [("seq-mean-token-mean", "count"), ("seq-mean-token-sum", "count")],
)
def test_fully_masked_batch_is_zero_with_zero_grad(mode: str, empty_rows: str) -> None:
    b = make_batch(24)
    out = sapo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=torch.zeros_like(b.mask),
                    weights=b.weights, agg=mode, empty_rows=empty_rows)  # fmt: skip
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


@settings(max_examples=40)
@given(seed=seeds)
def test_gradient_flows_only_through_logp_and_garbage_never_leaks(seed: int) -> None:
    b = make_batch(seed)
    prox = b.prox_logp.clone().requires_grad_(True)
    adv = b.adv_tok.clone().requires_grad_(True)
    w = b.weights.clone().requires_grad_(True)
    out = sapo_loss(logp=b.logp, prox_logp=prox, advantages=adv, mask=b.mask, weights=w)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [prox, adv, w])
