"""Token-budget micro-batching with an exact gradient, for every method and every aggregation mode.

A method's loss is a function of the whole batch: token-mean needs the global token count, GRPO's baselines and
GMC-GRPO's group mass need whole groups, OPOB and VCPO's ESS are batch statistics. Splitting the loss by rows and
summing the pieces is exact only for some of them. The learner therefore splits the *model*, not the loss
(``optim.microbatch_tokens``):

1. **values** (no graph kept): per micro-batch, one forward gives ``logp`` (and COPC's hidden states, or OPOB's
   per-trajectory gradient norms, when the method reads them); they are scattered back into full-batch tensors;
2. **loss**: the method's loss on the full batch, with ``logp`` (and ``hidden``) as leaf tensors;
   ``L.backward()`` gives a = ∂L/∂logp ``[N, T]`` (and ∂L/∂hidden), and the critic head's gradient;
3. **gradient**: per micro-batch, a forward with grad and ``backward(a[rows])``: by the chain rule
   ∇θ L = Σ_{i,t} a_{i,t} ∇θ logp_{i,t} = Σ_micro-batches ∇θ ⟨a_mb, logp_mb⟩, exact for any L.

Step 1 costs one no-grad forward per optimizer step; when the learner has just recomputed π_prox with the same
weights (``recompute_prox``, or several updates per batch, at the first one) those values are reused and step 1 is
free. A loss that reads only log-probs and vocabulary terms usually skips it: the learner forwards each micro-batch
once and takes a at its rows from the loss on the values known so far, then checks every a against step 2's and
backpropagates any difference (:meth:`steadyrl.train.learner.Learner._speculative_backward`; metric
``train/values_pass``). The forward must be deterministic (no dropout), as in RL fine-tuning.

A micro-batch costs rows × (longest prompt + longest response among its rows) tokens (padding is trimmed per
micro-batch); rows are packed longest first, greedily, so a budget of B tokens bounds every forward's activations.
A row longer than B alone goes into a micro-batch of its own (its cost is its own length).
Confidence: [exact] (the chain rule; tested to 1e-10 in float64 against the full-batch gradient for every method).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from steadyrl.rollout.rollouts import TokenBatchLike, context_mask


def row_widths(batch: TokenBatchLike) -> tuple[list[int], list[int]]:
    """(real prompt tokens, response columns up to the last attended one) of every row (host lists)."""
    prompt = batch.prompt_mask.sum(dim=-1)
    ctx = context_mask(batch)
    T = ctx.shape[1]
    cols = torch.arange(1, T + 1, device=ctx.device)
    response = torch.where(ctx, cols, torch.zeros_like(cols)).amax(dim=-1) if T else torch.zeros_like(prompt)
    return prompt.tolist(), response.tolist()


def plan_microbatches(batch: TokenBatchLike, budget: int) -> list[Tensor]:
    """Row indices of micro-batches whose padded size rows × (max prompt + max response) is at most ``budget``.

    Longest rows first, each added to the current micro-batch while it still fits (then a new one starts); the
    result covers every row exactly once. One micro-batch (every row) when the whole batch fits.
    """
    if budget < 1:
        raise ValueError(f"microbatch_tokens must be >= 1, got {budget}")
    prompt, response = row_widths(batch)
    N = len(prompt)
    order = sorted(range(N), key=lambda i: (prompt[i] + response[i], i), reverse=True)
    device = batch.response_ids.device
    plans: list[list[int]] = []
    current: list[int] = []
    p_max = r_max = 0
    for i in order:
        p, r = max(p_max, prompt[i]), max(r_max, response[i])
        if current and (len(current) + 1) * (p + r) > budget:
            plans.append(current)
            current, p, r = [], prompt[i], response[i]
        current.append(i)
        p_max, r_max = p, r
    if current:
        plans.append(current)
    return [torch.tensor(sorted(rows), dtype=torch.long, device=device) for rows in plans]


def scatter_rows(parts: Sequence[tuple[Tensor, Tensor]], *, like: Tensor) -> Tensor:
    """A tensor shaped ``like`` (zeros) with each ``(rows, values)`` part written at ``rows`` (and its leading
    columns: a micro-batch's responses are trimmed on the right)."""
    out = torch.zeros_like(like)
    for rows, values in parts:
        if values.dim() == 1:
            out[rows] = values.to(out.dtype)
        else:
            out[rows, : values.shape[1]] = values.to(out.dtype)
    return out


def take_rows(full: Tensor, rows: Tensor, width: int | None) -> Tensor:
    """``full[rows]``, its second dimension cut to ``width`` (a micro-batch's trimmed response length)."""
    picked = full[rows]
    return picked if width is None or picked.dim() == 1 else picked[:, :width]
