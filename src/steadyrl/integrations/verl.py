"""steadyrl methods as verl policy losses (verl 0.9.1): every preset registered as ``steadyrl/<name>``.

The two-line change (docs/integrations.md)::

    export VERL_USE_EXTERNAL_MODULES=steadyrl.integrations.verl    # verl imports it in every process it starts
    python -m verl.trainer.main_ppo ... actor_rollout_ref.actor.policy_loss.loss_mode=steadyrl/seq_tis \\
        algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=1e9

Importing this module registers, with verl's own ``register_policy_loss``, one loss per steadyrl preset, and the
GRPO-family advantage estimators with ``register_adv_est`` (``algorithm.adv_estimator=steadyrl/grpo``,
``steadyrl/dr_grpo``). :func:`register` adds a composition or a preset with options under a name of your choice.

How verl's tensors map (DESIGN.md vocabulary), read from how verl 0.9.1 calls a policy loss
(``verl.workers.utils.losses.ppo_loss``, keyword arguments):

1. **π_θ** is ``log_prob`` (with gradient); **π_prox** is ``old_log_prob``, the log-probs verl recomputes before the
   update (decoupled mode). verl's *bypass* mode (``rollout_correction.bypass_mode=true``) replaces
   ``loss_mode`` by its own ``bypass_mode`` loss, so a steadyrl loss never runs there; steadyrl's ``bypass``
   preset runs in decoupled mode and sets π_prox := μ itself.
2. **μ (behavior) never reaches the loss as log-probs.** The type alias ``PolicyLossFn`` names the seventh argument
   ``rollout_log_probs``, but the caller passes ``rollout_is_weights=``: the weights verl's rollout correction
   computed from ``old_log_probs − rollout_log_probs``. With ``rollout_is=token`` and a threshold above
   e^20 (``rollout_is_threshold=1e9``, no ``rollout_rs``, no batch normalization) each weight is exactly
   exp(clamp(ℓ_t, ±20)), ℓ_t = log π_prox − log μ, and the adapter recovers log μ = ``old_log_prob`` − log w_t.
   Truncated or sequence-level weights (verl's defaults) cannot be inverted; zero weights are refused, the rest is
   the user's configuration to get right (:data:`ROLLOUT_CORRECTION`). A caller that has μ passes it as
   ``rollout_log_probs=`` (keyword); the seventh argument is keyword-only so a positional call following the alias
   fails instead of reading log-probs as weights. Without either, μ := π_prox (ℓ ≡ 0), refused for methods whose
   loss depends on μ (every correction, M2PO's clip, ``bypass``, the ESS step size).
3. **Advantages** are verl's (``advantage.type=given``, token advantages from ``algorithm.adv_estimator``): the
   method's GRPO options do not act; use ``adv_estimator=steadyrl/grpo`` or ``steadyrl/dr_grpo`` for steadyrl's
   estimators. ``response_mask`` is the mask (after verl's rejection sampling, if configured).
4. **Aggregation.** ``loss_agg_mode`` must equal the method's ``agg`` (refused otherwise: verl aggregates its
   entropy and KL terms with it too). The micro-batch loss is ``compute_loss`` times its share of the step
   (``config.global_batch_info``: ``dp_size``, ``batch_num_tokens``, ``global_batch_size``), as verl's ``agg_loss``
   normalizes; ``loss_scale_factor`` is the method's ``norm_len`` for ``seq-mean-token-sum-norm``.

Not hosted (the policy loss receives no rewards, groups, values, entropies, gradient norms or reference log-probs):
VCPO and OPOB, VACO, OTB (verl has its own ``optimal_token_baseline``), COPC, GMC-GRPO, OAPL, ESTR, and the KL
presets (use verl's ``actor.use_kl_loss`` / ``algorithm.use_kl_in_reward``); their names are registered and raise a
``ValueError`` saying what is missing. Step-level controllers (ESS step size, GAC) run when the training process
wraps its optimizer with :func:`wrap_optimizer` (verl 0.9.1 has no optimizer callback: its FSDP engine owns
``engine.optimizer``). Metrics go to verl's actor metrics as ``steadyrl/<key>``.
Confidence: [exact] as a mapping (tests compare with ``steadyrl.compute_loss`` on the same tensors to 1e-6).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from steadyrl.core.advantages import grpo
from steadyrl.integrations._framework import install_hint, missing_framework, warn_if_untested
from steadyrl.integrations._token_loss import (
    needs_behavior,
    step_share,
    token_loss_spec,
    unhosted_reason,
)
from steadyrl.integrations.step_control import StepControl, host_metrics
from steadyrl.methods import PRESETS, MethodSpec, compute_loss, resolve_method
from steadyrl.methods import spec as S

#: The verl release this adapter was written and tested against.
VERL_VERSION = "0.9.1"

try:
    from verl.trainer.ppo import core_algos
except ImportError as _err:  # one line saying what to install
    raise missing_framework("verl", "verl", install_hint("verl", "verl", VERL_VERSION)) from _err

warn_if_untested("verl", "verl", VERL_VERSION)

#: Prefix of registered names and of steadyrl metrics in verl's logs.
PREFIX = "steadyrl/"
#: ``algorithm.rollout_correction`` settings under which verl's ``rollout_is_weights`` are raw token weights
#: exp(clamp(log π_prox − log μ, ±20)) (the threshold exceeds e^20 ≈ 4.9e8, so nothing is truncated).
ROLLOUT_CORRECTION: dict[str, Any] = {
    "rollout_is": "token",
    "rollout_is_threshold": 1e9,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "bypass_mode": False,
}
#: The advantage estimators registered at import: verl name → steadyrl preset whose advantage it computes.
ADVANTAGE_ESTIMATORS: dict[str, str] = {"steadyrl/grpo": "grpo", "steadyrl/dr_grpo": "dr_grpo"}

_CONTROLS: dict[str, StepControl] = {}  # registered loss name → its step controllers (process-wide)
_HOW = (
    "set algorithm.rollout_correction.rollout_is=token and rollout_is_threshold=1e9 (no rollout_rs, no batch "
    "normalization) so verl hands the loss raw token weights π_prox/μ"
)


def _check_mode(spec: MethodSpec, loss_agg_mode: str) -> None:
    if loss_agg_mode != spec.agg:
        raise ValueError(
            f"method {spec.name!r} aggregates with {spec.agg!r} but verl's actor_rollout_ref.actor.loss_agg_mode is "
            f"{loss_agg_mode!r}: set loss_agg_mode={spec.agg} (verl aggregates its entropy and KL terms with it too), "
            "or register the method with overrides={'agg': ...}"
        )


def behavior_from_weights(old_log_prob: Tensor, rollout_is_weights: Tensor, response_mask: Tensor) -> Tensor:
    """log μ = log π_prox − log w [B,T] from verl's raw token weights w = exp(clamp(ℓ, ±20)); π_prox off the mask.

    Raises ``ValueError`` when a masked-in weight is not a positive finite number (verl zeroes weights that IcePop
    bounds or rejection remove: such weights carry no μ).
    """
    m = response_mask.bool()
    w = rollout_is_weights.detach().to(old_log_prob.dtype)
    bad = m & ~(torch.isfinite(w) & (w > 0))
    if bool(bad.any()):
        raise ValueError(
            f"rollout_is_weights has {int(bad.sum())} zero or non-finite weight(s) on response tokens, so μ cannot be "
            f"recovered from them: {_HOW}"
        )
    safe = torch.where(m, w, torch.ones_like(w))
    return torch.where(m, old_log_prob.detach() - torch.log(safe), old_log_prob.detach())


def make_policy_loss(
    method: str | MethodSpec, overrides: Mapping[str, Any] | None = None, *, name: str | None = None
) -> Callable[..., tuple[Tensor, dict[str, Any]]]:
    """A function with verl's policy-loss interface computing ``steadyrl.compute_loss`` of ``method``.

    Call as verl 0.9.1 does: ``fn(old_log_prob=, log_prob=, advantages=, response_mask=, loss_agg_mode=, config=,
    rollout_is_weights=)``; or with ``rollout_log_probs=`` (log μ) instead of the weights. Returns ``(loss,
    metrics)``, metrics as floats named ``steadyrl/<key>``.
    """
    spec = token_loss_spec(method, overrides, where="a verl policy loss")
    control = StepControl(spec, framework="verl")
    by_norm: dict[float, MethodSpec] = {}

    def steadyrl_policy_loss(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        *,
        rollout_is_weights: Tensor | None = None,
        rollout_log_probs: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        _check_mode(spec, loss_agg_mode)
        if rollout_is_weights is not None and rollout_log_probs is not None:
            raise ValueError("pass rollout_is_weights (verl's π_prox/μ) or rollout_log_probs (log μ), not both")
        if rollout_log_probs is not None:
            behav = rollout_log_probs.detach()
        elif rollout_is_weights is not None:
            behav = behavior_from_weights(old_log_prob, rollout_is_weights, response_mask)
        elif needs_behavior(spec):
            raise ValueError(
                f"method {spec.name!r} corrects for the behavior policy μ, which verl did not pass: {_HOW}"
            )
        else:
            behav = old_log_prob.detach()
        info: Mapping[str, Any] = getattr(config, "global_batch_info", None) or {}
        run = spec
        scale_factor = info.get("loss_scale_factor", getattr(config, "loss_scale_factor", None))
        if scale_factor is not None and spec.agg == "seq-mean-token-sum-norm":
            key = float(scale_factor)
            run = by_norm.setdefault(key, resolve_method(spec, {"norm_len": int(key)}))
        batch = {
            "logp": log_prob,
            "behav_logp": behav,
            "prox_logp": old_log_prob.detach(),
            "mask": response_mask.bool(),
            "advantages": advantages.detach(),
        }
        loss, metrics = compute_loss(run, batch, validate=False)
        share = step_share(
            response_mask, spec.agg, dp_size=int(info.get("dp_size", 1) or 1),
            batch_num_tokens=info.get("batch_num_tokens"), global_batch_size=info.get("global_batch_size"),
        )  # fmt: skip
        if share is not None:
            loss = loss * share.to(loss.dtype)
        if torch.is_grad_enabled() and log_prob.requires_grad:
            control.record(metrics)
        return loss, host_metrics(metrics, PREFIX)

    steadyrl_policy_loss.__qualname__ = steadyrl_policy_loss.__name__ = f"steadyrl_{(name or spec.name)}"
    steadyrl_policy_loss.steadyrl_method = spec  # type: ignore[attr-defined]
    steadyrl_policy_loss.steadyrl_control = control  # type: ignore[attr-defined]
    return steadyrl_policy_loss


def _refusing_loss(name: str, reason: str) -> Callable[..., tuple[Tensor, dict[str, Any]]]:
    def refused(*args: Any, **kwargs: Any) -> tuple[Tensor, dict[str, Any]]:
        raise ValueError(f"verl loss_mode={name!r} cannot run: {reason}")

    return refused


def register(name: str, method: str | MethodSpec, overrides: Mapping[str, Any] | None = None) -> str:
    """Register ``method`` (preset, composition or spec, with ``overrides``) as verl ``loss_mode=name``.

    Raises ``ValueError`` if the method cannot run as a verl policy loss. Call it in every process that trains
    (e.g. from a module listed in ``VERL_USE_EXTERNAL_MODULES``). Returns ``name``.
    """
    fn = make_policy_loss(method, overrides, name=name)
    core_algos.register_policy_loss(name)(fn)
    _CONTROLS[name] = fn.steadyrl_control  # type: ignore[attr-defined]
    return name


def wrap_optimizer(optimizer: Any, loss_mode: str, params: Iterable[Tensor] | None = None) -> Any:
    """Run the step-level controllers of the registered ``loss_mode`` around ``optimizer.step`` (e.g. the
    ``engine.optimizer`` of verl's FSDP engine, from a custom worker). The ESS ratio is averaged over the step's
    micro-batches and the data-parallel ranks; GAC refuses more than one process. Returns ``optimizer``."""
    if loss_mode not in _CONTROLS:
        raise ValueError(f"{loss_mode!r} is not a steadyrl loss registered in this process; known: {sorted(_CONTROLS)}")
    return _CONTROLS[loss_mode].wrap(optimizer, params)


def supported(method: str | MethodSpec) -> tuple[bool, str]:
    """(whether ``method`` runs as a verl policy loss, why not / what it needs) — the docs' table."""
    spec = resolve_method(method)
    reason = unhosted_reason(spec)
    if reason is not None:
        return False, reason
    notes = []
    if needs_behavior(spec):
        notes.append("rollout_is=token, rollout_is_threshold=1e9 (μ from the weights)")
    if spec.controllers:
        notes.append("wrap_optimizer for " + ", ".join(c.type for c in spec.controllers))
    return True, "; ".join(notes)


# ------------------------------------------------------------------------------------------------ advantages
def make_advantage_estimator(method: str | MethodSpec) -> Callable[..., tuple[Tensor, Tensor]]:
    """A verl advantage estimator computing ``method``'s GRPO-family advantage (arXiv 2402.03300; Dr.GRPO
    arXiv 2503.20783) [exact]: outcome reward R_i = Σ_t ``token_level_rewards`` (verl's convention), groups from
    ``index`` (verl's ``uid``); returns (advantages, returns), both the token-broadcast advantage, as verl's GRPO."""
    spec = resolve_method(method)
    adv = spec.advantage
    if not isinstance(adv, S.GrpoAdvantage):
        raise ValueError(
            f"method {spec.name!r}: advantage.type={adv.type!r} needs more than rewards and groups "
            "(verl hands a custom estimator token_level_rewards, response_mask and index only)"
        )

    def steadyrl_advantage(
        token_level_rewards: Tensor, response_mask: Tensor, index: Any = None, config: Any = None, **_: Any
    ) -> tuple[Tensor, Tensor]:
        if index is None:
            raise ValueError("steadyrl's GRPO advantages need verl's prompt index (non_tensor_batch['uid'])")
        _, inverse = _unique_inverse(index)
        group_ids = torch.as_tensor(inverse, dtype=torch.long, device=token_level_rewards.device)
        with torch.no_grad():
            out = grpo.grpo_advantages(
                rewards=token_level_rewards.sum(dim=-1), group_ids=group_ids, scale=adv.scale, eps=adv.eps,
                unbiased=adv.unbiased,
            )  # fmt: skip
            tok = grpo.token_advantages(advantages=out.advantages, mask=response_mask.bool())
        return tok, tok

    return steadyrl_advantage


def _unique_inverse(index: Any) -> tuple[list[Any], list[int]]:
    first: dict[Any, int] = {}
    inverse = [first.setdefault(k, len(first)) for k in list(index)]
    return list(first), inverse


def _refusing_estimator(name: str, reason: str) -> Callable[..., tuple[Tensor, Tensor]]:
    def refused(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        raise ValueError(f"verl adv_estimator={name!r} cannot run: {reason}")

    return refused


def register_advantage(name: str, method: str | MethodSpec) -> str:
    """Register ``method``'s GRPO-family advantage as verl ``algorithm.adv_estimator=name``. Returns ``name``."""
    fn = make_advantage_estimator(method)
    core_algos.ADV_ESTIMATOR_REGISTRY.pop(name, None)  # verl refuses a second function under one name
    core_algos.register_adv_est(name)(fn)
    return name


def _register_all() -> None:
    for preset in PRESETS:
        name = PREFIX + preset.name
        reason = unhosted_reason(resolve_method(preset.name))
        if reason is None:
            register(name, preset.name)
        else:
            core_algos.register_policy_loss(name)(_refusing_loss(name, reason))
    for name, preset_name in ADVANTAGE_ESTIMATORS.items():
        register_advantage(name, preset_name)
    for adv in ("opob", "vaco", "otb", "copc", "brace"):
        name = PREFIX + adv
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(name, None)
        core_algos.register_adv_est(name)(
            _refusing_estimator(name, unhosted_reason(resolve_method(adv)) or "not a GRPO-family advantage")
        )


_register_all()

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "PREFIX",
    "ROLLOUT_CORRECTION",
    "VERL_VERSION",
    "behavior_from_weights",
    "make_advantage_estimator",
    "make_policy_loss",
    "register",
    "register_advantage",
    "supported",
    "wrap_optimizer",
]
