"""Ratio-based policy surrogates on the PPO ratio r = π_θ / π_prox: PPO-clip, REINFORCE and GSPO.

How these objectives differ from one another (ALGORITHMS.md, "Policy objectives and corrections"):

1. ``ppo_clip_loss``: per-token ratio r_t, two-sided clip, optional dual clip for A < 0 [exact].
2. ``reinforce_loss``: no clip; −A·w·r has the value −A·w at the first update and the gradient −A·w·∇log π_θ.
3. ``gspo_loss``: one ratio per sequence, s_i = exp(mean_t log r_t), clipped with a tiny two-sided range and
   broadcast to the tokens [reference-code].

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

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    AggMode,
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

#: A clip range given as a Python float or as a 0-d tensor (e.g. from ``m2po.m2po_clip_range``).
ClipRange = float | Float[Tensor, ""]


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

    Reduction: ``masking.aggregate(L, mask, agg, norm_len=norm_len)`` (default ``token-mean``). Shapes: see the
    module table; the result is a 0-d loss.

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
    loss = aggregate(apply_weights(x.weights, loss_tok), x.mask, agg, norm_len=norm_len)  # w · L, reduced by ``agg``
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
) -> LossOutput:
    """REINFORCE surrogate on the proximal ratio (Williams 1992; the form VCPO, arXiv 2602.17616, trains with).

    Per token, with r = exp(clamp(log π_θ − log π_prox, ±20)) (no clip)::

        L_t = −A_t · w_t · r_t,     ∇L_t = −A_t · w_t · r_t · ∇log π_θ(y_t)

    At the first update π_θ = π_prox, so r = 1 in value and the gradient is −A·w·∇log π_θ. verl's form
    −A·w·log π_θ has the same gradient there but other loss values: compare gradients, not losses, across
    implementations (ALGORITHMS.md, "REINFORCE surrogate").

    Reduction: ``masking.aggregate(L, mask, agg, norm_len=norm_len)`` (VCPO uses ``seq-mean-token-mean``).
    Metrics: ``loss/policy``, ``loss/ratio_mean``, ``loss/ratio_max``, ``loss/all_masked``.
    """
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    ratio = safe_exp(x.log_ratio)  # r = π_θ / π_prox (1 in value at the first update)
    loss = aggregate(apply_weights(x.weights, -x.advantages) * ratio, x.mask, agg, norm_len=norm_len)  # −A·w·r
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
) -> LossOutput:
    """GSPO, Group Sequence Policy Optimization (Zheng et al., arXiv 2507.18071, Eq. 5 and its s_i definition).

    [reference-code] (TRL/AReaL ``importance_sampling_level="sequence"``). One ratio per sequence, the geometric
    mean of its token ratios, *with* gradient, clipped two-sided and broadcast to the tokens::

        s_i = exp(clamp((1/L_i) Σ_t m_{i,t} (log π_θ − log π_prox), ±20))
        L_{i,t} = w_{i,t} · max(−A_{i,t} s_i, −A_{i,t} clip(s_i, 1 − ε_low, 1 + ε_high))

    Defaults ε_low = 3e-4, ε_high = 4e-4 are the paper's (§5.1, v2); the GRPO baseline there used 0.2 / 0.27.
    ∂s_i/∂log π_θ(y_{i,t}) = s_i / L_i: every token of a sequence shares the same gradient scale.

    Reduction: the paper averages over sequences, (1/G) Σ_i, which ``seq-mean-token-mean`` reproduces for
    sequence-level advantages; that is this function's default (TRL's GSPO recipe and verl's agree). Any
    ``masking.aggregate`` mode may be passed. Shapes: see the module table.

    Metrics: ``loss/policy``, ``loss/clip_frac`` (fraction of masked-in tokens whose sequence ratio is clipped),
    ``loss/ratio_mean`` / ``loss/ratio_max`` (of s_i over non-empty sequences), ``loss/all_masked``.
    """
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    seq_ratio = safe_exp(geo_log_ratio(x.log_ratio, x.mask))  # s_i = exp(mean_t log r_{i,t}), with gradient
    ratio_tok = broadcast_seq(seq_ratio, like=x.log_ratio)  # s_i on every token of sequence i
    lower = 1.0 - as_scalar(clip_low, like=ratio_tok)
    upper = 1.0 + as_scalar(clip_high, like=ratio_tok)
    surrogate = clipped_surrogate(ratio=ratio_tok, advantages=x.advantages, lower=lower, upper=upper)
    loss = aggregate(apply_weights(x.weights, surrogate.loss), x.mask, agg, norm_len=norm_len)  # w · L
    nonempty = any_true(x.mask, dim=-1, keepdim=True)  # [B, 1]: sequence-level statistics as a one-token "batch"
    metrics: Metrics = ratio_metrics(seq_ratio.unsqueeze(-1), nonempty)
    metrics |= {
        "loss/clip_frac": mask_frac(surrogate.clipped, x.mask),
        "loss/policy": loss,
        "loss/all_masked": all_masked_flag(x.mask),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
