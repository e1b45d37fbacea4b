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
==================  ========  =========  =====================================================================

Position ids are implicit: ``cumsum([prompt_mask; response_mask]) − 1``, so token t of a response sits at
``prompt_len + t`` whatever the padding; the sampler and the learner's recompute both use this rule.
The response mask of a row is a prefix (True up to and including EOS, or everywhere when truncated).
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
    """Anything carrying the four token tensors a learner forward needs (:class:`Rollouts`, :class:`TokenBatch`)."""

    @property
    def prompt_ids(self) -> Tensor: ...
    @property
    def prompt_mask(self) -> Tensor: ...
    @property
    def response_ids(self) -> Tensor: ...
    @property
    def response_mask(self) -> Tensor: ...


class TokenBatch(NamedTuple):
    """Prompt and response tokens without sampler metadata (layout and shapes as in :class:`Rollouts`)."""

    prompt_ids: Int[Tensor, "N P"]
    prompt_mask: Bool[Tensor, "N P"]
    response_ids: Int[Tensor, "N T"]
    response_mask: Bool[Tensor, "N T"]


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

    def __post_init__(self) -> None:
        N, T = self.response_ids.shape
        per_token = {"response_mask": self.response_mask, "behav_logp": self.behav_logp, "versions": self.versions}
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

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def tokens(self) -> TokenBatch:
        """The four token tensors (what the learner's forward needs)."""
        return TokenBatch(self.prompt_ids, self.prompt_mask, self.response_ids, self.response_mask)

    @property
    def response_lengths(self) -> Int[Tensor, " N"]:
        """Number of trained tokens of each response (EOS included)."""
        return self.response_mask.sum(dim=-1)

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
        )
        return _trim(picked)


def _left_pad(x: Tensor, width: int, fill: float | int | bool) -> Tensor:
    return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=fill)


def _right_pad(x: Tensor, width: int, fill: float | int | bool) -> Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill)


def _kept_widths(prompt_mask: Tensor, response_mask: Tensor) -> tuple[int, int]:
    """Prompt columns some row uses (counted from the right) and response columns some row uses (from the left)."""
    if prompt_mask.shape[0] == 0:
        return 0, 0
    return int(prompt_mask.sum(dim=-1).max()), int(response_mask.sum(dim=-1).max())


def trim_padding(tokens: TokenBatch) -> TokenBatch:
    """Drop the padding columns every row has: left of the prompts, right of the responses (values unchanged)."""
    p_keep, t_keep = _kept_widths(tokens.prompt_mask, tokens.response_mask)
    P = tokens.prompt_ids.shape[1]
    return TokenBatch(
        tokens.prompt_ids[:, P - p_keep :],
        tokens.prompt_mask[:, P - p_keep :],
        tokens.response_ids[:, :t_keep],
        tokens.response_mask[:, :t_keep],
    )


def _trim(r: Rollouts) -> Rollouts:
    """:func:`trim_padding` for every per-token field of ``r``."""
    p_keep, t_keep = _kept_widths(r.prompt_mask, r.response_mask)
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
    )


def concat(parts: Sequence[Rollouts]) -> Rollouts:
    """Stack rollouts row-wise, re-padding prompts on the left and responses on the right to a common width.

    Group ids are offset so groups of different parts stay distinct (part j's ids are shifted by one more than the
    largest id of the parts before it). ``behav_entropy`` is kept only when every part has it.
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
    )
