"""Step time of ``steadyrl train method=grpo`` against TRL's ``GRPOTrainer`` on the CPU, interleaved in one process.

Both trainers run GRPO on the same model directory (the embedded default, a 1M-parameter ``LlamaForCausalLM`` with the
character tokenizer, warm-started on chain_sum and cached), the same chain_sum train prompts scored by the same
verifier (``ChainSumTask.score``), 16 prompts × 8 responses per optimizer step, the same response budget, lr, AdamW
(β, ε, no weight decay), gradient clipping at 1.0, temperature 1 without truncation, and one torch thread. Runs
alternate between the two (order ABBA… per repeat) so that load from other jobs on the machine hits both alike; the
first step of every run is dropped (first-call costs, and steadyrl's step-0 evaluation).

Two response budgets are measured (``--tokens``):

* ``12``: the main job's budget; the warm-started model answers in about 4 tokens and both stop when every row
  has emitted EOS;
* ``48`` *forced*: a copy of the model directory whose stop token is an id outside the model's vocabulary (the
  tokenizer gets one added token ``<never>`` as EOS, config and generation config name it), so no row can ever stop
  and both sides generate exactly 48 tokens per row. The old ``<eos>`` becomes an ordinary token.

What each side runs:

* steadyrl: ``steadyrl.train.entry.main`` (the ``steadyrl train`` command itself, in process) with ``method=grpo
  runtime.lag.k=0 runtime.threads=1``, eval only at step 0 (on 16 problems) and at the end, no checkpoints between;
  per-step times are its ``time/step_s``, ``time/batch_s`` (sampling + scoring = *generation*) and ``time/learn_s``
  (*learner*) of ``metrics.jsonl``.
* TRL: ``GRPOTrainer`` with ``num_generations=8``, ``per_device_train_batch_size=128``, one gradient-accumulation
  step (one optimizer step per 128 completions, so no old-log-prob pass), ``beta=0`` (no reference model),
  ``loss_type="grpo"`` (per-sequence token mean, then mean over sequences: steadyrl's grpo preset aggregation
  ``seq-mean-token-mean``), ``epsilon=0.2`` (steadyrl's PPO clip), ``scale_rewards="group"`` (steadyrl's GRPO
  advantage divides by the group std), constant lr, ``adamw_torch``, no vLLM, logging, saving and tqdm off. A step is
  the wall time between two ``on_step_end`` callbacks; *generation* is the time in
  ``_generate_and_score_completions`` (tokenize, ``model.generate``, rewards, advantages), *learner* the rest
  (so its *other* column is 0). steadyrl's *other* is ``time/step_s`` − generation − learner: the loop's metrics and
  the weight hand-over to the sampler (``publish``).

Every time is given twice: wall clock, and process CPU time (with one thread, the time spent descheduled while
other jobs run is not counted, so the CPU-time ratios move much less from run to run on a shared machine).

Derived columns, on CPU time: generated tokens/s of the sampler (response tokens including EOS / generation time),
learner tokens/s (rows × (prompt + mean response) tokens / learner time) and the learner's achieved FLOP/s ≈
6 · params · tokens (forward + backward; attention and the padding are not counted) as a fraction of a matmul peak
timed in the same run (the best of a few 1024³ fp32 ``torch.matmul`` on one thread), and the sampler's ≈
2 · params · generated tokens (no-grad forward; prefill and attention not counted) likewise.

Usage::

    .venv/bin/python benchmarks/peer_trl.py                       # --steps 6 --tokens 12,48 --free 12 --repeats 2
    .venv/bin/python benchmarks/peer_trl.py --quick               # smoke test: 3 steps, 12 tokens, 1 repeat
    .venv/bin/python benchmarks/peer_trl.py --quick --tiny        # ... on a random tiny model (no warm start)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from steadyrl.config.train import TrainConfig
from steadyrl.models import ModelConfig, load_policy
from steadyrl.tasks import ChainSumConfig, Problem, Task, build_task

#: Prompts per optimizer step and responses per prompt (both sides).
PROMPTS, GROUP = 16, 8
#: The added stop token of the forced-length copy (its id is the old vocabulary size: never sampled).
NEVER_TOKEN = "<never>"
#: Side of the square fp32 matmul that measures the machine's peak, and how many times it is timed.
PEAK_N, PEAK_REPEATS = 1024, 5
#: Problems in the train pool both sides draw from (steadyrl's ``data.train_pool`` default).
TRAIN_POOL = TrainConfig().data.train_pool


class StepTime(NamedTuple):
    """One optimizer step of one trainer: wall seconds in all, in generation and in the learner; response tokens;
    the same three in process CPU time (one thread: time spent descheduled while other jobs run is not counted)."""

    step_s: float
    gen_s: float
    learn_s: float
    tokens: int
    step_cpu: float
    gen_cpu: float
    learn_cpu: float


class Clocks(NamedTuple):
    """Wall and process CPU seconds of one call."""

    wall: float
    cpu: float


@contextlib.contextmanager
def clocked(owner: Any, name: str, log: list[Clocks]) -> Iterator[None]:
    """Within the block, every call of ``owner.name`` (a class or an object) appends its :class:`Clocks` to ``log``."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            log.append(Clocks(time.perf_counter() - wall, time.process_time() - cpu))

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        if isinstance(owner, type):
            setattr(owner, name, inner)
        else:
            delattr(owner, name)


class Setting(NamedTuple):
    """A response budget and the model directory that realises it."""

    tokens: int
    forced: bool
    model_dir: Path


# ------------------------------------------------------------------------------------------------- the model
def default_model_dir(seed: int) -> Path:
    """The cached warm-started default model for chain_sum (built on first use, a few minutes)."""
    return Path(load_policy(ModelConfig(), build_task(ChainSumConfig()), seed=seed, progress=False).path)


def forced_length_copy(src: Path, dst: Path) -> Path:
    """Copy model directory ``src`` to ``dst`` with a stop token no row can sample (an id outside the vocabulary)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    shutil.copytree(src, dst, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(src)
    vocab = int(AutoConfig.from_pretrained(src).vocab_size)
    tokenizer.add_special_tokens({"eos_token": NEVER_TOKEN})
    if tokenizer.eos_token_id != vocab:
        raise ValueError(f"the added stop token got id {tokenizer.eos_token_id}, expected {vocab} (outside the model)")
    tokenizer.save_pretrained(dst)
    config = AutoConfig.from_pretrained(src)
    config.eos_token_id = vocab
    config.save_pretrained(dst)
    generation = GenerationConfig.from_pretrained(src)
    generation.eos_token_id = vocab
    generation.save_pretrained(dst)
    return dst


def count_params(model_dir: Path) -> int:
    """Parameters of the model in ``model_dir`` (tied tensors once)."""
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def prompt_tokens(model_dir: Path, problems: Sequence[Problem]) -> float:
    """Mean encoded prompt length (BOS included) over ``problems``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return statistics.fmean(len(ids) for ids in tokenizer([p.prompt for p in problems])["input_ids"])


# ------------------------------------------------------------------------------------------------ steadyrl
def steadyrl_run(setting: Setting, *, steps: int, seed: int, lr: float, out_dir: Path) -> list[StepTime]:
    """``steadyrl train method=grpo runtime.lag.k=0`` on ``setting`` for ``steps`` steps: the wall times of its metrics,
    the CPU times of the loop's step, of the rollout source's ``next_batch`` and of ``Learner.step``."""
    from steadyrl.runtime.lag import LagSource
    from steadyrl.train import loop
    from steadyrl.train.entry import main
    from steadyrl.train.learner import Learner

    argv = [
        "method=grpo", "runtime.lag.k=0", f"steps={steps}", f"seed={seed}", f"lr={lr}",
        f"model.name={setting.model_dir}",
        f"prompts_per_step={PROMPTS}", f"group_size={GROUP}", f"rollout.max_new_tokens={setting.tokens}",
        "rollout.temperature=1.0", "runtime.threads=1", "eval.every=0", f"eval.n={PROMPTS}", "checkpoint.every=0",
        "log.progress=false", "log.plot=false", f"out_dir={out_dir}", "overwrite=true",
    ]  # fmt: skip
    step, gen, learn = [], [], []
    with (
        contextlib.redirect_stdout(io.StringIO()),
        clocked(loop._Run, "step", step),
        clocked(LagSource, "next_batch", gen),
        clocked(Learner, "step", learn),
    ):
        status = main(argv)
    if status != 0:
        raise RuntimeError(f"steadyrl train {' '.join(argv)} exited with {status}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rows = PROMPTS * GROUP
    records = [r for r in records if "time/learn_s" in r]
    if not len(records) == len(step) == len(gen) == len(learn) == steps:
        raise RuntimeError(f"{len(records)} metric lines, {len(step)} steps, {len(gen)} batches, {len(learn)} updates")
    return [
        StepTime(r["time/step_s"], r["time/batch_s"], r["time/learn_s"], round(r["response/len_mean"] * rows),
                 s.cpu, g.cpu, u.cpu)
        for r, s, g, u in zip(records, step, gen, learn, strict=True)
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------------------- TRL
def trl_run(
    setting: Setting, *, steps: int, seed: int, lr: float, out_dir: Path, task: Task, pool: Sequence[Problem]
) -> list[StepTime]:
    """TRL's ``GRPOTrainer`` with the matching configuration (module docstring) for ``steps`` steps."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    optim = TrainConfig().optim
    by_prompt = {p.prompt: p for p in pool}
    tokens: list[int] = []

    def chain_sum_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                         **_: Any) -> list[float]:  # fmt: skip
        """The task's verifier, as steadyrl scores (``ChainSumTask.score``); also counts the generated tokens."""
        tokens.append(sum(len(ids) for ids in completion_ids))
        return [task.score(by_prompt[p], c) for p, c in zip(prompts, completions, strict=True)]

    args = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, seed=seed, learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, optim="adamw_torch", adam_beta1=optim.betas[0], adam_beta2=optim.betas[1],
        adam_epsilon=optim.eps, weight_decay=optim.weight_decay, max_grad_norm=optim.grad_clip,
        per_device_train_batch_size=PROMPTS * GROUP, gradient_accumulation_steps=1, num_generations=GROUP,
        max_completion_length=setting.tokens, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="grpo",
        epsilon=0.2, scale_rewards="group", use_vllm=False, use_cpu=True, bf16=False, fp16=False,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(setting.model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(setting.model_dir, dtype=torch.float32)
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in pool]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=chain_sum_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer)  # fmt: skip
    gen: list[Clocks] = []
    ends: list[Clocks] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a: Any, **kw: Any) -> None:
            ends.append(Clocks(time.perf_counter(), time.process_time()))

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            ends.append(Clocks(time.perf_counter(), time.process_time()))
            if torch.get_num_threads() != 1:
                raise RuntimeError(f"TRL trains with {torch.get_num_threads()} torch threads, not 1")

    trainer.add_callback(StepClock())
    with (
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
        clocked(trainer, "_generate_and_score_completions", gen),
    ):
        warnings.simplefilter("ignore")
        trainer.train()
    walls = [Clocks(b.wall - a.wall, b.cpu - a.cpu) for a, b in itertools.pairwise(ends)]
    if not len(walls) == len(gen) == len(tokens) == steps:
        raise RuntimeError(f"TRL ran {len(walls)} steps, {len(gen)} generations, {len(tokens)} scorings")
    return [
        StepTime(w.wall, g.wall, w.wall - g.wall, n, w.cpu, g.cpu, w.cpu - g.cpu)
        for w, g, n in zip(walls, gen, tokens, strict=True)
    ]


# ---------------------------------------------------------------------------------------------- measurement
def matmul_peak(n: int = PEAK_N, repeats: int = PEAK_REPEATS) -> float:
    """FLOP/s (CPU time) of the best of ``repeats`` fp32 ``n × n`` matmuls on the current torch threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    best = min(_seconds(lambda: torch.matmul(a, b)) for _ in range(repeats))
    return 2 * n**3 / best


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


class Summary(NamedTuple):
    """Medians over the timed steps of one trainer in one setting (``other_s``: of step − generation − learner)."""

    step_s: float
    gen_s: float
    learn_s: float
    other_s: float
    tokens: float
    n: int
    step_cpu: float
    gen_cpu: float
    learn_cpu: float


def summarize(steps: Sequence[StepTime]) -> Summary:
    """Medians of each column (the tokens as a mean)."""

    def med(f: Callable[[StepTime], float]) -> float:
        return statistics.median(f(s) for s in steps)

    return Summary(
        med(lambda s: s.step_s), med(lambda s: s.gen_s), med(lambda s: s.learn_s),
        med(lambda s: s.step_s - s.gen_s - s.learn_s), statistics.fmean(s.tokens for s in steps), len(steps),
        med(lambda s: s.step_cpu), med(lambda s: s.gen_cpu), med(lambda s: s.learn_cpu),
    )  # fmt: skip


def measure(setting: Setting, *, steps: int, repeats: int, seed: int, lr: float, task: Task,
            pool: Sequence[Problem], peaks: list[float], work: Path) -> dict[str, list[StepTime]]:  # fmt: skip
    """Per-step times of both trainers, runs alternating (ABBA…), the first step of each run dropped."""
    out: dict[str, list[StepTime]] = {"steadyrl": [], "trl": []}
    order = ("steadyrl", "trl")
    for r in range(repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            run_dir = work / f"{name}-{setting.tokens}-{r}"
            if name == "steadyrl":
                times = steadyrl_run(setting, steps=steps, seed=seed + r, lr=lr, out_dir=run_dir)
            else:
                times = trl_run(setting, steps=steps, seed=seed + r, lr=lr, out_dir=run_dir, task=task, pool=pool)
            out[name] += times[1:]
            peaks.append(matmul_peak())
            print(f"  {setting.tokens:>3} tokens, repeat {r}, {name:<8}: median step "
                  f"{summarize(times[1:]).step_s:.3f} s", flush=True)  # fmt: skip
    return out


def report(results: dict[Setting, dict[str, Summary]], *, params: int, prompt_len: float, peak: float) -> str:
    """The tables: per-step medians and ratios, then throughput and FLOP/s fractions."""
    rows = PROMPTS * GROUP
    lines = [
        f"per-step medians (seconds); ratio = steadyrl / TRL; {PROMPTS} prompts x {GROUP}, 1 thread each",
        f"{'tokens':<10}{'trainer':<10}{'steps':>6}{'step':>8}{'gen':>8}{'learner':>9}{'other':>8}{'resp tok':>10}",
    ]
    for setting, pair in results.items():
        label = f"{setting.tokens}{' forced' if setting.forced else ''}"
        for name, s in pair.items():
            lines.append(f"{label:<10}{name:<10}{s.n:>6}{s.step_s:>8.3f}{s.gen_s:>8.3f}{s.learn_s:>9.3f}"
                         f"{s.other_s:>8.3f}{s.tokens:>10.0f}")  # fmt: skip
        a, b = pair["steadyrl"], pair["trl"]
        lines.append(f"{label:<10}{'ratio':<10}{'':>6}{a.step_s / b.step_s:>8.2f}{a.gen_s / b.gen_s:>8.2f}"
                     f"{a.learn_s / b.learn_s:>9.2f}")  # fmt: skip
    lines += ["", "the same in process CPU time (1 thread: not counting time descheduled by other jobs)",
              f"{'tokens':<10}{'trainer':<10}{'step':>8}{'gen':>8}{'learner':>9}"]  # fmt: skip
    for setting, pair in results.items():
        label = f"{setting.tokens}{' forced' if setting.forced else ''}"
        for name, s in pair.items():
            lines.append(f"{label:<10}{name:<10}{s.step_cpu:>8.3f}{s.gen_cpu:>8.3f}{s.learn_cpu:>9.3f}")
        a, b = pair["steadyrl"], pair["trl"]
        lines.append(f"{label:<10}{'ratio':<10}{a.step_cpu / b.step_cpu:>8.2f}{a.gen_cpu / b.gen_cpu:>8.2f}"
                     f"{a.learn_cpu / b.learn_cpu:>9.2f}")  # fmt: skip
    lines += [
        "",
        f"throughput (CPU time); model {params / 1e6:.2f}M params, prompt {prompt_len:.1f} tokens, matmul peak "
        f"(fp32 {PEAK_N}^3, 1 thread, best in run) {peak / 1e9:.1f} GFLOP/s",
        f"{'tokens':<10}{'trainer':<10}{'sampler tok/s':>14}{'sampler %peak':>14}{'learner tok/s':>14}"
        f"{'learner GFLOP/s':>16}{'learner %peak':>14}",
    ]
    for setting, pair in results.items():
        label = f"{setting.tokens}{' forced' if setting.forced else ''}"
        for name, s in pair.items():
            gen_tps = s.tokens / s.gen_cpu
            learn_tokens = rows * prompt_len + s.tokens
            learn_flops = 6 * params * learn_tokens / s.learn_cpu
            lines.append(
                f"{label:<10}{name:<10}{gen_tps:>14,.0f}{100 * 2 * params * gen_tps / peak:>13.1f}%"
                f"{learn_tokens / s.learn_cpu:>14,.0f}{learn_flops / 1e9:>16.2f}{100 * learn_flops / peak:>13.1f}%"
            )
    return "\n".join(lines)


def tiny_model_dir(dst: Path, *, seed: int) -> Path:
    """A randomly initialized tiny Llama (hidden 32, 2 layers) with the character tokenizer, saved to ``dst``: the
    smoke test's model (seconds instead of the default model's warm start on a fresh cache)."""
    from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    arch = TinyArchConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    build_tiny_model(arch, tokenizer=tokenizer, seed=seed).save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return dst


def run(args: argparse.Namespace) -> dict[Setting, dict[str, Summary]]:
    """Measure every budget of ``args`` (see :func:`main`); prints one line per run, then the tables."""
    torch.set_num_threads(1)
    lr = TrainConfig().lr
    task = build_task(ChainSumConfig())
    pool = task.problems("train", TRAIN_POOL, seed=args.seed)
    peaks = [matmul_peak()]
    results: dict[Setting, dict[str, Summary]] = {}
    with tempfile.TemporaryDirectory(prefix="peer_trl-") as tmp:
        work = Path(tmp)
        base = tiny_model_dir(work / "tiny-model", seed=args.seed) if args.tiny else default_model_dir(args.seed)
        params = count_params(base)
        prompt_len = prompt_tokens(base, pool[:1024])
        forced_dir = forced_length_copy(base, work / "forced-model")
        free = {int(t) for t in args.free.split(",") if t}
        for tokens in (int(t) for t in args.tokens.split(",")):
            forced = tokens not in free
            setting = Setting(tokens, forced, forced_dir if forced else base)
            times = measure(setting, steps=args.steps, repeats=args.repeats, seed=args.seed, lr=lr, task=task,
                            pool=pool, peaks=peaks, work=work)  # fmt: skip
            results[setting] = {name: summarize(t) for name, t in times.items()}
    print()
    print(report(results, params=params, prompt_len=prompt_len, peak=max(peaks)))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is dropped)")
    parser.add_argument("--tokens", default="12,48", help="response budgets (comma-separated)")
    parser.add_argument("--free", default=str(TrainConfig().rollout.max_new_tokens),
                        help="budgets in --tokens that stop at EOS; the others are forced to full length")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2, help="runs of each trainer per budget, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 steps, 12 tokens, 1 repeat")
    parser.add_argument("--tiny", action="store_true", help="a random tiny model instead of the warm-started default")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.tokens, args.repeats = 3, "12", 1
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step of each run is dropped)")
    run(args)
    return 0


if __name__ == "__main__":
    status = main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
    raise SystemExit(status)
