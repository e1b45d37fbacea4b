"""PNPO's detached prefix-normalized surrogate with hard rejection against a float64 loop reference written from
docs/algorithms.md (``pnpo``)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.objectives.pnpo import PNPO_DELTA, pnpo_loss
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import DT, Batch, assert_close, clamp20, dims, grad_of, make_batch, seeds


def _ref(b: Batch, *, delta: float | None, weighted: bool) -> tuple[torch.Tensor, float]:
    """(1/|N|) Σ_i (1/L_i) Σ_t −M_t v_t w_t A_i log π_θ(y_t), w_t = exp(mean_{k≤t} ℓ_k), M_t: the widened band."""
    B, T = b.mask.shape
    per_seq, rejected, n_tok = [], 0, 0
    for i in range(B):
        toks = [t for t in range(T) if b.mask[i, t]]
        if not toks:
            continue
        L, terms, running = len(toks), [], 0.0
        for n, t in enumerate(toks, start=1):
            running += float(b.logp[i, t].detach() - b.behav_logp[i, t])
            log_w = running / n  # (1/n_t) Σ_{k≤t} ℓ_k
            keep = delta is None or abs(log_w) <= delta * math.sqrt(L / n)
            rejected += not keep
            v = float(b.weights[i, t]) if weighted else 1.0
            coef = float(torch.exp(clamp20(torch.tensor(log_w, dtype=DT)))) * float(b.adv_seq[i]) * v * keep
            terms.append(-coef * b.logp[i, t])
        n_tok += L
        per_seq.append(sum(terms) / L)
    if not per_seq:
        return torch.zeros((), dtype=DT), 0.0
    return sum(per_seq) / len(per_seq), rejected / n_tok


@pytest.mark.parametrize("delta", [PNPO_DELTA, 0.5, None])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_reference(delta: float | None, weighted: bool) -> None:
    b = make_batch(31, B=8, T=6, scale=0.8)
    out = pnpo_loss(
        logp=b.logp, behav_logp=b.behav_logp, advantages=b.adv_tok, mask=b.mask,
        weights=b.weights if weighted else None, delta=delta,
    )  # fmt: skip
    ref, rejected = _ref(b, delta=delta, weighted=weighted)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp))
    assert_close(out.metrics["pnpo/rejected_frac"].to(DT), rejected, atol=1e-6)
    if delta == PNPO_DELTA:
        assert 0.0 < rejected < 1.0  # the band binds somewhere and keeps something


def test_band_widens_at_early_positions() -> None:
    """Same |log w| = 0.3 at t = 1 and t = 4 of a 4-token response: sqrt(4/1)·0.2 = 0.4 keeps it, 1·0.2 drops it."""
    logp = torch.zeros(1, 4, dtype=DT, requires_grad=True)
    behav = torch.tensor([[-0.3, -0.3, -0.3, -0.3]], dtype=DT)  # ℓ = 0.3 everywhere: log w_t = 0.3 for every t
    out = pnpo_loss(logp=logp, behav_logp=behav, advantages=torch.ones(1, 4, dtype=DT), mask=torch.ones(1, 4))
    # kept iff 0.3 ≤ 0.2·sqrt(4/t): t = 1 (0.4) kept, t = 2 (0.283) dropped, t = 3, 4 dropped
    g = grad_of(out.loss, logp)
    assert (g[0, 0] < 0).item() and torch.equal(g[0, 1:], torch.zeros(3, dtype=DT))
    assert_close(out.metrics["pnpo/rejected_frac"].to(DT), 0.75, atol=1e-7)


@given(seed=seeds, B=dims, T=dims)
def test_on_policy_is_grpo_reinforce(seed: int, B: int, T: int) -> None:
    """μ = π_θ: every w_t = 1 and every token kept: the gradient is −(1/|N|) A_i / L_i per token."""
    b = make_batch(seed, B, T)
    out = pnpo_loss(logp=b.logp, behav_logp=b.logp.detach(), advantages=b.adv_tok, mask=b.mask)
    rows = [i for i in range(B) if b.mask[i].any()]
    expect = torch.zeros(B, T, dtype=DT)
    for i in rows:
        expect[i, b.mask[i]] = -float(b.adv_seq[i]) / int(b.mask[i].sum()) / len(rows)
    assert_close(grad_of(out.loss, b.logp), expect)
    assert out.metrics["pnpo/rejected_frac"] == 0.0


@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_are_rejected_and_finite(seed: int, B: int, T: int, sign: float) -> None:
    b = make_batch(seed, B, T)
    out = pnpo_loss(logp=b.logp, behav_logp=b.logp.detach() + sign * 1000.0, advantages=b.adv_tok, mask=b.mask)
    hostile.assert_finite(out, b.logp)
    assert torch.equal(grad_of(out.loss, b.logp), torch.zeros_like(b.logp))  # every token is outside any band


def test_fully_masked_batch_is_zero_with_zero_grad() -> None:
    b = make_batch(32)
    out = pnpo_loss(logp=b.logp, behav_logp=b.behav_logp, advantages=b.adv_tok, mask=torch.zeros_like(b.mask))
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


def test_gradient_flows_only_through_logp() -> None:
    b = make_batch(33)
    behav = b.behav_logp.clone().requires_grad_(True)
    adv = b.adv_tok.clone().requires_grad_(True)
    out = pnpo_loss(logp=b.logp, behav_logp=behav, advantages=adv, mask=b.mask)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [behav, adv])
