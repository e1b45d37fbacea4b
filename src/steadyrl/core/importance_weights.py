"""Importance-weight corrections behavior → proximal: truncation (TIS), masking (MIS), veto, prefix ratios.

Every correction takes the behavior-correction log-ratio ``log_ratio`` = ℓ = log π_prox − log μ (shape ``[B, T]``;
detached here, whatever the caller passes) and the token ``mask``, and returns
``types.Corrected(weights, mask, metrics)``: the per-token weight the loss multiplies in, and the mask with rejected
tokens removed. The loss layer then aggregates over the returned mask (``masking.aggregate``).

Conventions steadyrl picks where frameworks differ (docs/algorithms.md, "Conventions that differ between frameworks"):

* **Padding.** Weights are 0 at every position outside the returned mask (verl and AReaL; TRL leaves padded
  weights at 1 and masks later). Values of ``log_ratio`` outside ``mask`` may be garbage (nan/inf): never read.
* **Overflow guard.** Every weight is materialized as ``exp(clamp(log w, ±20))`` (``masking.safe_exp``, verl's
  guard); the others exponentiate unguarded. Caps below e^20 are therefore exact.
* **Bounds.** Thresholds are compared in log space (ℓ ≥ log lower, ℓ ≤ log upper), inclusive on both sides, and the
  quantity tested is the ratio itself: exp(ℓ_t), exp(S_i) or exp(S̄_i). verl's sequence rejection tests the sign-flipped
  −S_i: its bounds [a, b] equal steadyrl's [1/b, 1/a] (:func:`flipped_bounds`); the two agree for symmetric bounds.
  verl's single threshold u means [1/u, u] (:func:`symmetric_bounds`). Either bound may be None (TRL's defaults test
  ρ ≤ 3 only, AReaL's ρ ≤ 5 only).
* **Rejected tokens leave the mask** and so the loss denominator (verl). TRL keeps them in the denominator; AReaL
  divides by the token count before rejection. A loss that wants TRL's denominator aggregates with the input mask.
* **What kept tokens carry** in masked IS is an explicit ``weight`` option: ``"ratio"`` (TRL's sequence masking keeps
  ρ; AReaL keeps π_prox/μ) or ``"one"`` (verl's pure rejection, weight 1).
* **All rejected.** A correction that removes every token returns an all-false mask and the metric
  ``loss/all_masked`` = 1; the loss built on it is an exact 0 (verl returns NaN there; one framework crashed).

Metrics (detached 0-d tensors): ``is/weight_mean``, ``is/weight_max``, ``is/weight_min`` over kept tokens;
``is/truncated_frac`` (truncations) or ``is/masked_frac`` and ``is/seq_masked_frac`` (masking) as fractions of the
originally masked-in tokens / non-empty sequences; ``loss/all_masked`` for every masking correction.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    aggregate,
    all_masked_flag,
    any_true,
    as_bool_mask,
    broadcast_seq,
    detach_metrics,
    geo_log_ratio,
    masked_min,
    safe_exp,
    safe_exp_,
    seq_log_ratio,
    where_masked,
)
from steadyrl.core.types import Corrected, Metrics

Renormalize = Literal["token", "sequence"]
MisWeight = Literal["ratio", "one"]
SeqRatio = Literal["product", "geometric"]
RENORMALIZE_MODES: tuple[str, ...] = get_args(Renormalize)
MIS_WEIGHTS: tuple[str, ...] = get_args(MisWeight)
SEQ_RATIOS: tuple[str, ...] = get_args(SeqRatio)

#: Token TIS cap C (verl ``rollout_is_threshold`` default; TRL uses 3).
TOKEN_TIS_CAP: float = 2.0
#: Sequence TIS cap C (VCPO runs, arXiv 2602.17616).
SEQ_TIS_CAP: float = 8.0
#: Token MIS bounds: verl's single threshold u = 2 read as [1/u, u].
TOKEN_MIS_LOWER: float = 0.5
TOKEN_MIS_UPPER: float = 2.0
#: Sequence MIS bounds [1/C, C] with the VCPO sequence cap C = 8.
SEQ_MIS_LOWER: float = 1.0 / SEQ_TIS_CAP
SEQ_MIS_UPPER: float = SEQ_TIS_CAP
#: Geometric MIS bounds (verl ``decoupled_geo_rs`` preset).
GEO_MIS_LOWER: float = 0.999
GEO_MIS_UPPER: float = 1.001
#: IcePop token bounds (arXiv 2510.18855).
ICEPOP_LOWER: float = 0.5
ICEPOP_UPPER: float = 5.0
#: Token veto: drop a sequence if any token ratio is below this (verl ``rollout_token_veto_threshold``).
TOKEN_VETO_THRESHOLD: float = 1e-4


class Bounds(NamedTuple):
    """Ratio bounds [lower, upper] for masked importance sampling; either side may be None (absent)."""

    lower: float | None
    upper: float | None


def symmetric_bounds(threshold: float) -> Bounds:
    """verl's single MIS threshold u: keep iff the ratio ∈ [1/u, u] (u > 1)."""
    if threshold <= 1.0:
        raise ValueError(f"a symmetric ratio threshold must exceed 1, got {threshold}")
    return Bounds(lower=1.0 / threshold, upper=threshold)


def flipped_bounds(lower: float | None, upper: float | None) -> Bounds:
    """Map bounds [a, b] on exp(−S) (verl's sign-flipped sequence test) to steadyrl's bounds on exp(S): [1/b, 1/a]."""
    return Bounds(
        lower=None if upper is None else 1.0 / upper,
        upper=None if lower is None else 1.0 / lower,
    )


def log_bound(value: float, *, like: Tensor) -> Float[Tensor, ""]:
    """log(value) as a 0-d tensor on ``like``'s device and dtype (a fill kernel: no host transfer)."""
    return like.new_full((), value).log()


def check_bounds(lower: float | None, upper: float | None) -> None:
    """Raise ValueError unless the ratio bounds are positive and ordered (None = absent)."""
    if lower is not None and lower <= 0:
        raise ValueError(f"lower ratio bound must be > 0, got {lower}")
    if upper is not None and upper <= 0:
        raise ValueError(f"upper ratio bound must be > 0, got {upper}")
    if lower is not None and upper is not None and lower > upper:
        raise ValueError(f"lower ratio bound {lower} exceeds upper bound {upper}")


def check_choice(name: str, value: str | None, choices: tuple[str | None, ...]) -> None:
    """Raise ValueError naming the option when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")


def in_log_bounds(log_value: Tensor, *, lower: float | None, upper: float | None) -> Tensor:
    """Elementwise log_value ∈ [log lower, log upper] (inclusive; an absent bound always holds). No ``exp``."""
    tests = []
    if lower is not None:
        tests.append(log_value >= log_bound(lower, like=log_value))  # ρ ≥ lower ⇔ ℓ ≥ log lower
    if upper is not None:
        tests.append(log_value <= log_bound(upper, like=log_value))  # ρ ≤ upper ⇔ ℓ ≤ log upper
    if not tests:
        return torch.ones_like(log_value, dtype=torch.bool)
    return tests[0] if len(tests) == 1 else tests[0] & tests[1]


def correction_metrics(
    *,
    weights: Float[Tensor, "B T"],
    mask_in: Bool[Tensor, "B T"],
    mask_out: Bool[Tensor, "B T"],
    truncated: Bool[Tensor, "B T"] | None = None,
) -> Metrics:
    """The ``is/`` metrics every correction logs (see the module docstring); detached 0-d tensors.

    ``weights`` follow the corrections' convention: ≥ 0, and 0 outside ``mask_out``; ``mask_out`` ⊆ ``mask_in`` (a
    correction only removes tokens). The mean and the max over the kept tokens are then plain reductions of the
    whole tensor (the zeros add nothing and never exceed a weight), and the removed tokens a difference of counts.

    With ``truncated`` (a truncation): ``is/truncated_frac`` = |truncated ∧ mask_in| / |mask_in|. Without it (a
    masking correction): ``is/masked_frac``, ``is/seq_masked_frac`` and ``loss/all_masked``.
    """
    dtype = weights.dtype
    count_in, count_out = torch.count_nonzero(mask_in), torch.count_nonzero(mask_out)
    n_in = count_in.clamp(min=1).to(dtype)
    metrics: Metrics = {
        "is/weight_mean": weights.sum() / count_out.clamp(min=1).to(dtype),  # w = 0 off mask
        "is/weight_max": weights.amax(),  # w ≥ 0, and 0 off the mask (0 when nothing is kept)
        "is/weight_min": masked_min(weights, mask_out),
    }
    if truncated is not None:
        metrics["is/truncated_frac"] = torch.count_nonzero(truncated & mask_in).to(dtype) / n_in
    else:
        seq_in = any_true(mask_in, dim=-1)
        seq_removed = seq_in & ~any_true(mask_out, dim=-1)
        metrics["is/masked_frac"] = (count_in - count_out).to(dtype) / n_in  # |mask_in ∧ ¬mask_out|
        metrics["is/seq_masked_frac"] = seq_removed.sum().to(dtype) / seq_in.sum().clamp(min=1).to(dtype)
        metrics["loss/all_masked"] = all_masked_flag(mask_out)
    return detach_metrics(metrics)


def broadcast_keep(keep_seq: Bool[Tensor, " B"], like: Shaped[Tensor, "B T"]) -> Bool[Tensor, "B T"]:
    """Broadcast a per-sequence keep decision to every token of its sequence."""
    return keep_seq.unsqueeze(-1).expand(like.shape)


def _renormalize(
    weights: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"], mode: str | None
) -> Float[Tensor, "B T"]:
    """verl's batch normalization after truncation: w / mean(w), the mean over tokens or over sequences."""
    if mode is None:
        return weights
    # "token": Σ m w / Σ m; "sequence": mean over non-empty sequences of the sequence's token mean.
    agg = "token-mean" if mode == "token" else "seq-mean-token-mean"
    mean = aggregate(weights, mask, agg)
    return weights / torch.where(mean > 0, mean, torch.ones_like(mean))


def token_tis(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    cap: float | None = TOKEN_TIS_CAP,
    floor: float | None = None,
    renormalize: Renormalize | str | None = None,
) -> Corrected:
    """Token-level truncated importance sampling (TIS) [reference-code: verl ``rollout_is=token``, TRL].

    w_t = min(exp ℓ_t, C), or clamp(exp ℓ_t, C_min, C) with ``floor`` = C_min (TRL's ``clip_min``),
    computed in log space: w_t = exp(clamp(ℓ_t, log C_min, log C)). ``cap=None`` leaves the weight uncapped above
    (TRL's ``vllm_importance_sampling_clip_max=None``; only the e^{±20} guard applies). With ``renormalize`` (verl
    ``rollout_is_batch_normalize``), after truncation w ← w / mean(w), the mean over masked tokens (``"token"``) or over
    sequences of each sequence's token mean (``"sequence"``); the result can then exceed C. Nothing is masked.

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     bool or 0/1; returned unchanged (as bool)
    ``weights``     [B, T]     w_t on masked tokens, 0 elsewhere
    ==============  =========  ====================================================

    Metrics: ``is/weight_*``, ``is/truncated_frac`` (tokens clamped at C or at C_min).
    """
    check_bounds(floor, cap)
    check_choice("renormalize", renormalize, (*RENORMALIZE_MODES, None))
    m = as_bool_mask(mask)
    ell = log_ratio.detach()
    log_w, truncated = _clamp_log(ell, cap=cap, floor=floor)  # log w_t = clamp(ℓ_t, log C_min, log C)
    w = where_masked(safe_exp_(log_w), m)  # log_w is a fresh detached tensor: exponentiated in place
    if renormalize is not None:
        w = where_masked(_renormalize(w, m, renormalize), m)
    return Corrected(w, m, correction_metrics(weights=w, mask_in=m, mask_out=m, truncated=truncated))


def _clamp_log(
    log_w: Float[Tensor, "*shape"], *, cap: float | None, floor: float | None
) -> tuple[Float[Tensor, "*shape"], Bool[Tensor, "*shape"]]:
    """(clamp(log_w, log floor, log cap) as a fresh tensor, where a bound was active); None = that side absent."""
    out = log_w.clone()
    truncated = torch.zeros_like(log_w, dtype=torch.bool)
    if cap is not None:
        log_cap = log_bound(cap, like=log_w)
        truncated = truncated | (log_w > log_cap)
        out = out.clamp_(max=log_cap)  # min(ℓ, log C)
    if floor is not None:
        log_floor = log_bound(floor, like=log_w)
        truncated = truncated | (log_w < log_floor)
        out = out.clamp_(min=log_floor)  # max(·, log C_min)
    return out, truncated


def seq_tis(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    cap: float | None = SEQ_TIS_CAP,
    floor: float | None = None,
    ratio: SeqRatio | str = "product",
    renormalize: Renormalize | str | None = None,
) -> Corrected:
    """Sequence-level truncated importance sampling [exact: the VCPO baseline, arXiv 2602.17616].

    w̄_i = min(exp(S_i), C) = exp(min(S_i, log C)), S_i = Σ_t m_{i,t} ℓ_{i,t}, broadcast to the tokens of sequence i.
    Computed in log space (never a product of token ratios). Options, defaults unchanged:

    * ``floor`` C_min: w̄_i = exp(clamp(S_i, log C_min, log C)) (TRL ``vllm_importance_sampling_mode=
      "sequence_truncate"`` with ``vllm_importance_sampling_clip_min``);
    * ``cap=None``: no upper truncation, w̄_i = exp(S_i) (clamped at e^{±20} like every weight);
    * ``ratio="geometric"``: the geometric-mean ratio exp(S̄_i), S̄_i = S_i / L_i, truncated the same way (AReaL's
      ``rejection_sampling`` with ``level="sequence", metric="ratio", agg="mean", action="clamp"``);
    * ``renormalize`` as in :func:`token_tis` (verl; ``"sequence"`` divides by the mean of w̄ over non-empty
      sequences). Nothing is masked.

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     bool or 0/1; returned unchanged (as bool)
    ``weights``     [B, T]     w̄_i on the masked tokens of sequence i, 0 elsewhere
    ==============  =========  ====================================================

    Metrics: ``is/weight_*``, ``is/truncated_frac`` (tokens of sequences clamped at C or C_min),
    ``is/seq_truncated_frac`` (fraction of non-empty sequences truncated).
    """
    check_bounds(floor, cap)
    check_choice("ratio", ratio, SEQ_RATIOS)
    check_choice("renormalize", renormalize, (*RENORMALIZE_MODES, None))
    m = as_bool_mask(mask)
    ell = log_ratio.detach()
    S = seq_log_ratio(ell, m) if ratio == "product" else geo_log_ratio(ell, m)  # S_i = Σ_t m ℓ, or S̄_i
    log_w, seq_truncated = _clamp_log(S, cap=cap, floor=floor)  # log w̄_i = clamp(S_i, log C_min, log C)
    w = where_masked(broadcast_seq(safe_exp_(log_w), ell), m)
    if renormalize is not None:
        w = where_masked(_renormalize(w, m, renormalize), m)
    truncated = broadcast_keep(seq_truncated, m)
    metrics = correction_metrics(weights=w, mask_in=m, mask_out=m, truncated=truncated)
    nonempty = any_true(m, dim=-1)
    metrics["is/seq_truncated_frac"] = (
        (seq_truncated & nonempty).sum().to(w.dtype) / nonempty.sum().clamp(min=1).to(w.dtype)
    ).detach()
    return Corrected(w, m, metrics)


def _masked_correction(
    *,
    log_weight: Float[Tensor, "B _"],  # [B, T], or [B, 1] for a sequence-level weight
    keep: Bool[Tensor, "B T"],
    mask: Bool[Tensor, "B T"],
    weight: str,
) -> Corrected:
    """Shared tail of every masking correction: new mask = mask ∧ keep; weight exp(log_weight) or 1 on kept tokens.

    A sequence-level ``log_weight`` comes as [B, 1] and is exponentiated once per sequence, then broadcast.
    """
    check_choice("weight", weight, MIS_WEIGHTS)
    new_mask = mask & keep
    w = safe_exp(log_weight) if weight == "ratio" else torch.ones_like(log_weight)
    w = where_masked(w, new_mask)
    metrics = correction_metrics(weights=w, mask_in=mask, mask_out=new_mask)
    return Corrected(w, new_mask, metrics, unit_weights=weight == "one")


def token_mis(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    lower: float | None = TOKEN_MIS_LOWER,
    upper: float | None = TOKEN_MIS_UPPER,
    weight: MisWeight | str = "ratio",
) -> Corrected:
    """Token-level masked importance sampling [reference-code: verl ``rollout_rs=token``, TRL, AReaL].

    Keep token t iff exp(ℓ_t) ∈ [lower, upper], tested as log lower ≤ ℓ_t ≤ log upper; either bound may be None.
    Kept tokens carry exp(ℓ_t) (``weight="ratio"``) or 1 (``"one"``); dropped tokens leave the mask.

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     input mask (bool or 0/1)
    ``weights``     [B, T]     weight on kept tokens, 0 elsewhere
    ``mask`` (out)  [B, T]     mask ∧ (ratio in bounds)
    ==============  =========  ====================================================
    """
    check_bounds(lower, upper)
    m = as_bool_mask(mask)
    ell = log_ratio.detach()
    keep = in_log_bounds(ell, lower=lower, upper=upper)
    return _masked_correction(log_weight=ell, keep=keep, mask=m, weight=weight)


def seq_mis(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    lower: float | None = SEQ_MIS_LOWER,
    upper: float | None = SEQ_MIS_UPPER,
    weight: MisWeight | str = "ratio",
) -> Corrected:
    """Sequence-level masked importance sampling [reference-code: verl ``rollout_rs=sequence``, TRL].

    Keep sequence i iff exp(S_i) ∈ [lower, upper] (log lower ≤ S_i ≤ log upper), S_i = Σ_t m ℓ; kept tokens carry
    the sequence weight exp(S_i) (``"ratio"``, TRL keeps ρ; clamped at e^{±20}) or 1 (``"one"``). Bounds are on
    exp(S_i), not verl's flipped exp(−S_i): convert with :func:`flipped_bounds`.

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     input mask (bool or 0/1)
    ``weights``     [B, T]     exp(S_i) or 1 on kept sequences' tokens, 0 elsewhere
    ==============  =========  ====================================================
    """
    check_bounds(lower, upper)
    m = as_bool_mask(mask)
    ell = log_ratio.detach()
    S = seq_log_ratio(ell, m)  # S_i = Σ_t m ℓ
    keep = broadcast_keep(in_log_bounds(S, lower=lower, upper=upper), m)
    return _masked_correction(log_weight=S.unsqueeze(-1), keep=keep, mask=m, weight=weight)


def geo_mis(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    lower: float | None = GEO_MIS_LOWER,
    upper: float | None = GEO_MIS_UPPER,
    weight: MisWeight | str = "ratio",
) -> Corrected:
    """Geometric masked importance sampling [reference-code: verl ``rollout_rs=geometric``, AReaL's default test].

    Keep sequence i iff exp(S̄_i) ∈ [lower, upper], S̄_i = S_i / L_i the mean token log-ratio; kept tokens carry
    exp(S̄_i) (``"ratio"``; AReaL's sequence-level weight) or 1 (``"one"``). The tight default [0.999, 1.001]
    (verl preset) can mask everything at high lag (VCPO Fig. 4): ``loss/all_masked`` reports it.

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     input mask (bool or 0/1)
    ``weights``     [B, T]     exp(S̄_i) or 1 on kept sequences' tokens, 0 elsewhere
    ==============  =========  ====================================================
    """
    check_bounds(lower, upper)
    m = as_bool_mask(mask)
    ell = log_ratio.detach()
    S_bar = geo_log_ratio(ell, m)  # S̄_i = S_i / L_i
    keep = broadcast_keep(in_log_bounds(S_bar, lower=lower, upper=upper), m)
    return _masked_correction(log_weight=S_bar.unsqueeze(-1), keep=keep, mask=m, weight=weight)


def icepop(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    lower: float | None = ICEPOP_LOWER,
    upper: float | None = ICEPOP_UPPER,
    weight: MisWeight | str = "ratio",
) -> Corrected:
    """IcePop (arXiv 2510.18855) [reference-code]: token MIS with bounds [0.5, 5]; kept tokens carry the ratio.

    Same as :func:`token_mis` with IcePop's defaults (M(ρ) = ρ if ρ ∈ [α, β] else 0).
    """
    return token_mis(log_ratio=log_ratio, mask=mask, lower=lower, upper=upper, weight=weight)


def token_veto(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    threshold: float = TOKEN_VETO_THRESHOLD,
    weight: MisWeight | str = "one",
) -> Corrected:
    """Token veto [reference-code: verl ``rollout_token_veto_threshold``]: drop sequence i if any masked token has
    exp(ℓ_t) < threshold (tested as ℓ_t < log threshold, on the unclamped log-ratio).

    A pure rejection: kept tokens carry 1 by default; ``weight="ratio"`` gives them exp(ℓ_t) instead.

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     input mask (bool or 0/1)
    ``mask`` (out)  [B, T]     mask with vetoed sequences removed
    ==============  =========  ====================================================
    """
    check_bounds(threshold, None)
    m = as_bool_mask(mask)
    ell = log_ratio.detach()
    low = m & (ell < log_bound(threshold, like=ell))  # a catastrophic token: ρ_t < threshold
    keep = broadcast_keep(~any_true(low, dim=-1), m)
    return _masked_correction(log_weight=ell, keep=keep, mask=m, weight=weight)


class PrefixLogRatio(NamedTuple):
    """The prefix mean of a log-ratio and the prefix counts it divides by (both [B, T], detached)."""

    log_w: Float[Tensor, "B T"]
    """(1/n_t) Σ_{k≤t} m_k ℓ_k (0 before the first masked-in token)."""
    n: Float[Tensor, "B T"]
    """n_t = Σ_{k≤t} m_k, at least 1."""


def prefix_log_ratio(*, log_ratio: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"]) -> PrefixLogRatio:
    """log of the prefix geometric-mean ratio, log w_t = (1/n_t) Σ_{k≤t, m_k} ℓ_k (PNPO, arXiv 2608.01418), detached.

    n_t counts the masked-in tokens up to and including t: padding and tool tokens add neither to the sum nor to the
    count. Shared by :func:`prefix_ratio` and ``objectives.pnpo``.
    """
    m = as_bool_mask(mask)
    ell = where_masked(log_ratio.detach(), m)
    n = torch.cumsum(m, dim=-1, dtype=ell.dtype).clamp_(min=1)  # n_t = Σ_{k≤t} m_k (exact: counts < 2^24)
    return PrefixLogRatio(log_w=ell.cumsum(dim=-1).div_(n), n=n)  # (1/n_t) Σ_{k≤t} m_k ℓ_k


def prefix_ratio(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    cap: float | None = None,
) -> Corrected:
    """Prefix-normalized ratio as a detached weight on the proximal ratio, w_t = exp((1/n_t) Σ_{k≤t, m_k} ℓ_k).

    PNPO's weight (arXiv 2608.01418) on ℓ = log π_prox − log μ, as a correction on top of any objective: another
    reading of the paper, kept as the ``prefix_ratio`` correction. The paper's own objective (the weight of π_θ
    against μ, its hard-rejection gate, a REINFORCE-style surrogate) is ``objectives.pnpo``. Optional ``cap`` C:
    w_t = exp(min(mean, log C)). Nothing is masked.

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     bool or 0/1; returned unchanged (as bool)
    ``weights``     [B, T]     w_t on masked tokens, 0 elsewhere
    ==============  =========  ====================================================

    Metrics: ``is/weight_*``, ``is/truncated_frac`` (0 without a cap).
    """
    check_bounds(None, cap)
    m = as_bool_mask(mask)
    log_w = prefix_log_ratio(log_ratio=log_ratio, mask=m).log_w
    truncated = torch.zeros_like(m)
    if cap is not None:
        log_cap = log_bound(cap, like=log_w)
        truncated = log_w > log_cap
        log_w = log_w.clamp_(max=log_cap)
    w = where_masked(safe_exp_(log_w), m)  # log_w is a fresh detached tensor: exponentiated in place
    return Corrected(w, m, correction_metrics(weights=w, mask_in=m, mask_out=m, truncated=truncated))
