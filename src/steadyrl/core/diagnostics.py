"""Staleness diagnostics every run logs (docs/algorithms.md, "Diagnostics"): ESS, weights, mismatch KL, lag.

One call per optimizer minibatch; all values are detached 0-d tensors (no host sync), ready for the metrics sink.
ESS comes from ``ess.py`` and KL from ``kl.py``: nothing is recomputed differently here.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from steadyrl.core.ess import sequence_ess, token_ess
from steadyrl.core.importance_weights import SEQ_TIS_CAP, check_bounds, log_bound
from steadyrl.core.kl import mismatch_kl
from steadyrl.core.masking import (
    any_true,
    as_bool_mask,
    detach_metrics,
    masked_max,
    masked_mean,
    masked_min,
    safe_exp,
    where_masked,
)
from steadyrl.core.types import Metrics


def _seq_mean(x: Float[Tensor, " B"], valid: Bool[Tensor, " B"]) -> Float[Tensor, ""]:
    return masked_mean(x.unsqueeze(0), valid.unsqueeze(0))


def _seq_max(x: Float[Tensor, " B"], valid: Bool[Tensor, " B"]) -> Float[Tensor, ""]:
    return masked_max(x.unsqueeze(0), valid.unsqueeze(0))


def _seq_min(x: Float[Tensor, " B"], valid: Bool[Tensor, " B"]) -> Float[Tensor, ""]:
    return masked_min(x.unsqueeze(0), valid.unsqueeze(0))


def lag_metrics(
    *,
    versions: Int[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    learner_version: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Metrics:
    """Per-token lag = learner_version − v_{i,t} over masked tokens (PipelineRL-k: lag k means version t − k).

    With ``learner_version`` None the newest masked version in the batch stands in for it (lags are then relative
    to the freshest data, a lower bound on the true lag).

    ===========================  ======================================================================
    ``lag/mean|max|min``         over masked tokens
    ``lag/oldest_token_mean``    mean over non-empty sequences of each sequence's oldest token lag (max)
    ``lag/newest_token_mean``    mean over non-empty sequences of each sequence's newest token lag (min)
    ===========================  ======================================================================

    With in-flight weight updates one response mixes versions: oldest and newest differ.
    """
    m = as_bool_mask(mask)
    v = versions.to(dtype)
    ref = masked_max(v, m) if learner_version is None else v.new_full((), learner_version)
    lag = ref - v  # lag_{i,t} = learner_version − v_{i,t}
    nonempty = any_true(m, dim=-1)
    oldest = where_masked(lag, m, fill=-torch.inf).amax(dim=-1)  # max lag in sequence i
    newest = where_masked(lag, m, fill=torch.inf).amin(dim=-1)  # min lag in sequence i
    return detach_metrics(
        {
            "lag/mean": masked_mean(lag, m),
            "lag/max": _seq_max(oldest, nonempty),  # the batch max is the max of the sequence maxima
            "lag/min": _seq_min(newest, nonempty),
            "lag/oldest_token_mean": _seq_mean(oldest, nonempty),
            "lag/newest_token_mean": _seq_mean(newest, nonempty),
        }
    )


def staleness_diagnostics(
    *,
    logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    versions: Int[Tensor, "B T"] | None = None,
    learner_version: int | None = None,
    cap: float = SEQ_TIS_CAP,
) -> Metrics:
    """Mismatch and staleness metrics of a batch [exact formulas from VCPO arXiv 2602.17616 and docs/algorithms.md].

    ℓ = logp − behav_logp with ``logp`` the proximal (or, detached, the current) policy; S_i = Σ_t m ℓ.

    =============================  ================================================================================
    ``is/ess_ratio``               sequence ESS / B_valid of unclipped w_i = exp(S_i) (``ess.sequence_ess``)
    ``is/ess_ratio_token``         token ESS / #tokens of exp(ℓ_t) (``ess.token_ess``)
    ``is/weight_min|mean|max``     over non-empty sequences of exp(S_i), clamped to e^{±20} for display
    ``is/log_weight_max``          max_i S_i (unclamped)
    ``is/seq_truncated_frac``      fraction of non-empty sequences with exp(S_i) > ``cap`` (seq-TIS would clip)
    ``kl/k1``, ``kl/k3``           mismatch KL(μ‖π) token means, verl convention (``kl.mismatch_kl``)
    ``kl/max_abs_logp_diff``       max over masked tokens of |ℓ_t|
    ``lag/...``                    when ``versions`` is given: see :func:`lag_metrics`
    =============================  ================================================================================

    ==================  =========  =========================================
    ``logp``            [B, T]     log π_prox or log π_θ (detached here)
    ``behav_logp``      [B, T]     log μ
    ``mask``            [B, T]     bool or 0/1
    ``versions``        [B, T]     int policy version of each token
    ==================  =========  =========================================
    """
    check_bounds(None, cap)
    m = as_bool_mask(mask)
    ell = where_masked(logp.detach() - behav_logp.detach(), m)  # ℓ = log π − log μ, 0 off the mask
    S = ell.sum(dim=-1)  # S_i = Σ_t m ℓ (``masking.seq_log_ratio``; ℓ is already masked)
    nonempty = any_true(m, dim=-1)
    seq_ess = sequence_ess(log_weights=S, valid=nonempty)
    tok_ess = token_ess(log_ratio=ell, mask=m)
    kl = mismatch_kl(log_ratio=ell, mask=m)
    w_display = safe_exp(S)  # exp(S_i), clamped to e^{±20}
    n_seq = nonempty.sum().clamp(min=1).to(S.dtype)
    metrics: Metrics = {
        "is/ess_ratio": seq_ess.ess_ratio,
        "is/ess_ratio_token": tok_ess.ess_ratio,
        "is/weight_min": _seq_min(w_display, nonempty),
        "is/weight_mean": _seq_mean(w_display, nonempty),
        "is/weight_max": _seq_max(w_display, nonempty),
        "is/log_weight_max": _seq_max(S, nonempty),
        "is/seq_truncated_frac": (nonempty & (log_bound(cap, like=S) < S)).sum().to(S.dtype) / n_seq,
        "kl/k1": kl.metrics["kl/k1"],
        "kl/k3": kl.metrics["kl/k3"],
        "kl/max_abs_logp_diff": ell.abs().amax(),  # ℓ = 0 off the mask: the masked max of |ℓ| (0 when empty)
    }
    if versions is not None:
        metrics.update(lag_metrics(versions=versions, mask=m, learner_version=learner_version, dtype=S.dtype))
    return detach_metrics(metrics)
