"""Held-out evaluation: the fraction of eval problems a policy answers correctly (one sample per problem).

Sampled at the configured temperature by default (T = 1: the accuracy of the policy RL actually optimizes), or
greedily (top-k = 1). The eval generator is seeded the same way at every evaluation, so two evaluations of the same
weights agree exactly and successive evaluations share their random numbers (less noise between them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from steadyrl.rollout.sampler import generate
from steadyrl.tasks import Problem, Task
from steadyrl.train.config import EvalConfig

#: top_k of greedy decoding.
GREEDY_TOP_K = 1


class EvalResult(NamedTuple):
    """Accuracy (mean score) on the eval set and the mean response length in tokens."""

    acc: float
    len_mean: float
    n: int


def evaluate(
    *,
    model: nn.Module,
    tokenizer: Any,
    task: Task,
    problems: Sequence[Problem],
    cfg: EvalConfig,
    max_new_tokens: int,
    generator: torch.Generator,
    version: int,
) -> EvalResult:
    """Score one response per problem; ``cfg`` sets greedy/temperature and the prompts per generate call."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for start in range(0, len(problems), cfg.batch_size):
            chunk = problems[start : start + cfg.batch_size]
            out = generate(
                model,
                tokenizer,
                [p.prompt for p in chunk],
                group_size=1,
                max_new_tokens=max_new_tokens,
                temperature=1.0 if cfg.greedy else cfg.temperature,
                top_k=GREEDY_TOP_K if cfg.greedy else 0,
                generator=generator,
                version=version,
            )
            total += sum(task.score(p, text) for p, text in zip(chunk, out.texts, strict=True))
            tokens += int(out.response_mask.sum())
    finally:
        model.train(was_training)
    n = len(problems)
    return EvalResult(acc=total / n, len_mean=tokens / n, n=n)
