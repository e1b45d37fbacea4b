"""LUSPO (arXiv 2602.05261): GSPO with each sequence's loss scaled by its length |y_i|, against a float64 loop
reference of J = (1/G) Σ_i |y_i| · min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i) (negated), and the property
that makes it length-unbiased. steadyrl's ``luspo`` preset is GSPO with the ``seq-mean-token-sum`` reduction (the token
sum of the GSPO per-token loss is exactly |y_i| times the sequence's loss): no second implementation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from steadyrl import compute_loss, resolve_method
from steadyrl.core.objectives.ppo import gspo_loss
from steadyrl.core.types import LossOutput
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import DT, Batch, assert_close, clamp20, dims, grad_of, make_batch, seeds

EL, EH = 2e-3, 2.5e-3  # LUSPO §5.1 (per TRL's paper index), the preset's clip range


def _ref_luspo(b: Batch, *, el: float = EL, eh: float = EH) -> torch.Tensor:
    B, T = b.mask.shape
    per_seq = []
    for i in range(B):
        toks = [t for t in range(T) if b.mask[i, t]]
        if not toks:
            continue
        s = torch.exp(clamp20(sum(b.logp[i, t] - b.prox_logp[i, t] for t in toks) / len(toks)))
        A = float(b.adv_seq[i])
        seq_loss = torch.maximum(-A * s, -A * torch.clamp(s, 1.0 - el, 1.0 + eh))  # −min(s A, clip(s) A)
        per_seq.append(len(toks) * seq_loss)  # |y_i| · ℓ_i
    return sum(per_seq, torch.zeros((), dtype=DT)) / max(len(per_seq), 1)


def _output(b: Batch, **overrides) -> LossOutput:
    batch = {"logp": b.logp, "prox_logp": b.prox_logp, "behav_logp": b.behav_logp, "mask": b.mask,
             "advantages": b.adv_seq}  # fmt: skip
    return compute_loss(resolve_method("luspo", {"advantage.type": "given", **overrides}), batch)


def _compute(b: Batch, **overrides) -> torch.Tensor:
    return _output(b, **overrides).loss


@settings(max_examples=40)
@given(seed=seeds, B=dims, T=dims)
def test_luspo_matches_the_papers_objective(seed: int, B: int, T: int) -> None:
    b = make_batch(seed, B=B + 1, T=T, scale=0.004)  # log-ratios of the clip range's size: both branches occur
    loss = _compute(b)
    ref = _ref_luspo(b)
    assert_close(loss, ref, atol=1e-12)
    assert_close(grad_of(loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    direct = gspo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask, clip_low=EL,
                       clip_high=EH, agg="seq-mean-token-sum")  # fmt: skip
    assert_close(direct.loss, ref, atol=1e-12)


def test_the_preset_is_gspo_with_token_sums_and_the_papers_clip_range() -> None:
    spec = resolve_method("luspo")
    assert spec.objective.type == "gspo" and (spec.objective.clip_low, spec.objective.clip_high) == (EL, EH)
    assert spec.agg == "seq-mean-token-sum"


@settings(max_examples=30)
@given(seed=seeds, B=dims, T=dims)
def test_on_policy_every_token_gets_its_sequences_full_advantage(seed: int, B: int, T: int) -> None:
    """π_θ = π_prox: ∂L/∂log π_θ(y_{i,t}) = −A_i/G for every token (GSPO gives −A_i/(G·|y_i|): long answers'
    tokens get smaller steps, the length bias LUSPO removes)."""
    b = make_batch(seed, B=B + 1, T=T)
    on = b._replace(prox_logp=b.logp.detach())
    g = grad_of(_compute(on), b.logp)
    G = int(b.mask.any(-1).sum())
    expect = torch.where(b.mask, -b.adv_seq[:, None].expand_as(b.mask) / max(G, 1), torch.zeros_like(g))
    assert_close(g, expect, atol=1e-12)
    gspo = gspo_loss(logp=b.logp, prox_logp=b.logp.detach(), advantages=b.adv_tok, mask=b.mask)
    lengths = b.mask.sum(-1, keepdim=True).clamp(min=1)
    assert_close(grad_of(gspo.loss, b.logp), expect / lengths, atol=1e-12)


@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_huge_log_ratios_stay_finite(sign: float) -> None:
    b = make_batch(7)
    b = b._replace(prox_logp=b.logp.detach() + sign * 1000.0)
    hostile.assert_finite(_output(b), b.logp)


def test_fully_masked_batch_is_zero_with_zero_grad_and_flag() -> None:
    b = make_batch(8)
    b = b._replace(mask=torch.zeros_like(b.mask))
    batch = {"logp": b.logp, "prox_logp": b.prox_logp, "behav_logp": b.behav_logp, "mask": b.mask,
             "advantages": b.adv_seq}  # fmt: skip
    out = compute_loss(resolve_method("luspo", {"advantage.type": "given"}), batch)
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


def test_garbage_off_the_mask_does_not_leak() -> None:
    b = make_batch(9)  # nan off the mask, an empty first row
    hostile.assert_grad_only_through_logp(_output(b), b.logp, b.mask)
