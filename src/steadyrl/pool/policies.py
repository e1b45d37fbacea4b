"""Pool policies: which pooled groups the learner's next batch takes, and which it discards first.

``select`` is called when the learner wants a batch of ``P`` groups, with the pool in arrival order and the learner's
version v_now (the version the batch will be trained at). The lag of a trajectory consumed now is
v_now − (version of its oldest token); a group's lag is that of its oldest token.

==================  ==========================================================================================
policy              what ``select`` does
==================  ==========================================================================================
``fifo``            the P earliest arrivals; nothing is discarded
``drop``            drop every group whose lag would exceed s, then the P earliest of the rest
``max_staleness``   as ``drop`` (a safety net: the runtime's admission control should leave nothing to drop)
``pace``            PACE (arXiv 2609.36830): reject an EMA-smoothed share of the pool beyond its target occupancy,
                    the groups with the highest effective staleness first, then the P earliest of the rest
==================  ==========================================================================================

PACE, as far as the paper could be read here (its abstract and second-hand notes on its text; docs/algorithms.md,
``pace``, gives each source). Staleness is split into waiting staleness WS_i = v_now − v_complete(i) (in the pool)
and generation staleness GS_i = (1/L_i) Σ_t (v_complete(i) − v_{i,t}) (versions that changed during generation,
token-averaged). The effective staleness weights GS by how much the learner has *forgotten* the response's prefix:

    d_i   = mean_{t: v_{i,t} < v_complete(i)} |log π_now(y_t) − log μ(y_t)|     prefix-forgetting score (re-scored)
    p_i   = percentile rank of d_i among the pooled trajectories with GS > 0     in (0, 1]
    S_i   = WS_i + λ · p_i^γ · GS_i                                               γ = 4, λ = 1 (``pace.score=drift``)
    S_i   = WS_i + λ · GS_i                                                       (``pace.score=version_gap``)

so a long or interrupted rollout whose prefix the learner still scores as μ did is not rejected for spanning several
versions. The rejection rate follows the pool's excess over the target occupancy (Little's law: a fixed target is a
fixed mean wait at a fixed consumption rate), EMA-smoothed:

    r ← β · r + (1 − β) · max(0, 1 − target / |pool|),    budget B = round(r · |pool|)    β = ``pace.ema`` (0.9)

β = 0 rejects exactly |pool| − target. Ours, where the sources are silent: the form of d_i (mean absolute log-prob
drift over the older-version tokens), the percentile set, β, λ = 1, and rejection per *group* with the group's mean
S_i (every estimator here — GRPO's group baseline, OPOB, GMC — needs whole groups); ties reject the earlier arrival
(it has waited longer). The budget counts the pool before the batch is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from steadyrl.pool.config import PoolConfig
from steadyrl.pool.records import GroupRecord


class Selection(NamedTuple):
    """The outcome of :func:`select`: ``batch`` is None while the pool cannot fill one."""

    batch: list[GroupRecord] | None
    remaining: list[GroupRecord]
    dropped: list[GroupRecord]
    """Discarded for exceeding the staleness bound (drop / max_staleness)."""
    rejected: list[GroupRecord]
    """Discarded by PACE's occupancy budget."""
    pace_rate: float = 0.0
    """PACE's rejection rate r after this call (carried to the next; 0 for the other policies)."""


DriftFn = Callable[[Sequence[GroupRecord]], list[Tensor]]
"""Given pooled groups, each one's [G] prefix-forgetting scores d_i (:func:`prefix_forgetting` on the learner's
current log-probs); supplied by the runtime, which holds the model."""


def group_lag(record: GroupRecord, v_now: int) -> int:
    """Lag of the group's oldest token if it were trained at version ``v_now``."""
    return v_now - record.v_start


def prefix_forgetting(
    *, logp_now: Tensor, behav_logp: Tensor, versions: Tensor, response_mask: Tensor, v_complete: int
) -> Tensor:
    """[N] float64 PACE's prefix-forgetting score d_i: the mean |log π_now − log μ| over the response tokens that
    weights older than the completing version ``v_complete`` generated (0 for a row without such a token)."""
    prefix = response_mask.bool() & (versions >= 0) & (versions < v_complete)
    drift = (logp_now.double() - behav_logp.double()).abs() * prefix
    return drift.sum(-1) / prefix.sum(-1).clamp(min=1)


def pace_scores(
    records: Sequence[GroupRecord], *, v_now: int, lam: float, gamma: float = 4.0, drift: DriftFn | None = None
) -> Tensor:
    """[n] float64: each group's mean over its rows of the effective staleness S_i (module docstring).

    ``drift`` None: S_i = WS_i + λ·GS_i (``version_gap``). Otherwise only the groups with a row of GS > 0 are
    re-scored (the weight multiplies GS), and p_i is the percentile rank of d_i among those rows.
    """
    if not records:
        return torch.zeros(0, dtype=torch.float64)
    ws = [float(v_now - r.v_complete) for r in records]
    gs = [r.generation_staleness().to(torch.float64) for r in records]
    if drift is not None:
        spans = [j for j, g in enumerate(gs) if bool((g > 0).any())]
        if spans:
            scores = drift([records[j] for j in spans])
            d = torch.cat([scores[k].to(torch.float64)[gs[j] > 0] for k, j in enumerate(spans)])
            for k, j in enumerate(spans):  # p_i = share of the candidates with d ≤ d_i, in (0, 1]
                p = (scores[k].to(torch.float64).unsqueeze(-1) >= d).double().mean(-1)
                gs[j] = gs[j] * p.pow(gamma)
    return torch.stack([(ws[j] + lam * gs[j]).mean() for j in range(len(records))])


def pace_rate(rate: float, *, occupancy: int, target: int, beta: float) -> float:
    """PACE's EMA-smoothed rejection rate: β·r + (1 − β)·max(0, 1 − target/occupancy)."""
    excess = max(0.0, 1.0 - target / occupancy) if occupancy > 0 else 0.0
    return beta * rate + (1.0 - beta) * excess


def select(
    records: Sequence[GroupRecord], *, cfg: PoolConfig, v_now: int, batch_groups: int, drift: DriftFn | None = None,
    rate: float = 0.0,
) -> Selection:  # fmt: skip
    """Apply ``cfg.policy`` to the pool ``records`` (arrival order) for a batch of ``batch_groups`` groups.

    PACE only: ``drift`` re-scores pooled groups (needed for ``pool.pace.score=drift``; without it the policy refuses
    to run) and ``rate`` is the rejection rate the previous call returned in :attr:`Selection.pace_rate`.
    """
    if batch_groups < 1:
        raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
    pool = list(records)
    dropped: list[GroupRecord] = []
    rejected: list[GroupRecord] = []
    if cfg.policy in ("drop", "max_staleness"):
        dropped = [r for r in pool if group_lag(r, v_now) > cfg.max_staleness]
        pool = [r for r in pool if group_lag(r, v_now) <= cfg.max_staleness]
    elif cfg.policy == "pace":
        if cfg.pace.score == "drift" and drift is None:
            raise ValueError("pool.pace.score=drift re-scores the pool with the learner's policy: pass drift")
        rate = pace_rate(rate, occupancy=len(pool), target=cfg.resolved_target(batch_groups), beta=cfg.pace.ema)
        budget = min(len(pool), round(rate * len(pool)))
        if budget:
            scores = pace_scores(
                pool, v_now=v_now, lam=cfg.pace.weight, gamma=cfg.pace.gamma,
                drift=drift if cfg.pace.score == "drift" else None,
            )  # fmt: skip
            # highest score first; among equals the earlier arrival (lower position) first
            order = sorted(range(len(pool)), key=lambda i: (-float(scores[i]), i))
            out = set(order[:budget])
            rejected = [r for i, r in enumerate(pool) if i in out]
            pool = [r for i, r in enumerate(pool) if i not in out]
    elif cfg.policy != "fifo":
        raise ValueError(f"pool.policy {cfg.policy!r} is not one of fifo, max_staleness, drop, pace")
    if cfg.policy != "pace":
        rate = 0.0
    if len(pool) < batch_groups:
        return Selection(None, pool, dropped, rejected, rate)
    return Selection(pool[:batch_groups], pool[batch_groups:], dropped, rejected, rate)
