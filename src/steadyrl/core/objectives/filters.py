"""Per-sample and per-token keep masks on the current → behavior ratio π_θ/μ: VACO, COPC (actor), ESTR.

Each filter returns ``Corrected(weights=1, mask=kept, metrics)`` and is meant to be combined with a policy loss
(``ppo.ppo_clip_loss``) by passing the returned mask. They read π_θ through ``logp.detach()``: a filter decides
which tokens train, it never carries a gradient. VACO's filter follows the first author's released code; COPC and
ESTR are [reconstructed] from abstracts and second-hand notes on the papers; every uncertain piece is a named option or
a documented module constant (docs/algorithms.md gives the source of each).

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
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from steadyrl.core.groups import group_sum
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

#: VACO's total-variation threshold δ, 0.2 (the value a review of the paper reports). The first author's
#: released LLM scripts use ``clip_ratio`` 0.015, i.e. δ = 0.0075 on the same ½-scaled TV.
VACO_DELTA: float = 0.2
#: COPC's actor keep interval [c_low, c_high] on ρ = π_θ/μ. Our starting point: the paper's values are unknown and
#: interact with the critic's ratio clip [ρ_min, ρ_max]; sweep them jointly.
COPC_C_LOW: float = 0.5
COPC_C_HIGH: float = 2.0
#: ESTR's entropy offset ε in δ²/(H + ε): 0.01, "0.01 in the paper" per a second-hand note on it (one source;
#: the paper's text was not available here).
ESTR_EPS: float = 0.01
#: ESTR's threshold τ. UNKNOWN in the paper: 0.04 is our placeholder, borrowed from M2PO's second-moment budget
#: (δ² per nat of behavior entropy, same units as M2PO's mean δ²). Sweep it.
ESTR_TAU: float = 0.04
#: Half of the L1 distance: TV = ½ · mean |r − 1|.
TV_HALF: float = 0.5

VacoRule = Literal["tvpo", "sequence", "token"]
VACO_RULES: tuple[str, ...] = get_args(VacoRule)


def _log_ratio(
    logp: Float[Tensor, "B T"], behav_logp: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"]
) -> Float[Tensor, "B T"]:
    """log(π_θ/μ) per token, detached, 0 where masked out."""
    return where_masked(logp.detach() - behav_logp.detach(), as_bool_mask(mask))


def _group_tv(
    seq_tv: Float[Tensor, " B"], nonempty: Bool[Tensor, " B"], group_ids: Int[Tensor, " B"]
) -> tuple[Float[Tensor, " B"], Float[Tensor, ""]]:
    """(TV_g(i) for every row: the mean of seq_tv over the group's non-empty rows; the batch TV: the mean of TV_g over
    groups with a non-empty row). Empty rows count in neither."""
    w = nonempty.to(seq_tv.dtype)
    n_g = group_sum(w, group_ids=group_ids)  # non-empty members of g(i)
    tv_g = group_sum(seq_tv * w, group_ids=group_ids) / n_g.clamp(min=1)
    per_group = w / n_g.clamp(min=1)  # each group with a non-empty row sums to 1 over its non-empty rows
    return tv_g, (tv_g * per_group).sum() / per_group.sum().clamp(min=1)


def vaco_filter(
    *,
    logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    group_ids: Int[Tensor, " B"] | None = None,
    delta: float = VACO_DELTA,
    rule: VacoRule | str = "tvpo",
) -> Corrected:
    """VACO / Align and Filter (arXiv 2603.01365): drop the tokens whose update would push the TV past δ further.

    ρ_t = exp(clamp(log π_θ − log μ, ±20)) (detached). ``rule="tvpo"`` (default) is the filter of the first author's
    released code (``compute_policy_loss_tvpo`` in the hmnhonari/verl fork; the VACO paper's own equations were not
    available, so this is [reference-code] for the filter idea, not a confirmed transcription of the paper)::

        TV_i = ½ · (1/L_i) Σ_t m_{i,t} |ρ_{i,t} − 1|          per sequence: the mean token deviation
        TV_g = mean_{i∈g} TV_i,   TV = mean_g TV_g              per prompt group, then over the batch
        TV ≤ δ:  keep every token (inside the trust region: the plain policy gradient)
        TV > δ:  keep token (i, t) iff TV_g(i) ≤ δ  or  A_{i,t} · sign(log ρ_{i,t}) ≤ 0
                 (drop a token that has already moved in the direction its advantage pushes, in a group outside δ)

    The code's threshold is ``clip_ratio / 2`` on the same ½-scaled TV, so δ here = ``clip_ratio / 2`` there.
    Needs ``group_ids``. Other readings, kept as named rules: ``"sequence"`` — r_i = exp(mean_t log ρ) per
    sequence, drop iff ½|r_i − 1| > δ and sign(A)(r_i − 1) > 0 (positive and negative drift cancel in r_i, so it
    fires less); ``"token"`` — the same test with ρ_t per token. TV metric: ``rule`` tvpo the batch TV above,
    sequence ½ mean_i |r_i − 1|, token ½ mean_t |ρ_t − 1|. A = 0 never drops.

    Returns ``Corrected(weights=1, mask=kept, metrics)``. Metrics: ``vaco/tv``, ``vaco/masked_frac`` (dropped /
    masked-in tokens).
    """
    if rule not in VACO_RULES:
        raise ValueError(f"VACO rule {rule!r} is not one of {', '.join(VACO_RULES)}")
    m = as_bool_mask(mask)
    log_ratio = _log_ratio(logp, behav_logp, m)
    adv = where_masked(advantages.detach(), m)
    if rule == "tvpo":
        if group_ids is None:
            raise ValueError("VACO rule 'tvpo' measures the TV per prompt group: pass group_ids")
        nonempty = any_true(m, dim=-1)
        seq_tv = TV_HALF * masked_mean((safe_exp(log_ratio) - 1.0).abs(), m, dim=-1)  # ½ (1/L_i) Σ_t |ρ_t − 1|
        tv_g, tv = _group_tv(where_masked(seq_tv, nonempty), nonempty, group_ids)
        outside = (tv > delta) & (tv_g > delta).unsqueeze(-1)  # the batch and the row's group are outside δ
        moves_away = adv * torch.sign(log_ratio) > 0  # A · sign(π_θ − μ) > 0
        dropped = m & outside & moves_away
    else:
        if rule == "sequence":  # per sequence, on [B, 1], broadcast to the tokens by the tests below
            excess = safe_exp(geo_log_ratio(log_ratio, m)).unsqueeze(-1) - 1.0  # r_i − 1, r_i = exp(mean_t log ρ)
            half_dev = TV_HALF * excess.abs()  # ½|r_i − 1|
            tv = masked_mean(half_dev, any_true(m, dim=-1, keepdim=True))  # over non-empty sequences
        else:
            excess = safe_exp(log_ratio) - 1.0  # ρ_t − 1
            half_dev = TV_HALF * excess.abs()  # ½|ρ_t − 1|
            tv = masked_mean(half_dev, m)
        dropped = m & (half_dev > delta) & (torch.sign(adv) * excess > 0)  # ½|r − 1| > δ and sign(A)(r − 1) > 0
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
    (``behav_entropy``), ε = 0.01. Confident (low-entropy) positions tolerate less drift. τ is UNKNOWN in the
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
