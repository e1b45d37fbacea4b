"""Score centering: REINFORCE whose score is centred by the sampler-expected weighted score (arXiv 2609.20807, Eq. 14).

With p = π_θ(·|s_t) the current policy's sampling distribution, q = μ(·|s_t) the behavior (sampler) distribution,
a = y_t the sampled token, A_t the detached advantage and w_v = f(p_v / q_v) a detached weight::

    ℓ_t = −A_t · [ w_a · log p_a − Σ_v sg(q_v · w_v) · log p_v ]
    ∇ℓ_t = −A_t · [ w_a ∇log p_a − E_{v~q}[ w_v ∇log p_v ] ]

so the gradient subtracts the sampler-expected weighted score from the sampled one (a control variate with mean zero
under the sampler: E_{a~q}[w_a ∇log p_a] − E_{v~q}[w_v ∇log p_v] = 0 for any detached A). NeMo-RL's
``compute_score_centering_term`` follows the same equation. f (option ``weight``):

- ``none``: f ≡ 1 (no importance weight);
- ``tis``: f(r) = min(r, 2) (truncated IS, cap :data:`TIS_CAP`);
- ``mis``: f(r) = r · 1[0.5 ≤ r ≤ 5] (masked IS, band :data:`MIS_LOWER`–:data:`MIS_UPPER`, IcePop's).

Every f is evaluated in log space from log r = log p − log q, so log-ratios of ±1000 stay finite.

**The term Σ_v c_v log p_v** (c_v = sg(q_v w_v)) needs the full vocabulary; it is a vocabulary term of
:mod:`steadyrl.core.vocab_chunks` (``centering_term``), computed chunk by chunk with its gradient, never as a second
full-vocabulary pass. Two forms:

- **exact** (``top_k = 0``): q recorded in full by the sampler (allowed up to :data:`EXACT_VOCAB_LIMIT` tokens);
- **top-k** (``top_k = k``): the sampler records its k most likely tokens H and their q. The tail is assumed to follow
  p: q_v = ρ p_v for v ∉ H with ρ = (1 − Σ_H q) / (1 − Σ_H p), the denominator floored at :data:`RHO_FLOOR` (our
  reading of the paper's floor; ρ = 0 when H holds all of q's mass). Then w_v = f(1/ρ) on the tail, and with
  α = ρ·f(1/ρ) (0 when ρ = 0)::

      Σ_v c_v log p_v = Σ_{v∈H} sg(q_v f(p_v/q_v) − α p_v) log p_v + α Σ_v sg(p_v) log p_v

  The last sum has zero gradient (Σ_v p_v ∇log p_v = ∇Σ_v p_v = 0), so the gradient is the head's alone, with the
  paper's head coefficient q_v f(p_v/q_v) − α p_v; its value is added (detached) so the term's value is that of the
  approximated full sum. When H covers q's support (ρ = 0) the top-k form is the exact one.

Tokens outside the current policy's sampling support (p_v = 0 under a top-k/top-p sampling distribution) contribute
nothing: their score is undefined, and f(0) = 0 for ``tis``/``mis`` anyway.

Shapes: log-probs of one chunk ``[m, V]``, the recorded behavior ``[M, K]`` indexed by each token's index.
Confidence: [reconstructed] for the top-k tail rule's floor (the equation is the paper's, the floor's placement ours);
the exact form [exact] against Eq. 14.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    AggMode,
    aggregate,
    all_masked_flag,
    as_bool_mask,
    detach_metrics,
    masked_max,
    masked_mean,
    where_masked,
)
from steadyrl.core.types import LossOutput, Metrics
from steadyrl.core.vocab_chunks import VocabTerm

ScoreWeight = Literal["none", "tis", "mis"]

#: TIS cap of f (the paper's truncated-IS choice, as verl's token TIS).
TIS_CAP: float = 2.0
#: MIS band of f: keep r in [0.5, 5] (IcePop's band, arXiv 2510.18855).
MIS_LOWER: float = 0.5
MIS_UPPER: float = 5.0
#: Floor of the top-k tail ratio's denominator 1 − Σ_H p.
RHO_FLOOR: float = 1e-6
#: Largest vocabulary whose full behavior distribution the sampler records (the exact form); larger ones use top-k.
EXACT_VOCAB_LIMIT: int = 4096


def weight_from_log_ratio(log_ratio: Tensor, weight: ScoreWeight) -> Tensor:
    """w = f(r) from log r (any shape; −inf allowed: r = 0). ``none`` 1, ``tis`` min(r, 2), ``mis`` r·1[0.5 ≤ r ≤ 5].

    Computed in log space (``exp`` of a value ≤ log 5 or of −inf), so any log-ratio gives a finite weight. A NaN
    log-ratio (never produced here: see the callers) would give weight 0 under ``mis``.
    """
    if weight == "none":
        return torch.ones_like(log_ratio)
    if weight == "tis":
        return log_ratio.clamp(max=math.log(TIS_CAP)).exp()
    if weight == "mis":
        keep = (log_ratio >= math.log(MIS_LOWER)) & (log_ratio <= math.log(MIS_UPPER))
        return torch.where(keep, log_ratio.clamp(max=math.log(MIS_UPPER)).exp(), torch.zeros_like(log_ratio))
    raise ValueError(f"weight={weight!r} is not one of 'none', 'tis', 'mis'")


def _times_logp(coef: Tensor, logp: Tensor) -> Tensor:
    """Σ_v coef_v · log p_v over the last axis, a zero coefficient contributing 0 even where log p = −inf."""
    safe = torch.where(coef != 0, logp, torch.zeros_like(logp))
    return (coef * safe).sum(-1)


def exact_coefficients(logp: Float[Tensor, "m V"], behav_logp: Float[Tensor, "m V"], weight: ScoreWeight) -> Tensor:
    """c_v = q_v · f(p_v / q_v) of the exact form, detached (0 where q_v = 0 or p_v = 0)."""
    lp, lq = logp.detach(), behav_logp.detach()
    both = (lq > -math.inf) & (lp > -math.inf)
    log_ratio = torch.where(both, lp - lq, torch.zeros_like(lp))
    return torch.where(both, lq.exp() * weight_from_log_ratio(log_ratio, weight), torch.zeros_like(lp))


def topk_coefficients(
    logp: Float[Tensor, "m V"], head_ids: Int[Tensor, "m K"], head_behav_logp: Float[Tensor, "m K"], weight: ScoreWeight
) -> tuple[Float[Tensor, "m K"], Float[Tensor, " m"]]:
    """(head coefficients q_v f(p_v/q_v) − α p_v for v ∈ H, α) of the top-k form (module docstring), detached."""
    lp = logp.detach()
    lp_head = lp.gather(-1, head_ids)
    lq = head_behav_logp.detach().to(lp.dtype)
    q_tail = (1 - lq.exp().sum(-1)).clamp(min=0)
    log_p_tail = lp.scatter(-1, head_ids, -math.inf).logsumexp(-1)  # log Σ_{v∉H} p_v, without cancellation
    rho = q_tail / log_p_tail.exp().clamp(min=RHO_FLOOR)
    pos = rho > 0
    log_inv = torch.where(pos, -rho.clamp(min=torch.finfo(rho.dtype).tiny).log(), torch.zeros_like(rho))
    alpha = torch.where(pos, rho * weight_from_log_ratio(log_inv, weight), torch.zeros_like(rho))
    head = exact_coefficients(lp_head, lq, weight) - alpha.unsqueeze(-1) * lp_head.exp()
    return head, alpha


def centering_term(
    *,
    behav_logp: Float[Tensor, "M K"],
    head_ids: Int[Tensor, "M K"] | None,
    weight: ScoreWeight,
) -> VocabTerm:
    """The vocabulary term Σ_v sg(q_v w_v) log p_v (module docstring) for :func:`~steadyrl.core.vocab_chunks.
    chunked_log_probs`: ``behav_logp`` holds log q of each token (row = the token's index): all V entries
    (``head_ids`` None: the exact form) or the head's K entries with their ids (the top-k form)."""

    def term(log_probs: Float[Tensor, "m V"], index: Int[Tensor, " m"]) -> Float[Tensor, " m"]:
        lq = behav_logp[index].to(log_probs.dtype)
        if head_ids is None:
            if lq.shape[-1] != log_probs.shape[-1]:
                raise ValueError(
                    f"the recorded behavior distribution has {lq.shape[-1]} entries, the vocabulary "
                    f"{log_probs.shape[-1]}: record it with the policy's own vocabulary"
                )
            return _times_logp(exact_coefficients(log_probs, lq, weight), log_probs)
        ids = head_ids[index]
        head, alpha = topk_coefficients(log_probs, ids, lq, weight)
        lp = log_probs.detach()
        tail_value = alpha * _times_logp(lp.exp(), lp)  # α Σ_v sg(p_v) log p_v: value only (zero gradient)
        return _times_logp(head, log_probs.gather(-1, ids)) + tail_value

    return term


def score_centering_loss(
    *,
    logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    centering: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weight: ScoreWeight = "tis",
    agg: AggMode | str = "token-mean",
    norm_len: float | None = None,
    count_mask: Shaped[Tensor, "B T"] | None = None,
    weights: Float[Tensor, "B T"] | None = None,
) -> LossOutput:
    """Score-centering loss (arXiv 2609.20807, Eq. 14): L_t = −A_t · [w_a · log p_a − C_t], reduced with ``agg``.

    ``logp`` = log p_a of the sampled token (with gradient), ``behav_logp`` = log q_a, ``centering`` = C_t =
    Σ_v sg(q_v w_v) log p_v from :func:`centering_term` (with gradient), w_a = f(p_a/q_a) detached, A detached.
    ``weights`` (other corrections' detached weights) multiply the whole bracket. No clip (REINFORCE).
    Metrics: ``loss/policy``, ``sc/weight_mean``, ``sc/weight_max``, ``sc/centering_mean`` (mean C_t),
    ``loss/all_masked``.
    """
    m = as_bool_mask(mask)
    lp = where_masked(logp, m)
    log_ratio = where_masked(logp.detach() - behav_logp.detach(), m)
    w_a = where_masked(weight_from_log_ratio(log_ratio, weight), m)
    adv = where_masked(advantages.detach(), m)
    c = where_masked(centering, m)
    bracket = w_a * lp - c
    if weights is not None:
        bracket = where_masked(weights.detach(), m, fill=1.0) * bracket
    loss = aggregate(-adv * bracket, m, agg, norm_len=norm_len, count_mask=count_mask)
    metrics: Metrics = {
        "loss/policy": loss,
        "sc/weight_mean": masked_mean(w_a, m),
        "sc/weight_max": masked_max(w_a, m),
        "sc/centering_mean": masked_mean(c.detach(), m),
        "loss/all_masked": all_masked_flag(m),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
