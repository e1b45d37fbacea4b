"""The GPU check (issue 15): warm-start a ~85M-parameter Llama on the GPU, then 30 steps of ``steadyrl train`` there
in bf16-mixed precision at lag 0, and print what a GPU run needs to show (docs/scale.md, "GPU check").

1. Build the embedded Llama (:func:`steadyrl.models.build_tiny_model`) at the size ``--size`` names (``gpu``: hidden
   768, 12 layers, 12 heads, MLP 2048, 85.0M parameters; ``tiny``: hidden 32, 2 layers, the CPU smoke run), place it
   on ``--device`` (:class:`steadyrl.base.device.Placement`), warm-start it there on the main job's chain_sum
   (two 2-digit terms) for at most ``warm_start.max_steps`` steps, and save it with its tokenizer.
2. Run ``steadyrl train`` in-process on that directory (``model.name=<dir>``) with ``precision=bf16-mixed``,
   ``lag=0`` (so every step logs ``mismatch/*``, the bf16 KV-cache sampler against the learner's one-pass recompute)
   and an ``optim.microbatch_tokens`` budget below the batch's tokens (so the learner micro-batches).
3. Print, and write to ``$OUT/gpu_check.json`` when ``OUT`` is set (or to ``--json``), the fields of
   :func:`summarize`.

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from steadyrl.base.device import Placement
from steadyrl.models import TinyArchConfig, WarmStartConfig, build_char_tokenizer, build_tiny_model, warm_start
from steadyrl.tasks import build_task
from steadyrl.train.config import MAIN_JOB_TASK
from steadyrl.train.entry import main as train_main
from steadyrl.train.metrics import METRICS_FILE, read_metrics

#: The file written under ``$OUT`` (the device machine's folder of files that come back).
JSON_NAME = "gpu_check.json"
#: Precision of the warm start and the RL run: bf16 autocast, fp32 weights, AdamW and output layer.
PRECISION = "bf16-mixed"
#: Seed of the model's initialization, the warm start and the RL run.
SEED = 0


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

    The warm start runs under the placement's autocast, as the RL run's forwards do.
    """
    tokenizer = build_char_tokenizer()
    model = placement.place(build_tiny_model(size.arch, tokenizer=tokenizer, seed=SEED))
    task = build_task(task_cfg)
    with placement.autocast():
        report = warm_start(model, tokenizer, task=task, cfg=size.warm_start, seed=SEED, progress=False)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    fields = {
        "parameters": parameter_count(model),
        "warm_start/steps": report.steps,
        "warm_start/seconds": report.seconds,
        "warm_start/accuracy": report.accuracy,
        "warm_start/reached_target": report.reached_target,
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
        "lag=0",
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


def run_check(*, size_name: str, device: str, work: Path) -> dict[str, Any]:
    """Steps 1–3 in ``work``; returns the fields (also when the RL run fails: ``rl/exit_status`` says so)."""
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
    t0 = time.perf_counter()
    status = train_main(train_overrides(size, device=device, model_dir=model_dir, out_dir=out_dir))
    fields["rl/seconds"] = time.perf_counter() - t0
    fields["rl/exit_status"] = status
    fields["rl/microbatch_tokens"] = size.microbatch_tokens
    fields["rl/batch_rows"] = size.prompts_per_step * size.group_size
    fields["rl/peak_memory_gib"] = (
        torch.cuda.max_memory_allocated(placement.device) / 2**30 if placement.device.type == "cuda" else None
    )
    fields |= summarize(read_metrics(out_dir / METRICS_FILE), rows=size.prompts_per_step * size.group_size)
    fields["wall_seconds"] = time.perf_counter() - wall0
    return fields


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
    args = parser.parse_args(argv)
    json_path = args.json or (Path(os.environ["OUT"]) / JSON_NAME if os.environ.get("OUT") else None)
    with work_dir(args.work_dir) as work:
        fields = run_check(size_name=args.size, device=args.device, work=work)
    print(f"gpu_check ({args.size} on {fields['device']}):\n{format_fields(fields)}", flush=True)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(fields, indent=2) + "\n")
        print(f"  written: {json_path}")
    return int(fields["rl/exit_status"])


if __name__ == "__main__":
    sys.exit(main())
