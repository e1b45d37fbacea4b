"""DRO: the policy part of Direct Reward Optimization, a REINFORCE term plus a quadratic log-ratio penalty.

DRO (Richemond et al., "Offline Regularised Reinforcement Learning for Large Language Models Alignment", arXiv
2405.19107, Eq. 6) regresses τ·log(π/π_ref) onto r − V; the gradient of its policy term with respect to log π is
that of −(r − V)·log π + ½τ·(log π/π_ref)². verl 0.9.1 (``policy_loss.loss_mode="dro"``,
``compute_policy_loss_dro``) ships that policy term with the advantage in place of r − V and the proximal policy in
place of π_ref, and steadyrl computes the same thing::

    log r_t = log π_θ(y_t) − log π_prox(y_t)
    L_t     = w_t · ( −A_t · log π_θ(y_t) + ½β · (log r_t)² )
    ∇L_t    = w_t · ( −A_t + β · log r_t ) · ∇log π_θ(y_t)

At π_θ = π_prox the penalty and its gradient vanish: the gradient is REINFORCE's −A·∇log π_θ, the same as PPO's
at the first update. The log-ratio is not clamped (a clamp would zero the penalty's pull past it); (log r)² stays
finite for any finite log-ratio. The loss *value* carries log π_θ itself, as verl's does. The correction weight w
multiplies both terms, as verl's ``rollout_is_weights`` do.
"""

from __future__ import annotations

from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.masking import AggMode, aggregate, all_masked_flag, detach_metrics, masked_mean, where_masked
from steadyrl.core.objectives.ppo import apply_weights, prepare_token_inputs
from steadyrl.core.types import LossOutput, Metrics

#: β of ½β(log r)²: verl has no default (``policy_loss.dro_beta`` must be set); 0.1 is steadyrl's choice.
DRO_BETA: float = 0.1


def dro_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    beta: float = DRO_BETA,
    agg: AggMode | str = "token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """DRO's policy loss (arXiv 2405.19107, Eq. 6; verl 0.9.1 ``compute_policy_loss_dro``) [reference-code].

    Per token ``L_t = w_t·(−A_t·log π_θ + ½β·(log π_θ − log π_prox)²)``, reduced with
    ``masking.aggregate(L, mask, agg, norm_len=norm_len)``. Shapes: every tensor [B, T]; values at masked-out
    positions may be garbage. Metrics: ``loss/policy``, ``loss/dro_penalty`` (the masked mean of ½β(log r)²),
    ``loss/log_ratio_mean`` (verl's ``actor/ppo_kl`` is its negative), ``loss/all_masked``.
    """
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    log_pi = where_masked(logp, x.mask)  # log π_θ(y_t) with gradient, 0 off the mask
    penalty = 0.5 * beta * x.log_ratio.square()  # ½β(log r)²
    loss_tok = apply_weights(x.weights, -x.advantages * log_pi + penalty)
    loss = aggregate(loss_tok, x.mask, agg, norm_len=norm_len)
    metrics: Metrics = {
        "loss/policy": loss,
        "loss/dro_penalty": masked_mean(penalty, x.mask),
        "loss/log_ratio_mean": masked_mean(x.log_ratio, x.mask),
        "loss/all_masked": all_masked_flag(x.mask),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
