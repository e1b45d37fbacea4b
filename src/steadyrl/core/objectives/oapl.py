"""OAPL: a squared-error policy objective with no importance ratio (arXiv 2602.19362) [reference-code].

How it differs from GRPO (docs/algorithms.md, ``oapl``):

1. The baseline is a soft maximum of the group's rewards, V̂*(x) = β1 · log((1/G) Σ_i exp(R_i/β1)), not their mean.
2. The policy is regressed, not ratio-weighted: β2 · log(π_θ(y)/μ(y)) is fitted to the advantage R − V̂*(x) by
   least squares, so no importance weight appears and stale data from a fixed μ is used directly.
3. Defaults β1 = 1, β2 = 1e-3; the authors hold μ fixed for 50 learner steps before refreshing it (a runtime
   choice, not part of the loss); lags of 400+ steps were reported stable.
"""

from __future__ import annotations

from jaxtyping import Float, Int, Shaped
from torch import Tensor

from steadyrl.core.groups import group_count, group_logsumexp
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
from steadyrl.core.objectives.ppo import ratio_metrics
from steadyrl.core.types import LossOutput, Metrics

#: Temperature β1 of the soft-max value V̂* (authors' default).
OAPL_BETA1: float = 1.0
#: Scale β2 of the sequence log-ratio regressed onto the advantage (authors' default).
OAPL_BETA2: float = 1e-3


def oapl_value(
    *,
    rewards: Float[Tensor, " B"],
    group_ids: Int[Tensor, " B"],
    beta1: float = OAPL_BETA1,
) -> Float[Tensor, " B"]:
    """OAPL's optimal-value estimate V̂*(x) = β1 · log((1/G) Σ_{j∈g} exp(R_j/β1)) (arXiv 2602.19362).

    [reference-code] Computed as β1 · (LSE_{j∈g}(R_j/β1) − log G) with ``groups.group_logsumexp``, so it is exact
    for any β1 > 0: V̂* → max_g R as β1 → 0 and → mean_g R as β1 → ∞. Every member of a group counts (a reward
    exists whether or not its tokens are trained on). ``rewards`` [B] (detached here), ``group_ids`` [B]; returns
    V̂* [B], broadcast to the members of each group.
    """
    if beta1 <= 0.0:
        raise ValueError(f"OAPL beta1 must be > 0; got {beta1}")
    R = rewards.detach()
    log_G = group_count(group_ids, dtype=R.dtype).log()
    return beta1 * (group_logsumexp(R / beta1, group_ids=group_ids) - log_G)  # β1 · log((1/G) Σ exp(R/β1))


def oapl_loss(
    *,
    logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    rewards: Float[Tensor, " B"],
    group_ids: Int[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    beta1: float = OAPL_BETA1,
    beta2: float = OAPL_BETA2,
) -> LossOutput:
    """OAPL loss (arXiv 2602.19362) [reference-code, two independent implementations agree].

    With Â*_i = R_i − V̂*(x_i) (``oapl_value``, detached) and the sequence log-ratio to the behavior policy::

        loss = (1/B') Σ_i (β2 · Σ_t m_{i,t} (log π_θ − log μ) − Â*_i)²

    B' counts sequences with at least one masked-in token (empty rows have no trainable token and are left out,
    so a fully masked batch gives exactly 0). No ratio is exponentiated, so no clamp is needed; the gradient is
    2 β2 (β2 Σ_t m ℓ − Â*_i) on every token of response i.

    =================  ======  =============================================
    argument           shape   meaning
    =================  ======  =============================================
    ``logp``           [B, T]  log π_θ (carries the gradient)
    ``behav_logp``     [B, T]  log μ, the behavior policy (detached here)
    ``rewards``        [B]     R_i
    ``group_ids``      [B]     prompt group of each response, ids in [0, B)
    ``mask``           [B, T]  tokens trained on
    =================  ======  =============================================

    The paper fixes the reduction (mean over responses). Metrics: ``loss/policy``, ``loss/ratio_mean`` /
    ``loss/ratio_max`` (token ratio π_θ/μ), ``loss/all_masked``, ``oapl/value_mean`` (mean V̂*),
    ``oapl/adv_mean`` (mean Â*), ``oapl/seq_log_ratio_mean`` (mean Σ_t m (log π_θ − log μ) over non-empty rows).
    """
    m = as_bool_mask(mask)
    nonempty = any_true(m, dim=-1)
    log_ratio = where_masked(logp, m) - where_masked(behav_logp.detach(), m)  # log π_θ − log μ per token
    seq_lr = seq_log_ratio(log_ratio, m)  # Σ_t m (log π_θ − log μ)
    value = oapl_value(rewards=rewards, group_ids=group_ids, beta1=beta1)  # V̂*(x)
    adv = rewards.detach() - value  # Â* = R − V̂*(x)
    residual = beta2 * seq_lr - where_masked(adv, nonempty)  # β2 Σ_t m ℓ − Â*
    seq_mask = nonempty.unsqueeze(-1)
    loss = aggregate((residual**2).unsqueeze(-1), seq_mask, "token-mean")  # (1/B') Σ_i residual²
    metrics: Metrics = ratio_metrics(safe_exp(log_ratio.detach()), m)
    metrics |= {
        "loss/policy": loss,
        "loss/all_masked": all_masked_flag(m),
        "oapl/value_mean": value.mean(),
        "oapl/adv_mean": adv.mean(),
        "oapl/seq_log_ratio_mean": aggregate(seq_lr.detach().unsqueeze(-1), seq_mask, "token-mean"),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
