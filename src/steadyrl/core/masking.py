"""Masked reductions and loss aggregation, the building blocks every formula in ``steadyrl.core`` uses.

Values at masked-out positions may be anything (padding garbage, ``inf``, ``nan``): every helper selects with
``torch.where`` instead of multiplying by the mask, so they never leak into a result or a gradient.
No function here synchronizes with the host.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from steadyrl.core.types import LOG_RATIO_CLAMP

AggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"
]
AGG_MODES: tuple[str, ...] = get_args(AggMode)
#: Which rows a mean over sequences divides by: the non-empty ones (``skip``, the default) or all B (``count``).
EmptyRows = Literal["skip", "count"]
#: The modes that are a mean over sequences (``empty_rows`` applies to them only).
ROW_MEAN_MODES: tuple[str, ...] = ("seq-mean-token-mean", "seq-mean-token-sum")


def as_bool_mask(mask: Tensor) -> Bool[Tensor, "..."]:
    """Return ``mask`` as a bool tensor (accepts bool, integer or 0/1 float masks)."""
    return mask if mask.dtype == torch.bool else mask != 0


def any_true(x: Shaped[Tensor, "..."], dim: int | None = None, *, keepdim: bool = False) -> Bool[Tensor, "..."]:
    """``x.any(dim)`` (as bool), computed as a max reduction: the same result, several times faster on CPU, where
    PyTorch's bool ``any`` kernel is slow. An empty reduction, which ``amax`` refuses, falls back to ``any``."""
    x = as_bool_mask(x)
    if (x.numel() if dim is None else x.shape[dim]) == 0:
        return x.any() if dim is None else x.any(dim=dim, keepdim=keepdim)
    return x.amax() if dim is None else x.amax(dim=dim, keepdim=keepdim)


def where_masked(x: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """``x`` where ``mask`` holds, ``fill`` elsewhere (gradient-safe: masked positions get zero gradient)."""
    if x.is_floating_point():
        return torch.where(mask, x, fill)  # a Python scalar keeps x's dtype and allocates no [B, T] fill buffer
    return torch.where(mask, x, torch.full_like(x, fill))


def masked_sum(x: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"], dim: int | None = None) -> Tensor:
    """Sum of ``x`` over masked-in positions (all dims when ``dim`` is None)."""
    z = where_masked(x, mask)
    return z.sum() if dim is None else z.sum(dim=dim)


def masked_mean(x: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"], dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked-in positions; 0 (not NaN) where nothing is masked in."""
    # count_nonzero reduces a bool mask in place; mask.sum() first copies it to an int64 [B, T] tensor.
    n = torch.count_nonzero(mask) if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / n.clamp(min=1).to(x.dtype)


def masked_max(x: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"]) -> Tensor:
    """Max of ``x`` over masked-in positions (0 when none)."""
    m = where_masked(x, mask, fill=-torch.inf).amax()
    return torch.where(any_true(mask), m, torch.zeros_like(m))


def masked_min(x: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"]) -> Tensor:
    """Min of ``x`` over masked-in positions (0 when none)."""
    m = where_masked(x, mask, fill=torch.inf).amin()
    return torch.where(any_true(mask), m, torch.zeros_like(m))


def lengths(mask: Bool[Tensor, "B T"]) -> Float[Tensor, " B"]:
    """L_i: number of masked-in tokens of each sequence (float, for use as a divisor)."""
    return mask.sum(dim=-1).to(torch.get_default_dtype())


def clamp_log_ratio(log_ratio: Tensor, bound: float = LOG_RATIO_CLAMP) -> Tensor:
    """Clamp a log-ratio to ±``bound`` before it is exponentiated (docs/algorithms.md, log-space rules)."""
    return log_ratio.clamp(min=-bound, max=bound)


def safe_exp(log_ratio: Tensor, bound: float = LOG_RATIO_CLAMP) -> Tensor:
    """``exp(clamp(log_ratio, ±bound))``: a ratio materialized from a log-ratio without overflow."""
    # exp in place on the clamp's fresh output: one [B, T] buffer instead of two (clamp's backward needs its input,
    # not its output, so autograd allows it).
    return clamp_log_ratio(log_ratio, bound).exp_()


def safe_expm1(log_ratio: Tensor, bound: float = LOG_RATIO_CLAMP) -> Tensor:
    """``expm1(clamp(log_ratio, ±bound))`` = r − 1 without the cancellation of forming r first (r − 1 keeps its
    digits for |x| ≪ 1)."""
    return clamp_log_ratio(log_ratio, bound).expm1_()


def safe_exp_(log_ratio: Tensor, bound: float = LOG_RATIO_CLAMP) -> Tensor:
    """:func:`safe_exp` in place, for a fresh detached tensor the caller owns (no new [B, T] buffer); returns it."""
    return log_ratio.clamp_(min=-bound, max=bound).exp_()


def seq_log_ratio(log_ratio: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"]) -> Float[Tensor, " B"]:
    """S_i = Σ_t m_{i,t} ℓ_{i,t}: the sequence log-ratio (log of the product of token ratios)."""
    return masked_sum(log_ratio, mask, dim=-1)


def geo_log_ratio(log_ratio: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"]) -> Float[Tensor, " B"]:
    """S̄_i = S_i / L_i: the geometric-mean log-ratio (0 for an empty sequence)."""
    return masked_mean(log_ratio, mask, dim=-1)


def broadcast_seq(x: Float[Tensor, " B"], like: Shaped[Tensor, "B T"]) -> Float[Tensor, "B T"]:
    """Broadcast a per-sequence value to every token of its sequence (a view; ``like`` only gives the shape)."""
    return x.unsqueeze(-1).expand_as(like)


def aggregate(
    loss_tok: Float[Tensor, "B T"],
    mask: Bool[Tensor, "B T"],
    mode: AggMode | str,
    *,
    norm_len: float | None = None,
    empty_rows: EmptyRows = "skip",
    count_mask: Shaped[Tensor, "B T"] | None = None,
) -> Float[Tensor, ""]:
    """Reduce per-token losses to the scalar loss (verl's ``loss_agg_mode`` names).

    ====================================  =========================================================================
    ``token-mean``                        Σ_{i,t} m ℓ / Σ_{i,t} m (every token weighs the same)
    ``seq-mean-token-mean``               mean over non-empty sequences of (Σ_t m ℓ / L_i)
    ``seq-mean-token-sum``                mean over non-empty sequences of Σ_t m ℓ
    ``seq-mean-token-sum-norm``           Σ_{i,t} m ℓ / (B · norm_len), norm_len = T by default (Dr.GRPO,
                                          arXiv 2503.20783; TRL's ``dr_grpo``, SkyRL's ``seq_mean_token_sum_norm``,
                                          verl 0.9.1's trainer with ``loss_scale_factor`` = norm_len; verl's bare
                                          ``agg_loss`` without ``global_batch_size`` divides by |N| · norm_len)
    ``token-sum``                         Σ_{i,t} m ℓ, no normalization (verl 0.9.1 ``loss_agg_mode="token-sum"``)
    ====================================  =========================================================================

    Sequences with no masked-in token (padding rows, rejected sequences) are left out of the sequence means
    (``empty_rows="skip"``, the default; verl 0.9.1 ``agg_loss`` with ``global_batch_size=None``, OpenRLHF 0.11.2
    ``aggregate_loss``). ``empty_rows="count"`` divides the two sequence means by all B rows instead, trained or not:
    TRL 1.16.0 ``loss_type="grpo"`` (a plain ``.mean()`` over rows), SkyRL 0.3.0 ``loss_reduction="sequence_mean"``
    (advantages divided by the batch size), verl's trainer (``global_batch_size`` = the mini-batch size). It is refused
    for ``token-mean`` and ``token-sum`` (no rows) and ``seq-mean-token-sum-norm`` (always divided by B · norm_len).
    With nothing masked in, the result is an exact 0 that keeps the graph (zero gradients).

    ``count_mask`` (default ``mask``): the mask the denominators are counted on, while the sums run over ``mask``. Pass
    the mask from before the rejections (``mask`` ⊆ ``count_mask``) to keep rejected tokens in the denominator: the
    token count of ``token-mean`` (TRL ``dapo``/``bnpo``, AReaL's ``loss_mask_count``), each L_i and the non-empty rows
    of the sequence means (TRL ``grpo``, whose IS masking zeroes weights but keeps its mask).
    ``seq-mean-token-sum-norm`` divides by B · norm_len either way.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"loss aggregation mode {mode!r} is not one of {', '.join(AGG_MODES)}")
    if empty_rows != "skip" and (empty_rows != "count" or mode not in ROW_MEAN_MODES):
        raise ValueError(
            f"empty_rows={empty_rows!r}: 'count' divides a mean over sequences ({', '.join(ROW_MEAN_MODES)}) by all "
            f"B rows; mode={mode!r}"
        )
    counted = mask if count_mask is None else as_bool_mask(count_mask)  # where the denominators are counted
    if mode == "token-mean":
        return masked_sum(loss_tok, mask) / torch.count_nonzero(counted).clamp(min=1).to(loss_tok.dtype)
    if mode == "token-sum":
        return masked_sum(loss_tok, mask)
    if mode == "seq-mean-token-sum-norm":
        B, T = loss_tok.shape
        denom = B * (float(T) if norm_len is None else float(norm_len))
        return masked_sum(loss_tok, mask) / max(denom, 1.0)
    seq_sum = masked_sum(loss_tok, mask, dim=-1)
    L = counted.sum(dim=-1)
    per_seq = seq_sum / L.clamp(min=1).to(loss_tok.dtype) if mode == "seq-mean-token-mean" else seq_sum
    nonempty = L > 0
    total = where_masked(per_seq, nonempty).sum()
    if empty_rows == "count":
        return total / max(loss_tok.shape[0], 1)  # (1/B) Σ_{i∈N}: every row counts
    return total / nonempty.sum().clamp(min=1).to(loss_tok.dtype)  # (1/|N|) Σ_{i∈N}


def all_masked_flag(mask: Bool[Tensor, "..."]) -> Float[Tensor, ""]:
    """Metric ``loss/all_masked``: 1.0 when no token is trainable, else 0.0 (a tensor; no host sync)."""
    return (~any_true(mask)).to(torch.get_default_dtype())


def detach_metrics(metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    """Detach every metric tensor (metrics never carry a graph)."""
    return {k: v.detach() for k, v in metrics.items()}
