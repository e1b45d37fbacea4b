"""Per-sample and per-token keep masks on the current → behavior ratio π_θ/μ: VACO, COPC (actor), ESTR.

Each filter returns ``Corrected(weights=1, mask=kept, metrics)`` and is meant to be combined with a policy loss
(``ppo.ppo_clip_loss``) by passing the returned mask. They read π_θ through ``logp.detach()``: a filter decides
which tokens train, it never carries a gradient. All three are [reconstructed] from abstracts and summaries; every
uncertain piece is a named option or a documented module constant.

=================  ======  ===========================================================
argument           shape   meaning
=================  ======  ===========================================================
``logp``           [B, T]  log π_θ (read detached)
``behav_logp``     [B, T]  log μ, the behavior policy
``advantages``     [B, T]  A (VACO only); callers broadcast sequence advantages
``behav_entropy``  [B, T]  H_t, the behavior policy's entropy at each token (ESTR only)
``mask``           [B, T]  tokens trained on
=================  ======  ===========================================================
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    any_true,
    as_bool_mask,
    detach_metrics,
    geo_log_ratio,
    masked_mean,
    safe_exp,
    where_masked,
)
from steadyrl.core.objectives.ppo import mask_frac
from steadyrl.core.types import Corrected, Metrics

#: VACO's total-variation threshold δ (ALGORITHMS.md).
VACO_DELTA: float = 0.2
#: COPC's actor keep interval [c_low, c_high] on ρ = π_θ/μ. Our starting point: the paper's values are unknown and
#: interact with the critic's ratio clip [ρ_min, ρ_max]; sweep them jointly.
COPC_C_LOW: float = 0.5
COPC_C_HIGH: float = 2.0
#: ESTR's entropy offset ε in δ²/(H + ε).
ESTR_EPS: float = 1e-6
#: ESTR's threshold τ. UNKNOWN in the paper: 0.04 is our placeholder, borrowed from M2PO's second-moment budget
#: (δ² per nat of behavior entropy, same units as M2PO's mean δ²). Sweep it.
ESTR_TAU: float = 0.04
#: Half of the L1 distance: TV = ½ · mean |r − 1|.
TV_HALF: float = 0.5

VacoLevel = Literal["geometric", "token"]
VACO_LEVELS: tuple[str, ...] = get_args(VacoLevel)


def _log_ratio(
    logp: Float[Tensor, "B T"], behav_logp: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"]
) -> Float[Tensor, "B T"]:
    """log(π_θ/μ) per token, detached, 0 where masked out."""
    return where_masked(logp.detach() - behav_logp.detach(), as_bool_mask(mask))


def vaco_filter(
    *,
    logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    delta: float = VACO_DELTA,
    level: VacoLevel | str = "geometric",
) -> Corrected:
    """VACO / Align and Filter (arXiv 2603.01365) [reconstructed]: drop updates that would push TV further.

    With r the sample's ratio π_θ/μ (detached)::

        level="geometric" (default):  r_i = exp(clamp((1/L_i) Σ_t m (log π_θ − log μ), ±20)), per sequence
        level="token":                r_t = exp(clamp(log π_θ − log μ, ±20)), per token
        TV estimate:                  ½ · mean |r − 1|   (over non-empty sequences, resp. masked-in tokens)
        drop when  ½ |r − 1| > δ  and  sign(A)(r − 1) > 0           δ = 0.2

    The drop test is evaluated per token with A_{i,t} and the sequence's r_i broadcast, which is the per-sample rule
    when advantages are per sequence. A = 0 never drops. Reconstructed: the ratio level (``level``), the use of the
    geometric mean for LLMs, and δ. The paper's V-trace advantage re-alignment is not part of this filter (it
    belongs to the advantage estimators).

    Returns ``Corrected(weights=1, mask=kept, metrics)``. Metrics: ``vaco/tv``, ``vaco/masked_frac`` (dropped /
    masked-in tokens).
    """
    if level not in VACO_LEVELS:
        raise ValueError(f"VACO level {level!r} is not one of {', '.join(VACO_LEVELS)}")
    m = as_bool_mask(mask)
    log_ratio = _log_ratio(logp, behav_logp, m)
    if level == "geometric":  # per sequence, on [B, 1], broadcast to the tokens by the tests below
        seq_ratio = safe_exp(geo_log_ratio(log_ratio, m)).unsqueeze(-1)  # r_i = exp(mean_t log(π_θ/μ))
        half_dev = TV_HALF * (seq_ratio - 1.0).abs()  # ½|r_i − 1|
        tv = masked_mean(half_dev, any_true(m, dim=-1, keepdim=True))  # ½ mean |r−1| over non-empty sequences
        excess = seq_ratio - 1.0
    else:
        excess = safe_exp(log_ratio) - 1.0  # r_t − 1, r_t = π_θ/μ
        half_dev = TV_HALF * excess.abs()  # ½|r_t − 1|
        tv = masked_mean(half_dev, m)  # ½ mean |r−1|
    adv = where_masked(advantages.detach(), m)
    too_far = half_dev > delta  # ½|r − 1| > δ
    moves_away = torch.sign(adv) * excess > 0  # sign(A)(r − 1) > 0: the update would grow TV
    dropped = m & too_far & moves_away
    metrics: Metrics = {"vaco/tv": tv, "vaco/masked_frac": mask_frac(dropped, m)}
    return Corrected(torch.ones_like(log_ratio), m & ~dropped, detach_metrics(metrics), unit_weights=True)


def copc_actor_mask(
    *,
    logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    c_low: float = COPC_C_LOW,
    c_high: float = COPC_C_HIGH,
) -> Corrected:
    """COPC actor mask (arXiv 2610.09597) [reconstructed]: keep token t iff ρ_t = π_θ/μ ∈ [c_low, c_high].

    ρ_t = exp(clamp(log π_θ − log μ, ±20)) (detached); tokens outside the interval are masked, not clipped. The PPO
    surrogate then runs on the kept tokens. The thresholds are unknown in the paper: [0.5, 2.0] is our starting
    point and interacts with the critic's ratio clip (sweep jointly). The critic side (two-sided clipped ratio in
    the TD targets) lives with the advantage estimators.

    Returns ``Corrected(weights=1, mask=kept, metrics)``. Metrics: ``copc/masked_frac``.
    """
    m = as_bool_mask(mask)
    ratio = safe_exp(_log_ratio(logp, behav_logp, m))  # ρ_t = π_θ/μ
    kept = m & (ratio >= c_low) & (ratio <= c_high)  # ρ_t ∈ [c_low, c_high]
    metrics: Metrics = {"copc/masked_frac": mask_frac(m & ~kept, m)}
    return Corrected(torch.ones_like(ratio), kept, detach_metrics(metrics), unit_weights=True)


def estr_mask(
    *,
    logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    behav_entropy: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    tau: float = ESTR_TAU,
    eps: float = ESTR_EPS,
) -> Corrected:
    """ESTR, entropy-scaled trust region (arXiv 2607.22186) [reconstructed]: keep t iff δ_t²/(H_t + ε) ≤ τ.

    δ_t = log π_θ − log μ (detached; not exponentiated, so not clamped), H_t the behavior policy's entropy at t
    (``behav_entropy``), ε = 1e-6. Confident (low-entropy) positions tolerate less drift. τ is UNKNOWN in the
    paper: ``ESTR_TAU`` = 0.04 is a placeholder (sweep it). Kept tokens then use the ordinary PPO clip.

    Returns ``Corrected(weights=1, mask=kept, metrics)``. Metrics: ``estr/masked_frac``, ``estr/score_mean``
    (mean δ²/(H + ε) over masked-in tokens).
    """
    m = as_bool_mask(mask)
    delta = _log_ratio(logp, behav_logp, m)  # δ_t = log(π_θ/μ)
    entropy = where_masked(behav_entropy.detach(), m, fill=1.0)  # H_t (neutral value where masked out)
    score = (delta**2).div_(entropy.add_(eps))  # δ_t² / (H_t + ε), in place on the fresh detached tensors
    kept = m & (score <= tau)
    # δ = 0 off the mask, so the score is 0 there: its masked mean is a plain sum over the count; kept ⊆ m, so the
    # dropped tokens are a difference of counts.
    n_in, n_kept = torch.count_nonzero(m), torch.count_nonzero(kept)
    frac_dtype = torch.get_default_dtype()  # as ``ppo.mask_frac``
    masked_frac = (n_in - n_kept).to(frac_dtype) / n_in.clamp(min=1).to(frac_dtype)
    score_mean = score.sum() / n_in.clamp(min=1).to(score.dtype)
    metrics: Metrics = {"estr/masked_frac": masked_frac, "estr/score_mean": score_mean}
    return Corrected(torch.ones_like(delta), kept, detach_metrics(metrics), unit_weights=True)
