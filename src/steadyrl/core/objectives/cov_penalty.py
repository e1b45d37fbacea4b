"""Clip-Cov and KL-Cov (Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
arXiv 2505.22617, §5): restrain the few tokens whose log-probability and advantage covary most, the ones that drive
policy entropy down.

Per trained token, over the batch's N trained tokens (means over the mask, values detached)::

    Cov_t = (log π_θ(y_t) − mean log π_θ) · (A_t − mean A)

=========  ==========================================================================================================
Clip-Cov   candidates: trained tokens PPO's clip leaves unclipped with ω_low < Cov_t < ω_high; k = max(⌊ρ·N⌋, 1) of
           them, drawn uniformly at random without replacement (all when fewer), lose their loss and gradient;
           the rest train on PPO-clip
KL-Cov     the k = max(⌊ρ·N⌋, 1) trained tokens of largest Cov_t get β·|log r_t| added to the unclipped −A_t r_t
=========  ==========================================================================================================

The count k is a tensor (no host sync): selection ranks tokens with one sort, so top-k by a count that depends on the
mask needs no ``.item()`` (verl and SkyRL read the count on the host and build index lists there).

Randomness of Clip-Cov: the draw is one uniform key per token from a ``torch.Generator``; :func:`selection_generator`
builds it from a seed and the learner's version, so the selection is a pure function of (seed, version, batch
shape, device): the same loss and gradient however often the loss is evaluated (micro-batching, recomputation), a
fresh draw each optimizer step. ``generator=None`` draws from torch's global generator, as verl's ``randperm`` does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    AggMode,
    aggregate,
    all_masked_flag,
    detach_metrics,
    masked_mean,
    safe_exp,
    where_masked,
)
from steadyrl.core.objectives.ppo import (
    PPO_CLIP_EPS,
    apply_weights,
    as_scalar,
    clipped_surrogate,
    mask_frac,
    prepare_token_inputs,
    ratio_metrics,
)
from steadyrl.core.types import LossOutput, Metrics

#: Clip-Cov's fraction ρ of clipped tokens and its covariance window [ω_low, ω_high] (the authors' scripts
#: ``recipe/dapo/7b_clip_cov.sh`` / ``32b_clip_cov.sh``: clip_cov_ratio 2e-4, clip_cov_lb 1, clip_cov_ub 5; verl's
#: ``PolicyLossConfig`` defaults are the same).
CLIP_COV_FRAC: float = 2e-4
CLIP_COV_LB: float = 1.0
CLIP_COV_UB: float = 5.0
#: PPO clip range of the authors' Clip-Cov scripts (clip_ratio_low = clip_ratio_high = 1: ratios in [0, 2]).
CLIP_COV_PPO_EPS: float = 1.0
#: KL-Cov's fraction k of penalized tokens and its coefficient β (the authors' ``7b_kl_cov.sh``: k_percent 0.2,
#: a percentage, so 2e-3; ``32b_kl_cov.sh`` uses 2e-4; ppo_kl_coef 1 in both).
KL_COV_FRAC: float = 2e-3
KL_COV_COEF: float = 1.0


class CovSelection(NamedTuple):
    """Which trained tokens a covariance rule restrains (detached): ``cov`` [B,T] (0 off the mask), the
    ``candidates`` it chose among, the ``selected`` ones and the target count ``k`` (an int64 0-d tensor)."""

    cov: Float[Tensor, "B T"]
    candidates: Bool[Tensor, "B T"]
    selected: Bool[Tensor, "B T"]
    k: Int[Tensor, ""]


def token_covariance(
    *, logp: Float[Tensor, "B T"], advantages: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"]
) -> Float[Tensor, "B T"]:
    """Cov_t = (log π_θ − mean_mask log π_θ)(A − mean_mask A), detached, 0 off the mask (arXiv 2505.22617, §5)."""
    lp, adv = where_masked(logp.detach(), mask), where_masked(advantages.detach(), mask)
    cov = (lp - masked_mean(lp, mask)) * (adv - masked_mean(adv, mask))
    return where_masked(cov, mask)


def count_from_fraction(mask: Bool[Tensor, "B T"], frac: float) -> Int[Tensor, ""]:
    """k = max(⌊frac · N⌋, 1) with N the number of trained tokens, as an int64 0-d tensor (floor in float64, as
    Python's ``int(N * frac)`` in verl and SkyRL)."""
    n = torch.count_nonzero(mask).to(torch.float64)
    return torch.floor(n * frac).clamp(min=1).to(torch.int64)


def _ranks(scores: Float[Tensor, "B T"], *, descending: bool) -> Int[Tensor, "B T"]:
    """Rank of every position by ``scores`` (0 = first; ties in row-major order), without a host sync."""
    flat = scores.flatten()
    order = torch.argsort(flat, descending=descending, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    return ranks.view_as(scores)


def top_k_mask(scores: Float[Tensor, "B T"], valid: Bool[Tensor, "B T"], k: Int[Tensor, ""]) -> Bool[Tensor, "B T"]:
    """The ``k`` valid positions with the largest ``scores`` (all valid ones when fewer)."""
    ranked = _ranks(torch.where(valid, scores, -torch.inf), descending=True)
    return valid & (ranked < k)


def random_subset(
    candidates: Bool[Tensor, "B T"], k: Int[Tensor, ""], generator: torch.Generator | None = None
) -> Bool[Tensor, "B T"]:
    """``k`` of the ``candidates`` drawn uniformly without replacement (all when fewer): the smallest of one uniform
    float64 key per position, drawn from ``generator`` (torch's global one when None)."""
    keys = torch.rand(candidates.shape, generator=generator, dtype=torch.float64, device=candidates.device)
    ranked = _ranks(torch.where(candidates, keys, 2.0), descending=False)  # non-candidates rank after every one
    return candidates & (ranked < k)


def selection_generator(seed: int | None, step: int | None, device: torch.device | str) -> torch.Generator | None:
    """A fresh generator on ``device`` seeded from (``seed``, ``step``), or None (the global one) when ``seed`` is
    None. ``step`` is the learner's version (0 when unknown): one draw per optimizer step, the same on every
    evaluation of that step's loss."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(((seed * 1_000_003) ^ (step or 0)) % (2**63))
    return g


def clip_cov_selection(
    *,
    logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Bool[Tensor, "B T"],
    ppo_clipped: Bool[Tensor, "B T"],
    frac: float = CLIP_COV_FRAC,
    cov_lb: float = CLIP_COV_LB,
    cov_ub: float = CLIP_COV_UB,
    generator: torch.Generator | None = None,
) -> CovSelection:
    """Clip-Cov's tokens: ``k`` = max(⌊frac·N⌋, 1) drawn at random among trained, PPO-unclipped tokens with
    cov_lb < Cov < cov_ub (verl ``compute_policy_loss_clip_cov``'s candidate rule, both bounds strict)."""
    cov = token_covariance(logp=logp, advantages=advantages, mask=mask)
    candidates = mask & ~ppo_clipped & (cov > cov_lb) & (cov < cov_ub)
    k = count_from_fraction(mask, frac)
    return CovSelection(cov=cov, candidates=candidates, selected=random_subset(candidates, k, generator), k=k)


def kl_cov_selection(
    *, logp: Float[Tensor, "B T"], advantages: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"], frac: float
) -> CovSelection:
    """KL-Cov's tokens: the ``k`` = max(⌊frac·N⌋, 1) trained tokens of largest Cov (every trained token competes)."""
    cov = token_covariance(logp=logp, advantages=advantages, mask=mask)
    k = count_from_fraction(mask, frac)
    return CovSelection(cov=cov, candidates=mask, selected=top_k_mask(cov, mask, k), k=k)


def _cov_metrics(sel: CovSelection, mask: Bool[Tensor, "B T"]) -> Metrics:
    return {
        "cov/selected_frac": mask_frac(sel.selected, mask),
        "cov/candidate_frac": mask_frac(sel.candidates, mask),
        "cov/mean": masked_mean(sel.cov, mask),
        "cov/selected_mean": masked_mean(sel.cov, sel.selected),
    }


def clip_cov_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    clip_low: float = PPO_CLIP_EPS,
    clip_high: float = PPO_CLIP_EPS,
    frac: float = CLIP_COV_FRAC,
    cov_lb: float = CLIP_COV_LB,
    cov_ub: float = CLIP_COV_UB,
    generator: torch.Generator | None = None,
    agg: AggMode | str = "token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """Clip-Cov (arXiv 2505.22617, §5, "Clip-Cov") [reference-code: the authors' verl code, merged into verl].

    With r = exp(clamp(log π_θ − log π_prox, ±20)), S the tokens of :func:`clip_cov_selection` and w the detached
    correction weight::

        L_t  = max(−A_t r_t, −A_t clip(r_t, 1 − ε_low, 1 + ε_high))     PPO-clip
        L_t ← 0                        for t ∈ S (no loss, no gradient; t stays in the aggregation's denominator)
        loss = agg(w · L, mask)

    Defaults: ρ = 2e-4, ω_low = 1, ω_high = 5 (the authors' scripts and verl's defaults). The authors' scripts set
    PPO's ε_low = ε_high = 1 for Clip-Cov (``CLIP_COV_PPO_EPS``, what the ``clip_cov`` preset uses); this function's
    default is PPO's 0.2. ``generator``: the source of the random draw (module docstring).

    Metrics: ``loss/policy``, ``loss/clip_frac`` (PPO's clipped fraction), ``cov/selected_frac`` (|S| / N: verl's
    ``pg_clipfrac`` for this loss), ``cov/candidate_frac``, ``cov/mean``, ``cov/selected_mean``, ``loss/ratio_mean``,
    ``loss/ratio_max``, ``loss/all_masked``.
    """
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    ratio = safe_exp(x.log_ratio)
    lower = 1.0 - as_scalar(clip_low, like=ratio)
    upper = 1.0 + as_scalar(clip_high, like=ratio)
    surrogate = clipped_surrogate(ratio=ratio, advantages=x.advantages, lower=lower, upper=upper)
    sel = clip_cov_selection(
        logp=logp, advantages=x.advantages, mask=x.mask, ppo_clipped=surrogate.clipped, frac=frac, cov_lb=cov_lb,
        cov_ub=cov_ub, generator=generator,
    )  # fmt: skip
    loss_tok = torch.where(sel.selected, 0.0, surrogate.loss)
    loss = aggregate(apply_weights(x.weights, loss_tok), x.mask, agg, norm_len=norm_len)
    metrics: Metrics = {"loss/clip_frac": mask_frac(surrogate.clipped, x.mask), **_cov_metrics(sel, x.mask)}
    metrics |= ratio_metrics(ratio, x.mask)
    metrics |= {"loss/policy": loss, "loss/all_masked": all_masked_flag(x.mask)}
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))


def kl_cov_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    frac: float = KL_COV_FRAC,
    coef: float = KL_COV_COEF,
    agg: AggMode | str = "token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """KL-Cov (arXiv 2505.22617, §5, "KL-Cov") [reference-code: the authors' verl code, merged into verl].

    With r = exp(clamp(log π_θ − log π_prox, ±20)) (no PPO clip), S the ``k`` = max(⌊frac·N⌋, 1) tokens of largest
    Cov (:func:`kl_cov_selection`) and w the detached correction weight::

        L_t  = −A_t r_t + β · 1[t ∈ S] · |log π_θ(y_t) − log π_prox(y_t)|
        loss = agg(w · L, mask)

    Defaults: k = 2e-3 and β = 1 (the authors' 7B script; their 32B script uses k = 2e-4). verl's
    ``PolicyLossConfig`` defaults are k = 2e-4, β = 0.1 (1.0 in its function's fallback); SkyRL's ``KLCovConfig``
    k = 0.2, β = 1.

    Metrics: ``loss/policy``, ``kl_cov/abs_log_ratio_mean`` (mean |log r| over trained tokens: verl's ``ppo_kl`` for
    this loss), ``kl_cov/penalty`` (the aggregated β-term), ``cov/selected_frac``, ``cov/candidate_frac``,
    ``cov/mean``, ``cov/selected_mean``, ``loss/ratio_mean``, ``loss/ratio_max``, ``loss/all_masked``.
    """
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    ratio = safe_exp(x.log_ratio)
    sel = kl_cov_selection(logp=logp, advantages=x.advantages, mask=x.mask, frac=frac)
    abs_log_ratio = x.log_ratio.abs()
    penalty_tok = where_masked(coef * abs_log_ratio, sel.selected)
    loss = aggregate(apply_weights(x.weights, -x.advantages * ratio + penalty_tok), x.mask, agg, norm_len=norm_len)
    metrics: Metrics = _cov_metrics(sel, x.mask)
    metrics |= ratio_metrics(ratio, x.mask)
    metrics |= {
        "kl_cov/abs_log_ratio_mean": masked_mean(abs_log_ratio, x.mask),
        "kl_cov/penalty": aggregate(apply_weights(x.weights, penalty_tok), x.mask, agg, norm_len=norm_len),
        "loss/policy": loss,
        "loss/all_masked": all_masked_flag(x.mask),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
