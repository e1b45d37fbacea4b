"""The learner step: recompute log-probs, the method's loss, controllers, AdamW; it never sees where a batch came from.

One learner step consumes one batch of rollouts (prompts_per_step × G responses with rewards) and runs
``updates_per_batch`` passes of ``minibatches`` optimizer steps over it (1 × 1 by default). Each optimizer step:

1. ``logp`` ← forward of π_θ over [prompt; response] (with gradient), at the sampler's temperature; each distinct
   prompt runs once and its G responses against its KV cache (``optim.share_prompts``, on by default);
2. ``loss, metrics = compute_loss(method, batch)`` with the batch keys the method needs (``required_inputs``);
3. a non-finite loss skips the step (no backward); otherwise ``backward``;
4. ``grad/norm`` = ‖g‖ of the raw gradient and ``grad/cos_prev`` = cos(g_t, g_{t−1}) (0 at the first step), for
   every method; a non-finite norm skips the step. g_{t−1} is one copy of the gradient, per parameter (no flat copy
   of the model), shared with GAC when GAC keeps the raw previous gradient (its default), so GAC costs no second
   copy;
5. each controller's ``before_step`` (GAC edits ``.grad``; the ESS step size scales this step's lr; either can ask to
   skip), then gradient clipping, a last finiteness check, ``optimizer.step()``, each ``after_step``.

A skipped step zeroes the gradient and leaves weights and AdamW moments untouched (metric ``train/skipped`` = 1 and a
printed reason). The proximal log-probs (``prox_logp``) are recomputed once, before the first optimizer step, when
the method asks for it (``recompute_prox``) or when the batch gets more than one optimizer step; otherwise the loss
uses π_prox = π_θ detached (VCPO's one-update setting). A-3PO (``prox_approx=loglinear``) never recomputes: its loss
interpolates π_prox from μ, π_θ and the token versions. OTB (arXiv 2602.07078) also needs Σ_v π_v² of π_prox at
each token (``sum_p2``): for it that no-grad pass always runs (:func:`~steadyrl.rollout.logprobs.proximal_logprobs`,
one extra forward per learner step when π_prox is not otherwise recomputed) and hands over ``sum_p2`` with π_prox.

Version = number of optimizer steps applied (skipped ones do not count); the lag metrics of ``compute_loss`` use it.
Metrics of the optimizer steps of one learner step are aggregated: keys ending in ``max`` by max, ``min`` by min,
``time/*`` by sum, the rest by mean.

Device and precision come from one :class:`~steadyrl.base.device.Placement` (batches are moved to its device, every
forward runs under its autocast). With ``optim.microbatch_tokens`` an optimizer step whose batch exceeds the budget
runs :mod:`steadyrl.train.microbatch`'s three passes instead of step 1's one forward: the loss still sees the whole
batch, and the accumulated gradient is the one-pass gradient (metric ``train/microbatches``); where the loss reads each
row alone, each micro-batch is forwarded once (checked every step, ``train/values_pass``).

Vocabulary terms (:mod:`steadyrl.train.vocab_terms`): a method that needs a full-vocabulary term of π_θ with gradient
(score centering's Σ_v sg(μ_v w_v) log π_θ(v), batch key ``centering``; the entropy H of an entropy bonus, batch key
``entropy``) gets it from step 1's forward (:func:`~steadyrl.rollout.logprobs.sequence_logprob_terms`, chunk by chunk
in the chunked head, at the learner's temperature), also with a critic's hidden states; with micro-batches it is
micro-batched like ``logp``. OPOB's fused gradient-norm pass computes none: with both, the norms come from a separate
ghost pass (``grad_norms=None``, the default, picks it; an explicit fused mode is refused).

Controllers that steer the loss hand it batch inputs before each optimizer step's loss
(:func:`~steadyrl.control.base.loss_inputs`): the adaptive entropy controller's coefficient ``entropy_coef``, a
tensor on the model's device that its ``before_step`` updates from the step's entropy (read to the host only with
the step's other metrics).

The optimizer is AdamW, or Muon on the hidden weight matrices and AdamW on the rest (``optim.name=muon``,
:mod:`steadyrl.train.optim`).

COPC critic (:mod:`steadyrl.train.critic`): when the method needs ``values``, step 1's forward also returns the final
hidden states, the value head turns them into V(s_t) (the batch's ``values``, detached), and the value loss
value_coef · ½ · masked mean (V − target)² (targets: COPC's V + Â of the same values) is added to the loss of step 3;
the critic's AdamW steps exactly when the policy's does. BRACE's critic (arXiv 2609.09783) also runs its critic-only
warm-up steps (the policy's optimizer does not step, the version does not advance, ``critic/warmup`` = 1) and, when
the batch gets several optimizer steps, takes V_old for its value clip from the π_prox pass (one forward for both).

Old-logit repair (``proximal``; "Missing Old Logits", arXiv 2605.12070): ``behavior_snapshot`` takes π_prox from the
lag runtime's recompute on each token's behavior version (``old_logp``); ``ewma`` from a no-grad forward of an
exponentially weighted average of the weights (PPO-EWMA), updated after every applied optimizer step and kept on the
model's device and dtype. Given ``old_logp``, the step logs ``kl/discrepancy`` and ``kl/staleness``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from steadyrl.base.device import Placement, host_values, refuse_outer_autocast, to_device
from steadyrl.config.critic import CriticConfig
from steadyrl.config.train import OptimConfig, RacConfig
from steadyrl.control.base import SKIP_STEP, Controller, grad_parts, loss_inputs, parts_like
from steadyrl.core.advantages.rac import rac_corrections
from steadyrl.core.gradient_alignment import grad_cosine
from steadyrl.core.masking import masked_mean, seq_log_ratio, where_masked
from steadyrl.core.proximal import ewma_update_, mismatch_split
from steadyrl.methods import compute_loss
from steadyrl.methods.resolve import required_inputs
from steadyrl.methods.spec import MethodSpec
from steadyrl.rollout.logprobs import proximal_logprobs, sequence_logprob_terms, sequence_logprobs
from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.scored import DelayedRewards
from steadyrl.train.critic import Critic
from steadyrl.train.grad_norms import GhostPass, GradNormMethod, chunkable_head, per_trajectory_grad_sq_norms
from steadyrl.train.microbatch import plan_microbatches, scatter_rows, take_rows
from steadyrl.train.optim import build_optimizer
from steadyrl.train.vocab_terms import VOCAB_TERMS, vocab_terms

#: How the learner gets OPOB's per-trajectory squared gradient norms: ``fused`` / ``fused_shared`` from the step's own
#: forward and one backward (:class:`~steadyrl.train.grad_norms.GhostPass`), or a separate pass of
#: :func:`~steadyrl.train.grad_norms.per_trajectory_grad_sq_norms` with that method before the usual forward/backward.
#: The default (``grad_norms=None``) is ``fused_shared`` when ``optim.share_prompts`` is on (the default), else
#: ``fused``.
GradNormsMode = Literal["fused", "fused_shared"] | GradNormMethod
#: The fused modes (the norms from the step's own forward); ``fused_shared`` runs that forward with each distinct prompt
#: once (:class:`~steadyrl.train.grad_norms.GhostPass` ``share_prompts=True``: fewer forward FLOPs, one prompt backward
#: per response rank; the same norms and gradient up to float rounding); ``fused`` forwards every row's prompt.
FUSED_MODES: tuple[str, ...] = ("fused", "fused_shared")


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward (``optim.activation_checkpointing``).

    transformers' gradient checkpointing, non-reentrant (``use_reentrant=False``): it works with
    ``torch.autograd.grad``, so with the fused OPOB/VCPO gradient-norm pass too (:mod:`steadyrl.train.grad_norms`).
    Active only in training mode (the sampler's eval-mode copy decodes with its KV cache as before).
    """
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if not callable(enable) or not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"optim.activation_checkpointing: {type(model).__name__} does not support gradient checkpointing "
            "(a transformers model with supports_gradient_checkpointing is needed); set it to false"
        )
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class LearnerOutput(NamedTuple):
    """What one learner step did: aggregated metrics (plain floats), optimizer steps applied and skipped, why."""

    metrics: dict[str, float]
    applied: int
    skipped: int
    reasons: list[str]


def aggregate_metrics(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Combine per-optimizer-step metrics: ``*max`` → max, ``*min`` → min, ``time/*`` → sum, else mean."""
    keys = sorted({k for s in steps for k in s})
    out: dict[str, float] = {}
    for key in keys:
        values = [s[key] for s in steps if key in s]
        if key.endswith("max"):
            out[key] = max(values)
        elif key.endswith("min"):
            out[key] = min(values)
        elif key.startswith("time/"):
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def group_minibatches(group_ids: Tensor, n: int) -> list[Tensor]:
    """Row indices of ``n`` minibatches that keep each group whole (groups in order, split into n equal runs)."""
    groups = torch.unique(group_ids)
    if groups.numel() % n:
        raise ValueError(f"{groups.numel()} groups cannot be split into {n} equal minibatches")
    return [torch.isin(group_ids, chunk).nonzero().flatten() for chunk in groups.chunk(n)]


class Learner:
    """π_θ, AdamW, the method's loss and controllers; :meth:`step` runs one learner step on a batch of rollouts."""

    def __init__(
        self,
        *,
        model: nn.Module,
        method: MethodSpec,
        controllers: Sequence[Controller],
        lr: float,
        optim: OptimConfig,
        temperature: float = 1.0,
        ref_model: nn.Module | None = None,
        log: Callable[[str], None] = print,
        grad_norms: GradNormsMode | None = None,
        critic: CriticConfig | None = None,
        placement: Placement | None = None,
        proximal: Literal["current", "behavior_snapshot", "ewma"] = "current",
        proximal_beta: float = 0.9,
        rac: RacConfig | None = None,
    ) -> None:
        self.model = model
        self.rac = rac or RacConfig()
        """Retroactive Advantage Correction of the rows whose late reward arrives (``step(..., delayed=)``)."""
        self.method = method
        self.controllers = list(controllers)
        self.lr = lr
        self.optim_cfg = optim
        self.temperature = temperature
        self.ref_model = ref_model
        self.log = log
        self.needs = set(required_inputs(method))
        if "ref_logp" in self.needs and ref_model is None:
            raise ValueError(f"method {method.name!r} has a reference KL term: pass ref_model")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.placement = placement or Placement(device=self.params[0].device)
        """Device of every batch tensor and the autocast of every forward (steadyrl.base.device)."""
        if optim.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.optimizer = build_optimizer(model, self.params, lr=lr, cfg=optim)  # AdamW, or Muon + AdamW
        self.version = 0
        self._prox_version: int | None = None  # version at which this step's π_prox was recomputed (None: not)
        self._prev_grad: list[Tensor] | None = None
        self._speculate = True  # micro-batches skip their values pass until a step finds the loss mixing rows
        # a controller that keeps the previous raw gradient anyway (GAC with prev="raw"): no second copy
        self._prev_keeper = next((c for c in self.controllers if getattr(c, "keeps_raw_prev", False)), None)
        self.term_keys = tuple(k for k in self.needs if k in VOCAB_TERMS)
        """Batch keys computed as vocabulary terms in the forward of ``logp`` (:mod:`steadyrl.train.vocab_terms`)."""
        if grad_norms is None:  # fused (on the shared-prompt forward when the learner shares prompts), unless a
            # vocabulary term needs the forward the fused pass would take
            fused = "fused_shared" if optim.share_prompts else "fused"
            grad_norms = "ghost" if self.term_keys and "grad_sq_norms" in self.needs else fused
        self.grad_norms: GradNormsMode = grad_norms
        if self.term_keys and "grad_sq_norms" in self.needs and grad_norms in FUSED_MODES:
            raise ValueError(
                f"method {method.name!r} needs vocabulary terms ({', '.join(self.term_keys)}) from the forward of "
                f"logp, and OPOB's per-trajectory gradient norms from the same forward (grad_norms={grad_norms!r}), "
                "whose fused pass computes no vocabulary term: use grad_norms='ghost' (a separate pass), or drop one"
            )
        # COPC's value head and its AdamW: only when the method's advantage needs critic values
        self.critic: Critic | None = None
        if "values" in self.needs:
            size = int(model.config.hidden_size)
            self.critic = Critic(size, critic or CriticConfig(), device=self.params[0].device, method=method)
        # old-logit repair (arXiv 2605.12070): π_prox from the behavior snapshot, or PPO-EWMA weights
        if proximal != "current" and (method.policy == "bypass" or method.prox_approx != "none"):
            raise ValueError(
                f"proximal={proximal} sets π_prox, but method {method.name!r} does not use a recomputed π_prox "
                f"(policy={method.policy}, prox_approx={method.prox_approx}): use proximal=current with it"
            )
        if not 0 <= proximal_beta < 1:
            raise ValueError(f"proximal_beta must lie in [0, 1) (got {proximal_beta})")
        self.proximal = proximal
        self.proximal_beta = proximal_beta
        self.ewma: nn.Module | None = None
        """proximal=ewma: the EWMA of the weights (a copy of the model on its device and dtype, no gradient)."""
        self.ewma_weight = 1.0  # W of the recursion: θ_ewma = θ_0 counts as the first iterate
        if proximal == "ewma":
            self.ewma = copy.deepcopy(model).eval().requires_grad_(False)

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Optimizer, version, previous gradient and controller states, whether micro-batches still skip their values
        pass (the model's weights are saved apart)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "speculate": self._speculate,
            "prev_grad": self._prev_grad,
            "controllers": [c.state_dict() for c in self.controllers],
            "critic": None if self.critic is None else self.critic.state_dict(),
            **({} if self.ewma is None else {"ewma": {"weight": self.ewma_weight, "state": self.ewma.state_dict()}}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, every tensor onto the learner's device (a checkpoint is read to the CPU, a
        rollback snapshot is held there; the optimizer moves its own state to its parameters' devices)."""
        device = self.placement.device
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self._speculate = bool(state.get("speculate", True))  # absent from checkpoints written before it existed
        self._prev_grad = parts_like(to_device(state["prev_grad"], device), self.params)
        for controller, cstate in zip(self.controllers, state["controllers"], strict=True):
            controller.load_state_dict(to_device(cstate, device))
        if self.critic is not None:
            self.critic.load_state_dict(to_device(state["critic"], device))
        if self.ewma is not None:
            self.ewma.load_state_dict(state["ewma"]["state"])
            self.ewma_weight = float(state["ewma"]["weight"])

    @property
    def prev_grad(self) -> list[Tensor] | None:
        """g_{t−1}, the previous step's raw gradient, one tensor per parameter (None before the first step); the
        copy a controller keeps (GAC's) when it keeps one."""
        return self._prev_keeper.prev_grad if self._prev_keeper is not None else self._prev_grad

    # -------------------------------------------------------------------------------------------------- step
    def scheduled_lr(self) -> float:
        """lr after linear warm-up over ``optim.warmup_steps`` optimizer steps."""
        warmup = self.optim_cfg.warmup_steps
        return self.lr * min(1.0, (self.version + 1) / warmup) if warmup else self.lr

    def step(
        self, rollouts: Rollouts, rewards: Tensor, *, old_logp: Tensor | None = None,
        delayed: DelayedRewards | None = None,
    ) -> LearnerOutput:  # fmt: skip
        """One learner step on ``rollouts`` (N rows) with ``rewards`` ``[N]``; returns its aggregated metrics.

        ``delayed``: earlier rows whose true reward arrived now; their RAC correction (:meth:`_rac_backward`) joins
        the gradient of this step's first optimizer step (``rac.enabled``).

        ``old_logp`` [N, T]: π_old^train, the log-probs under each token's behavior version (the lag runtime's
        recompute): π_prox under ``proximal=behavior_snapshot`` (required then), and with any proximal the source of
        ``kl/discrepancy`` and ``kl/staleness``.
        """
        device = self.placement.device
        refuse_outer_autocast(device, "Learner.step", "it runs each forward under its placement's autocast itself")
        self.model.train()
        rollouts, rewards = rollouts.to(device), rewards.to(device)
        old_logp = None if old_logp is None else old_logp.to(device)
        n_updates = self.optim_cfg.updates_per_batch * self.optim_cfg.minibatches
        prox = sum_p2 = old_values = None
        self._prox_version = None
        # A-3PO (prox_approx=loglinear) approximates π_prox inside the loss: no recompute pass, however many updates;
        # the old-logit repairs bring their own π_prox
        recompute = self.method.prox_approx == "none" and (self.method.recompute_prox or n_updates > 1)
        recompute = recompute and self.proximal == "current"
        if "sum_p2" in self.needs:  # OTB: Σ_v π_v² of π_prox, from the pass that also gives π_prox
            logp_all, sum_p2 = self._no_grad(
                rollouts, lambda mb: proximal_logprobs(self.model, mb, temperature=self.temperature)
            )
            if recompute:
                prox, self._prox_version = logp_all, self.version
        elif recompute and self.critic is not None and self.critic.brace is not None:  # V_old with π_prox
            prox, old_values = self._no_grad(rollouts, self._logp_and_values)
            self._prox_version = self.version
        elif recompute:
            (prox,) = self._no_grad(rollouts, lambda mb: (self._logp(self.model, mb),))
            self._prox_version = self.version
        if self.proximal == "behavior_snapshot":
            if old_logp is None:
                raise ValueError(
                    "proximal=behavior_snapshot needs each token's log-prob under its behavior version's weights "
                    "(old_logp), which the lag runtime records (runtime.mode=lag)"
                )
            prox = old_logp
        elif self.ewma is not None:
            ewma = self.ewma
            (prox,) = self._no_grad(rollouts, lambda mb: (self._logp(ewma, mb),))
        ref = None
        if "ref_logp" in self.needs and self.ref_model is not None:
            ref_model = self.ref_model
            (ref,) = self._no_grad(rollouts, lambda mb: (self._logp(ref_model, mb),))
        minibatches = group_minibatches(rollouts.group_ids, self.optim_cfg.minibatches)
        per_step: list[dict[str, float]] = []
        reasons: list[str] = []
        applied = 0
        rac = delayed if delayed is not None and self.rac.enabled else None
        for _ in range(self.optim_cfg.updates_per_batch):
            for rows in minibatches:
                whole = len(minibatches) == 1
                sub = rollouts if whole else rollouts.select(rows)
                T = sub.response_ids.shape[1]
                extras = {
                    "prox_logp": None if prox is None else (prox if whole else prox[rows][:, :T]),
                    "ref_logp": None if ref is None else (ref if whole else ref[rows][:, :T]),
                    "sum_p2": None if sum_p2 is None else (sum_p2 if whole else sum_p2[rows][:, :T]),
                    _OLD_VALUES: None if old_values is None else (old_values if whole else old_values[rows][:, :T]),
                    _OLD_LOGP: None if old_logp is None else (old_logp if whole else old_logp[rows][:, :T]),
                }
                metrics, reason = self._optimizer_step(sub, rewards if whole else rewards[rows], extras, rac=rac)
                rac = None  # the correction is applied once, at the step's first optimizer step
                per_step.append(metrics)
                if reason is None:
                    applied += 1
                else:
                    reasons.append(reason)
        out = aggregate_metrics(per_step)
        return LearnerOutput(out, applied, len(reasons), reasons)

    # ------------------------------------------------------------------------------------------ micro-batches
    def _plan(self, batch: Rollouts) -> list[Tensor] | None:
        """Row sets of the micro-batches of ``batch`` (None: one pass, no ``microbatch_tokens`` or it all fits)."""
        budget = self.optim_cfg.microbatch_tokens
        N, width = batch.prompt_ids.shape[0], batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
        if budget is None or N * width <= budget:
            return None
        plan = plan_microbatches(batch, budget)
        return None if len(plan) == 1 else plan

    def _norm_plan(self, batch: Rollouts) -> list[Tensor] | None:
        """Row sets for OPOB's norm pass when it would hold more than ``optim.norm_pass_logits`` logits (None: the
        step's own plan does).

        Where the chunked head fits the model, the ghost pass forms the output layer's part of each norm over
        vocabulary chunks (:class:`~steadyrl.train.grad_norms.GhostPass`) and holds no logits: no split. Elsewhere it
        records the output layer's call, so its forward holds the layer's whole ``[n, T, V]`` output and gradient;
        past the budget (rows × width × V, width = prompt + response positions) the pass then runs per
        micro-batch, as under ``optim.microbatch_tokens``, while the rest of the step keeps its own plan.
        """
        if "grad_sq_norms" not in self.needs or self.grad_norms not in (*FUSED_MODES, "ghost"):
            return None
        with self.placement.autocast():  # as where the pass runs (a plain float32 head under autocast does not split)
            if chunkable_head(self.model, batch.response_ids.device) is not None:
                return None
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if head is None:
            return None
        budget = max(1, self.optim_cfg.norm_pass_logits // int(head.weight.shape[0]))
        user = self.optim_cfg.microbatch_tokens
        N, width = batch.prompt_ids.shape[0], batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
        if N * width <= budget or (user is not None and user <= budget):
            return None
        return plan_microbatches(batch, budget)

    @contextlib.contextmanager
    def _forward_context(self, *, grad: bool) -> Iterator[None]:
        with torch.set_grad_enabled(grad), self.placement.autocast():
            yield

    def _no_grad(self, batch: Rollouts, compute: Callable[[Rollouts], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
        """``compute(batch)`` without gradient, micro-batched when ``optim.microbatch_tokens`` asks for it."""
        plan = self._plan(batch)
        with self._forward_context(grad=False):
            if plan is None:
                return compute(batch)
            parts = [(rows, compute(batch.select(rows))) for rows in plan]
        like = torch.zeros(batch.response_ids.shape, dtype=parts[0][1][0].dtype, device=batch.response_ids.device)
        n_out = len(parts[0][1])
        return tuple(scatter_rows([(rows, out[k]) for rows, out in parts], like=like) for k in range(n_out))

    def _logp_and_values(self, batch: Rollouts) -> tuple[Tensor, Tensor]:
        """log π and the critic's V(s_t) of ``batch`` from one forward (BRACE's π_prox and V_old)."""
        assert self.critic is not None
        out = sequence_logprobs(self.model, batch, temperature=self.temperature, return_hidden=True,
                                share_prompts=self.optim_cfg.share_prompts)  # fmt: skip
        return out.logp, self.critic.values(out.hidden, batch.response_mask).detach()  # type: ignore[arg-type]

    def _logp(self, model: nn.Module, batch: Rollouts) -> Tensor:
        share = self.optim_cfg.share_prompts
        return sequence_logprobs(model, batch, temperature=self.temperature, share_prompts=share).logp

    def _batch(
        self, sub: Rollouts, rewards: Tensor, extras: Mapping[str, Tensor | None], logp: Tensor,
        grad_sq_norms: Tensor | None = None,
    ) -> dict:  # fmt: skip
        batch: dict[str, Any] = {
            "logp": logp,
            "behav_logp": sub.behav_logp,
            "mask": sub.response_mask,
            "rewards": rewards,
            "group_ids": sub.group_ids,
            "versions": sub.versions,
            "learner_version": self.version,
        }
        for key, value in extras.items():
            if value is not None and key not in (_OLD_VALUES, _OLD_LOGP):
                batch[key] = value
        batch |= loss_inputs(self.controllers, logp.device)  # the adaptive entropy coefficient of this step
        if "behav_entropy" in self.needs:
            if sub.behav_entropy is None:
                raise ValueError(f"method {self.method.name!r} needs behav_entropy: sample with record_entropy=True")
            batch["behav_entropy"] = sub.behav_entropy
        if grad_sq_norms is not None:  # OPOB: ‖∇_θ log π_θ(y_i)‖² per trajectory
            batch["grad_sq_norms"] = grad_sq_norms
        return batch

    def _forward(self, sub: Rollouts) -> tuple[Tensor, Tensor | None, GhostPass | None, dict[str, Tensor]]:
        """(logp for the loss, per-trajectory squared gradient norms if the method needs them, the fused pass, the
        method's vocabulary terms from the same forward)."""
        if self.term_keys:
            norms = None
            if "grad_sq_norms" in self.needs:  # a separate pass (the fused one computes no vocabulary term)
                norms = self._separate_norms(sub)
            terms = vocab_terms(self.method, self.term_keys, sub)
            out = sequence_logprob_terms(
                self.model, sub, terms=terms, temperature=self.temperature, share_prompts=self.optim_cfg.share_prompts
            )
            return out.logp, norms, None, out.terms
        logp, norms, ghost = self._plain_forward(sub)
        return logp, norms, ghost, {}

    def _plain_forward(self, sub: Rollouts) -> tuple[Tensor, Tensor | None, GhostPass | None]:
        if "grad_sq_norms" not in self.needs:
            return self._logp(self.model, sub), None, None
        if self.grad_norms not in FUSED_MODES:  # a separate pass first (the benchmark's reference points)
            return self._logp(self.model, sub), self._separate_norms(sub), None
        share = self.grad_norms == "fused_shared"
        ghost = GhostPass(self.model, sub, temperature=self.temperature, share_prompts=share)
        # The loss sees a leaf copy of logp: its gradient ∂L/∂logp decides how the fused pass forms ∇θ L.
        return ghost.logp.detach().requires_grad_(), ghost.sq_norms(), ghost

    def _separate_norms(self, batch: Rollouts) -> Tensor:
        """OPOB's norms from a pass of their own (``grad_norms`` ``ghost``, ``vmap`` or ``naive``); ``ghost`` shares
        prompts as the learner's forward does."""
        return per_trajectory_grad_sq_norms(self.model, batch, method=self.grad_norms,  # type: ignore[arg-type]
                                            temperature=self.temperature,
                                            share_prompts=self.optim_cfg.share_prompts)  # fmt: skip

    @staticmethod
    def _fused_backward(ghost: GhostPass, loss: Tensor, logp: Tensor, mask: Tensor) -> bool:
        """∇θ L into ``.grad`` from the fused pass; True when one backward sufficed (sequence-constant ∂L/∂logp).

        With a_{i,t} = ∂L/∂logp_{i,t}: if a is constant along each trajectory's masked tokens (VCPO), ∇θ L =
        Σ_i a_i ∇θ Σ_t log π(y_{i,t}) is assembled from the stored per-sample pieces; otherwise a is backpropagated
        through the kept graph (one more backward).
        """
        (a,) = torch.autograd.grad(loss, logp, allow_unused=True)
        if a is None:
            return True
        m = mask.bool()
        c = torch.where(m, a, torch.zeros_like(a)).sum(-1) / m.sum(-1).clamp(min=1)  # a_i: the row's mean
        spread = torch.where(m, (a - c.unsqueeze(-1)).abs(), torch.zeros_like(a)).amax()
        if bool(spread <= 1e-6 * a.abs().amax().clamp(min=torch.finfo(a.dtype).tiny)):
            ghost.accumulate_grad(c)
            return True
        ghost.backward(a)
        return False

    def _skip(self, reason: str) -> str:
        self.optimizer.zero_grad(set_to_none=True)
        self.log(f"[steadyrl train] step skipped at version {self.version}: {reason}")
        return reason

    def _loss(
        self, sub: Rollouts, rewards: Tensor, extras: Mapping[str, Tensor | None], logp: Tensor,
        norms: Tensor | None, hidden: Tensor | None,
    ) -> tuple[Tensor, Mapping[str, Tensor], dict[str, Tensor]]:  # fmt: skip
        """The method's loss on the batch (plus COPC's value loss), its raw metrics and the step's metrics, all
        detached tensors (read to the host once, in :meth:`_optimizer_step`)."""
        batch = self._batch(sub, rewards, extras, logp, norms)
        critic = None
        if self.critic is not None and hidden is not None:  # V(s_t) joins the batch (detached), L_V the loss
            critic = self.critic.terms(
                method=self.method, batch=batch, hidden=hidden, old_values=extras.get(_OLD_VALUES)
            )
            batch["values"] = critic.values
        loss, loss_metrics = compute_loss(self.method, batch, validate=False)
        metrics = {k: v.detach() for k, v in loss_metrics.items()}
        if critic is not None:
            metrics |= {k: v.detach() for k, v in critic.metrics.items()}
        if norms is not None:
            metrics["grad/per_traj_norm_mean"] = norms.detach().clamp(min=0).sqrt().mean()  # mean_i ‖∇θ log π(y_i)‖
            if "adv/baseline_mean" in metrics:
                metrics["vcpo/baseline_mean"] = metrics["adv/baseline_mean"]
        old = extras.get(_OLD_LOGP)
        if old is not None:  # π/μ = [π_old^train/μ]·[π/π_old^train]: discrepancy and staleness (arXiv 2605.12070)
            prox = extras.get("prox_logp")
            # staleness against the loss's π_prox, or the current policy when π_prox is the behavior snapshot itself
            against = logp.detach() if prox is None or self.proximal == "behavior_snapshot" else prox
            metrics |= mismatch_split(behav_logp=sub.behav_logp, old_logp=old, prox_logp=against,
                                      mask=sub.response_mask)  # fmt: skip
        metrics["loss"] = loss.detach()
        if critic is not None:  # one backward for actor and critic; a non-finite value loss skips the step too
            loss = loss + critic.loss
        return loss, loss_metrics, metrics

    def _full_backward(
        self, sub: Rollouts, rewards: Tensor, extras: Mapping[str, Tensor | None]
    ) -> tuple[Mapping[str, Tensor], dict[str, Tensor], dict[str, float], Tensor]:
        """One forward with grad over the whole (mini)batch and its backward (also for a non-finite loss: the step
        is then skipped, and nothing was read to the host to find out sooner); returns the loss's metrics, the
        step's tensor metrics, its host-side metrics and the loss."""
        hidden = None
        with self._forward_context(grad=True):
            if self.critic is None:
                logp, norms, ghost, terms = self._forward(sub)
            else:  # COPC: logp, the final hidden states and any vocabulary term from one forward (no OPOB norms)
                logp, hidden, terms = self._micro_forward(sub, return_hidden=True)
                norms, ghost = None, None
            extras = {**extras, **terms}
        host: dict[str, float] = {}
        try:
            loss, loss_metrics, metrics = self._loss(sub, rewards, extras, logp, norms, hidden)
            if ghost is None:
                loss.backward()
            else:
                host["grad/fused"] = float(self._fused_backward(ghost, loss, logp, sub.response_mask))
        finally:
            if ghost is not None:
                ghost.close()
        return loss_metrics, metrics, host, loss.detach()

    def _micro_forward(self, mb: Rollouts, *, return_hidden: bool = False) -> tuple[Tensor, Tensor | None, dict]:
        """(logp, hidden states or None, vocabulary terms) of one micro-batch, with the step's forward options."""
        share = self.optim_cfg.share_prompts
        if self.term_keys:
            terms = vocab_terms(self.method, self.term_keys, mb)
            out = sequence_logprob_terms(self.model, mb, terms=terms, temperature=self.temperature, share_prompts=share,
                                         return_hidden=return_hidden)  # fmt: skip
            return out.logp, out.hidden, out.terms
        scored = sequence_logprobs(self.model, mb, temperature=self.temperature, return_hidden=return_hidden,
                                   share_prompts=share)  # fmt: skip
        return scored.logp, scored.hidden if return_hidden else None, {}

    def _micro_values(
        self, sub: Rollouts, plan: Sequence[Tensor], extras: Mapping[str, Tensor | None]
    ) -> tuple[Tensor, Tensor | None, Tensor | None, dict[str, Tensor]]:
        """Step 1 of :mod:`steadyrl.train.microbatch`: logp (and OPOB norms, COPC hidden states, the method's
        vocabulary terms), no graph kept."""
        wants_norms, wants_hidden = "grad_sq_norms" in self.needs, self.critic is not None
        prox = extras.get("prox_logp")
        if self._values_are_prox(extras):
            assert prox is not None
            return prox.clone(), None, None, {}  # π_prox was just recomputed with these weights: the same values
        logps, norms, hiddens = [], [], []
        term_parts: dict[str, list[tuple[Tensor, Tensor]]] = {k: [] for k in self.term_keys}
        for rows in plan:
            mb = sub.select(rows)
            if wants_norms:
                if self.grad_norms in FUSED_MODES:
                    share = self.grad_norms == "fused_shared"
                    with (
                        self._forward_context(grad=True),
                        GhostPass(self.model, mb, temperature=self.temperature, share_prompts=share) as g,
                    ):
                        norms.append((rows, g.sq_norms()))
                        logps.append((rows, g.logp.detach()))
                    continue
                with self._forward_context(grad=True):
                    n = self._separate_norms(mb)
                norms.append((rows, n.detach()))
            with self._forward_context(grad=False):
                mb_logp, mb_hidden, mb_terms = self._micro_forward(mb, return_hidden=wants_hidden)
            logps.append((rows, mb_logp))
            if wants_hidden:
                hiddens.append((rows, mb_hidden))
            for key, value in mb_terms.items():
                term_parts[key].append((rows, value))
        N, T = sub.response_ids.shape
        logp = scatter_rows(logps, like=torch.zeros(N, T, dtype=logps[0][1].dtype, device=sub.response_ids.device))
        terms = {k: scatter_rows(parts, like=torch.zeros_like(logp)) for k, parts in term_parts.items()}
        norm = None
        if norms:
            norm = scatter_rows(norms, like=torch.zeros(N, dtype=norms[0][1].dtype, device=logp.device))
        hidden = None
        if hiddens:
            H = hiddens[0][1].shape[-1]
            hidden = scatter_rows(hiddens, like=torch.zeros(N, T, H, dtype=hiddens[0][1].dtype, device=logp.device))
        return logp, norm, hidden, terms

    def _micro_backward(
        self, sub: Rollouts, rewards: Tensor, extras: Mapping[str, Tensor | None], plan: Sequence[Tensor], *,
        values_plan: Sequence[Tensor] | None = None,
    ) -> tuple[Mapping[str, Tensor], dict[str, Tensor], dict[str, float], Tensor]:  # fmt: skip
        """Steps 2–3 of :mod:`steadyrl.train.microbatch`: the full-batch loss on leaf log-probs, then per
        micro-batch ``backward(∂L/∂logp)`` (and ∂L/∂hidden for a critic that trains the trunk); returns as
        :meth:`_full_backward`. ``values_plan``: step 1's own row sets (OPOB's norm pass, :meth:`_norm_plan`);
        None: ``plan``."""
        logp_values, norms, hidden_values, term_values = self._micro_values(sub, values_plan or plan, extras)
        logp = logp_values.requires_grad_()
        hidden = None if hidden_values is None else hidden_values.requires_grad_()
        terms = {k: v.requires_grad_() for k, v in term_values.items()}
        loss, loss_metrics, metrics = self._loss(sub, rewards, {**extras, **terms}, logp, norms, hidden)
        reused = values_plan is None and self._values_are_prox(extras)
        host = {"train/microbatches": float(len(plan)), "train/values_pass": 0.0 if reused else 1.0}
        if values_plan is not None:
            host["train/norm_microbatches"] = float(len(values_plan))
        loss.backward()  # ∂L/∂logp, ∂L/∂hidden, ∂L/∂term into the leaves; the critic head's own gradient into .grad
        a, gh = logp.grad, None if hidden is None else hidden.grad
        g_terms = {k: v.grad for k, v in terms.items() if v.grad is not None}
        if a is None and gh is None and not g_terms:
            return loss_metrics, metrics, host, loss.detach()
        for rows in plan:
            mb = sub.select(rows)
            width = mb.response_ids.shape[1]
            with self._forward_context(grad=True):
                mb_logp, mb_hidden, mb_terms = self._micro_forward(mb, return_hidden=gh is not None)
            tensors, grads = [], []
            if a is not None:
                tensors.append(mb_logp)
                grads.append(take_rows(a, rows, width))
            if gh is not None and mb_hidden is not None:
                tensors.append(mb_hidden)
                grads.append(take_rows(gh, rows, width).to(mb_hidden.dtype))
            for key, g in g_terms.items():
                tensors.append(mb_terms[key])
                grads.append(take_rows(g, rows, width).to(mb_terms[key].dtype))
            torch.autograd.backward(tensors, grads)
        return loss_metrics, metrics, host, loss.detach()

    def _reads_log_probs_only(self) -> bool:
        """Whether the loss reads nothing from the forward but log-probs (no OPOB norms, critic hidden states or
        vocabulary terms)."""
        return "grad_sq_norms" not in self.needs and self.critic is None and not self.term_keys

    def _values_are_prox(self, extras: Mapping[str, Tensor | None]) -> bool:
        """Whether step 1's values are π_prox's, just recomputed with these weights (step 1 is free then)."""
        prox = extras.get("prox_logp")
        return prox is not None and self._prox_version == self.version and self._reads_log_probs_only()

    def _speculates(self, extras: Mapping[str, Tensor | None], values_plan: Sequence[Tensor] | None) -> bool:
        """Whether the micro-batches may skip step 1 (:meth:`_speculative_backward`): the loss reads log-probs and
        vocabulary terms only (no OPOB norms, no critic hidden states), step 1 is not free anyway, and no earlier step
        of this learner found its loss mixing rows."""
        return (self._speculate and values_plan is None and "grad_sq_norms" not in self.needs
                and self.critic is None and not self._values_are_prox(extras))  # fmt: skip

    def _speculative_backward(
        self, sub: Rollouts, rewards: Tensor, extras: Mapping[str, Tensor | None], plan: Sequence[Tensor]
    ) -> tuple[Mapping[str, Tensor], dict[str, Tensor], dict[str, float], Tensor, _Speculation]:
        """Steps 1–3 of :mod:`steadyrl.train.microbatch` with one forward per micro-batch instead of two.

        Micro-batch k's forward (with grad) gives its log-probs (and vocabulary terms); the loss is taken on the
        whole batch with the values known so far (the rows not forwarded yet hold μ's log-probs and terms of 0), and
        a_k = ∂L/∂logp (and ∂L/∂term) at its rows is backpropagated at once. When no row's a depends on another
        row's values (GRPO, sequence TIS with the ESS step size, an entropy bonus, ...), a_k equals step 2's a at
        those rows, so the gradient is the two-pass one. The loss is then taken once more with every true value (its
        metrics, and step 2's a), and the two are compared element by element; the comparison is read to the host
        with the step's loss (:meth:`_optimizer_step`), and where a micro-batch's a_k differs, :meth:`_correct`
        backpropagates the difference (exact by linearity) and this learner runs step 1 from then on. Returns as
        :meth:`_micro_backward`, and the check.
        """
        mask = sub.response_mask.bool()
        values: dict[str, Tensor] = {}  # _LOGP and each vocabulary term: [N, T], the values known so far
        used: list[tuple[Tensor, dict[str, Tensor]]] = []
        for rows in plan:
            mb = sub.select(rows)
            width = mb.response_ids.shape[1]
            with self._forward_context(grad=True):
                mb_logp, _, mb_terms = self._micro_forward(mb)
            outputs = {_LOGP: mb_logp, **mb_terms}
            if not values:  # the rows not forwarded yet: their behavior log-probs, terms of 0
                values = {key: torch.zeros(mask.shape, dtype=out.dtype, device=out.device)
                          for key, out in outputs.items()}  # fmt: skip
                values[_LOGP] = torch.where(mask, sub.behav_logp.to(mb_logp.dtype), values[_LOGP])
            for key, out in outputs.items():
                values[key][rows, :width] = out.detach()
            grads = self._leaf_grads(sub, rewards, extras, {k: v.clone() for k, v in values.items()}, quiet=True)[0]
            a_mb = {key: take_rows(g, rows, width) for key, g in grads.items()}
            torch.autograd.backward([outputs[k] for k in a_mb], [g.to(outputs[k].dtype) for k, g in a_mb.items()])
            used.append((rows, a_mb))
        a, loss, loss_metrics, metrics = self._leaf_grads(sub, rewards, extras, values, quiet=False)
        differs = torch.stack([torch.stack([_differs(take_rows(a[k], rows, g.shape[1]), g) for k, g in a_mb.items()])
                               .any() for rows, a_mb in used])  # fmt: skip
        host = {"train/microbatches": float(len(plan)), "train/values_pass": 0.0}
        return loss_metrics, metrics, host, loss, _Speculation(sub=sub, used=used, a=a, differs=differs)

    def _leaf_grads(
        self, sub: Rollouts, rewards: Tensor, extras: Mapping[str, Tensor | None], values: dict[str, Tensor], *,
        quiet: bool,
    ) -> tuple[dict[str, Tensor], Tensor, Mapping[str, Tensor], dict[str, Tensor]]:  # fmt: skip
        """(∂L/∂logp and ∂L/∂term at ``values`` (keys :data:`_LOGP` and the vocabulary terms), the loss, its metrics,
        the step's metrics): the method's loss on leaves; no parameter's ``.grad`` changes. ``quiet``: the loss's
        warnings are not shown (a speculative evaluation; the final one shows them)."""
        leaves = {key: v.requires_grad_() for key, v in values.items()}
        terms = {key: v for key, v in leaves.items() if key != _LOGP}
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("ignore")
            loss, loss_metrics, metrics = self._loss(sub, rewards, {**extras, **terms}, leaves[_LOGP], None, None)
        grads = (torch.autograd.grad(loss, list(leaves.values()), allow_unused=True) if loss.requires_grad
                 else (None,) * len(leaves))  # fmt: skip
        out = {key: torch.zeros_like(v) if g is None else g for (key, v), g in zip(leaves.items(), grads, strict=True)}
        return out, loss.detach(), loss_metrics, metrics

    def _correct(self, speculation: _Speculation) -> None:
        """Backpropagate a − a_k through every micro-batch whose speculative a_k differed from step 2's a, and run
        step 1 from now on (this method's loss mixes rows)."""
        self._speculate = False
        self.log("[steadyrl] this method's loss mixes rows' log-probs: micro-batches run their values pass from now "
                 "on (optim.microbatch_tokens)")  # fmt: skip
        sub = speculation.sub
        for (rows, a_mb), wrong in zip(speculation.used, speculation.differs.tolist(), strict=True):
            if not wrong:
                continue
            mb = sub.select(rows)
            with self._forward_context(grad=True):
                mb_logp, _, mb_terms = self._micro_forward(mb)
            outputs = {_LOGP: mb_logp, **mb_terms}
            fixes = [(take_rows(speculation.a[k], rows, g.shape[1]) - g).to(outputs[k].dtype) for k, g in a_mb.items()]
            torch.autograd.backward([outputs[k] for k in a_mb], fixes)

    def _rac_backward(self, delayed: DelayedRewards) -> dict[str, Tensor]:
        """RAC (arXiv 2606.27580) on the rows whose true reward arrived: c_i from r_slow, b and the sequence ratio
        π_θ(y_i)/μ(y_i) of the current policy (π_{t+Δ}), then the gradient of

            L_RAC = −masked token mean_{i,t} c_i · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})]     (= −c_i ∇ log π_θ(y_i))

        into ``.grad`` (added to this optimizer step's gradient). A_partial was applied when the rows were trained
        on, so this update carries c_i alone: together the two updates apply A_partial + c (our reading of
        A_total = A_partial + c for a batch that is no longer in memory). Returns the ``rac/*`` metrics."""
        rows = delayed.rollouts.to(self.placement.device)
        mask = rows.response_mask
        with self._forward_context(grad=True):
            logp = self._logp(self.model, rows)
        log_ratio = seq_log_ratio(where_masked(logp.detach() - rows.behav_logp, mask), mask)  # log π_{t+Δ}(y)/μ(y)
        out = rac_corrections(
            slow_rewards=delayed.slow.to(logp.device), fast_rewards=delayed.fast.to(logp.device),
            log_ratio=log_ratio, age=torch.full_like(log_ratio, float(delayed.age)), valid=mask.any(dim=-1),
            alpha=self.rac.alpha, tau_age=self.rac.tau_age, rho_bar=self.rac.rho_bar, max_abs=self.rac.max_abs,
        )  # fmt: skip
        surrogate = torch.exp(logp - logp.detach())  # 1 in value, ∇ log π in gradient
        loss = -masked_mean(where_masked(out.corrections.unsqueeze(-1).to(logp.dtype) * surrogate, mask), mask)
        loss.backward()
        rows_n = torch.tensor(float(len(rows)), device=logp.device)
        return {**out.metrics, "rac/loss": loss.detach(), "rac/rows": rows_n}

    def _optimizer_step(
        self, sub: Rollouts, rewards: Tensor, extras: Mapping[str, Tensor | None], *,
        rac: DelayedRewards | None = None,
    ) -> tuple[dict[str, float], str | None]:  # fmt: skip
        """One optimizer step, with two reads to the host (three with VCPO's ESS step size, which sets a Python lr):
        the loss and the gradient norm (whether to go on), then every metric with the post-clip norm and the
        controllers' decision (whether to step)."""
        lr = self.scheduled_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's groups: their own lr (steadyrl.train.optim)
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.zero_grad()
        plan, norm_plan = self._plan(sub), self._norm_plan(sub)
        speculation: _Speculation | None = None
        if plan is None and norm_plan is None:
            loss_metrics, tensors, metrics, loss = self._full_backward(sub, rewards, extras)
        elif plan is not None and self._speculates(extras, norm_plan):
            loss_metrics, tensors, metrics, loss, speculation = self._speculative_backward(sub, rewards, extras, plan)
        else:
            every = [torch.arange(sub.response_ids.shape[0], device=sub.response_ids.device)]
            loss_metrics, tensors, metrics, loss = self._micro_backward(
                sub, rewards, extras, plan or every, values_plan=norm_plan
            )
        metrics["train/skipped"] = 0.0
        if rac is not None:  # the late rewards' correction joins this step's gradient
            tensors |= self._rac_backward(rac)
        grad = grad_parts(self.params)
        reads = [loss, torch.nn.utils.get_total_norm(grad)]  # ‖g‖ before controllers
        if speculation is not None:  # whether a micro-batch's speculative ∂L/∂logp was not step 2's
            reads.append(speculation.differs.any())
        loss_value, norm, *wrong = host_values(reads)
        if speculation is not None and wrong[0] and math.isfinite(loss_value):  # (a non-finite loss skips anyway)
            self._correct(speculation)
            metrics["train/values_pass"] = 1.0
            grad = grad_parts(self.params)
            (norm,) = host_values([torch.nn.utils.get_total_norm(grad)])
        if not (math.isfinite(loss_value) and math.isfinite(norm)):
            metrics |= _read(tensors)
            metrics |= {"train/skipped": 1.0, "lr": lr}
            if math.isfinite(loss_value):
                metrics["grad/norm"] = norm
            if self.critic is not None:
                self.critic.zero_grad()
            return metrics, self._skip(f"loss is {loss_value}" if not math.isfinite(loss_value) else
                                       f"gradient norm is {norm}")  # fmt: skip
        metrics["grad/norm"] = norm
        prev = self.prev_grad  # before the controllers: GAC replaces its copy in before_step
        # cos(g_t, g_{t−1}) per parameter (no flat copy); 0 at the first step
        tensors["grad/cos_prev"] = grad_cosine(a=grad, b=prev) if prev is not None else loss.new_zeros(())
        if self._prev_keeper is None:
            self._prev_grad = [g.detach().clone() for g in grad]
        reason = None
        try:
            control: dict[str, Tensor] = {}
            for controller in self.controllers:
                control |= controller.before_step(optimizer=self.optimizer, params=self.params, metrics=loss_metrics)
            metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])  # effective lr of this step (a Python float)
            grads = [p.grad for p in self.params if p.grad is not None]
            if self.optim_cfg.grad_clip is not None:  # its total norm is also the finiteness check below
                total = torch.nn.utils.clip_grad_norm_(self.params, self.optim_cfg.grad_clip)
            else:
                total = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            values = _read({**tensors, **control, _TOTAL: total})  # the step's one read of its metrics
            total_value = values.pop(_TOTAL)
            metrics |= values
            if values.get(SKIP_STEP, 0.0) != 0.0:
                reason = "a controller asked to skip"
                self.optimizer.zero_grad(set_to_none=True)
            elif not math.isfinite(total_value):  # a NaN or inf element makes the norm non-finite
                metrics["train/skipped"] = 1.0
                reason = self._skip("gradient is not finite after the controllers")
            elif not math.isfinite(metrics["lr"]):
                metrics["train/skipped"] = 1.0
                reason = self._skip(f"learning rate is {metrics['lr']}")
            elif self.critic is not None and self.critic.warmup_step():  # BRACE: the critic steps alone
                self.optimizer.zero_grad(set_to_none=True)
                self.critic.step()
                metrics["critic/warmup"] = 1.0
                reason = "critic-only warm-up step"
            else:
                self.optimizer.step()
                if self.critic is not None:
                    self.critic.step()
                if self.ewma is not None:  # PPO-EWMA: W ← βW + 1, θ_ewma ← (βW_prev/W)θ_ewma + θ/W
                    self.ewma_weight = ewma_update_(list(self.ewma.parameters()), list(self.model.parameters()),
                                                    weight=self.ewma_weight, beta=self.proximal_beta)  # fmt: skip
                self.version += 1
        finally:
            for controller in self.controllers:
                controller.after_step(optimizer=self.optimizer)
        return metrics, reason


#: Key of BRACE's V_old in a step's extras (handed to the critic, not to the loss).
_OLD_VALUES = "old_values"
#: Key of π_old^train in a step's extras (for the mismatch split; under behavior_snapshot it is also prox_logp).
_OLD_LOGP = "old_logp"
#: Key of the post-clip gradient norm in the step's read (not a metric).
_TOTAL = "__total_norm"
#: Key of the log-probs among the leaves of a speculative micro-batched step (beside the vocabulary terms' keys).
_LOGP = "__logp"


@dataclass
class _Speculation:
    """A speculative micro-batched step (:meth:`Learner._speculative_backward`): the batch, each micro-batch's rows
    with the a_k it backpropagated (per leaf: log-probs, vocabulary terms), step 2's a [N, T] per leaf, and whether
    each micro-batch's a_k differs from a at its rows ``[M]``."""

    sub: Rollouts
    used: list[tuple[Tensor, dict[str, Tensor]]]
    a: dict[str, Tensor]
    differs: Tensor


def _differs(a: Tensor, b: Tensor) -> Tensor:
    """Whether two gradients differ anywhere (NaN where both are NaN counts as equal): a 0-dim bool tensor."""
    return ((a != b) & ~(a.isnan() & b.isnan())).any()


def _read(tensors: Mapping[str, Tensor]) -> dict[str, float]:
    """Scalar tensors as Python floats, in one read to the host (:func:`steadyrl.base.device.host_values`)."""
    return dict(zip(tensors, host_values(tensors.values()), strict=True))
