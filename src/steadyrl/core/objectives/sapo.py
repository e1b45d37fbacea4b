"""SAPO: Soft Adaptive Policy Optimization (Gao et al., Qwen, arXiv 2511.20347).

SAPO replaces PPO's hard clip by a smooth gate of the token ratio r = π_θ/π_prox, with a temperature that depends on
the sign of the advantage (τ_pos for A > 0, τ_neg otherwise)::

    f_τ(r)     = σ(τ (r − 1)) · 4/τ                          the gate (its value at r = 1 is 2/τ)
    L_t        = −w_t · f_{τ_t}(r_t) · A_t
    ∂L_t/∂θ    = −w_t · A_t · 4 σ(τ(r−1)) (1 − σ(τ(r−1))) · r_t · ∇log π_θ(y_t)

The gradient weight 4σ(1−σ) = sech²(τ(r−1)/2) is 1 at r = 1 (the on-policy policy gradient, whatever τ) and decays
smoothly as r leaves 1, faster for larger τ: τ_neg > τ_pos damps negative-advantage tokens sooner. Defaults
τ_pos = 1.0, τ_neg = 1.05 (the paper's; the defaults of verl 0.9.1 ``tau_pos``/``tau_neg``, TRL 1.16.0
``sapo_temperature_pos``/``sapo_temperature_neg``, SkyRL 0.3.0 ``sapo.tau_pos``/``tau_neg`` and AReaL 1.0.4
``sapo_tau_pos``/``sapo_tau_neg``). The four frameworks compute the same gate; they differ only in the reduction
(verl forces ``seq-mean-token-mean`` over non-empty rows, TRL and SkyRL divide that sum by every row — the
``empty_rows="count"`` of ``masking.aggregate`` —, AReaL takes a token mean).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    AggMode,
    EmptyRows,
    aggregate,
    all_masked_flag,
    detach_metrics,
    masked_mean,
    safe_exp,
)
from steadyrl.core.objectives.ppo import apply_weights, prepare_token_inputs, ratio_metrics
from steadyrl.core.types import LossOutput, Metrics

#: SAPO's temperatures (the paper's defaults, and every shipping framework's).
SAPO_TAU_POS: float = 1.0
SAPO_TAU_NEG: float = 1.05


def sapo_gate(ratio: Float[Tensor, "*shape"], tau: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """The SAPO gate f_τ(r) = σ(τ (r − 1)) · 4/τ (arXiv 2511.20347), elementwise; differentiable in ``ratio``."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    tau_pos: float = SAPO_TAU_POS,
    tau_neg: float = SAPO_TAU_NEG,
    agg: AggMode | str = "seq-mean-token-mean",
    norm_len: float | None = None,
    empty_rows: EmptyRows = "skip",
) -> LossOutput:
    """SAPO loss (arXiv 2511.20347, the SAPO objective with its soft gate) [reference-code: four frameworks agree].

    Per token, with r = exp(clamp(log π_θ − log π_prox, ±20)) (with gradient), τ_t = τ_pos where A_t > 0 and τ_neg
    elsewhere, and w the detached correction weight::

        L_t = −w_t · σ(τ_t (r_t − 1)) · (4/τ_t) · A_t

    Reduction: ``masking.aggregate(L, mask, agg, norm_len=norm_len)``; the paper averages tokens within a response and
    responses within the group, ``seq-mean-token-mean`` (the default; verl forces it). ``empty_rows="count"``
    divides by all B rows (TRL, SkyRL; ``masking.aggregate``). Both temperatures must be positive.

    Shapes: every tensor [B, T]; values at masked-out positions may be garbage.
    Metrics: ``loss/policy``, ``loss/gate_mean`` (mean gate f_τ(r) over trained tokens; AReaL's ``sapo_soft_gate``),
    ``loss/ratio_mean``, ``loss/ratio_max``, ``loss/all_masked``.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be positive; got tau_pos={tau_pos}, tau_neg={tau_neg}")
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    ratio = safe_exp(x.log_ratio)  # r = π_θ / π_prox, with gradient
    pos, neg = torch.tensor(tau_pos, dtype=ratio.dtype), torch.tensor(tau_neg, dtype=ratio.dtype)
    tau = torch.where(x.advantages > 0, pos.to(ratio.device), neg.to(ratio.device))
    gate = sapo_gate(ratio, tau)  # f_τ(r)
    loss_tok = apply_weights(x.weights, -x.advantages) * gate  # −w · f · A
    loss = aggregate(loss_tok, x.mask, agg, norm_len=norm_len, empty_rows=empty_rows)
    metrics: Metrics = {"loss/gate_mean": masked_mean(gate, x.mask)}
    metrics |= ratio_metrics(ratio, x.mask)
    metrics |= {"loss/policy": loss, "loss/all_masked": all_masked_flag(x.mask)}
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
