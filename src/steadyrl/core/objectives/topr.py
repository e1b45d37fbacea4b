"""TOPR: Tapered Off-Policy REINFORCE (Le Roux, Bellemare et al., arXiv 2503.14286).

TOPR is REINFORCE on trajectories y sampled by a behavior policy μ, asymmetric in the sign of the (baselined)
return. The paper's gradient::

    ∇J = Σ_{y: A(y) ≥ 0} μ(y) A(y) ∇log π(y)  +  Σ_{y: A(y) < 0} μ(y) [π(y)/μ(y)]_0^1 A(y) ∇log π(y)

Positive trajectories get the plain supervised (REINFORCE) gradient, no importance weight, so learning from them is
fast even when π has moved away from μ; negative ones get the *sequence* ratio π(y)/μ(y) truncated to [0, 1], which
tapers their push-down to zero as π(y) → 0 (no collapse onto −∞ log-probs) and leaves it untruncated-REINFORCE when
π(y) ≥ μ(y). The ratio is a weight: it carries no gradient. Here μ is ``behav_logp`` (the sampler; the paper's
fully off-policy setting), π = π_θ, and log π(y) = Σ_t log π_θ(y_t)::

    α_i  = 1                                     if A_i ≥ 0
           min(1, exp(clamp(S_i, ±20)))          if A_i < 0,    S_i = Σ_t m_{i,t} (log π_θ − log μ)   (detached)
    L_{i,t} = −w_{i,t} · α_i · A_i · u_{i,t},     u = π_θ(y_t)/sg(π_θ(y_t)) = 1 in value   (``value="unit"``)
                                                 u = log π_θ(y_t)                          (``value="logp"``)

Both give the paper's gradient −w·α·A·∇log π_θ. The default value is steadyrl's REINFORCE convention (−w·α·A, like
``ppo.reinforce_loss`` at the first update): it does not carry the absolute log-probs, whose float32 rounding in a
framework's forward would otherwise be summed over the tokens; ``"logp"`` is the paper's surrogate −α·A·log π(y).
No framework installed here (verl 0.9.1, TRL 1.16.0, AReaL 1.0.4, SkyRL 0.3.0, OpenRLHF 0.11.2) ships TOPR.
"""

from __future__ import annotations

from typing import Literal

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
    detach_metrics,
    masked_mean,
    safe_exp,
    seq_log_ratio,
    where_masked,
)
from steadyrl.core.objectives.ppo import apply_weights, mask_frac
from steadyrl.core.types import LossOutput, Metrics


def topr_loss(
    *,
    logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    agg: AggMode | str = "seq-mean-token-sum",
    norm_len: float | None = None,
    value: Literal["unit", "logp"] = "unit",
) -> LossOutput:
    """TOPR loss (arXiv 2503.14286, the TOPR gradient) [reconstructed in its reduction and advantage; see below].

    ``advantages`` [B]: one A_i per trajectory (the paper's R(y) − c; callers average token advantages per row).
    With α_i the truncated, detached sequence ratio of the module docstring and w the detached correction weight::

        L_{i,t} = −w_{i,t} · α_i · A_i · u_{i,t},     ∇ = −w · α_i · A_i · ∇log π_θ(y_{i,t})

    with u = 1 in value (``value="unit"``, default) or u = log π_θ(y_{i,t}) (``value="logp"``, the paper's J).

    Reduction: ``masking.aggregate`` (default ``seq-mean-token-sum``: the mean over trajectories of A·log π(y) with
    log π(y) = Σ_t log π_θ(y_t), the paper's per-trajectory objective). At μ = π_θ every α is 1: plain REINFORCE.

    =================  ======  ===============================================
    ``logp``           [B, T]  log π_θ (carries the gradient)
    ``behav_logp``     [B, T]  log μ, the behavior policy that sampled y (detached)
    ``advantages``     [B]     A_i
    ``mask``           [B, T]  tokens trained on
    ``weights``        [B, T]  detached correction weight w (default 1)
    =================  ======  ===============================================

    Metrics: ``loss/policy``, ``loss/neg_frac`` (fraction of non-empty rows with A < 0), ``loss/neg_weight_mean``
    (mean α over those rows; 0 when none), ``loss/tapered_frac`` (fraction of trained tokens in a row with A < 0 and
    π_θ(y) < μ(y), whose weight is below 1), ``loss/all_masked``.
    """
    m = as_bool_mask(mask)
    nonempty = any_true(m, dim=-1)
    adv = where_masked(advantages.detach(), nonempty)
    log_ratio = where_masked(logp.detach() - behav_logp.detach(), m)  # log π_θ − log μ per token, no gradient
    seq_lr = seq_log_ratio(log_ratio, m)  # S_i = log π_θ(y)/μ(y)
    neg = adv < 0
    alpha = torch.where(neg, safe_exp(seq_lr.clamp(max=0.0)), torch.ones_like(seq_lr))  # [π(y)/μ(y)]_0^1 on A < 0
    if value not in ("unit", "logp"):
        raise ValueError(f"value must be 'unit' or 'logp'; got {value!r}")
    log_pi = where_masked(logp, m)  # log π_θ(y_t) with gradient, 0 off the mask
    u = log_pi if value == "logp" else torch.exp(log_pi - log_pi.detach())  # 1 in value, ∇u = ∇log π_θ
    coef = broadcast_seq(-alpha * adv, like=log_pi)  # −α_i · A_i
    w = None if weights is None else where_masked(weights.detach(), m, fill=1.0)
    loss = aggregate(apply_weights(w, coef) * u, m, agg, norm_len=norm_len)
    neg_rows = neg & nonempty
    tapered = (neg_rows & (seq_lr < 0)).unsqueeze(-1) & m  # tokens of rows whose weight is below 1
    dtype = torch.get_default_dtype()
    metrics: Metrics = {
        "loss/neg_frac": torch.count_nonzero(neg_rows).to(dtype) / torch.count_nonzero(nonempty).clamp(min=1).to(dtype),
        "loss/neg_weight_mean": masked_mean(alpha.unsqueeze(-1), neg_rows.unsqueeze(-1)),  # [B, 1]: rows as tokens
        "loss/tapered_frac": mask_frac(tapered, m),
        "loss/policy": loss,
        "loss/all_masked": all_masked_flag(m),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
