"""Bias-corrected (importance-weighted) k3 reference KL (DeepSeek-V3.2, arXiv 2512.02556; TRL
``use_bias_correction_kl``) against float64 references written from the paper's estimator
D_t = (π_θ/π_old)·(π_ref/π_θ − log(π_ref/π_θ) − 1), and its unbiasedness on an exact expectation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.kl import importance_weighted_kl, reference_kl

DT = torch.float64


def _batch(seed: int, B: int = 5, T: int = 6, scale: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=DT) * 2).requires_grad_(True)
    prox = logp.detach() + scale * torch.randn(B, T, generator=g, dtype=DT)
    ref = logp.detach() + scale * torch.randn(B, T, generator=g, dtype=DT)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False
    mask[1, 0] = True
    nan = float("nan")
    return logp, prox.masked_fill(~mask, nan), ref.masked_fill(~mask, nan), mask


def _corrected(logp, prox, ref, mask, level):
    k = reference_kl(logp=logp, ref_logp=ref, mask=mask, kind="k3")
    return importance_weighted_kl(kl=k.kl, logp=logp, prox_logp=prox, mask=mask, level=level)


def _ref_terms(logp, prox, ref, mask, level):
    """{(i, t): r·k3} by loops, with r = π_θ/π_old per token or exp(mean_t log(π_θ/π_old)) per sequence."""
    B, T = mask.shape
    out = {}
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        if not toks:
            continue
        seq_r = torch.exp(sum(logp[i, t] - prox[i, t] for t in toks) / len(toks))
        for t in toks:
            x = ref[i, t] - logp[i, t]  # log(π_ref/π_θ)
            k3 = torch.exp(x) - x - 1.0
            r = torch.exp(logp[i, t] - prox[i, t]) if level == "token" else seq_r
            out[(i, t)] = r * k3
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_matches_the_papers_estimator_in_value_and_gradient(level: str) -> None:
    logp, prox, ref, mask = _batch(1)
    out = _corrected(logp, prox, ref, mask, level)
    terms = _ref_terms(logp, prox, ref, mask, level)
    for (i, t), v in terms.items():
        assert out.kl[i, t].item() == pytest.approx(v.item(), abs=1e-12)
    assert torch.count_nonzero(out.kl[~mask]) == 0
    total, ref_total = out.kl.sum(), sum(terms.values())
    (g,) = torch.autograd.grad(total, logp, retain_graph=True)
    (g_ref,) = torch.autograd.grad(ref_total, logp)
    assert torch.allclose(g, g_ref, atol=1e-12, rtol=0)
    assert out.metrics["kl/ref_mean"].item() == pytest.approx(ref_total.item() / len(terms), abs=1e-12)


@settings(max_examples=30)
@given(seed=st.integers(0, 10_000), V=st.integers(2, 8), on_policy=st.booleans())
def test_expectation_under_the_proximal_policy_is_the_reverse_kl_and_its_gradient(
    seed: int, V: int, on_policy: bool
) -> None:
    """Over a whole vocabulary: Σ_y π_prox(y)·r(y)·k3(y) = KL(π_θ ‖ π_ref) exactly, gradient included; the
    uncorrected Σ_y π_prox(y)·k3(y) has another gradient, also when π_prox = π_θ (the weight's value is 1 there)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=g, dtype=DT).requires_grad_(True)
    logp = torch.log_softmax(theta, -1).unsqueeze(0)  # one "sequence" whose tokens are the V outcomes
    prox = logp.detach() if on_policy else torch.log_softmax(torch.randn(V, generator=g, dtype=DT), -1).unsqueeze(0)
    ref = torch.log_softmax(torch.randn(V, generator=g, dtype=DT), -1).unsqueeze(0)
    mask = torch.ones(1, V, dtype=torch.bool)
    k = reference_kl(logp=logp, ref_logp=ref, mask=mask, kind="k3").kl
    weighted = importance_weighted_kl(kl=k, logp=logp, prox_logp=prox, mask=mask).kl
    p_prox = prox.exp()
    estimate = (p_prox * weighted).sum()
    exact = (logp.exp() * (logp - ref)).sum()  # KL(π_θ ‖ π_ref)
    assert estimate.item() == pytest.approx(exact.item(), abs=1e-12)
    (g_est,) = torch.autograd.grad(estimate, theta, retain_graph=True)
    (g_exact,) = torch.autograd.grad(exact, theta, retain_graph=True)
    assert torch.allclose(g_est, g_exact, atol=1e-12, rtol=0)
    (g_plain,) = torch.autograd.grad((p_prox * k).sum(), theta)
    assert not torch.allclose(g_plain, g_exact, atol=1e-6, rtol=0)


def test_none_returns_the_penalty_unchanged() -> None:
    logp, prox, ref, mask = _batch(2)
    k = reference_kl(logp=logp, ref_logp=ref, mask=mask, kind="k3").kl
    out = importance_weighted_kl(kl=k, logp=logp, prox_logp=prox, mask=mask, level="none")
    assert out.kl is k and out.metrics == {}


def test_unknown_level_is_refused() -> None:
    logp, prox, _ref, mask = _batch(2)
    with pytest.raises(ValueError, match="level"):
        importance_weighted_kl(kl=torch.zeros_like(logp), logp=logp, prox_logp=prox, mask=mask, level="seq")


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_huge_log_ratios_stay_finite(level: str, sign: float) -> None:
    logp, _prox, _ref, mask = _batch(3)
    out = _corrected(logp, logp.detach() + sign * 1000.0, logp.detach() - sign * 1000.0, mask, level)
    (g,) = torch.autograd.grad(out.kl.sum(), logp)
    assert torch.isfinite(out.kl).all() and torch.isfinite(g).all()
    assert math.isfinite(out.metrics["kl/ref_mean"].item())


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fully_masked_and_garbage(level: str) -> None:
    """Nothing masked in: zeros with zero gradient; nan garbage off a partial mask reaches neither value nor grad."""
    logp, prox, ref, mask = _batch(4)
    empty = _corrected(logp, prox, ref, torch.zeros_like(mask), level)
    (g0,) = torch.autograd.grad(empty.kl.sum(), logp)
    assert torch.count_nonzero(empty.kl) == 0 and torch.count_nonzero(g0) == 0
    assert empty.metrics["kl/ref_mean"].item() == 0.0
    out = _corrected(logp, prox, ref, mask, level)
    (g,) = torch.autograd.grad(out.kl.sum(), logp)
    assert torch.isfinite(out.kl).all() and torch.isfinite(g).all()
    assert torch.count_nonzero(g[~mask]) == 0


def test_gradient_does_not_reach_the_proximal_or_reference_policy() -> None:
    logp, prox, ref, mask = _batch(5)
    prox = prox.clone().requires_grad_(True)
    ref = ref.clone().requires_grad_(True)
    out = _corrected(logp, prox, ref, mask, "token")
    assert torch.autograd.grad(out.kl.sum(), [prox, ref], allow_unused=True) == (None, None)
