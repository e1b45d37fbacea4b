"""The GPU check: warm-start a ~85M-parameter Llama on the GPU, 30 steps of ``steadyrl train`` there in bf16-mixed
precision at lag 0, then the paths that can break on a GPU, each with a PASS or FAIL rule (docs/scale.md, "GPU
check").

1. Build the embedded Llama (:func:`steadyrl.models.build_tiny_model`) at the size ``--size`` names (``gpu``: hidden
   768, 12 layers, 12 heads, MLP 2048, 85.0M parameters; ``tiny``: hidden 32, 2 layers, the CPU smoke run), place it
   on ``--device`` (:class:`steadyrl.base.device.Placement`), warm-start it there on the main job's chain_sum
   (two 2-digit terms) for at most ``warm_start.max_steps`` steps, and save it with its tokenizer.
2. Run ``steadyrl train`` in-process on that directory (``model.name=<dir>``) with ``precision=bf16-mixed``,
   ``runtime.lag.k=0`` (so every step logs ``mismatch/*``, the bf16 KV-cache sampler against the learner's one-pass
   recompute) and an ``optim.microbatch_tokens`` budget below the batch's tokens (so the learner micro-batches).
3. Print, and write to ``$OUT/gpu_check.json`` when ``OUT`` is set (or to ``--json``), the fields of
   :func:`summarize`.
4. The items of :data:`ITEMS`, each PASS or FAIL by a rule that can fail (:func:`run_items`): training raises the
   accuracy; a resume continues exactly (the steps after ``resume=true`` equal an uninterrupted run's); the collapse
   guard's rollback restores the weights bit for bit and the next step runs; VCPO (the fused norm pass), GAC,
   ``precision=bf16`` train; ``runtime.mode=local`` trains with its sampler process beside the learner on its
   device (``rollout.device=learner``); the adapters' step control runs ``seq_tis+ess_lr`` and
   ``seq_tis+gac`` on the device behind a stand-in trainer; three tool-use steps (model-written code run in the
   sandbox); a profile of one sampling and one learner step of the main run's batch (tokens/s, peak memory per
   phase, the learner's FLOP/s as a share of a matmul peak measured in the same process: :func:`item_profile`). The
   exit status is non-zero when any item fails.

Run it through ``bash benchmarks/gpu_check.sh`` on a machine with only torch/transformers/accelerate/numpy (it
installs the rest from wheels first), or directly where steadyrl is installed:

    .venv/bin/python benchmarks/gpu_check.py --device cpu --size tiny     # the CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from steadyrl.base.device import Placement
from steadyrl.config.train import MAIN_JOB_TASK
from steadyrl.models import TinyArchConfig, WarmStartConfig, build_char_tokenizer, build_tiny_model, warm_start
from steadyrl.tasks import build_task
from steadyrl.train.entry import main as train_main
from steadyrl.train.metrics import METRICS_FILE, read_metrics

#: The file written under ``$OUT`` (the device machine's folder of files that come back).
JSON_NAME = "gpu_check.json"
#: Precision of the warm start and the RL run: bf16 autocast, fp32 weights, AdamW and output layer.
PRECISION = "bf16-mixed"
#: Seed of the model's initialization, the warm start and the RL run.
SEED = 0
#: The PASS/FAIL items, in the order they run (:func:`run_items`).
ITEMS = (
    "train", "resume", "rollback", "vcpo", "gac", "bf16", "tools", "local_sampler", "adapter_ess_lr", "adapter_gac",
    "profile",
)  # fmt: skip


@dataclass(frozen=True)
class Size:
    """One size of the check: the model, its warm start and the RL run."""

    arch: TinyArchConfig
    warm_start: WarmStartConfig
    steps: int
    """RL learner steps."""
    prompts_per_step: int
    group_size: int
    eval_every: int
    eval_n: int
    """Held-out problems per evaluation."""
    microbatch_tokens: int
    """``optim.microbatch_tokens``: below the batch's padded tokens (rows × ~19), so the learner micro-batches."""
    accuracy_rises: bool = True
    """The train item's rule: the sampled accuracy rises (the GPU size); False for the CPU smoke size, whose few
    warm-start steps leave the accuracy at 0 (there the rule is: exit 0 and every step finite)."""


SIZES: dict[str, Size] = {
    # 85.0M parameters: 12 × (4·768² + 3·768·2048 + 2·768) + 768 + 100·768 (RMSNorms, tied embeddings). The warm
    # start's lr is near the GPT-2-small scale's (3e-3, the 1M default's, is too large at width 768). It is bounded by
    # steps (WarmStartConfig has no time limit): ~20–40 ms a step expected on an H200 (launch-bound at 128 × ~14
    # tokens), so 1500 steps and 16 evaluations should take ~60–90 s.
    "gpu": Size(
        arch=TinyArchConfig(
            hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048, max_position_embeddings=512
        ),
        warm_start=WarmStartConfig(
            lr=1e-3, warmup_steps=100, batch_size=128, max_steps=1500, eval_every=100, eval_problems=256
        ),
        steps=30,
        prompts_per_step=64,
        group_size=8,
        eval_every=10,
        eval_n=512,
        microbatch_tokens=2048,
    ),
    # the CPU smoke run (tests/train/test_gpu_check.py): seconds, not meaningful numbers
    "tiny": Size(
        arch=TinyArchConfig(
            hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64
        ),
        warm_start=WarmStartConfig(
            lr=3e-3, warmup_steps=2, batch_size=16, train_problems=256, max_steps=4, eval_every=2, eval_problems=16
        ),
        steps=3,
        prompts_per_step=4,
        group_size=4,
        eval_every=2,
        eval_n=8,
        microbatch_tokens=128,
        accuracy_rises=False,
    ),
}


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters of ``model`` (tied weights counted once, as ``model.parameters()`` yields them)."""
    return sum(p.numel() for p in model.parameters())


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` on a GPU; the processor's name on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def warm_start_to_dir(size: Size, placement: Placement, *, task_cfg: Any, out: Path) -> dict[str, Any]:
    """Step 1: build, place and warm-start the model on ``placement``'s device; save it (and its tokenizer) in ``out``.

    The warm start's forwards run under the placement's autocast, as the RL run's do: one region per forward
    (``warm_start(autocast=...)``); a region around the whole warm start would keep the first step's bf16 weights.
    """
    tokenizer = build_char_tokenizer()
    model = placement.place(build_tiny_model(size.arch, tokenizer=tokenizer, seed=SEED))
    task = build_task(task_cfg)
    report = warm_start(
        model, tokenizer, task=task, cfg=size.warm_start, seed=SEED, progress=False, autocast=placement.autocast
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    fields = {
        "parameters": parameter_count(model),
        "warm_start/steps": report.steps,
        "warm_start/seconds": report.seconds,
        "warm_start/accuracy": report.accuracy,
        "warm_start/reached_target": report.reached_target,
        "warm_start/history": " ".join(f"{p.step}:{p.accuracy:.3f}" for p in report.history),
    }
    del model
    gc.collect()
    if placement.device.type == "cuda":
        torch.cuda.empty_cache()
    return fields


def train_overrides(size: Size, *, device: str, model_dir: Path, out_dir: Path) -> list[str]:
    """Step 2: the ``steadyrl train`` arguments (the main job's task, method and sampling; the rest as the check
    needs: lag 0, bf16-mixed, micro-batches, no plot, no periodic checkpoints)."""
    return [
        f"model.name={model_dir}",
        f"device={device}",
        f"precision={PRECISION}",
        f"optim.microbatch_tokens={size.microbatch_tokens}",
        "runtime.lag.k=0",
        f"steps={size.steps}",
        f"prompts_per_step={size.prompts_per_step}",
        f"group_size={size.group_size}",
        f"eval.every={size.eval_every}",
        f"eval.n={size.eval_n}",
        "log.plot=false",
        "log.progress=false",
        "checkpoint.every=0",
        "runtime.threads=0",  # leave torch's thread count alone (the warm start used the same)
        f"seed={SEED}",
        f"out_dir={out_dir}",
        "overwrite=true",
    ]


def _values(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if r.get(key) is not None]


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize(records: Sequence[Mapping[str, Any]], *, rows: int) -> dict[str, Any]:
    """Step 3: the RL run's fields from its metrics.jsonl records (``rows``: responses per step).

    Token rates count response tokens (``response/len_mean`` × rows) over ``time/learn_s`` (the learner step:
    micro-batched forwards, loss, backward, AdamW) and ``time/sample_s`` (the lag runtime's sampling: loading the
    snapshot into the sampler copy, then generate), summed over steps 1 … (step 0 pays CUDA's first-call costs; it
    is the only step of a one-step run). ``time/mismatch_s`` is the lag-0 recompute behind ``mismatch/*``.
    """
    steps = [r for r in records if "time/learn_s" in r]
    timed_steps = steps[1:] or steps
    tokens = sum(float(r["response/len_mean"]) * rows for r in timed_steps)
    learn_s = sum(float(r["time/learn_s"]) for r in timed_steps)
    sample_s = sum(float(r["time/sample_s"]) for r in timed_steps)
    accs = _values(records, "eval/acc")
    kl, dlogp = _values(steps, "mismatch/kl_k3"), _values(steps, "mismatch/max_abs_dlogp")
    micro = _values(steps, "train/microbatches")
    return {
        "rl/steps": len(steps),
        "rl/learner_tokens_per_s": tokens / learn_s if learn_s > 0 else None,
        "rl/sampler_tokens_per_s": tokens / sample_s if sample_s > 0 else None,
        "rl/step_s_mean": _mean(_values(timed_steps, "time/step_s")),
        "rl/sample_s_mean": _mean(_values(timed_steps, "time/sample_s")),
        "rl/learn_s_mean": _mean(_values(timed_steps, "time/learn_s")),
        "rl/mismatch_s_mean": _mean(_values(timed_steps, "time/mismatch_s")),
        "rl/microbatches_mean": _mean(micro),
        "rl/response_len_mean": _mean(_values(steps, "response/len_mean")),
        "rl/truncated_mean": _mean(_values(steps, "response/truncated")),
        "rl/mismatch_kl_k3_mean": _mean(kl),
        "rl/mismatch_kl_k3_max": max(kl, default=None),
        "rl/mismatch_max_abs_dlogp_mean": _mean(dlogp),
        "rl/mismatch_max_abs_dlogp_max": max(dlogp, default=None),
        "rl/mismatch_steps": len(kl),
        "rl/eval_acc_first": accs[0] if accs else None,
        "rl/eval_acc_last": accs[-1] if accs else None,
        "rl/reward_mean_last": _values(steps, "reward/mean")[-1] if steps else None,
    }


@contextlib.contextmanager
def work_dir(path: str | None) -> Iterator[Path]:
    """``path`` (kept), or a temporary directory removed afterwards."""
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="steadyrl_gpu_check_") as tmp:
        yield Path(tmp)


def run_check(
    *, size_name: str, device: str, work: Path, items: Sequence[str] = ITEMS
) -> tuple[dict[str, Any], list[ItemResult]]:
    """Steps 1–4 in ``work``; returns the fields (also when the RL run fails: ``rl/exit_status`` says so) and the
    items' verdicts."""
    wall0 = time.perf_counter()
    size = SIZES[size_name]
    placement = Placement.from_names(device, PRECISION)
    fields: dict[str, Any] = {
        "size": size_name,
        "device": str(placement.device),
        "device_name": device_name(placement.device),
        "precision": PRECISION,
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, python "
        f"{platform.python_version()}",
    }
    model_dir, out_dir = work / "model", work / "run"
    fields |= warm_start_to_dir(size, placement, task_cfg=MAIN_JOB_TASK, out=model_dir)
    if placement.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(placement.device)
    print(f"[gpu_check] warm start: {fields['warm_start/steps']} steps in {fields['warm_start/seconds']:.1f} s, "
          f"accuracy {fields['warm_start/accuracy']}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        status: int | str = train_main(train_overrides(size, device=device, model_dir=model_dir, out_dir=out_dir))
    except Exception as exc:  # the items below still run: each is its own finding
        traceback.print_exc()
        status = f"{type(exc).__name__}: {exc}"
    fields["rl/seconds"] = time.perf_counter() - t0
    fields["rl/exit_status"] = status
    fields["rl/microbatch_tokens"] = size.microbatch_tokens
    fields["rl/batch_rows"] = size.prompts_per_step * size.group_size
    fields["rl/peak_memory_gib"] = (
        torch.cuda.max_memory_allocated(placement.device) / 2**30 if placement.device.type == "cuda" else None
    )
    metrics_file = out_dir / METRICS_FILE
    records = read_metrics(metrics_file) if metrics_file.exists() else []
    fields |= summarize(records, rows=size.prompts_per_step * size.group_size)
    fields["main_run_seconds"] = time.perf_counter() - wall0
    results = run_items(fields, size=size, device=device, model_dir=model_dir, work=work, only=items)
    fields["items"] = {r.name: {"passed": r.passed, "detail": r.detail} for r in results}
    fields["wall_seconds"] = time.perf_counter() - wall0
    return fields, results


#: Largest relative difference between a resumed run's steps and an uninterrupted run's (1e-6: float32 rounding
#: would already fail it; a resume is exact).
RESUME_RTOL = 1e-6
#: Metrics compared between the resumed and the uninterrupted run.
RESUME_KEYS = ("loss", "grad/norm", "reward/mean", "is/ess_ratio", "kl/k3", "lr")


@dataclass(frozen=True)
class ItemResult:
    """One item: passed or not, and the measured values behind the verdict."""

    name: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"  {'PASS' if self.passed else 'FAIL'}  {self.name}: {self.detail}"


def _short_overrides(size: Size, *, device: str, model_dir: Path, out_dir: Path, steps: int) -> list[str]:
    """A short run of the check's model (the items' runs): ``steps`` steps at lag 1, no eval past step 0."""
    base = train_overrides(size, device=device, model_dir=model_dir, out_dir=out_dir)
    keep = [o for o in base if not o.startswith(("steps=", "runtime.lag.k=", "eval.every=", "eval.n="))]
    return [*keep, f"steps={steps}", "runtime.lag.k=1", f"eval.every={steps}", "eval.n=8"]


def _finite_run(records: Sequence[Mapping[str, Any]], steps: int) -> str | None:
    """Why a run's records are not ``steps`` finite learner steps (None: they are)."""
    learned = [r for r in records if "loss" in r]
    if len(learned) != steps:
        return f"{len(learned)} learner steps, expected {steps}"
    for r in learned:
        bad = [k for k in ("loss", "grad/norm") if not math.isfinite(float(r.get(k, math.nan)))]
        if bad:
            return f"step {r['step']}: {', '.join(bad)} not finite"
    return None


def item_train(fields: Mapping[str, Any], size: Size, out_dir: Path) -> ItemResult:
    """The main run: exit 0, every step finite, and (the GPU size) the sampled accuracy higher at the end than at
    the start."""
    first, last = fields.get("rl/eval_acc_first"), fields.get("rl/eval_acc_last")
    why = _finite_run(read_metrics(out_dir / METRICS_FILE), size.steps) if fields.get("rl/exit_status") == 0 else (
        f"exit status {fields.get('rl/exit_status')}"
    )
    rises = first is not None and last is not None and last > first
    ok = why is None and (rises or not size.accuracy_rises)
    rule = "finite steps, accuracy rises" if size.accuracy_rises else "finite steps (smoke size)"
    seen = (f"warm start {fields.get('warm_start/accuracy')}, eval acc {first} -> {last}, responses "
            f"{_round(fields.get('rl/response_len_mean'))} tokens ({_round(fields.get('rl/truncated_mean'))} cut)")
    return ItemResult("train", ok, f"{why or 'finite steps'}; {seen} (rule: {rule})")


def _round(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def item_resume(size: Size, *, device: str, model_dir: Path, work: Path, steps: int = 6, stop: int = 3) -> ItemResult:
    """``steps`` steps uninterrupted, against ``stop`` steps, then ``resume=true`` to ``steps``: the resumed steps'
    metrics (:data:`RESUME_KEYS`) and the final state (the weights and the learner's: AdamW's moments and step
    counts, the version, the previous gradient) within :data:`RESUME_RTOL` of the uninterrupted run's."""
    from steadyrl.train.checkpoint import load_latest

    whole, parts = work / "resume_whole", work / "resume_parts"
    common = dict(device=device, model_dir=model_dir)
    if train_main(_short_overrides(size, **common, out_dir=whole, steps=steps)) != 0:
        return ItemResult("resume", False, "the uninterrupted run failed")
    if train_main(_short_overrides(size, **common, out_dir=parts, steps=stop)) != 0:
        return ItemResult("resume", False, "the first part failed")
    resumed = [o for o in _short_overrides(size, **common, out_dir=parts, steps=steps) if o != "overwrite=true"]
    if train_main([*resumed, "resume=true"]) != 0:
        return ItemResult("resume", False, "resume=true failed")
    a = {r["step"]: r for r in read_metrics(whole / METRICS_FILE) if "loss" in r}
    b = {r["step"]: r for r in read_metrics(parts / METRICS_FILE) if "loss" in r}
    if sorted(a) != sorted(b) or len(a) != steps:
        return ItemResult("resume", False, f"steps {sorted(b)} after the resume, {sorted(a)} uninterrupted")
    worst = 0.0
    for step in range(stop, steps):
        for key in RESUME_KEYS:
            x, y = a[step].get(key), b[step].get(key)
            if x is None and y is None:
                continue
            if x is None or y is None:
                return ItemResult("resume", False, f"step {step}: {key} only in one run")
            worst = max(worst, abs(float(x) - float(y)) / max(abs(float(x)), 1e-12))
    end_a, end_b = load_latest(whole), load_latest(parts)
    if end_a is None or end_b is None:
        return ItemResult("resume", False, "no final checkpoint")
    worst_state = 0.0
    for part in ("model", "learner"):
        xs, ys = list(_tensors(end_a.state[part])), list(_tensors(end_b.state[part]))
        if len(xs) != len(ys) or any(x.shape != y.shape for x, y in zip(xs, ys, strict=True)):
            return ItemResult("resume", False, f"the final {part} states differ in layout")
        for x, y in zip(xs, ys, strict=True):
            diff = (x.double() - y.double()).abs().max() if x.numel() else torch.zeros(())
            worst_state = max(worst_state, float(diff) / max(float(x.double().abs().max()) if x.numel() else 0, 1e-12))
    ok = max(worst, worst_state) <= RESUME_RTOL
    return ItemResult("resume", ok, f"max relative difference {worst:.3g} in the metrics of steps {stop}-"
                      f"{steps - 1}, {worst_state:.3g} in the final weights and learner state "
                      f"(rule: <= {RESUME_RTOL:g})")  # fmt: skip


def _stand_in_batch(model: torch.nn.Module, placement: Placement, seed: int) -> tuple[Any, torch.Tensor]:
    """Rollouts of the check's model on a few prompts (lag 0) and random 0/1 rewards, on the model's device."""
    from steadyrl.base.seeding import generator
    from steadyrl.rollout.sampler import generate

    tokenizer = build_char_tokenizer()
    prompts = [p.prompt for p in build_task(MAIN_JOB_TASK).problems("train", 4, seed=seed)]
    with torch.no_grad(), placement.autocast():
        rollouts = generate(model, tokenizer, prompts, group_size=4, max_new_tokens=8, version=0,
                            generator=generator(seed, "sample", device=placement.device))  # fmt: skip
    rewards = torch.randint(0, 2, (len(prompts) * 4,), generator=torch.Generator().manual_seed(seed)).float()
    return rollouts, rewards.to(placement.device)


def _load_policy(model_dir: Path, placement: Placement) -> torch.nn.Module:
    return placement.place(transformers.AutoModelForCausalLM.from_pretrained(model_dir))


def item_rollback(*, model_dir: Path, placement: Placement, work: Path) -> ItemResult:
    """The collapse guard (``mode=rollback``) fed an alarming step restores the snapshot of step 0: the weights equal
    it bit for bit, the learner's state sits on the model's device, and the next learner step runs."""
    from steadyrl.config.guard import GuardConfig
    from steadyrl.config.train import OptimConfig
    from steadyrl.control import build_controllers
    from steadyrl.methods import resolve_method
    from steadyrl.train.collapse_guard import CollapseGuard
    from steadyrl.train.learner import Learner

    model = _load_policy(model_dir, placement)
    spec = resolve_method("seq_tis+gac")
    learner = Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-3, optim=OptimConfig(),
                      log=lambda _: None, placement=placement)  # fmt: skip
    cfg = GuardConfig(mode="rollback", warmup=0, patience=1, smooth=1, kl_max=0.5)
    guard = CollapseGuard(cfg, out_dir=work / "rollback", model=model, learner=learner, base_lr=1e-3,
                          say=lambda _: None)  # fmt: skip
    guard.start(0)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for seed in range(2):
        learner.step(*_stand_in_batch(model, placement, seed))
    moved = any(not torch.equal(want[k], v) for k, v in model.state_dict().items())

    class Source:
        def restart(self, *, step: int, version: int, model: torch.nn.Module) -> None:
            return None

    action = guard.after_step(2, {"kl/k3": 10.0, "is/ess_ratio": 1.0, "grad/norm": 1.0}, source=Source())
    same = all(torch.equal(want[k], v) for k, v in model.state_dict().items())
    stray = [t.device for t in _tensors(learner.state_dict()) if t.device != placement.device and t.dim() > 0]
    out = learner.step(*_stand_in_batch(model, placement, 7))  # the step after a rollback (previous gradients)
    ok = action.kind == "rollback" and moved and same and not stray and out.applied == 1
    return ItemResult("rollback", ok, f"action {action.kind}, weights moved {moved}, restored bit for bit {same}, "
                      f"learner tensors off the device {len(stray)}, next step applied {out.applied}")  # fmt: skip


def _tensors(state: Any) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, Mapping):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _tensors(v)


def item_run(name: str, size: Size, *, device: str, model_dir: Path, work: Path, extra: Sequence[str],
             check: str | None = None) -> ItemResult:  # fmt: skip
    """A 3-step run with ``extra`` overrides: exit 0, 3 finite learner steps (and the metric ``check`` present)."""
    steps, out = 3, work / name
    keys = {e.split("=", 1)[0] for e in extra}
    base = _short_overrides(size, device=device, model_dir=model_dir, out_dir=out, steps=steps)
    status = train_main([*(o for o in base if o.split("=", 1)[0] not in keys), *extra])
    if status != 0:
        return ItemResult(name, False, f"{' '.join(extra)}: exit status {status}")
    records = read_metrics(out / METRICS_FILE)
    why = _finite_run(records, steps)
    if why is None and check is not None and not any(check in r for r in records):
        why = f"no {check} metric"
    return ItemResult(name, why is None, f"{' '.join(extra)}: " + (why or f"{steps} finite steps"))


def item_adapter(name: str, method: str, *, model_dir: Path, placement: Placement) -> ItemResult:
    """The adapters' step control (:class:`steadyrl.integrations.step_control.StepControl`) behind a stand-in
    trainer: two micro-batches per optimizer step, ``compute_loss`` on π_θ recomputed with gradient, the optimizer
    wrapped; two steps. Passes when the control metrics are finite, the lr is restored and the weights moved."""
    from steadyrl.integrations.step_control import StepControl
    from steadyrl.methods import compute_loss, resolve_method
    from steadyrl.rollout.logprobs import sequence_logprobs

    model = _load_policy(model_dir, placement)
    spec = resolve_method(method, {"advantage.type": "given"})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    control = StepControl(spec, framework="check")
    control.wrap(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(2):
        for micro in range(2):
            rollouts, rewards = _stand_in_batch(model, placement, 10 * step + micro)
            with placement.autocast():
                logp = sequence_logprobs(model, rollouts).logp
            adv = (rewards - rewards.mean()).unsqueeze(-1).expand_as(logp)
            batch = {"logp": logp, "behav_logp": rollouts.behav_logp - 0.05, "mask": rollouts.response_mask,
                     "advantages": adv}  # fmt: skip
            loss, metrics = compute_loss(spec, batch)
            control.record(metrics)
            (loss / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    values = control.last
    finite = bool(values) and all(math.isfinite(v) for v in values.values())
    restored = optimizer.param_groups[0]["lr"] == 1e-4
    moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    skipped = values.get("steadyrl/control/skip_step", 0.0) == 1.0
    ok = finite and restored and (moved or skipped)
    shown = ", ".join(f"{k.removeprefix('steadyrl/')} {v:.3g}" for k, v in values.items())
    return ItemResult(name, ok, f"{method}: {shown}; lr restored {restored}, weights moved {moved}")


#: Tool-use item: the main job's sums with a sandboxed calculator (the check's model was not warm-started on tool
#: calls, so it may call none: the item checks the multi-turn path runs and logs, not that tools help).
TOOL_OVERRIDES = (
    "task=chain_sum_tool", "task.min_terms=2", "task.max_terms=2", "task.min_digits=2", "task.max_digits=2",
    "tools.enabled=true", "tools.max_total_tokens=56", "tools.max_tool_tokens=12", "tools.sandbox.workers=2",
    "tools.sandbox.timeout_s=3", "tools.sandbox.cpu_s=2", "method=seq_tis",
)  # fmt: skip


def matmul_peak_flops(device: torch.device, *, reps: int = 10) -> tuple[float, str]:
    """The best FLOP/s of a square matmul on ``device`` (bf16 on a GPU, n = 8192; float32 on the CPU, n = 1024),
    measured now, in this process: the denominator of the learner's share."""
    cuda = device.type == "cuda"
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(reps + 2):  # two warm-up calls
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best, f"{str(dtype).removeprefix('torch.')} {n}x{n}"


def learner_flops(model: torch.nn.Module, rollouts: Any, *, chunked_head: bool) -> float:
    """FLOPs of one learner forward + backward on ``rollouts`` as the learner runs it (prompts shared: each group's
    padded prompt once, every row's padded response): 6 per body parameter per position, plus the output layer on
    response positions only (6·H·V, 8·H·V when the head runs in vocabulary chunks: one more forward in its backward).
    Attention scores and norms are not counted (sequences of ~20 tokens: under 1% here), so the share is a lower
    bound."""
    head = model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - head.numel()  # a tied embedding is the head: counted once
    groups = int(rollouts.group_ids.unique().numel()) if getattr(rollouts, "group_ids", None) is not None else len(
        rollouts.prompt_ids)
    prompt_positions = groups * rollouts.prompt_ids.shape[1]
    response_positions = rollouts.response_ids.numel()
    vocab, hidden = head.shape
    return 6.0 * body * (prompt_positions + response_positions) + (8.0 if chunked_head else 6.0) * hidden * vocab * (
        response_positions)


def item_profile(size: Size, *, model_dir: Path, placement: Placement) -> ItemResult:
    """One sampling step and one learner step (forward, backward, AdamW) of the main run's batch, each timed after a
    warm-up call, with its peak memory; the learner's FLOP/s (:func:`learner_flops`) against a bf16 matmul's peak
    measured in this process. Passes when every figure is finite and positive and the share lies in (0, 1]: a share
    above 1 means the FLOP count counts work that was not done."""
    from steadyrl.base.seeding import generator
    from steadyrl.core.vocab_chunks import DEFAULT_CHUNK_ELEMENTS
    from steadyrl.rollout.logprobs import sequence_logprobs
    from steadyrl.rollout.sampler import generate

    model = _load_policy(model_dir, placement)
    device, cuda = placement.device, placement.device.type == "cuda"
    tokenizer = build_char_tokenizer()
    prompts = [p.prompt for p in build_task(MAIN_JOB_TASK).problems("train", size.prompts_per_step, seed=SEED)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def peak_reset() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def peak_gib() -> float | None:
        return torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None

    def sample(seed: int) -> Any:
        with torch.no_grad(), placement.autocast():
            return generate(model, tokenizer, prompts, group_size=size.group_size, max_new_tokens=8, version=0,
                            generator=generator(seed, "sample", device=device))  # fmt: skip

    def learn(rollouts: Any) -> None:
        with placement.autocast():
            logp = sequence_logprobs(model, rollouts, share_prompts=True).logp
        mask = rollouts.response_mask
        loss = -(logp * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sample(SEED)  # warm-up
    sync()
    peak_reset()
    t0 = time.perf_counter()
    rollouts = sample(SEED + 1)
    sync()
    sample_s, sample_peak = time.perf_counter() - t0, peak_gib()
    learn(rollouts)  # warm-up
    sync()
    peak_reset()
    t0 = time.perf_counter()
    learn(rollouts)
    sync()
    learn_s, learn_peak = time.perf_counter() - t0, peak_gib()
    tokens = float(rollouts.response_mask.sum())
    steps = _learner_step_seconds(model, rollouts, size=size, placement=placement, sync=sync)
    head = model.get_output_embeddings().weight
    chunked = rollouts.response_ids.numel() * head.shape[0] > DEFAULT_CHUNK_ELEMENTS
    flops = learner_flops(model, rollouts, chunked_head=chunked)
    peak, peak_shape = matmul_peak_flops(device)
    share = flops / learn_s / peak
    figures = {"sampler_tokens_per_s": tokens / sample_s, "learner_tokens_per_s": tokens / learn_s,
               "learner_tflops": flops / learn_s / 1e12, "matmul_peak_tflops": peak / 1e12, "learner_share": share,
               "step_tokens_per_s": tokens / steps["one_pass"], "step_micro_tokens_per_s": tokens / steps["micro"]}
    ok = all(math.isfinite(v) and v > 0 for v in figures.values()) and share <= 1.0
    memory = "" if not cuda else f", peak memory sampling {sample_peak:.2f} GiB, learning {learn_peak:.2f} GiB"
    detail = (f"{size.prompts_per_step}x{size.group_size} rows, {tokens:.0f} response tokens: sampler "
              f"{figures['sampler_tokens_per_s']:.0f} tok/s, learner {figures['learner_tokens_per_s']:.0f} tok/s, "
              f"{figures['learner_tflops']:.3g} TFLOP/s = {share:.1%} of a {peak_shape} matmul's "
              f"{figures['matmul_peak_tflops']:.3g}{memory}; Learner.step (the main job's method, deterministic) "
              f"{figures['step_tokens_per_s']:.0f} tok/s in one pass, {figures['step_micro_tokens_per_s']:.0f} tok/s "
              f"in {steps['microbatches']:.0f} micro-batches of {size.microbatch_tokens} tokens")  # fmt: skip
    return ItemResult("profile", ok, detail)


def _learner_step_seconds(model: torch.nn.Module, rollouts: Any, *, size: Size, placement: Placement,
                          sync: Any) -> dict[str, float]:  # fmt: skip
    """Seconds of one ``Learner.step`` on ``rollouts`` with the main job's method and controllers, in one pass and
    in the RL run's micro-batches (``optim.microbatch_tokens``), each after a warm-up step, under deterministic
    algorithms as the RL run: against the single forward + backward above, what the learner's own work costs (the
    loss, controllers, metrics, the micro-batches' extra forward)."""
    from steadyrl.config.train import OptimConfig, TrainConfig
    from steadyrl.control import build_controllers
    from steadyrl.train.learner import Learner

    spec = TrainConfig().method.resolve()
    rewards = (torch.arange(rollouts.response_ids.shape[0], device=placement.device) % 2).float()
    out: dict[str, float] = {}
    with placement.runtime(deterministic=True):
        for name, budget in (("one_pass", None), ("micro", size.microbatch_tokens)):
            learner = Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-6,
                              optim=OptimConfig(microbatch_tokens=budget), log=lambda _: None,
                              placement=placement)  # fmt: skip
            learner.step(rollouts, rewards)  # warm-up
            sync()
            t0 = time.perf_counter()
            step = learner.step(rollouts, rewards)
            sync()
            out[name] = time.perf_counter() - t0
            if name == "micro":
                out["microbatches"] = float(step.metrics.get("train/microbatches", 1.0))
    return out


def run_items(fields: Mapping[str, Any], *, size: Size, device: str, model_dir: Path, work: Path,
              only: Sequence[str] = ITEMS) -> list[ItemResult]:  # fmt: skip
    """The items of :data:`ITEMS` (those in ``only``); an item that raises is a FAIL with the exception."""
    placement = Placement.from_names(device, PRECISION)
    common = dict(device=device, model_dir=model_dir, work=work)
    runs: dict[str, Any] = {
        "train": lambda: item_train(fields, size, work / "run"),
        "resume": lambda: item_resume(size, **common),
        "rollback": lambda: item_rollback(model_dir=model_dir, placement=placement, work=work),
        "vcpo": lambda: item_run("vcpo", size, **common, extra=["method=vcpo", "optim.microbatch_tokens=null"],
                                 check="grad/fused"),  # the fused norm pass (the main run micro-batches)
        "gac": lambda: item_run("gac", size, **common, extra=["method=seq_tis+gac"], check="gac/cos"),
        "bf16": lambda: item_run("bf16", size, **common, extra=["precision=bf16"]),
        "tools": lambda: item_run("tools", size, **common, extra=list(TOOL_OVERRIDES), check="tool/tokens_mean"),
        "local_sampler": lambda: item_run("local_sampler", size, **common, extra=[
            "runtime.mode=local", "runtime.lag.k=0", "rollout.device=learner", "runtime.threads=1"]),
        "adapter_ess_lr": lambda: item_adapter("adapter_ess_lr", "seq_tis+ess_lr", model_dir=model_dir,
                                               placement=placement),
        "adapter_gac": lambda: item_adapter("adapter_gac", "seq_tis+gac", model_dir=model_dir, placement=placement),
        "profile": lambda: item_profile(size, model_dir=model_dir, placement=placement),
    }
    results = []
    for name in ITEMS:
        if name not in only:
            continue
        try:
            results.append(runs[name]())
        except Exception as exc:  # a crash is the finding: report it as the item's failure
            results.append(ItemResult(name, False, f"raised {type(exc).__name__}: {exc}"))
        print(results[-1].line(), flush=True)
    return results


def format_fields(fields: Mapping[str, Any]) -> str:
    """One ``key: value`` line per field (floats to 4 significant digits)."""

    def show(v: Any) -> str:
        if isinstance(v, float) and not isinstance(v, bool):
            return f"{v:.4g}" if math.isfinite(v) else str(v)
        return "n/a" if v is None else str(v)

    width = max(len(k) for k in fields)
    return "\n".join(f"  {k:<{width}}  {show(v)}" for k, v in fields.items())


def main(argv: list[str] | None = None) -> int:
    """Run the check, print its fields, write the JSON; 0 if the RL run finished, else its exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=os.environ.get("GPU_CHECK_DEVICE", "cuda"), help="cuda | cuda:N | cpu "
                        "(default $GPU_CHECK_DEVICE, else cuda)")  # fmt: skip
    parser.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("GPU_CHECK_SIZE", "gpu"),
                        help="gpu (85M parameters, 30 steps) | tiny (the CPU smoke run); default $GPU_CHECK_SIZE, "
                        "else gpu")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help=f"write the fields here (default $OUT/{JSON_NAME} "
                        "when OUT is set)")  # fmt: skip
    parser.add_argument("--work-dir", default=None, help="keep the model and run here (default: a temporary "
                        "directory, removed)")  # fmt: skip
    parser.add_argument("--items", default=os.environ.get("GPU_CHECK_ITEMS", ",".join(ITEMS)),
                        help=f"comma-separated items to run after the main run (default: all: {','.join(ITEMS)})")
    args = parser.parse_args(argv)
    items = [i for i in args.items.split(",") if i]
    unknown = sorted(set(items) - set(ITEMS))
    if unknown:
        parser.error(f"unknown items {unknown}; known: {', '.join(ITEMS)}")
    json_path = args.json or (Path(os.environ["OUT"]) / JSON_NAME if os.environ.get("OUT") else None)
    with work_dir(args.work_dir) as work:
        fields, results = run_check(size_name=args.size, device=args.device, work=work, items=items)
    shown = {k: v for k, v in fields.items() if k != "items"}
    print(f"gpu_check ({args.size} on {fields['device']}):\n{format_fields(shown)}", flush=True)
    failed = [r.name for r in results if not r.passed]
    print("items:\n" + "\n".join(r.line() for r in results))
    print(f"gpu_check: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'} "
          f"({len(results) - len(failed)}/{len(results)} items passed)")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(fields, indent=2) + "\n")
        print(f"  written: {json_path}")
    status = fields["rl/exit_status"]
    if status != 0:
        return status if isinstance(status, int) else 1
    return 1 if failed else 0


if __name__ == "__main__":
    status = main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
    sys.exit(status)
