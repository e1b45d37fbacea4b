"""steadyrl methods inside SkyRL (``skyrl`` 0.3.0): a policy loss and an advantage estimator for SkyRL's registries.

The two-line change (docs/integrations.md)::

    from steadyrl.integrations.skyrl import register
    name = register("seq_tis", method_overrides={"agg": "token-mean"})   # before validate_cfg / initialize_ray
    # then: trainer.algorithm.policy_loss_type=<name> trainer.algorithm.advantage_estimator=<name>

What the adapter does, in four points (everything else, generation, the π_prox forward, micro-batching, the optimizer,
is SkyRL's):

1. **The policy loss** (:class:`PolicyLoss`, registered in ``PolicyLossRegistry``) receives what SkyRL's policy worker
   passes every registered loss: ``(log_probs, old_log_probs, advantages, config=, loss_mask=, rollout_logprobs=)``,
   and returns ``(loss, metrics)``. Tensor mapping (DESIGN.md vocabulary): π_θ ``logp`` = ``log_probs`` (with
   gradient); π_prox ``prox_logp`` = ``old_log_probs`` (SkyRL's forward pass at the start of the step); μ
   ``behav_logp`` = ``rollout_logprobs`` (the inference engine's log-probs, present when
   ``generator.sampling_params.logprobs`` is set; SkyRL's own example loss omits this argument, and a loss that omits
   it raises ``TypeError`` in SkyRL's worker); ``mask`` = ``loss_mask``; ``advantages`` = SkyRL's, as
   ``advantage.type=given``.
2. **Aggregation.** SkyRL pre-scales the advantages per mini-batch by its ``trainer.algorithm.loss_reduction``
   (``apply_loss_reduction_to_advantages_minibatch``: ÷ the mini-batch's token count for ``token_mean``, ÷ B·L_i for
   ``sequence_mean``, ÷ B·``max_seq_len`` for ``seq_mean_token_sum_norm``) and expects each micro-batch's loss to be
   the plain **sum** over its tokens; the worker sums micro-batches. Every hosted objective is positively homogeneous
   in A per token, so Σ_t ℓ_t(c_t·A_t) = Σ_t c_t·ℓ_t(A_t): the adapter returns the token sum of the method's
   per-token loss (``compute_loss`` with ``agg=seq-mean-token-sum-norm``, ``norm_len=1``, times B), and the
   mini-batch loss is the method's ``agg`` over the whole mini-batch. The method's ``agg`` must therefore name the
   same reduction as ``loss_reduction`` (checked, naming both). Tokens a correction removes stay in SkyRL's
   denominator (its pre-scaling saw them): for a masking correction under ``token_mean`` the result is
   ``compute_loss`` × (1 − ``loss/masked_frac``). Batch-coupled corrections (M2PO's budget) see one micro-batch.
3. **Advantages.** :func:`register` also registers the method's GRPO / Dr.GRPO estimator (its ``scale``, ``eps``,
   ``unbiased``) in ``AdvantageEstimatorRegistry`` under the same name: groups are SkyRL's ``uids``.
4. **The Ray trap.** SkyRL keeps both registries in a named Ray actor: a loss registered in the driver before
   ``initialize_ray`` is pushed by its ``sync_registries()``, one registered after goes straight to the actor, and
   each worker pulls it with ``cloudpickle``. :class:`PolicyLoss` is a plain module-level class holding a validated
   :class:`~steadyrl.MethodSpec`, so it pickles by reference (steadyrl must be importable on every worker).
   Registering a name twice replaces it (SkyRL's ``register`` refuses duplicates).

Not hosted (the loss signature carries no tensor for them): advantages from steadyrl estimators that need the
policies or gradients (OPOB, VACO, OTB, COPC), group-coupled objectives (GMC-GRPO, OAPL) and TIC-GRPO's sequence
loss, ESTR (behavior entropies), the reference KL (use SkyRL's ``use_kl_loss`` / ``use_kl_in_reward``), and the
step-level controllers (ESS step size, GAC): SkyRL's optimizer lives inside its Ray policy worker, which no registry
reaches. SkyRL's ``trainer.algorithm.off_policy_correction`` block is honoured: :func:`off_policy_corrections`
translates it into steadyrl corrections (the same functions, parity-tested), which run before the method's own.
Confidence: [exact] as a mapping (the loss equals ``steadyrl.compute_loss`` on the same tensors; tests check 1e-6).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from steadyrl.core.advantages import grpo
from steadyrl.integrations._framework import install_hint, missing_framework, warn_if_untested
from steadyrl.methods import MethodSpec, compute_loss, reads_behavior, required_inputs, resolve_method
from steadyrl.methods.spec import GrpoAdvantage

#: The SkyRL release this adapter was written and tested against.
SKYRL_VERSION = "0.3.0"

try:
    from skyrl.backends.skyrl_train.utils import ppo_utils as _ppo
    from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import off_policy_correction_enabled
except ImportError as _err:  # one line saying what to install
    raise missing_framework("skyrl", "SkyRL", install_hint("skyrl", "skyrl", SKYRL_VERSION)) from _err
except Exception as _err:  # skyrl 0.3.0's `skyrl.backends` package needs Python >= 3.12 (pydantic TypedDict)
    _first = (str(_err).splitlines() or [type(_err).__name__])[0]
    raise ImportError(f"steadyrl.integrations.skyrl: `import skyrl.backends` failed ({_first[:120]}); "
                      "SkyRL's trainer needs Python >= 3.12") from _err  # fmt: skip

warn_if_untested("skyrl", "skyrl", SKYRL_VERSION)

#: Prefix of every name this adapter registers, and of its metrics in SkyRL's logs.
NAME_PREFIX = "steadyrl_"
METRIC_PREFIX = "steadyrl/"
#: steadyrl ``agg`` → SkyRL ``trainer.algorithm.loss_reduction`` of the same mini-batch reduction.
AGG_TO_LOSS_REDUCTION: dict[str, str] = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "sequence_mean",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}
#: Batch keys a hosted loss can be given, beyond logp / behav_logp / mask.
_PROVIDED = ("advantages", "prox_logp")
_NOT_HOSTED_INPUTS: dict[str, str] = {
    "grad_sq_norms": "SkyRL passes no per-trajectory gradient norms (OPOB)",
    "sum_p2": "SkyRL passes no Σ_v π_v² of the proximal distribution (OTB)",
    "centering": "SkyRL records no behavior distribution per token (score centering)",
    "values": "SkyRL's policy loss receives no critic values (COPC)",
    "behav_entropy": "SkyRL records no entropy of the behavior distribution (ESTR)",
    "ref_logp": "SkyRL's policy loss receives no reference log-probs: use its use_kl_loss / use_kl_in_reward",
    "rewards": "SkyRL's policy loss receives advantages, not rewards and groups",
    "group_ids": "SkyRL's policy loss receives advantages, not rewards and groups",
    "entropy": "SkyRL's policy loss receives no entropy of π_θ: use its use_entropy_loss / entropy_loss_coef instead "
    "of the method's entropy.coef",
}


def _hosted_spec(spec: MethodSpec) -> MethodSpec:
    """The spec the loss runs: SkyRL's advantages (``given``) and a plain token sum (module docstring, point 2)."""
    return resolve_method(spec, {"advantage.type": "given", "agg": "seq-mean-token-sum-norm", "norm_len": 1})


def why_not_hosted(spec: MethodSpec) -> str | None:
    """Why ``spec``'s loss cannot run as a SkyRL policy loss, or None when it can."""
    if spec.controllers:
        kinds = ", ".join(c.type for c in spec.controllers)
        return (f"step-level controllers ({kinds}) act on the optimizer, which lives inside SkyRL's Ray policy "
                "worker where no registry reaches")  # fmt: skip
    if spec.agg not in AGG_TO_LOSS_REDUCTION:
        return f"agg={spec.agg!r} has no SkyRL loss_reduction (allowed: {', '.join(AGG_TO_LOSS_REDUCTION)})"
    if spec.objective.type in ("gmc_grpo", "oapl"):
        return f"objective {spec.objective.type!r} needs the rewards and groups, which SkyRL's policy loss lacks"
    if spec.objective.type in ("clip_cov", "kl_cov"):
        return f"objective {spec.objective.type!r} ranks Cov(log π, A) of a batch; SkyRL gives a micro-batch's scaled A"
    if spec.objective.type in ("dro", "ipo"):
        return (f"objective {spec.objective.type!r} has a (log r)² term that does not carry A, so SkyRL's advantage "
                "pre-scaling would leave it unnormalized: use SkyRL's own losses or another framework")  # fmt: skip
    if spec.objective.type == "tic_grpo":
        return "TIC-GRPO's loss is a mean over sequences, not the token sum SkyRL's pre-scaled advantages need"
    if spec.advantage.type not in ("grpo", "given"):
        return (f"advantage.type={spec.advantage.type!r} needs tensors SkyRL's advantage estimator does not get "
                "(policies, gradient norms or values)")  # fmt: skip
    for key in required_inputs(_hosted_spec(spec)):
        if key not in _PROVIDED:
            return f"needs {key}: {_NOT_HOSTED_INPUTS.get(key, 'SkyRL does not provide it')}"
    return None


def off_policy_corrections(block: Any) -> list[dict[str, Any]]:
    """SkyRL 0.3.0's ``trainer.algorithm.off_policy_correction`` as steadyrl corrections, in SkyRL's order.

    Every rule reads w_t = π_prox/μ (SkyRL: exp(old_log_probs − rollout_logprobs)); masked tokens leave the token sum,
    as SkyRL's ``loss_mask`` update does (its pre-scaled advantages keep them in the denominators, as here):

    ==========================================  ===============================================================
    SkyRL field                                 steadyrl correction
    ==========================================  ===============================================================
    ``outlier_token_is_threshold_low`` = a      ``token_veto`` (threshold a): drop a sequence with any w_t < a
    ``outlier_token_is_threshold_high`` = b     ``rejection`` (metric ratio, level sequence, max, upper b)
    ``token_mask_is_threshold_low/high``        ``token_mis`` (weight one): drop tokens outside [low, high]
    ``tis_ratio_type="token"``                  ``token_tis`` (cap ``token_tis_ratio_clip_high``)
    ``tis_ratio_type="sequence"``               ``seq_tis`` (cap ``sequence_tis_ratio_clip_high``)
    ``sequence_mask_metric="geometric"``        ``geo_mis`` (weight one, [geo_mask_low, geo_mask_high])
    ``sequence_mask_metric="product"``          ``seq_mis`` (weight one, [product_mask_low, product_mask_high])
    ==========================================  ===============================================================
    """
    out: list[dict[str, Any]] = []
    low, high = block.outlier_token_is_threshold_low, block.outlier_token_is_threshold_high
    if low is not None:
        out.append({"type": "token_veto", "threshold": float(low)})
    if high is not None:
        out.append({"type": "rejection", "metric": "ratio", "level": "sequence", "seq_agg": "max", "lower": None,
                    "upper": float(high)})  # fmt: skip
    if block.token_mask_is_threshold_low is not None and block.token_mask_is_threshold_high is not None:
        out.append({"type": "token_mis", "lower": float(block.token_mask_is_threshold_low),
                    "upper": float(block.token_mask_is_threshold_high), "weight": "one"})  # fmt: skip
    if block.tis_ratio_type == "token":
        out.append({"type": "token_tis", "cap": float(block.token_tis_ratio_clip_high)})
    elif block.tis_ratio_type == "sequence":
        out.append({"type": "seq_tis", "cap": float(block.sequence_tis_ratio_clip_high)})
    elif block.tis_ratio_type is not None:
        raise ValueError(f"off_policy_correction.tis_ratio_type={block.tis_ratio_type!r}: use 'token' or 'sequence'")
    metric = block.sequence_mask_metric
    if metric == "geometric":
        out.append({"type": "geo_mis", "lower": float(block.geo_mask_low), "upper": float(block.geo_mask_high),
                    "weight": "one"})  # fmt: skip
    elif metric == "product":
        out.append({"type": "seq_mis", "lower": float(block.product_mask_low),
                    "upper": float(block.product_mask_high), "weight": "one"})  # fmt: skip
    elif metric is not None:
        raise ValueError(f"off_policy_correction.sequence_mask_metric={metric!r}: use 'geometric' or 'product'")
    return out


def needs_behavior(spec: MethodSpec) -> bool:
    """Whether the loss of ``spec`` reads μ (then SkyRL must record ``rollout_logprobs``)."""
    return reads_behavior(spec, controllers=False)  # controllers are refused here (why_not_hosted)


class PolicyLoss:
    """A steadyrl method as a SkyRL policy loss (module docstring: the tensor mapping and the aggregation).

    Args:
        method: a preset name, a composition or a resolved :class:`~steadyrl.MethodSpec`.
        method_overrides: dotted options as in :func:`steadyrl.resolve_method`.

    Called as SkyRL's worker calls every registered loss; returns ``(loss, metrics)`` with float metrics named
    ``steadyrl/<key>`` (one host read per call).
    """

    def __init__(self, method: str | MethodSpec, method_overrides: Mapping[str, Any] | None = None) -> None:
        spec = resolve_method(method, method_overrides)
        reason = why_not_hosted(spec)
        if reason is not None:
            raise ValueError(f"method {spec.name!r} cannot run as a SkyRL policy loss: {reason}")
        self.method: MethodSpec = spec
        self.hosted: MethodSpec = _hosted_spec(spec)
        self.needs_behavior: bool = needs_behavior(spec)
        self._with_block: dict[str, MethodSpec] = {}

    def check_config(self, config: Any) -> None:
        """Refuse a SkyRL ``trainer.algorithm`` config the loss cannot honour, naming the field."""
        want = AGG_TO_LOSS_REDUCTION[self.method.agg]
        got = config.loss_reduction
        if got != want:
            inverse = {v: k for k, v in AGG_TO_LOSS_REDUCTION.items()}
            fix = f"method_overrides={{'agg': {inverse[got]!r}}}" if got in inverse else "another loss_reduction"
            raise ValueError(
                f"method {self.method.name!r} aggregates with agg={self.method.agg!r}, so SkyRL's "
                f"trainer.algorithm.loss_reduction must be {want!r} (got {got!r}: SkyRL pre-scales the advantages "
                f"by it); or register with {fix}"
            )
        if want == "seq_mean_token_sum_norm" and self.method.norm_len not in (None, config.max_seq_len):
            raise ValueError(
                f"method {self.method.name!r} has norm_len={self.method.norm_len}; SkyRL divides by "
                f"trainer.algorithm.max_seq_len={config.max_seq_len}: make them equal"
            )

    def with_block(self, block: Any) -> MethodSpec:
        """The hosted spec with SkyRL's ``off_policy_correction`` block's corrections first (itself when unset)."""
        if block is None or not off_policy_correction_enabled(block):
            return self.hosted
        extra = off_policy_corrections(block)
        key = repr(extra)
        if key not in self._with_block:
            fields = self.hosted.model_dump()
            fields["corrections"] = [*extra, *fields["corrections"]]
            self._with_block[key] = MethodSpec.model_validate(fields)
        return self._with_block[key]

    def batch(
        self, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor | None,
        rollout_logprobs: Tensor | None,
    ) -> dict[str, Tensor]:  # fmt: skip
        """The ``compute_loss`` batch of one SkyRL micro-batch (module docstring, point 1)."""
        mask = torch.ones_like(log_probs, dtype=torch.bool) if loss_mask is None else loss_mask > 0
        prox = old_log_probs.detach()
        if rollout_logprobs is None:
            if self.needs_behavior:
                raise ValueError(
                    f"method {self.method.name!r} corrects for the behavior policy μ but SkyRL passed no "
                    "rollout_logprobs: set generator.sampling_params.logprobs (e.g. 1) so the inference engine "
                    "records them"
                )
            behav = prox  # no correction reads μ; the diagnostics then see μ = π_prox
        else:
            behav = rollout_logprobs.detach().to(log_probs.dtype)
        return {
            "logp": log_probs, "behav_logp": behav, "prox_logp": prox.to(log_probs.dtype), "mask": mask,
            "advantages": advantages.detach().to(log_probs.dtype),
        }  # fmt: skip

    def __call__(
        self,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        config: Any,
        loss_mask: Tensor | None = None,
        rollout_logprobs: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        self.check_config(config)
        hosted = self.with_block(getattr(config, "off_policy_correction", None))
        if hosted is not self.hosted and rollout_logprobs is None:
            raise ValueError(
                "SkyRL's trainer.algorithm.off_policy_correction reads the rollout log-probs, which SkyRL did not "
                "pass: set generator.sampling_params.logprobs (e.g. 1)"
            )
        batch = self.batch(log_probs, old_log_probs, advantages, loss_mask, rollout_logprobs)
        out = compute_loss(hosted, batch, validate=False)
        loss = out.loss * log_probs.shape[0]  # seq-mean-token-sum-norm with norm_len=1 divides by B: undo it
        keys = list(out.metrics)
        values = torch.stack([out.metrics[k].float().reshape(()) for k in keys]).tolist() if keys else []
        return loss, {METRIC_PREFIX + k: v for k, v in zip(keys, values, strict=True)}

    def __repr__(self) -> str:
        return f"steadyrl.integrations.skyrl.PolicyLoss({self.method.name!r})"


class AdvantageEstimator:
    """A steadyrl GRPO / Dr.GRPO estimator with SkyRL's estimator signature (arXiv 2402.03300, 2503.20783) [exact].

    ``(token_level_rewards [B,T], response_mask [B,T], index [B] (SkyRL's uids), **kwargs)`` → ``(advantages,
    returns)`` [B,T]: R_i = Σ_t r_{i,t}; groups = equal uids; ``grpo.grpo_advantages`` with the method's ``scale``,
    ``eps`` and ``unbiased``; A_i broadcast to the response tokens (returns = advantages, as SkyRL's GRPO).
    """

    def __init__(self, method: str | MethodSpec, method_overrides: Mapping[str, Any] | None = None) -> None:
        spec = resolve_method(method, method_overrides)
        if not isinstance(spec.advantage, GrpoAdvantage):
            raise ValueError(
                f"method {spec.name!r} has advantage.type={spec.advantage.type!r}; only 'grpo' runs as a SkyRL "
                "advantage estimator (the others need tensors the estimator does not get)"
            )
        self.method: MethodSpec = spec
        self.advantage: GrpoAdvantage = spec.advantage

    def __call__(
        self, token_level_rewards: Tensor, response_mask: Tensor, index: Sequence[Any], **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        config = kwargs.get("config")
        if config is not None and getattr(config, "advantage_batch_normalize", False):
            raise ValueError(
                f"method {self.method.name!r}: SkyRL's trainer.algorithm.advantage_batch_normalize would re-normalize "
                "steadyrl's advantages; set it to false"
            )
        if not kwargs.get("grpo_norm_by_std", True) and self.advantage.scale != "none":
            raise ValueError(
                f"trainer.algorithm.grpo_norm_by_std=false asks for Dr.GRPO but method {self.method.name!r} has "
                f"advantage.scale={self.advantage.scale!r}: register with method_overrides={{'advantage.scale': "
                "'none'}} (or set grpo_norm_by_std=true)"
            )
        dense: dict[Any, int] = {}
        ids = torch.tensor([dense.setdefault(u, len(dense)) for u in list(index)], device=token_level_rewards.device)
        a = self.advantage
        out = grpo.grpo_advantages(
            rewards=token_level_rewards.sum(dim=-1), group_ids=ids, scale=a.scale, eps=a.eps, unbiased=a.unbiased
        )
        adv = grpo.token_advantages(advantages=out.advantages, mask=response_mask).to(token_level_rewards.dtype)
        return adv, adv

    def __repr__(self) -> str:
        return f"steadyrl.integrations.skyrl.AdvantageEstimator({self.method.name!r})"


def _replace(registry: Any, name: str, fn: Any) -> None:
    """``registry.register`` that replaces an existing entry (SkyRL refuses duplicates; a re-run re-registers)."""
    if name in registry._functions:
        registry.unregister(name)
    registry.register(name, fn)


def register(
    method: str | MethodSpec, *, method_overrides: Mapping[str, Any] | None = None, name: str | None = None
) -> str:
    """Register ``method`` as a SkyRL policy loss (and, for a GRPO advantage, an advantage estimator) under ``name``.

    ``name`` defaults to ``steadyrl_<method name>``. Call it in the driver before SkyRL's ``validate_cfg`` (which
    checks ``policy_loss_type`` against the registry) and ``initialize_ray`` (which syncs the registries to their Ray
    actor); a call after ``ray.init`` reaches the actor directly. Returns the name to put in
    ``trainer.algorithm.policy_loss_type`` (and ``advantage_estimator``).
    """
    loss = PolicyLoss(method, method_overrides)
    name = name or NAME_PREFIX + loss.method.name
    _replace(_ppo.PolicyLossRegistry, name, loss)
    if isinstance(loss.method.advantage, GrpoAdvantage):
        _replace(_ppo.AdvantageEstimatorRegistry, name, AdvantageEstimator(loss.method))
    return name


def supported(method: str | MethodSpec) -> tuple[bool, str]:
    """(whether ``method`` runs as a SkyRL policy loss, why not / what it needs) — the table of the docs."""
    spec = resolve_method(method) if isinstance(method, str) else method
    reason = why_not_hosted(spec)
    if reason is not None:
        return False, reason
    notes = [f"loss_reduction={AGG_TO_LOSS_REDUCTION[spec.agg]}"]
    if needs_behavior(spec):
        notes.append("rollout_logprobs (generator.sampling_params.logprobs)")
    return True, "; ".join(notes)


__all__ = [
    "AGG_TO_LOSS_REDUCTION",
    "METRIC_PREFIX",
    "NAME_PREFIX",
    "SKYRL_VERSION",
    "AdvantageEstimator",
    "PolicyLoss",
    "needs_behavior",
    "off_policy_corrections",
    "register",
    "supported",
    "why_not_hosted",
]
