"""Retroactive Advantage Correction (RAC, arXiv 2606.27580; the authors' released code, its ``rac`` primitive).

A slow reward channel arrives Δ learner steps after a rollout y_i was trained on with a fast reward b_i (cached at
rollout time) and advantage A_partial. RAC corrects it retroactively::

    δ_i = α · (r_slow,i − b_i)
    c_i = exp(−Δ_i / τ_age) · min(ρ̄, π_{t+Δ}(y_i) / μ(y_i)) · δ_i        (sequence-level ratio)
    c  ← c · min(1, C / max_i |c_i|)                                    (the batch rescaled so max |c| ≤ C)
    A_total,i = A_partial,i + c_i

with α = 1, τ_age = 50, ρ̄ = 1.2, C = 5. π_{t+Δ} is the policy when the slow reward arrives, μ the behavior policy
that sampled y_i; the ratio is taken in log space (min(log ρ̄, Σ_t log π − log μ)) so it stays finite for any
log-ratio. A_partial was applied when y_i was first trained on, so the update that carries the correction uses c_i
alone (how ``steadyrl train`` does that: docs/algorithms.md).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from steadyrl.core.masking import detach_metrics
from steadyrl.core.types import Metrics

#: The authors' constants: α, τ_age, ρ̄ and the bound C on max |c|.
RAC_ALPHA: float = 1.0
RAC_TAU_AGE: float = 50.0
RAC_RHO_BAR: float = 1.2
RAC_MAX_ABS: float = 5.0


class RacOutput(NamedTuple):
    """``corrections`` [K] (detached, 0 where not ``valid``) and metrics ``rac/delta_mean``, ``rac/corr_mean``,
    ``rac/corr_abs_max``, ``rac/rescale``, ``rac/ratio_clipped_frac``."""

    corrections: Float[Tensor, " K"]
    metrics: Metrics


def rac_corrections(
    *,
    slow_rewards: Float[Tensor, " K"],
    fast_rewards: Float[Tensor, " K"],
    log_ratio: Float[Tensor, " K"],
    age: Float[Tensor, " K"],
    valid: Bool[Tensor, " K"] | None = None,
    alpha: float = RAC_ALPHA,
    tau_age: float = RAC_TAU_AGE,
    rho_bar: float = RAC_RHO_BAR,
    max_abs: float = RAC_MAX_ABS,
) -> RacOutput:
    """RAC's corrections c_i (module docstring; arXiv 2606.27580).

    ==================  =====  ==============================================================
    ``slow_rewards``    [K]    r_slow,i, the reward that arrived late
    ``fast_rewards``    [K]    b_i, the fast reward cached when y_i was sampled
    ``log_ratio``       [K]    log π_{t+Δ}(y_i) − log μ(y_i), summed over y_i's tokens (detached here)
    ``age``             [K]    Δ_i, learner steps between training on y_i and the arrival
    ``valid``           [K]    rows to correct (None: all); the others get c = 0 and do not set the rescale
    ==================  =====  ==============================================================
    """
    if not (tau_age > 0 and rho_bar > 0 and max_abs > 0):
        raise ValueError(f"need tau_age, rho_bar, max_abs > 0 (got {tau_age}, {rho_bar}, {max_abs})")
    dtype = torch.promote_types(slow_rewards.dtype, torch.float32)
    ok = torch.ones_like(slow_rewards, dtype=torch.bool) if valid is None else valid
    delta = alpha * (slow_rewards.detach().to(dtype) - fast_rewards.detach().to(dtype))  # δ = α (r_slow − b)
    log_rho = torch.nan_to_num(log_ratio.detach().to(dtype), nan=0.0).clamp(max=math.log(rho_bar))
    ratio = log_rho.exp()  # min(ρ̄, π/μ), in log space
    c = torch.exp(-age.to(dtype) / tau_age) * ratio * delta
    c = torch.where(ok, c, torch.zeros_like(c))
    biggest = c.abs().amax() if c.numel() else c.new_zeros(())
    scale = torch.where(biggest > max_abs, max_abs / biggest.clamp(min=max_abs), torch.ones_like(biggest))
    c = c * scale  # max |c| ≤ C
    n = ok.to(dtype).sum().clamp(min=1)
    metrics: Metrics = {
        "rac/delta_mean": torch.where(ok, delta, 0.0).sum() / n,
        "rac/corr_mean": c.sum() / n,
        "rac/corr_abs_max": c.abs().amax() if c.numel() else c.new_zeros(()),
        "rac/rescale": scale,
        "rac/ratio_clipped_frac": torch.where(ok, (log_ratio.detach() > math.log(rho_bar)).to(dtype), 0.0).sum() / n,
    }
    return RacOutput(corrections=c.detach(), metrics=detach_metrics(metrics))
