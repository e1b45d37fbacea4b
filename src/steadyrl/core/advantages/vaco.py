"""VACO's advantage re-alignment: a one-step V-trace target per group (arXiv 2603.01365, "Align and Filter").

VACO (arXiv 2603.01365) [reconstructed: only the abstract and summaries were available] re-aligns the advantages
once per optimization phase with a V-trace target (IMPALA, arXiv 1802.01561, Eq. (1)) truncated at ρ̄, and filters
updates that would push the total variation further (``steadyrl.core.objectives.filters.vaco_filter``). For an
outcome reward the whole response is one action, so V-trace reduces to its one-step form, per group g::

    b_g   = (1/G) Σ_{i∈g} R_i                                   value of the prompt under the behavior policy μ
    ℓ̄_i   = (1/L_i) Σ_t m_{i,t} ℓ_{i,t}        ratio="geometric" (default; the filter's default level)
          = Σ_t m_{i,t} ℓ_{i,t}                ratio="product"
          ℓ_{i,t} = log π_prox − log μ of the sampled token (detached)
    ρ_i   = exp(clamp(ℓ̄_i, ±20))
    v_g   = b_g + (1/G) Σ_{i∈g} min(ρ̄, ρ_i) (R_i − b_g)          one-step V-trace target, ρ̄ = 1
    A_i   = (R_i − v_g) / (std_g R + ε)                           divisor as GRPO's (``scale``: group | batch | none)

π_prox is the policy at the start of the optimization phase (the learner recomputes ``prox_logp`` once, before the
first optimizer step), so the re-alignment happens once per phase: every optimizer step of the phase sees the same
ρ_i and therefore the same advantages.

Reconstructed pieces, each a named option: the sequence ratio (geometric mean or product of the token ratios), the
truncation ρ̄, and the GRPO-style divisor. Conventions of this code: the target is computed as
v_g = b_g + (1/G) Σ (min(ρ̄, ρ_i) − 1)(R_i − b_g), equal to the formula above because Σ_{i∈g} (R_i − b_g) = 0, so that
with every ratio 1 (on-policy) and ρ̄ ≥ 1, v_g = b_g bit for bit and A_i is exactly GRPO's. A response with no trained
token has ℓ̄_i = 0 (ρ_i = 1); its reward still counts in b_g and v_g, as in GRPO.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

from jaxtyping import Float, Int, Shaped
from torch import Tensor

from steadyrl.core.advantages.grpo import VERL_STD_EPS, GrpoScale, reward_scale, sequence_advantage_metrics
from steadyrl.core.groups import group_mean
from steadyrl.core.masking import (
    any_true,
    as_bool_mask,
    detach_metrics,
    geo_log_ratio,
    masked_mean,
    safe_exp,
    seq_log_ratio,
)
from steadyrl.core.types import Metrics

#: V-trace truncation ρ̄ of the re-alignment (IMPALA's default; the VACO abstract gives no value).
VACO_RHO_BAR: float = 1.0

VacoRatio = Literal["geometric", "product"]
VACO_RATIOS: tuple[str, ...] = get_args(VacoRatio)


class VacoAdvantages(NamedTuple):
    """Result of :func:`vaco_advantages` (every tensor detached).

    ==================  ======  ================================================================================
    field               shape   meaning
    ==================  ======  ================================================================================
    ``advantages``      [B]     A_i = (R_i − v_g) / (std + ε)
    ``value_target``    [B]     v_g, the one-step V-trace target of the response's group
    ``behavior_value``  [B]     b_g, the group's mean reward (value under μ)
    ``rho``             [B]     ρ_i = exp(clamp(ℓ̄_i, ±20)), before the truncation at ρ̄
    ``metrics``                 ``adv/mean``, ``adv/std``, ``adv/baseline_mean`` (mean v_g), ``adv/zero_std_frac``,
                                ``adv/behavior_value_mean`` (mean b_g), ``adv/realign_shift`` (mean |v_g − b_g|),
                                ``adv/rho_clipped_frac`` (non-empty responses with ρ_i > ρ̄)
    ==================  ======  ================================================================================
    """

    advantages: Float[Tensor, " B"]
    value_target: Float[Tensor, " B"]
    behavior_value: Float[Tensor, " B"]
    rho: Float[Tensor, " B"]
    metrics: Metrics


def vaco_advantages(
    *,
    rewards: Float[Tensor, " B"],
    group_ids: Int[Tensor, " B"],
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    rho_bar: float = VACO_RHO_BAR,
    ratio: VacoRatio | str = "geometric",
    scale: GrpoScale | str = "group",
    eps: float = VERL_STD_EPS,
    unbiased: bool = True,
) -> VacoAdvantages:
    """VACO advantages re-aligned with a one-step V-trace target per group (arXiv 2603.01365) [reconstructed].

    ===============  ======  =========================================================================
    argument         shape   meaning
    ===============  ======  =========================================================================
    ``rewards``      [B]     scalar outcome reward R_i
    ``group_ids``    [B]     prompt of each response, ids in [0, B) (``core.groups``)
    ``log_ratio``    [B, T]  ℓ = log π_prox − log μ per token (detached here; masked-out values ignored)
    ``mask``         [B, T]  trained tokens
    ``rho_bar``              V-trace truncation ρ̄ > 0 of the sequence ratio (default 1)
    ``ratio``                ``geometric``: ℓ̄_i = mean_t ℓ (default) | ``product``: ℓ̄_i = Σ_t ℓ
    ``scale``                divisor as GRPO's: ``group`` | ``batch`` | ``none`` (``grpo.reward_scale``)
    ``eps``                  ε added to the std
    ``unbiased``             n − 1 std (verl, TRL) or population std
    ===============  ======  =========================================================================

    Formula in the module docstring. Reduction: b_g and v_g are means over the group's members; the divisor is
    per group or per batch (``scale``). With every ρ_i = 1 and ρ̄ ≥ 1 the result equals
    ``grpo.grpo_advantages`` with the same ``scale``, ``eps``, ``unbiased`` exactly.
    """
    if ratio not in VACO_RATIOS:
        raise ValueError(f"VACO ratio={ratio!r} is not one of {', '.join(VACO_RATIOS)}")
    if not rho_bar > 0:
        raise ValueError(f"VACO rho_bar={rho_bar} must be > 0")
    R = rewards.detach()
    m = as_bool_mask(mask)
    ell = log_ratio.detach()  # ℓ_{i,t}; the masked reductions below ignore masked-out values
    log_rho = geo_log_ratio(ell, m) if ratio == "geometric" else seq_log_ratio(ell, m)  # ℓ̄_i (0 for empty rows)
    rho = safe_exp(log_rho)  # ρ_i = exp(clamp(ℓ̄_i, ±20))
    truncated = rho.clamp(max=rho_bar)  # min(ρ̄, ρ_i)
    b = group_mean(R, group_ids=group_ids)  # b_g = (1/G) Σ_{i∈g} R_i
    centered = R - b  # R_i − b_g
    v = b + group_mean((truncated - 1.0) * centered, group_ids=group_ids)  # v_g = b_g + (1/G) Σ min(ρ̄,ρ_i)(R_i − b_g)
    divisor = reward_scale(rewards=R, group_ids=group_ids, scale=scale, eps=eps, unbiased=unbiased)
    advantages = (R - v) / divisor  # A_i = (R_i − v_g) / (std + ε)

    metrics = sequence_advantage_metrics(advantages=advantages, baseline=v, rewards=R, group_ids=group_ids)
    nonempty = any_true(m, dim=-1, keepdim=True)  # [B, 1]
    clipped = (rho > rho_bar).to(R.dtype).unsqueeze(-1)
    metrics |= detach_metrics(
        {
            "adv/behavior_value_mean": b.mean(),
            "adv/realign_shift": (v - b).abs().mean(),
            "adv/rho_clipped_frac": masked_mean(clipped, nonempty),
        }
    )
    return VacoAdvantages(advantages=advantages, value_target=v, behavior_value=b, rho=rho, metrics=metrics)
