"""steadyrl methods as OpenRLHF's policy loss (OpenRLHF 0.11.2): a module with ``PolicyLoss``'s call signature.

The two-line change (docs/integrations.md), run in every process that builds OpenRLHF's PPO actor (the Ray actor
workers; e.g. ``ray.init(runtime_env={"worker_process_setup_hook": "steadyrl.integrations.openrlhf.install_from_env",
"env_vars": {"STEADYRL_METHOD": "seq_tis"}})`` before OpenRLHF's launcher)::

    from steadyrl.integrations import openrlhf as sopen
    sopen.install("seq_tis")      # openrlhf.trainer.ray.ppo_actor.PolicyLoss -> steadyrl's PolicyLoss("seq_tis")

and ``--algo.advantage.is_correction_level token`` so that vLLM records the sampling log-probs.

How OpenRLHF's tensors map (DESIGN.md vocabulary), read from ``PolicyModelActor.training_step`` in
``openrlhf/trainer/ray/ppo_actor.py``, which calls ``actor_loss_fn(action_log_probs, old_action_log_probs,
advantages, action_mask=, rollout_log_probs=, dp_size=, batch_num_tokens=, global_batch_size=)``:

1. **π_θ** is ``log_probs`` (the actor's forward, with gradient); **π_prox** is ``old_log_probs`` (the experience
   maker's forward of the actor when the batch was made); **μ** is ``rollout_log_probs``, vLLM's log-probs of the
   sampled tokens, which OpenRLHF records only when ``--algo.advantage.is_correction_level`` is not ``off`` (its
   ``is_correction_mode/gating/threshold`` then no longer act: the method's corrections replace them). Without
   them μ := π_prox (ℓ ≡ 0), refused for methods whose loss depends on μ.
2. **Advantages** are OpenRLHF's token advantages (``advantage.type=given``; its ``--algo.advantage.estimator``
   decides them). ``action_mask`` is the mask (all ones when None).
3. **Aggregation**: the method's ``agg`` replaces ``--actor.loss_agg_mode`` for the policy term; the loss is
   ``compute_loss`` times the micro-batch's share of the optimizer step (``batch_num_tokens`` for ``token-mean``,
   ``global_batch_size`` otherwise, times ``dp_size``), as OpenRLHF's ``aggregate_loss`` normalizes. The
   constructor arguments OpenRLHF passes (clip ε, dual clip, ``token_level_loss``, ``policy_loss_type``,
   ``is_correction_*``) do not act.
4. **Outputs**: ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)`` as OpenRLHF expects: the method's clip
   fraction, mean(log π_prox − log π_θ), mean(log μ − log π_prox) and the fraction of tokens the corrections masked
   (both None without μ, so OpenRLHF logs neither). All of ``compute_loss``'s metrics are in ``last_metrics``.

Not hosted (the policy loss receives no rewards, groups, values, entropies, gradient norms or reference log-probs):
VCPO and OPOB, VACO, OTB, COPC, GMC-GRPO, OAPL, ESTR and the KL presets (use OpenRLHF's ``--algo.kl.*``).
Step-level controllers (ESS step size, GAC): OpenRLHF steps through DeepSpeed's engine, which offers no optimizer
callback; :meth:`PolicyLoss.wrap_optimizer` wraps a torch optimizer's ``step`` (tested with a plain torch optimizer
only). Confidence: [exact] as a mapping (tests compare with ``steadyrl.compute_loss`` to 1e-6).
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from steadyrl.integrations._framework import install_hint, missing_framework, warn_if_untested
from steadyrl.integrations._token_loss import (
    needs_behavior,
    step_share,
    token_loss_spec,
    unhosted_reason,
)
from steadyrl.integrations.step_control import StepControl, host_metrics
from steadyrl.methods import MethodSpec, compute_loss, resolve_method

#: The OpenRLHF release this adapter was written and tested against.
OPENRLHF_VERSION = "0.11.2"

try:
    import openrlhf  # noqa: F401  (presence only: openrlhf.models needs flash-attn and CUDA at import)
except ImportError as _err:  # one line saying what to install
    raise missing_framework("openrlhf", "OpenRLHF", install_hint("openrlhf", "openrlhf", OPENRLHF_VERSION)) from _err

warn_if_untested("openrlhf", "openrlhf", OPENRLHF_VERSION)

#: Environment variables read by :func:`install_from_env` (a Ray ``worker_process_setup_hook``).
METHOD_ENV, OVERRIDES_ENV = "STEADYRL_METHOD", "STEADYRL_METHOD_OVERRIDES"


class PolicyLoss(torch.nn.Module):
    """OpenRLHF's ``PolicyLoss`` interface with the loss of a steadyrl method (module docstring: the mapping).

    Args:
        method: a preset name, a composition (``"seq_tis+ess_lr"``) or a resolved :class:`~steadyrl.MethodSpec`.
        method_overrides: dotted options as in :func:`steadyrl.resolve_method` (``{"seq_tis.cap": 4}``).
    """

    def __init__(self, method: str | MethodSpec = "grpo", method_overrides: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.steadyrl_method: MethodSpec = token_loss_spec(method, method_overrides, where="an OpenRLHF policy loss")
        self.steadyrl_control = StepControl(self.steadyrl_method, framework="openrlhf")
        self.last_metrics: dict[str, float] = {}

    def forward(
        self,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        action_mask: Tensor | None = None,
        rollout_log_probs: Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | Tensor | None = None,
        global_batch_size: float | Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)`` for one micro-batch, as OpenRLHF's."""
        spec = self.steadyrl_method
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask.bool()
        if rollout_log_probs is None:
            if needs_behavior(spec):
                raise ValueError(
                    f"method {spec.name!r} corrects for the behavior policy μ, which OpenRLHF did not pass: set "
                    "--algo.advantage.is_correction_level token so that vLLM records rollout_log_probs"
                )
            behav = old_log_probs.detach()
        else:
            behav = rollout_log_probs.detach().to(old_log_probs.dtype)
        batch = {
            "logp": log_probs,
            "behav_logp": behav,
            "prox_logp": old_log_probs.detach(),
            "mask": mask,
            "advantages": advantages.detach(),
        }
        loss, metrics = compute_loss(spec, batch, validate=False)
        share = step_share(
            mask, spec.agg, dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size
        )
        if share is not None:
            loss = loss * share.to(loss.dtype)
        if torch.is_grad_enabled() and log_probs.requires_grad:
            self.steadyrl_control.record(metrics)
        self.last_metrics = host_metrics(metrics, "steadyrl/")
        n = mask.sum().clamp(min=1)
        zero = loss.detach().new_zeros(())
        clip_ratio = metrics.get("loss/clip_frac", zero)
        ppo_kl = torch.where(mask, old_log_probs.detach() - log_probs.detach(), 0.0).sum() / n
        if rollout_log_probs is None:
            return loss, clip_ratio, ppo_kl, None, None
        vllm_kl = torch.where(mask, behav - old_log_probs.detach(), 0.0).sum() / n
        return loss, clip_ratio, ppo_kl, vllm_kl, metrics["loss/masked_frac"]

    def wrap_optimizer(self, optimizer: Any, params: Iterable[Tensor] | None = None) -> Any:
        """Run the method's step-level controllers around ``optimizer.step``
        (:class:`steadyrl.integrations.step_control.StepControl`)."""
        return self.steadyrl_control.wrap(optimizer, params)


def policy_loss_factory(method: str | MethodSpec, overrides: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """A stand-in for OpenRLHF's ``PolicyLoss`` class: accepts its constructor arguments (which do not act) and
    returns steadyrl's :class:`PolicyLoss` of ``method``. The method is checked now, not at the first step."""
    spec = token_loss_spec(method, overrides, where="an OpenRLHF policy loss")

    def make(*_: Any, **__: Any) -> PolicyLoss:
        return PolicyLoss(spec)

    return make


def install(
    method: str | MethodSpec, overrides: Mapping[str, Any] | None = None, *, module: types.ModuleType | None = None
) -> Callable[..., Any]:
    """Make OpenRLHF's PPO actor build steadyrl's loss: replace ``PolicyLoss`` in ``module`` (default
    ``openrlhf.trainer.ray.ppo_actor``, which imports deepspeed, flash-attn and vLLM) with
    :func:`policy_loss_factory`. Call it in each actor process before the actor is constructed."""
    if module is None:
        import importlib

        module = importlib.import_module("openrlhf.trainer.ray.ppo_actor")
    if not hasattr(module, "PolicyLoss"):
        raise ValueError(f"{module.__name__} has no PolicyLoss to replace (OpenRLHF {OPENRLHF_VERSION} has one)")
    factory = policy_loss_factory(method, overrides)
    module.PolicyLoss = factory  # type: ignore[attr-defined]
    return factory


def install_from_env() -> None:
    """:func:`install` with the method in ``$STEADYRL_METHOD`` and JSON overrides in ``$STEADYRL_METHOD_OVERRIDES``
    (a Ray ``worker_process_setup_hook``); does nothing when ``$STEADYRL_METHOD`` is unset."""
    method = os.environ.get(METHOD_ENV)
    if method:
        install(method, json.loads(os.environ.get(OVERRIDES_ENV) or "{}"))


def supported(method: str | MethodSpec) -> tuple[bool, str]:
    """(whether ``method`` runs as OpenRLHF's policy loss, why not / what it needs) — the docs' table."""
    spec = resolve_method(method)
    reason = unhosted_reason(spec)
    if reason is not None:
        return False, reason
    notes = []
    if needs_behavior(spec):
        notes.append("--algo.advantage.is_correction_level token (vLLM's log-probs as μ)")
    if spec.controllers:
        notes.append("wrap_optimizer for " + ", ".join(c.type for c in spec.controllers))
    return True, "; ".join(notes)


__all__ = [
    "METHOD_ENV",
    "OPENRLHF_VERSION",
    "OVERRIDES_ENV",
    "PolicyLoss",
    "install",
    "install_from_env",
    "policy_loss_factory",
    "supported",
]
