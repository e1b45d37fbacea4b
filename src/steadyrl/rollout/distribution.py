"""The sampling distribution: temperature, top-k and top-p truncation, renormalized, in log space.

This is the one definition of "the distribution the sampler actually sampled from". The sampler draws from it and
records the drawn token's log-prob as the behavior log-prob μ (docs/algorithms.md, notation: μ is the log-prob *of the
distribution actually sampled from*, truncation included); the learner's recompute
(:func:`steadyrl.rollout.logprobs.sequence_logprobs`) applies the same function when asked to score a token under
the sampling distribution (e.g. decoupled cooling, arXiv 2609.36953, records μ at the sampling temperature).

Order of the transforms (the order of Hugging Face's logits warpers and vLLM's sampler):

1. z = logits / T
2. top-k: keep the tokens whose z is at least the k-th largest (ties at the k-th value are all kept); k = 0 keeps all
3. top-p (nucleus): with p_v = softmax(z over the kept set), sorted in decreasing order, keep the smallest prefix
   whose mass reaches p: token v is kept iff the mass of the tokens ranked before it is < p (the top token is always
   kept); p = 1 keeps all
4. log μ(v) = z_v − logsumexp_{kept} z for kept v, −inf otherwise

Shapes: ``logits`` ``[..., V]`` (any leading dims, any float dtype) → log-probs ``[..., V]`` float32 (float64 for
float64 logits).
Confidence: [exact] (the sampler's own definition; no paper formula involved).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from steadyrl.core.entropy import token_entropy

#: top_p at or above this keeps every token (no sort needed).
TOP_P_OFF: float = 1.0
#: top_k equal to this keeps every token.
TOP_K_OFF: int = 0


class SamplingParams(NamedTuple):
    """Parameters of the sampling distribution; the defaults are plain softmax sampling (T = 1, no truncation)."""

    temperature: float = 1.0
    top_k: int = TOP_K_OFF
    top_p: float = TOP_P_OFF


def check_sampling_params(params: SamplingParams) -> None:
    """Raise ``ValueError`` naming the bad parameter (T > 0, top_k ≥ 0, 0 < top_p ≤ 1)."""
    if not params.temperature > 0:
        raise ValueError(f"temperature must be > 0 (use top_k=1 for greedy decoding), got {params.temperature}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {params.top_k}")
    if not 0 < params.top_p <= TOP_P_OFF:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {params.top_p}")


def sampling_log_probs(logits: Float[Tensor, "... V"], *, params: SamplingParams) -> Float[Tensor, "... V"]:
    """log μ(v): log-probs of the tempered, truncated, renormalized distribution (−inf outside the kept set).

    Differentiable in ``logits`` (the kept set is chosen without gradient). Computed in float32, or float64 for
    float64 logits.
    """
    check_sampling_params(params)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / params.temperature  # z = logits / T
    V = z.shape[-1]
    if params.top_k != TOP_K_OFF and params.top_k < V:
        kth = torch.topk(z.detach(), params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z.detach() < kth, -torch.inf)  # keep z_v >= k-th largest
    if params.top_p < TOP_P_OFF:
        sorted_z, order = torch.sort(z.detach(), dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # Σ_{u ranked before v} p_u
        drop_sorted = mass_before >= params.top_p  # keep v iff mass_before(v) < p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, -torch.inf)
    return torch.log_softmax(z, dim=-1)  # log μ(v) = z_v − logsumexp_kept z


def entropy_from_log_probs(log_probs: Float[Tensor, "... V"]) -> Float[Tensor, "..."]:
    """H = −Σ_v μ(v) log μ(v) over the kept tokens (tokens at −inf contribute 0, not NaN): the entropy of
    :func:`steadyrl.core.entropy.token_entropy`, the one the learner's entropy bonus differentiates."""
    return token_entropy(log_probs)
