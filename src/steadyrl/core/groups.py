"""Per-group reductions over ``group_ids`` without host syncs.

``group_ids`` (shape ``[B]``, int64) labels the prompt each response belongs to. Ids must lie in ``[0, B)``
(any labelling of at most B groups; they need not be contiguous or sorted). Reductions scatter into a buffer of
size B, so the number of groups never has to be read on the host. Each ``group_*`` function returns the group's
statistic broadcast back to its members (shape ``[B]``).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor


def _scatter_sum(x: Tensor, group_ids: Tensor) -> Tensor:
    return torch.zeros(x.shape[0], dtype=x.dtype, device=x.device).index_add(0, group_ids, x)


def group_sum(x: Float[Tensor, " B"], *, group_ids: Int[Tensor, " B"]) -> Float[Tensor, " B"]:
    """Σ_{j∈g(i)} x_j for every i."""
    return _scatter_sum(x, group_ids)[group_ids]


def group_count(group_ids: Int[Tensor, " B"], *, dtype: torch.dtype = torch.float32) -> Float[Tensor, " B"]:
    """|g(i)|: size of the group of each member."""
    ones = torch.ones(group_ids.shape[0], dtype=dtype, device=group_ids.device)
    return _scatter_sum(ones, group_ids)[group_ids]


def group_mean(x: Float[Tensor, " B"], *, group_ids: Int[Tensor, " B"]) -> Float[Tensor, " B"]:
    """mean_{j∈g(i)} x_j."""
    return group_sum(x, group_ids=group_ids) / group_count(group_ids, dtype=x.dtype)


def group_std(x: Float[Tensor, " B"], *, group_ids: Int[Tensor, " B"], unbiased: bool) -> Float[Tensor, " B"]:
    """Standard deviation of x within each group (population when ``unbiased`` is False, else n−1; 0 for n = 1)."""
    n = group_count(group_ids, dtype=x.dtype)
    dev2 = (x - group_mean(x, group_ids=group_ids)) ** 2
    denom = (n - 1).clamp(min=1) if unbiased else n
    return (group_sum(dev2, group_ids=group_ids) / denom).sqrt()


def group_logsumexp(x: Float[Tensor, " B"], *, group_ids: Int[Tensor, " B"]) -> Float[Tensor, " B"]:
    """log Σ_{j∈g(i)} exp(x_j), stable for any magnitude of x (per-group max shift)."""
    B = x.shape[0]
    gmax = torch.full((B,), -torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(
        0, group_ids, x, reduce="amax", include_self=True
    )
    shift = gmax[group_ids].detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    return torch.log(group_sum(torch.exp(x - shift), group_ids=group_ids)) + shift


def rank_in_group(group_ids: Int[Tensor, " B"]) -> Int[Tensor, " B"]:
    """Each member's position among its group's members, in batch order (0 for the first): [B], no host sync."""
    B = group_ids.shape[0]
    counts = torch.bincount(group_ids, minlength=B)
    order = torch.argsort(group_ids, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(group_ids)
    rank[order] = torch.arange(B, device=group_ids.device) - starts[group_ids[order]]
    return rank
