"""One completed group: G responses to one prompt, their rewards, versions and timing (a pool record)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.tool_metrics import RowMetrics


@dataclass(frozen=True, eq=False)
class GroupRecord:
    """A group as a sampler completed it (immutable; its version summaries are computed once, on first use).

    ``group_id`` is unique over the run (the samplers' claim counter), so the rollout ids ``(group_id, j)`` for
    j < G are unique too: the runtimes check that no id is trained on twice. Versions are per token in
    ``rollouts.versions`` (several, when weights changed during generation).
    """

    group_id: int
    problem_index: int
    """Index into the run's train pool (the verifier scored ``rewards`` against this problem)."""
    rollouts: Rollouts
    """G rows, ``group_ids`` all 0."""
    rewards: Tensor
    """[G] float32."""
    sampler: int
    """Which sampler produced it (0-based; a restarted sampler keeps its index)."""
    started_at: float
    """Wall-clock (``time.time()``) when generation started."""
    completed_at: float
    """Wall-clock when the group was scored and handed to the pool."""
    tool_counts: RowMetrics | None = None
    """Per-row tool counts (calls, errors, timeouts, turns, tool tokens) when the group was sampled with
    ``tools.enabled``; None otherwise (and for records saved before counts were carried)."""

    def __post_init__(self) -> None:
        if tuple(self.rewards.shape) != (len(self.rollouts),):
            raise ValueError(f"rewards has shape {tuple(self.rewards.shape)}, expected ({len(self.rollouts)},)")
        if self.tool_counts is not None and len(self.tool_counts.tool_calls) != len(self.rollouts):
            raise ValueError(f"tool_counts has {len(self.tool_counts.tool_calls)} rows, expected {len(self.rollouts)}")

    @cached_property
    def v_start(self) -> int:
        """Version of the group's oldest token (the weights generation started with)."""
        v = self.rollouts.versions[self.rollouts.response_mask]
        return int(v.min()) if v.numel() else 0

    @cached_property
    def v_complete(self) -> int:
        """Version of the weights the group completed with (its newest token)."""
        v = self.rollouts.versions[self.rollouts.response_mask]
        return int(v.max()) if v.numel() else 0

    def generation_staleness(self) -> Tensor:
        """[G] PACE's prefix-aware generation staleness GS_i = (1/L_i) Σ_t (v_complete − v_{i,t}) (docs/algorithms.md).

        v_complete is the group's completion version (all its rows complete together); rows with no token get 0.
        """
        mask = self.rollouts.response_mask
        gap = (self.v_complete - self.rollouts.versions).to(torch.float64) * mask
        return (gap.sum(-1) / mask.sum(-1).clamp(min=1)).float()

    def to_state(self) -> dict[str, Any]:
        """Plain tensors and numbers (what ``torch.load(weights_only=True)`` reads back)."""
        r = self.rollouts
        rollouts = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
        return {
            "group_id": self.group_id,
            "problem_index": self.problem_index,
            "rollouts": rollouts,
            "rewards": self.rewards,
            "sampler": self.sampler,
            "started_at": self.started_at,
            "completed_at": self.completed_at,
            "tool_counts": None if self.tool_counts is None else self.tool_counts.to_state(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> GroupRecord:
        """Inverse of :meth:`to_state`."""
        return cls(
            group_id=int(state["group_id"]),
            problem_index=int(state["problem_index"]),
            rollouts=Rollouts(**state["rollouts"]),
            rewards=state["rewards"],
            sampler=int(state["sampler"]),
            started_at=float(state["started_at"]),
            completed_at=float(state["completed_at"]),
            tool_counts=None if state.get("tool_counts") is None else RowMetrics.from_state(state["tool_counts"]),
        )
