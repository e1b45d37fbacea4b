"""BAPO, Balanced Policy Optimization with Adaptive Clipping (Xi et al., arXiv 2510.18927, §4.2, Eq. 8 and
Algorithm 1): PPO-clip whose ratio bounds [c_low, c_high] are searched per batch so that the positive-advantage
tokens carry at least a share ρ0 of the loss.

Contributions at bounds (c_low, c_high), over trained tokens, with r = π_θ/π_prox and w the correction weight::

    P(c_high) = Σ_{A_t > 0} w_t · A_t · min(r_t, c_high)          (the clipped surrogate's value, A > 0)
    N(c_low)  = Σ_{A_t < 0} w_t · |A_t| · max(r_t, c_low)         (its magnitude, A < 0)
    share ρ   = P / (P + N)          (ρ = 1 when P + N = 0: nothing to balance)

Algorithm 1 (``order="high_first"``): start at (a⁻, a⁺); while ρ < ρ0 and c_low + δ2 ≤ b⁻, raise c_high by δ1
while it stays ≤ b⁺, else raise c_low by δ2. The bounds walk a fixed path of at most ⌊(b⁺ − a⁺)/δ1⌋ +
⌊(b⁻ − a⁻)/δ2⌋ + 1 points, known before the batch is seen: :func:`bapo_bounds` evaluates ρ at every point (one pass
over the tokens per distinct bound) and takes the first that meets ρ0, else the last, as tensors: no host sync.
Grid points are a + k·δ, k ≤ ⌊(b − a)/δ + 1e-9⌋ (so 0.6 → 0.9 in steps of 0.02 ends on 0.9, which repeated float
addition would miss).

The authors' released verl recipe (``recipe/bapo/policy_loss.py``) differs, and both forms are options: it raises
c_low first, then c_high (``order="low_first"``; steps capped at the maximum), and its target is the ratio P/N ≥ t
(``balance="odds"``; its ``adv_ratio_target`` is 1 in the recipe's yaml, 0.5 in its run script), not the share of
Eq. 8; it also applies verl's dual clip (c = 3) to A < 0 (``dual_clip=3``).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.masking import AggMode, detach_metrics, safe_exp, where_masked
from steadyrl.core.objectives.ppo import ppo_clip_loss, prepare_token_inputs
from steadyrl.core.types import LossOutput, Metrics

Order = Literal["high_first", "low_first"]
Balance = Literal["share", "odds"]

#: §5, "Implementation details": target contribution ρ0 = 0.4, movable ranges [a⁻, b⁻] = [0.6, 0.9] and
#: [a⁺, b⁺] = [1.2, 3.0], step sizes δ1 = 0.05 (upper bound) and δ2 = 0.02 (lower bound).
BAPO_TARGET: float = 0.4
BAPO_LOW_START: float = 0.6
BAPO_LOW_MAX: float = 0.9
BAPO_HIGH_START: float = 1.2
BAPO_HIGH_MAX: float = 3.0
BAPO_HIGH_STEP: float = 0.05
BAPO_LOW_STEP: float = 0.02


class BapoBounds(NamedTuple):
    """The searched bounds (0-d tensors): ratio bounds ``c_low`` / ``c_high``, the positive ``share`` ρ there, and
    the search's metrics (``bapo/...``)."""

    c_low: Float[Tensor, ""]
    c_high: Float[Tensor, ""]
    share: Float[Tensor, ""]
    metrics: Metrics


def _grid(start: float, stop: float, step: float) -> list[float]:
    """start, start + step, …, up to stop (k·step with k ≤ ⌊(stop − start)/step + 1e-9⌋, rounded to 12 decimals)."""
    if step <= 0 or stop <= start:
        return [start]
    return [round(start + k * step, 12) for k in range(math.floor((stop - start) / step + 1e-9) + 1)]


def _capped(start: float, stop: float, step: float) -> list[float]:
    """The released recipe's walk: start, then min(previous + step, stop) until stop."""
    values = [start]
    while step > 0 and values[-1] < stop:
        values.append(min(round(values[-1] + step, 12), stop))
    return values


def search_path(
    *,
    low_start: float = BAPO_LOW_START,
    low_max: float = BAPO_LOW_MAX,
    low_step: float = BAPO_LOW_STEP,
    high_start: float = BAPO_HIGH_START,
    high_max: float = BAPO_HIGH_MAX,
    high_step: float = BAPO_HIGH_STEP,
    order: Order | str = "high_first",
) -> list[tuple[float, float]]:
    """The (c_low, c_high) points the bound search visits, in order (module docstring); static, batch-independent."""
    if order == "high_first":  # Algorithm 1: the loop runs only while c_low + δ2 ≤ b⁻ still holds
        lows, highs = _grid(low_start, low_max, low_step), _grid(high_start, high_max, high_step)
        if len(lows) == 1:
            return [(low_start, high_start)]
        return [(low_start, h) for h in highs] + [(lo, highs[-1]) for lo in lows[1:]]
    if order == "low_first":
        lows, highs = _capped(low_start, low_max, low_step), _capped(high_start, high_max, high_step)
        return [(lo, high_start) for lo in lows] + [(lows[-1], h) for h in highs[1:]]
    raise ValueError(f"order must be 'high_first' or 'low_first'; got {order!r}")


def bapo_bounds(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    target: float = BAPO_TARGET,
    balance: Balance | str = "share",
    path: list[tuple[float, float]] | None = None,
) -> BapoBounds:
    """Search BAPO's bounds along ``path`` (default: :func:`search_path` with the paper's constants), detached.

    ``balance="share"``: stop at the first point with P ≥ ρ0 (P + N) (Eq. 8); ``"odds"``: with P ≥ t·N (the released
    recipe's P/N ≥ ``adv_ratio_target``, there with 1e-8 added to N). No point meets it: the path's last point.
    Metrics: ``bapo/c_low``, ``bapo/c_high``, ``bapo/pos_share`` (ρ at the chosen bounds), ``bapo/pos_share_start``
    (ρ at the first point), ``bapo/target_met`` (1 if a point met the target), ``bapo/steps`` (points walked past).
    """
    if balance not in ("share", "odds"):
        raise ValueError(f"balance must be 'share' or 'odds'; got {balance!r}")
    pts = search_path() if path is None else path
    x = prepare_token_inputs(logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights)
    r = safe_exp(x.log_ratio.detach())
    w_abs = x.advantages.abs() if x.weights is None else x.weights * x.advantages.abs()  # w·|A|, 0 off the mask
    pos, neg = x.mask & (x.advantages > 0), x.mask & (x.advantages < 0)
    p_of = {h: where_masked(w_abs * r.clamp(max=h), pos).sum() for h in sorted({h for _, h in pts})}
    n_of = {lo: where_masked(w_abs * r.clamp(min=lo), neg).sum() for lo in sorted({lo for lo, _ in pts})}
    pc = torch.stack([p_of[h] for _, h in pts])  # P at every point of the path
    nc = torch.stack([n_of[lo] for lo, _ in pts])  # N at every point
    met = pc >= target * (pc + nc) if balance == "share" else pc >= target * nc
    n = len(pts)
    idx = torch.where(met.any(), torch.argmax(met.to(torch.int8)), n - 1)  # first point that meets it, else the last
    lows = torch.tensor([lo for lo, _ in pts], dtype=r.dtype, device=r.device)
    highs = torch.tensor([h for _, h in pts], dtype=r.dtype, device=r.device)
    total = pc + nc
    share = torch.where(total > 0, pc / torch.where(total > 0, total, 1.0), 1.0)
    metrics: Metrics = {
        "bapo/c_low": lows[idx],
        "bapo/c_high": highs[idx],
        "bapo/pos_share": share[idx],
        "bapo/pos_share_start": share[0],
        "bapo/target_met": met.any().to(r.dtype),
        "bapo/steps": idx.to(r.dtype),
    }
    return BapoBounds(c_low=lows[idx], c_high=highs[idx], share=share[idx], metrics=detach_metrics(metrics))


def bapo_loss(
    *,
    logp: Float[Tensor, "B T"],
    prox_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    weights: Float[Tensor, "B T"] | None = None,
    target: float = BAPO_TARGET,
    balance: Balance | str = "share",
    path: list[tuple[float, float]] | None = None,
    dual_clip: float | None = None,
    agg: AggMode | str = "token-mean",
    norm_len: float | None = None,
) -> LossOutput:
    """BAPO (arXiv 2510.18927, Algorithm 1) [reconstructed: Eq. 8 read as the positive share P/(P + N)].

    The bounds of :func:`bapo_bounds`, then PPO-clip with them (``ppo.ppo_clip_loss``, ε_low = 1 − c_low,
    ε_high = c_high − 1)::

        L_t  = w_t · max(−A_t r_t, −A_t clip(r_t, c_low, c_high))        (J_BAPO of Algorithm 1, line 20)
        loss = agg(L, mask)

    The extracted text of Eq. 8 sums each side with π_rollout(y_t) in front, an expectation over the sampled tokens;
    on samples that is the plain sum, as in the authors' code. ``dual_clip``: verl's dual clip for A < 0 (the released
    recipe applies c = 3; Algorithm 1 has none). Metrics: PPO-clip's (``loss/clip_frac``, ...) and the search's.
    """
    b = bapo_bounds(
        logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights, target=target,
        balance=balance, path=path,
    )  # fmt: skip
    out = ppo_clip_loss(
        logp=logp, prox_logp=prox_logp, advantages=advantages, mask=mask, weights=weights, clip_low=1.0 - b.c_low,
        clip_high=b.c_high - 1.0, dual_clip=dual_clip, agg=agg, norm_len=norm_len,
    )  # fmt: skip
    return LossOutput(loss=out.loss, metrics={**out.metrics, **b.metrics})
