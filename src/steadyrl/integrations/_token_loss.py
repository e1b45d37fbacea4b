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
3. **Step-level controllers** (:class:`StepControl`): VCPO's ESS step size and GAC wrap the optimizer's ``step``;
   the loss records each micro-batch's ``vcpo/ess_ratio`` for them.

Confidence: [exact] as a mapping (tests compare with ``steadyrl.compute_loss`` on the same tensors).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from steadyrl.control.base import SKIP_STEP, Controller, build_controllers
from steadyrl.control.ess_lr import ESS_METRIC
from steadyrl.methods import KEY_DOCS, MethodSpec, reads_behavior, required_inputs, resolve_method
from steadyrl.methods import spec as S

#: Advantage types the framework's own advantages stand in for (the estimator runs before the loss, outside it).
REPLACEABLE_ADVANTAGES = ("grpo", "given")
#: Batch keys these frameworks never hand their policy loss, with why.
NOT_HOSTED: dict[str, str] = {
    "rewards": "the framework computes advantages before its policy loss, which receives no rewards",
    "group_ids": "the policy loss receives no prompt groups",
    "grad_sq_norms": "the policy loss cannot run per-trajectory backward passes",
    "values": "no critic values reach the policy loss",
    "sum_p2": "the policy loss receives no Σ_v π_v² of the proximal distribution",
    "behav_entropy": "the policy loss receives no entropy of the behavior distribution",
    "ref_logp": "the policy loss receives no reference log-probs (the framework adds its own reference KL)",
    "versions": "the policy loss receives no per-token policy versions (A-3PO's interpolation weight needs them)",
    "learner_version": "the policy loss receives no learner version (A-3PO's interpolation weight needs it)",
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
    sequence modes: b_local / ``global_batch_size`` · ``dp_size`` (b_local: its sequences with a masked-in token).
    Summed over the step's micro-batches and averaged over ``dp_size`` ranks (the data-parallel gradient mean),
    the micro-batch means weighted this way give the step's mean, as verl's ``agg_loss`` and OpenRLHF's
    ``aggregate_loss`` compute it. None (no rescaling) when no normalizer is given and ``dp_size`` is 1.
    """
    m = mask.bool()
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


def host_metrics(metrics: Mapping[str, Tensor], prefix: str) -> dict[str, float]:
    """``metrics`` as Python floats under ``prefix`` (one host read for all of them)."""
    if not metrics:
        return {}
    values = torch.stack([v.detach().float().reshape(()) for v in metrics.values()]).tolist()
    return {prefix + k: float(v) for k, v in zip(metrics, values, strict=True)}


class StepControl:
    """A method's step-level controllers (VCPO's ESS step size, GAC) around a torch optimizer's ``step``.

    The policy loss calls :meth:`record` on every training micro-batch; :meth:`wrap` makes ``optimizer.step``
    average those metrics over the step's micro-batches (and over data-parallel ranks), run every controller's
    ``before_step`` (after the framework has clipped the gradient), skip the step when GAC asks for it (the
    gradient is dropped so neither weights nor Adam moments move), step, and restore the learning rate.
    """

    def __init__(self, spec: MethodSpec, *, framework: str) -> None:
        self.spec = spec
        self.framework = framework
        self.controllers: list[Controller] = build_controllers(spec)
        self.pending: list[dict[str, Tensor]] = []
        self.last: dict[str, float] = {}
        self.wrapped = False
        self._warned = False

    def record(self, metrics: Mapping[str, Tensor]) -> None:
        """Keep what the controllers read from one training micro-batch's ``compute_loss`` metrics."""
        if not self.controllers:
            return
        if not self.wrapped and not self._warned:
            self._warned = True
            warnings.warn(
                f"method {self.spec.name!r} has step-level controllers "
                f"({', '.join(c.type for c in self.spec.controllers)}) that act only once the optimizer is wrapped: "
                f"call steadyrl.integrations.{self.framework}.wrap_optimizer(optimizer, ...) in the training process",
                stacklevel=3,
            )
        self.pending.append({k: v.detach() for k, v in metrics.items() if k == ESS_METRIC})

    def wrap(self, optimizer: Any, params: Iterable[Tensor] | None = None) -> Any:
        """Make ``optimizer.step`` run the controllers; ``params`` default to the optimizer's own parameters."""
        if getattr(optimizer, "_steadyrl_wrapped", False):
            raise ValueError("this optimizer is already wrapped by a steadyrl step control")
        if any(isinstance(c, S.GAC) for c in self.spec.controllers) and _world_size() > 1:
            raise ValueError(
                "GAC reads the flat local gradient; with data-parallel or sharded training each rank holds a part of "
                "it and ranks could disagree about skipping: use GAC with one process only"
            )
        plist = [p for g in optimizer.param_groups for p in g["params"]] if params is None else list(params)
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            control = self._before(optimizer, plist)
            try:
                if bool(control.get(SKIP_STEP, torch.tensor(0.0)) != 0):
                    optimizer.zero_grad(set_to_none=True)
                    return None
                return original(*args, **kwargs)
            finally:
                for c in self.controllers:
                    c.after_step(optimizer=optimizer)

        optimizer.step = step
        optimizer._steadyrl_wrapped = True
        self.wrapped = True
        return optimizer

    def _before(self, optimizer: Any, params: list[Tensor]) -> dict[str, Tensor]:
        steps, self.pending = self.pending, []
        metrics: dict[str, Tensor] = {}
        if steps and all(ESS_METRIC in m for m in steps):
            ess = torch.stack([m[ESS_METRIC] for m in steps]).mean()
            if _world_size() > 1:  # one learning rate for every replica
                ess = ess.clone()
                torch.distributed.all_reduce(ess, op=torch.distributed.ReduceOp.SUM)
                ess = ess / _world_size()
            metrics[ESS_METRIC] = ess
        control: dict[str, Tensor] = {}
        for c in self.controllers:
            control |= c.before_step(optimizer=optimizer, params=params, metrics=metrics)
        control["lr"] = torch.tensor(float(optimizer.param_groups[0]["lr"]))
        self.last = host_metrics(control, "steadyrl/")
        return control


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
