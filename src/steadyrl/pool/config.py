"""``pool.*`` keys of ``steadyrl train`` (used by ``runtime.mode=local`` and ``runtime.mode=ray``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PoolPolicy = Literal["fifo", "max_staleness", "drop", "pace"]


class PoolConfig(BaseModel):
    """Which completed groups the learner trains on, and how far the samplers may run ahead.

    Staleness is counted in learner versions (optimizer steps): the lag of a trajectory is the learner's version when
    it trains on it minus the version of its oldest token (``lag/max`` of that step is the batch maximum of it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: PoolPolicy = Field(
        "fifo",
        description="fifo: oldest completed first, nothing discarded (staleness bounded only by pool.capacity); "
        "max_staleness: samplers do not start a group that would be consumed with lag > max_staleness (AReaL's "
        "admission control), and any that still would be is dropped; drop: samplers run freely, groups whose lag "
        "would exceed max_staleness are dropped when the learner takes a batch; pace: PACE (arXiv 2609.36830) "
        "pool-aware rejection of the highest waiting + λ·generation staleness beyond pool.target_occupancy.",
    )
    max_staleness: int = Field(4, ge=0, le=1_000_000, description="s of max_staleness and drop, in learner versions "
                               "(optimizer steps).")
    capacity: int = Field(0, ge=0, le=1_000_000, description="Back-pressure: samplers wait while groups in flight "
                          "plus groups in the pool reach this many (0: 4 × prompts_per_step).")
    target_occupancy: int = Field(0, ge=0, le=1_000_000, description="PACE: groups the pool may hold before the "
                                  "excess is rejected, counted before the batch is taken (0: 2 × prompts_per_step, "
                                  "one batch in reserve).")
    pace_lambda: float = Field(1.0, ge=0, le=1e6, description="PACE: λ, the weight of generation staleness "
                               "against waiting staleness in the rejection score.")

    def resolved_capacity(self, prompts_per_step: int) -> int:
        """``capacity`` with 0 resolved to its default."""
        return self.capacity or 4 * prompts_per_step

    def resolved_target(self, prompts_per_step: int) -> int:
        """``target_occupancy`` with 0 resolved to its default."""
        return self.target_occupancy or 2 * prompts_per_step
