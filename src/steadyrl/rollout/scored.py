"""A batch ready for the learner: rollouts, their verifier rewards, and what the runtime measured producing them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from steadyrl.rollout.rollouts import Rollouts
from steadyrl.tasks import Problem, Task


class DelayedRewards(NamedTuple):
    """Rows whose slow (true) reward arrived at this step (``task.reward_delay``), for Retroactive Advantage
    Correction (arXiv 2606.27580): the rollouts as sampled, their rewards and their age."""

    rollouts: Rollouts
    slow: Float[Tensor, " K"]
    """r_slow,i: the verifier's reward, arriving now."""
    fast: Float[Tensor, " K"]
    """b_i: the fast proxy reward the rows were trained on."""
    age: int
    """Δ: learner steps since the rows were trained on."""


class ScoredRollouts(NamedTuple):
    """What a runtime hands the learner for one step."""

    rollouts: Rollouts
    rewards: Float[Tensor, " N"]
    """float32, one per row."""
    metrics: dict[str, float]
    """Runtime metrics of this batch (``time/sample_s``, ``lag/gen_mean``, ``pool/occupancy``, ...)."""
    old_logp: Float[Tensor, "N T"] | None = None
    """π_old^train: each token's log-prob recomputed by the trainer's forward under its behavior version's weights
    (``proximal`` other than ``current``, lag runtime); None otherwise."""
    delayed: DelayedRewards | None = None
    """An earlier batch whose slow reward arrived at this step (``task.reward_delay``); None otherwise."""


def score_rollouts(task: Task, problems: Sequence[Problem], rollouts: Rollouts) -> Float[Tensor, " N"]:
    """The task's verifier reward of each row; row i answers ``problems[rollouts.group_ids[i]]``."""
    groups = rollouts.group_ids.tolist()
    return torch.tensor(
        [task.score(problems[g], text) for g, text in zip(groups, rollouts.texts, strict=True)], dtype=torch.float32
    )
