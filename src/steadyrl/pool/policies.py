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
``pace``            PACE (arXiv 2609.36830, ALGORITHMS.md) [reconstructed]: budget B = max(0, |pool| − target);
                    reject the B groups with the highest score S = WS + λ·GS, then the P earliest of the rest
==================  ==========================================================================================

PACE's per-trajectory score, from ALGORITHMS.md: waiting staleness WS_i = v_now − v_complete(i), generation staleness
GS_i = (1/L_i) Σ_t (v_complete(i) − v_{i,t}) (token-weighted, prefix-aware). **Decision** (the paper leaves it open):
rejection is per *group* with the group's mean S_i, because every estimator here (GRPO's group baseline, OPOB, GMC)
needs whole groups; ties reject the earlier arrival (it has waited longer). The budget counts the pool before the batch
is taken, so the pool settles near ``target`` and keeps target − P groups in reserve after each batch.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def group_lag(record: GroupRecord, v_now: int) -> int:
    """Lag of the group's oldest token if it were trained at version ``v_now``."""
    return v_now - record.v_start


def pace_scores(records: Sequence[GroupRecord], *, v_now: int, lam: float) -> Tensor:
    """[n] float64: each group's mean over its rows of S_i = (v_now − v_complete) + λ · GS_i."""
    if not records:
        return torch.zeros(0, dtype=torch.float64)
    out = []
    for r in records:
        ws = float(v_now - r.v_complete)
        gs = r.generation_staleness().to(torch.float64)
        out.append((ws + lam * gs).mean())
    return torch.stack(out)


def select(records: Sequence[GroupRecord], *, cfg: PoolConfig, v_now: int, batch_groups: int) -> Selection:
    """Apply ``cfg.policy`` to the pool ``records`` (arrival order) for a batch of ``batch_groups`` groups."""
    if batch_groups < 1:
        raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
    pool = list(records)
    dropped: list[GroupRecord] = []
    rejected: list[GroupRecord] = []
    if cfg.policy in ("drop", "max_staleness"):
        dropped = [r for r in pool if group_lag(r, v_now) > cfg.max_staleness]
        pool = [r for r in pool if group_lag(r, v_now) <= cfg.max_staleness]
    elif cfg.policy == "pace":
        budget = max(0, len(pool) - cfg.resolved_target(batch_groups))
        if budget:
            scores = pace_scores(pool, v_now=v_now, lam=cfg.pace_lambda)
            # highest score first; among equals the earlier arrival (lower position) first
            order = sorted(range(len(pool)), key=lambda i: (-float(scores[i]), i))
            out = set(order[:budget])
            rejected = [r for i, r in enumerate(pool) if i in out]
            pool = [r for i, r in enumerate(pool) if i not in out]
    elif cfg.policy != "fifo":
        raise ValueError(f"pool.policy {cfg.policy!r} is not one of fifo, max_staleness, drop, pace")
    if len(pool) < batch_groups:
        return Selection(None, pool, dropped, rejected)
    return Selection(pool[:batch_groups], pool[batch_groups:], dropped, rejected)
