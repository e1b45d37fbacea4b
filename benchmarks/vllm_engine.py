"""The vLLM engine against the transformers engine on the embedded default model: speed, mismatch, and its effect.

Three parts, in one run (``--parts``):

* ``speed``: one batch of the main job (64 prompts × G = 8, ``rollout.max_new_tokens`` = 12, T = 1) sampled by
  :func:`steadyrl.rollout.sampler.generate` (torch threads ``--threads``) and by :class:`VLLMEngine` (``--dtypes``),
  median of ``--repeats`` after one warm-up: generated tokens per second; plus the engine's start-up and the time of
  one in-place weight update.
* ``mismatch``: engine-vs-trainer mismatch at lag 0 (same weights) for each ``--dtypes``: the engine samples a batch,
  the float32 transformers model (the trainer) recomputes π at the sampling temperature, and
  :func:`~steadyrl.rollout.vllm_engine.engine_mismatch` reports ``mismatch/ess_ratio``, ``mismatch/kl_k3``,
  ``mismatch/max_abs_dlogp`` (the transformers engine's own row is the same recompute of its own samples).
* ``train``: short ``steadyrl train rollout.engine=vllm runtime.lag.k=0`` runs of ``--methods`` (default: grpo, i.e. no
  correction, and seq_tis) at ``--train-dtype``: does the correction matter when the only off-policyness is the
  engine's? Reports reward, accuracy and the mismatch the learner saw.

Run it with the vLLM interpreter (``bash scripts/setup_vllm.sh`` first)::

    .venv-vllm/bin/python benchmarks/vllm_engine.py                                   # all three parts
    .venv-vllm/bin/python benchmarks/vllm_engine.py --parts speed --repeats 5
    .venv-vllm/bin/python benchmarks/vllm_engine.py --parts train --train-steps 60 --train-dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from steadyrl.config.io import load_config
from steadyrl.config.train import MAIN_JOB_TASK, TrainConfig
from steadyrl.models import ModelConfig, load_policy
from steadyrl.rollout import Rollouts, generate
from steadyrl.rollout.vllm_engine import VLLMEngine, VLLMSettings, engine_mismatch
from steadyrl.tasks import build_task
from steadyrl.train.entry import run
from steadyrl.train.metrics import read_metrics

#: The main job's batch and response cap (TrainConfig defaults).
PROMPTS, GROUP, NEW_TOKENS = 64, 8, 12


def load_default() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, list[str]]:
    """The warm-started default model (built and cached on first use) and 64 eval prompts of the main job's task."""
    task = build_task(MAIN_JOB_TASK)
    policy = load_policy(ModelConfig(), task, seed=0, progress=False)
    prompts = [p.prompt for p in task.problems("eval", PROMPTS, seed=0)]
    return policy.model, policy.tokenizer, prompts


def speed(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], args: argparse.Namespace
) -> None:
    """All engines are started first, then timed in interleaved rounds (load changes on a shared machine hit all)."""
    torch.set_num_threads(args.threads)
    engines: dict[str, VLLMEngine] = {}
    starts: dict[str, float] = {}
    try:
        for dtype in args.dtypes:
            t0 = time.perf_counter()
            engines[dtype] = VLLMEngine(model, tokenizer, settings=VLLMSettings(dtype=dtype))
            starts[dtype] = time.perf_counter() - t0
        samplers: dict[str, Callable[[int], Rollouts]] = {
            f"transformers generate ({args.threads} threads)": lambda seed: generate(
                model,
                tokenizer,
                prompts,
                group_size=GROUP,
                max_new_tokens=NEW_TOKENS,
                generator=torch.Generator().manual_seed(seed),
                version=0,
            ),
        }
        for dtype, engine in engines.items():
            samplers[f"vLLM {dtype}"] = lambda seed, e=engine: e.generate(
                prompts, group_size=GROUP, max_new_tokens=NEW_TOKENS, seed=seed
            )
        tokens = {name: int(fn(0).response_mask.sum()) for name, fn in samplers.items()}  # warm-up
        times: dict[str, list[float]] = {name: [] for name in samplers}
        for rep in range(args.repeats):
            for name, fn in samplers.items():
                t0 = time.perf_counter()
                fn(rep + 1)
                times[name].append(time.perf_counter() - t0)
        updates = {}
        for dtype, engine in engines.items():
            updates[dtype] = []
            for v in range(1, 4):
                engine.update_weights(model, version=v)
                updates[dtype].append(engine.last_update_s)
    finally:
        for engine in engines.values():
            engine.close()
    base = None
    print(f"speed: {PROMPTS} prompts x G={GROUP}, max_new_tokens={NEW_TOKENS}, T=1; median of {args.repeats} "
          "interleaved rounds")  # fmt: skip
    for name, ts in times.items():
        med = statistics.median(ts)
        rate = tokens[name] / med
        base = base or rate
        print(f"  {name:<32} {tokens[name]:>6} tokens  {med:6.2f} s  {rate:8,.0f} tokens/s  {rate / base:5.2f}x  "
              f"(min {min(ts):.2f} s, max {max(ts):.2f} s)")  # fmt: skip
    for dtype in engines:
        print(f"  vLLM {dtype}: start-up {starts[dtype]:.1f} s, in-place weight update "
              f"{statistics.median(updates[dtype]):.2f} s (median of 3)")  # fmt: skip


def mismatch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], args: argparse.Namespace
) -> None:
    T = args.temperature
    print(f"mismatch at lag 0 (trainer: float32 transformers at T={T}; {PROMPTS} prompts x G={GROUP})")
    print(f"  {'engine':<22} {'ess_ratio':>10} {'kl_k3':>10} {'max|dlogp|':>11} {'mean|dlogp|':>12}")
    rows: list[tuple[str, Rollouts, dict[str, float]]] = []
    r = generate(model, tokenizer, prompts, group_size=GROUP, max_new_tokens=NEW_TOKENS, temperature=T,
                 generator=torch.Generator().manual_seed(0), version=0)  # fmt: skip
    rows.append(("transformers float32", r, engine_mismatch(model, r, temperature=T)))
    for dtype in args.dtypes:
        with VLLMEngine(model, tokenizer, settings=VLLMSettings(dtype=dtype)) as engine:
            r = engine.generate(prompts, group_size=GROUP, max_new_tokens=NEW_TOKENS, temperature=T, seed=0)
        rows.append((f"vLLM {dtype}", r, engine_mismatch(model, r, temperature=T)))
    for name, r, m in rows:
        from steadyrl.rollout.logprobs import sequence_logprobs

        with torch.no_grad():
            d = (sequence_logprobs(model, r, temperature=T).logp - r.behav_logp)[r.response_mask].abs().mean()
        print(f"  {name:<22} {m['mismatch/ess_ratio']:>10.4f} {m['mismatch/kl_k3']:>10.2e} "
              f"{m['mismatch/max_abs_dlogp']:>11.2e} {float(d):>12.2e}")  # fmt: skip


def train_runs(args: argparse.Namespace) -> None:
    print(f"train: steadyrl train rollout.engine=vllm rollout.vllm.dtype={args.train_dtype} runtime.lag.k=0, "
          f"{args.train_steps} steps, seed {args.seed}")  # fmt: skip
    print(f"  {'method':<10} {'reward first10':>14} {'reward last10':>13} {'eval/acc base->final':>21} "
          f"{'min mismatch ess':>16} {'max mismatch k3':>15} {'max is/weight':>13} {'s/step':>7}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            out = Path(tmp) / method
            cfg = load_config(TrainConfig, overrides=[
                "runtime.lag.k=0", f"method={method}", f"steps={args.train_steps}", f"seed={args.seed}",
                "rollout.engine=vllm",
                f"rollout.vllm.dtype={args.train_dtype}", "runtime.threads=1", "log.progress=false", "log.plot=false",
                "checkpoint.every=0", f"eval.every={args.train_steps}", f"out_dir={out}",
            ])  # fmt: skip
            run(cfg)
            recs = read_metrics(out / "metrics.jsonl")
            steps = [r for r in recs if "loss" in r]
            acc = [r["eval/acc"] for r in recs if "eval/acc" in r]
            reward = [r["reward/mean"] for r in steps]
            print(f"  {method:<10} {statistics.fmean(reward[:10]):>14.3f} {statistics.fmean(reward[-10:]):>13.3f} "
                  f"{acc[0]:>10.3f} -> {acc[-1]:.3f} {min(r['mismatch/ess_ratio'] for r in steps):>16.4f} "
                  f"{max(r['mismatch/kl_k3'] for r in steps):>15.2e} {max(r['is/weight_max'] for r in steps):>13.3f} "
                  f"{statistics.median(r['time/step_s'] for r in steps):>7.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="speed,mismatch,train")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the transformers engine")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    parser.add_argument("--methods", type=lambda s: s.split(","), default=["grpo", "seq_tis"])
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--train-dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    parts = args.parts.split(",")
    if {"speed", "mismatch"} & set(parts):
        model, tokenizer, prompts = load_default()
        if "speed" in parts:
            speed(model, tokenizer, prompts, args)
        if "mismatch" in parts:
            mismatch(model, tokenizer, prompts, args)
    if "train" in parts:
        train_runs(args)


if __name__ == "__main__":
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
