"""TIC-GRPO: GRPO with one clipped trajectory-level ratio per response (arXiv 2508.02833).

How it differs from GRPO (ALGORITHMS.md, "TIC-GRPO"):

1. The token ratios π_θ/π_old are replaced by one trajectory ratio w'_i = π_θ(y_i)/π_old(y_i) = exp(Σ_t log r_t),
   with gradient (so every token of response i is scaled by the same w'_i).
2. The PPO clip acts on w'_i, not on tokens; the option ``upper_only`` clips only at 1 + ε (the GMC-GRPO paper,
   arXiv 2610.01896, calls 1 + ε "the ratio threshold" of TIC-GRPO).
3. The objective averages over responses, (1/G) Σ_i, with one advantage A_i per response.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    aggregate,
    all_masked_flag,
    any_true,
    as_bool_mask,
    detach_metrics,
    safe_exp,
    seq_log_ratio,
    where_masked,
)
from steadyrl.core.objectives.ppo import PPO_CLIP_EPS, as_scalar, clipped_surrogate, mask_frac, ratio_metrics
from steadyrl.core.types import LossOutput, Metrics


def tic_grpo_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, " B"] | None = None,
    clip_eps: float = PPO_CLIP_EPS,
    upper_only: bool = False,
) -> LossOutput:
    """Trajectory-ratio clipped GRPO loss (TIC-GRPO, arXiv 2508.02833) [reconstructed detail].

    With S_i = Σ_t m_{i,t} (log π_θ − log π_prox) (with gradient) and w'_i = exp(clamp(S_i, ±20))::

        loss = −(1/B') Σ_i v_i · min(w'_i A_i, clip(w'_i, 1 − ε, 1 + ε) A_i)          (two-sided, default)
        loss = −(1/B') Σ_i v_i · min(w'_i A_i, min(w'_i, 1 + ε) A_i)                   (``upper_only=True``)

    B' is the number of sequences with at least one masked-in token (= B when no row is empty; empty rows carry no
    trainable token and are left out, as ``masking.aggregate`` does). v_i is an optional detached per-sequence
    weight (``weights``, default 1). ε = 0.2. The reconstructed pieces: whether the clip is two-sided or upper-only
    (``upper_only``), and the ±20 log-space clamp of S_i (zero gradient beyond it), which the paper does not state.

    =================  ======  ===============================================
    argument           shape   meaning
    =================  ======  ===============================================
    ``logp``           [B, T]  log π_θ (carries the gradient)
    ``prox_logp``      [B, T]  log π_prox (detached here)
    ``advantages``     [B]     A_i, one per response
    ``mask``           [B, T]  tokens trained on
    ``weights``        [B]     optional detached per-sequence weight v_i
    =================  ======  ===============================================

    The paper fixes the reduction (a mean over responses); there is no ``agg`` argument.
    Metrics: ``loss/policy``, ``loss/clip_frac`` (fraction of non-empty sequences on the clipped branch),
    ``loss/ratio_mean`` / ``loss/ratio_max`` (of w'_i over non-empty sequences), ``loss/all_masked``.
    """
    m = as_bool_mask(mask)
    nonempty = any_true(m, dim=-1)
    log_ratio = where_masked(logp, m) - where_masked(prox_logp.detach(), m)  # log π_θ − log π_prox per token
    traj_ratio = safe_exp(seq_log_ratio(log_ratio, m))  # w'_i = exp(Σ_t log r_t), with gradient
    adv = where_masked(advantages.detach(), nonempty)
    seq_w = torch.ones_like(adv) if weights is None else where_masked(weights.detach(), nonempty, fill=1.0)
    upper = 1.0 + as_scalar(clip_eps, like=traj_ratio)
    lower = torch.full_like(upper, -torch.inf) if upper_only else 1.0 - as_scalar(clip_eps, like=traj_ratio)
    surrogate = clipped_surrogate(ratio=traj_ratio, advantages=adv, lower=lower, upper=upper)  # −min(w'A, clip·A)
    seq_loss, seq_mask = (seq_w * surrogate.loss).unsqueeze(-1), nonempty.unsqueeze(-1)  # [B, 1]
    loss = aggregate(seq_loss, seq_mask, "token-mean")  # (1/B') Σ_i over non-empty sequences
    metrics: Metrics = ratio_metrics(traj_ratio.unsqueeze(-1), seq_mask)
    metrics |= {
        "loss/clip_frac": mask_frac(surrogate.clipped.unsqueeze(-1), seq_mask),
        "loss/policy": loss,
        "loss/all_masked": all_masked_flag(m),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
