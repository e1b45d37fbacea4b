"""Per-trajectory tool counts (:class:`RowMetrics`) and the batch metrics of tool-integrated rollouts.

One implementation serves every runtime: the lag runtime summarizes the counts its multi-turn sampler returns, the
concurrent runtimes (``local``, ``ray``) carry each group's counts in its :class:`~steadyrl.pool.records.GroupRecord`
and summarize the batch the pool hands out, and rollouts that come without counts (records saved before counts
existed) fall back to what the token masks alone determine (:func:`tool_metrics_from_rollouts`).

Batch metrics (per learner step; docs/tools.md):

``tool/calls_mean``            tool calls run per trajectory
``tool/errors``                calls in the batch whose result had an error (crash, timeout, internal_error, ...)
``tool/timeouts``              calls in the batch stopped by the wall-clock limit
``tool/tokens_mean``           tool-output tokens per trajectory
``turns/mean``                 model turns per trajectory
``response/context_len_mean``  prompt + sampled + tool-output tokens per trajectory

Confidence: [exact] (counts; no paper formula involved).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from jaxtyping import Int
from torch import Tensor

from steadyrl.rollout.rollouts import Rollouts, context_mask


class RowMetrics(NamedTuple):
    """Per-trajectory counts, each ``[N]`` int64."""

    tool_calls: Int[Tensor, " N"]  # calls that ran
    tool_errors: Int[Tensor, " N"]  # calls whose result had an error (any kind)
    tool_timeouts: Int[Tensor, " N"]  # calls stopped by the wall-clock limit
    turns: Int[Tensor, " N"]  # model turns sampled
    tool_tokens: Int[Tensor, " N"]  # tool-output tokens in the response

    def select(self, rows: Sequence[int] | Tensor) -> RowMetrics:
        """The counts of ``rows`` (in that order)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.tool_calls.device)
        return RowMetrics(*(t[idx] for t in self))

    @classmethod
    def cat(cls, parts: Sequence[RowMetrics]) -> RowMetrics:
        """Rows of ``parts`` one after the other (the row order of :func:`steadyrl.rollout.rollouts.concat`)."""
        if not parts:
            raise ValueError("RowMetrics.cat needs at least one part")
        return cls(*(torch.cat(column) for column in zip(*parts, strict=True)))

    def to_state(self) -> dict[str, Tensor]:
        """Plain tensors by field name (what ``torch.load(weights_only=True)`` reads back)."""
        return self._asdict()

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RowMetrics:
        """Inverse of :meth:`to_state`."""
        return cls(**{name: state[name] for name in cls._fields})


def context_len_mean(rollouts: Rollouts) -> float:
    """Mean context length of a trajectory: prompt + sampled + tool-output tokens."""
    context = rollouts.prompt_mask.sum(-1) + context_mask(rollouts).sum(-1)
    return float(context.float().mean())


def tool_summary(counts: RowMetrics, rollouts: Rollouts) -> dict[str, float]:
    """The batch metrics of the module docstring from per-row ``counts`` of ``rollouts`` (same rows, same order)."""
    if len(counts.tool_calls) != len(rollouts):
        raise ValueError(f"tool counts have {len(counts.tool_calls)} rows, the rollouts {len(rollouts)}")
    return {
        "tool/calls_mean": float(counts.tool_calls.float().mean()),
        "tool/errors": float(counts.tool_errors.sum()),
        "tool/timeouts": float(counts.tool_timeouts.sum()),
        "tool/tokens_mean": float(counts.tool_tokens.float().mean()),
        "turns/mean": float(counts.turns.float().mean()),
        "response/context_len_mean": context_len_mean(rollouts),
    }


def _runs(mask: Tensor) -> Tensor:
    """Number of maximal runs of True along the last dim, [N] int64."""
    starts = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    return starts.sum(-1)


def tool_metrics_from_rollouts(rollouts: Rollouts) -> dict[str, float]:
    """The metrics of :func:`tool_summary` that the token masks alone determine (for rollouts that come without
    per-row counts): ``tool/calls_mean`` (tool turns: runs of ``tool_mask``; a call whose output was cut to nothing is
    not seen), ``tool/tokens_mean``, ``turns/mean`` (runs of sampled tokens: every model turn samples at least one
    token and consecutive model turns are separated by a tool turn) and ``response/context_len_mean``. Errors and
    timeouts are not in the tokens."""
    tool = rollouts.tool_mask
    if tool is None:  # unpickled from before tool turns existed
        tool = torch.zeros_like(rollouts.response_mask, dtype=torch.bool)
    return {
        "tool/calls_mean": float(_runs(tool.bool()).float().mean()),
        "tool/tokens_mean": float(tool.sum(-1).float().mean()),
        "turns/mean": float(_runs(rollouts.response_mask.bool()).float().mean()),
        "response/context_len_mean": context_len_mean(rollouts),
    }
