"""Learner step time of ``steadyrl train`` for the default model, per method, next to the sampling time of a step.

The batch is the main job's (``TrainConfig`` defaults): 64 prompts × G = 8 responses to the main job's chain_sum
prompts, sampled by the default architecture (hidden 128, 4 layers, ~1M parameters) with ``max_new_tokens`` tokens
(4 ≈ a chain_sum answer + EOS), with the main job's thread count (2). The weights are a seeded random
initialization, so no warm start is needed; the step time depends on the shapes, not the weights. One learner step
= forward with gradient, ``compute_loss`` (plus the per-trajectory gradient norms OPOB needs, for vcpo), backward,
controllers, clipping, AdamW (:class:`steadyrl.train.learner.Learner`). Times are medians over ``--repeats`` steps
after ``--warmup`` steps, the methods interleaved (one step of each in turn) so that load changes hit all alike;
ratios are against the first method and against one sampling call of the same batch.

A method may end in ``@fused_shared`` (the default), ``@fused``, ``@ghost``, ``@vmap`` or ``@naive``: how the learner
gets the per-trajectory gradient norms of VCPO's baseline (``Learner(grad_norms=...)``): fused into the step's own
forward and backward (``fused_shared``: on the shared-prompt forward, each distinct prompt once; ``fused``: every row's
prompt forwarded), or a separate pass first
(``naive`` = one backward per trajectory, the VCPO authors' micro-batch-1 method).

    .venv/bin/python benchmarks/learner_step.py [--threads 2] [--repeats 20] [--methods grpo,vcpo,vcpo@naive]
    .venv/bin/python benchmarks/learner_step.py --prompts 8     # 8 x G=8 = 64 trajectories
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import time
from functools import partial
from pathlib import Path

import torch

from steadyrl.config.train import OptimConfig, TrainConfig
from steadyrl.control import build_controllers
from steadyrl.methods import resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.sampler import generate
from steadyrl.tasks import build_task
from steadyrl.train.learner import Learner
from timing import timed

DEFAULT_METHODS = "grpo,seq_tis,seq_tis+ess_lr,seq_tis+gac,vcpo,vcpo@fused,vcpo@ghost,vcpo@naive"


def provenance() -> str:
    """One line for the record: UTC date, commit (``+dirty`` with uncommitted changes), machine and CPU count."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    except OSError:
        pass
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{date}, commit {commit}, {platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} CPUs"


def exact_norm_floor(rollouts) -> tuple[int, int, int]:
    """Token passes of the model body in one learner step: (grpo, vcpo with its norm pass on the shared-prompt
    forward, vcpo on the one-pass forward), padded shapes as they run (U distinct prompts of P positions, N rows of T).

    A pass is one position through the body's matmuls: a forward, a backward to the inputs, or a weight gradient
    (the three cost the same per Linear). GRPO's recompute forwards each prompt once per group and backpropagates
    it once: 3 (U P + N T). VCPO's per-trajectory norms ‖∇θ log π(y_i)‖² need row i's own output gradients at the
    prompt positions (its response reads the prompt's keys and values), so the backward to the inputs covers N P
    prompt positions however the forward ran; the weight gradient is formed once from the stored pieces. Shared:
    (U P + N T) + (N P + N T) + (U P + N T); one-pass: 3 N (P + T). The Gram sums of the norms come on top, so
    these are lower bounds of the exact method's cost.
    """
    N, T = rollouts.response_ids.shape
    P = rollouts.prompt_ids.shape[1]
    U = int(torch.unique(rollouts.prompt_ids, dim=0).shape[0])
    return 3 * (U * P + N * T), 2 * U * P + N * P + 3 * N * T, 3 * N * (P + T)


def main() -> None:
    defaults = TrainConfig.model_fields
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=TrainConfig().runtime.threads, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated method specs")
    parser.add_argument("--prompts", type=int, default=defaults["prompts_per_step"].default, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=defaults["group_size"].default, help="G")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="response length cap")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyArchConfig(), tokenizer=tokenizer, seed=0)
    params = sum(p.numel() for p in model.parameters())
    task = build_task(TrainConfig().task)
    prompts = [p.prompt for p in task.problems("train", args.prompts, seed=0)]

    def sample():
        return generate(
            model, tokenizer, prompts, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
            generator=torch.Generator().manual_seed(0), version=0,
        )

    rollouts = sample()
    rewards = (torch.arange(len(rollouts)) % 3 == 0).float()
    sample_s = timed(sample, repeats=args.repeats, warmup=args.warmup).median
    B, T = rollouts.response_ids.shape
    print(provenance())
    print(f"default model: {params / 1e6:.2f}M parameters, {args.threads} thread(s); batch {args.prompts} prompts "
          f"x G={args.group_size} = {B} responses, T={T} tokens")
    names = args.methods.split(",")
    steps = {}
    for name in names:
        spec_name, _, mode = name.partition("@")
        spec = resolve_method(spec_name)
        learner = Learner(
            model=build_tiny_model(TinyArchConfig(), tokenizer=tokenizer, seed=0), method=spec,
            controllers=build_controllers(spec), lr=1e-4, optim=OptimConfig(), log=lambda _: None,
            grad_norms=mode or None,
        )
        steps[name] = partial(learner.step, rollouts, rewards)
    # Interleaved: repeat r times every method once, so that a change of machine load hits all methods alike.
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.warmup + args.repeats):
        for name in names:
            t0 = time.perf_counter()
            steps[name]()
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    first = names[0]
    base = statistics.median(times[first])
    print(f"{'method':<22} {'learner step ms':>16} {'vs ' + first:>12} {'vs sampling':>12}")
    for name in names:
        seconds = statistics.median(times[name])
        print(f"{name:<22} {seconds * 1e3:>16.1f} {seconds / base:>11.2f}x {seconds / sample_s:>11.2f}x")
    print(f"{'sampling':<22} {sample_s * 1e3:>16.1f}   (generate, {args.max_new_tokens} new tokens, KV cache)")
    grpo, shared, one_pass = exact_norm_floor(rollouts)
    print(f"exact-norm floor (body token passes, Gram sums not counted): grpo {grpo}, vcpo shared-prompt {shared} "
          f"({shared / grpo:.2f}x), one-pass {one_pass} ({one_pass / grpo:.2f}x)")


if __name__ == "__main__":
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
