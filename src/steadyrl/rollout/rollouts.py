"""What a sampler returns: :class:`Rollouts`, token tensors with the behavior log-probs and versions of every token.

Layout (N rows = number of prompts × group size G; prompt i's samples are rows i·G … i·G + G − 1):

==================  ========  =========  =====================================================================
field               shape     dtype      meaning
==================  ========  =========  =====================================================================
``prompt_ids``      [N, P]    int64      prompt tokens, **left**-padded with ``pad_id``
``prompt_mask``     [N, P]    bool       True on real prompt tokens
``response_ids``    [N, T]    int64      sampled tokens, **right**-padded with ``pad_id``
``response_mask``   [N, T]    bool       True on sampled tokens, the EOS included (it is trained on); False after
``behav_logp``      [N, T]    float32    log μ of each sampled token under the sampling distribution; 0 at pad
``versions``        [N, T]    int64      policy version that produced each token; −1 at pad, −2 at tool output
``group_ids``       [N]       int64      index of the row's prompt (its group)
``truncated``       [N]       bool       hit ``max_new_tokens`` without EOS
``texts``           N         str        decoded responses, EOS and padding removed
``behav_entropy``   [N, T]    float32    entropy of the sampling distribution at each step (0 at pad); optional
``tool_mask``       [N, T]    bool       True on tool-output tokens (context written by a tool, not sampled);
                                         all False without tools (the default)
``behav_dist_logp`` [N, T, K] float32    log μ of the sampling distribution at each step: all V tokens (K = V,
                                         ``behav_dist_ids`` None) or its K most likely ones; −inf at pad; optional
``behav_dist_ids``  [N, T, K] int64      the token ids of ``behav_dist_logp``'s entries (top-k); None when full
==================  ========  =========  =====================================================================

The behavior distribution (``behav_dist_*``) is recorded only when a method needs it (score centering:
``record_dist`` of :func:`steadyrl.rollout.sampler.generate`).

A response is the model's sampled tokens interleaved with tool turns (:mod:`steadyrl.rollout.multiturn`):
``response_mask`` marks the sampled tokens (trained on, importance-weighted, counted in ESS and KL) and ``tool_mask``
the tool-output tokens (attended as context, never trained on); the two never overlap. Without tools the response
mask is a prefix (True up to and including EOS, or everywhere when truncated); with tools it has holes.

The **attention mask** of a row is ``[prompt_mask; response_mask | tool_mask]`` (:func:`attention_mask`) and the
position ids are implicit, ``cumsum(attention) − 1``, so token t of a response sits at ``prompt_len + t`` whatever the
padding; the sampler and the learner's recompute both use this rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

#: Version recorded at padding positions.
PAD_VERSION: int = -1
#: Version recorded at tool-output tokens (written by the environment, not sampled: ``response_mask`` False there).
TOOL_VERSION: int = -2


class TokenBatchLike(Protocol):
    """Anything carrying the token tensors a learner forward needs (:class:`Rollouts`, :class:`TokenBatch`)."""

    @property
    def prompt_ids(self) -> Tensor: ...
    @property
    def prompt_mask(self) -> Tensor: ...
    @property
    def response_ids(self) -> Tensor: ...
    @property
    def response_mask(self) -> Tensor: ...
    @property
    def tool_mask(self) -> Tensor | None: ...


class TokenBatch(NamedTuple):
    """Prompt and response tokens without sampler metadata (layout and shapes as in :class:`Rollouts`).

    ``tool_mask`` None means no tool-output token (all False).
    """

    prompt_ids: Int[Tensor, "N P"]
    prompt_mask: Bool[Tensor, "N P"]
    response_ids: Int[Tensor, "N T"]
    response_mask: Bool[Tensor, "N T"]
    tool_mask: Bool[Tensor, "N T"] | None = None


def context_mask(batch: TokenBatchLike) -> Bool[Tensor, "N T"]:
    """The attended response tokens, ``response_mask | tool_mask`` (sampled tokens and tool output), bool [N, T]."""
    sampled = batch.response_mask.bool()
    tool = getattr(batch, "tool_mask", None)  # None or absent (a batch type from before tool turns): no tool token
    return sampled if tool is None else sampled | tool.bool()


def attention_mask(batch: TokenBatchLike) -> Bool[Tensor, "N P+T"]:
    """``[prompt_mask; response_mask | tool_mask]``: every real token of ``[prompt; response]``, bool [N, P + T]."""
    return torch.cat([batch.prompt_mask.bool(), context_mask(batch)], dim=-1)


@dataclass(frozen=True, eq=False)
class Rollouts:
    """A batch of sampled responses with their behavior log-probs (see the module docstring for the layout)."""

    prompt_ids: Int[Tensor, "N P"]
    prompt_mask: Bool[Tensor, "N P"]
    response_ids: Int[Tensor, "N T"]
    response_mask: Bool[Tensor, "N T"]
    behav_logp: Float[Tensor, "N T"]
    versions: Int[Tensor, "N T"]
    group_ids: Int[Tensor, " N"]
    truncated: Bool[Tensor, " N"]
    texts: list[str]
    pad_id: int
    behav_entropy: Float[Tensor, "N T"] | None = None
    tool_mask: Bool[Tensor, "N T"] | None = None
    """None at construction becomes all False (no tool turn)."""
    behav_dist_logp: Float[Tensor, "N T K"] | None = None
    behav_dist_ids: Int[Tensor, "N T K"] | None = None

    def __post_init__(self) -> None:
        N, T = self.response_ids.shape
        if self.tool_mask is None:
            object.__setattr__(self, "tool_mask", torch.zeros_like(self.response_mask, dtype=torch.bool))
        per_token = {"response_mask": self.response_mask, "behav_logp": self.behav_logp, "versions": self.versions,
                     "tool_mask": self.tool_mask}  # fmt: skip
        if self.behav_entropy is not None:
            per_token["behav_entropy"] = self.behav_entropy
        for name, value in per_token.items():
            if tuple(value.shape) != (N, T):
                raise ValueError(f"Rollouts.{name} has shape {tuple(value.shape)}, expected {(N, T)}")
        if self.prompt_ids.shape[0] != N or self.prompt_mask.shape != self.prompt_ids.shape:
            raise ValueError(f"prompt_ids {tuple(self.prompt_ids.shape)} / prompt_mask must be [N={N}, P]")
        for name, value in {"group_ids": self.group_ids, "truncated": self.truncated}.items():
            if tuple(value.shape) != (N,):
                raise ValueError(f"Rollouts.{name} has shape {tuple(value.shape)}, expected {(N,)}")
        if len(self.texts) != N:
            raise ValueError(f"Rollouts.texts has {len(self.texts)} entries, expected {N}")
        dist, ids = self.behav_dist_logp, self.behav_dist_ids
        if dist is None and ids is not None:
            raise ValueError("Rollouts.behav_dist_ids is set without behav_dist_logp")
        if dist is not None and (dist.dim() != 3 or tuple(dist.shape[:2]) != (N, T)):
            raise ValueError(f"Rollouts.behav_dist_logp has shape {tuple(dist.shape)}, expected {(N, T)} + (K,)")
        if ids is not None and dist is not None and ids.shape != dist.shape:
            raise ValueError(f"Rollouts.behav_dist_ids has shape {tuple(ids.shape)}, expected {tuple(dist.shape)}")

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def tokens(self) -> TokenBatch:
        """The token tensors (what the learner's forward needs)."""
        return TokenBatch(self.prompt_ids, self.prompt_mask, self.response_ids, self.response_mask, self.tool_mask)

    def to(self, device: torch.device | str) -> Rollouts:
        """The same rollouts with every tensor on ``device`` (e.g. from a sampler's device to the learner's)."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        moved = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in moved.items()}
        return Rollouts(**moved)

    def select(self, rows: Int[Tensor, " K"] | Sequence[int]) -> Rollouts:
        """The rows ``rows`` (in that order), with padding columns no kept row uses trimmed away.

        Group ids are relabelled densely (0, 1, … in increasing order of the original ids) so they stay in
        ``[0, K)``, as :mod:`steadyrl.core.groups` requires; rows of one group stay one group.
        """
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.response_ids.device)
        dense_groups = torch.unique(self.group_ids[idx], return_inverse=True)[1]
        entropy = None if self.behav_entropy is None else self.behav_entropy[idx]
        picked = Rollouts(
            prompt_ids=self.prompt_ids[idx],
            prompt_mask=self.prompt_mask[idx],
            response_ids=self.response_ids[idx],
            response_mask=self.response_mask[idx],
            behav_logp=self.behav_logp[idx],
            versions=self.versions[idx],
            group_ids=dense_groups,
            truncated=self.truncated[idx],
            texts=[self.texts[i] for i in idx.tolist()],
            pad_id=self.pad_id,
            behav_entropy=entropy,
            tool_mask=_tool_mask(self)[idx],
            behav_dist_logp=None if self.behav_dist_logp is None else self.behav_dist_logp[idx],
            behav_dist_ids=None if self.behav_dist_ids is None else self.behav_dist_ids[idx],
        )
        return _trim(picked)


def _left_pad(x: Tensor, width: int, fill: float | int | bool) -> Tensor:
    return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=fill)


def _right_pad(x: Tensor, width: int, fill: float | int | bool) -> Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill)


def _pad_steps(x: Tensor, width: int, fill: float | int) -> Tensor:
    """``[N, T, K]`` padded with ``fill`` to ``width`` steps (on the right of the step axis)."""
    return torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[1]), value=fill)


def _tool_mask(r: Rollouts) -> Tensor:
    """``r.tool_mask``; all False for a Rollouts unpickled from before tool turns existed (the class default None)."""
    return torch.zeros_like(r.response_mask, dtype=torch.bool) if r.tool_mask is None else r.tool_mask


def _kept_widths(tokens: TokenBatchLike) -> tuple[int, int]:
    """Prompt columns some row uses (counted from the right) and response columns up to the last one some row
    attends (from the left; a sampled or a tool token: the response mask has holes after a tool turn)."""
    if tokens.prompt_mask.shape[0] == 0:
        return 0, 0
    used = context_mask(tokens).any(dim=0)  # [T]
    last = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
    return int(tokens.prompt_mask.sum(dim=-1).max()), last


def trim_padding(tokens: TokenBatch) -> TokenBatch:
    """Drop the padding columns every row has: left of the prompts, right of the responses (values unchanged)."""
    p_keep, t_keep = _kept_widths(tokens)
    P = tokens.prompt_ids.shape[1]
    return TokenBatch(
        tokens.prompt_ids[:, P - p_keep :],
        tokens.prompt_mask[:, P - p_keep :],
        tokens.response_ids[:, :t_keep],
        tokens.response_mask[:, :t_keep],
        None if tokens.tool_mask is None else tokens.tool_mask[:, :t_keep],
    )


def _trim(r: Rollouts) -> Rollouts:
    """:func:`trim_padding` for every per-token field of ``r``."""
    p_keep, t_keep = _kept_widths(r)
    P, T = r.prompt_ids.shape[1], r.response_ids.shape[1]
    if p_keep == P and t_keep == T:
        return r
    tokens = trim_padding(r.tokens)
    entropy = None if r.behav_entropy is None else r.behav_entropy[:, :t_keep]
    return Rollouts(
        prompt_ids=tokens.prompt_ids,
        prompt_mask=tokens.prompt_mask,
        response_ids=tokens.response_ids,
        response_mask=tokens.response_mask,
        behav_logp=r.behav_logp[:, :t_keep],
        versions=r.versions[:, :t_keep],
        group_ids=r.group_ids,
        truncated=r.truncated,
        texts=r.texts,
        pad_id=r.pad_id,
        behav_entropy=entropy,
        tool_mask=tokens.tool_mask,
        behav_dist_logp=None if r.behav_dist_logp is None else r.behav_dist_logp[:, :t_keep],
        behav_dist_ids=None if r.behav_dist_ids is None else r.behav_dist_ids[:, :t_keep],
    )


def concat(parts: Sequence[Rollouts]) -> Rollouts:
    """Stack rollouts row-wise, re-padding prompts on the left and responses on the right to a common width.

    Group ids are offset so groups of different parts stay distinct (part j's ids are shifted by one more than the
    largest id of the parts before it). ``behav_entropy`` and the behavior distribution (``behav_dist_*``) are kept
    only when every part has them (the distribution: with the same K, all full or all top-k).
    """
    if not parts:
        raise ValueError("concat needs at least one Rollouts")
    pad_ids = {p.pad_id for p in parts}
    if len(pad_ids) != 1:
        raise ValueError(f"cannot concatenate rollouts with different pad ids {sorted(pad_ids)}")
    P = max(p.prompt_ids.shape[1] for p in parts)
    T = max(p.response_ids.shape[1] for p in parts)
    pad = parts[0].pad_id
    offsets, next_id = [], 0
    for p in parts:
        offsets.append(next_id)
        next_id += int(p.group_ids.max()) + 1 if len(p) else 0
    entropy = None
    if all(p.behav_entropy is not None for p in parts):
        entropy = torch.cat([_right_pad(p.behav_entropy, T, 0.0) for p in parts])  # type: ignore[arg-type]
    dist = ids = None
    dists = [p.behav_dist_logp for p in parts]
    if all(d is not None for d in dists) and len({d.shape[-1] for d in dists}) == 1:  # type: ignore[union-attr]
        dist = torch.cat([_pad_steps(d, T, -torch.inf) for d in dists])  # type: ignore[arg-type]
        if all(p.behav_dist_ids is not None for p in parts):
            ids = torch.cat([_pad_steps(p.behav_dist_ids, T, 0) for p in parts])  # type: ignore[arg-type]
        elif any(p.behav_dist_ids is not None for p in parts):
            dist = None  # full and top-k records do not mix
    return Rollouts(
        prompt_ids=torch.cat([_left_pad(p.prompt_ids, P, pad) for p in parts]),
        prompt_mask=torch.cat([_left_pad(p.prompt_mask, P, False) for p in parts]),
        response_ids=torch.cat([_right_pad(p.response_ids, T, pad) for p in parts]),
        response_mask=torch.cat([_right_pad(p.response_mask, T, False) for p in parts]),
        behav_logp=torch.cat([_right_pad(p.behav_logp, T, 0.0) for p in parts]),
        versions=torch.cat([_right_pad(p.versions, T, PAD_VERSION) for p in parts]),
        group_ids=torch.cat([p.group_ids + off for p, off in zip(parts, offsets, strict=True)]),
        truncated=torch.cat([p.truncated for p in parts]),
        texts=[t for p in parts for t in p.texts],
        pad_id=pad,
        behav_entropy=entropy,
        tool_mask=torch.cat([_right_pad(_tool_mask(p), T, False) for p in parts]),
        behav_dist_logp=dist,
        behav_dist_ids=ids,
    )
