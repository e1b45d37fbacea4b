"""Entropy bonus and the adaptive entropy coefficient (Skywork-OR1, arXiv 2505.22312, §3.2; TRL 1.16.0's rule).

The policy entropy at each trained token is a full-vocabulary quantity with gradient, of the distribution the
log-probs are scored under (the learner's temperature, top-k, top-p)::

    H_t = −Σ_v π_θ(v | s_t) log π_θ(v | s_t)

:func:`entropy_term` is it as a vocabulary term of :mod:`steadyrl.core.vocab_chunks`: computed chunk by chunk in the
same forward as log π_θ(y_t), with its gradient, never from a second full-vocabulary pass or ``[N, T, V]`` logits
with gradient (the learner asks for it under the batch key ``entropy``: :mod:`steadyrl.train.vocab_terms`).

The bonus subtracts c times an aggregate of H over the trained tokens::

    L = L_policy − c · agg_{i,t}(m H)

with ``agg`` the method's own aggregation by default (verl's ``actor.entropy_coeff``: ``agg_loss(entropy,
response_mask, loss_agg_mode)``) or a token mean Σ m H / Σ m (TRL's ``entropy_coef``: a token mean whatever the
``loss_type``). verl 0.9.1 and TRL 1.16.0 both subtract the bonus from the loss they backpropagate.

The adaptive controller (TRL ``use_adaptive_entropy``, after Skywork-OR1) moves c once per optimizer step from the
step's token-mean entropy Ĥ = Σ m H / max(Σ m, 1) (over the whole step: every micro-batch, every process), and
applies it only while the entropy of the previous step was at or below the target::

    c ← min(c + δ, c_max)   if Ĥ ≤ H_target,     c ← max(c − δ, c_min)   otherwise
    applied c_t = c if Ĥ_{t−1} ≤ H_target else 0        (Ĥ_{−1} = +∞: nothing applied at the first step)

:func:`adaptive_entropy_coef` and :func:`applied_entropy_coef` take floats or tensors (the controller of
:mod:`steadyrl.control.adaptive_entropy` keeps c and Ĥ as float64 tensors on the model's device: no host read).
Confidence: [exact] (TRL 1.16.0's ``GRPOTrainer`` and verl 0.9.1's ``ppo_loss``: tests/parity/test_trl_entropy.py).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.masking import (
    AggMode,
    EmptyRows,
    aggregate,
    all_masked_flag,
    as_bool_mask,
    detach_metrics,
    masked_mean,
    masked_sum,
)
from steadyrl.core.types import LossOutput

#: TRL 1.16.0 ``GRPOConfig`` defaults of the adaptive controller.
ENTROPY_TARGET: float = 0.2
ENTROPY_COEF_DELTA: float = 0.005
ENTROPY_COEF_MIN: float = 0.0
ENTROPY_COEF_MAX: float = 1.0

#: Metrics of :func:`entropy_bonus` the adaptive controller reads: Σ m H and Σ m of the step (their ratio over any
#: number of micro-batches and processes is the step's token mean, as TRL's window statistics).
ENTROPY_SUM = "entropy/token_sum"
ENTROPY_TOKENS = "entropy/tokens"


def token_entropy(log_probs: Float[Tensor, "... V"]) -> Float[Tensor, "..."]:
    """H = −Σ_v π_v log π_v over the last axis from log-probs (tokens at −inf, outside a top-k/top-p support,
    contribute 0 to the value and the gradient, not NaN)."""
    kept = torch.isfinite(log_probs)
    safe = torch.where(kept, log_probs, torch.zeros_like(log_probs))  # no 0·(−inf) in the value or the gradient
    return -torch.where(kept, safe.exp() * safe, torch.zeros_like(safe)).sum(dim=-1)


def entropy_term(log_probs: Float[Tensor, "m V"], index: Tensor) -> Float[Tensor, " m"]:
    """H_t of each token of a chunk, as a vocabulary term (:data:`~steadyrl.core.vocab_chunks.VocabTerm`): the
    log-probs are those of the sampling distribution the head computes (temperature included), ``index`` unused."""
    return token_entropy(log_probs)


def entropy_bonus(
    *,
    entropy: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    coef: float | Tensor,
    agg: AggMode = "token-mean",
    norm_len: float | None = None,
    empty_rows: EmptyRows = "skip",
    count_mask: Shaped[Tensor, "B T"] | None = None,
) -> LossOutput:
    """−c · agg(m H): the term an entropy bonus adds to the loss [exact].

    ``entropy`` [B, T] carries the gradient into the model (values off the mask are never read); ``coef`` a float or
    a 0-d tensor (cast to the entropy's dtype); ``agg``, ``norm_len``, ``empty_rows`` and ``count_mask`` as in
    :func:`steadyrl.core.masking.aggregate` (the default is TRL's token mean). Metrics (detached): ``entropy/mean``
    (token mean of H over ``mask``), ``entropy/coef`` (c applied), ``loss/entropy_bonus`` (the term), and
    :data:`ENTROPY_SUM` / :data:`ENTROPY_TOKENS` (Σ m H, Σ m). A batch with no trained token gives an exact 0 with
    zero gradients.
    """
    m = as_bool_mask(mask)
    h = aggregate(entropy, m, agg, norm_len=norm_len, empty_rows=empty_rows, count_mask=count_mask)
    c = coef.detach().to(device=h.device, dtype=h.dtype) if isinstance(coef, Tensor) else h.new_tensor(float(coef))
    term = -c * h
    metrics = {
        "entropy/mean": masked_mean(entropy, m),
        "entropy/coef": c,
        "loss/entropy_bonus": term,
        ENTROPY_SUM: masked_sum(entropy, m),
        ENTROPY_TOKENS: m.sum().to(h.dtype),
        "loss/all_masked": all_masked_flag(m),
    }
    return LossOutput(loss=term, metrics=detach_metrics(metrics))


def adaptive_entropy_coef(
    coef: float | Tensor,
    entropy: float | Tensor,
    *,
    target: float = ENTROPY_TARGET,
    delta: float = ENTROPY_COEF_DELTA,
    coef_min: float = ENTROPY_COEF_MIN,
    coef_max: float = ENTROPY_COEF_MAX,
) -> float | Tensor:
    """The next coefficient from the step's token-mean entropy Ĥ (module docstring; TRL's update) [exact].

    Floats give a float; a tensor ``coef`` or ``entropy`` gives a tensor, computed on the device (no host read).
    """
    if not isinstance(coef, Tensor) and not isinstance(entropy, Tensor):
        return min(coef + delta, coef_max) if entropy <= target else max(coef - delta, coef_min)
    c = torch.as_tensor(coef, dtype=torch.float64, device=entropy.device if isinstance(entropy, Tensor) else None)
    h = torch.as_tensor(entropy, dtype=c.dtype, device=c.device)
    return torch.where(h <= target, (c + delta).clamp(max=coef_max), (c - delta).clamp(min=coef_min))


def applied_entropy_coef(
    coef: float | Tensor, last_entropy: float | Tensor, *, target: float = ENTROPY_TARGET
) -> float | Tensor:
    """The coefficient a step applies: c while the previous step's entropy was ≤ target, else 0 (TRL's gate)."""
    if not isinstance(coef, Tensor) and not isinstance(last_entropy, Tensor):
        return coef if last_entropy <= target else 0.0
    c = torch.as_tensor(coef, dtype=torch.float64)
    h = torch.as_tensor(last_entropy, dtype=c.dtype, device=c.device)
    return torch.where(h <= target, c, torch.zeros_like(c))
