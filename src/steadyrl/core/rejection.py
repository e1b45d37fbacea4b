"""Rejection on divergence estimators and off-policy sequence masking (OPSM).

Both only remove tokens from the mask; they return ``types.Corrected`` like the corrections in ``weights.py`` and log
the same ``is/`` metrics plus ``loss/all_masked``.

Divergence rejection [reference-code: verl ``rollout_rs`` with k1/k2/k3, AReaL ``rejection_sampling.metric``]:
per token the mismatch estimator k of ℓ = log π_prox − log μ (``kl.mismatch_kl``), or per sequence that estimator
aggregated over the masked tokens by sum | mean | max, is tested against [lower, upper].

Bounds, steadyrl's choice and the mapping to the frameworks:

* Bounds are in **metric space** (AReaL): keep iff lower ≤ metric ≤ upper; either may be None.
* verl gives **k1 bounds as ratios** and compares them in log space: keep iff log(lower) ≤ k1 ≤ log(upper). Set
  ``ratio_bounds=True`` to pass verl's ratios unchanged (the log is taken for you, in tensor space). verl's k2/k3
  take an upper bound only: leave ``lower=None``.
* verl ANDs a comma-separated list of conditions: pass several :class:`RejectionSpec` to
  :func:`divergence_rejection_all`.
* Estimator direction: ``convention="verl"`` (k1 = −ℓ, k3 = e^ℓ − ℓ − 1, default) or ``"areal"`` (k1 = ℓ,
  k3 = e^{−ℓ} − 1 + ℓ); the same bound keeps different tokens under the two, so match the framework you mirror.
* What kept tokens carry (``weight``): ``"one"`` (default: a pure mask, composable with a TIS weight),
  ``"token"`` (π_prox/μ per token, AReaL's decoupled PPO) or ``"geometric"`` (exp(S̄_i) on every token of the sequence,
  AReaL's sequence-level variant).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from steadyrl.core.kl import KL_CONVENTIONS, MISMATCH_KINDS, KLConvention, MismatchKind, mismatch_estimator
from steadyrl.core.masking import (
    any_true,
    as_bool_mask,
    broadcast_seq,
    geo_log_ratio,
    masked_mean,
    masked_sum,
    safe_exp,
    where_masked,
)
from steadyrl.core.types import Corrected
from steadyrl.core.weights import broadcast_keep, check_choice, correction_metrics, log_bound

RejectLevel = Literal["token", "sequence"]
SeqAgg = Literal["sum", "mean", "max"]
RejectWeight = Literal["one", "token", "geometric"]
REJECT_LEVELS: tuple[str, ...] = get_args(RejectLevel)
SEQ_AGGS: tuple[str, ...] = get_args(SeqAgg)
REJECT_WEIGHTS: tuple[str, ...] = get_args(RejectWeight)


class RejectionSpec(NamedTuple):
    """One rejection condition: keep iff ``lower`` ≤ agg(metric) ≤ ``upper`` (None = that side absent).

    ``metric``: k1 | k2 | k3 of ℓ; ``level``: token | sequence; ``seq_agg``: sum | mean | max over the masked tokens
    (sequence level only); ``ratio_bounds``: bounds are ratios compared as log(bound) (verl's k1 convention).
    """

    metric: str = "k3"
    level: str = "token"
    seq_agg: str = "mean"
    lower: float | None = None
    upper: float | None = None
    ratio_bounds: bool = False


def _validate(spec: RejectionSpec) -> None:
    check_choice("metric", spec.metric, MISMATCH_KINDS)
    check_choice("level", spec.level, REJECT_LEVELS)
    check_choice("seq_agg", spec.seq_agg, SEQ_AGGS)
    if spec.ratio_bounds:
        for b in (spec.lower, spec.upper):
            if b is not None and b <= 0:
                raise ValueError(f"ratio bounds must be > 0, got {b}")
    if spec.lower is not None and spec.upper is not None and spec.lower > spec.upper:
        raise ValueError(f"lower bound {spec.lower} exceeds upper bound {spec.upper}")


def _seq_agg(k: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"], agg: str) -> Float[Tensor, " B"]:
    """Aggregate a per-token statistic over each sequence's masked tokens (0 for an empty sequence)."""
    if agg == "sum":
        return masked_sum(k, mask, dim=-1)
    if agg == "mean":
        return masked_mean(k, mask, dim=-1)
    mx = torch.where(mask, k, torch.full_like(k, -torch.inf)).amax(dim=-1)
    return torch.where(any_true(mask, dim=-1), mx, torch.zeros_like(mx))


def _bound(value: float, spec: RejectionSpec, like: Tensor) -> Tensor:
    """A bound as a 0-d tensor in metric space: log(value) for ratio bounds, value otherwise."""
    return log_bound(value, like=like) if spec.ratio_bounds else like.new_full((), value)


def _keep(
    estimates: dict[str, Tensor], mask: Bool[Tensor, "B T"], spec: RejectionSpec
) -> Bool[Tensor, "B T"]:
    """Tokens that pass one condition."""
    k = estimates[spec.metric]
    stat = k if spec.level == "token" else _seq_agg(k, mask, spec.seq_agg)
    keep = torch.ones_like(stat, dtype=torch.bool)
    if spec.lower is not None:
        keep = keep & (stat >= _bound(spec.lower, spec, stat))
    if spec.upper is not None:
        keep = keep & (stat <= _bound(spec.upper, spec, stat))
    return keep if spec.level == "token" else broadcast_keep(keep, mask)


def divergence_rejection_all(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    specs: list[RejectionSpec] | tuple[RejectionSpec, ...],
    convention: KLConvention | str = "verl",
    weight: RejectWeight | str = "one",
) -> Corrected:
    """Rejection on several divergence conditions, ANDed (verl's comma-separated ``rollout_rs`` list).

    A token is kept iff it is masked in and passes every :class:`RejectionSpec`. See the module docstring for the
    bound conventions. An empty ``specs`` keeps everything.

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     input mask (bool or 0/1)
    ``weights``     [B, T]     1, π_prox/μ or exp(S̄_i) on kept tokens (``weight``), 0 elsewhere
    ``mask`` (out)  [B, T]     tokens that pass every condition
    ==============  =========  ====================================================
    """
    check_choice("convention", convention, KL_CONVENTIONS)
    check_choice("weight", weight, REJECT_WEIGHTS)
    for spec in specs:
        _validate(spec)
    m = as_bool_mask(mask)
    ell = log_ratio.detach()
    x = where_masked(ell, m)  # as in ``kl.mismatch_kl``: estimators are 0 off the mask
    # Only the estimators the conditions test (each as ``kl.mismatch_kl`` computes it).
    kinds = dict.fromkeys(spec.metric for spec in specs)
    estimates = {k: mismatch_estimator(x, kind=k, convention=convention) for k in kinds}
    keep = m
    for spec in specs:
        keep = keep & _keep(estimates, m, spec)
    if weight == "one":
        w = torch.ones_like(ell)
    elif weight == "token":
        w = safe_exp(ell)  # π_prox/μ per token
    else:
        w = broadcast_seq(safe_exp(geo_log_ratio(ell, m)), ell)  # exp(S̄_i)
    w = where_masked(w, keep)
    return Corrected(w, keep, correction_metrics(weights=w, mask_in=m, mask_out=keep), unit_weights=weight == "one")


def divergence_rejection(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    metric: MismatchKind | str = "k3",
    level: RejectLevel | str = "token",
    seq_agg: SeqAgg | str = "mean",
    lower: float | None = None,
    upper: float | None = None,
    ratio_bounds: bool = False,
    convention: KLConvention | str = "verl",
    weight: RejectWeight | str = "one",
) -> Corrected:
    """Rejection on one divergence estimator [reference-code: verl ``rollout_rs``, AReaL ``rejection_sampling``].

    Token level: keep token t iff lower ≤ k(ℓ_t) ≤ upper. Sequence level: keep every token of sequence i iff
    lower ≤ agg_t k(ℓ_{i,t}) ≤ upper, agg = sum | mean | max over masked tokens. k ∈ {k1, k2, k3}
    (``kl.mismatch_estimators`` in ``convention``). Shapes and weights as :func:`divergence_rejection_all`.
    """
    spec = RejectionSpec(
        metric=metric, level=level, seq_agg=seq_agg, lower=lower, upper=upper, ratio_bounds=ratio_bounds
    )
    return divergence_rejection_all(
        log_ratio=log_ratio, mask=mask, specs=[spec], convention=convention, weight=weight
    )


def opsm(
    *,
    logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    delta: float,
) -> Corrected:
    """Off-policy sequence masking, OPSM (DeepSeek-V3.2, arXiv 2512.02556; TRL ``off_policy_mask_threshold`` δ)
    [reference-code].

    Keep sequence i iff A_i ≥ 0 or mean_t (log μ − log π_θ) ≤ δ, the mean over the sequence's masked tokens
    (a k1 estimate of KL(μ ‖ π_θ)); computed detached. Kept tokens carry weight 1. A sequence with a negative
    advantage that the policy has drifted far from is dropped: pushing its tokens down further is what destabilizes.

    ==============  =========  ====================================================
    ``logp``        [B, T]     log π_θ (detached here)
    ``behav_logp``  [B, T]     log μ
    ``advantages``  [B]        A_i (detached here)
    ``mask``        [B, T]     input mask (bool or 0/1)
    ``mask`` (out)  [B, T]     tokens of kept sequences
    ==============  =========  ====================================================

    Metrics: the ``is/`` masking metrics, ``loss/all_masked`` and ``kl/opsm_seq_mean`` (mean over non-empty
    sequences of the per-sequence statistic).
    """
    m = as_bool_mask(mask)
    d = where_masked(behav_logp.detach() - logp.detach(), m)  # log μ − log π_θ
    seq_kl = masked_mean(d, m, dim=-1)  # mean_t over masked tokens
    keep_seq = (advantages.detach() >= 0) | (seq_kl <= delta)
    keep = m & broadcast_keep(keep_seq, m)
    w = keep.to(d.dtype)  # 1 on kept tokens, 0 elsewhere
    metrics = correction_metrics(weights=w, mask_in=m, mask_out=keep)
    nonempty = any_true(m, dim=-1)
    metrics["kl/opsm_seq_mean"] = masked_mean(seq_kl.unsqueeze(0), nonempty.unsqueeze(0)).detach()
    return Corrected(w, keep, metrics, unit_weights=True)
