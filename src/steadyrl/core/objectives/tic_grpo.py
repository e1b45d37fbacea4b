"""TIC-GRPO: GRPO with one clipped trajectory-level importance ratio per response (arXiv 2508.02833).

Paper: Pang, Luo, Jin, "TIC-GRPO: Provable and Efficient Optimization for Reinforcement Learning from Human
Feedback" (v1/v2: "On the Theory and Practice of GRPO: A Trajectory-Corrected Approach with Fast Convergence").
How it differs from GRPO (docs/algorithms.md, ``tic_grpo``, with the sources of each point):

1. The token ratios are replaced by one trajectory ratio w_i = π_θ(y_i|x)/π_old(y_i|x) = exp(Σ_t log r_t), with
   gradient, where π_old is the policy that *sampled* y_i (the abstract: GRPO "estimates the policy gradient at the
   old policy rather than the current one"; the trajectory ratio corrects that). Here π_old = μ, ``behav_logp``.
2. The clip acts on w_i, not on tokens, and only from above at 1 + ε ("upper-only clipping", ICLR 2026 reviews).
3. The objective averages over responses, (1/G) Σ_i, with one advantage A_i per response; the paper pairs it with a
   length-corrected group normalization of the advantage (``advantages.grpo.length_corrected_rewards``).
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
    behav_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, " B"] | None = None,
    clip_eps: float = PPO_CLIP_EPS,
    upper_only: bool = True,
) -> LossOutput:
    """Trajectory-ratio clipped GRPO loss (TIC-GRPO, arXiv 2508.02833).

    With S_i = Σ_t m_{i,t} (log π_θ − log μ) (with gradient) and w_i = exp(clamp(S_i, ±20))::

        loss = −(1/B') Σ_i v_i · min(w_i A_i, min(w_i, 1 + ε) A_i)                     (``upper_only=True``, default)
        loss = −(1/B') Σ_i v_i · min(w_i A_i, clip(w_i, 1 − ε, 1 + ε) A_i)            (two-sided)

    B' is the number of sequences with at least one masked-in token (= B when no row is empty; empty rows carry no
    trainable token and are left out, as ``masking.aggregate`` does). v_i is an optional detached per-sequence
    weight (``weights``, default 1). ε = 0.2 is ours (the paper's value is not known here). Sources and confidence:
    the ratio against the sampling policy and its product form (abstract; a reviewer on its variance "growing
    exponentially with length") and the upper-only clip (reviews) are the paper's; the PPO-style min form, ε, the
    mean over responses and the ±20 clamp of S_i (zero gradient beyond it) are reconstructed.

    =================  ======  ===============================================
    argument           shape   meaning
    =================  ======  ===============================================
    ``logp``           [B, T]  log π_θ (carries the gradient)
    ``behav_logp``     [B, T]  log π_old, the sampling policy μ (detached here); pass log π_prox for the ratio to
                               the proximal policy instead (``ratio_to="proximal"`` of the spec)
    ``advantages``     [B]     A_i, one per response
    ``mask``           [B, T]  tokens trained on
    ``weights``        [B]     optional detached per-sequence weight v_i
    =================  ======  ===============================================

    The reduction is a mean over responses; there is no ``agg`` argument.
    Metrics: ``loss/policy``, ``loss/clip_frac`` (fraction of non-empty sequences on the clipped branch),
    ``loss/ratio_mean`` / ``loss/ratio_max`` (of w_i over non-empty sequences), ``loss/all_masked``.
    """
    m = as_bool_mask(mask)
    nonempty = any_true(m, dim=-1)
    log_ratio = where_masked(logp, m) - where_masked(behav_logp.detach(), m)  # log π_θ − log μ per token
    traj_ratio = safe_exp(seq_log_ratio(log_ratio, m))  # w_i = exp(Σ_t log r_t), with gradient
    adv = where_masked(advantages.detach(), nonempty)
    seq_w = torch.ones_like(adv) if weights is None else where_masked(weights.detach(), nonempty, fill=1.0)
    upper = 1.0 + as_scalar(clip_eps, like=traj_ratio)
    lower = torch.full_like(upper, -torch.inf) if upper_only else 1.0 - as_scalar(clip_eps, like=traj_ratio)
    surrogate = clipped_surrogate(ratio=traj_ratio, advantages=adv, lower=lower, upper=upper)  # −min(wA, clip·A)
    seq_loss, seq_mask = (seq_w * surrogate.loss).unsqueeze(-1), nonempty.unsqueeze(-1)  # [B, 1]
    loss = aggregate(seq_loss, seq_mask, "token-mean")  # (1/B') Σ_i over non-empty sequences
    metrics: Metrics = ratio_metrics(traj_ratio.unsqueeze(-1), seq_mask)
    metrics |= {
        "loss/clip_frac": mask_frac(surrogate.clipped.unsqueeze(-1), seq_mask),
        "loss/policy": loss,
        "loss/all_masked": all_masked_flag(m),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
