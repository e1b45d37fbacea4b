"""OPOB: VCPO's off-policy optimal baseline (arXiv 2602.17616) [exact in paper; reference code differs].

The variance-minimizing constant baseline for the importance-weighted REINFORCE estimator
ĝ = Σ_i w_i (R_i − b) ∇ log π(y_i) weighs each reward by the squared norm of its own gradient term:

    b_g = Σ_{i∈g} W_i R_i / (Σ_{i∈g} W_i + ε),   W_i = w_i² ‖∇_θ log π_θ(y_i)‖²,   ε = 1e-8,
    Â_i = (R_i − b_g) / σ_g,   σ_g the population std of the group's rewards (no division when σ_g < 1e-8).

Options, each from the authors' code (``mit-han-lab/vcpo``, ``grad_baselining``):

- ``weighting="authors_code"``: their ‖∇‖ is measured on the TIS-weighted loss of one trajectory, so the weight
  works out to W_i = w̄_i² w_i² ‖∇‖², w̄_i = min(w_i, C_tis) (≈ w⁴). ``"paper"`` (default) is W_i = w_i² ‖∇‖².
- ``clip=C``: w_i → min(w_i, C) in W (their ``use_clipped_is_ratios``).
- ``length_normalize``: W_i / L_i² (their ``normalize_by_length``).
- ``scope="minibatch"``: one baseline over the whole minibatch, computed from the GRPO advantages
  A_i = (R_i − mean_g R)/(σ_g + ε) instead of the rewards; then Â_i = A_i − b (no further division).
- ``aggregation``: ``mean`` (the formula), W-weighted ``median``, or W-weighted ``winsorized`` mean (values clamped
  to the W-weighted 5% and 95% quantiles, then the weighted mean with the same ε).
- ``normalize_std=False``: Â_i = R_i − b_g (their ``norm_by_std`` is off by default; the paper divides).

Numerics: w_i = exp(S_i) is never materialized. log W_i = 2 S_i + log ‖∇‖² (+ 2 log w̄_i − 2 log L_i), formed in
float64, is normalized within each scope with a logsumexp, p_i = W_i / Σ W, and the ε term is applied exactly as
Σ W / (Σ W + ε) = sigmoid(log Σ W − log ε), so S = ±1000 gives finite results (a scope whose weights all underflow
in linear space gets b = 0, as the formula does). Quantiles are vectorized: one stable sort by value, then one by
scope, then a per-scope cumulative sum of p (float64), with no loop over groups and no host sync.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from steadyrl.core.advantages.grpo import grpo_advantages, sequence_advantage_metrics
from steadyrl.core.groups import group_count, group_logsumexp, group_std, group_sum
from steadyrl.core.types import Metrics

OpobWeighting = Literal["paper", "authors_code"]
OpobScope = Literal["group", "minibatch"]
OpobAggregation = Literal["mean", "median", "winsorized"]
OPOB_WEIGHTINGS: tuple[str, ...] = get_args(OpobWeighting)
OPOB_SCOPES: tuple[str, ...] = get_args(OpobScope)
OPOB_AGGREGATIONS: tuple[str, ...] = get_args(OpobAggregation)

#: ε of b_g's denominator, of the GRPO advantages in minibatch scope, and the σ_g below which division is skipped.
OPOB_EPS: float = 1e-8
#: Sequence TIS cap of the VCPO runs (C = 8): the w̄ of ``weighting="authors_code"``.
VCPO_TIS_CAP: float = 8.0
#: Weighted quantiles of the winsorized mean (5% and 95%, as in the authors' code).
WINSOR_LOW: float = 0.05
WINSOR_HIGH: float = 0.95
MEDIAN_Q: float = 0.5
#: A cumulative weight within this of a quantile's cut counts as reaching it, so an exact tie in real arithmetic
#: (two equal weights and the median) takes the lower value whatever the rounding of the normalized weights.
QUANTILE_TIE_TOL: float = 1e-9


class OpobAdvantages(NamedTuple):
    """Result of :func:`opob_advantages` (all detached).

    ==============  =====  ========================================================================
    field           shape  meaning
    ==============  =====  ========================================================================
    ``advantages``  [B]    Â_i
    ``baseline``    [B]    b of the member's scope (group, or the whole minibatch)
    ``weights``     [B]    p_i = W_i / Σ_{scope} W: normalized baseline weights (0 in a scope whose
                           weights are all 0)
    ``metrics``            ``adv/mean``, ``adv/std``, ``adv/baseline_mean``, ``adv/zero_std_frac``,
                           ``adv/opob_ess_frac`` (mean over scopes of (1/Σp²)/|scope|)
    ==============  =====  ========================================================================
    """

    advantages: Float[Tensor, " B"]
    baseline: Float[Tensor, " B"]
    weights: Float[Tensor, " B"]
    metrics: Metrics


def opob_advantages(
    *,
    rewards: Float[Tensor, " B"],
    group_ids: Int[Tensor, " B"],
    log_weights: Float[Tensor, " B"],
    grad_sq_norms: Float[Tensor, " B"],
    weighting: OpobWeighting | str = "paper",
    scope: OpobScope | str = "group",
    aggregation: OpobAggregation | str = "mean",
    length_normalize: bool = False,
    lengths: Shaped[Tensor, " B"] | None = None,
    clip: float | None = None,
    tis_cap: float = VCPO_TIS_CAP,
    normalize_std: bool = True,
    eps: float = OPOB_EPS,
) -> OpobAdvantages:
    """Off-policy optimal baseline and advantages (VCPO, arXiv 2602.17616, OPOB) [exact; options reference-code].

    b_g = Σ_{i∈g} W_i R_i / (Σ_{i∈g} W_i + ε), W_i = w_i² ‖∇ log π(y_i)‖²; Â_i = (R_i − b_g)/σ_g (module docstring
    for every option).

    =================  =====  =============================================================================
    argument           shape  meaning
    =================  =====  =============================================================================
    ``rewards``        [B]    outcome reward R_i
    ``group_ids``      [B]    prompt of each response, ids in [0, B)
    ``log_weights``    [B]    S_i = Σ_t m ℓ: sequence log importance ratio log(π_old/μ) (detached here)
    ``grad_sq_norms``  [B]    ‖∇_θ log π_θ(y_i)‖² ≥ 0, one per trajectory (detached here; 0 allowed)
    ``weighting``             ``paper`` (w²) | ``authors_code`` (w̄² w², w̄ = min(w, ``tis_cap``))
    ``scope``                 ``group`` | ``minibatch`` (one baseline over the batch, on GRPO advantages)
    ``aggregation``           ``mean`` | ``median`` | ``winsorized`` (W-weighted, 5–95%)
    ``length_normalize``      divide W_i by L_i² (needs ``lengths``; L_i < 1 is treated as 1)
    ``lengths``        [B]    L_i, number of response tokens (``masking.lengths``)
    ``clip``                  C: use min(w, C) for w in W (None: unclipped)
    ``tis_cap``               C_tis of ``authors_code`` (VCPO: 8)
    ``normalize_std``         divide R_i − b_g by σ_g (group scope only)
    ``eps``                   ε of b's denominator and the σ_g skip threshold (1e-8)
    =================  =====  =============================================================================

    Reduction: per group (or once over the minibatch); the median of a scope with all-zero weights is 0. Returns
    :class:`OpobAdvantages`.
    """
    _check_options(weighting, scope, aggregation, clip, tis_cap, eps)
    if length_normalize and lengths is None:
        raise ValueError("length_normalize=True needs lengths (the L_i of each response)")
    R = rewards.detach()
    # log W in float64: |log W| reaches 2|S| (thousands), where float32 keeps only ~1e-4 of absolute precision.
    S = log_weights.detach().to(torch.float64)
    log_w = S if clip is None else S.clamp(max=math.log(clip))  # log min(w, C)
    log_W = 2.0 * log_w + torch.log(grad_sq_norms.detach().to(torch.float64))  # log W_i = log w_i² ‖∇‖²
    if weighting == "authors_code":
        log_W = log_W + 2.0 * S.clamp(max=math.log(tis_cap))  # · w̄_i², w̄_i = min(w_i, C_tis)
    if length_normalize and lengths is not None:
        log_W = log_W - 2.0 * torch.log(lengths.detach().to(torch.float64).clamp(min=1.0))  # / L_i²

    if scope == "group":
        values, scope_ids = R, group_ids
    else:  # minibatch: one baseline over every response, on the GRPO advantages (population std + ε)
        values = grpo_advantages(rewards=R, group_ids=group_ids, scale="group", eps=eps, unbiased=False).advantages
        scope_ids = torch.zeros_like(group_ids)
    p, shrink = (x.to(R.dtype) for x in _normalized_weights(log_W, scope_ids, eps))
    baseline = _weighted_location(values, p, shrink, scope_ids, aggregation)
    centered = values - baseline  # R_i − b_g (or A_i − b)
    if scope == "group" and normalize_std:
        sigma = group_std(R, group_ids=group_ids, unbiased=False)  # population std σ_g
        divide = sigma >= eps
        advantages = torch.where(divide, centered / torch.where(divide, sigma, torch.ones_like(sigma)), centered)
    else:
        advantages = centered

    metrics = sequence_advantage_metrics(advantages=advantages, baseline=baseline, rewards=R, group_ids=group_ids)
    metrics["adv/opob_ess_frac"] = _mean_ess_frac(p, scope_ids).detach()
    return OpobAdvantages(advantages=advantages, baseline=baseline, weights=p, metrics=metrics)


def _check_options(
    weighting: str, scope: str, aggregation: str, clip: float | None, tis_cap: float, eps: float
) -> None:
    for name, value, allowed in (
        ("weighting", weighting, OPOB_WEIGHTINGS),
        ("scope", scope, OPOB_SCOPES),
        ("aggregation", aggregation, OPOB_AGGREGATIONS),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip={clip} must be > 0 (or None for unclipped weights)")
    if not tis_cap > 0:
        raise ValueError(f"tis_cap={tis_cap} must be > 0")
    if not eps > 0:
        raise ValueError(f"eps={eps} must be > 0")


def _normalized_weights(
    log_W: Float[Tensor, " B"], scope_ids: Int[Tensor, " B"], eps: float
) -> tuple[Float[Tensor, " B"], Float[Tensor, " B"]]:
    """p_i = W_i / Σ_scope W (0 where the scope's weights are all 0) and the factor Σ W / (Σ W + ε)."""
    lse = group_logsumexp(log_W, group_ids=scope_ids)  # log Σ_{j∈scope} W_j
    has_weight = torch.isfinite(lse)
    p = torch.where(has_weight, torch.exp(log_W - torch.where(has_weight, lse, torch.zeros_like(lse))), 0.0)
    shrink = torch.sigmoid(lse - math.log(eps))  # Σ W / (Σ W + ε), exact in log space
    return p, shrink


def _weighted_location(
    values: Float[Tensor, " B"],
    p: Float[Tensor, " B"],
    shrink: Float[Tensor, " B"],
    scope_ids: Int[Tensor, " B"],
    aggregation: str,
) -> Float[Tensor, " B"]:
    """b of each member's scope: Σ W v / (Σ W + ε), the W-weighted median, or the W-weighted winsorized mean."""
    if aggregation == "mean":
        return group_sum(p * values, group_ids=scope_ids) * shrink  # Σ W R / (Σ W + ε)
    if aggregation == "median":
        return _weighted_quantile(values, p, scope_ids, MEDIAN_Q)
    low = _weighted_quantile(values, p, scope_ids, WINSOR_LOW)
    high = _weighted_quantile(values, p, scope_ids, WINSOR_HIGH)
    clamped = torch.minimum(torch.maximum(values, low), high)  # winsorize to the 5–95% weighted quantiles
    return group_sum(p * clamped, group_ids=scope_ids) * shrink


def _weighted_quantile(
    values: Float[Tensor, " B"], p: Float[Tensor, " B"], scope_ids: Int[Tensor, " B"], q: float
) -> Float[Tensor, " B"]:
    """Lower W-weighted q-quantile of each scope: the smallest v_k with Σ_{j: v_j ≤ v_k} p_j ≥ q · Σ p.

    Sorted by (scope, value) with two stable sorts; the within-scope cumulative weight is the global cumulative
    sum minus the scope's starting offset, in float64 so offsets of many scopes do not swamp a scope's weights.
    A scope with no weight has no such value and gets 0.
    """
    B = values.shape[0]
    by_value = torch.sort(values, stable=True).indices
    order = by_value[torch.sort(scope_ids[by_value], stable=True).indices]
    v_s, g_s = values[order], scope_ids[order]
    p_s = p[order].to(torch.float64)
    cum = torch.cumsum(p_s, dim=0)
    start = torch.full((B,), torch.inf, dtype=torch.float64, device=values.device).scatter_reduce(
        0, g_s, cum - p_s, reduce="amin", include_self=True
    )  # Σ of p over earlier scopes (p ≥ 0, so the first member's exclusive sum is the scope's minimum)
    within = cum - start[g_s]
    total = group_sum(p_s, group_ids=g_s)
    reached = (within >= q * total - QUANTILE_TIE_TOL) & (total > 0)
    inf = torch.full_like(v_s, torch.inf)
    first = inf.new_full((B,), torch.inf).scatter_reduce(
        0, g_s, torch.where(reached, v_s, inf), reduce="amin", include_self=True
    )[scope_ids]  # values ascend within a scope, so the smallest reached value is the first one
    return torch.where(torch.isfinite(first), first, torch.zeros_like(first))


def _mean_ess_frac(p: Float[Tensor, " B"], scope_ids: Int[Tensor, " B"]) -> Float[Tensor, ""]:
    """Mean over scopes of ESS/|scope| = 1 / (|scope| Σ p²) (0 for a scope without weight)."""
    count = group_count(scope_ids, dtype=p.dtype)
    sum_p2 = group_sum(p * p, group_ids=scope_ids)
    ess_frac = torch.where(sum_p2 > 0, 1.0 / (count * torch.where(sum_p2 > 0, sum_p2, torch.ones_like(sum_p2))), 0.0)
    per_member = 1.0 / count
    return (ess_frac * per_member).sum() / per_member.sum()

