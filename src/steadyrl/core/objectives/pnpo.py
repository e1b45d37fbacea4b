"""PNPO, prefix-normalized policy optimization (arXiv 2608.01418) [reconstructed in its gate constants].

Paper: Zhang et al., "Reusing Rollouts under Policy Lag: Prefix-Normalized Policy Optimization for LLM Reinforcement
Learning". How it differs from GRPO / PPO (docs/algorithms.md, ``pnpo``, with the source of each point):

1. The token ratio is replaced by the geometric mean of the likelihood ratios along each causal prefix,
   w_t = exp((1/t) Σ_{k≤t} log π_θ(y_k)/μ(y_k)) (abstract: "the geometric mean of likelihood ratios along each
   causal prefix"), taken against the policy that sampled, with the current π_θ.
2. The same statistic decides which tokens train: a token whose w_t leaves a band that widens at early positions by
   h(t, L_i) = sqrt(L_i/t) is hard-rejected, not clipped to the edge ("used both as the weight and as the acceptance
   statistic").
3. The surrogate is detached, sg[M·w·A]·log π_θ, so there is no PPO clip and no gradient through the prefix; per
   response 1/L_i, then the mean over responses (``seq-mean-token-mean``).

All three come from second-hand notes on the paper (its text was not available here); the base band δ and the form
|log w_t| ≤ δ·h are our choice.
"""

from __future__ import annotations

from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.importance_weights import prefix_log_ratio
from steadyrl.core.masking import (
    AggMode,
    aggregate,
    all_masked_flag,
    as_bool_mask,
    detach_metrics,
    lengths,
    masked_mean,
    safe_exp,
    where_masked,
)
from steadyrl.core.objectives.ppo import mask_frac, ratio_metrics
from steadyrl.core.types import LossOutput, Metrics

#: Base half-width δ of the acceptance band on log w_t at the last position (h = 1): |log w_L| ≤ 0.2, i.e. the
#: response's geometric-mean ratio in [e^{−0.2}, e^{0.2}] ≈ [0.82, 1.22], PPO's ε in log space. OURS: the paper's
#: band is not known here.
PNPO_DELTA: float = 0.2


def pnpo_loss(
    *,
    logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    delta: float | None = PNPO_DELTA,
    agg: AggMode | str = "seq-mean-token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """PNPO's detached prefix-normalized surrogate with hard rejection (arXiv 2608.01418).

    With ℓ_k = log π_θ(y_k) − log μ(y_k) (detached: the current policy's value), n_t = Σ_{k≤t} m_k and
    L_i = Σ_t m_{i,t}::

        log w_t = (1/n_t) Σ_{k≤t} m_k ℓ_k,        w_t = exp(clamp(log w_t, ±20))
        M_t     = [ |log w_t| ≤ δ · sqrt(L_i / n_t) ]            (``delta=None``: no gate, M = 1)
        loss    = agg(−sg[M_t v_t w_t A_t] · log π_θ(y_t), m)    v_t: optional detached correction weights

    The gradient per token is −M v w A ∇log π_θ. Rejected tokens stay in the denominator (the paper's 1/L_i runs
    over the response), so a batch whose tokens are all rejected gives a zero loss and gradient. Like GMC-GRPO's,
    the loss value is written on log π_θ: compare gradients, not values, with ratio surrogates.

    =================  ======  ===============================================
    argument           shape   meaning
    =================  ======  ===============================================
    ``logp``           [B, T]  log π_θ (carries the gradient)
    ``behav_logp``     [B, T]  log μ, the sampling policy (detached here)
    ``advantages``     [B, T]  A_t (sequence advantages broadcast)
    ``mask``           [B, T]  tokens trained on
    ``weights``        [B, T]  optional detached weights v_t of composed corrections
    =================  ======  ===============================================

    Metrics: ``loss/policy``, ``loss/ratio_mean`` / ``loss/ratio_max`` (of w_t over trained tokens),
    ``pnpo/rejected_frac`` (gated-out / trained tokens), ``pnpo/weight_mean`` (mean M·w over trained tokens),
    ``loss/all_masked``.
    """
    m = as_bool_mask(mask)
    prefix = prefix_log_ratio(log_ratio=logp.detach() - behav_logp.detach(), mask=m)
    w = where_masked(safe_exp(prefix.log_w), m)  # w_t = exp((1/n_t) Σ_{k≤t} ℓ_k)
    if delta is None:
        kept = m
    else:
        h = (lengths(m).to(prefix.n.dtype).unsqueeze(-1) / prefix.n).sqrt()  # h(t, L_i) = sqrt(L_i / n_t)
        kept = m & (prefix.log_w.abs() <= delta * h)  # hard rejection outside the widened band
    coef = where_masked(w, kept) * where_masked(advantages.detach(), m)  # sg[M w A]
    if weights is not None:
        coef = coef * where_masked(weights.detach(), m)
    logp_in = where_masked(logp, m)
    loss = aggregate(-coef * logp_in, m, agg, norm_len=norm_len)  # agg(−sg[M w A] log π_θ)
    metrics: Metrics = ratio_metrics(w, m)
    metrics |= {
        "loss/policy": loss,
        "pnpo/rejected_frac": mask_frac(m & ~kept, m),
        "pnpo/weight_mean": masked_mean(where_masked(w, kept), m),
        "loss/all_masked": all_masked_flag(m),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
