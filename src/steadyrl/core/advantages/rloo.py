"""RLOO: REINFORCE with the leave-one-out baseline (Kool et al. 2019; Ahmadian et al., arXiv 2402.14740, Eq. 5).

Each of the G responses to a prompt is credited with its reward relative to the mean of the *other* G − 1::

    A_i = R_i − (1/(G−1)) Σ_{j∈g(i), j≠i} R_j  =  G/(G−1) · (R_i − mean_{j∈g(i)} R_j)

The baseline does not depend on R_i, so the estimator stays unbiased. A group of one has no other response:
``singleton="zero"`` gives it A = 0 (verl 0.9.1 ``rloo_vectorized``), ``singleton="reward"`` leaves A = R_i with no
baseline (verl 0.9.1 ``rloo``, its loop form). Everything is detached.
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from steadyrl.core.advantages.grpo import GroupAdvantages, sequence_advantage_metrics
from steadyrl.core.groups import group_count, group_sum

#: A group of one response: A = 0 (``zero``, verl's vectorized form) or A = R (``reward``, verl's loop form).
RlooSingleton = Literal["zero", "reward"]


def rloo_advantages(
    *,
    rewards: Float[Tensor, " B"],
    group_ids: Int[Tensor, " B"],
    singleton: RlooSingleton = "zero",
) -> GroupAdvantages:
    """RLOO advantages A_i = R_i − mean_{j∈g(i), j≠i} R_j (arXiv 2402.14740, Eq. 5) [exact].

    ``rewards`` [B] outcome rewards, ``group_ids`` [B] prompt ids in [0, B) (``core.groups``); ``singleton`` as in
    the module docstring. Returns :class:`~steadyrl.core.advantages.grpo.GroupAdvantages` with the leave-one-out
    baseline and scale 1; metrics ``adv/mean``, ``adv/std``, ``adv/baseline_mean``, ``adv/zero_std_frac``.
    """
    if singleton not in ("zero", "reward"):
        raise ValueError(f"singleton must be 'zero' or 'reward', got {singleton!r}")
    R = rewards.detach()
    n = group_count(group_ids, dtype=R.dtype)
    others = group_sum(R, group_ids=group_ids) - R  # Σ_{j≠i} R_j
    alone = n == 1
    loo = others / (n - 1).clamp(min=1)  # mean of the other G − 1 rewards
    baseline = torch.where(alone, R if singleton == "zero" else torch.zeros_like(R), loo)
    advantages = R - baseline
    metrics = sequence_advantage_metrics(advantages=advantages, baseline=baseline, rewards=R, group_ids=group_ids)
    return GroupAdvantages(advantages=advantages, baseline=baseline, scale=torch.ones_like(R), metrics=metrics)
