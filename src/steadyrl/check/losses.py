"""``steadyrl check losses``: a framework's own loss function against steadyrl's float64 reference (arXiv 2610.02911,
check 4: "the implemented loss against its written equation on a fixed float64 batch").

The cases are the rows of the framework-qualified name table (:mod:`steadyrl.methods.frameworks`: ``verl:vanilla``,
``trl:dapo``, ...), each of its aggregation settings a case of its own. Each :class:`LossCase` calls one framework
function as that framework's trainer runs it (its defaults plus the row's settings, the normalisers its trainer hands
the loss for one process and one micro-batch) on fixed float64 batches (rows of different lengths, all-masked rows,
log-ratios up to ±3 with tokens past a dual clip's ratio 3, heavy-tailed advantages), against
``steadyrl.compute_loss`` of the qualified name on the same advantages (``advantage.type=given``), μ = π_old, in
float64. Three comparisons, each a FAIL when off:

1. the loss value, rtol 1e-6, atol 1e-9 (the paper's tolerances);
2. the gradient ∂L/∂log π_θ on every token, same tolerances;
3. the **per-sequence gradient scale** s_i = Σ_t |∂L_framework/∂log π_θ(i, t)| / Σ_t |∂L_ref/∂log π_θ(i, t)| over
   the rows with a non-zero reference gradient: 1 on every row when the normalisers agree. A normaliser that
   divides by another count (the padded length instead of the row's, the batch's tokens instead of the rows) shows
   as s_i ≠ 1, and as a pattern in the lengths, which the message reports (s_i of the shortest and longest row).

Frameworks that are not installed are skipped (SKIP), so the command runs anywhere.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import types
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from steadyrl.check.rules import Finding
from steadyrl.methods.frameworks import FRAMEWORK_LOSSES, FrameworkLoss

DT = torch.float64
RTOL, ATOL = 1e-6, 1e-9
#: The fixed batches: (seed, row lengths, the scale of log π_old − log π_θ before its clamp to ±3). An empty row in
#: two (the frameworks differ on counting it); the last has tokens with A < 0 past a dual clip's ratio 3.
BATCHES = ((0, (7, 2, 0, 5, 1), 1.0), (1, (3, 3, 6, 4), 1.0), (5, (6, 4, 0, 5), 1.5))
#: Modules each framework's calls import (a missing one: SKIP).
REQUIRES: dict[str, tuple[str, ...]] = {
    "verl": ("verl",), "trl": ("trl",), "openrlhf": ("openrlhf", "deepspeed"), "areal": ("areal",),
    "skyrl": ("skyrl",),
}  # fmt: skip


class LossBatch(NamedTuple):
    """A fixed float64 batch: π_θ (a leaf), π_old, token advantages, the mask; padding holds finite garbage."""

    logp: Tensor
    old: Tensor
    adv: Tensor
    mask: Tensor


def fixed_batches(*, sequence: bool = False) -> list[LossBatch]:
    """The batches every case runs on (seeded, float64); with ``sequence``, each row's advantage is one value (the
    row's first token's) on every position, as GRPO's outcome advantages are."""
    out = []
    for seed, lengths, scale in BATCHES:
        g = torch.Generator().manual_seed(seed)
        B, T = len(lengths), max(lengths) + 1
        mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
        logp = -0.05 - 3.0 * torch.rand(B, T, generator=g, dtype=DT)
        old = (logp + (scale * torch.randn(B, T, generator=g, dtype=DT)).clamp(-3, 3)).clamp(max=-0.01)
        adv = torch.randn(B, T, generator=g, dtype=DT) * torch.exp(torch.randn(B, T, generator=g, dtype=DT))
        out.append(LossBatch(logp, old, adv[:, :1].expand(B, T) if sequence else adv, mask))
    return out


@dataclass(frozen=True)
class LossCase:
    """One framework loss and the steadyrl method (with options) that reproduces it."""

    name: str
    framework: str
    loss: Callable[[LossBatch, Tensor], Tensor]
    """(batch, the π_θ leaf) → the framework's scalar loss."""
    options: dict[str, Any] = field(default_factory=dict)
    """Overrides on ``method`` (``agg``, ``objective.empty_rows``, ``norm_len``, ...)."""
    requires: tuple[str, ...] = ()
    """Modules that must import (else SKIP)."""
    method: str = "ppo"
    """The steadyrl method name (a preset, a composition or a framework-qualified name)."""
    sequence: bool = False
    """Run on per-sequence advantages (:func:`fixed_batches` ``sequence``); steadyrl gets them as [B]."""


def reference(batch: LossBatch, logp: Tensor, case: LossCase) -> Tensor:
    """steadyrl's loss of ``case.method`` on ``batch`` (μ = π_old; NaN at padding, which it must ignore)."""
    from steadyrl import compute_loss, resolve_method

    spec = resolve_method(case.method, {"advantage.type": "given", **case.options})
    nan = torch.full_like(batch.old, float("nan"))
    old = torch.where(batch.mask, batch.old, nan)
    adv = batch.adv[:, 0] if case.sequence else torch.where(batch.mask, batch.adv, nan)
    out = compute_loss(spec, {"logp": torch.where(batch.mask, logp, nan), "behav_logp": old, "prox_logp": old,
                              "mask": batch.mask, "advantages": adv})  # fmt: skip
    return out.loss


def _grad(loss: Tensor, x: Tensor) -> Tensor:
    (g,) = torch.autograd.grad(loss, x, allow_unused=True, materialize_grads=True)
    return g


def compare(case: LossCase) -> Finding:
    """Value, gradient and per-sequence gradient scale of ``case`` against the reference (the module docstring)."""
    name = f"{case.framework}:{case.name}"
    for module in case.requires:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return Finding(name, "SKIP", None, f"{module} is not installed")
    worst_value = worst_grad = 0.0
    scales: list[tuple[int, float]] = []
    for batch in fixed_batches(sequence=case.sequence):
        mine, theirs_x = batch.logp.clone().requires_grad_(True), batch.logp.clone().requires_grad_(True)
        ref = reference(batch, mine, case)
        theirs = case.loss(batch, theirs_x)
        g_ref, g_theirs = _grad(ref, mine), _grad(theirs, theirs_x)
        g_theirs = torch.where(batch.mask, g_theirs, torch.zeros_like(g_theirs))  # padding is not compared
        worst_value = max(worst_value, _excess(ref.detach(), theirs.detach()))
        worst_grad = max(worst_grad, _excess(g_ref, g_theirs))
        num, den = g_theirs.abs().sum(-1), g_ref.abs().sum(-1)
        lengths = batch.mask.sum(-1)
        scales += [(int(n), float(a / b)) for n, a, b in zip(lengths, num, den, strict=True) if b > 0]
    off = [(n, s) for n, s in scales if abs(s - 1.0) > RTOL]
    shortest, longest = min(scales)[1], max(scales)[1]
    detail = (f"value {worst_value:.2g}, gradient {worst_grad:.2g} past the tolerance; per-sequence scale "
              f"{min(s for _, s in scales):.6g}..{max(s for _, s in scales):.6g} (shortest row {shortest:.6g}, "
              f"longest {longest:.6g})")  # fmt: skip
    if off or worst_value > 0 or worst_grad > 0:
        hint = " (a normaliser differs: the scale depends on the row)" if off else ""
        return Finding(name, "FAIL", None, f"differs from steadyrl {_options(case)}: {detail}{hint}")
    return Finding(name, "PASS", None, f"equals steadyrl {_options(case)} (value, gradient, per-sequence scale 1)")


def _excess(ref: Tensor, theirs: Tensor) -> float:
    """How far past |theirs − ref| ≤ atol + rtol·|ref| the worst element is (0 when within)."""
    err = (theirs.to(DT) - ref).abs() - (ATOL + RTOL * ref.abs())
    return max(0.0, float(err.max())) if err.numel() else 0.0


def _options(case: LossCase) -> str:
    return " ".join([case.method, *(f"{k}={v}" for k, v in case.options.items())])


# ------------------------------------------------------------------------------------------------- frameworks
def _verl(row: FrameworkLoss, settings: Mapping[str, Any]) -> Callable[[LossBatch, Tensor], Tensor]:
    """verl's registered policy loss ``row.name`` with the actor config ``settings`` (``policy_loss.*`` keys go to
    its ``PolicyLossConfig``) and the global batch values its ``ppo_loss`` sets for one process."""

    def loss(batch: LossBatch, logp: Tensor) -> Tensor:
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        from verl.workers.config import ActorConfig, PolicyLossConfig

        B = batch.mask.shape[0]
        policy = {k.removeprefix("policy_loss."): v for k, v in settings.items() if k.startswith("policy_loss.")}
        actor = {k: v for k, v in settings.items() if not k.startswith("policy_loss.")}
        cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=B, rollout_n=1,
                          policy_loss=PolicyLossConfig(loss_mode=row.name, **policy), **actor)  # fmt: skip
        cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(batch.mask.sum()), global_batch_size=B,
                                     loss_scale_factor=cfg.loss_scale_factor)  # fmt: skip
        out, _ = get_policy_loss_fn(row.name)(
            old_log_prob=batch.old, log_prob=logp, advantages=batch.adv, response_mask=batch.mask,
            loss_agg_mode=cfg.loss_agg_mode, config=cfg, rollout_is_weights=None,
        )  # fmt: skip
        return out

    return loss


class OneProcessAccelerator:
    """The ``Accelerator`` calls TRL's ``GRPOTrainer._compute_loss`` makes, for one process (identity reductions)."""

    num_processes = 1

    def reduce(self, x: Tensor, reduction: str = "sum") -> Tensor:
        return x

    def gather(self, x: Tensor) -> Tensor:
        return x

    gather_for_metrics = gather


class TrainerStandIn(types.SimpleNamespace):
    """A stand-in ``self`` for ``GRPOTrainer``'s methods: instance attributes first, then ``GRPOTrainer``'s own (its
    static helpers come back as plain functions)."""

    def __getattr__(self, name: str) -> Any:
        from trl import GRPOTrainer

        return getattr(GRPOTrainer, name)


def trl_loss(
    logp: Tensor, inputs: dict[str, Tensor], *, training: bool = True, **config: Any
) -> tuple[Tensor, dict[str, list[float]]]:
    """TRL's ``GRPOTrainer._compute_loss``, run unbound on a stand-in ``self``.

    The stand-in holds the attributes ``GRPOTrainer.__init__`` derives from a real ``GRPOConfig(**config)`` (the same
    assignments: ε_low = ``epsilon``, ε_high = ``epsilon_high`` or ``epsilon``, ...), a one-process accelerator, and a
    ``_get_per_token_logps_and_entropies`` that returns ``logp`` (the tensor TRL's forward would produce); any other
    attribute resolves to ``GRPOTrainer``'s own: everything from the log-probs on is TRL's own code. Returns the loss
    and TRL's logged metrics (``train`` mode unless ``training=False``).
    """
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], bf16=False, **config)
    B, T = logp.shape
    mode = "train" if training else "eval"
    self = TrainerStandIn(
        args=args, accelerator=OneProcessAccelerator(), model=types.SimpleNamespace(training=training),
        _metrics={mode: defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp.detach()), None),
        loss_type=args.loss_type, importance_sampling_level=args.importance_sampling_level,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        beta=args.beta, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, use_vllm=args.use_vllm,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        max_completion_length=args.max_completion_length, current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
    )  # fmt: skip
    ids = torch.ones(B, T, dtype=torch.long)
    full = {"prompt_ids": ids[:, :1], "prompt_mask": ids[:, :1], "completion_ids": ids} | inputs
    loss = GRPOTrainer._compute_loss(self, None, full)
    return loss, dict(self._metrics[mode])


def _trl(row: FrameworkLoss, settings: Mapping[str, Any]) -> Callable[[LossBatch, Tensor], Tensor]:
    """TRL's ``GRPOTrainer._compute_loss`` with ``loss_type=row.name`` and ``GRPOConfig(**settings)``."""

    def loss(batch: LossBatch, logp: Tensor) -> Tensor:
        inputs = {"completion_mask": batch.mask.long(), "advantages": batch.adv, "old_per_token_logps": batch.old,
                  "num_items_in_batch": batch.mask.sum()}  # fmt: skip
        return trl_loss(logp, inputs, loss_type=row.name, **settings)[0]

    return loss


def openrlhf_module(name: str) -> types.ModuleType:
    """``openrlhf.models.<mod>`` without running ``openrlhf/models/__init__.py`` (it imports CUDA-only kernels)."""
    import openrlhf

    pkg = name.rsplit(".", 1)[0]
    if pkg not in sys.modules:
        bare = types.ModuleType(pkg)
        bare.__path__ = [str(Path(openrlhf.__path__[0]) / pkg.split(".")[1])]
        sys.modules[pkg] = bare
    return importlib.import_module(name)


def _openrlhf(row: FrameworkLoss, settings: Mapping[str, Any]) -> Callable[[LossBatch, Tensor], Tensor]:
    """OpenRLHF's ``PolicyLoss(policy_loss_type=row.name)`` as its actor builds it from ``--actor.*`` (``settings``),
    with the normalisers its trainer passes: the step's token count and its non-empty samples."""

    def loss(batch: LossBatch, logp: Tensor) -> Tensor:
        low, high = settings.get("eps_clip_low_high", (0.2, 0.2))  # --actor.eps_clip 0.2 on both sides
        fn = openrlhf_module("openrlhf.models.loss").PolicyLoss(
            clip_eps_low=low, clip_eps_high=high, dual_clip=settings.get("dual_clip"), policy_loss_type=row.name,
            token_level_loss=settings.get("loss_agg_mode", "token-mean") == "token-mean",
        )  # fmt: skip
        m = batch.mask.to(DT)
        out, *_ = fn(logp, batch.old, batch.adv, action_mask=m, dp_size=1, batch_num_tokens=float(m.sum()),
                     global_batch_size=float(batch.mask.any(-1).sum()))  # fmt: skip
        return out

    return loss


def _areal(row: FrameworkLoss, settings: Mapping[str, Any]) -> Callable[[LossBatch, Tensor], Tensor]:
    """AReaL's actor loss without the decoupled loss (π_prox = π_old): ``sapo_loss_fn`` under ``use_sapo_loss``, else
    ``ppo_actor_loss_fn``, with ``PPOActorConfig``'s defaults overlaid by ``settings``."""

    def loss(batch: LossBatch, logp: Tensor) -> Tensor:
        from areal.api.cli_args import PPOActorConfig
        from areal.utils.functional.functional import ppo_actor_loss_fn, sapo_loss_fn

        fields = dataclasses.fields(PPOActorConfig)
        cfg = {**{f.name: f.default for f in fields if f.default is not dataclasses.MISSING}, **settings}
        common = {"logprobs": logp, "old_logprobs": batch.old, "advantages": batch.adv, "loss_mask": batch.mask,
                  "importance_sampling_level": cfg["importance_sampling_level"]}  # fmt: skip
        if cfg["use_sapo_loss"]:
            out, _ = sapo_loss_fn(tau_pos=cfg["sapo_tau_pos"], tau_neg=cfg["sapo_tau_neg"], **common)
        else:
            clip = {"eps_clip": cfg["eps_clip"], "eps_clip_higher": cfg["eps_clip_higher"], "c_clip": cfg["c_clip"]}
            out, _ = ppo_actor_loss_fn(proximal_logprobs=batch.old, **clip, **common)
        return out

    return loss


def skyrl_ppo_utils() -> types.ModuleType:
    """SkyRL 0.3.0's ``ppo_utils`` (``skyrl.backends`` registered bare on Python < 3.12: its package imports need
    3.12)."""
    if sys.version_info < (3, 12) and "skyrl.backends" not in sys.modules:
        spec = importlib.util.find_spec("skyrl")
        assert spec is not None and spec.submodule_search_locations
        pkg = types.ModuleType("skyrl.backends")
        pkg.__path__ = [spec.submodule_search_locations[0] + "/backends"]
        sys.modules["skyrl.backends"] = pkg
    return importlib.import_module("skyrl.backends.skyrl_train.utils.ppo_utils")


def _skyrl(row: FrameworkLoss, settings: Mapping[str, Any]) -> Callable[[LossBatch, Tensor], Tensor]:
    """SkyRL's registered policy loss ``row.name`` with ``AlgorithmConfig`` overlaid by ``settings``, on the
    advantages its trainer pre-scales for the ``loss_reduction`` (one micro-batch); μ = π_old."""

    def loss(batch: LossBatch, logp: Tensor) -> Tensor:
        ppo = skyrl_ppo_utils()
        from skyrl.train.config import AlgorithmConfig

        cfg = dataclasses.replace(AlgorithmConfig(), policy_loss_type=row.name, **settings)
        m = batch.mask.to(DT)
        scaled = ppo.apply_loss_reduction_to_advantages_minibatch(
            advantages=batch.adv * m, loss_mask=m, loss_reduction=cfg.loss_reduction, micro_batch_size=m.shape[0],
            max_seq_len=cfg.max_seq_len,
        )  # fmt: skip
        out, _ = ppo.PolicyLossRegistry.get(row.name)(logp, batch.old, scaled, config=cfg, loss_mask=m,
                                                      rollout_logprobs=batch.old)  # fmt: skip
        return out

    return loss


#: Each framework's call: (row, its settings) → (batch, the π_θ leaf) → the framework's loss.
CALLS: dict[str, Callable[[FrameworkLoss, Mapping[str, Any]], Callable[[LossBatch, Tensor], Tensor]]] = {
    "verl": _verl, "trl": _trl, "openrlhf": _openrlhf, "areal": _areal, "skyrl": _skyrl,
}  # fmt: skip


def row_cases(row: FrameworkLoss) -> list[LossCase]:
    """The cases of one qualified name: its default, and each aggregation setting of its ``reductions`` (steadyrl:
    the name with ``agg`` overridden)."""
    call, sequence = CALLS[row.framework], row.advantages == "sequence"
    requires = REQUIRES[row.framework]
    cases = [LossCase(row.name, row.framework, call(row, row.settings), {}, requires, row.qualified, sequence)]
    for agg, reduction in row.reductions.items():
        settings = {**row.settings, **reduction.settings}
        cases.append(LossCase(f"{row.name}[agg={agg}]", row.framework, call(row, settings), {"agg": agg}, requires,
                              row.qualified, sequence))  # fmt: skip
    return cases


def framework_cases() -> dict[str, list[LossCase]]:
    """Every framework's cases: the rows of :data:`steadyrl.methods.frameworks.FRAMEWORK_LOSSES`."""
    out: dict[str, list[LossCase]] = {}
    for row in FRAMEWORK_LOSSES:
        out.setdefault(row.framework, []).extend(row_cases(row))
    return out


def check_losses(frameworks: Sequence[str] | None = None, *, cases: Sequence[LossCase] | None = None) -> list[Finding]:
    """Findings of every case of ``frameworks`` (default: all), or of the given ``cases``."""
    if cases is None:
        table = framework_cases()
        unknown = [f for f in frameworks or () if f not in table]
        if unknown:
            return [Finding(f, "SKIP", None, f"no loss mapping for {f} (known: {', '.join(table)})") for f in unknown]
        cases = [c for f in (frameworks or list(table)) for c in table[f]]
    findings = []
    for case in cases:
        try:
            findings.append(compare(case))
        except ImportError as err:
            findings.append(Finding(f"{case.framework}:{case.name}", "SKIP", None, f"cannot import: {err}"))
    return findings
