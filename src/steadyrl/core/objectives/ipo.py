"""prime-rl's IPO loss: a symmetric probability trust region, the ratio policy gradient and a (log r)² penalty.

prime-rl (PrimeIntellect-ai/prime-rl, ``trainer/rl/loss.py`` ``ipo_loss_fn``; not installed here, read from its
public repository, no paper) drops a token from the policy-gradient term when its sampled-token probability moved
by more than ε in either direction, whatever the sign of its advantage, and keeps a squared log-ratio penalty on
every trained token::

    log r_t = log π_θ(y_t) − log π_anc(y_t)            (π_anc: π_prox, which is μ under policy=bypass, as prime-rl)
    keep_t  = |π_θ(y_t) − π_anc(y_t)| ≤ ε
    L_t     = w_t · ( −keep_t · A_t · r_t + κ · (log r_t)² )
    loss    = agg(L, mask)                               (dropped tokens stay in the denominators, as prime-rl)

r_t = exp(clamp(log r_t, ±20)) carries the gradient; (log r)² is not clamped (finite for any finite log-ratio).
On-policy r = 1, every token is kept and the penalty's gradient is 0: the gradient is −A·∇log π_θ. Unlike DPPO's
Binary-TV mask (``dppo``), the trust region does not look at the advantage's sign.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.masking import AggMode, aggregate, all_masked_flag, detach_metrics, masked_mean, safe_exp
from steadyrl.core.objectives.ppo import apply_weights, mask_frac, prepare_token_inputs, ratio_metrics
from steadyrl.core.types import LossOutput, Metrics

#: ε of |π_θ(y) − π_anc(y)| (prime-rl's ``ipo_threshold`` / ``ipo_epsilon`` default).
IPO_EPSILON: float = 0.1
#: κ of κ·(log r)² (prime-rl's ``kl_tau`` default).
IPO_KL_COEF: float = 1e-3


def ipo_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    epsilon: float = IPO_EPSILON,
    kl_coef: float = IPO_KL_COEF,
    agg: AggMode | str = "token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """prime-rl's IPO loss [reference-code: its public ``ipo_loss_fn``, no installed package to test against].

    Per token ``L_t = w_t·(−keep_t·A_t·r_t + κ·(log r_t)²)`` with ``keep_t = |π_θ(y_t) − π_prox(y_t)| ≤ ε``
    (probabilities, detached test), reduced by ``masking.aggregate(L, mask, agg, norm_len=norm_len)``: dropped tokens
    keep their place in the denominators. Shapes: every tensor [B, T]; values off the mask may be garbage.
    Metrics: ``loss/policy``, ``loss/ipo_masked_frac`` (trained tokens outside the trust region),
    ``loss/ipo_penalty`` (masked mean of κ(log r)²), ``loss/ratio_mean``, ``loss/ratio_max``, ``loss/all_masked``.
    """
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    ratio = safe_exp(x.log_ratio)  # r = π_θ / π_anc, with gradient
    lr = x.log_ratio.detach()
    p_theta = torch.where(x.mask, logp.detach(), 0.0).clamp(max=0.0).exp()  # π_θ(y) ∈ [0, 1]
    p_anc = torch.where(x.mask, prox_logp.detach(), 0.0).clamp(max=0.0).exp()
    moved = x.mask & ((p_theta - p_anc).abs() > epsilon)
    pg = torch.where(moved, 0.0, -x.advantages * ratio)
    penalty = kl_coef * x.log_ratio.square()
    loss_tok = apply_weights(x.weights, pg + penalty)
    loss = aggregate(loss_tok, x.mask, agg, norm_len=norm_len)
    metrics: Metrics = {"loss/ipo_masked_frac": mask_frac(moved, x.mask),
                        "loss/ipo_penalty": masked_mean(kl_coef * lr.square(), x.mask)}  # fmt: skip
    metrics |= ratio_metrics(ratio.detach(), x.mask)
    metrics |= {"loss/policy": loss, "loss/all_masked": all_masked_flag(x.mask)}
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
