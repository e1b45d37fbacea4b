"""Group-relative advantages (GRPO, Dr.GRPO, batch scaling) and the ``adv/`` metrics every baseline reports.

GRPO (DeepSeekMath, arXiv 2402.03300, §4.1.2, outcome supervision) [exact]: each of the G responses to a prompt
is credited with its reward relative to the group,

    A_i = (R_i − mean_{j∈g(i)} R_j) / (std_{j∈g(i)} R_j + ε).

Frameworks differ only in the normalizer, so it is explicit here (``scale``, ``unbiased``, ``eps``):

==========  ============================================  =================================================
``scale``   divisor                                       used by
==========  ============================================  =================================================
``group``   std of the group's rewards + ε                GRPO; verl (unbiased, ε = 1e-6), TRL ``"group"``
                                                          (unbiased, ε = 1e-4)
``batch``   std of every reward in the batch + ε          TRL ``scale_rewards="batch"`` (std of the raw rewards
                                                          of the whole gathered batch, centred per group)
``none``    1 (no division)                               Dr.GRPO (arXiv 2503.20783): the std normalizer
                                                          re-weights prompts by their difficulty, so drop it
==========  ============================================  =================================================

Two conventions that frameworks differ on are options of :func:`grpo_advantages`: ``batch_std="centered"`` takes the
batch std of the group-centred rewards R_i − mean_g R instead of the raw rewards (AReaL 1.0.4 ``NormConfig``
``mean_level="group", std_level="batch"``, LitePPO's group mean with batch std, arXiv 2508.08221), and
``singleton="reward"`` gives a group of one response baseline 0 and group std 1 (verl 0.9.1, SkyRL 0.3.0), so its
advantage is R_i / (1 + ε) instead of 0.

VCPO's OPOB path uses the population std and skips the division below 1e-8 (see ``opob``). A group of one response
has std 0 (``groups.group_std`` convention), so its advantage is exactly 0 (``singleton="zero"``, the default).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from steadyrl.core.groups import group_count, group_mean, group_std
from steadyrl.core.importance_weights import check_choice
from steadyrl.core.masking import as_bool_mask, broadcast_seq, detach_metrics, masked_mean, where_masked
from steadyrl.core.types import Metrics

GrpoScale = Literal["group", "batch", "none"]
GRPO_SCALES: tuple[str, ...] = get_args(GrpoScale)
#: What ``scale="batch"`` takes the std of: the raw rewards (TRL) or the group-centred rewards (AReaL).
BatchStd = Literal["rewards", "centered"]
BATCH_STDS: tuple[str, ...] = get_args(BatchStd)
#: A group of one response: advantage 0 (``zero``) or its reward over 1 + ε (``reward``: verl's mean 0, std 1).
Singleton = Literal["zero", "reward"]
SINGLETONS: tuple[str, ...] = get_args(Singleton)

#: verl's ``norm_adv_by_std_in_grpo`` epsilon (unbiased std). Our default.
VERL_STD_EPS: float = 1e-6
#: TRL's GRPOTrainer epsilon (unbiased std).
TRL_STD_EPS: float = 1e-4
#: AReaL's ``NormConfig.eps`` default (unbiased std, ``std_unbiased=True``).
AREAL_STD_EPS: float = 1e-5
#: A group whose population reward std is below this counts as "zero std" in ``adv/zero_std_frac``.
ZERO_STD_TOL: float = 1e-8


class GroupAdvantages(NamedTuple):
    """Per-sequence advantages of a group-relative estimator.

    ==============  ======  =====================================================================
    field           shape   meaning
    ==============  ======  =====================================================================
    ``advantages``  [B]     A_i (detached)
    ``baseline``    [B]     the value subtracted from R_i (the group mean, broadcast to members)
    ``scale``       [B]     the divisor applied to R_i − baseline (std + ε, or 1 for ``none``)
    ``metrics``             ``adv/mean``, ``adv/std``, ``adv/baseline_mean``, ``adv/zero_std_frac``
    ==============  ======  =====================================================================
    """

    advantages: Float[Tensor, " B"]
    baseline: Float[Tensor, " B"]
    scale: Float[Tensor, " B"]
    metrics: Metrics


def grpo_advantages(
    *,
    rewards: Float[Tensor, " B"],
    group_ids: Int[Tensor, " B"],
    scale: GrpoScale | str = "group",
    eps: float = VERL_STD_EPS,
    unbiased: bool = True,
    batch_std: BatchStd = "rewards",
    singleton: Singleton = "zero",
) -> GroupAdvantages:
    """GRPO advantages A_i = (R_i − mean_g R) / (std R + ε), with the normalizer chosen by ``scale`` [exact].

    Paper: DeepSeekMath (arXiv 2402.03300) §4.1.2; Dr.GRPO (arXiv 2503.20783) for ``scale="none"``.

    ===============  =====  ==================================================================
    argument         shape  meaning
    ===============  =====  ==================================================================
    ``rewards``      [B]    scalar outcome reward R_i of each response
    ``group_ids``    [B]    prompt of each response, ids in [0, B) (see ``core.groups``)
    ``scale``               ``group`` | ``batch`` | ``none`` (module table)
    ``eps``                 ε added to the std (verl 1e-6, TRL 1e-4); ignored for ``none``
    ``unbiased``            std with n − 1 (verl, TRL) or n (population) in the denominator
    ``batch_std``           ``scale="batch"``: std of the raw rewards around the batch mean (TRL
                            ``scale_rewards="batch"``) or of the group-centred rewards R − mean_g
                            (``centered``: AReaL ``mean_level="group", std_level="batch"``)
    ``singleton``           a group of one: A = 0 (``zero``) or baseline 0 and group std 1, so
                            A = R/(1+ε) under ``group`` (``reward``: verl, SkyRL)
    ===============  =====  ==================================================================

    Reduction: the mean is always per group; the std is per group (``group``) or over the whole batch (``batch``).
    A divisor of exactly 0 (only with ``eps=0`` and a constant group) leaves R_i − mean unscaled instead of
    dividing 0 by 0. Returns a :class:`GroupAdvantages`; every tensor is detached.
    """
    check_choice("singleton", singleton, SINGLETONS)
    R = rewards.detach()
    safe = reward_scale(
        rewards=R, group_ids=group_ids, scale=scale, eps=eps, unbiased=unbiased, batch_std=batch_std
    )
    baseline = group_mean(R, group_ids=group_ids)  # mean_{j∈g(i)} R_j
    if singleton == "reward":  # verl / SkyRL: a group of one has mean 0 and std 1
        alone = group_count(group_ids, dtype=R.dtype) == 1
        baseline = where_masked(baseline, ~alone)
        if scale == "group":
            safe = torch.where(alone, torch.full_like(safe, 1.0 + eps), safe)
    centered = R - baseline
    advantages = centered / safe  # A_i = (R_i − mean_g R) / (std + ε)
    metrics = sequence_advantage_metrics(advantages=advantages, baseline=baseline, rewards=R, group_ids=group_ids)
    return GroupAdvantages(advantages=advantages, baseline=baseline, scale=safe, metrics=metrics)


def length_corrected_rewards(
    *, rewards: Float[Tensor, " B"], mask: Shaped[Tensor, "B T"]
) -> Float[Tensor, " B"]:
    """R_i / L_i: TIC-GRPO's length-corrected rewards, normalized by GRPO afterwards (arXiv 2508.02833).

    The paper pairs its trajectory ratio with a "length-corrected group normalization" (the ICLR 2026 reviews name
    it); its formula was not available here. Our reading [reconstructed], from a public re-implementation: the
    reward is divided by the response's length *before* the group mean and std, A_i = (R_i/L_i − mean_g R/L) /
    (std_g R/L + ε). L_i = number of masked-in tokens (a row with none counts as length 1). Detached.
    """
    return rewards.detach() / as_bool_mask(mask).sum(dim=-1).clamp(min=1).to(rewards.dtype)


def reward_scale(
    *,
    rewards: Float[Tensor, " B"],
    group_ids: Int[Tensor, " B"],
    scale: GrpoScale | str = "group",
    eps: float = VERL_STD_EPS,
    unbiased: bool = True,
    batch_std: BatchStd = "rewards",
) -> Float[Tensor, " B"]:
    """GRPO's divisor of R_i − baseline for each response (module table), detached.

    ``group``: std_{g(i)} R + ε; ``batch``: std of all B rewards + ε (``batch_std="centered"``: of the B group-centred
    rewards R_i − mean_{g(i)} R, whose batch mean is 0; AReaL); ``none``: 1. A divisor of exactly 0 (only
    with ``eps=0`` and a constant scope) is replaced by 1, so the centred reward is left unscaled instead of dividing
    0 by 0. Shared by every estimator that normalizes like GRPO (``grpo_advantages``, ``vaco.vaco_advantages``).
    """
    if scale not in GRPO_SCALES:
        raise ValueError(f"scale={scale!r} is not one of {', '.join(GRPO_SCALES)}")
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    check_choice("batch_std", batch_std, BATCH_STDS)
    R = rewards.detach()
    if scale == "none":
        return torch.ones_like(R)  # Dr.GRPO: no std division
    scope = group_ids if scale == "group" else torch.zeros_like(group_ids)  # "batch": one scope for all
    if scale == "batch" and batch_std == "centered":
        R = R - group_mean(R, group_ids=group_ids)  # AReaL: the batch std of R − mean_g R
    divisor = group_std(R, group_ids=scope, unbiased=unbiased) + eps  # std + ε
    return torch.where(divisor > 0, divisor, torch.ones_like(divisor))


def token_advantages(*, advantages: Float[Tensor, " B"], mask: Shaped[Tensor, "B T"]) -> Float[Tensor, "B T"]:
    """Broadcast per-sequence advantages A_i to every token of the sequence, 0 at masked-out positions.

    ``advantages`` [B], ``mask`` [B, T] (bool or 0/1) → [B, T] with A_{i,t} = m_{i,t} · A_i (selected with
    ``torch.where``, so a non-finite A_i never reaches a masked-out token).
    """
    m = as_bool_mask(mask)
    return where_masked(broadcast_seq(advantages, m), m)  # ``like`` only lends its shape: a view, no copy


def sequence_advantage_metrics(
    *,
    advantages: Float[Tensor, " B"],
    baseline: Float[Tensor, " B"],
    rewards: Float[Tensor, " B"],
    group_ids: Int[Tensor, " B"],
) -> Metrics:
    """``adv/`` metrics of a per-sequence estimator (detached 0-d tensors, no host sync).

    ``adv/mean`` and ``adv/std`` (population) of A over the batch; ``adv/baseline_mean``: mean of the baseline
    over the batch; ``adv/zero_std_frac``: fraction of *groups* whose rewards have population std below
    :data:`ZERO_STD_TOL` (those groups carry no group-relative signal). A group counts once whatever its size:
    Σ_i [σ_g(i) ≈ 0] / |g(i)| over Σ_i 1 / |g(i)|.
    """
    sigma = group_std(rewards, group_ids=group_ids, unbiased=False)
    per_member = 1.0 / group_count(group_ids, dtype=rewards.dtype)  # each group sums to 1
    zero_frac = where_masked(per_member, sigma < ZERO_STD_TOL).sum() / per_member.sum()
    return detach_metrics(
        {
            "adv/mean": advantages.mean(),
            "adv/std": advantages.std(correction=0),
            "adv/baseline_mean": baseline.mean(),
            "adv/zero_std_frac": zero_frac,
        }
    )


def token_advantage_metrics(
    *,
    advantages: Float[Tensor, "B T"],
    baseline: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
) -> Metrics:
    """``adv/`` metrics of a per-token estimator over masked-in tokens (0 when nothing is masked in).

    ``adv/mean``, ``adv/std`` (population) of A_{i,t}, and ``adv/baseline_mean`` (the subtracted baseline or
    value, B*_t or V_t), each a mean over the masked-in tokens of the batch.
    """
    m = as_bool_mask(mask)
    mean = masked_mean(advantages, m)
    var = masked_mean((advantages - mean) ** 2, m)
    return detach_metrics(
        {"adv/mean": mean, "adv/std": var.sqrt(), "adv/baseline_mean": masked_mean(baseline, m)}
    )
