"""Ratio-based policy surrogates on the PPO ratio r = π_θ / π_prox: PPO-clip, REINFORCE and GSPO.

How these objectives differ from one another (docs/algorithms.md, "Policy objectives"):

1. ``ppo_clip_loss``: per-token ratio r_t, two-sided clip, optional dual clip for A < 0 [exact].
2. ``reinforce_loss``: no clip; −A·w·r has the value −A·w at the first update and the gradient −A·w·∇log π_θ.
3. ``gspo_loss``: one ratio per sequence, s_i = exp(mean_t log r_t), clipped with a tiny two-sided range and
   broadcast to the tokens [reference-code]; ``form="token"`` is the paper's GSPO-token variant (verl, SkyRL).

Every function takes the same keyword-only inputs (shapes below) and returns ``LossOutput``. A correction (TIS,
MIS, decoupled PPO's μ weight, ...) enters through ``weights`` (detached, multiplied per token) and ``mask``
(rejected tokens removed); the loss never recomputes it.

=================  ======  ==============================================================================
argument           shape   meaning
=================  ======  ==============================================================================
``logp``           [B, T]  log π_θ(y_t) of the sampled tokens (carries the gradient)
``prox_logp``      [B, T]  log π_prox(y_t), the proximal policy (detached here)
``advantages``     [B, T]  A_{i,t}; callers broadcast sequence advantages to the tokens
``mask``           [B, T]  tokens trained on (bool or 0/1)
``weights``        [B, T]  detached per-token importance weight w from a correction (default 1)
=================  ======  ==============================================================================

Values at masked-out positions may be garbage (nan, inf): every input is replaced there before any arithmetic, so
nothing leaks into the loss or its gradient.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    AggMode,
    EmptyRows,
    aggregate,
    all_masked_flag,
    any_true,
    as_bool_mask,
    broadcast_seq,
    detach_metrics,
    geo_log_ratio,
    masked_max,
    masked_mean,
    safe_exp,
    where_masked,
)
from steadyrl.core.types import LossOutput, Metrics

#: PPO's clip range ε (arXiv 1707.06347, §6.1 uses 0.2); also verl's and TRL's default.
PPO_CLIP_EPS: float = 0.2
#: verl's dual-clip constant c (``clip_ratio_c``), applied to A < 0 by default there. Not our default.
VERL_DUAL_CLIP_C: float = 3.0
#: GSPO's clip ranges (arXiv 2507.18071 v2, §5.1: "the left and right clipping ranges in Eq. (5) ... 3e-4 and 4e-4").
GSPO_CLIP_LOW: float = 3e-4
GSPO_CLIP_HIGH: float = 4e-4

#: verl 0.9.1 ``gspo`` and SkyRL 0.3.0 ``GSPO`` clamp the log of the GSPO-token ratio at +10 (upper only). Not ours.
VERL_GSPO_LOG_RATIO_CAP: float = 10.0

#: A clip range given as a Python float or as a 0-d tensor (e.g. from ``m2po.m2po_clip_range``).
ClipRange = float | Float[Tensor, ""]
#: What the REINFORCE surrogate multiplies −A·w by: the ratio r (ours) or log π_θ (verl's REINFORCE).
ReinforceSurrogate = Literal["ratio", "log_prob"]
#: GSPO's ratio: one value s_i per sequence with its gradient (``sequence``) or the GSPO-token form (``token``).
GspoForm = Literal["sequence", "token"]


class TokenInputs(NamedTuple):
    """Policy-loss inputs after masking: masked-out positions hold neutral values (log-ratio 0, A 0, w 1).

    ``weights`` is None when no correction weight was given (every w is 1: the losses skip the product).
    """

    mask: Bool[Tensor, "B T"]
    log_ratio: Float[Tensor, "B T"]
    advantages: Float[Tensor, "B T"]
    weights: Float[Tensor, "B T"] | None


class ClippedSurrogate(NamedTuple):
    """``loss`` = max(−A r, −A clip(r, lower, upper)); ``clipped`` marks where the clipped branch is the larger."""

    loss: Float[Tensor, "*shape"]
    clipped: Bool[Tensor, "*shape"]


def prepare_token_inputs(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
) -> TokenInputs:
    """Mask the inputs of a token-level policy loss: log r = log π_θ − log π_prox (π_prox detached), A, w (detached).

    Masked-out positions get log r = 0, A = 0 and w = 1 (``weights`` None stays None: all ones), so garbage there
    can reach neither the loss nor a gradient (the selection's backward sends exact zeros through the difference).
    """
    m = as_bool_mask(mask)
    log_ratio = where_masked(logp - prox_logp.detach(), m)  # log r = log π_θ − log π_prox
    adv = where_masked(advantages.detach(), m)
    w = None if weights is None else where_masked(weights.detach(), m, fill=1.0)
    return TokenInputs(mask=m, log_ratio=log_ratio, advantages=adv, weights=w)


def apply_weights(weights: Float[Tensor, "B T"] | None, x: Float[Tensor, "B T"]) -> Float[Tensor, "B T"]:
    """w · x, or x itself when there is no weight (w = 1: the same values without a [B, T] product)."""
    return x if weights is None else weights * x


def clipped_surrogate(
    *,
    ratio: Float[Tensor, "*shape"],
    advantages: Float[Tensor, "*shape"],
    lower: Float[Tensor, ""],
    upper: Float[Tensor, ""],
) -> ClippedSurrogate:
    """PPO's pessimistic surrogate, elementwise: max(−A r, −A clip(r, lower, upper)) (arXiv 1707.06347, Eq. 7)."""
    neg_adv = -advantages
    pg_unclipped = neg_adv * ratio  # −A r
    pg_clipped = neg_adv * torch.clamp(ratio, min=lower, max=upper)  # −A clip(r, 1−ε_low, 1+ε_high)
    return ClippedSurrogate(loss=torch.maximum(pg_unclipped, pg_clipped), clipped=pg_clipped > pg_unclipped)


def as_scalar(value: ClipRange, *, like: Tensor) -> Float[Tensor, ""]:
    """A Python float or 0-d tensor as a detached 0-d tensor of ``like``'s dtype and device."""
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).detach()


def ratio_metrics(ratio: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"]) -> Metrics:
    """``loss/ratio_mean`` and ``loss/ratio_max`` over masked-in positions (0 when none)."""
    return {"loss/ratio_mean": masked_mean(ratio, mask), "loss/ratio_max": masked_max(ratio, mask)}


def mask_frac(flags: Bool[Tensor, "B T"], mask: Bool[Tensor, "B T"]) -> Float[Tensor, ""]:
    """Fraction of masked-in positions where ``flags`` holds (0 when none); counted, not summed as floats."""
    dtype = torch.get_default_dtype()
    return torch.count_nonzero(flags & mask).to(dtype) / torch.count_nonzero(mask).clamp(min=1).to(dtype)


def capped_exp(log_ratio: Tensor, cap: float | None = None) -> Tensor:
    """exp of a log-ratio: clamped to ±20 first (``masking.safe_exp``), or, with ``cap``, capped above at ``cap`` only
    (verl's and SkyRL's GSPO ratio, ``log s ≤ 10``; no lower bound, where exp underflows to 0 harmlessly)."""
    return safe_exp(log_ratio) if cap is None else log_ratio.clamp(max=cap).exp()


def ppo_clip_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    clip_low: ClipRange = PPO_CLIP_EPS,
    clip_high: ClipRange = PPO_CLIP_EPS,
    dual_clip: float | None = None,
    agg: AggMode | str = "token-mean",
    norm_len: float | None = None,
    empty_rows: EmptyRows = "skip",
    count_mask: Shaped[Tensor, "B T"] | None = None,
) -> LossOutput:
    """PPO-clip surrogate (Schulman et al., arXiv 1707.06347, Eq. 7) with asymmetric ranges and optional dual clip.

    [exact] Per token, with r = exp(clamp(log π_θ − log π_prox, ±20)) and w the detached correction weight::

        L_t = w_t · max(−A_t r_t, −A_t clip(r_t, 1 − ε_low, 1 + ε_high))
        dual clip (A_t < 0 only):  L_t ← w_t · min(max(...), −c·A_t)

    ``clip_high > clip_low`` is DAPO's "clip-higher" (arXiv 2503.14476). Both ranges may be Python floats or 0-d
    tensors (``m2po.m2po_clip_range`` returns tensors; an infinite range switches that side's clip off).

    Dual clip (Ye et al., arXiv 1912.09729) bounds the loss of a negative-advantage token whose ratio exploded:
    ``dual_clip=None`` (default) is off, as in TRL, which has none; verl applies it by default with c = 3
    (``VERL_DUAL_CLIP_C``). c must exceed 1.

    Reduction: ``masking.aggregate(L, mask, agg, norm_len=norm_len, empty_rows=empty_rows)`` (default
    ``token-mean``; ``empty_rows="count"`` divides a sequence mean by all B rows, TRL's ``loss_type="grpo"`` and SkyRL's
    ``sequence_mean``; ``count_mask``: the mask the denominators are counted on, e.g. the one from before the
    rejections, TRL ``dapo`` and AReaL). Shapes: see the module table; the result is a 0-d loss.

    Frameworks (``tests/parity/test_ppo.py``): verl 0.9.1 ``vanilla`` is ``dual_clip=3`` (its ``clip_ratio_c``, always
    on); TRL 1.16.0's ``delta`` (INTELLECT-2's upper bound on r) equals ``dual_clip=delta`` whenever delta ≥ 1 + ε_high.

    Metrics: ``loss/policy``, ``loss/clip_frac`` (fraction of masked-in tokens where the clipped branch is the larger
    one, so its gradient is zero), ``loss/dual_clip_frac`` (when dual clip is on), ``loss/ratio_mean``,
    ``loss/ratio_max``, ``loss/all_masked``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (verl uses {VERL_DUAL_CLIP_C}); got {dual_clip}")
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    ratio = safe_exp(x.log_ratio)  # r = π_θ / π_prox, from a log-ratio clamped to ±20
    lower = 1.0 - as_scalar(clip_low, like=ratio)
    upper = 1.0 + as_scalar(clip_high, like=ratio)
    surrogate = clipped_surrogate(ratio=ratio, advantages=x.advantages, lower=lower, upper=upper)
    loss_tok = surrogate.loss
    metrics: Metrics = {"loss/clip_frac": mask_frac(surrogate.clipped, x.mask)}
    if dual_clip is not None:
        dual_cap = -dual_clip * x.advantages  # −c·A
        dual_active = (x.advantages < 0) & (dual_cap < loss_tok)
        loss_tok = torch.where(dual_active, dual_cap, loss_tok)  # L ← min(L, −c·A) where A < 0
        metrics["loss/dual_clip_frac"] = mask_frac(dual_active, x.mask)
    loss = aggregate(  # w·L
        apply_weights(x.weights, loss_tok), x.mask, agg, norm_len=norm_len, empty_rows=empty_rows, count_mask=count_mask
    )
    metrics |= ratio_metrics(ratio, x.mask)
    metrics |= {"loss/policy": loss, "loss/all_masked": all_masked_flag(x.mask)}
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))


def reinforce_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    agg: AggMode | str = "token-mean",
    norm_len: float | None = None,
    empty_rows: EmptyRows = "skip",
    count_mask: Shaped[Tensor, "B T"] | None = None,
    surrogate: ReinforceSurrogate = "ratio",
) -> LossOutput:
    """REINFORCE surrogate on the proximal ratio (Williams 1992; the form VCPO, arXiv 2602.17616, trains with).

    Per token, with r = exp(clamp(log π_θ − log π_prox, ±20)) (no clip)::

        L_t = −A_t · w_t · r_t,     ∇L_t = −A_t · w_t · r_t · ∇log π_θ(y_t)

    At the first update π_θ = π_prox, so r = 1 in value and the gradient is −A·w·∇log π_θ. verl's form
    −A·w·log π_θ has the same gradient there but other loss values: ``surrogate="log_prob"`` computes it,
    L_t = −A_t · w_t · log π_θ(y_t) (verl 0.9.1 ``compute_policy_loss_reinforce``, its bypass-mode REINFORCE; the
    gradient is −A·w·∇log π_θ at every update, without the factor r).

    Reduction: ``masking.aggregate(L, mask, agg, norm_len=norm_len, empty_rows=empty_rows, count_mask=count_mask)``
    (VCPO uses ``seq-mean-token-mean``; ``count_mask``: the mask the denominators are counted on, e.g. the one from
    before the rejections).
    Metrics: ``loss/policy``, ``loss/ratio_mean``, ``loss/ratio_max``, ``loss/all_masked``.
    """
    if surrogate not in ("ratio", "log_prob"):
        raise ValueError(f"surrogate={surrogate!r} is not one of 'ratio', 'log_prob'")
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    ratio = safe_exp(x.log_ratio)  # r = π_θ / π_prox (1 in value at the first update)
    neg_adv_w = apply_weights(x.weights, -x.advantages)
    term = ratio if surrogate == "ratio" else where_masked(logp, x.mask)  # r, or log π_θ (verl's form)
    loss = aggregate(  # −A·w·r or −A·w·log π_θ
        neg_adv_w * term, x.mask, agg, norm_len=norm_len, empty_rows=empty_rows, count_mask=count_mask
    )
    metrics: Metrics = ratio_metrics(ratio, x.mask)
    metrics |= {"loss/policy": loss, "loss/all_masked": all_masked_flag(x.mask)}
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))


def gspo_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    clip_low: ClipRange = GSPO_CLIP_LOW,
    clip_high: ClipRange = GSPO_CLIP_HIGH,
    agg: AggMode | str = "seq-mean-token-mean",
    norm_len: float | None = None,
    empty_rows: EmptyRows = "skip",
    count_mask: Shaped[Tensor, "B T"] | None = None,
    form: GspoForm = "sequence",
    log_ratio_cap: float | None = None,
) -> LossOutput:
    """GSPO, Group Sequence Policy Optimization (Zheng et al., arXiv 2507.18071, Eq. 5 and its s_i definition).

    [reference-code] (TRL/AReaL ``importance_sampling_level="sequence"``). One ratio per sequence, the geometric
    mean of its token ratios, *with* gradient, clipped two-sided and broadcast to the tokens::

        s_i = exp(clamp((1/L_i) Σ_t m_{i,t} (log π_θ − log π_prox), ±20))
        L_{i,t} = w_{i,t} · max(−A_{i,t} s_i, −A_{i,t} clip(s_i, 1 − ε_low, 1 + ε_high))

    Defaults ε_low = 3e-4, ε_high = 4e-4 are the paper's (§5.1, v2); the GRPO baseline there used 0.2 / 0.27.
    ∂s_i/∂log π_θ(y_{i,t}) = s_i / L_i: every token of a sequence shares the same gradient scale.

    ``form="token"`` is the paper's GSPO-token ratio (§4.3), the form verl 0.9.1 ``gspo`` and SkyRL 0.3.0 ``GSPO``
    compute: s_{i,t} = sg[s_i] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})], the value of s_i with the gradient of the token's own
    log-probability, ∂s_{i,t}/∂log π_θ(y_{i,t}) = s_i. Both forms give the same loss, and the same gradient when A and
    w are constant over each sequence; with token-level A or w the token form weighs each token by its own A_t w_t
    where the sequence form spreads the row's mean over the tokens. ``log_ratio_cap`` replaces the ±20 clamp of log s
    by an upper cap only (verl and SkyRL: ``log s ≤ 10``, :data:`VERL_GSPO_LOG_RATIO_CAP`, no lower bound): the loss
    then saturates (zero gradient) above exp(cap).

    Reduction: the paper averages over sequences, (1/G) Σ_i, which ``seq-mean-token-mean`` reproduces for
    sequence-level advantages; that is this function's default (TRL's GSPO recipe and verl's agree). Any
    ``masking.aggregate`` mode may be passed, with ``empty_rows`` (``count``: TRL ``loss_type="grpo"``, SkyRL
    ``sequence_mean``). Shapes: see the module table.

    Metrics: ``loss/policy``, ``loss/clip_frac`` (fraction of masked-in tokens whose sequence ratio is clipped),
    ``loss/ratio_mean`` / ``loss/ratio_max`` (of s_i over non-empty sequences), ``loss/all_masked``.
    """
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    log_s = geo_log_ratio(x.log_ratio, x.mask)  # log s_i = mean_t log r_{i,t}, with gradient
    if form == "sequence":
        seq_ratio = capped_exp(log_s, log_ratio_cap)  # s_i, with gradient
        ratio_tok = broadcast_seq(seq_ratio, like=x.log_ratio)  # s_i on every token of sequence i
    elif form == "token":  # GSPO-token: the value of log s_i, the gradient of the token's own log π_θ
        log_s_tok = broadcast_seq(log_s.detach(), like=x.log_ratio) + (x.log_ratio - x.log_ratio.detach())
        ratio_tok = capped_exp(log_s_tok, log_ratio_cap)
        seq_ratio = capped_exp(log_s.detach(), log_ratio_cap)
    else:
        raise ValueError(f"form={form!r} is not one of 'sequence', 'token'")
    lower = 1.0 - as_scalar(clip_low, like=ratio_tok)
    upper = 1.0 + as_scalar(clip_high, like=ratio_tok)
    surrogate = clipped_surrogate(ratio=ratio_tok, advantages=x.advantages, lower=lower, upper=upper)
    loss_tok = apply_weights(x.weights, surrogate.loss)  # w · L
    loss = aggregate(loss_tok, x.mask, agg, norm_len=norm_len, empty_rows=empty_rows, count_mask=count_mask)
    nonempty = any_true(x.mask, dim=-1, keepdim=True)  # [B, 1]: sequence-level statistics as a one-token "batch"
    metrics: Metrics = ratio_metrics(seq_ratio.unsqueeze(-1), nonempty)
    metrics |= {
        "loss/clip_frac": mask_frac(surrogate.clipped, x.mask),
        "loss/policy": loss,
        "loss/all_masked": all_masked_flag(x.mask),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
