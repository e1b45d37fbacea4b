"""OTB: optimal token baseline (arXiv 2602.07078) [reference-code, verl ``optimal_token_baseline``].

A per-token baseline that weighs each response of the group by the "realized energy" accumulated up to the token,
a forward-only proxy of ‖∇ log π(y_{≤t})‖² (the logit-gradient proxy):

    e_j = w_j² (1 − 2 π_j + Σ_v π_v²)               π_j = π_old(y_j), Σ_v π_v² over the vocabulary at step j
    W_t = Σ_{j≤t} m_j e_j                            (w_j: optional token importance weight, 1 without)
    B*_t = Σ_{i∈g, active at t} G_t^(i) W_t^(i) / (Σ_{i∈g, active at t} W_t^(i) + ε)
    A_t = G_t − B*_t                                 (G_t the return-to-go; R_i broadcast for an outcome reward)

``1 − 2π_j + Σπ²`` is ‖e_{y_j} − π‖², the squared norm of the logit gradient of log π(y_j), so W_t ≥ 0.

Choices (each a named option):

- ``alignment="trained_tokens"`` (default): position t of a response is its t-th *masked-in* token, so masked-out
  tool or prompt tokens inside a multi-turn response are skipped and sequences align by trained token (verl's
  multi-turn variant). ``"absolute"``: t is the column of the padded tensor and a response is active where its
  mask is 1 (verl's single-turn variant). Both agree for right-padded responses without holes.
- ``zero_lone_baseline=True`` (default, verl's ``handle_zero_tail`` and its groups of one): where a response is
  the only one of its group active at t (the tail of a uniquely longest response, or a group of one), the baseline
  would be ≈ its own return and its advantage ≈ 0; the baseline is set to 0 there instead (A_t = G_t).
  ``False`` keeps the formula as written.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from steadyrl.core.advantages.grpo import token_advantage_metrics
from steadyrl.core.groups import group_sum
from steadyrl.core.masking import as_bool_mask, masked_mean, where_masked
from steadyrl.core.types import Metrics

OtbAlignment = Literal["trained_tokens", "absolute"]
OTB_ALIGNMENTS: tuple[str, ...] = get_args(OtbAlignment)

#: ε of B*_t's denominator (verl's default).
OTB_EPS: float = 1e-8


class OtbAdvantages(NamedTuple):
    """Result of :func:`otb_advantages` (all detached; 0 at masked-out positions).

    ==============  ======  ================================================================
    field           shape   meaning
    ==============  ======  ================================================================
    ``advantages``  [B, T]  A_t = G_t − B*_t
    ``baseline``    [B, T]  B*_t
    ``energy``      [B, T]  W_t, the cumulative realized energy
    ``metrics``             ``adv/mean``, ``adv/std``, ``adv/baseline_mean`` over masked-in tokens;
                            ``adv/otb_lone_frac``: fraction of tokens alone at their position
    ==============  ======  ================================================================
    """

    advantages: Float[Tensor, "B T"]
    baseline: Float[Tensor, "B T"]
    energy: Float[Tensor, "B T"]
    metrics: Metrics


def sum_squared_probs(logits: Float[Tensor, "*batch V"]) -> Float[Tensor, "*batch"]:
    """Σ_v π_v² of softmax(logits) over the last axis, in log space (arXiv 2602.07078; verl ``sum_pi_squared``).

    Σ_v π_v² = exp(logsumexp(2·z) − 2·logsumexp(z)): no softmax is materialized, finite for any logit scale.
    The logits are first shifted by their (detached) maximum, which leaves the value unchanged and keeps both
    logsumexps near 0, so no precision is lost to cancellation for large logits in float32.
    ``logits`` [..., V] (already divided by the sampling temperature if π is the tempered policy) → [...].
    """
    z = logits - logits.detach().amax(dim=-1, keepdim=True)  # shift invariance of Σπ²
    return torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1))  # Σ_v π_v²


def otb_advantages(
    *,
    returns: Float[Tensor, "B T"],
    token_logp: Float[Tensor, "B T"],
    sum_p2: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    group_ids: Int[Tensor, " B"],
    token_weights: Float[Tensor, "B T"] | None = None,
    eps: float = OTB_EPS,
    alignment: OtbAlignment | str = "trained_tokens",
    zero_lone_baseline: bool = True,
) -> OtbAdvantages:
    """Optimal token baseline advantages A_t = G_t − B*_t (arXiv 2602.07078) [reference-code, verl].

    Formula and options in the module docstring.

    =================  ======  =====================================================================
    argument           shape   meaning
    =================  ======  =====================================================================
    ``returns``        [B, T]  return-to-go G_t (for an outcome reward: R_i on every token)
    ``token_logp``     [B, T]  log π_old of the sampled token (``prox_logp``)
    ``sum_p2``         [B, T]  Σ_v π_old,v² at each step (:func:`sum_squared_probs`)
    ``mask``           [B, T]  trained tokens (bool or 0/1); other positions may hold garbage
    ``group_ids``      [B]     prompt of each response, ids in [0, B)
    ``token_weights``  [B, T]  optional token importance weights w_t (detached here); enter squared
    ``eps``                    ε of the denominator (1e-8)
    =================  ======  =====================================================================

    Reduction: B*_t sums over the responses of a group active at position t (vectorized: one scatter over the
    composite key (group, position)). Returns :class:`OtbAdvantages`.
    """
    if alignment not in OTB_ALIGNMENTS:
        raise ValueError(f"alignment={alignment!r} is not one of {', '.join(OTB_ALIGNMENTS)}")
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    m = as_bool_mask(mask)
    B, T = m.shape
    G = where_masked(returns.detach(), m)
    pi = torch.exp(where_masked(token_logp.detach(), m))  # π_j (masked-out: exp(0), never used)
    energy_tok = 1.0 - 2.0 * pi + where_masked(sum_p2.detach(), m)  # ‖e_y − π‖² = 1 − 2π_j + Σ_v π_v²
    if token_weights is not None:
        energy_tok = energy_tok * where_masked(token_weights.detach(), m) ** 2  # · w_j²
    W = torch.cumsum(where_masked(energy_tok, m), dim=-1)  # W_t = Σ_{j≤t} m_j w_j² (1 − 2π_j + Σπ²)

    if alignment == "trained_tokens":
        position = (torch.cumsum(m.to(torch.int64), dim=-1) - 1).clamp(min=0)  # rank among trained tokens
    else:
        position = torch.arange(T, device=m.device).expand(B, T)
    key = (group_ids.unsqueeze(-1) * T + position).reshape(-1)  # composite (group, position) id in [0, B·T)

    def per_key_sum(x: Tensor) -> Tensor:
        return group_sum(where_masked(x, m).reshape(-1), group_ids=key).reshape(B, T)

    numer = per_key_sum(G * W)  # Σ_i G_t W_t over the group's responses active at t
    denom = per_key_sum(W)  # Σ_i W_t
    active = per_key_sum(m.to(G.dtype))  # how many responses of the group are active at t
    denom = denom + eps
    nonzero = denom != 0  # only eps = 0 with no energy at all: baseline 0 instead of 0/0
    baseline = torch.where(nonzero, numer / torch.where(nonzero, denom, torch.ones_like(denom)), 0.0)  # B*_t
    lone = m & (active <= 1)
    if zero_lone_baseline:
        baseline = torch.where(lone, torch.zeros_like(baseline), baseline)
    baseline = where_masked(baseline, m)
    advantages = where_masked(G - baseline, m)  # A_t = G_t − B*_t
    metrics = token_advantage_metrics(advantages=advantages, baseline=baseline, mask=m)
    metrics["adv/otb_lone_frac"] = masked_mean(lone.to(G.dtype), m).detach()
    return OtbAdvantages(advantages=advantages, baseline=baseline, energy=where_masked(W, m), metrics=metrics)
