"""``steadyrl check losses``: a framework's own loss function against steadyrl's float64 reference (arXiv 2610.02911,
check 4: "the implemented loss against its written equation on a fixed float64 batch").

Each :class:`LossCase` calls one framework function on fixed float64 batches (rows of different lengths, one empty
row, log-ratios up to ±3, heavy-tailed token advantages) and names the steadyrl method options that reproduce it
(the aggregation ``agg``, ``objective.empty_rows``, ``norm_len`` and the clip range: the mappings the parity tests
under ``tests/parity`` establish for PPO-clip). The reference is ``steadyrl.compute_loss`` of ``ppo`` on given
advantages, μ = π_old, in float64. Three comparisons, each a FAIL when off:

1. the loss value, rtol 1e-6, atol 1e-9 (the paper's tolerances);
2. the gradient ∂L/∂log π_θ on every token, same tolerances;
3. the **per-sequence gradient scale** s_i = Σ_t |∂L_framework/∂log π_θ(i, t)| / Σ_t |∂L_ref/∂log π_θ(i, t)| over
   the rows with a non-zero reference gradient: 1 on every row when the normalisers agree. A normaliser that
   divides by another count (the padded length instead of the row's, the batch's tokens instead of the rows) shows
   as s_i ≠ 1, and as a pattern in the lengths, which the message reports (s_i of the shortest and longest row).

Frameworks that are not installed are skipped (SKIP), so the command runs anywhere.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from steadyrl.check.rules import Finding

DT = torch.float64
RTOL, ATOL = 1e-6, 1e-9
CLIP = (0.2, 0.28)
#: Row lengths of the fixed batches (an empty row included: the frameworks differ on counting it).
LENGTHS = ((7, 2, 0, 5, 1), (3, 3, 6, 4))


class LossBatch(NamedTuple):
    """A fixed float64 batch: π_θ (a leaf), π_old, token advantages, the mask; padding holds finite garbage."""

    logp: Tensor
    old: Tensor
    adv: Tensor
    mask: Tensor


def fixed_batches() -> list[LossBatch]:
    """The batches every case runs on (seeded, float64)."""
    out = []
    for seed, lengths in enumerate(LENGTHS):
        g = torch.Generator().manual_seed(seed)
        B, T = len(lengths), max(lengths) + 1
        mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
        logp = -0.05 - 3.0 * torch.rand(B, T, generator=g, dtype=DT)
        old = (logp + torch.randn(B, T, generator=g, dtype=DT).clamp(-3, 3)).clamp(max=-0.01)
        adv = torch.randn(B, T, generator=g, dtype=DT) * torch.exp(torch.randn(B, T, generator=g, dtype=DT))
        out.append(LossBatch(logp, old, adv, mask))
    return out


@dataclass(frozen=True)
class LossCase:
    """One framework loss and the steadyrl options that reproduce it."""

    name: str
    framework: str
    loss: Callable[[LossBatch, Tensor], Tensor]
    """(batch, the π_θ leaf) → the framework's scalar loss."""
    options: dict[str, Any] = field(default_factory=dict)
    """steadyrl ``ppo`` method options (``agg``, ``objective.empty_rows``, ``norm_len``, ...)."""
    requires: tuple[str, ...] = ()
    """Modules that must import (else SKIP)."""


def reference(batch: LossBatch, logp: Tensor, options: dict[str, Any]) -> Tensor:
    """steadyrl's PPO-clip loss on ``batch`` (μ = π_old; NaN at padding, which it must ignore)."""
    from steadyrl import compute_loss, resolve_method

    spec = resolve_method("ppo", {"advantage.type": "given", "objective.clip_low": CLIP[0],
                                  "objective.clip_high": CLIP[1], **options})  # fmt: skip
    nan = torch.full_like(batch.old, float("nan"))
    old = torch.where(batch.mask, batch.old, nan)
    out = compute_loss(spec, {"logp": torch.where(batch.mask, logp, nan), "behav_logp": old, "prox_logp": old,
                              "mask": batch.mask, "advantages": torch.where(batch.mask, batch.adv, nan)})  # fmt: skip
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
    for batch in fixed_batches():
        mine, theirs_x = batch.logp.clone().requires_grad_(True), batch.logp.clone().requires_grad_(True)
        ref = reference(batch, mine, case.options)
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
    return "ppo " + " ".join(f"{k}={v}" for k, v in case.options.items())


# ------------------------------------------------------------------------------------------------- frameworks
def _verl_case(agg: str) -> LossCase:
    def loss(batch: LossBatch, logp: Tensor) -> Tensor:
        from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
        from verl.workers.config import ActorConfig, PolicyLossConfig

        B, T = batch.mask.shape
        cfg = ActorConfig(
            strategy="fsdp", ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=B, rollout_n=1,
            policy_loss=PolicyLossConfig(loss_mode="vanilla"), loss_agg_mode=agg, clip_ratio_low=CLIP[0],
            clip_ratio_high=CLIP[1], clip_ratio_c=1e12, loss_scale_factor=T,
        )  # fmt: skip
        cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(batch.mask.sum()), global_batch_size=B,
                                     loss_scale_factor=T)  # fmt: skip
        out, _ = compute_policy_loss_vanilla(old_log_prob=batch.old, log_prob=logp, advantages=batch.adv,
                                             response_mask=batch.mask, loss_agg_mode=agg, config=cfg)  # fmt: skip
        return out

    rows = "count" if agg in ("seq-mean-token-mean", "seq-mean-token-sum") else "skip"
    opts: dict[str, Any] = {"agg": agg, "objective.empty_rows": rows}
    return LossCase(f"compute_policy_loss_vanilla[{agg}]", "verl", loss, opts, ("verl",))


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


def _trl_case(loss_type: str, agg: str, rows: str) -> LossCase:
    def loss(batch: LossBatch, logp: Tensor) -> Tensor:
        from trl import GRPOConfig, GRPOTrainer

        B, T = batch.mask.shape
        args = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], bf16=False, loss_type=loss_type,
                          epsilon=CLIP[0], epsilon_high=CLIP[1], beta=0.0, max_completion_length=T)  # fmt: skip
        attrs = TrainerStandIn(
            args=args, accelerator=OneProcessAccelerator(), model=types.SimpleNamespace(training=True),
            _metrics={"train": defaultdict(list)},
            _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp.detach()), None),
            loss_type=loss_type, importance_sampling_level=args.importance_sampling_level,
            epsilon_low=args.epsilon, epsilon_high=args.epsilon_high, beta=0.0,
            top_entropy_quantile=args.top_entropy_quantile, off_policy_mask_threshold=args.off_policy_mask_threshold,
            use_vllm=False, vllm_importance_sampling_correction=False, max_completion_length=T,
            current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        )  # fmt: skip
        ids = torch.ones(B, T, dtype=torch.long)
        inputs = {"prompt_ids": ids[:, :1], "prompt_mask": ids[:, :1], "completion_ids": ids,
                  "completion_mask": batch.mask.long(), "advantages": batch.adv, "old_per_token_logps": batch.old,
                  "num_items_in_batch": batch.mask.sum()}  # fmt: skip
        return GRPOTrainer._compute_loss(attrs, None, inputs)

    opts: dict[str, Any] = {"agg": agg, "objective.empty_rows": rows}
    return LossCase(f"GRPOTrainer._compute_loss[{loss_type}]", "trl", loss, opts, ("trl",))


def openrlhf_module(name: str) -> types.ModuleType:
    """``openrlhf.models.<mod>`` without running ``openrlhf/models/__init__.py`` (it imports CUDA-only kernels)."""
    import openrlhf

    pkg = name.rsplit(".", 1)[0]
    if pkg not in sys.modules:
        bare = types.ModuleType(pkg)
        bare.__path__ = [str(Path(openrlhf.__path__[0]) / pkg.split(".")[1])]
        sys.modules[pkg] = bare
    return importlib.import_module(name)


def _openrlhf_case(token_level: bool) -> LossCase:
    def loss(batch: LossBatch, logp: Tensor) -> Tensor:
        fn = openrlhf_module("openrlhf.models.loss").PolicyLoss(clip_eps_low=CLIP[0], clip_eps_high=CLIP[1],
                                                token_level_loss=token_level, policy_loss_type="ppo")  # fmt: skip
        m = batch.mask.to(DT)
        norm = {"batch_num_tokens": float(m.sum())} if token_level else {"global_batch_size": float(m.shape[0])}
        out, *_ = fn(logp, batch.old, batch.adv, action_mask=m, **norm)
        return out

    opts: dict[str, Any] = ({"agg": "token-mean"} if token_level
                            else {"agg": "seq-mean-token-mean", "objective.empty_rows": "count"})  # fmt: skip
    name = f"PolicyLoss[token_level_loss={token_level}]"
    return LossCase(name, "openrlhf", loss, opts, ("openrlhf", "deepspeed"))


def _areal_case() -> LossCase:
    def loss(batch: LossBatch, logp: Tensor) -> Tensor:
        from areal.utils.functional.functional import ppo_actor_loss_fn

        out, _ = ppo_actor_loss_fn(logprobs=logp, proximal_logprobs=batch.old, old_logprobs=batch.old,
                                   advantages=batch.adv, eps_clip=CLIP[0], eps_clip_higher=CLIP[1], c_clip=None,
                                   loss_mask=batch.mask)  # fmt: skip
        return out

    return LossCase("ppo_actor_loss_fn", "areal", loss, {"agg": "token-mean"}, ("areal",))


def framework_cases() -> dict[str, list[LossCase]]:
    """Every framework's cases (the mappings of ``tests/parity/test_ppo.py``)."""
    return {
        "verl": [
            _verl_case(a)
            for a in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
        ],
        "trl": [
            _trl_case("grpo", "seq-mean-token-mean", "count"),
            _trl_case("bnpo", "token-mean", "skip"),
            _trl_case("dapo", "token-mean", "skip"),
            _trl_case("dr_grpo", "seq-mean-token-sum-norm", "skip"),
        ],
        "openrlhf": [_openrlhf_case(True), _openrlhf_case(False)],
        "areal": [_areal_case()],
    }


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
