"""REINFORCE++ advantages (Hu et al., arXiv 2501.03262, §3) as verl 0.9.1 computes them.

``reinforce_pp`` (verl ``reinforce_plus_plus``): the discounted return-to-go of the token rewards, whitened over
every trained token of the batch (the global batch mean is the baseline)::

    G_t = Σ_{k≥t, m_k} γ^{c_k − c_t} r_k        (c_t: trained tokens up to t; untrained positions are skipped)
    A_t = (G_t − mean_m G) / sqrt(var_m G + 1e-8)

``reinforce_pp_baseline`` (verl ``reinforce_plus_plus_baseline``, the paper's group-baseline variant): the sequence
return minus its group's mean reward (0 for a group of one), broadcast to the tokens, then whitened the same way::

    A_t = whiten_m(R_i − mean_{j∈g(i)} R_j)

``var_m`` is the unbiased variance over the masked-in tokens (verl ``masked_whiten``); with fewer than two trained
tokens the variance is 0 and the advantages are the centred values (0 for one token), where verl raises.
Everything is detached; advantages are 0 off the mask.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from steadyrl.core.advantages.grpo import token_advantage_metrics, token_advantages
from steadyrl.core.groups import group_count, group_mean
from steadyrl.core.masking import as_bool_mask, masked_mean, where_masked
from steadyrl.core.types import Metrics

#: Added to the variance before the square root (verl ``masked_whiten``).
WHITEN_EPS: float = 1e-8


class TokenAdvantages(NamedTuple):
    """Per-token advantages [B, T] (detached, 0 off the mask), the returns they whiten, and ``adv/`` metrics."""

    advantages: Float[Tensor, "B T"]
    returns: Float[Tensor, "B T"]
    metrics: Metrics


def masked_whiten(x: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"]) -> Float[Tensor, "B T"]:
    """(x − mean_m x) / sqrt(var_m x + 1e-8) over the masked-in entries, unbiased variance, 0 off the mask."""
    m = as_bool_mask(mask)
    mean = masked_mean(x, m)
    n = torch.count_nonzero(m).to(x.dtype)
    centered = where_masked(x - mean, m)
    var = centered.square().sum() / (n - 1).clamp(min=1)  # Σ(x − x̄)²/(n − 1) = masked var · n/(n − 1)
    return where_masked(centered * torch.rsqrt(var + WHITEN_EPS), m)


def discounted_returns(
    token_rewards: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"], *, gamma: float = 1.0
) -> Float[Tensor, "B T"]:
    """G_t = r_t + γ·G_{t+1} over the trained tokens; untrained positions neither add their reward nor discount.

    γ = 1 is a reversed cumulative sum; γ < 1 runs the recursion over the T columns (no host sync).
    """
    m = as_bool_mask(mask)
    r = where_masked(token_rewards.detach(), m)
    if gamma == 1.0:
        return where_masked(r.flip(-1).cumsum(-1).flip(-1), m)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return where_masked(out, m)


def reinforce_pp_advantages(
    *, token_rewards: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"], gamma: float = 1.0
) -> TokenAdvantages:
    """REINFORCE++ (arXiv 2501.03262; verl 0.9.1 ``compute_reinforce_plus_plus_outcome_advantage``) [reference-code].

    ``token_rewards`` [B, T] (an outcome reward sits on the last trained token; a KL-in-reward penalty on every
    token), ``mask`` [B, T], ``gamma`` the discount (verl ``algorithm.gamma``). A = masked_whiten(G).
    """
    returns = discounted_returns(token_rewards, mask, gamma=gamma)
    adv = masked_whiten(returns, mask)
    return TokenAdvantages(adv, returns, token_advantage_metrics(advantages=adv, baseline=returns - adv, mask=mask))


def reinforce_pp_baseline_advantages(
    *, rewards: Float[Tensor, " B"], group_ids: Int[Tensor, " B"], mask: Shaped[Tensor, "B T"]
) -> TokenAdvantages:
    """REINFORCE++-baseline (arXiv 2501.03262; verl 0.9.1 ``compute_reinforce_plus_plus_baseline_outcome_advantage``)
    [reference-code]: A = masked_whiten(R_i − mean_{g(i)} R), a group of one keeping R_i (verl's mean 0).

    ``rewards`` [B] sequence returns, ``group_ids`` [B], ``mask`` [B, T].
    """
    R = rewards.detach()
    alone = group_count(group_ids, dtype=R.dtype) == 1
    baseline = where_masked(group_mean(R, group_ids=group_ids), ~alone)
    centered = token_advantages(advantages=R - baseline, mask=mask)
    adv = masked_whiten(centered, mask)
    metrics = token_advantage_metrics(advantages=adv, baseline=token_advantages(advantages=baseline, mask=mask),
                                      mask=mask)  # fmt: skip
    return TokenAdvantages(adv, centered, metrics)
