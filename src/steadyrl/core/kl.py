"""KL estimators k1, k2, k3 (Schulman, "Approximating KL divergence", 2020) in their two uses.

1. **Mismatch diagnostic** KL(μ ‖ π_prox), estimated from samples of μ with x = ℓ = log π_prox − log μ
   (:func:`mismatch_kl`; detached, a metric or a rejection statistic).
2. **Reference penalty** KL(π_θ ‖ π_ref), estimated from samples of the policy with x = log π_ref − log π_θ
   (:func:`reference_kl`, with gradient through ``logp``; :func:`kl_in_reward`, detached, subtracted from the reward).

docs/algorithms.md, section 3.4 [reference-code: verl ``kl_penalty``, AReaL]. Every ``exp`` is guarded by the ±20
log clamp (``masking.safe_exp``, ``masking.safe_expm1``), so ±1000 log-ratios give finite values and gradients; k3
is computed without cancellation (:func:`k3_of`: its series for |x| < 0.1, expm1(x) − x above). Masked-out
positions are replaced by x = 0 *before* any arithmetic, so garbage there reaches neither a value nor a gradient;
per-token outputs are 0 outside the mask.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from steadyrl.core.importance_weights import check_choice
from steadyrl.core.masking import (
    aggregate,
    as_bool_mask,
    broadcast_seq,
    detach_metrics,
    geo_log_ratio,
    safe_exp,
    safe_expm1,
    where_masked,
)
from steadyrl.core.types import Metrics

KLConvention = Literal["verl", "areal"]
MismatchKind = Literal["k1", "k2", "k3"]
RefKLKind = Literal["k1", "k2", "k3", "abs", "low_var_kl"]
KL_CONVENTIONS: tuple[str, ...] = get_args(KLConvention)
MISMATCH_KINDS: tuple[str, ...] = get_args(MismatchKind)
REF_KL_KINDS: tuple[str, ...] = get_args(RefKLKind)

#: verl ``low_var_kl`` and AReaL clamp the k3 reference penalty to [−10, 10].
LOW_VAR_KL_CLAMP: float = 10.0
#: OpenRLHF 0.11.2 ``compute_approx_kl`` and AReaL 1.0.4 ``KLEstimator(apply_clamp=True)`` clamp every estimator's value
#: (k1, k2, k3) to [−10, 10] (``reference_kl(value_clamp=...)``). Not our default.
ESTIMATOR_VALUE_CLAMP: float = 10.0
#: KL-in-reward coefficient β (VCPO's ablation).
KL_IN_REWARD_BETA: float = 0.001


class KLEstimators(NamedTuple):
    """Elementwise k1, k2, k3 of one log-ratio (same shape as the input)."""

    k1: Tensor
    k2: Tensor
    k3: Tensor


class MismatchKL(NamedTuple):
    """Per-token mismatch estimators (0 outside the mask) and their masked token means as metrics.

    ``metrics``: ``kl/k1``, ``kl/k2``, ``kl/k3`` (token means over masked tokens, detached).
    """

    k1: Float[Tensor, "B T"]
    k2: Float[Tensor, "B T"]
    k3: Float[Tensor, "B T"]
    metrics: Metrics


class RefKL(NamedTuple):
    """Per-token reference penalty k_t (with gradient through ``logp``; 0 outside the mask) and metrics.

    ``metrics``: ``kl/ref_mean`` (token mean over masked tokens, detached).
    """

    kl: Float[Tensor, "B T"]
    metrics: Metrics


class KLReward(NamedTuple):
    """Token rewards r_t − β·k_t (detached; 0 outside the mask), per-sequence returns Σ_t, and metrics."""

    token_rewards: Float[Tensor, "B T"]
    returns: Float[Tensor, " B"]
    metrics: Metrics


#: Below this |x|, k3 = eˣ − 1 − x is summed from its series (x²/2! + … + x¹⁰/10!: the first term left out,
#: x¹¹/11!, is under 5e-17 of the sum there); above, (eˣ − 1) − x loses at most 2ε/|x| ≤ 20ε to the cancellation.
K3_SERIES_BELOW: float = 0.1
#: 1/n! for n = 2 … 10: the series' coefficients, highest first (Horner's order).
_K3_COEFFICIENTS: tuple[float, ...] = tuple(1 / math.factorial(n) for n in range(10, 1, -1))


def k3_of(x: Tensor) -> Tensor:
    """k3 = eˣ − 1 − x ≥ 0 to within a few roundings of the dtype for |x| < 0.1, and within 20ε + rounding above
    (eˣ on x clamped to ±20).

    eˣ − x − 1 in float32 rounds eˣ to ~1.2e-7 near 1, so for |x| below ~5e-4 it keeps no digit of x²/2 and goes
    negative; (eˣ − 1) − x from expm1 still loses up to 2ε/|x| of it (12% at |x| = 1e-6 in float32). The Taylor
    series has no cancellation; it is taken on x clamped to the series' range, so the branch not chosen stays finite
    (and so does its gradient, which ``torch.where`` multiplies by 0).
    """
    s = x.clamp(min=-K3_SERIES_BELOW, max=K3_SERIES_BELOW)
    series = torch.full_like(s, _K3_COEFFICIENTS[0])
    for c in _K3_COEFFICIENTS[1:]:
        series = series * s + c
    return torch.where(x.abs() < K3_SERIES_BELOW, series * s * s, safe_expm1(x) - x)


def mismatch_estimators(x: Tensor, *, convention: KLConvention | str = "verl") -> KLEstimators:
    """Elementwise (k1, k2, k3) of x = log π_prox − log μ for KL(μ ‖ π_prox).

    ``"verl"``: k1 = −x, k2 = x²/2, k3 = eˣ − x − 1. ``"areal"``: the mirrored pair k1 = +x, k3 = e^{−x} − 1 + x
    (k2 is the same). On an outlier token the two k3 differ by more than 10×.
    """
    return KLEstimators(*(mismatch_estimator(x, kind=kind, convention=convention) for kind in MISMATCH_KINDS))


def mismatch_estimator(
    x: Tensor, *, kind: MismatchKind | str, convention: KLConvention | str = "verl"
) -> Tensor:
    """One of the estimators of :func:`mismatch_estimators` (only that one is computed)."""
    check_choice("convention", convention, KL_CONVENTIONS)
    check_choice("kind", kind, MISMATCH_KINDS)
    if kind == "k2":
        return 0.5 * x**2  # k2 = x²/2
    if convention == "verl":
        return -x if kind == "k1" else k3_of(x)  # k1 = −x, k3 = eˣ − x − 1
    return x if kind == "k1" else k3_of(-x)  # AReaL: k1 = x, k3 = e^{−x} − 1 + x


def mismatch_kl(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    convention: KLConvention | str = "verl",
) -> MismatchKL:
    """Behavior → proximal mismatch KL estimators [reference-code], detached.

    x = ℓ = log π_prox − log μ; steadyrl's default is verl's convention (k1 = −x, k2 = x²/2, k3 = eˣ − x − 1);
    ``convention="areal"`` gives AReaL's mirrored pair (see :func:`mismatch_estimators`). eˣ is taken on x clamped to
    ±20, so k3 stays finite (and large) for any x.

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ (detached here)
    ``mask``        [B, T]     bool or 0/1
    ``k1/k2/k3``    [B, T]     per-token estimators, 0 outside the mask
    ==============  =========  ====================================================

    Reduction: the metrics ``kl/k1|k2|k3`` are token means over all masked tokens of the batch.
    """
    m = as_bool_mask(mask)
    x = where_masked(log_ratio.detach(), m)
    # x = 0 off the mask, where every estimator is 0 too (k1 = −0): no re-masking, and a token mean is a plain sum.
    k1, k2, k3 = mismatch_estimators(x, convention=convention)
    n = torch.count_nonzero(m).clamp(min=1).to(x.dtype)
    metrics = {"kl/k1": k1.sum() / n, "kl/k2": k2.sum() / n, "kl/k3": k3.sum() / n}
    return MismatchKL(k1, k2, k3, detach_metrics(metrics))


def reference_kl(
    *,
    logp: Float[Tensor, "B T"],
    ref_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    kind: RefKLKind | str = "low_var_kl",
    clamp: float = LOW_VAR_KL_CLAMP,
    value_clamp: float | None = None,
    straight_through: bool = False,
) -> RefKL:
    """Per-token reference penalty estimating KL(π_θ ‖ π_ref) [reference-code: verl ``kl_penalty``, AReaL].

    With x = log π_ref − log π_θ (``ref_logp`` detached, gradient through ``logp``):

    ==============  ===============================================================
    ``k1``          log π_θ − log π_ref = −x
    ``abs``         |log π_θ − log π_ref| (verl)
    ``k2``          x²/2
    ``k3``          eˣ − x − 1 (eˣ on x clamped to ±20)
    ``low_var_kl``  clamp(eˣ − x − 1, −clamp, clamp), clamp = 10 (verl, AReaL)
    ==============  ===============================================================

    ==============  =========  ===========================================================
    ``logp``        [B, T]     log π_θ (with gradient)
    ``ref_logp``    [B, T]     log π_ref (detached here)
    ``mask``        [B, T]     bool or 0/1; outside it the penalty is 0 with zero gradient
    ``kl``          [B, T]     per-token penalty k_t
    ==============  =========  ===========================================================

    Two framework conventions are options (defaults off): ``value_clamp=c`` clamps the value of every kind to [−c, c]
    after the formula above (OpenRLHF 0.11.2 ``compute_approx_kl`` and AReaL 1.0.4 ``KLEstimator``: c = 10, so their
    k1, k2 and k3 are ours with ``value_clamp=10``; their k3 is our ``low_var_kl``); ``straight_through=True`` keeps
    the value of ``kind`` and takes the gradient of k2 = x²/2 (verl 0.9.1 ``kl_loss_type`` with a ``+`` suffix,
    ``k3+`` / ``low_var_kl+`` / ``k1+`` / ``abs+``: k2's gradient is the unbiased gradient of KL(π_θ ‖ π_ref)).
    verl's ``k3`` is our ``low_var_kl`` (verl clamps both names); TRL 1.16.0's k3 is our ``k3``.

    The loss layer aggregates ``kl`` (``masking.aggregate``) and adds β times it; the metric ``kl/ref_mean`` is the
    token mean.
    """
    check_choice("kind", kind, REF_KL_KINDS)
    m = as_bool_mask(mask)
    x = where_masked(ref_logp.detach() - logp, m)  # x = log π_ref − log π_θ; 0 (and zero grad) off the mask
    if kind == "k1":
        k = -x  # log π_θ − log π_ref
    elif kind == "abs":
        k = x.abs()
    elif kind == "k2":
        k = 0.5 * x**2
    else:
        k = k3_of(x)  # k3 = eˣ − x − 1
        if kind == "low_var_kl":
            k = k.clamp(min=-clamp, max=clamp)
    if value_clamp is not None:
        k = k.clamp(min=-value_clamp, max=value_clamp)  # OpenRLHF / AReaL: every estimator within ±10
    if straight_through:
        k2 = 0.5 * x**2  # value of ``kind``, gradient of k2 (verl's "+" kinds)
        k = k.detach() + (k2 - k2.detach())
    # x = 0 off the mask, where every kind gives k = 0 (k1: −0) with zero gradient: no re-masking needed, and the
    # token mean is a plain sum over the count.
    n = torch.count_nonzero(m).clamp(min=1).to(k.dtype)
    return RefKL(k, detach_metrics({"kl/ref_mean": k.sum() / n}))


def last_token_mask(mask: Shaped[Tensor, "B T"]) -> Bool[Tensor, "B T"]:
    """True at the last masked-in token of each sequence (no position for an empty sequence)."""
    m = as_bool_mask(mask)
    pos = torch.arange(m.shape[-1], device=m.device).expand(m.shape)
    last = torch.where(m, pos, torch.full_like(pos, -1)).amax(dim=-1, keepdim=True)
    return m & (pos == last)


def kl_in_reward(
    *,
    logp: Float[Tensor, "B T"],
    ref_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    rewards: Float[Tensor, " B"] | None = None,
    token_rewards: Float[Tensor, "B T"] | None = None,
    beta: float = KL_IN_REWARD_BETA,
    kind: RefKLKind | str = "k1",
    clamp: float = LOW_VAR_KL_CLAMP,
    value_clamp: float | None = None,
) -> KLReward:
    """KL in the reward [reference-code: verl ``use_kl_in_reward``; VCPO ablation β = 0.001]: r'_t = r_t − β·k_t.

    k_t is :func:`reference_kl` of ``kind`` (default k1, verl's ``kl_penalty="kl"``; ``value_clamp`` as there),
    **detached**: the penalty acts through the advantages, not through a gradient. Give exactly one of ``rewards`` (an
    outcome reward, placed on the last masked-in token of each sequence; a sequence with no masked token gets nothing)
    or ``token_rewards``.

    ========================  =========  ==========================================
    ``logp``                  [B, T]     log π (detached here; π_prox or π_θ)
    ``ref_logp``              [B, T]     log π_ref
    ``rewards``               [B]        outcome reward R_i
    ``token_rewards``         [B, T]     per-token rewards r_t
    out ``token_rewards``     [B, T]     r_t − β·k_t on masked tokens, 0 elsewhere
    out ``returns``           [B]        Σ_t of the above
    ========================  =========  ==========================================

    Metrics: ``kl/ref_mean`` (token mean of k), ``kl/reward_penalty`` (mean over non-empty sequences of β·Σ_t k_t).
    """
    if (rewards is None) == (token_rewards is None):
        raise ValueError("give exactly one of rewards (per sequence) or token_rewards (per token)")
    m = as_bool_mask(mask)
    ref = reference_kl(logp=logp.detach(), ref_logp=ref_logp, mask=m, kind=kind, clamp=clamp, value_clamp=value_clamp)
    if rewards is not None:
        r = torch.where(last_token_mask(m), rewards.detach().unsqueeze(-1), torch.zeros_like(logp))
    else:
        assert token_rewards is not None
        r = token_rewards.detach()
    penalty = beta * ref.kl  # β·k_t
    out = where_masked(r - penalty, m)  # r'_t = r_t − β·k_t
    metrics = dict(ref.metrics)
    metrics["kl/reward_penalty"] = aggregate(penalty, m, "seq-mean-token-sum")
    return KLReward(out, out.sum(dim=-1), detach_metrics(metrics))


KLBiasCorrection = Literal["none", "token", "sequence"]
KL_BIAS_CORRECTIONS: tuple[str, ...] = get_args(KLBiasCorrection)


def importance_weighted_kl(
    *,
    kl: Float[Tensor, "B T"],
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    level: KLBiasCorrection | str = "token",
) -> RefKL:
    """Bias-corrected reference penalty k_t · r (DeepSeek-V3.2, arXiv 2512.02556, "Unbiased KL Estimate")
    [reference-code: TRL 1.16 ``use_bias_correction_kl``].

    The k3 estimate of KL(π_θ ‖ π_ref) from tokens the policy did not sample itself, reweighted by the importance
    ratio r = π_θ/π_prox **with gradient**: E_{π_prox}[r·k3] = KL(π_θ ‖ π_ref), and its gradient is the unbiased
    reverse-KL gradient. The weight matters even where its value is 1 (π_θ = π_prox at the first update): ∇(r·k) =
    k·∇log π_θ + ∇k, whereas ∇k alone is biased. ``level="token"``: r_t = exp(clamp(log π_θ − log π_prox, ±20));
    ``"sequence"``: r_i = exp(clamp(mean_t (log π_θ − log π_prox), ±20)) on every token of sequence i, TRL's weight
    under ``importance_sampling_level="sequence"`` (there TRL notes the unbiasedness argument is the token one).
    TRL's ratio is its ``coef_1`` = π_θ/``old_per_token_logps`` (π_prox, not μ: the vLLM ratio π_prox/μ does not
    multiply TRL's KL term), reproduced here; ``level="none"`` returns k unchanged.

    ==============  =========  ===========================================================
    ``kl``          [B, T]     per-token penalty k_t (:func:`reference_kl`; 0 outside the mask)
    ``logp``        [B, T]     log π_θ (with gradient)
    ``prox_logp``   [B, T]     log π_prox (detached here)
    ``mask``        [B, T]     bool or 0/1
    ``kl`` (out)    [B, T]     r·k_t (0 outside the mask, zero gradient there)
    ==============  =========  ===========================================================

    Metric ``kl/ref_mean``: token mean of r·k over masked tokens (TRL's logged ``kl``), detached.
    """
    check_choice("level", level, KL_BIAS_CORRECTIONS)
    if level == "none":
        return RefKL(kl, {})
    m = as_bool_mask(mask)
    log_r = where_masked(logp - prox_logp.detach(), m)  # log π_θ − log π_prox, 0 off the mask
    seq_r = None if level == "token" else safe_exp(geo_log_ratio(log_r, m))  # exp(mean_t log r) per sequence
    r = safe_exp(log_r) if seq_r is None else broadcast_seq(seq_r, like=log_r)
    k = kl * r  # kl is 0 (with zero gradient) off the mask and r is finite: 0 there too
    n = torch.count_nonzero(m).clamp(min=1).to(k.dtype)
    return RefKL(k, detach_metrics({"kl/ref_mean": k.sum() / n}))
