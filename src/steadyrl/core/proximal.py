"""A-3PO: the proximal policy approximated from μ and π_θ by version, instead of recomputed (arXiv 2512.06547).

Decoupled PPO (AReaL, arXiv 2505.24298) needs log π_prox, the policy one version behind the learner, which costs a
no-grad forward pass per step. A-3PO (Li, Wu, Shen, "Accelerating Asynchronous LLM Training with Staleness-aware
Proximal Policy Approximation") interpolates it in log space between the behavior policy μ that sampled a token and
the current policy π_θ, by how stale the token is::

    α_t = clamp((v_prox − v_t) / (v_θ − v_t), 0, 1),   v_prox = v_θ − 1,   α_t = 0 where v_θ = v_t or v_t < 0
    log π_prox(y_t) ≈ log μ(y_t) + α_t · (log π_θ(y_t) − log μ(y_t))          (π_θ detached)

v_t is the version of the policy that sampled token t (``versions``), v_θ the learner's (``learner_version``).
A token sampled by the learner's own version (v_t = v_θ) or by the one just before it (v_t = v_θ − 1) gets α = 0:
π_prox = μ, no behavior correction; one sampled k > 1 versions ago gets α = (k − 1)/k. [reference-code] The formula,
v_prox = v_θ − 1, the clamp and α = 0 for negative versions are those of the authors' implementation in AReaL
(``areal/trainer/ppo/actor.py``, ``compute_prox_logp_approximations``, method ``loglinear``; AReaL 1.0.4,
``prox_logp_method=loglinear``); the paper's Sec. 3 names the same interpolation.

Old-logit repair ("Missing Old Logits", arXiv 2605.12070; only the abstract was available): π_θ/μ factors into
[π_old^train/μ]·[π_θ/π_old^train], a training–inference discrepancy at the behavior version times staleness, where
π_old^train is the trainer's log-prob under the behavior version's weights. :func:`mismatch_split` measures the two
factors; :func:`ewma_update_` is the PPO-EWMA recursion of the approximate repair (an EWMA of the weights as π_prox).
The exact repair (π_old^train from the lag ring's snapshot) needs no formula here: ``steadyrl.train`` hands those
log-probs to the loss as π_prox.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from steadyrl.core.kl import mismatch_kl
from steadyrl.core.masking import as_bool_mask, detach_metrics, masked_mean, where_masked
from steadyrl.core.types import Metrics


class ProximalApprox(NamedTuple):
    """``prox_logp`` [B,T]: the approximated log π_prox (detached, 0 off the mask); ``alpha`` [B,T]; metrics."""

    prox_logp: Float[Tensor, "B T"]
    alpha: Float[Tensor, "B T"]
    metrics: Metrics


def loglinear_prox_logp(
    *,
    logp: Float[Tensor, "B T"],
    behav_logp: Float[Tensor, "B T"],
    versions: Int[Tensor, "B T"],
    learner_version: int | Tensor,
    mask: Shaped[Tensor, "B T"],
) -> ProximalApprox:
    """A-3PO's log-linear proximal log-probs (module docstring): log μ + α (log π_θ − log μ), α from the versions.

    ``logp`` is read detached. ``learner_version`` v_θ: the learner's version now (optimizer steps applied), as the
    lag metrics use it. Metrics: ``a3po/alpha_mean`` (over masked-in tokens), ``a3po/interpolated_frac`` (tokens
    with α > 0).
    """
    m = as_bool_mask(mask)
    v_t = versions.to(logp.dtype)
    v_theta = torch.as_tensor(learner_version, dtype=logp.dtype, device=logp.device)
    diff = v_theta - v_t  # v_θ − v_t
    use = (diff > 0) & (versions >= 0) & m
    alpha = torch.where(use, (v_theta - 1.0 - v_t) / torch.where(use, diff, 1.0), 0.0).clamp(0.0, 1.0)
    behav = where_masked(behav_logp.detach(), m)
    prox = behav + alpha * (where_masked(logp.detach(), m) - behav)  # log μ + α (log π_θ − log μ)
    metrics: Metrics = {
        "a3po/alpha_mean": masked_mean(alpha, m),
        "a3po/interpolated_frac": masked_mean((alpha > 0).to(logp.dtype), m),
    }
    return ProximalApprox(prox_logp=prox, alpha=alpha, metrics=detach_metrics(metrics))


# --------------------------------------------------------------------------------------------- old-logit repair
def ewma_update_(
    ewma: Sequence[Tensor], params: Sequence[Tensor], *, weight: float, beta: float
) -> float:  # fmt: skip
    """One PPO-EWMA step (Hilton, Cobbe, Schulman 2021, "Batch size-invariance for policy optimization"), in
    place: W' = β·W + 1, θ_ewma ← (β·W/W')·θ_ewma + θ/W'; returns W'.

    After n updates from θ_ewma = θ_0 and W = 1 this is the β-weighted average Σ_i β^{n−i} θ_i / Σ_i β^{n−i} of the
    iterates θ_0 … θ_n (the initial weights count as the first iterate: our choice). ``weight`` is a Python float
    (no device tensor, no host sync); every update follows its tensor's device and dtype.
    """
    if not 0 <= beta < 1:
        raise ValueError(f"proximal_beta must lie in [0, 1) (got {beta})")
    new = beta * weight + 1.0  # W' = β W + 1
    keep = beta * weight / new
    with torch.no_grad():
        for e, p in zip(ewma, params, strict=True):
            e.mul_(keep).add_(p.detach().to(e.dtype), alpha=1.0 / new)  # (βW/W') θ_ewma + θ/W'
    return new


def mismatch_split(
    *,
    behav_logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
) -> Metrics:
    """The two factors of π/μ = [π_old^train/μ]·[π/π_old^train] ("Missing Old Logits", arXiv 2605.12070, abstract),
    each as a k3 token mean (verl convention, :func:`steadyrl.core.kl.mismatch_kl`), detached:

    * ``kl/discrepancy`` = KL(μ ‖ π_old^train): the training–inference discrepancy at the behavior version (x =
      log π_old^train − log μ);
    * ``kl/staleness`` = KL(π_old^train ‖ π_prox): how far the policy moved since (x = log π_prox − log π_old^train,
      on the same tokens, sampled by μ ≈ π_old^train).
    """
    m = as_bool_mask(mask)
    old = where_masked(old_logp.detach(), m)
    disc = mismatch_kl(log_ratio=old - where_masked(behav_logp.detach(), m), mask=m).metrics["kl/k3"]
    stale = mismatch_kl(log_ratio=where_masked(prox_logp.detach(), m) - old, mask=m).metrics["kl/k3"]
    return detach_metrics({"kl/discrepancy": disc, "kl/staleness": stale})
