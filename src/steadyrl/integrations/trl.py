"""steadyrl methods inside TRL's ``GRPOTrainer`` (TRL 1.16.0): a subclass whose loss is ``steadyrl.compute_loss``.

The two-line change (docs/integrations.md)::

    from steadyrl.integrations.trl import GRPOTrainer          # instead of: from trl import GRPOTrainer
    trainer = GRPOTrainer(method="seq_tis", model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)

What the subclass changes, in four points (everything else, generation, rewards, logging, is TRL's):

1. **The loss.** ``_compute_loss`` runs TRL's own log-prob forward (π_θ, with gradient), maps TRL's tensors to a
   steadyrl batch (below) and returns ``compute_loss(method, batch).loss`` divided by the gradient-accumulation steps
   (TRL's own normalizer for its per-micro-batch losses). TRL's ``loss_type``, ``epsilon``, ``delta``,
   ``importance_sampling_level``, ``beta`` (as a coefficient) and ``vllm_importance_sampling_*`` no longer act: the
   method's objective, corrections and KL decide.
2. **The policies** (DESIGN.md vocabulary). μ (``behav_logp``) is what TRL records for the policy that generated the
   completions: vLLM's per-token log-probs (``sampling_per_token_logps``) when TRL samples with vLLM; without vLLM TRL
   records none, and μ is the generating policy's log-probs recomputed by the trainer right after generation
   (``old_per_token_logps``, same weights, teacher-forced), or π_θ detached when TRL skips that recompute because no
   optimizer step separates generation from every use of the batch. π_prox (``prox_logp``) is
   ``old_per_token_logps`` (the policy at the start of the batch's optimization phase), else π_θ detached. Without
   vLLM, therefore, μ = π_prox: ℓ = log π_prox − log μ ≡ 0, every behavior correction has weight 1 and the ESS is 1;
   the only staleness is the forward lag of ``num_iterations > 1`` (up to ``num_iterations − 1`` optimizer steps
   between π_prox and π_θ), which the method's objective (its PPO clip) sees. μ is the tempered full softmax: with
   ``top_p < 1`` or ``top_k > 0`` the sampler's truncated distribution is not what μ scores.
3. **Advantages.** ``advantages="steadyrl"`` (default): steadyrl gets the rewards (Σ_k w_k r_k over TRL's reward
   functions, ``reward_weights``) and the group ids, so its own estimators run (GRPO, Dr.GRPO, OPOB, VACO) and
   group-coupled objectives (GMC-GRPO, OAPL) see whole groups. This needs every micro-batch to hold whole groups:
   ``steps_per_generation = 1`` and ``per_device_train_batch_size`` a multiple of ``num_generations`` (checked).
   ``advantages="trl"``: TRL's advantages (its ``scale_rewards``, multi-objective aggregation) are passed as
   ``advantage.type=given``, for any batching; refused for methods whose estimator or objective needs whole groups.
   Completions whose every reward function returned None get no gradient (masked out) and their group's mean reward
   in the group statistics.
4. **Step-level controllers** (VCPO's ESS step size, GAC), through two Trainer seams: before TRL clips the gradient
   (``_clip_grad_norm``, as steadyrl's learner orders them) and around ``optimizer.step`` (a wrapper that can skip
   the step: zeroing a gradient would not stop AdamW). The ESS ratio of a step is the mean over its micro-batches,
   averaged across processes so every replica scales its lr alike. OPOB's per-trajectory squared gradient norms come
   from :func:`steadyrl.train.grad_norms.per_trajectory_grad_sq_norms` (one more forward and backward per
   micro-batch with the default ``"ghost"``).

Metrics: every ``compute_loss`` metric and every controller metric goes to TRL's logger (``self._metrics``, averaged
over a logging window) as ``steadyrl/<key>`` (``steadyrl/is/ess_ratio``, ``steadyrl/kl/k3``,
``steadyrl/vcpo/ess_scale``, ``steadyrl/gac/cos``, ...), with one host read per micro-batch. Versions are TRL's
``global_step`` at generation, so ``steadyrl/lag/*`` measure the forward lag.

5. **Entropy bonus.** TRL's ``entropy_coef`` and ``use_adaptive_entropy`` (with ``entropy_target``,
   ``entropy_coef_delta``, ``entropy_coef_min/max``) map onto the method's: ``entropy.coef`` with TRL's reduction (a
   token mean over the completion mask: ``entropy.agg=token-mean``, ``entropy.mask=input``) and the
   ``adaptive_entropy`` controller, whose coefficient reaches every micro-batch's loss and moves once per optimizer
   step from the step's token-mean entropy over every micro-batch and process (TRL's window statistics). Its state
   is written to and read from TRL's own ``entropy_ctrl_state.json`` of each checkpoint. A method that sets its own
   entropy options (``method.entropy.coef``, ``+adaptive_entropy``) runs as it is; setting both is refused. The
   entropy is TRL's (its fused LM head, at its temperature), requested only when the method needs it.

Not hosted (no TRL tensor to build them from): ESTR (behavior entropies), OTB (Σ_v π_v² of π_prox), COPC (a critic).
Confidence: [exact] as a mapping (the loss equals ``steadyrl.compute_loss`` on the same tensors; tests check 1e-6).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from steadyrl.control.adaptive_entropy import AdaptiveEntropyController
from steadyrl.integrations._framework import install_hint, missing_framework, warn_if_untested
from steadyrl.integrations.step_control import StepControl
from steadyrl.methods import MethodSpec, compute_loss, required_inputs, resolve_method
from steadyrl.rollout.rollouts import TokenBatch
from steadyrl.train.grad_norms import GRAD_NORM_METHODS, GradNormMethod, per_trajectory_grad_sq_norms

#: The TRL release this adapter was written and tested against (it overrides private ``GRPOTrainer`` methods).
TRL_VERSION = "1.16.0"

try:
    from trl import GRPOTrainer as _TRLGRPOTrainer
except ImportError as _err:  # one line saying what to install
    raise missing_framework("trl", "TRL", install_hint("trl", "trl", TRL_VERSION, pin_file=False)) from _err

warn_if_untested("trl", "trl", TRL_VERSION)

AdvantageSource = Literal["steadyrl", "trl"]
ADVANTAGE_SOURCES: tuple[str, ...] = ("steadyrl", "trl")
#: Prefix of every steadyrl metric in TRL's logs.
METRIC_PREFIX = "steadyrl/"
#: Batch keys steadyrl methods may need that TRL has no tensor for, with the reason.
_NOT_HOSTED: dict[str, str] = {
    "behav_entropy": "TRL records no entropy of the behavior distribution",
    "sum_p2": "TRL computes no Σ_v π_v² of the proximal distribution",
    "centering": "TRL records no behavior distribution per token (score centering)",
    "values": "TRL's GRPOTrainer has no critic",
}
#: Extra keys this adapter adds to TRL's generation batch (shuffled and split with it).
_REWARDS, _GROUPS = "steadyrl_rewards", "steadyrl_group_ids"
_SCORABLE, _VERSIONS = "steadyrl_scorable", "steadyrl_version"
#: GRPOConfig options that act inside TRL's loss only: set away from their default, they would be silently ignored.
_LOSS_ONLY_OPTIONS: dict[str, Any] = {
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
}
#: ``entropy_ctrl_state.json`` keys of TRL's adaptive entropy state ↔ the controller's metrics that carry them.
_ENTROPY_STATE = {"entropy_coef": "entropy/adaptive_coef", "_last_world_entropy": "entropy/step_mean"}


class GRPOTrainer(_TRLGRPOTrainer):
    """TRL's ``GRPOTrainer`` with the loss of a steadyrl method (module docstring: what changes and why).

    Args (besides TRL's, passed through unchanged):
        method: a preset name, a composition (``"seq_tis+gac"``) or a resolved :class:`~steadyrl.MethodSpec`.
        method_overrides: dotted options as in :func:`steadyrl.resolve_method` (``{"seq_tis.cap": 4}``).
        advantages: ``"steadyrl"`` (rewards and group ids to steadyrl's estimator) or ``"trl"`` (TRL's advantages,
            ``advantage.type=given``).
        grad_norms: how OPOB's per-trajectory gradient norms are computed (``ghost`` | ``vmap`` | ``naive``).
    """

    def __init__(
        self,
        *args: Any,
        method: str | MethodSpec = "grpo",
        method_overrides: Mapping[str, Any] | None = None,
        advantages: AdvantageSource | str = "steadyrl",
        grad_norms: GradNormMethod | str = "ghost",
        **kwargs: Any,
    ) -> None:
        if advantages not in ADVANTAGE_SOURCES:
            raise ValueError(f"advantages={advantages!r} is not one of {', '.join(ADVANTAGE_SOURCES)}")
        if grad_norms not in GRAD_NORM_METHODS:
            raise ValueError(f"grad_norms={grad_norms!r} is not one of {', '.join(GRAD_NORM_METHODS)}")
        spec = resolve_method(method, method_overrides)
        if advantages == "trl":
            _check_trl_advantages(spec)
            spec = resolve_method(spec, {"advantage.type": "given"})
        self.steadyrl_method: MethodSpec = spec
        self.steadyrl_advantages: str = advantages
        self.steadyrl_grad_norms: str = grad_norms
        self.steadyrl_needs: tuple[str, ...] = required_inputs(spec)
        self.steadyrl_control = StepControl(spec, framework="trl", wrap_hint="the optimizer TRL creates")
        self._steadyrl_rewards_per_func: Tensor | None = None
        super().__init__(*args, **kwargs)
        spec = with_trl_entropy(spec, self.args)
        if spec is not self.steadyrl_method:
            self.steadyrl_method, self.steadyrl_needs = spec, required_inputs(spec)
            self.steadyrl_control = StepControl(spec, framework="trl", wrap_hint="the optimizer TRL creates")
        # TRL saves and restores its adaptive entropy state (entropy_coef, _last_world_entropy) with each checkpoint
        # when this is set; the controller's state is mirrored there (_steadyrl_before_step, _load_optimizer_...)
        self.use_adaptive_entropy = _adaptive_entropy(self.steadyrl_control) is not None
        self._check_config()

    # ------------------------------------------------------------------------------------------------ checks
    def _check_config(self) -> None:
        """Refuse configurations the loss cannot honour, naming the method or the GRPOConfig field."""
        a, name = self.args, self.steadyrl_method.name
        for key, reason in _NOT_HOSTED.items():
            if key in self.steadyrl_needs:
                raise ValueError(f"method {name!r} needs {key!r}, which the TRL adapter cannot provide: {reason}")
        sharded = sharding_reason(self)
        if "grad_sq_norms" in self.steadyrl_needs and sharded is not None:
            raise ValueError(
                f"method {name!r} needs per-trajectory gradient norms, which the TRL adapter computes on the whole "
                f"unwrapped model in each process; under {sharded} each process holds a shard of the weights, so "
                "those norms would be wrong: run OPOB/VCPO with DDP or ZeRO-1/2 (the weights whole on every "
                "process), or pick a method without per-trajectory norms (e.g. seq_tis+ess_lr)"
            )
        if "ref_logp" in self.steadyrl_needs and a.beta == 0.0:
            raise ValueError(
                f"method {name!r} needs reference log-probs: set GRPOConfig.beta to any nonzero value so TRL computes "
                "them (the coefficient used is the method's kl.beta)"
            )
        for key, default in _LOSS_ONLY_OPTIONS.items():
            if getattr(a, key) != default:
                raise ValueError(
                    f"GRPOConfig.{key}={getattr(a, key)!r} acts inside TRL's loss, which steadyrl replaces; "
                    f"leave it at {default!r} (steadyrl methods: `steadyrl methods`)"
                )
        if self.steadyrl_advantages == "steadyrl":
            G = self.num_generations
            if a.steps_per_generation != 1 or a.per_device_train_batch_size % G:
                raise ValueError(
                    "advantages='steadyrl' needs whole groups in every micro-batch: GRPOConfig.steps_per_generation "
                    f"must be 1 (got {a.steps_per_generation}) and per_device_train_batch_size "
                    f"({a.per_device_train_batch_size}) a multiple of num_generations ({G}); "
                    "or pass advantages='trl'"
                )
            if a.multi_objective_aggregation != "sum_then_normalize":
                raise ValueError(
                    "advantages='steadyrl' gives steadyrl the weighted sum of the rewards: GRPOConfig."
                    f"multi_objective_aggregation must be 'sum_then_normalize' (got {a.multi_objective_aggregation!r})"
                    "; or pass advantages='trl'"
                )

    # ------------------------------------------------------------------------------------------------ rewards
    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Tensor:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._steadyrl_rewards_per_func = rewards_per_func  # [N_all, n_funcs], gathered over processes
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        n = out["completion_ids"].shape[0]
        device = out["completion_ids"].device
        out[_VERSIONS] = torch.full((n,), self.state.global_step, dtype=torch.long, device=device)
        if self.steadyrl_advantages != "steadyrl":
            return out
        G = self.num_generations if self.model.training else self.num_generations_eval
        start = self.accelerator.process_index * n
        if n % G or start % G:
            raise ValueError(
                f"advantages='steadyrl': this process holds {n} completions from index {start}, not whole groups of "
                f"num_generations={G}; make the per-device batch a multiple of it, or pass advantages='trl'"
            )
        rpf = self._steadyrl_rewards_per_func
        assert rpf is not None
        rewards = group_filled_rewards(rpf, self.reward_weights.to(rpf.device), G)[start : start + n]
        out[_SCORABLE] = ~torch.isnan(rpf).all(dim=1)[start : start + n]
        out[_REWARDS] = rewards.to(device)
        out[_GROUPS] = torch.arange(n, device=device) // G  # TRL's groups: G consecutive completions per prompt
        return out

    # ------------------------------------------------------------------------------------------------ loss
    def steadyrl_batch(
        self, model: torch.nn.Module, inputs: Mapping[str, Any], logp: Tensor, entropy: Tensor | None = None
    ) -> dict[str, Any]:
        """The ``compute_loss`` batch of one TRL micro-batch, given π_θ's log-probs ``logp`` [B, T] (with gradient)
        and, for an entropy bonus, its entropies ``entropy`` [B, T] (with gradient)."""
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        if _SCORABLE in inputs:
            mask = mask & inputs[_SCORABLE].unsqueeze(-1)
        old = inputs.get("old_per_token_logps")
        prox = logp.detach() if old is None else old.detach()
        sampling = inputs.get("sampling_per_token_logps")
        # vLLM writes NaN where it could not score a token: μ := π_prox there (no correction), as TRL does.
        behav = prox if sampling is None else torch.where(torch.isnan(sampling), prox, sampling)
        B, T = logp.shape
        batch: dict[str, Any] = {
            "logp": logp,
            "behav_logp": behav,
            "prox_logp": prox,
            "mask": mask,
            "versions": inputs[_VERSIONS].unsqueeze(-1).expand(B, T),
            "learner_version": int(self.state.global_step),
        }
        if self.steadyrl_advantages == "steadyrl":
            batch["rewards"] = inputs[_REWARDS].to(logp.dtype)
            batch["group_ids"] = inputs[_GROUPS]
        else:
            batch["advantages"] = inputs["advantages"].to(logp.dtype)
        if "ref_logp" in self.steadyrl_needs:
            batch["ref_logp"] = inputs["ref_per_token_logps"]
        if "entropy" in self.steadyrl_needs:
            if entropy is None:
                raise ValueError(f"method {self.steadyrl_method.name!r} has an entropy bonus: pass the entropies")
            batch["entropy"] = entropy
        batch |= self.steadyrl_control.loss_inputs(logp.device)  # the adaptive entropy coefficient of this step
        if "grad_sq_norms" in self.steadyrl_needs:
            tokens = TokenBatch(inputs["prompt_ids"], inputs["prompt_mask"].bool(), inputs["completion_ids"], mask)
            batch["grad_sq_norms"] = per_trajectory_grad_sq_norms(
                self.accelerator.unwrap_model(model), tokens, method=self.steadyrl_grad_norms,
                temperature=self.temperature,
            ).to(logp.dtype)  # fmt: skip
        return batch

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        multimodal = {k: inputs.get(k) for k in _MULTIMODAL_KEYS}
        logp, entropy, aux_loss = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy="entropy" in self.steadyrl_needs,
            compute_aux_loss=self.aux_loss_enabled, **multimodal,
        )  # fmt: skip
        batch = self.steadyrl_batch(model, inputs, logp, entropy)
        loss, metrics = compute_loss(self.steadyrl_method, batch, validate=False)
        mode = "train" if self.model.training else "eval"
        self._log_steadyrl(metrics, mode)
        if mode == "train":
            self.steadyrl_control.record(metrics)
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0  # as TRL's "grpo" loss
        loss = loss / normalizer
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
        return loss

    def _log_steadyrl(self, metrics: Mapping[str, Tensor], mode: str) -> None:
        """Append ``metrics`` to TRL's logger as ``steadyrl/<key>`` (one host read for all of them)."""
        if not metrics:
            return
        values = torch.stack([v.detach().float().reshape(()) for v in metrics.values()]).tolist()
        for key, value in zip(metrics, values, strict=True):
            self._metrics[mode][METRIC_PREFIX + key].append(value)

    # ------------------------------------------------------------------------------------------------ controllers
    def _trainable_params(self) -> list[Tensor]:
        return [p for p in self.accelerator.unwrap_model(self.model).parameters() if p.requires_grad]

    def _steadyrl_before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Run every controller's ``before_step`` once per optimizer step (gradient accumulated, before clipping)
        and log the step's control metrics (:mod:`steadyrl.integrations.step_control`)."""
        control = self.steadyrl_control
        if not control or control.prepared:
            return
        if not getattr(optimizer, "_steadyrl_wrapped", False):  # an optimizer passed to the Trainer by the user
            _wrap_step(self, optimizer)
        control.prepare(optimizer, self._trainable_params())
        for key, value in control.last.items():
            self._metrics["train"][key].append(value)
        if self.use_adaptive_entropy:  # mirrored where TRL's checkpoint writes its entropy state
            for attr, key in _ENTROPY_STATE.items():
                setattr(self, attr, control.last[METRIC_PREFIX + key])

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)  # TRL reads entropy_ctrl_state.json into its attributes
        ctrl = _adaptive_entropy(self.steadyrl_control)
        if ctrl is not None and checkpoint is not None:
            ctrl.load_state_dict({"coef": self.entropy_coef, "last_entropy": self._last_world_entropy})

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        self._steadyrl_before_step(self.optimizer)  # GAC edits the raw gradient, then TRL clips (as the learner)
        return super()._clip_grad_norm(model)

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.steadyrl_control and not getattr(optimizer, "_steadyrl_wrapped", False):
            _wrap_step(self, optimizer)
        return optimizer


#: Per-sample multimodal inputs TRL's log-prob forward accepts (passed through unchanged).
_MULTIMODAL_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


def _wrap_step(trainer: GRPOTrainer, optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.step`` run the controllers (unless clipping already did), skip on request, then restore."""
    control = trainer.steadyrl_control
    control.wrap(optimizer, trainer._trainable_params)
    wrapped = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        trainer._steadyrl_before_step(optimizer)  # logs the metrics when clipping did not run first
        return wrapped(*args, **kwargs)

    optimizer.step = step  # type: ignore[method-assign]


def with_trl_entropy(spec: MethodSpec, args: Any) -> MethodSpec:
    """``spec`` with the entropy bonus a ``GRPOConfig`` asks for (module docstring, point 5); ``spec`` itself when it
    asks for none. Raises ``ValueError`` when both the config and the method set one."""
    coef, adaptive = float(args.entropy_coef), bool(args.use_adaptive_entropy)
    if coef == 0.0 and not adaptive:
        return spec
    own = [c.type for c in spec.controllers if c.type == "adaptive_entropy"]
    if spec.entropy.coef != 0.0 or own:
        raise ValueError(
            f"GRPOConfig.entropy_coef={coef} / use_adaptive_entropy={adaptive} and method {spec.name!r}'s own entropy "
            f"bonus (entropy.coef={spec.entropy.coef}{', adaptive_entropy' if own else ''}) both set the entropy "
            "bonus: set it in one place"
        )
    fields = spec.model_dump()
    fields["entropy"] = {**fields["entropy"], "coef": coef, "agg": "token-mean", "mask": "input"}  # TRL's reduction
    if adaptive:
        fields["controllers"] = [*fields["controllers"], {
            "type": "adaptive_entropy", "target": args.entropy_target, "delta": args.entropy_coef_delta,
            "coef_min": args.entropy_coef_min, "coef_max": args.entropy_coef_max,
        }]  # fmt: skip
    try:
        return MethodSpec.model_validate(fields)
    except ValueError as err:
        raise ValueError(f"GRPOConfig's entropy options do not map onto method {spec.name!r}: {err}") from None


def _adaptive_entropy(control: StepControl) -> AdaptiveEntropyController | None:
    return next((c for c in control.controllers if isinstance(c, AdaptiveEntropyController)), None)


def sharding_reason(trainer: Any) -> str | None:
    """``"FSDP"`` or ``"DeepSpeed ZeRO-3"`` when the trainer shards the weights across processes, else None.

    Reads the attributes ``transformers.Trainer`` sets from its accelerator (``is_fsdp_enabled``,
    ``is_deepspeed_enabled`` and the DeepSpeed plugin's ``zero_stage``).
    """
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP"
    if getattr(trainer, "is_deepspeed_enabled", False):
        plugin = getattr(getattr(trainer.accelerator, "state", None), "deepspeed_plugin", None)
        if getattr(plugin, "zero_stage", None) == 3:
            return "DeepSpeed ZeRO-3"
    return None


def group_filled_rewards(rewards_per_func: Tensor, reward_weights: Tensor, num_generations: int) -> Tensor:
    """r_i = Σ_k w_k r_{i,k} [N] over TRL's reward functions (NaN entries skipped, as TRL's ``nansum``).

    A completion whose every function returned None (all NaN) gets its group's mean reward over the scorable ones
    (0 if none is): it then leaves the group mean unchanged; the loss masks it out. Groups are ``num_generations``
    consecutive rows, TRL's layout.
    """
    r = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    r = torch.where(unscorable, torch.full_like(r, math.nan), r)
    group_mean = torch.nanmean(r.view(-1, num_generations), dim=1).nan_to_num(0.0)
    return torch.where(unscorable, group_mean.repeat_interleave(num_generations), r)


def _check_trl_advantages(spec: MethodSpec) -> None:
    """``advantages='trl'`` replaces the method's estimator by TRL's: refuse when that changes what it is."""
    if spec.advantage.type not in ("grpo", "given"):
        raise ValueError(
            f"method {spec.name!r} has advantage.type={spec.advantage.type!r}, which needs steadyrl's estimator: "
            "use advantages='steadyrl'"
        )
    if spec.objective.type in ("gmc_grpo", "oapl"):
        raise ValueError(
            f"method {spec.name!r}: objective {spec.objective.type!r} couples the completions of a group; use "
            "advantages='steadyrl' (whole groups per micro-batch)"
        )


def supported(spec: MethodSpec | str, *, advantages: AdvantageSource | str = "steadyrl") -> tuple[bool, str]:
    """(whether ``spec`` runs in this adapter, why not / what it needs) — the table of docs/integrations.md."""
    spec = resolve_method(spec) if isinstance(spec, str) else spec
    needs = required_inputs(spec)
    for key, reason in _NOT_HOSTED.items():
        if key in needs:
            return False, f"needs {key}: {reason}"
    if advantages == "trl":
        try:
            _check_trl_advantages(spec)
        except ValueError as err:
            return False, str(err)
    if "ref_logp" in needs:
        return True, "GRPOConfig.beta != 0 (TRL then computes the reference log-probs)"
    if "grad_sq_norms" in needs:
        return True, "one more forward and backward per micro-batch (per-trajectory gradient norms)"
    return True, ""


__all__ = [
    "ADVANTAGE_SOURCES",
    "METRIC_PREFIX",
    "TRL_VERSION",
    "GRPOTrainer",
    "group_filled_rewards",
    "supported",
    "with_trl_entropy",
]
