"""What the verl and OpenRLHF adapters share: a policy loss called with token tensors only.

Both frameworks compute the advantages before the policy loss and call it with π_θ (with gradient), π_prox, the
token advantages, a response mask, optionally the behavior policy μ, and the normalizers of the optimizer step
(``dp_size``, ``batch_num_tokens``, ``global_batch_size``). This module holds the rules both adapters apply:

1. **Which methods run** (:func:`token_loss_spec`): the method's GRPO advantage is replaced by the framework's
   (``advantage.type=given``); a method whose advantage estimator or objective needs rewards, prompt groups,
   gradient norms, a critic, entropies or reference log-probs cannot run there (:func:`unhosted_reason`).
2. **The step normalizers** (:func:`step_share`): ``steadyrl.compute_loss`` aggregates one micro-batch with the
   method's ``agg``; the adapter multiplies it by the micro-batch's share of the optimizer step, as the frameworks'
   own ``agg_loss`` / ``aggregate_loss`` do, so the accumulated gradient is the step's mean.
3. **Step-level controllers**: VCPO's ESS step size and GAC wrap the optimizer's ``step``
   (:class:`steadyrl.integrations.step_control.StepControl`, shared by every adapter); the loss records each
   micro-batch's ``vcpo/ess_ratio`` for them.

Confidence: [exact] as a mapping (tests compare with ``steadyrl.compute_loss`` on the same tensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from steadyrl.methods import KEY_DOCS, MethodSpec, reads_behavior, required_inputs, resolve_method

#: Advantage types the framework's own advantages stand in for (the estimator runs before the loss, outside it).
#: RLOO and REINFORCE++(-baseline) are verl's own estimators (``algorithm.adv_estimator``), parity-tested.
REPLACEABLE_ADVANTAGES = ("grpo", "given", "rloo", "reinforce_pp", "reinforce_pp_baseline")
#: Batch keys these frameworks never hand their policy loss, with why.
NOT_HOSTED: dict[str, str] = {
    "rewards": "the framework computes advantages before its policy loss, which receives no rewards",
    "group_ids": "the policy loss receives no prompt groups",
    "grad_sq_norms": "the policy loss cannot run per-trajectory backward passes",
    "values": "no critic values reach the policy loss",
    "sum_p2": "the policy loss receives no Σ_v π_v² of the proximal distribution",
    "centering": "the policy loss receives no behavior distribution nor full-vocabulary log-probs (score centering)",
    "behav_entropy": "the policy loss receives no entropy of the behavior distribution",
    "ref_logp": "the policy loss receives no reference log-probs (the framework adds its own reference KL)",
    "versions": "the policy loss receives no per-token policy versions (A-3PO's interpolation weight needs them)",
    "learner_version": "the policy loss receives no learner version (A-3PO's interpolation weight needs it)",
    "entropy": "the policy loss receives no entropy of π_θ: the framework adds its own entropy bonus outside it (verl: "
    "actor_rollout_ref.actor.entropy_coeff, aggregated with loss_agg_mode as steadyrl's entropy.agg=None); set it "
    "there instead of the method's entropy.coef / adaptive_entropy",
}


def unhosted_reason(spec: MethodSpec) -> str | None:
    """Why ``spec`` cannot run as a token-advantage policy loss, naming what is missing; None if it can."""
    adv = spec.advantage.type
    if adv not in REPLACEABLE_ADVANTAGES:
        missing = ", ".join(repr(k) for k in required_inputs(spec) if k in NOT_HOSTED)
        return f"advantage.type={adv!r} needs {missing}: {NOT_HOSTED['rewards']}"
    missing_keys = [k for k in required_inputs(_given(spec)) if k in NOT_HOSTED]
    if not missing_keys:
        return None
    return "needs " + "; ".join(f"{k!r} ({KEY_DOCS[k]}): {NOT_HOSTED[k]}" for k in missing_keys)


def _given(spec: MethodSpec) -> MethodSpec:
    return spec if spec.advantage.type == "given" else resolve_method(spec, {"advantage.type": "given"})


def token_loss_spec(method: str | MethodSpec, overrides: Mapping[str, Any] | None, *, where: str) -> MethodSpec:
    """``method`` with the framework's advantages (``advantage.type=given``); ``ValueError`` if it cannot run."""
    spec = resolve_method(method, overrides)
    reason = unhosted_reason(spec)
    if reason is not None:
        raise ValueError(f"method {spec.name!r} cannot run as {where}: {reason}")
    return _given(spec)


def needs_behavior(spec: MethodSpec) -> bool:
    """Whether the loss of ``spec`` depends on μ (``behav_logp``) beyond the diagnostics."""
    return reads_behavior(spec)


def step_share(
    mask: Tensor,
    agg: str,
    *,
    dp_size: int = 1,
    batch_num_tokens: float | Tensor | None = None,
    global_batch_size: float | Tensor | None = None,
) -> Tensor | None:
    """The factor that turns one micro-batch's aggregated loss into its share of the optimizer step's loss.

    ``token-mean``: n_local / ``batch_num_tokens`` · ``dp_size`` (n_local: masked-in tokens of this micro-batch);
    sequence modes: b_local / ``global_batch_size`` · ``dp_size`` (b_local: its sequences with a masked-in token);
    ``token-sum``: ``dp_size`` (verl's ``agg_loss``: the step's loss is the sum over all ranks' tokens).
    Summed over the step's micro-batches and averaged over ``dp_size`` ranks (the data-parallel gradient mean),
    the micro-batch means weighted this way give the step's mean, as verl's ``agg_loss`` and OpenRLHF's
    ``aggregate_loss`` compute it. None (no rescaling) when no normalizer is given and ``dp_size`` is 1.
    """
    m = mask.bool()
    if agg == "token-sum":  # a plain sum: each rank's share is dp_size, undoing the data-parallel gradient mean (verl)
        return None if dp_size == 1 else torch.tensor(float(dp_size), dtype=torch.float32, device=mask.device)
    if agg == "token-mean":
        total, local, field = batch_num_tokens, m.sum(), "batch_num_tokens"
    else:
        total, local, field = global_batch_size, m.any(dim=-1).sum(), "global_batch_size"
    if total is None:
        if dp_size > 1:
            raise ValueError(f"{field} (the step's global count) is required when dp_size={dp_size} > 1")
        return None
    total_t = torch.as_tensor(total, dtype=torch.float64, device=mask.device)
    return (local.to(torch.float64) / total_t * dp_size).to(torch.float32)
