"""VESPO against a float64 loop reference written from the paper's kernel φ(W) = W^k·exp(λ(1 − W)) (arXiv 2602.10693,
§3.4; TRL's paper-index form) with the clamps of the authors' code and TRL, plus its properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.masking import AGG_MODES
from steadyrl.core.objectives.ppo import reinforce_loss
from steadyrl.core.objectives.vespo import vespo_loss, vespo_phi
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

KERNEL = {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}


def _ref_vespo(b: Batch, *, den: torch.Tensor, weighted: bool, mode: str, kp=2.0, lp=3.0, kn=3.0, ln=2.0):
    """Loops: log W_i = clamp(Σ_t clamp(log π_θ − log π_den, ±20) + Σ_t clamp(log w, [ln 1e-8, 20]), [ln 1e-8, 20]);
    φ_i = W^k exp(λ(1 − W)) by the sign of A_i; L = −φ_i A_i log π_θ."""
    B, T = b.mask.shape
    floor = math.log(1e-8)
    terms, phis = {}, []
    for i in range(B):
        toks = [t for t in range(T) if b.mask[i, t]]
        if not toks:
            continue
        s = 0.0
        for t in toks:
            s += float(clamp20(b.logp[i, t].detach() - den[i, t]))
            if weighted:
                s += min(max(math.log(float(b.weights[i, t])), floor), 20.0)
        W = math.exp(min(max(s, floor), 20.0))
        A = float(b.adv_seq[i])
        k, lam = (kp, lp) if A >= 0 else (kn, ln)
        phi = W**k * math.exp(lam * (1.0 - W))
        phis.append(phi)
        for t in toks:
            terms[(i, t)] = -phi * A * b.logp[i, t]
    return ref_aggregate(terms, B, T, mode), phis


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("den", ["prox", "behav"])
def test_vespo_matches_reference(mode: str, weighted: bool, den: str) -> None:
    b = make_batch(4, scale=0.3)
    den_logp = b.prox_logp if den == "prox" else b.behav_logp
    out = vespo_loss(
        logp=b.logp, ratio_logp=den_logp, advantages=b.adv_seq, mask=b.mask, weights=b.weights if weighted else None,
        agg=mode,
    )  # fmt: skip
    ref, phis = _ref_vespo(b, den=den_logp, weighted=weighted, mode=mode)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp))
    assert_close(out.metrics["loss/phi_mean"], sum(phis) / len(phis))
    assert_close(out.metrics["loss/phi_max"], max(phis))
    assert max(phis) - min(phis) > 0.1  # the kernel varies across the batch (not φ ≡ 1)


@settings(max_examples=30)
@given(seed=seeds, B=dims, T=dims, k=st.floats(0.5, 4.0), lam=st.floats(0.5, 4.0))
def test_vespo_reference_over_random_kernels(seed: int, B: int, T: int, k: float, lam: float) -> None:
    b = make_batch(seed, B=B + 1, T=T, scale=0.6)
    kernel = {"k_pos": k, "lambda_pos": lam, "k_neg": lam, "lambda_neg": k}
    out = vespo_loss(
        logp=b.logp, ratio_logp=b.behav_logp, advantages=b.adv_seq, mask=b.mask, weights=b.weights, **kernel
    )
    ref, _ = _ref_vespo(b, den=b.behav_logp, weighted=True, mode="token-mean", kp=k, lp=lam, kn=lam, ln=k)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp))


def test_kernel_is_one_at_w_one_peaks_at_k_over_lambda_and_vanishes_at_the_ends() -> None:
    adv = torch.ones(5, dtype=DT)
    log_w = torch.log(torch.tensor([1.0, 2.0 / 3.0, 0.5, 1e-8, math.exp(20.0)], dtype=DT))
    phi = vespo_phi(log_w=log_w, advantages=adv, **KERNEL)  # A ≥ 0: k = 2, λ = 3, peak at W = 2/3
    assert phi[0].item() == pytest.approx(1.0, abs=1e-15)
    assert phi[1].item() == pytest.approx((2 / 3) ** 2 * math.exp(3 * (1 - 2 / 3)), rel=1e-14)
    assert phi[1] > phi[0] and phi[1] > phi[2]
    assert phi[3].item() < 1e-14 and phi[4].item() == 0.0
    neg = vespo_phi(log_w=log_w[:3], advantages=-adv[:3], **KERNEL)  # A < 0: k = 3, λ = 2, peak at W = 3/2
    assert neg[0].item() == pytest.approx(1.0, abs=1e-15) and neg[2].item() == pytest.approx(0.125 * math.exp(1.0))


def test_overflowing_kernel_is_zero_as_trl_sets_it() -> None:
    """k·log W beyond float64's range (k = 40, W = e^20): TRL's nan_to_num(posinf=0) gives 0, and so do we."""
    phi = vespo_phi(log_w=torch.tensor([20.0], dtype=DT), advantages=torch.ones(1, dtype=DT), k_pos=40.0,
                    lambda_pos=1e-9, k_neg=3.0, lambda_neg=2.0)  # fmt: skip
    assert phi.item() == 0.0


def test_a_zeroed_correction_weight_folds_as_one_in_1e8() -> None:
    logp = torch.zeros(1, 2, dtype=DT, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    w = torch.tensor([[0.0, 1.0]], dtype=DT)
    out = vespo_loss(logp=logp, ratio_logp=logp.detach(), advantages=torch.ones(1, dtype=DT), mask=mask, weights=w)
    assert out.metrics["loss/ratio_mean"].item() == pytest.approx(1e-8, rel=1e-12)


@settings(max_examples=30)
@given(seed=seeds, B=dims, T=dims)
def test_on_policy_is_reinforce_on_log_prob(seed: int, B: int, T: int) -> None:
    """π_θ = π_den, no weights: W = 1, φ = 1, so L = −A·log π_θ, whose gradient is REINFORCE's at the first update."""
    b = make_batch(seed, B=B + 1, T=T)
    out = vespo_loss(logp=b.logp, ratio_logp=b.logp.detach(), advantages=b.adv_seq, mask=b.mask)
    plain = reinforce_loss(logp=b.logp, prox_logp=b.logp.detach(), advantages=b.adv_tok, mask=b.mask)
    assert_close(grad_of(out.loss, b.logp), grad_of(plain.loss, b.logp), atol=1e-12)
    terms = {(i, t): -float(b.adv_seq[i]) * b.logp[i, t] for i, t in b.mask.nonzero().tolist()}
    assert_close(out.loss, ref_aggregate(terms, *b.mask.shape, "token-mean"), atol=1e-12)
    assert out.metrics["loss/phi_mean"].item() == pytest.approx(float(out.metrics["loss/all_masked"] == 0))


@settings(max_examples=30)
@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_give_finite_loss_and_gradients(seed: int, B: int, T: int, sign: float) -> None:
    b = make_batch(seed, B=B + 1, T=T)
    den = b.logp.detach() + sign * 1000.0
    out = vespo_loss(logp=b.logp, ratio_logp=den, advantages=b.adv_seq, mask=b.mask, weights=b.weights * 1e300)
    hostile.assert_finite(out, b.logp)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_masked_batch_is_zero_with_zero_grad(mode: str) -> None:
    b = make_batch(5)
    mask = torch.zeros_like(b.mask)
    out = vespo_loss(logp=b.logp, ratio_logp=b.behav_logp, advantages=b.adv_seq, mask=mask, weights=b.weights,
                     agg=mode)  # fmt: skip
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


@settings(max_examples=30)
@given(seed=seeds)
def test_garbage_off_the_mask_does_not_leak(seed: int) -> None:
    """nan at masked-out positions of every input (and nan advantages of the empty row): finite loss, zero gradient
    there, and the same loss as with clean zeros in place of the garbage."""
    b = make_batch(seed)  # nan garbage off the mask, row 0 empty
    adv = b.adv_seq.clone()
    adv[0] = float("nan")
    out = vespo_loss(logp=b.logp, ratio_logp=b.behav_logp, advantages=adv, mask=b.mask, weights=b.weights)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask)
    clean = [x.detach().masked_fill(~b.mask, 0.0) for x in (b.logp, b.behav_logp, b.weights)]
    ref = vespo_loss(logp=clean[0], ratio_logp=clean[1], advantages=b.adv_seq, mask=b.mask, weights=clean[2])
    assert_close(out.loss, ref.loss, atol=1e-14)


def test_gradient_flows_only_through_logp() -> None:
    b = make_batch(6)
    den = b.behav_logp.clone().requires_grad_(True)
    w = b.weights.clone().requires_grad_(True)
    adv = b.adv_seq.clone().requires_grad_(True)
    out = vespo_loss(logp=b.logp, ratio_logp=den, advantages=adv, mask=b.mask, weights=w)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [den, w, adv])
