"""steadyrl methods inside AReaL (``areal`` 1.0.4): a ``loss_fn`` for ``TrainEngine.train_batch`` on packed inputs.

The two-line change (docs/integrations.md)::

    from steadyrl.integrations.areal import PPOActor             # instead of: from areal.trainer.ppo.actor import ...
    engine.actor = PPOActor(config.actor, engine, method="m2po")  # e.g. on an FSDPPPOActor engine

or, in a hand-written update loop, ``loss = LossFn("m2po")`` and
``engine.train_batch(mb, loss_fn=loss, loss_weight_fn=loss.loss_weight)``.

What the adapter does, in four points (everything else, rollout, staleness control, advantages, the π_prox forward,
packing, the optimizer, is AReaL's):

1. **Packed inputs.** AReaL's engine packs each micro-batch into 1-D tensors of ``N = cu_seqlens[-1]`` tokens
   (sequence j occupies ``[cu_seqlens[j], cu_seqlens[j+1])``) and calls ``loss_fn(logprobs [N], entropy [N],
   input_data, ...)``. The adapter scatters every per-token tensor into a right-padded [B, T] layout (row = sequence,
   T = the longest sequence), with gradient for π_θ, so per-sequence pieces (sequence weights, group-free sequence
   masks, GSPO's sequence ratio, prefix ratios) see whole sequences. Padded ``[B, S]`` inputs are accepted as they are.
2. **The policies**, in AReaL's naming (the naming steadyrl follows): π_θ ``logp`` = the engine's ``logprobs`` (with
   gradient); μ ``behav_logp`` = ``input_data["logprobs"]`` (the inference engine's); π_prox ``prox_logp`` =
   ``input_data["prox_logp"]`` (recomputed by ``compute_logp``), or π_θ detached when absent; ``mask`` =
   ``loss_mask``; ``advantages`` = AReaL's (``advantage.type=given``); ``versions`` / the engine version for lag
   metrics; ``ref_logp`` when a reference model is configured. Trap: unless ``actor.use_decoupled_loss=true``,
   AReaL's ``compute_advantages`` overwrites ``input_data["logprobs"]`` with ``prox_logp``, so μ = π_prox and every
   behavior correction is a no-op: :func:`check_actor_config` refuses that for a method that reads μ.
3. **Normalization.** The loss of a micro-batch is ``compute_loss(method, ...)`` (the method's ``agg`` inside the
   micro-batch); AReaL scales it by ``loss_weight_fn(mb) / Σ_mb loss_weight_fn`` and sums. :meth:`LossFn.loss_weight`
   returns the matching weight (trained tokens for ``token-mean``, non-empty sequences for the sequence means and
   TIC-GRPO, sequences for ``seq-mean-token-sum-norm``), so the sum is the method's ``agg`` over the whole batch.
   Tokens a correction removes leave steadyrl's denominator but not AReaL's weight: with several micro-batches a
   masking correction's batch loss differs by that reweighting; batch-coupled corrections (M2PO's budget) see one
   micro-batch.
4. **Step-level controllers** (VCPO's ESS step size, GAC):
   :class:`~steadyrl.integrations.step_control.StepControl` wraps the engine's
   ``optimizer.step`` (AReaL calls it inside ``engine.optimizer_step``, after its gradient clipping): before the
   step it runs the controllers with the metrics the loss recorded since the last step (the ESS ratio: their mean,
   averaged across processes), skips the step when one asks (weights and AdamW moments untouched), then restores.
   GAC needs the full gradient on each process: FSDP shards it, so GAC is for single-process runs only.

Metrics: every ``compute_loss`` metric goes to AReaL's ``stats_tracker`` as ``steadyrl/<key>`` (one host read per
micro-batch). Not hosted (no tensor for them in AReaL's loss input): OPOB / VCPO (per-trajectory gradient norms),
VACO's re-aligned advantages, OTB (Σ_v π_v²), COPC (critic values in the actor's loss), ESTR (the behavior
entropies; AReaL's ``entropy`` is π_θ's), GMC-GRPO and OAPL (rewards and groups; AReaL pops the rewards before the
update), KL in the reward (AReaL's ``kl_ctl`` does it). Confidence: [exact] as a mapping (tests check 1e-6).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from steadyrl.integrations._framework import install_hint, missing_framework, warn_if_untested
from steadyrl.integrations.step_control import StepControl
from steadyrl.methods import MethodSpec, compute_loss, reads_behavior, required_inputs, resolve_method

#: The AReaL release this adapter was written and tested against.
AREAL_VERSION = "1.0.4"

try:
    from areal.api.cli_args import MicroBatchSpec
    from areal.trainer.ppo.actor import PPOActor as _ArealPPOActor
    from areal.utils import stats_tracker
    from areal.utils.data import split_padded_tensor_dict_into_mb_list
except ImportError as _err:  # one line saying what to install
    raise missing_framework("areal", "AReaL", install_hint("areal", "areal", AREAL_VERSION)) from _err

warn_if_untested("areal", "areal", AREAL_VERSION)

METRIC_PREFIX = "steadyrl/"
#: Batch keys the adapter can fill from AReaL's loss input, beyond logp / behav_logp / mask.
_PROVIDED = ("advantages", "prox_logp", "versions", "learner_version", "ref_logp")
_NOT_HOSTED_INPUTS: dict[str, str] = {
    "grad_sq_norms": "AReaL's loss input has no per-trajectory gradient norms (OPOB)",
    "sum_p2": "AReaL's loss input has no Σ_v π_v² of the proximal distribution (OTB)",
    "centering": "AReaL records no behavior distribution per token (score centering)",
    "values": "the actor's loss input has no critic values (COPC)",
    "behav_entropy": "AReaL records no entropy of the behavior distribution (its `entropy` argument is π_θ's)",
    "rewards": "AReaL's actor pops the rewards before the update; its loss gets advantages",
    "group_ids": "AReaL's loss input has no prompt groups",
    "entropy": "the adapter does not feed AReaL's `entropy` argument to the loss (no entropy bonus in AReaL): leave "
    "the method's entropy.coef at 0 and adaptive_entropy out",
}
#: PPOActorConfig options that act only inside AReaL's own loss: set, they would be silently ignored.
_LOSS_ONLY_OPTIONS: dict[str, Any] = {
    "use_sapo_loss": False,
    "rejection_sampling": None,
    "m2_threshold": None,
    "c_clip": None,
}


def _hosted_spec(spec: MethodSpec) -> MethodSpec:
    """The spec the loss runs: AReaL's advantages (``given``)."""
    return resolve_method(spec, {"advantage.type": "given"}) if spec.advantage.type != "given" else spec


def why_not_hosted(spec: MethodSpec) -> str | None:
    """Why ``spec``'s loss cannot run as an AReaL ``loss_fn``, or None when it can."""
    if spec.advantage.type not in ("grpo", "given"):
        return (f"advantage.type={spec.advantage.type!r} needs tensors AReaL's loss input lacks (policies at the "
                "phase start, gradient norms or values): AReaL computes the advantages")  # fmt: skip
    if spec.objective.type in ("gmc_grpo", "oapl"):
        return f"objective {spec.objective.type!r} needs the rewards and groups, which AReaL's loss input lacks"
    if spec.objective.type in ("clip_cov", "kl_cov"):
        return f"objective {spec.objective.type!r} ranks Cov(log π, A) over the batch; AReaL's loss sees a micro-batch"
    if spec.kl.type == "in_reward":
        return "KL in the reward needs the rewards: use AReaL's own kl_ctl"
    for key in required_inputs(_hosted_spec(spec)):
        if key not in _PROVIDED:
            return f"needs {key}: {_NOT_HOSTED_INPUTS.get(key, 'AReaL does not provide it')}"
    return None


def needs_behavior(spec: MethodSpec) -> bool:
    """Whether the loss or a controller of ``spec`` reads μ (AReaL must then keep it: ``use_decoupled_loss``)."""
    return reads_behavior(spec)


def supported(method: str | MethodSpec) -> tuple[bool, str]:
    """(whether ``method`` runs in this adapter, why not / what it needs) — the table of the docs."""
    spec = resolve_method(method) if isinstance(method, str) else method
    reason = why_not_hosted(spec)
    if reason is not None:
        return False, reason
    notes = []
    if needs_behavior(spec):
        notes.append("actor.use_decoupled_loss=true")
    if "ref_logp" in required_inputs(spec):
        notes.append("a reference model (ref_logp)")
    if spec.controllers:
        notes.append("StepControl on the engine's optimizer (PPOActor attaches it)")
    return True, "; ".join(notes)


def check_actor_config(config: Any, spec: MethodSpec) -> None:
    """Refuse a ``PPOActorConfig`` the loss cannot honour, naming the field (module docstring, point 2)."""
    if needs_behavior(spec) and not config.use_decoupled_loss:
        raise ValueError(
            f"method {spec.name!r} corrects for the behavior policy μ, but with actor.use_decoupled_loss=false "
            "AReaL's compute_advantages overwrites the behavior log-probs with prox_logp: set "
            "actor.use_decoupled_loss=true"
        )
    for key, default in _LOSS_ONLY_OPTIONS.items():
        value = getattr(config, key, default)
        if value != default:
            raise ValueError(
                f"actor.{key}={value!r} acts inside AReaL's own loss, which steadyrl replaces; leave it at "
                f"{default!r} (steadyrl methods: `steadyrl methods`)"
            )


def unpack(x: Tensor, cu_seqlens: Tensor, max_seqlen: int, fill: float | bool = 0) -> Tensor:
    """Packed [N, ...] → right-padded [B, T, ...] (B = len(cu_seqlens) − 1, T = ``max_seqlen``), differentiable.

    Token ``p`` of sequence j (``cu[j] ≤ p < cu[j+1]``) goes to row j, column p − cu[j]; the rest is ``fill``.
    """
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    B = lens.shape[0]
    rows = torch.repeat_interleave(torch.arange(B, device=x.device), lens, output_size=x.shape[0])
    cols = torch.arange(x.shape[0], device=x.device) - cu[rows]
    out = torch.full((B, max_seqlen, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    return out.index_put((rows, cols), x)


class LossFn:
    """A steadyrl method as AReaL's actor ``loss_fn`` (module docstring: packing, policies, normalization).

    Args:
        method: a preset name, a composition or a resolved :class:`~steadyrl.MethodSpec`.
        method_overrides: dotted options as in :func:`steadyrl.resolve_method`.

    Call: ``loss_fn(logprobs, entropy, input_data, *, current_version=None, **_)`` → scalar loss (AReaL passes
    ``vocab_min_logits`` / ``vocab_max_logits``, ignored). Pass :meth:`loss_weight` as ``loss_weight_fn``.
    """

    def __init__(self, method: str | MethodSpec, method_overrides: Mapping[str, Any] | None = None) -> None:
        spec = resolve_method(method, method_overrides)
        reason = why_not_hosted(spec)
        if reason is not None:
            raise ValueError(f"method {spec.name!r} cannot run as an AReaL loss_fn: {reason}")
        self.method: MethodSpec = spec
        self.hosted: MethodSpec = _hosted_spec(spec)
        self.needs: tuple[str, ...] = required_inputs(self.hosted)
        self.step_control: StepControl | None = None
        if spec.controllers:
            self.step_control = StepControl(spec, framework="areal", wrap_hint="steadyrl.integrations.areal.PPOActor")
        self.learner_version: int | None = None  # set by PPOActor to the engine's version before an update

    # ------------------------------------------------------------------------------------------------ layout
    def _padded(self, input_data: Mapping[str, Any], logprobs: Tensor) -> tuple[Callable[..., Tensor], Tensor]:
        """(a function that lays a per-token tensor out as [B, T], the loss mask [B, T])."""
        if logprobs.dim() == 2:  # already padded [B, S]
            return (lambda x, fill=0: x), input_data["loss_mask"].bool()
        cu = input_data["cu_seqlens"]
        max_len = input_data.get("max_seqlen")
        if max_len is None:
            max_len = int((cu[1:] - cu[:-1]).max())
        n, T = logprobs.shape[0], int(max_len)

        def lay(x: Tensor, fill: float | bool = 0) -> Tensor:
            return unpack(x[:n], cu, T, fill)

        return lay, lay(input_data["loss_mask"].bool(), False)

    def batch(self, logprobs: Tensor, input_data: Mapping[str, Any], current_version: int | None) -> dict[str, Any]:
        """The ``compute_loss`` batch of one AReaL micro-batch (module docstring, point 2)."""
        lay, mask = self._padded(input_data, logprobs)
        logp = lay(logprobs)
        behav = input_data.get("logprobs")
        if behav is None:
            raise ValueError("AReaL's input_data has no 'logprobs' (the behavior log-probs of the inference engine)")
        prox = input_data.get("prox_logp")
        out: dict[str, Any] = {
            "logp": logp,
            "behav_logp": lay(behav.detach().to(logp.dtype)),
            "prox_logp": logp.detach() if prox is None else lay(prox.detach().to(logp.dtype)),
            "mask": mask,
            "advantages": lay(input_data["advantages"].detach().to(logp.dtype)),
        }
        version = current_version if current_version is not None else self.learner_version
        if input_data.get("versions") is not None and version is not None:
            out["versions"] = lay(input_data["versions"].long())
            out["learner_version"] = int(version)
        if "ref_logp" in self.needs:
            ref = input_data.get("ref_logp")
            if ref is None:
                raise ValueError(
                    f"method {self.method.name!r} needs reference log-probs: configure AReaL's reference model "
                    "(config.ref) so input_data carries 'ref_logp'"
                )
            out["ref_logp"] = lay(ref.detach().to(logp.dtype))
        return out

    # ------------------------------------------------------------------------------------------------ AReaL hooks
    def __call__(
        self, logprobs: Tensor, entropy: Tensor | None, input_data: Mapping[str, Any], *,
        current_version: int | None = None, **_: Any,
    ) -> Tensor:  # fmt: skip
        out = compute_loss(self.hosted, self.batch(logprobs, input_data, current_version), validate=False)
        if self.step_control is not None:
            self.step_control.record(out.metrics)
        keys = list(out.metrics)
        values = torch.stack([out.metrics[k].float().reshape(()) for k in keys]).tolist()
        stats_tracker.scalar(**{METRIC_PREFIX + k: v for k, v in zip(keys, values, strict=True)})
        return out.loss

    def loss_weight(self, input_data: Mapping[str, Any]) -> Tensor:
        """AReaL's ``loss_weight_fn`` matching the method's aggregation (module docstring, point 3)."""
        mask = input_data["loss_mask"].bool()
        if self.method.agg == "token-mean" and self.method.objective.type != "tic_grpo":
            return mask.count_nonzero()
        if mask.dim() == 2:
            per_seq = mask.sum(-1)
        else:
            cu = input_data["cu_seqlens"].to(device=mask.device, dtype=torch.long)
            csum = torch.nn.functional.pad(mask.long().cumsum(0), (1, 0))
            per_seq = csum[cu[1:]] - csum[cu[:-1]]
        if self.method.agg == "seq-mean-token-sum-norm" and self.method.objective.type != "tic_grpo":
            return torch.tensor(per_seq.shape[0], device=mask.device)
        return (per_seq > 0).sum()

    def __repr__(self) -> str:
        return f"steadyrl.integrations.areal.LossFn({self.method.name!r})"


class PPOActor(_ArealPPOActor):
    """AReaL's ``PPOActor`` whose update runs a steadyrl method (module docstring); everything else is AReaL's.

    Args (besides AReaL's ``config`` and ``engine``): ``method``, ``method_overrides`` as for :class:`LossFn`.
    """

    def __init__(
        self, config: Any, engine: Any, *, method: str | MethodSpec = "grpo",
        method_overrides: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.steadyrl_loss = LossFn(method, method_overrides)
        check_actor_config(config, self.steadyrl_loss.method)
        super().__init__(config, engine)

    def _ppo_update(self, data: dict[str, Any]) -> None:
        for key in ("rewards", "tot_rewards", "kl_rewards"):  # as AReaL's update: not per-token training inputs
            data.pop(key, None)
        self.engine.train()  # gradient checkpointing needs train mode
        loss = self.steadyrl_loss
        loss.learner_version = int(self.engine.get_version())
        optimizer = self.engine.optimizer
        if loss.step_control is not None and not getattr(optimizer, "_steadyrl_wrapped", False):
            model = self.engine.model
            loss.step_control.wrap(optimizer, lambda: [p for p in model.parameters() if p.requires_grad])
        mbs = split_padded_tensor_dict_into_mb_list(data, mb_spec=MicroBatchSpec(n_mbs=self.config.ppo_n_minibatches))
        with stats_tracker.scope("update"):
            for mb in mbs.mbs:
                stats = self.engine.train_batch(mb, loss_fn=loss, loss_weight_fn=loss.loss_weight)
                if loss.step_control is not None:
                    stats = {**stats, **loss.step_control.last}
                stats_tracker.scalar(**{k: v for k, v in stats.items() if math.isfinite(float(v))})


__all__ = [
    "AREAL_VERSION",
    "METRIC_PREFIX",
    "LossFn",
    "PPOActor",
    "StepControl",
    "check_actor_config",
    "needs_behavior",
    "supported",
    "unpack",
    "why_not_hosted",
]
