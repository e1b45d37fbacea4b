"""Effective sample size of importance weights and VCPO's ESS-scaled step size (arXiv 2602.17616).

ESS = (Σ_i w_i)² / Σ_i w_i² is computed in log space, log ESS = 2·logsumexp(S) − logsumexp(2S) with S_i = log w_i,
so it neither overflows nor underflows for any finite S (S = ±1000 included). ESS is invariant to a common scale of
the weights, and 1 ≤ ESS ≤ n for n valid weights.

Framework difference: VCPO uses per-trajectory **unclipped** weights w_i = exp(S_i) over the whole
optimizer minibatch (that is steadyrl's default, :func:`sequence_ess`); verl logs ``rollout_is_eff_sample_size``, the
ESS ratio of its applied IS weights clamped to [0, C], every masked token one sample (a sequence weight counts once per
token): :func:`weights_ess` with ``cap`` (``floor`` = 1/C gives the [1/C, C] clamp of earlier verl versions). ESS is a
statistic of the data: inputs are detached.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.importance_weights import check_bounds, check_choice, log_bound
from steadyrl.core.masking import as_bool_mask

LrScaleFn = Literal["sqrt", "identity"]
LR_SCALE_FNS: tuple[str, ...] = get_args(LrScaleFn)

#: VCPO's ρ_base for single-turn tasks; its multi-turn runs use :data:`VCPO_RHO_BASE_MULTI_TURN`.
VCPO_RHO_BASE: float = 1.0
VCPO_RHO_BASE_MULTI_TURN: float = 0.55


class ESS(NamedTuple):
    """Effective sample size of one set of weights (all 0-d, detached).

    ``ess`` = (Σw)²/Σw², ``ess_ratio`` = ESS / n_valid ∈ (0, 1], ``log_ess``, ``n_valid``. With no valid weight:
    ``ess`` = 0, ``ess_ratio`` = 0, ``log_ess`` = −inf (an empty batch gives the lr rule a zero step, so optimizer
    momentum does not move the weights on a batch with nothing to learn from).
    """

    ess: Float[Tensor, ""]
    ess_ratio: Float[Tensor, ""]
    log_ess: Float[Tensor, ""]
    n_valid: Float[Tensor, ""]


def sequence_ess(
    *,
    log_weights: Float[Tensor, " B"],
    valid: Shaped[Tensor, " B"],
    cap: float | None = None,
    floor: float | None = None,
) -> ESS:
    """ESS of sequence weights w_i = exp(S_i) over the valid sequences [exact: VCPO, authors' code].

    log ESS = 2·logsumexp_{i valid}(S_i) − logsumexp_{i valid}(2·S_i); ESS ratio ρ_ess = ESS / B_valid.
    ``cap`` C (VCPO option): use clipped weights min(w_i, C), i.e. S_i ← min(S_i, log C), before the ESS; ``floor``
    likewise clamps from below, S_i ← max(S_i, log floor). A weight of exactly 0 (S_i = −inf) counts as a sample that
    adds nothing; with every valid weight 0 the ESS is 0.

    ==================  =====  ====================================================
    ``log_weights``     [B]    S_i = Σ_t m ℓ (detached here); any value where invalid
    ``valid``           [B]    bool or 0/1: which sequences count (e.g. non-empty)
    ==================  =====  ====================================================

    Call it on the **whole optimizer minibatch** (gather S over data-parallel ranks first): ESS is not additive.
    """
    check_bounds(floor, cap)
    v = as_bool_mask(valid)
    S = log_weights.detach()
    if cap is not None:
        S = torch.minimum(S, log_bound(cap, like=S))  # log min(w, C) = min(S, log C)
    if floor is not None:
        S = torch.maximum(S, log_bound(floor, like=S))  # log max(w, C_min)
    n_valid = torch.count_nonzero(v).to(S.dtype)
    S_valid = torch.where(v, S, -torch.inf)  # invalid weights are exp(−inf) = 0
    # ESS is scale invariant: shift by max_i S_i so both logsumexps are O(log n) and keep full precision.
    shift = S_valid.amax()
    S_valid = S_valid - torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # −inf stays −inf
    lse1 = torch.logsumexp(S_valid, dim=0)  # log Σ w
    lse2 = torch.logsumexp(2.0 * S_valid, dim=0)  # log Σ w²
    any_mass = (n_valid > 0) & torch.isfinite(lse1)  # some valid weight is > 0
    log_ess = torch.where(any_mass, 2.0 * lse1 - torch.where(any_mass, lse2, 0.0), -torch.inf)  # 2·lse(S) − lse(2S)
    ess = torch.exp(log_ess)  # log ESS ≤ log n: no overflow
    ess_ratio = ess / n_valid.clamp(min=1)
    return ESS(ess=ess, ess_ratio=ess_ratio, log_ess=log_ess, n_valid=n_valid)


def token_ess(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    cap: float | None = None,
    floor: float | None = None,
) -> ESS:
    """Token-level ESS: the same formula over the masked-in token weights exp(ℓ_{i,t}) (ratio = ESS / #tokens).

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     bool or 0/1: which tokens count
    ==============  =========  ====================================================
    """
    m = as_bool_mask(mask)
    return sequence_ess(log_weights=log_ratio.reshape(-1), valid=m.reshape(-1), cap=cap, floor=floor)


def weights_ess(
    *,
    weights: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    cap: float | None = None,
    floor: float | None = None,
) -> ESS:
    """ESS of materialized per-token weights w ≥ 0 (a correction's output), every masked token one sample.

    [reference-code: verl ``compute_is_metrics``, ``rollout_is_eff_sample_size`` = 1 / mean_t (w̃_t / mean w̃)² with
    w̃ = clamp(w, 0, C) over the response mask, which is ``ess_ratio`` here with ``cap=C``; verl adds 1e-8 to the
    mean, a relative difference below 1e-7 for weights near 1.] A sequence weight broadcast to its tokens counts once
    per token; a zeroed weight (IcePop) counts as a sample with no mass. ``floor`` = 1/C clamps to [1/C, C].

    ==============  =========  ====================================================
    ``weights``     [B, T]     w ≥ 0 (detached here); any value outside ``mask``
    ``mask``        [B, T]     bool or 0/1: which tokens count
    ==============  =========  ====================================================
    """
    m = as_bool_mask(mask)
    w = torch.where(m, weights.detach(), 1.0).clamp(min=0.0)
    return token_ess(log_ratio=torch.log(w), mask=m, cap=cap, floor=floor)  # log 0 = −inf: a sample with no mass


def vcpo_lr_scale(
    *,
    ess_ratio: Float[Tensor, ""],
    rho_base: float = VCPO_RHO_BASE,
    fn: LrScaleFn | str = "sqrt",
) -> Float[Tensor, ""]:
    """VCPO ESS step-size factor [exact: arXiv 2602.17616 and the authors' code]: f(min(1, ρ_ess / ρ_base)).

    lr_t = lr_sched · f(min(1, ρ_ess/ρ_base)), f = sqrt (default) or identity, ρ_base = 1.0 (0.55 multi-turn).
    The factor lies in [0, 1]; set it on the optimizer's param groups for this step only (the ``control`` layer does).
    Returns a detached 0-d tensor (no host sync).
    """
    check_choice("fn", fn, LR_SCALE_FNS)
    if rho_base <= 0:
        raise ValueError(f"rho_base must be > 0, got {rho_base}")
    x = (ess_ratio.detach() / rho_base).clamp(min=0.0, max=1.0)  # min(1, ρ_ess/ρ_base)
    return x.sqrt() if fn == "sqrt" else x
