"""CISPO: clipped importance-sampling-weight policy optimization (MiniMax-M1, arXiv 2506.13585, Eq. 4).

PPO clips the *token update*: once r_t leaves [1 − ε, 1 + ε] on the side its advantage pushes, the token's gradient is
zero. CISPO clips the *importance weight* instead and detaches it, so every token keeps a gradient::

    r_t  = exp(clamp(log π_θ − log π_prox, ±20))
    r̂_t  = sg(clip(r_t, 1 − ε_low, 1 + ε_high))
    L_t  = −w_t · r̂_t · A_t · log π_θ(y_t),        ∇L_t = −w_t · r̂_t · A_t · ∇log π_θ(y_t)

The paper (§3.1) sets no lower bound in practice ("setting ε_low^IS to a large value") and tunes ε_high only; it
gives no value for ε_high. The default ratio cap 1 + ε_high = 5 is TRL's recommended ``epsilon_high=5.0`` (its ε_max,
after ScaleRL, arXiv 2510.13786). The loss *value* is the paper's, −r̂·A·log π_θ, as verl 0.9.1, TRL 1.16.0 and
SkyRL 0.3.0 all compute it (it is not −A at the first update, unlike ``ppo.reinforce_loss``).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.masking import AggMode, aggregate, all_masked_flag, detach_metrics, safe_exp, where_masked
from steadyrl.core.objectives.ppo import apply_weights, mask_frac, prepare_token_inputs, ratio_metrics
from steadyrl.core.types import LossOutput, Metrics

#: ε_high: ratio cap 1 + ε_high = 5, TRL's recommended ``epsilon_high`` (ε_max = 5) for ``loss_type="cispo"``; the
#: paper tunes ε_high without reporting it.
CISPO_CLIP_HIGH: float = 4.0


def cispo_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    clip_low: float | None = None,
    clip_high: float | None = CISPO_CLIP_HIGH,
    agg: AggMode | str = "token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """CISPO loss (MiniMax-M1, arXiv 2506.13585, Eq. 4) [reference-code: the equation is the paper's, ε_high is TRL's].

    Per token, with r = exp(clamp(log π_θ − log π_prox, ±20)) and w the detached correction weight::

        L_t = −w_t · sg(clip(r_t, 1 − ε_low, 1 + ε_high)) · A_t · log π_θ(y_t)

    ``clip_low=None`` (default) is no lower bound (the paper's practice); ``clip_high=None`` no upper bound (then the
    weight is the plain ratio). verl's ``clip_ratio_low``/``clip_ratio_high`` and SkyRL's ``cispo_eps_clip_low``/
    ``cispo_eps_clip_high`` are ε_low/ε_high; TRL's ``epsilon_high`` is the cap itself (ε_high = epsilon_high − 1, no
    lower bound). Reduction: ``masking.aggregate(L, mask, agg, norm_len=norm_len)``; the paper normalizes by the
    batch's token count (1/Σ_i |o_i|), i.e. ``token-mean``, the default.

    Shapes: every tensor [B, T] (see ``ppo``'s module table); values at masked-out positions may be garbage.
    Metrics: ``loss/policy``, ``loss/clip_frac`` (fraction of trained tokens whose ratio lies outside
    [1 − ε_low, 1 + ε_high], i.e. whose weight is clipped; verl's ``pg_clipfrac`` and SkyRL's ``clip_ratio``),
    ``loss/ratio_mean``, ``loss/ratio_max``, ``loss/all_masked``.
    """
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    ratio = safe_exp(x.log_ratio.detach())  # r = π_θ / π_prox (a weight: no gradient)
    lower = None if clip_low is None else 1.0 - clip_low
    upper = None if clip_high is None else 1.0 + clip_high
    no_clip = lower is None and upper is None
    clipped = ratio if no_clip else torch.clamp(ratio, min=lower, max=upper)  # r̂ = sg(clip(r, 1 − ε_low, 1 + ε_high))
    outside = torch.zeros_like(x.mask)
    if lower is not None:
        outside = outside | (ratio < lower)
    if upper is not None:
        outside = outside | (ratio > upper)
    log_pi = where_masked(logp, x.mask)  # log π_θ(y_t) with gradient, 0 off the mask
    loss_tok = apply_weights(x.weights, -x.advantages * clipped) * log_pi  # −w · r̂ · A · log π_θ
    loss = aggregate(loss_tok, x.mask, agg, norm_len=norm_len)
    metrics: Metrics = {"loss/clip_frac": mask_frac(outside, x.mask)}
    metrics |= ratio_metrics(ratio, x.mask)
    metrics |= {"loss/policy": loss, "loss/all_masked": all_masked_flag(x.mask)}
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
