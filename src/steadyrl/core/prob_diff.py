"""ROLL's probability-difference filters: keep tokens whose π_prox(y) − μ(y) statistic lies in [lower, upper].

ROLL (alibaba/ROLL, ``roll/utils/train_infer_corrections.py``, ``train_infer_correction.filters`` with
``diff_enabled``; not installed here, read from its public repository, no paper) measures the train/inference
mismatch in probability space, d_t = π_prox(y_t) − μ(y_t) (signed), and aggregates it at one of four levels::

    token      s_t = d_t
    geometric  s_t = mean_{k∈i} d_k               (ROLL's name: the masked mean over the sequence)
    sequence   s_t = Σ_{k∈i} d_k
    segment    s_t = mean_{k∈seg(t)} d_k          (a segment: a run of masked-in tokens, one turn)

and keeps token t iff lower ≤ s_t ≤ upper; the others leave the mask (a pure mask: kept tokens carry weight 1).
Probabilities are exp of the log-probs (≤ 0 enforced), so ±1000 log-ratios stay finite.
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.importance_weights import correction_metrics
from steadyrl.core.masking import as_bool_mask, broadcast_seq, masked_mean, masked_sum, where_masked
from steadyrl.core.segments import segment_mean
from steadyrl.core.types import Corrected

ProbDiffLevel = Literal["token", "geometric", "sequence", "segment"]
PROB_DIFF_LEVELS: tuple[str, ...] = ("token", "geometric", "sequence", "segment")


def prob_diff_statistic(
    *, prox_logp: Float[Tensor, "B T"], behav_logp: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"], level: str
) -> Float[Tensor, "B T"]:
    """s_t of ``level`` (module table) on every masked-in token, 0 elsewhere; detached."""
    if level not in PROB_DIFF_LEVELS:
        raise ValueError(f"level={level!r} is not one of {', '.join(PROB_DIFF_LEVELS)}")
    m = as_bool_mask(mask)
    p = torch.where(m, prox_logp.detach(), 0.0).clamp(max=0.0).exp()
    q = torch.where(m, behav_logp.detach(), 0.0).clamp(max=0.0).exp()
    d = where_masked(p - q, m)  # d_t = π_prox(y_t) − μ(y_t)
    if level == "token":
        return d
    if level == "segment":
        return segment_mean(d, m)
    per_seq = masked_mean(d, m, dim=-1) if level == "geometric" else masked_sum(d, m, dim=-1)
    return where_masked(broadcast_seq(per_seq, m), m)


def prob_diff_filter(
    *,
    prox_logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    level: ProbDiffLevel | str = "token",
    lower: float | None = None,
    upper: float | None = None,
) -> Corrected:
    """ROLL's difference filter [reference-code: its public ``compute_train_infer_correction``, not installed].

    Keep token t iff ``lower ≤ s_t ≤ upper`` (``None``: no bound on that side), s_t the ``level`` statistic of
    d = π_prox(y) − μ(y). Returns a pure mask (weights 1) and ``is/`` correction metrics.
    """
    m = as_bool_mask(mask)
    s = prob_diff_statistic(prox_logp=prox_logp, behav_logp=behav_logp, mask=m, level=level)
    keep = torch.ones_like(m)
    if lower is not None:
        keep = keep & (s >= lower)
    if upper is not None:
        keep = keep & (s <= upper)
    new_mask = m & keep
    w = where_masked(torch.ones_like(s), new_mask)
    return Corrected(w, new_mask, correction_metrics(weights=w, mask_in=m, mask_out=new_mask), unit_weights=True)
