"""A reward that arrives Δ learner steps late (``task.reward_delay``), for every runtime.

Each batch a runtime hands the learner at step s trains on a fast proxy b (:func:`~steadyrl.tasks.delayed.
proxy_rewards`); its true reward r is held back and handed over with the batch of step s + Δ, as
:class:`~steadyrl.rollout.scored.DelayedRewards` of age Δ, where the learner applies Retroactive Advantage Correction
(arXiv 2606.27580). The lag runtime and the concurrent runtimes (``local``, ``ray``) wrap their batches in the same
:class:`RewardDelay`, so the true reward lands Δ learner steps after the batch trained, whatever produced it. The
proxy is drawn from its own seeded stream (``"proxy"``, s): sampling is untouched. The batches awaiting their reward
are checkpointed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from steadyrl.base.seeding import generator
from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.scored import DelayedRewards, ScoredRollouts
from steadyrl.tasks.delayed import ProxyKind, proxy_rewards


class RewardDelay:
    """Swaps each batch's true rewards for the proxy and attaches the batch whose true reward arrives now."""

    def __init__(self, delay: int, *, proxy: ProxyKind, flip: float, seed: int) -> None:
        if delay < 1:
            raise ValueError(f"task.reward_delay must be >= 1 for a delayed reward, got {delay}")
        self.delay, self.proxy, self.flip, self.seed = delay, proxy, flip, seed
        self.pending: dict[int, DelayedRewards] = {}
        """Batches trained at a step, waiting for their true reward (step → rollouts, true and proxy rewards)."""

    def apply(self, step: int, batch: ScoredRollouts) -> ScoredRollouts:
        """The batch of learner step ``step`` with its proxy rewards, carrying the batch of step − Δ's true reward."""
        gen = generator(self.seed, "proxy", step)
        fast = proxy_rewards(batch.rewards, kind=self.proxy, flip=self.flip, generator=gen)
        self.pending[step] = DelayedRewards(batch.rollouts, batch.rewards, fast, self.delay)
        arrived = self.pending.pop(step - self.delay, None)
        metrics = {**batch.metrics, "reward/true_mean": float(batch.rewards.mean())}
        if arrived is not None:
            metrics["reward/slow_mean"] = float(arrived.slow.mean())
        return batch._replace(rewards=fast, metrics=metrics, delayed=arrived)

    def state_dict(self) -> dict[str, Any]:
        """The batches awaiting their true reward (plain tensors, lists and numbers)."""
        return {
            step: {"rollouts": {f.name: getattr(d.rollouts, f.name) for f in dataclasses.fields(d.rollouts)},
                   "slow": d.slow, "fast": d.fast, "age": d.age}
            for step, d in self.pending.items()
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[Any, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.pending = {
            int(step): DelayedRewards(Rollouts(**d["rollouts"]), d["slow"], d["fast"], int(d["age"]))
            for step, d in state.items()
        }
