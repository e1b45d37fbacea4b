"""VESPO: a gamma-shaped kernel of the sequence importance weight as a detached REINFORCE coefficient.

Variational sEquence-level Soft Policy Optimization (Shen et al., arXiv 2602.10693) [reference-code: the authors'
``recipe/vespo/code/core_algos.py`` (github.com/FloyedShen/VESPO, a verl recipe) and TRL 1.16
``GRPOTrainer.get_gamma_weights`` / ``loss_type="vespo"``]. Per sequence i, with the *product* (not the geometric
mean) of its token ratios::

    log W_i = clamp(Σ_t m_{i,t} [clamp(log π_θ − log π_den, ±20) + clamp(log w_{i,t}, [ln 1e-8, 20])], [ln 1e-8, 20])
    φ_i     = W_i^k · exp(λ (1 − W_i)) = exp(λ + k log W_i − λ W_i)          (φ(1) = 1; detached)
    L_{i,t} = −φ_i · A_i · log π_θ(y_{i,t})                                   (∇L = −φ_i A_i ∇log π_θ)

(k, λ) = (k₊, λ₊) for A_i ≥ 0 and (k₋, λ₋) for A_i < 0. π_den is the denominator of the sequence ratio: μ (the paper's
W = π_θ(τ)/μ(τ)) or π_prox (the authors' code and TRL, whose ``old_log_prob`` / ``old_per_token_logps`` is the
trainer's recomputed policy); w are the detached weights of the corrections before it, folded into W in log space as
both implementations fold their token TIS ratio π_prox/μ (``rollout_is_weights``, TRL ``importance_sampling_ratio``):
W = (π_θ/π_prox)·(π_prox/μ) = π_θ/μ, with each factor truncated as the correction truncates it.

Constants and their sources:

* k₊ = 2, λ₊ = 3, k₋ = 3, λ₋ = 2: the authors' code defaults and every one of their run scripts
  (``recipe/vespo/run/sync/vespo_N_*.sh``), TRL's ``vespo_k_pos`` … ``vespo_lambda_neg`` defaults; the paper's c1 (k)
  and c2 (λ) of §3.4. (The docstring of the authors' function lists stale values 2 / 1.5 / 4 / 2.5; its code and
  scripts use the ones here.)
* the ±20 token clamp, the [ln 1e-8, 20] clamps of log W and of each folded log weight, λ ≥ 1e-4 and a non-finite φ
  replaced by 0: TRL's code (the authors clamp log W to ±20 and take log max(W, 1e-8) for the k log W term, which
  differs from TRL's clamp only below W = 1e-8, where φ ≈ 0 anyway).
* the loss *value* −φ·A·log π_θ (not −φ·A·r): both implementations; its gradient is the method's, φ A ∇log π_θ, at
  every update of a phase (a ratio surrogate would add a factor π_θ/π_prox once π_θ moves).
* aggregation: token-mean in the authors' scripts (verl's default ``loss_agg_mode``) and in TRL (the token sum divided
  by ``num_items_in_batch``, the batch's token count); any ``masking.aggregate`` mode may be passed.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    AggMode,
    aggregate,
    all_masked_flag,
    any_true,
    as_bool_mask,
    broadcast_seq,
    clamp_log_ratio,
    detach_metrics,
    masked_mean,
    seq_log_ratio,
    where_masked,
)
from steadyrl.core.objectives.ppo import ratio_metrics
from steadyrl.core.types import LOG_RATIO_CLAMP, LossOutput, Metrics

#: Kernel exponents and decay rates (authors' code and scripts, TRL defaults; the paper's c1 / c2, §3.4).
VESPO_K_POS: float = 2.0
VESPO_LAMBDA_POS: float = 3.0
VESPO_K_NEG: float = 3.0
VESPO_LAMBDA_NEG: float = 2.0
#: Lower clamp of log W and of each folded log weight: ln 1e-8 (TRL ``lower_clamp``; the authors' ``clamp(min=1e-8)``).
LOG_W_FLOOR: float = math.log(1e-8)
#: λ is clamped to at least this (both implementations' ``clamp(min=1e-4)``).
LAMBDA_FLOOR: float = 1e-4


def vespo_log_weight(
    *,
    logp: Float[Tensor, "B T"],
    ratio_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
) -> Float[Tensor, " B"]:
    """log W_i of the module equation, detached: Σ_t of the ±20-clamped log π_θ − log π_den and of the folded
    log-weights clamped to [ln 1e-8, 20], the sum clamped to [ln 1e-8, 20]. An empty sequence gets log W = 0."""
    m = as_bool_mask(mask)
    log_r = clamp_log_ratio(where_masked(logp.detach() - ratio_logp.detach(), m))
    log_w = seq_log_ratio(log_r, m)  # Σ_t clamp(log π_θ − log π_den, ±20)
    if weights is not None:
        # log 0 = −inf (a weight a correction zeroed) clamps to ln 1e-8, as TRL's clamp(log ρ, ln 1e-8, 20) does.
        log_wt = torch.log(weights.detach()).clamp(min=LOG_W_FLOOR, max=LOG_RATIO_CLAMP)
        log_w = log_w + seq_log_ratio(where_masked(log_wt, m), m)
    return log_w.clamp(min=LOG_W_FLOOR, max=LOG_RATIO_CLAMP)


def vespo_phi(
    *,
    log_w: Float[Tensor, " B"],
    advantages: Float[Tensor, " B"],
    k_pos: float = VESPO_K_POS,
    lambda_pos: float = VESPO_LAMBDA_POS,
    k_neg: float = VESPO_K_NEG,
    lambda_neg: float = VESPO_LAMBDA_NEG,
) -> Float[Tensor, " B"]:
    """φ_i = exp(λ(1 − W) + k log W) with (k, λ) chosen by the sign of A_i (A ≥ 0: the positive pair), detached;
    λ clamped to ≥ 1e-4, and a non-finite φ (overflow of a large k log W) set to 0 as TRL and the authors do."""
    log_w = log_w.detach()
    nonneg = advantages.detach() >= 0
    k = torch.where(nonneg, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(nonneg, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg))
    lam = lam.clamp(min=LAMBDA_FLOOR)
    # log φ = λ(1 − W) + k log W, with 1 − W = −expm1(log W): no cancellation of λ against λW near W = 1 (the same
    # value as TRL's λ + k log W − λW, with a smaller rounding error in float32). log W ≤ 20: no overflow in λW.
    phi = torch.exp(-lam * torch.expm1(log_w) + k * log_w)
    return torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi))


def vespo_loss(
    *,
    logp: Float[Tensor, "B T"],
    ratio_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    k_pos: float = VESPO_K_POS,
    lambda_pos: float = VESPO_LAMBDA_POS,
    k_neg: float = VESPO_K_NEG,
    lambda_neg: float = VESPO_LAMBDA_NEG,
    agg: AggMode | str = "token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """VESPO loss (arXiv 2602.10693; module docstring for the equation and the source of each constant).

    ==============  =========  ======================================================================
    ``logp``        [B, T]     log π_θ (carries the gradient)
    ``ratio_logp``  [B, T]     log π_den, the denominator of W: log μ or log π_prox (detached here)
    ``advantages``  [B]        sequence advantages A_i (their sign picks (k, λ))
    ``mask``        [B, T]     tokens trained on
    ``weights``     [B, T]     detached correction weights, folded into W in log space (not multiplied)
    ==============  =========  ======================================================================

    Reduction: ``masking.aggregate(−φ·A·log π_θ, mask, agg, norm_len=norm_len)`` (default ``token-mean``, as the
    authors' scripts and TRL). Masked-out positions may hold garbage: every input is selected before arithmetic.

    Metrics: ``loss/policy``, ``loss/phi_mean`` / ``loss/phi_max`` (φ over non-empty sequences), ``loss/ratio_mean`` /
    ``loss/ratio_max`` (W over non-empty sequences), ``loss/all_masked``.
    """
    m = as_bool_mask(mask)
    log_w = vespo_log_weight(logp=logp, ratio_logp=ratio_logp, mask=m, weights=weights)
    phi = vespo_phi(
        log_w=log_w, advantages=advantages, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg
    )
    lp = where_masked(logp, m)  # log π_θ, 0 (and zero gradient) off the mask
    coef = broadcast_seq(where_masked(phi * advantages.detach(), any_true(m, dim=-1)), like=lp)  # φ_i A_i per token
    loss = aggregate(-coef * lp, m, agg, norm_len=norm_len)  # −φ·A·log π_θ
    nonempty = any_true(m, dim=-1, keepdim=True)  # [B, 1]: sequence statistics as a one-token "batch"
    metrics: Metrics = ratio_metrics(torch.exp(log_w).unsqueeze(-1), nonempty)
    metrics |= {
        "loss/phi_mean": masked_mean(phi.unsqueeze(-1), nonempty),
        "loss/phi_max": where_masked(phi.unsqueeze(-1), nonempty).amax(),  # φ ≥ 0: 0 when nothing is kept
        "loss/policy": loss,
        "loss/all_masked": all_masked_flag(m),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
