"""M2PO, second-moment trust region (Zheng et al., "Prosperity before Collapse", arXiv 2510.01161).

M2PO bounds the second moment M2 = mean_t δ_t² of the behavior → learner log-ratio δ_t = log μ − log π_prox by
τ = 0.04, so only extreme outliers lose their update. Two implementations, both here (docs/algorithms.md, ``m2po``):

1. ``m2po_mask`` [reference-code, AReaL ``m2_threshold``]: drop the tokens with the largest δ² until the mean of
   the rest is below τ; returns ``Corrected``. The objective is then ``ppo.ppo_clip_loss`` (or
   ``ppo.reinforce_loss``) on the returned mask with ``agg="token-mean"``: (1/kept) Σ m r A, the kept count being
   the denominator.
2. ``m2po_clip_range`` [reference-code, the authors' repository]: never masks; narrows the PPO clip range until the
   harmful tokens' capped M2 meets the budget; pass the returned ``clip_low`` / ``clip_high`` (0-d tensors) to
   ``ppo.ppo_clip_loss``. The authors train in verl's bypass mode (π_old := μ), i.e. ``prox_logp = behav_logp``.

Both are computed once per batch before the update, from detached inputs, with one sort and one cumsum: no loop
over tokens and no host synchronization.

"Harmful" tokens (where the update pushes the policy further from μ): A > 0 ∧ r > 1 or A < 0 ∧ r < 1, with
r = π_prox / μ = exp(−δ); the authors' code tests A and r against ±1e-12 (``HARMFUL_TOL``).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from steadyrl.core.masking import as_bool_mask, detach_metrics, masked_mean, masked_sum, where_masked
from steadyrl.core.objectives.ppo import mask_frac
from steadyrl.core.types import Corrected, Metrics

#: M2PO's second-moment budget τ_M2 (the paper's and AReaL's example value).
M2PO_TAU: float = 0.04
#: Tolerance of the authors' harmful-token test: A > tol, r > 1 + tol (taken as log r > tol), and symmetrically.
HARMFUL_TOL: float = 1e-12
#: Tolerance of the authors' clip-range search (breakpoint offset, budget slack, "already within budget" slack).
BREAKPOINT_TOL: float = 1e-12
#: Floors the authors' loss function offers for the narrowed ranges (off in their training scripts; not defaults).
AUTHORS_FLOOR_LOW: float = 0.3
AUTHORS_FLOOR_HIGH: float = 0.5

BudgetScope = Literal["candidates", "valid"]
BUDGET_SCOPES: tuple[str, ...] = get_args(BudgetScope)

#: The signed integer type as wide as each float type, to sort floats by their IEEE-754 bits (``sort_floats``).
_BITS_DTYPE: dict[torch.dtype, torch.dtype] = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


class SortedFloats(NamedTuple):
    """Result of ``sort_floats``: the sorted values and, for each, its index in the input."""

    values: Float[Tensor, " N"]
    indices: Int[Tensor, " N"]


def sort_floats(x: Float[Tensor, " N"], *, descending: bool = False) -> SortedFloats:
    """``torch.sort(x, descending=descending, stable=True)`` of a 1-D float tensor, through integer keys.

    PyTorch's CPU sort is a radix sort for integers but a comparison sort for floats, about 6× slower (B·T = 2.6e5
    values: ~26 ms against ~4 ms). The key is the float's IEEE-754 bit pattern read as a signed integer, with the
    magnitude bits flipped where the sign bit is set (key = bits ⊕ 0x7F…F for negative numbers): an order-preserving
    map, so ascending keys are ascending floats; a descending sort sorts the complement ~key. Values and order are
    torch.sort's, ties in index order, except that −0.0 sorts just below +0.0 and a NaN with its sign bit set sorts
    before −inf instead of after +inf.
    """
    bits = x.contiguous().view(_BITS_DTYPE[x.dtype])
    key = torch.where(bits < 0, bits ^ torch.iinfo(bits.dtype).max, bits)  # monotone in x
    order = torch.sort(~key if descending else key, stable=True).indices
    return SortedFloats(values=x.gather(0, order), indices=order)


class M2POClipRange(NamedTuple):
    """Result of ``m2po_clip_range``.

    ===============  =====  ===========================================================================
    field            dtype  meaning
    ===============  =====  ===========================================================================
    ``clip_low``     f64    ε_low = 1 − e^{−τ'} (≥ ``floor_low`` when given); 1 when no clip is needed
    ``clip_high``    f64    ε_high = e^{τ'} − 1 (≥ ``floor_high`` when given); +inf when no clip is needed
    ``tau_prime``    f64    τ', the log-ratio bound; +inf when no clip is needed
    ``m2``           f64    M2 of the harmful tokens, mean δ² (0 when there are none)
    ``m2_after``     f64    mean_j min(δ_j², τ'²) over the harmful tokens (= ``m2`` when no clip is needed)
    ``k``            i64    the breakpoint index found (0-based, ascending order); n when no clip is needed
    ``metrics``             ``m2po/clip_low``, ``m2po/clip_high``, ``m2po/m2``, ``m2po/m2_after``,
                            ``m2po/harmful_frac``
    ===============  =====  ===========================================================================
    """

    clip_low: Float[Tensor, ""]
    clip_high: Float[Tensor, ""]
    tau_prime: Float[Tensor, ""]
    m2: Float[Tensor, ""]
    m2_after: Float[Tensor, ""]
    k: Int[Tensor, ""]
    metrics: Metrics


def _at(x: Tensor, index: Int[Tensor, ""]) -> Tensor:
    """``x[index]`` for a 0-d index tensor without a host sync (plain indexing would call ``.item()``)."""
    return x.index_select(0, index.reshape(1)).squeeze(0)


def harmful_tokens(
    *,
    log_ratio: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
) -> Bool[Tensor, "B T"]:
    """Masked-in tokens with (A > 0 ∧ r > 1) ∨ (A < 0 ∧ r < 1), r = π_prox/μ = exp(−δ), δ = ``log_ratio``.

    [reference-code] The M2PO authors' trust-region token set; A and log r are compared with ±``HARMFUL_TOL``.
    """
    m = as_bool_mask(mask)
    delta = where_masked(log_ratio.detach(), m)  # δ = −log r, log r = log π_prox − log μ
    adv = where_masked(advantages.detach(), m)
    pushes_up = (adv > HARMFUL_TOL) & (delta < -HARMFUL_TOL)  # A > 0 ∧ r > 1 (log r > tol ⇔ δ < −tol)
    pushes_down = (adv < -HARMFUL_TOL) & (delta > HARMFUL_TOL)  # A < 0 ∧ r < 1 (log r < −tol ⇔ δ > tol)
    return m & (pushes_up | pushes_down)


def m2po_mask(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    tau: float = M2PO_TAU,
    harmful_only: bool = False,
    advantages: Float[Tensor, "B T"] | None = None,
    budget_over: BudgetScope | str = "candidates",
) -> Corrected:
    """M2PO token mask: drop the largest δ² until the second moment of the rest is below τ (arXiv 2510.01161).

    [reference-code, AReaL] With δ_t = log μ − log π_prox (``log_ratio``, detached) and the candidate tokens sorted
    by δ² descending, v_1 ≥ v_2 ≥ … ≥ v_n::

        M2(k) = (Σ_{budget set} δ² − Σ_{j≤k} v_j) / (|budget set| − k)        (mean of the rest after dropping k)
        k*    = min{k ∈ [0, n] : M2(k) < τ}      drop the k* largest; keep every other masked-in token

    Options (the paper leaves the restriction ambiguous):

    - ``harmful_only=False`` (default, AReaL): every masked-in token is a candidate.
    - ``harmful_only=True`` [reconstructed]: only harmful tokens (``harmful_tokens``; needs ``advantages``) can be
      dropped, as the paper describes the mask.
    - ``budget_over="candidates"`` (default): M2 is the mean over the candidates (the authors' clip rule also
      measures M2 over harmful tokens only). ``"valid"``: over every masked-in token, so with ``harmful_only`` the
      budget can be unreachable. Identical when ``harmful_only`` is False.

    When no k < n meets the budget, every candidate is dropped (k* = n) and ``m2po/budget_unreachable`` = 1. AReaL
    keeps the single smallest token there instead (only to avoid its "all masked" assertion); here an all-masked
    batch is legal and gives a zero loss downstream.

    Shapes: ``log_ratio``, ``mask``, ``advantages`` [B, T]. Returns ``Corrected(weights=1, mask=kept, metrics)``;
    reduce the loss with ``token-mean`` over the kept mask (the kept count is M2PO's denominator).

    Metrics: ``m2po/masked_frac`` (dropped / masked-in tokens), ``m2po/m2_before`` and ``m2po/m2_after`` (mean δ²
    over the budget set before and after dropping), ``m2po/budget_unreachable``.
    """
    if budget_over not in BUDGET_SCOPES:
        raise ValueError(f"budget_over {budget_over!r} is not one of {', '.join(BUDGET_SCOPES)}")
    if harmful_only and advantages is None:
        raise ValueError("m2po_mask(harmful_only=True) needs advantages to find the harmful tokens")
    m = as_bool_mask(mask)
    delta = where_masked(log_ratio.detach(), m)  # δ = log μ − log π_prox (0 where masked out)
    sq = delta**2  # δ²
    if harmful_only and advantages is not None:
        candidates = harmful_tokens(log_ratio=delta, advantages=advantages, mask=m)
    else:
        candidates = m
    budget_set = candidates if budget_over == "candidates" else m

    flat_sq, flat_cand = sq.flatten(), candidates.flatten()
    N = flat_sq.numel()
    sorted_sq, order = sort_floats(torch.where(flat_cand, flat_sq, -torch.inf), descending=True)  # v_1 ≥ … ≥ v_n
    n = torch.count_nonzero(flat_cand)
    n_budget = torch.count_nonzero(budget_set)
    budget_sum = masked_sum(sq, budget_set)  # Σ_{budget set} δ²
    idx = torch.arange(N + 1, device=sq.device)  # k = 0 … N
    dropped_sum = torch.cat([sq.new_zeros(1), torch.cumsum(where_masked(sorted_sq, idx[1:] <= n), 0)])  # Σ_{j≤k} v_j
    rest_count = n_budget - idx
    rest_mean = (budget_sum - dropped_sum) / rest_count.clamp(min=1).to(sq.dtype)  # M2(k)
    meets = (rest_mean < tau) & (rest_count > 0)
    stop = (meets | (idx == n)) & (idx <= n)  # k ≤ n; dropping every candidate is the last resort
    k = stop.to(torch.uint8).argmax()  # k*: first index that stops (argmax returns the first maximum)

    # Drop the first k* tokens of the sort order: scatter "sorted position < k*" back to the token positions.
    in_top = torch.empty_like(flat_cand).scatter_(0, order, idx[:N] < k)
    dropped = (flat_cand & in_top).view_as(m)
    kept = m & ~dropped
    metrics: Metrics = {
        "m2po/masked_frac": mask_frac(dropped, m),
        "m2po/m2_before": budget_sum / n_budget.clamp(min=1).to(sq.dtype),  # mean δ² over the budget set
        "m2po/m2_after": masked_mean(sq, budget_set & kept),
        "m2po/budget_unreachable": ((n > 0) & ~_at(meets, k)).to(torch.get_default_dtype()),
    }
    return Corrected(torch.ones_like(delta), kept, detach_metrics(metrics), unit_weights=True)


def m2po_clip_range(
    *,
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    advantages: Float[Tensor, "B T"],
    tau: float = M2PO_TAU,
    floor_low: float | None = None,
    floor_high: float | None = None,
) -> M2POClipRange:
    """M2PO clip narrowing: the PPO clip range that caps the harmful tokens' M2 at τ (arXiv 2510.01161).

    [reference-code, the authors' repository (``kpo_clip_harmful_tokens``)] Over the n harmful tokens
    (``harmful_tokens``) with v the ascending δ² values, v_0 ≤ … ≤ v_{n−1} (0-based)::

        no clip               if n = 0 or M2 = (1/n) Σ v ≤ τ + 1e-12
        k  = min{k : Σ_{j≤k} v_j + (n − k − 1)·(v_k − 1e-12) ≥ τ·n − 1e-12}
        τ'² = v_{k−1} − 1e-12   (τ' = 0 if k = 0, or if τ·n ≤ 1e-12)
        ratio bounds [e^{−τ'}, e^{τ'}]  (float32)  →  ε_low = 1 − e^{−τ'},  ε_high = e^{τ'} − 1  (float64)
        optional floors: ε_low ← max(ε_low, floor_low), ε_high ← max(ε_high, floor_high)

    The order is the authors' (``kpo_clip_harmful_tokens`` returns the float32 bounds as Python floats and
    ``compute_m2po_policy_loss`` takes ε = 1 − bound, bound − 1 in Python): 1 − ε_low and 1 + ε_high are then exactly
    the float32 bounds, so a ratio sitting on a bound is unclipped on both sides, as in their code. (In a float32 loss
    ``ppo.ppo_clip_loss`` forms 1 − ε in float32, exact while ε_low ≤ 1/2, i.e. τ' ≤ ln 2.) Their floors are
    ``miniclip_low`` / ``miniclip_high`` (here ``floor_low`` / ``floor_high``) and their budget ``M2_budget`` (τ).

    τ'² snaps down to a breakpoint just below v_{k−1}, so Σ_j min(v_j, τ'²) ≤ τ·n. The 1e-12 offsets are the
    authors' (``BREAKPOINT_TOL``); the search runs in float64, as their ``.item()`` arithmetic does. Choices where
    their code is silent or breaks: "no clip" is ε_low = 1, ε_high = +inf (τ' = +inf; their code returns the
    sentinel bounds [0, 1e5]); τ'² is clamped at 0 (their code would take the square root of a negative number when
    v_{k−1} < 1e-12). The authors read the advantage sign from the first token of each row; here it is A_{i,t},
    the same for broadcast sequence advantages. Their floors (0.3 / 0.5, ``AUTHORS_FLOOR_LOW/HIGH``) are off in
    their training scripts, hence ``None`` by default.

    ``log_ratio`` is δ = log μ − log π_prox [B, T] (detached; the authors evaluate it on the current log-probs in
    the loss, equal to π_prox at the first update), ``advantages`` [B, T], ``mask`` [B, T]. Returns
    ``M2POClipRange``; pass ``clip_low`` / ``clip_high`` to ``ppo.ppo_clip_loss``.
    """
    m = as_bool_mask(mask)
    delta = where_masked(log_ratio.detach(), m)  # δ = log μ − log π_prox
    harmful = harmful_tokens(log_ratio=delta, advantages=advantages, mask=m).flatten()
    sq = (delta**2).flatten()  # δ²
    v_all = sq.to(torch.float64)  # searched in float64
    N = v_all.numel()
    # Sorted on δ² in its own dtype: widening to float64 is exact and monotone, so the order is the same (and the
    # integer keys of ``sort_floats`` half as wide). The other tokens are NaN, which sorts after +inf: the first n
    # positions are the harmful tokens, ascending.
    order = sort_floats(torch.where(harmful, sq, torch.nan)).indices
    idx = torch.arange(N, device=v_all.device)
    n = torch.count_nonzero(harmful)
    n_f = n.to(torch.float64)
    is_harm = idx < n
    v = where_masked(v_all.gather(0, order), is_harm)  # v_0 ≤ … ≤ v_{n−1}, then zeros
    csum = torch.cumsum(v, 0)  # Σ_{j≤k} v_j
    total = v.sum()
    m2 = total / n_f.clamp(min=1)  # M2 of the harmful tokens
    target = tau * n_f  # τ·n
    rest = (n - idx - 1).to(torch.float64)  # n − k − 1 tokens capped at v_k
    reaches = is_harm & (csum + rest * (v - BREAKPOINT_TOL) >= target - BREAKPOINT_TOL)
    k = reaches.to(torch.uint8).argmax()  # first breakpoint that reaches the budget
    tau2 = (_at(v, (k - 1).clamp(min=0)) - BREAKPOINT_TOL).clamp(min=0.0)  # τ'² = v_{k−1} − 1e-12
    tau2 = torch.where((k == 0) | (target <= BREAKPOINT_TOL), torch.zeros_like(tau2), tau2)  # τ' = 0 cases
    no_clip = (n == 0) | (m2 <= tau + BREAKPOINT_TOL)
    tau_prime = torch.where(no_clip, torch.full_like(tau2, torch.inf), tau2.sqrt())
    # The authors' order: the ratio bounds e^{∓τ'} in float32 (``torch.exp(torch.tensor(∓τ))``), then ε from them in
    # float64 (their Python floats), so 1 − ε_low and 1 + ε_high give back exactly those bounds; taking 1 − e^{−τ'} in
    # float32 instead rounds it for τ' > ln 2 and moves the lower bound by an ulp.
    tau_f32 = tau_prime.to(torch.float32)
    ratio_low = torch.exp(-tau_f32).to(torch.float64)  # e^{−τ'} (float32 value)
    ratio_high = torch.exp(tau_f32).to(torch.float64)  # e^{τ'} (float32 value)
    clip_low = 1.0 - ratio_low  # ε_low = 1 − e^{−τ'}, exact in float64
    clip_high = ratio_high - 1.0  # ε_high = e^{τ'} − 1, exact in float64
    if floor_low is not None:
        clip_low = clip_low.clamp(min=floor_low)
    if floor_high is not None:
        clip_high = clip_high.clamp(min=floor_high)
    capped_sum = torch.minimum(v, tau2).sum()  # Σ_j min(v_j, τ'²) (v = 0 past n and τ'² ≥ 0: those add 0)
    m2_after = torch.where(no_clip, m2, capped_sum / n_f.clamp(min=1))
    k = torch.where(no_clip, n, k)
    metrics: Metrics = {
        "m2po/clip_low": clip_low,
        "m2po/clip_high": clip_high,
        "m2po/m2": m2,
        "m2po/m2_after": m2_after,
        "m2po/harmful_frac": n_f / m.sum().clamp(min=1).to(torch.float64),
    }
    return M2POClipRange(
        clip_low=clip_low.detach(),
        clip_high=clip_high.detach(),
        tau_prime=tau_prime.detach(),
        m2=m2.detach(),
        m2_after=m2_after.detach(),
        k=k,
        metrics=detach_metrics(metrics),
    )
