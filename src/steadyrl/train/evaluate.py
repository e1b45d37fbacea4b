"""Held-out evaluation: the fraction of eval problems a policy answers correctly (one sample per problem).

Sampled at the configured temperature by default (T = 1: the accuracy of the policy RL actually optimizes), or
greedily (top-k = 1). The eval generator is seeded the same way at every evaluation, so two evaluations of the same
weights agree exactly and successive evaluations share their random numbers (less noise between them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from steadyrl.config.train import EvalConfig, EvalSamplingConfig
from steadyrl.rollout.accuracy import Accuracy, sampled_accuracy_of
from steadyrl.rollout.multiturn import ToolUse
from steadyrl.tasks import Problem, Task

#: top_k of greedy decoding.
GREEDY_TOP_K = 1


#: Accuracy, mean response length and number of problems of one evaluation.
EvalResult = Accuracy


def evaluate(
    *,
    model: nn.Module,
    tokenizer: Any,
    task: Task,
    problems: Sequence[Problem],
    cfg: EvalConfig,
    sampling: EvalSamplingConfig,
    max_new_tokens: int,
    generator: torch.Generator,
    version: int,
    tools: ToolUse | None = None,
) -> EvalResult:
    """Score one response per problem; ``sampling`` sets greedy/temperature, ``cfg`` the prompts per generate call. With
    ``tools``, responses are multi-turn trajectories scored on their last model turn (the training path)."""
    return sampled_accuracy_of(
        model, tokenizer, task=task, problems=problems, max_new_tokens=max_new_tokens, generator=generator,
        temperature=1.0 if sampling.greedy else sampling.temperature, top_k=GREEDY_TOP_K if sampling.greedy else 0,
        version=version, batch_size=cfg.batch_size, tools=tools,
    )  # fmt: skip
