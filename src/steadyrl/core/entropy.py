"""Entropy bonus and the adaptive entropy coefficient (Skywork-OR1, arXiv 2505.22312, §3.2; TRL 1.16.0's rule).

The bonus subtracts the mean per-token entropy of the policy, a full-vocabulary quantity with gradient::

    H_t  = −Σ_v π_θ(v | s_t) log π_θ(v | s_t)          (rollout.logprobs ``sequence_logprob_terms`` with the
                                                         entropy term: the logits are never materialized twice)
    L    = L_policy − c · (Σ_{i,t} m H / Σ_{i,t} m)     (TRL ``entropy_coef``: a token mean whatever the loss type)

The adaptive controller (TRL ``use_adaptive_entropy``, after Skywork-OR1) moves c once per optimizer step from the
step's token-mean entropy Ĥ, and applies it only while the entropy of the previous step was at or below the target::

    c ← min(c + δ, c_max)   if Ĥ ≤ H_target,     c ← max(c − δ, c_min)   otherwise
    applied c_t = c if Ĥ_{t−1} ≤ H_target else 0        (Ĥ_{−1} = +∞: nothing applied at the first step)
"""

from __future__ import annotations

from jaxtyping import Float, Shaped
from torch import Tensor

from steadyrl.core.masking import all_masked_flag, as_bool_mask, detach_metrics, masked_mean
from steadyrl.core.types import LossOutput

#: TRL 1.16.0 ``GRPOConfig`` defaults of the adaptive controller.
ENTROPY_TARGET: float = 0.2
ENTROPY_COEF_DELTA: float = 0.005
ENTROPY_COEF_MIN: float = 0.0
ENTROPY_COEF_MAX: float = 1.0


def entropy_bonus(*, entropy: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"], coef: float | Tensor) -> LossOutput:
    """−c · token-mean of H over the mask (TRL 1.16.0's ``entropy_coef`` term) [exact].

    ``entropy`` [B, T] carries the gradient into the model (garbage off the mask is never read); ``coef`` a float or
    0-d tensor. Metrics: ``entropy/mean`` (detached token mean of H), ``entropy/coef``, ``loss/entropy_bonus`` (the
    term added to the loss), ``loss/all_masked``. An all-masked batch gives an exact 0 with zero gradients.
    """
    m = as_bool_mask(mask)
    h = masked_mean(entropy, m)
    term = -coef * h
    c = coef.detach() if isinstance(coef, Tensor) else h.new_tensor(float(coef))
    metrics = {"entropy/mean": h, "entropy/coef": c, "loss/entropy_bonus": term, "loss/all_masked": all_masked_flag(m)}
    return LossOutput(loss=term, metrics=detach_metrics(metrics))


def adaptive_entropy_coef(
    coef: float,
    entropy: float,
    *,
    target: float = ENTROPY_TARGET,
    delta: float = ENTROPY_COEF_DELTA,
    coef_min: float = ENTROPY_COEF_MIN,
    coef_max: float = ENTROPY_COEF_MAX,
) -> float:
    """The next coefficient from the step's token-mean entropy Ĥ (module docstring; TRL's update) [exact]."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def applied_entropy_coef(coef: float, last_entropy: float, *, target: float = ENTROPY_TARGET) -> float:
    """The coefficient a step applies: c while the previous step's entropy was ≤ target, else 0 (TRL's gate)."""
    return coef if last_entropy <= target else 0.0
