"""GMPO: Geometric-Mean Policy Optimization (Zhao et al., arXiv 2507.20673).

GRPO maximizes the arithmetic mean over a response's tokens of the clipped surrogates r_t·A; GMPO maximizes their
geometric mean, which an outlier ratio moves far less. With one advantage A_i per response the paper's objective,
(Π_t |min(r_t A_i, clip(r_t, e^{−ε_low}, e^{ε_high}) A_i)|)^{1/|o_i|} · sgn(A_i), is A_i times the geometric mean of
the token ratios, each clipped PPO-style (one-sided, on the side A_i pushes) *in log space* and before the mean::

    ℓ_t   = log π_θ(y_t) − log π_prox(y_t)
    ℓ̃_t   = min(ℓ_t, clip(ℓ_t, −ε_low, ε_high))   if A_i > 0
            max(ℓ_t, clip(ℓ_t, −ε_low, ε_high))   otherwise
    s_i   = exp(clamp((1/L_i) Σ_t m_{i,t} ℓ̃_t, ±20))                 with gradient
    L_i   = −w̄_i · A_i · s_i

ε_low = ε_high = 0.4 (ratios in (e^{−0.4}, e^{0.4}) ≈ (0.67, 1.49)): the authors' scripts (``CLIPRANGE=0.4``, github
callsys/GMPO) and TRL's ``GMPOConfig`` (paper §4). verl 0.9.1 ships it as ``loss_mode="geo_mean"`` (its
``clip_ratio_low``/``clip_ratio_high`` are ε_low/ε_high in log space); TRL 1.16.0 as ``trl.experimental.gmpo``.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    AggMode,
    EmptyRows,
    aggregate,
    all_masked_flag,
    any_true,
    as_bool_mask,
    broadcast_seq,
    detach_metrics,
    geo_log_ratio,
    masked_mean,
    safe_exp,
    where_masked,
)
from steadyrl.core.objectives.ppo import mask_frac, ratio_metrics
from steadyrl.core.types import LossOutput, Metrics

#: GMPO's log-space clip range: ratios in (e^{−0.4}, e^{0.4}) (authors' scripts ``CLIPRANGE=0.4``; TRL ``GMPOConfig``).
GMPO_CLIP_LOW: float = 0.4
GMPO_CLIP_HIGH: float = 0.4


def gmpo_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    clip_low: float = GMPO_CLIP_LOW,
    clip_high: float = GMPO_CLIP_HIGH,
    agg: AggMode | str = "seq-mean-token-mean",
    norm_len: float | None = None,
    empty_rows: EmptyRows = "skip",
) -> LossOutput:
    """GMPO loss (arXiv 2507.20673, the GMPO objective) [reference-code: verl ``geo_mean``, TRL ``GMPOTrainer``].

    One advantage A_i per response (``advantages`` [B]; token advantages are averaged per row by the caller, as verl
    does). With ℓ̃ the sign-aware log-space clip of the module docstring, s_i = exp(clamp(mean_t ℓ̃_t, ±20)) (with
    gradient) and w̄_i = exp(mean_t log w_{i,t}) the geometric mean of the detached correction weights over the row
    (verl's reduction of ``rollout_is_weights``; 1 without weights)::

        L_i = −w̄_i · A_i · s_i,     ∂L_i/∂log π_θ(y_{i,t}) = −w̄_i · A_i · s_i / L_i   where the clip is inactive

    L_i is broadcast to the row's tokens and reduced by ``masking.aggregate`` (``seq-mean-token-mean`` by default:
    (1/|N|) Σ_i L_i, the paper's (1/G) Σ_i). ``empty_rows="count"`` divides by all B rows instead (verl
    ``geo_mean``'s ``torch.mean`` and TRL ``GMPOTrainer``'s ``.mean()`` over rows). A clip range may be 0 (that side
    clipped at ratio 1) or ``math.inf`` (no clip on that side).

    Metrics: ``loss/policy``, ``loss/clip_frac`` (fraction of trained tokens where the clip is active: ℓ_t > ε_high
    with A_i > 0 or ℓ_t < −ε_low with A_i < 0, so their gradient is zero; TRL's ``clip_ratio/region_mean``),
    ``loss/ratio_mean``/``loss/ratio_max`` (of s_i over non-empty rows), ``loss/all_masked``.
    """
    m = as_bool_mask(mask)
    nonempty = any_true(m, dim=-1)
    log_ratio = where_masked(logp - prox_logp.detach(), m)  # ℓ = log π_θ − log π_prox, 0 off the mask
    adv = where_masked(advantages.detach(), nonempty)
    adv_tok = broadcast_seq(adv, like=log_ratio)
    clamped = log_ratio.clamp(min=-clip_low, max=clip_high)
    up = adv_tok > 0
    clipped_lr = torch.where(up, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped))  # ℓ̃
    seq_ratio = safe_exp(geo_log_ratio(clipped_lr, m))  # s_i = exp(mean_t ℓ̃_t), with gradient
    seq_loss = -adv * seq_ratio  # −A_i · s_i
    if weights is not None:
        log_w = torch.log(where_masked(weights.detach(), m, fill=1.0))
        seq_loss = torch.exp(masked_mean(log_w, m, dim=-1)) * seq_loss  # w̄_i: geometric mean of w over the row
    loss = aggregate(broadcast_seq(seq_loss, like=log_ratio), m, agg, norm_len=norm_len, empty_rows=empty_rows)
    active = (up & (log_ratio > clip_high)) | ((adv_tok < 0) & (log_ratio < -clip_low))
    metrics: Metrics = ratio_metrics(seq_ratio.unsqueeze(-1), nonempty.unsqueeze(-1))
    metrics |= {
        "loss/clip_frac": mask_frac(active, m),
        "loss/policy": loss,
        "loss/all_masked": all_masked_flag(m),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
