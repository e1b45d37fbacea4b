"""Rejection on divergence estimators and off-policy sequence masking (OPSM).

Both only remove tokens from the mask; they return ``types.Corrected`` like the corrections in ``weights.py`` and log
the same ``is/`` metrics plus ``loss/all_masked``.

Divergence rejection [reference-code: verl ``rollout_rs`` with k1/k2/k3, AReaL ``rejection_sampling.metric``]:
per token a statistic of ℓ = log π_prox − log μ, or per sequence that statistic aggregated over the masked tokens by
sum | mean | max, is tested against [lower, upper]. The statistics (``metric``):

* ``k1`` | ``k2`` | ``k3``: the mismatch estimators of KL(μ ‖ π_prox) (``kl.mismatch_estimator``, in
  ``convention``);
* ``ratio``: ℓ itself, bounds read as ratios (AReaL's ``metric="ratio"``: a sequence's sum | mean | max is taken in
  log space, so its mean tests the geometric-mean ratio exp(S̄_i));
* ``binary_kl``: KPop's bidirectional binary KL, max(D(p ‖ q), D(q ‖ p)) with p = π_prox(y_t), q = μ(y_t) and
  D(p ‖ q) = p log(p/q) + (1 − p) log((1 − p)/(1 − q)), p and q clamped to [ε, 1 − ε], ε = 1e-8
  [reconstructed: AReaL PR #1405 ``compute_binary_kl_divergence``, after areal 1.0.4; verl PR #6800 is open]. It reads
  the token probabilities themselves, so it needs ``behav_logp`` (log q; log p = log q + ℓ).

Bounds, steadyrl's choice and the mapping to the frameworks:

* Bounds are in **metric space** (AReaL): keep iff lower ≤ metric ≤ upper, inclusive; either may be None.
* verl gives **k1 bounds as ratios** and compares them in log space: keep iff log(lower) ≤ k1 ≤ log(upper). Set
  ``ratio_bounds=True`` to pass verl's ratios unchanged (the log is taken for you, in tensor space). ``ratio`` always
  reads its bounds as ratios. verl's k2/k3 take an upper bound only: leave ``lower=None``.
* verl's Geo-RS (``decoupled_geo_rs``: ``rollout_rs="seq_mean_k1"``, ``rollout_rs_threshold="0.999_1.001"``) is
  ``metric="k1", level="sequence", seq_agg="mean", ratio_bounds=True, lower=0.999, upper=1.001`` (verl convention).
* verl ANDs a comma-separated list of conditions, each on the input mask: pass several :class:`RejectionSpec` to
  :func:`divergence_rejection_all` (or list several ``rejection`` corrections in a method, the sequence-level ones
  first: a sequence-level statistic aggregates over the mask the earlier corrections left).
* Estimator direction: ``convention="verl"`` (k1 = −ℓ, k3 = e^ℓ − ℓ − 1, default) or ``"areal"`` (k1 = ℓ,
  k3 = e^{−ℓ} − 1 + ℓ); the same bound keeps different tokens under the two, so match the framework you mirror.
* What kept tokens carry (``weight``): ``"one"`` (default: a pure mask, composable with a TIS weight),
  ``"token"`` (π_prox/μ per token, AReaL's decoupled PPO) or ``"geometric"`` (exp(S̄_i) on every token of the sequence,
  AReaL's sequence-level ``ratio`` variant).
* The default level is ``"sequence"``, as the ``rejection`` spec's (verl's ``decoupled_k3_rs`` tests a sequence mean).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from steadyrl.core.importance_weights import broadcast_keep, check_choice, correction_metrics, log_bound
from steadyrl.core.kl import KL_CONVENTIONS, KLConvention, MismatchKind, mismatch_estimator
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

RejectLevel = Literal["token", "sequence"]
SeqAgg = Literal["sum", "mean", "max"]
RejectWeight = Literal["one", "token", "geometric"]
RejectMetric = Literal["k1", "k2", "k3", "ratio", "binary_kl"]
REJECT_LEVELS: tuple[str, ...] = get_args(RejectLevel)
SEQ_AGGS: tuple[str, ...] = get_args(SeqAgg)
REJECT_WEIGHTS: tuple[str, ...] = get_args(RejectWeight)
REJECT_METRICS: tuple[str, ...] = get_args(RejectMetric)

#: Default upper bound of the ``rejection`` spec: verl's ``decoupled_k3_rs`` / ``bypass_ppo_clip_k3_rs`` threshold on
#: the sequence mean of k3 (``verl/trainer/config/algorithm.py``, verl 0.9.1).
REJECTION_UPPER: float = 0.01
#: Probability clamp ε of the binary KL (AReaL ``compute_binary_kl_divergence``: p, q ∈ [1e-8, 1 − 1e-8]).
BINARY_KL_EPS: float = 1e-8


class RejectionSpec(NamedTuple):
    """One rejection condition: keep iff ``lower`` ≤ agg(metric) ≤ ``upper`` (None = that side absent).

    ``metric``: k1 | k2 | k3 | ratio | binary_kl (module docstring); ``level``: token | sequence; ``seq_agg``: sum |
    mean | max over the masked tokens (sequence level only); ``ratio_bounds``: bounds are ratios compared as
    log(bound) (verl's k1 convention; implied for ``ratio``).
    """

    metric: str = "k3"
    level: str = "sequence"
    seq_agg: str = "mean"
    lower: float | None = None
    upper: float | None = None
    ratio_bounds: bool = False


def _log_bounds(spec: RejectionSpec) -> bool:
    """Whether the bounds of ``spec`` are ratios, compared as their logs."""
    return spec.ratio_bounds or spec.metric == "ratio"


def _validate(spec: RejectionSpec) -> None:
    check_choice("metric", spec.metric, REJECT_METRICS)
    check_choice("level", spec.level, REJECT_LEVELS)
    check_choice("seq_agg", spec.seq_agg, SEQ_AGGS)
    if _log_bounds(spec):
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
    return log_bound(value, like=like) if _log_bounds(spec) else like.new_full((), value)


def binary_kl(log_p: Float[Tensor, "*shape"], log_q: Float[Tensor, "*shape"], eps: float = BINARY_KL_EPS) -> Tensor:
    """KL of the Bernoulli distributions (p, 1 − p) ‖ (q, 1 − q), from log-probabilities (KPop's binary KL).

    D(p ‖ q) = p (log p − log q) + (1 − p) (log(1 − p) − log(1 − q)), with p and q clamped to [ε, 1 − ε] (AReaL's
    ``compute_binary_kl_divergence``, ε = 1e-8). Clamped in log space and 1 − p taken as −expm1(log p), so p close
    to 1 keeps its complement in float32 too. Elementwise, no gradient taken here (callers detach).
    """
    lo, hi = math.log(eps), math.log1p(-eps)
    lp, lq = log_p.clamp(min=lo, max=hi), log_q.clamp(min=lo, max=hi)
    p, one_minus_p = lp.exp(), -torch.expm1(lp)
    log_1mp, log_1mq = torch.log(one_minus_p), torch.log(-torch.expm1(lq))
    return p * (lp - lq) + one_minus_p * (log_1mp - log_1mq)


def _statistic(
    metric: str, x: Float[Tensor, "B T"], behav: Float[Tensor, "B T"] | None, convention: str
) -> Float[Tensor, "B T"]:
    """The per-token statistic ``metric`` of x = ℓ (0 off the mask); ``behav`` = log μ (0 off the mask)."""
    if metric == "ratio":
        return x  # log ρ; bounds are logs of ratios
    if metric == "binary_kl":
        assert behav is not None
        log_p = behav + x  # log π_prox = log μ + ℓ
        return torch.maximum(binary_kl(log_p, behav), binary_kl(behav, log_p))  # bidirectional (KPop)
    return mismatch_estimator(x, kind=metric, convention=convention)


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
    behav_logp: Float[Tensor, "B T"] | None = None,
) -> Corrected:
    """Rejection on several divergence conditions, ANDed (verl's comma-separated ``rollout_rs`` list).

    A token is kept iff it is masked in and passes every :class:`RejectionSpec`; every condition is evaluated on the
    input ``mask`` (as verl does). See the module docstring for the statistics and the bound conventions. An empty
    ``specs`` keeps everything.

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     input mask (bool or 0/1)
    ``behav_logp``  [B, T]     log μ (detached here); needed by ``binary_kl`` only
    ``weights``     [B, T]     1, π_prox/μ or exp(S̄_i) on kept tokens (``weight``), 0 elsewhere
    ``mask`` (out)  [B, T]     tokens that pass every condition
    ==============  =========  ====================================================
    """
    check_choice("convention", convention, KL_CONVENTIONS)
    check_choice("weight", weight, REJECT_WEIGHTS)
    for spec in specs:
        _validate(spec)
    kinds = dict.fromkeys(spec.metric for spec in specs)  # only the statistics the conditions test
    if "binary_kl" in kinds and behav_logp is None:
        raise ValueError("metric='binary_kl' compares the token probabilities themselves: pass behav_logp (log μ)")
    m = as_bool_mask(mask)
    ell = log_ratio.detach()
    x = where_masked(ell, m)  # as in ``kl.mismatch_kl``: statistics are computed on 0 off the mask
    behav = None if behav_logp is None else where_masked(behav_logp.detach(), m)
    estimates = {k: _statistic(k, x, behav, convention) for k in kinds}
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
    metric: RejectMetric | MismatchKind | str = "k3",
    level: RejectLevel | str = "sequence",
    seq_agg: SeqAgg | str = "mean",
    lower: float | None = None,
    upper: float | None = None,
    ratio_bounds: bool = False,
    convention: KLConvention | str = "verl",
    weight: RejectWeight | str = "one",
    behav_logp: Float[Tensor, "B T"] | None = None,
) -> Corrected:
    """Rejection on one divergence statistic [reference-code: verl ``rollout_rs``, AReaL ``rejection_sampling``].

    Token level: keep token t iff lower ≤ k_t ≤ upper. Sequence level (default, as the ``rejection`` spec): keep every
    token of sequence i iff lower ≤ agg_t k_{i,t} ≤ upper, agg = sum | mean | max over masked tokens. k is the
    ``metric`` of the module docstring (k1 | k2 | k3 in ``convention``, ratio, binary_kl). Shapes and weights as
    :func:`divergence_rejection_all`.
    """
    spec = RejectionSpec(
        metric=metric, level=level, seq_agg=seq_agg, lower=lower, upper=upper, ratio_bounds=ratio_bounds
    )
    return divergence_rejection_all(
        log_ratio=log_ratio, mask=mask, specs=[spec], convention=convention, weight=weight, behav_logp=behav_logp
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


#: NeMo-RL's ``grpo.seq_logprob_error_threshold`` in its Nemotron 3 recipes (``examples/nemo_gym/grpo_nanov3.yaml``
#: and the nemotron-3-super / -ultra configs set 2; the option defaults to off).
SEQ_LOGPROB_ERROR_THRESHOLD: float = 2.0


def seq_logprob_error_mask(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    threshold: float = SEQ_LOGPROB_ERROR_THRESHOLD,
) -> Corrected:
    """Sequence log-prob-error mask [reference-code: NeMo-RL ``grpo.seq_logprob_error_threshold``,
    ``nemo_rl/algorithms/grpo.py`` ``compute_and_apply_seq_logprob_error_masking``, NVIDIA-NeMo/RL at 7ea279a].

    NeMo-RL's *multiplicative probability error* of sequence i is the token mean of e^{|ℓ_t|}, with
    ℓ = log π_prox − log μ (its ``prev_logprobs`` − ``generation_logprobs``: the trainer's log-probs before the step
    against the generator's) — the mean of the per-token errors, not e^{mean |ℓ|}::

        err_i = (1/L_i) Σ_t m_{i,t} exp(|ℓ_{i,t}|) ≥ 1;    keep sequence i iff err_i ≤ threshold

    A pure mask (kept tokens weigh 1). |ℓ| is clamped to 20 before the exp (``masking.safe_exp``); NeMo-RL's unguarded
    exp gives inf there, which any threshold below e^20/L_i rejects the same way. NeMo-RL masks the sequence before
    its advantages (its GRPO baseline still counts every response of the group) and its loss divides by the kept
    tokens; here the mask acts after the advantages too, and rejected tokens leave the loss denominator.

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     input mask (bool or 0/1)
    ``mask`` (out)  [B, T]     tokens of the kept sequences
    ==============  =========  ====================================================

    Metrics: the ``is/`` masking metrics, ``loss/all_masked``, ``is/seq_mult_prob_error_mean`` and
    ``is/seq_mult_prob_error_max`` (err_i over non-empty sequences, before masking; NeMo-RL's
    ``mean_seq_mult_prob_error`` / ``max_seq_mult_prob_error``).
    """
    if threshold < 1.0:
        raise ValueError(f"threshold bounds a mean of e^|ℓ| ≥ 1, so it must be ≥ 1 (NeMo-RL uses 2); got {threshold}")
    m = as_bool_mask(mask)
    err_tok = safe_exp(where_masked(log_ratio.detach(), m).abs())  # e^{|ℓ_t|} (1 off the mask, never averaged)
    err = masked_mean(err_tok, m, dim=-1)  # err_i; 0 for an empty sequence
    keep = m & broadcast_keep(err <= threshold, m)
    w = keep.to(err_tok.dtype)  # 1 on kept tokens, 0 elsewhere
    metrics = correction_metrics(weights=w, mask_in=m, mask_out=keep)
    nonempty = any_true(m, dim=-1)
    metrics["is/seq_mult_prob_error_mean"] = masked_mean(err.unsqueeze(0), nonempty.unsqueeze(0)).detach()
    metrics["is/seq_mult_prob_error_max"] = where_masked(err, nonempty).amax().detach()  # err ≥ 1 > 0 when kept
    return Corrected(w, keep, metrics, unit_weights=True)
