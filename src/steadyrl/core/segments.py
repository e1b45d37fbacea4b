"""Turn segments of multi-turn rollouts and segment-level importance weights (ROLL's ``weight_type="segment"``).

A **segment** is a maximal run of consecutive masked-in tokens of one sequence: in a multi-turn rollout the tool /
observation tokens between two assistant turns are outside the trained ``mask``, so each run of trained tokens is one
turn (ROLL: "each run of consecutive 1s of ``response_mask``"). A single-turn response is one segment, so segment
statistics reduce to sequence statistics there.

Segment TIS [reference-code: ROLL ``roll/utils/train_infer_corrections.py`` ``compute_train_infer_correction`` with
``train_infer_correction.is_weight.weight_type=segment``, segment means by ``roll/pipeline/agentic/utils.py``
``compute_segment_masked_mean``; alibaba/ROLL at commit 8eb27cc]: with ℓ = log π_prox − log μ (ROLL's
``old_log_probs − infer_log_probs``) and segment s of sequence i,

    w_t = min(exp((1/|s|) Σ_{u∈s} ℓ_u), C)   for every token t of s        (the segment's geometric-mean ratio)

broadcast to the segment's tokens and detached; C = 1.2 is ROLL's ``is_weight.upper_bound`` default (``None``: no cap).
ROLL clamps to [0, C]; a ratio is never negative, so the 0 changes nothing. ROLL divides the segment sum by
|s| + 1e-8: a relative 1e-8 on the mean log-ratio, which steadyrl leaves out.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from steadyrl.core.importance_weights import correction_metrics
from steadyrl.core.masking import any_true, as_bool_mask, masked_mean, safe_exp, where_masked
from steadyrl.core.types import Corrected

#: ROLL's segment IS cap (``TrainInferISWeightConfig.upper_bound`` default).
SEGMENT_TIS_CAP: float = 1.2


def segment_index(mask: Shaped[Tensor, "B T"]) -> Int[Tensor, "B T"]:
    """Index of each token's segment within its sequence (0, 1, ...); −1 before a sequence's first masked-in token.

    A masked-out position carries the index of the segment before it (it belongs to none: read it under the mask).
    """
    m = as_bool_mask(mask)
    prev = torch.nn.functional.pad(m[:, :-1], (1, 0), value=False)
    starts = m & ~prev  # a run of masked-in tokens begins here
    return starts.cumsum(dim=-1) - 1


def segment_count(mask: Shaped[Tensor, "B T"]) -> Int[Tensor, " B"]:
    """Number of segments (turns) of each sequence (0 for an empty one)."""
    return segment_index(mask)[:, -1] + 1


def segment_mean(x: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"]) -> Float[Tensor, "B T"]:
    """Mean of ``x`` over each token's segment, on every token of that segment; 0 outside the mask.

    Computed without a loop over segments: per-segment sums and counts by ``scatter_add`` into a [B, T] table (a row
    has at most T segments), read back with ``gather``. Values of ``x`` outside the mask are never read.
    """
    m = as_bool_mask(mask)
    idx = segment_index(m).clamp(min=0)  # masked-out leading positions point at segment 0 with a zero contribution
    vals = where_masked(x, m)
    sums = torch.zeros_like(vals).scatter_add(-1, idx, vals)
    counts = torch.zeros_like(vals).scatter_add(-1, idx, m.to(vals.dtype))
    mean = sums.gather(-1, idx) / counts.gather(-1, idx).clamp(min=1.0)
    return where_masked(mean, m)


def segment_tis(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    cap: float | None = SEGMENT_TIS_CAP,
) -> Corrected:
    """Segment-level truncated importance weights (module docstring; ROLL ``weight_type="segment"``).

    ==============  =========  ====================================================
    ``log_ratio``   [B, T]     ℓ = log π_prox − log μ (detached here)
    ``mask``        [B, T]     bool or 0/1; its runs are the segments; returned unchanged (as bool)
    ``weights``     [B, T]     min(exp(segment mean of ℓ), C) on masked tokens, 0 elsewhere
    ==============  =========  ====================================================

    Metrics: ``is/weight_*``, ``is/truncated_frac`` (tokens whose segment weight hit C) and ``is/segments_mean``
    (segments per non-empty sequence).
    """
    if cap is not None and cap <= 0:
        raise ValueError(f"cap must be > 0 (ROLL's upper_bound; None for no cap), got {cap}")
    m = as_bool_mask(mask)
    w = safe_exp(segment_mean(log_ratio.detach(), m))  # exp of the segment's mean log-ratio (1 off the mask)
    truncated = torch.zeros_like(m) if cap is None else m & (w > cap)
    if cap is not None:
        w = w.clamp(max=cap)
    w = where_masked(w, m)
    metrics = correction_metrics(weights=w, mask_in=m, mask_out=m, truncated=truncated)
    counts = segment_count(m).to(w.dtype).unsqueeze(0)
    metrics["is/segments_mean"] = masked_mean(counts, any_true(m, dim=-1).unsqueeze(0)).detach()
    return Corrected(w, m, metrics)
