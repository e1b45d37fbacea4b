"""The learner-side pool: completed groups in arrival order, id accounting, batch assembly with staleness metrics."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from steadyrl.pool.config import PoolConfig
from steadyrl.pool.policies import DriftFn, select
from steadyrl.pool.records import GroupRecord
from steadyrl.rollout.rollouts import Rollouts, concat
from steadyrl.rollout.tool_metrics import RowMetrics, tool_summary


class DuplicateRolloutError(RuntimeError):
    """A group id reached the pool a second time (a runtime bug: a rollout would be trained on twice)."""


class PoolBatch(NamedTuple):
    """A batch taken from the pool: groups in order, rows of group i at i·G … i·G+G−1."""

    rollouts: Rollouts
    rewards: Tensor
    records: list[GroupRecord]
    metrics: dict[str, float]


class RolloutPool:
    """Completed groups waiting for the learner (see :mod:`steadyrl.pool.policies` for what a batch takes)."""

    def __init__(self, cfg: PoolConfig, *, batch_groups: int, drift: DriftFn | None = None) -> None:
        self.cfg = cfg
        self.batch_groups = batch_groups
        self.drift = drift
        """PACE's re-scoring of pooled groups with the learner's policy (``pool.pace.score=drift``)."""
        self.pace_rate = 0.0
        """PACE's EMA-smoothed rejection rate (``pool.pace.ema``), checkpointed."""
        self._drift_cache: dict[int, Tensor] = {}
        """Drift scores by group id at learner version ``_drift_version``: :meth:`take` runs every time groups arrive
        while the learner waits, at one version, so each pooled group is re-scored once per version, not per call."""
        self._drift_version = -1
        self.records: list[GroupRecord] = []
        self.seen: set[int] = set()
        """Every group id that ever arrived (pooled, trained on or discarded)."""
        self.trained: set[int] = set()
        self.discarded: set[int] = set()
        self.totals = {"dropped": 0, "rejected": 0}
        self._pending_counts = {"dropped": 0, "rejected": 0}
        """Discards since the last batch (reported with the next one)."""

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: GroupRecord) -> None:
        """Append a completed group; a group id seen before raises :class:`DuplicateRolloutError`."""
        if record.group_id in self.seen:
            raise DuplicateRolloutError(f"group {record.group_id} arrived twice")
        self.seen.add(record.group_id)
        self.records.append(record)

    def take(self, *, v_now: int) -> tuple[PoolBatch | None, list[GroupRecord]]:
        """Apply the policy at learner version ``v_now``: the batch (None if the pool cannot fill one yet) and the
        groups discarded now (dropped or rejected; they are gone from the pool either way)."""
        occupancy = len(self.records)
        if v_now != self._drift_version:
            self._drift_cache, self._drift_version = {}, v_now
        sel = select(
            self.records, cfg=self.cfg, v_now=v_now, batch_groups=self.batch_groups,
            drift=None if self.drift is None else self._cached_drift, rate=self.pace_rate,
        )  # fmt: skip
        self.records = sel.remaining
        self.pace_rate = sel.pace_rate
        discarded = sel.dropped + sel.rejected
        self.discarded.update(r.group_id for r in discarded)
        self.totals["dropped"] += len(sel.dropped)
        self.totals["rejected"] += len(sel.rejected)
        self._pending_counts["dropped"] += len(sel.dropped)
        self._pending_counts["rejected"] += len(sel.rejected)
        if sel.batch is None:
            return None, discarded
        for r in sel.batch:
            if r.group_id in self.trained:
                raise DuplicateRolloutError(f"group {r.group_id} would be trained on twice")
            self.trained.add(r.group_id)
        counts, self._pending_counts = self._pending_counts, {"dropped": 0, "rejected": 0}
        return self._assemble(sel.batch, v_now=v_now, occupancy=occupancy, counts=counts), discarded

    def _cached_drift(self, records: list[GroupRecord]) -> list[Tensor]:
        """``self.drift`` on the groups not yet scored at this version; the others from the cache."""
        assert self.drift is not None
        missing = [r for r in records if r.group_id not in self._drift_cache]
        if missing:
            self._drift_cache.update(zip((r.group_id for r in missing), self.drift(missing), strict=True))
        return [self._drift_cache[r.group_id] for r in records]

    def _assemble(
        self, batch: list[GroupRecord], *, v_now: int, occupancy: int, counts: Mapping[str, int]
    ) -> PoolBatch:
        rollouts = concat([r.rollouts for r in batch])
        rewards = torch.cat([r.rewards for r in batch]).float()
        gs = torch.cat([r.generation_staleness() for r in batch]).double()
        ws = torch.tensor([float(v_now - r.v_complete) for r in batch for _ in range(len(r.rollouts))])
        now = time.time()
        metrics = {
            "lag/gen_mean": float(gs.mean()),
            "lag/gen_max": float(gs.max()),
            "lag/wait_mean": float(ws.mean()),
            "lag/group_max": float(max(v_now - r.v_start for r in batch)),
            "pool/occupancy": float(occupancy),
            "pool/dropped": float(counts["dropped"]),
            "pool/rejected": float(counts["rejected"]),
            "pool/pace_rate": self.pace_rate,
            "pool/wait_s_mean": sum(now - r.completed_at for r in batch) / len(batch),
            "sample/versions_per_group": sum(
                float(torch.unique(r.rollouts.versions[r.rollouts.response_mask]).numel()) for r in batch
            )
            / len(batch),
        }
        counts = [r.tool_counts for r in batch]
        if all(c is not None for c in counts):  # sampled with tools: every tool/* metric, as in the lag runtime
            metrics |= tool_summary(RowMetrics.cat(counts), rollouts)  # type: ignore[arg-type]
        return PoolBatch(rollouts, rewards, batch, metrics)

    def state_dict(self) -> dict[str, Any]:
        """The pooled records and the id accounting (plain tensors, for a checkpoint)."""
        return {
            "records": [r.to_state() for r in self.records],
            "seen": torch.tensor(sorted(self.seen), dtype=torch.long),
            "trained": torch.tensor(sorted(self.trained), dtype=torch.long),
            "discarded": torch.tensor(sorted(self.discarded), dtype=torch.long),
            "totals": dict(self.totals),
            "pace_rate": self.pace_rate,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.records = [GroupRecord.from_state(s) for s in state["records"]]
        self.seen = set(state["seen"].tolist())
        self.trained = set(state["trained"].tolist())
        self.discarded = set(state["discarded"].tolist())
        self.totals = {k: int(v) for k, v in state["totals"].items()}
        self.pace_rate = float(state.get("pace_rate", 0.0))  # absent in checkpoints written before PACE's EMA
        self._pending_counts = {"dropped": 0, "rejected": 0}
