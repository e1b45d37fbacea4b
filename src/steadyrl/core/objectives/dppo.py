"""DPPO, Divergence Proximal Policy Optimization (Qi et al., "Rethinking the Trust Region in LLM Reinforcement
Learning", arXiv 2602.04879): a trust-region *mask* on a divergence in probability space instead of PPO's ratio clip.

For each trained token, with p = π_θ(y_t) and q = π_anc(y_t) the probabilities of the sampled token under the current
policy and under the policy that anchors the trust region, the token's policy-gradient term is dropped when the
divergence between p and q passes δ *in the direction its advantage pushes*:

=====================  ==============================================================================================
Binary-TV              out  ⇔  (A > 0 ∧ p − q > δ_high) ∨ (A < 0 ∧ p − q < −δ_low)
Binary-KL              KL_B = q (log q − log p) + (1 − q)(log(1 − q + ε) − log(1 − p + ε)),  ε = 1e-8
                       out  ⇔  (A > 0 ∧ p > q ∧ KL_B > δ_high) ∨ (A < 0 ∧ p < q ∧ KL_B > δ_low)
=====================  ==============================================================================================

KL_B is the KL between the two Bernoulli distributions (q, 1 − q) and (p, 1 − p): the "binary" approximation keeps
only the sampled token and lumps the rest of the vocabulary together. A token with A = 0 has no direction and is never
dropped. The kept tokens train on the REINFORCE gradient weighted by the ratio r = π_θ/π_anc (optionally truncated at
C), the dropped ones contribute nothing but stay in the aggregation's denominator (verl, SkyRL and prime-rl agree).

Which policy anchors the trust region: the one ``prox_logp`` carries. The paper recommends the sampling policy μ
(§5.2; verl's example sets ``bypass_mode=True``): in steadyrl that is ``policy=bypass`` (π_prox := μ), which the
``dppo_tv`` / ``dppo_kl`` presets set. In the default decoupled mode the anchor is the recomputed π_prox, verl's
``old_log_prob`` outside bypass mode.

Optional (log r)² term (prime-rl's default loss, arXiv 2602.02276 for the KL part): ``sq_log_ratio_coef`` · (log r)²
on *every* trained token, dropped or not; prime-rl uses 1e-3 (``kl_tau``), with r against the inference policy μ.

Log-probabilities above 0 (not valid probabilities; the ±1000 stress inputs) are read as 0 where probabilities are
formed, so p, q ∈ [0, 1] and every divergence stays finite. Values at masked-out positions may be garbage.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    AggMode,
    aggregate,
    all_masked_flag,
    detach_metrics,
    masked_mean,
    safe_exp,
    where_masked,
)
from steadyrl.core.objectives.ppo import apply_weights, mask_frac, prepare_token_inputs, ratio_metrics
from steadyrl.core.types import LossOutput, Metrics

Divergence = Literal["tv", "kl"]
Surrogate = Literal["ratio", "log_prob"]

#: Trust-region thresholds of the authors' verl example (``examples/dppo_trainer/run_qwen30b_dppo.sh``, verl main):
#: δ = 0.15 for Binary-TV and δ = 0.05 for Binary-KL, the same on both sides.
DPPO_TV_DELTA: float = 0.15
DPPO_KL_DELTA: float = 0.05
#: ε inside log(1 − p + ε) of Binary-KL (verl ``compute_policy_loss_dppo_kl``, SkyRL ``dppo_policy_loss``).
BINARY_KL_EPS: float = 1e-8
#: prime-rl's coefficient of the (log r)² term (``DefaultLossConfig.kl_tau``).
PRIME_RL_KL_TAU: float = 1e-3


class TrustRegion(NamedTuple):
    """Which trained tokens lie outside DPPO's trust region, and the divergence that decided it (detached).

    ``outside_high``: A > 0 and π_θ rose past δ_high; ``outside_low``: A < 0 and π_θ fell past δ_low.
    ``divergence``: |p − q| (Binary-TV) or KL_B (Binary-KL), 0 off the mask.
    """

    outside_high: Bool[Tensor, "B T"]
    outside_low: Bool[Tensor, "B T"]
    divergence: Float[Tensor, "B T"]

    @property
    def outside(self) -> Bool[Tensor, "B T"]:
        return self.outside_high | self.outside_low


def binary_kl(
    *, logp: Float[Tensor, "B T"], anchor_logp: Float[Tensor, "B T"], eps: float = BINARY_KL_EPS
) -> Float[Tensor, "B T"]:
    """KL(Bern(q) ‖ Bern(p)) = q (log q − log p) + (1 − q)(log(1 − q + ε) − log(1 − p + ε)), elementwise.

    p = exp(log p), q = exp(log q), log-probabilities clamped at 0 first; log(1 − x + ε) as log1p(ε − x). The ε of
    verl and SkyRL keeps the value finite at p = 1 (about 18.4 nats at most for the second term).
    """
    log_p, log_q = logp.clamp(max=0.0), anchor_logp.clamp(max=0.0)
    p, q = log_p.exp(), log_q.exp()
    return q * (log_q - log_p) + (1.0 - q) * (torch.log1p(eps - q) - torch.log1p(eps - p))


def trust_region(
    *,
    logp: Float[Tensor, "B T"],
    anchor_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Bool[Tensor, "B T"],
    divergence: Divergence | str,
    delta_low: float,
    delta_high: float,
) -> TrustRegion:
    """DPPO's Binary-TV or Binary-KL trust-region test per token (module table), on detached inputs.

    ``mask`` must be bool and the other inputs already masked (finite everywhere); see :func:`dppo_loss`.
    """
    if divergence not in ("tv", "kl"):
        raise ValueError(f"divergence must be 'tv' or 'kl'; got {divergence!r}")
    p = logp.detach().clamp(max=0.0).exp()
    q = anchor_logp.detach().clamp(max=0.0).exp()
    rise = p - q  # signed change of the sampled token's probability
    pos, neg = mask & (advantages > 0), mask & (advantages < 0)
    if divergence == "tv":
        high, low = pos & (rise > delta_high), neg & (rise < -delta_low)
        div = rise.abs()
    else:
        div = binary_kl(logp=logp.detach(), anchor_logp=anchor_logp.detach())
        high, low = pos & (rise > 0) & (div > delta_high), neg & (rise < 0) & (div > delta_low)
    return TrustRegion(outside_high=high, outside_low=low, divergence=where_masked(div, mask))


def dppo_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    divergence: Divergence | str = "tv",
    delta_low: float = DPPO_TV_DELTA,
    delta_high: float = DPPO_TV_DELTA,
    trunc: float | None = None,
    surrogate: Surrogate | str = "ratio",
    sq_log_ratio_coef: float = 0.0,
    agg: AggMode | str = "token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """DPPO-Binary-TV / DPPO-Binary-KL (arXiv 2602.04879) [reference-code: the authors' verl code, verl 0.9.1].

    ``prox_logp`` is log π_anc, the anchor of the trust region (module docstring: μ under ``policy=bypass``). With
    r = exp(clamp(log π_θ − log π_anc, ±20)), c = min(r, C) (c = r when ``trunc`` C is None), M_t = 1 inside the
    trust region (:func:`trust_region`) and w the detached correction weight, per token::

        surrogate="ratio"     L_t = w_t · (−A_t · M_t · r_t · sg(c_t / r_t) + κ (log r_t)²)
        surrogate="log_prob"  L_t = w_t · (−A_t · M_t · sg(c_t) · log π_θ(y_t) + κ (log r_t)²)
        loss = agg(L, mask)

    Both surrogates have the gradient −A·M·min(r, C)·∇log π_θ (+ 2κ log r ∇log π_θ); their values differ.
    ``log_prob`` is verl's and the authors' form (``-advantages * truncated_ratio * log_prob * valid_mask``, the
    truncated ratio detached, C = ``clip_ratio_c``); ``ratio`` is SkyRL's and prime-rl's (−A·r·M, no truncation).
    Where the constants come from: δ_low = δ_high = 0.15 (TV) and 0.05 (KL) in the authors' verl example; C: verl's
    function falls back to 20 but reads ``clip_ratio_c`` from the actor config, whose default is 3, the authors'
    repository uses 10, their verl example 1e4 (off); κ = ``sq_log_ratio_coef`` (prime-rl: 1e-3, default 0 here).

    Metrics: ``loss/policy``, ``loss/clip_frac`` (fraction of trained tokens outside the trust region),
    ``dppo/masked_high_frac`` / ``dppo/masked_low_frac`` (A > 0 and rose / A < 0 and fell, of trained tokens),
    ``dppo/divergence_mean`` (mean |p − q| or KL_B over trained tokens), ``dppo/trunc_frac`` (kept tokens with r > C,
    of trained tokens; with ``trunc``), ``dppo/sq_log_ratio_mean`` (with κ > 0), ``loss/ratio_mean``,
    ``loss/ratio_max``, ``loss/all_masked``.
    """
    if surrogate not in ("ratio", "log_prob"):
        raise ValueError(f"surrogate must be 'ratio' or 'log_prob'; got {surrogate!r}")
    if trunc is not None and trunc <= 0:
        raise ValueError(f"trunc must be > 0 (or None: no truncation); got {trunc}")
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    m = x.mask
    lp = where_masked(logp, m)  # log π_θ with gradient, 0 off the mask
    anchor = where_masked(prox_logp.detach(), m)
    region = trust_region(
        logp=lp, anchor_logp=anchor, advantages=x.advantages, mask=m, divergence=divergence,
        delta_low=delta_low, delta_high=delta_high,
    )  # fmt: skip
    keep = m & ~region.outside
    ratio = safe_exp(x.log_ratio)  # r = π_θ / π_anc, with gradient
    r_val = ratio.detach()
    coef = r_val if trunc is None else r_val.clamp(max=trunc)  # c = min(r, C), detached
    if surrogate == "log_prob":
        pg = -x.advantages * coef * lp  # −A · sg(c) · log π_θ
    else:
        factor = torch.ones_like(r_val) if trunc is None else torch.where(r_val > trunc, trunc / r_val, 1.0)
        pg = -x.advantages * ratio * factor  # −A · r · sg(c / r): value −A·c
    loss_tok = where_masked(pg, keep)
    metrics: Metrics = {}
    if sq_log_ratio_coef:
        sq = x.log_ratio.square()  # (log r)², on every trained token
        loss_tok = loss_tok + sq_log_ratio_coef * sq
        metrics["dppo/sq_log_ratio_mean"] = masked_mean(sq, m)
    loss = aggregate(apply_weights(x.weights, loss_tok), m, agg, norm_len=norm_len)
    if trunc is not None:
        metrics["dppo/trunc_frac"] = mask_frac(keep & (r_val > trunc), m)
    metrics |= ratio_metrics(r_val, m)
    metrics |= {
        "loss/clip_frac": mask_frac(region.outside, m),
        "dppo/masked_high_frac": mask_frac(region.outside_high, m),
        "dppo/masked_low_frac": mask_frac(region.outside_low, m),
        "dppo/divergence_mean": masked_mean(region.divergence, m),
        "loss/policy": loss,
        "loss/all_masked": all_masked_flag(m),
    }
    return LossOutput(loss=loss, metrics=detach_metrics(metrics))
