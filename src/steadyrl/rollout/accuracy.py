"""Accuracy of a policy on a list of problems: one sampled response per problem, scored by the task's verifier.

Used by the held-out evaluation of ``steadyrl train`` (:mod:`steadyrl.train.evaluate`) and by the warm start's
stopping rule (:func:`steadyrl.models.warmstart.sampled_accuracy`). The model is put in eval mode for the call and
its train/eval mode restored afterwards. ``batch_size`` splits the problems into several ``generate`` calls (None: one
call); the generator is consumed in that order, so the same arguments give the same accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from steadyrl.rollout.sampler import generate

if TYPE_CHECKING:
    from steadyrl.rollout.multiturn import ToolUse
    from steadyrl.tasks import Problem, Task


class Accuracy(NamedTuple):
    """Mean score over the problems, mean response length in tokens (EOS included), number of problems."""

    acc: float
    len_mean: float
    n: int


def sampled_accuracy_of(
    model: nn.Module,
    tokenizer: Any,
    *,
    task: Task,
    problems: Sequence[Problem],
    max_new_tokens: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_k: int = 0,
    version: int = 0,
    batch_size: int | None = None,
    tools: ToolUse | None = None,
) -> Accuracy:
    """Score one response per problem (``task.score``: 1 right, 0 wrong), sampled at ``temperature`` / ``top_k``.

    With ``tools``, responses are multi-turn trajectories (the training path, ``tools.max_total_tokens`` replaces
    ``max_new_tokens``) and each is scored on its last model turn; ``len_mean`` counts sampled tokens only.
    """
    if not problems:
        raise ValueError("no problems to score")
    step = batch_size or len(problems)
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for start in range(0, len(problems), step):
            chunk = problems[start : start + step]
            kw: dict[str, Any] = dict(group_size=1, temperature=temperature, top_k=top_k, generator=generator,
                                      version=version)  # fmt: skip
            if tools is None:
                out = generate(model, tokenizer, [p.prompt for p in chunk], max_new_tokens=max_new_tokens, **kw)
                texts = out.texts
            else:
                multi = tools.generate(model, tokenizer, [p.prompt for p in chunk], **kw)
                out, texts = multi.rollouts, multi.final_texts
            total += sum(task.score(p, text) for p, text in zip(chunk, texts, strict=True))
            tokens += int(out.response_mask.sum())
    finally:
        model.train(was_training)
    n = len(problems)
    return Accuracy(acc=total / n, len_mean=tokens / n, n=n)
