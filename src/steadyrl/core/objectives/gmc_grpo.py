"""GMC-GRPO, group-mass capping (arXiv 2610.01896) [reconstructed].

How it differs from trajectory clipping (TIC-GRPO, ``tic_grpo``) (docs/algorithms.md, ``gmc_grpo``):

1. The trajectory weight corrects behavior → proximal, ρ_i = π_prox(y_i)/μ(y_i) = exp(S_i), and is detached.
2. Instead of clipping each ρ_i, the whole group is rescaled when its mean ratio exceeds 1 + ε: relative weights
   inside the group are kept, so the bias vanishes as the group size G grows (the paper's claim), whereas a
   trajectory clip's bias does not.
3. The policy term is REINFORCE-style on log π_θ with ``seq-mean-token-mean``, as in GRPO.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from steadyrl.core.groups import group_logsumexp, group_sum
from steadyrl.core.masking import (
    AggMode,
    aggregate,
    all_masked_flag,
    any_true,
    as_bool_mask,
    broadcast_seq,
    detach_metrics,
    safe_exp,
    seq_log_ratio,
    where_masked,
)
from steadyrl.core.objectives.ppo import ratio_metrics
from steadyrl.core.types import LossOutput, Metrics

#: ε of the group cap 1 + ε. Our default: the paper's value is unknown (sweep it).
GMC_EPS: float = 0.2

GmcCap = Literal["mass", "rms"]
GMC_CAPS: tuple[str, ...] = get_args(GmcCap)


class GMCWeights(NamedTuple):
    """Group-mass-capped trajectory weights (all detached, shape [B]).

    ==================  ====================================================================================
    field               meaning
    ==================  ====================================================================================
    ``weights``         w_i (0 for a sequence with no masked-in token)
    ``log_weights``     log w_i (−inf for an empty sequence)
    ``capped``          True where the group's cap factor is < 1
    ``group_mass``      the group's mean ratio (1/G) Σ_{j∈g} ρ_j, before capping, broadcast to its members
    ``metrics``         ``gmc/capped_frac``, ``gmc/group_mass_mean``, ``gmc/weight_mean``, ``gmc/weight_max``
    ==================  ====================================================================================
    """

    weights: Float[Tensor, " B"]
    log_weights: Float[Tensor, " B"]
    capped: Bool[Tensor, " B"]
    group_mass: Float[Tensor, " B"]
    metrics: Metrics


def _seq_mean(x: Float[Tensor, " B"], keep: Bool[Tensor, " B"]) -> Float[Tensor, ""]:
    """Mean of x over ``keep`` (0 when empty)."""
    return where_masked(x, keep).sum() / keep.sum().clamp(min=1).to(x.dtype)


def gmc_weights(
    *,
    prox_logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    group_ids: Int[Tensor, " B"],
    eps: float = GMC_EPS,
    cap: GmcCap | str = "mass",
) -> GMCWeights:
    """GMC-GRPO trajectory weights: ρ_i rescaled so the group's ratio mass stays within 1 + ε [reconstructed].

    With S_i = Σ_t m_{i,t} (log π_prox − log μ), ρ_i = exp(S_i) and G_g the number of non-empty sequences of
    group g, computed in log space with ``groups.group_logsumexp`` (exact for any magnitude of S)::

        cap="mass" (default):  w_i = ρ_i · min(1, G_g (1 + ε) / Σ_{j∈g} ρ_j)
                               log w_i = S_i + min(0, log(1 + ε) − (LSE_{j∈g} S_j − log G_g))
        cap="rms":             w_i = ρ_i · min(1, (1 + ε) / sqrt((1/G_g) Σ_{j∈g} ρ_j²))
                               log w_i = S_i + min(0, log(1 + ε) − ½ (LSE_{j∈g} 2S_j − log G_g))

    w_i = exp(clamp(log w_i, ±20)); since w_i ≤ G_g (1 + ε) (mass) or (1 + ε)·sqrt(G_g) (rms), the clamp only
    matters for weights below e^{−20}. Sequences with no masked-in token are left out of the group sums and get
    w = 0. Reconstructed pieces (named options): the cap form (``cap``) and ε (the paper's value is unknown).

    Shapes: ``prox_logp``, ``behav_logp``, ``mask`` [B, T]; ``group_ids`` [B] (ids in [0, B)). Returns
    ``GMCWeights``.
    """
    if cap not in GMC_CAPS:
        raise ValueError(f"GMC cap {cap!r} is not one of {', '.join(GMC_CAPS)}")
    m = as_bool_mask(mask)
    nonempty = any_true(m, dim=-1)
    ell = where_masked(prox_logp.detach(), m) - where_masked(behav_logp.detach(), m)  # ℓ = log π_prox − log μ
    S = torch.where(nonempty, seq_log_ratio(ell, m), -torch.inf)  # S_i; −inf drops empty rows from group sums
    log_G = group_sum(nonempty.to(S.dtype), group_ids=group_ids).clamp(min=1).log()  # log G_g
    log_cap = torch.log1p(torch.full_like(log_G, eps))  # log(1 + ε)
    log_mass = group_logsumexp(S, group_ids=group_ids) - log_G  # log((1/G) Σ_j ρ_j)
    if cap == "mass":
        log_factor = torch.clamp(log_cap - log_mass, max=0.0)  # log min(1, G(1+ε) / Σ_j ρ_j)
    else:
        log_rms = 0.5 * (group_logsumexp(2.0 * S, group_ids=group_ids) - log_G)  # log sqrt((1/G) Σ_j ρ_j²)
        log_factor = torch.clamp(log_cap - log_rms, max=0.0)  # log min(1, (1+ε) / rms_g)
    log_w = S + log_factor  # log w_i = S_i + log(cap factor)
    w = where_masked(safe_exp(log_w), nonempty)
    capped = nonempty & (log_factor < 0)
    group_mass = where_masked(safe_exp(log_mass), nonempty)
    metrics: Metrics = {
        "gmc/capped_frac": _seq_mean(capped.to(w.dtype), nonempty),
        "gmc/group_mass_mean": _seq_mean(group_mass, nonempty),
        "gmc/weight_mean": _seq_mean(w, nonempty),
        "gmc/weight_max": w.amax(),
    }
    return GMCWeights(
        weights=w, log_weights=log_w, capped=capped, group_mass=group_mass, metrics=detach_metrics(metrics)
    )


def gmc_grpo_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    group_ids: Int[Tensor, " B"],
    eps: float = GMC_EPS,
    cap: GmcCap | str = "mass",
    agg: AggMode | str = "seq-mean-token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """GMC-GRPO loss (arXiv 2610.01896) [reconstructed]: group-mass-capped weights on a REINFORCE term.

    With w_i from ``gmc_weights`` (detached)::

        loss = −(1/B') Σ_i w_i A_i (1/L_i) Σ_t m_{i,t} log π_θ(y_{i,t})          (``seq-mean-token-mean``)

    B' counts non-empty sequences. With every ratio 1 (π_prox = μ), w_i = 1 and this is GRPO's REINFORCE gradient.
    The loss is written on log π_θ, so its value is not comparable with ratio surrogates; its gradient is.
    ``agg`` defaults to the paper's ``seq-mean-token-mean``; any ``masking.aggregate`` mode may be passed.

    =================  ======  ===================================================
    argument           shape   meaning
    =================  ======  ===================================================
    ``logp``           [B, T]  log π_θ (carries the gradient)
    ``prox_logp``      [B, T]  log π_prox (detached here)
    ``behav_logp``     [B, T]  log μ, the behavior policy (detached here)
    ``advantages``     [B]     A_i, one per response
    ``mask``           [B, T]  tokens trained on
    ``group_ids``      [B]     prompt group of each response, ids in [0, B)
    =================  ======  ===================================================

    Metrics: ``loss/policy``, ``loss/ratio_mean`` / ``loss/ratio_max`` (token ratio π_θ/π_prox, a drift
    diagnostic), ``loss/all_masked``, and ``gmc/capped_frac``, ``gmc/group_mass_mean``, ``gmc/weight_mean``,
    ``gmc/weight_max`` from ``gmc_weights``.
    """
    m = as_bool_mask(mask)
    nonempty = any_true(m, dim=-1)
    gw = gmc_weights(prox_logp=prox_logp, behav_logp=behav_logp, mask=m, group_ids=group_ids, eps=eps, cap=cap)
    logp_in = where_masked(logp, m)
    coef = gw.weights * where_masked(advantages.detach(), nonempty)  # w_i A_i (detached)
    loss_tok = -broadcast_seq(coef, like=logp_in) * logp_in  # −w_i A_i log π_θ(y_{i,t})
    loss = aggregate(loss_tok, m, agg, norm_len=norm_len)
    drift = safe_exp(logp_in.detach() - where_masked(prox_logp.detach(), m))  # π_θ / π_prox, diagnostic only
    metrics: Metrics = ratio_metrics(drift, m)
    metrics |= gw.metrics
    metrics |= {"loss/policy": loss, "loss/all_masked": all_masked_flag(m)}
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))

