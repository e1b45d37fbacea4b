"""TIC-GRPO's clipped trajectory ratio to μ against a float64 loop reference written from the paper's form
(docs/algorithms.md, ``tic_grpo``: w_i = π_θ(y_i)/π_old(y_i) with π_old the sampling policy, upper-only clip)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.objectives.tic_grpo import tic_grpo_loss
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import DT, Batch, assert_close, clamp20, dims, grad_of, make_batch, seeds


def _ref(b: Batch, *, eps: float, upper_only: bool, weighted: bool):
    B, T = b.mask.shape
    terms, clipped = [], 0
    for i in range(B):
        toks = [t for t in range(T) if b.mask[i, t]]
        if not toks:
            continue
        w = torch.exp(clamp20(sum(b.logp[i, t] - b.behav_logp[i, t] for t in toks)))  # w_i = exp(Σ_t log π_θ/μ)
        A = float(b.adv_seq[i])
        clip = torch.clamp(w, max=1.0 + eps) if upper_only else torch.clamp(w, 1.0 - eps, 1.0 + eps)
        clipped += int(clip * A < w * A)
        v = float(b.weights[i, 0]) if weighted else 1.0
        terms.append(-v * torch.minimum(w * A, clip * A))
    if not terms:
        return torch.zeros((), dtype=DT), 0.0
    return sum(terms) / len(terms), clipped / len(terms)


@pytest.mark.parametrize("upper_only", [False, True])
@pytest.mark.parametrize("eps", [0.2, 0.05])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_reference(upper_only: bool, eps: float, weighted: bool) -> None:
    b = make_batch(21, B=8, T=4, scale=0.3)
    out = tic_grpo_loss(
        logp=b.logp,
        behav_logp=b.behav_logp,
        advantages=b.adv_seq,
        mask=b.mask,
        weights=b.weights[:, 0] if weighted else None,
        clip_eps=eps,
        upper_only=upper_only,
    )
    ref, clip_frac = _ref(b, eps=eps, upper_only=upper_only, weighted=weighted)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp))
    assert_close(out.metrics["loss/clip_frac"].to(DT), clip_frac, atol=1e-6)
    assert 0.0 < clip_frac < 1.0


def test_upper_only_keeps_gradient_of_small_ratio_with_negative_advantage() -> None:
    # w' = e^{-0.7} ≈ 0.50 < 1 − ε, A = −1: the two-sided clip freezes it, the upper-only clip does not.
    logp = torch.tensor([[-0.3, -0.4]], dtype=DT, requires_grad=True)
    behav = torch.zeros(1, 2, dtype=DT)
    kw = {"logp": logp, "behav_logp": behav, "advantages": torch.tensor([-1.0], dtype=DT), "mask": torch.ones(1, 2)}
    two = tic_grpo_loss(**kw, upper_only=False)
    upper = tic_grpo_loss(**kw)  # the default: the paper's upper-only clip
    w = torch.exp(torch.tensor(-0.7, dtype=DT))
    assert_close(two.loss, 0.8)
    assert torch.equal(grad_of(two.loss, logp), torch.zeros_like(logp))
    assert_close(upper.loss, w)
    assert_close(grad_of(upper.loss, logp), w.expand(1, 2))  # ∂(w'·1)/∂log π_θ(y_t) = w' for every token


@given(seed=seeds, B=dims, T=dims)
def test_on_policy_reduces_to_mean_advantage_objective(seed: int, B: int, T: int) -> None:
    b = make_batch(seed, B, T, empty_row=B > 1)
    out = tic_grpo_loss(logp=b.logp, behav_logp=b.logp.detach(), advantages=b.adv_seq, mask=b.mask)
    rows = [i for i in range(B) if b.mask[i].any()]
    assert_close(out.loss, -sum(float(b.adv_seq[i]) for i in rows) / len(rows))
    assert out.metrics["loss/clip_frac"] == 0.0
    assert_close(out.metrics["loss/ratio_mean"], 1.0)
    # gradient: −A_i / B' on every token (w' = 1, ∂w'/∂log π_θ = w')
    expect = torch.zeros(B, T, dtype=DT)
    for i in rows:
        expect[i, b.mask[i]] = -float(b.adv_seq[i]) / len(rows)
    assert_close(grad_of(out.loss, b.logp), expect)


@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]), upper_only=st.booleans())
def test_huge_log_ratios_give_finite_loss_and_gradients(
    seed: int, B: int, T: int, sign: float, upper_only: bool
) -> None:
    b = make_batch(seed, B, T)
    behav = b.logp.detach() + sign * 1000.0
    out = tic_grpo_loss(logp=b.logp, behav_logp=behav, advantages=b.adv_seq, mask=b.mask, upper_only=upper_only)
    hostile.assert_finite(out, b.logp)


def test_fully_masked_batch_is_zero_with_zero_grad() -> None:
    b = make_batch(22)
    out = tic_grpo_loss(logp=b.logp, behav_logp=b.behav_logp, advantages=b.adv_seq, mask=torch.zeros_like(b.mask))
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


@given(seed=seeds)
def test_gradient_flows_only_through_logp(seed: int) -> None:
    b = make_batch(seed)
    behav = b.behav_logp.clone().requires_grad_(True)
    adv = b.adv_seq.clone().requires_grad_(True)
    out = tic_grpo_loss(logp=b.logp, behav_logp=behav, advantages=adv, mask=b.mask)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [behav, adv])


def test_compute_loss_ratio_is_to_mu_with_length_corrected_advantages() -> None:
    """The preset end to end, by hand: R_i/L_i normalized per group (unbiased std + 1e-6), w_i = Π_t π_θ/μ, upper
    clip at 1.2, mean over responses."""
    from steadyrl import compute_loss
    from tests.methods._batch import make_batch as full_batch

    batch = full_batch(seed=11, scale=0.2)
    loss, _ = compute_loss("tic_grpo", batch)
    logp, behav, mask = batch["logp"].detach(), batch["behav_logp"], batch["mask"]
    B = mask.shape[0]
    L = [int(mask[i].sum()) for i in range(B)]
    r = [float(batch["rewards"][i]) / L[i] for i in range(B)]
    gid = batch["group_ids"].tolist()
    terms = []
    for i in range(B):
        members = [r[j] for j in range(B) if gid[j] == gid[i]]
        mean = sum(members) / len(members)
        std = (sum((x - mean) ** 2 for x in members) / (len(members) - 1)) ** 0.5
        A = (r[i] - mean) / (std + 1e-6)
        w = float(torch.exp(sum(logp[i, t] - behav[i, t] for t in range(mask.shape[1]) if mask[i, t])))
        terms.append(-min(w * A, min(w, 1.2) * A))
    assert loss.item() == pytest.approx(sum(terms) / B, abs=1e-10)
