"""Warm start of the embedded default model: supervised training on task demonstrations until sampled accuracy
reaches a target, then a cached save in the standard Hugging Face layout.

Why: RL with group baselines (GRPO and its relatives) learns only from groups with mixed rewards. A random model
scores 0 everywhere; a fully trained one scores 1. The warm start stops as soon as the sampled accuracy (T = 1) on
held-out problems reaches ``target_accuracy`` (default 0.30, so groups of 8 mostly mix right and wrong answers),
leaving room for RL to improve and for stale-rollout instabilities to show.

Training: each example is ``<bos> prompt`` → ``demonstration <eos>``; the loss is the mean negative log-likelihood
of the completion tokens only (token-mean over the batch), computed with
:func:`steadyrl.rollout.logprobs.sequence_logprobs`, the same forward the RL learner uses. A tool task's
demonstration is a transcript whose tool-output turn is context only (``tool_mask``: attended, not in the loss), and
its accuracy is measured with the tool (docs/tools.md). AdamW with a linear warmup
then a constant rate, gradient clipping. Problems come from the task's ``train`` split and accuracy from its ``eval``
split, both for the run's seed, so the warm start never trains on the problems a run with that seed evaluates on.

Reproducibility: the warm start runs with ``threads`` torch CPU threads of its own (the caller's count is restored
afterwards), so its weights do not depend on ``runtime.threads``, on ``OMP_NUM_THREADS`` or on the sweep's thread
count: the thread count changes the order of floating-point sums in some kernels, and with it the step at which the
sampled accuracy first reaches the target (a few-step probe on a 2-core AVX-512 machine: 1 and 2 threads gave the
same weights, 1 and 3, 4 or 8 did not). Sampler processes start only after the warm start, so they cannot change
it. What else the weights depend on (torch and transformers versions, the CPU's vector instruction set) is in the
cache key.

Cache: ``<root>/models/<task>-<key>/`` (see :mod:`steadyrl.models.model_cache`), the key hashing the architecture, a
fingerprint of the task, this config, the seed and the platform (:func:`platform_identity`). It holds
``save_pretrained`` output (model + tokenizer) and ``steadyrl_warmstart.json`` (config, steps, measured accuracy,
seconds), written last.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import transformers
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from steadyrl.base.device import refuse_outer_autocast
from steadyrl.core.masking import masked_mean
from steadyrl.models.model_cache import build_once, cache_key, models_dir
from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
from steadyrl.models.tokenizer import build_char_tokenizer
from steadyrl.rollout.accuracy import sampled_accuracy_of
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.multiturn import ToolRunner, ToolUse
from steadyrl.rollout.rollouts import TokenBatch, trim_padding
from steadyrl.tasks import DemoTurn, Problem, Task, ToolDemonstrations
from steadyrl.tools import SandboxPool

#: Metadata file of a warm-start cache entry (written last: its presence marks a complete entry).
METADATA_FILE = "steadyrl_warmstart.json"
#: Bump when the training procedure changes in a way that changes the weights (invalidates every cache entry).
#: 2: the warm start runs with its own fixed thread count (``WarmStartConfig.threads``).
WARM_START_FORMAT = 2
#: Problems per split hashed into the task fingerprint.
FINGERPRINT_PROBLEMS = 32
#: Extra new tokens the accuracy eval allows beyond the longest eval demonstration (+ EOS).
EVAL_TOKEN_SLACK = 8


class WarmStartConfig(BaseModel):
    """Supervised warm start of the embedded default model (TESTBED.md: ~3 minutes on 2 threads reach 0.3)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    lr: float = Field(3e-3, gt=0, le=1.0)
    """AdamW learning rate after warmup."""
    warmup_steps: int = Field(50, ge=0)
    """Steps of linear learning-rate warmup from 0."""
    weight_decay: float = Field(0.0, ge=0, le=1.0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (β1, β2)."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value."""
    batch_size: int = Field(128, ge=1, le=65536)
    """Demonstrations per step."""
    train_problems: int = Field(131072, ge=1)
    """Size of the pool of train problems (drawn once, reshuffled every pass)."""
    max_steps: int = Field(6000, ge=1)
    """Step cap: training stops here even if the target was not reached (the entry records that)."""
    eval_every: int = Field(50, ge=1)
    """Measure sampled accuracy every this many steps."""
    eval_problems: int = Field(256, ge=1)
    """Held-out problems per accuracy measurement (the first of the task's eval split; at most its eval size)."""
    eval_temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the accuracy measurement (1.0: the distribution RL samples from)."""
    eval_max_new_tokens: int | None = Field(None, ge=1)
    """Token budget of an eval completion; None: the longest eval demonstration + EOS + a small slack."""
    target_accuracy: float = Field(0.30, ge=0.0, le=1.0)
    """Stop as soon as sampled accuracy reaches this (0.2–0.5 leaves GRPO groups with mixed rewards)."""
    threads: int = Field(2, ge=1, le=1024)
    """torch CPU threads of the warm start, whatever the run's ``runtime.threads`` (the thread count can change the
    weights, so it is fixed here and part of the cache key; another value builds another cache entry)."""

    @model_validator(mode="after")
    def _pool_fills_a_batch(self) -> WarmStartConfig:
        if self.train_problems < self.batch_size:
            raise ValueError(f"train_problems ({self.train_problems}) must be >= batch_size ({self.batch_size})")
        return self


class EvalPoint(NamedTuple):
    """One accuracy measurement during the warm start."""

    step: int
    accuracy: float
    seconds: float
    """Wall-clock seconds since the warm start began."""


@dataclass(frozen=True)
class WarmStartReport:
    """Outcome of a warm start: where it stopped and what it measured."""

    steps: int
    """Optimizer steps taken."""
    accuracy: float
    """Sampled accuracy of the returned weights on the eval problems."""
    seconds: float
    """Wall-clock seconds of training and evaluation."""
    reached_target: bool
    """Whether ``accuracy >= target_accuracy`` (False: stopped at ``max_steps``)."""
    history: tuple[EvalPoint, ...]
    """Every accuracy measurement, in order."""


#: Called after every optimizer step (and once before the first) with the step and the latest measurement.
ProgressHook = Callable[[int, EvalPoint], None]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Within the block torch uses ``n`` intra-op CPU threads; the previous count is restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def demonstration_batch(
    tokenizer: PreTrainedTokenizerBase, *, task: Task, problems: list[Problem]
) -> TokenBatch:
    """Tokens of ``<bos> prompt`` (left-padded) → ``demonstration <eos>`` (right-padded) for ``problems``.

    For a task with tool-using demonstrations (:class:`~steadyrl.tasks.ToolDemonstrations`) the response is the whole
    transcript and its tool turns are marked in ``tool_mask`` (attended, not trained on: the RL learner's rule).
    """
    prompts = tokenizer([p.prompt for p in problems], padding=True, padding_side="left", return_tensors="pt")
    if isinstance(task, ToolDemonstrations):
        turns = [task.demonstration_turns(p) for p in problems]
    else:
        turns = [[DemoTurn(task.demonstration(p), tool=False)] for p in problems]
    encoded = iter(tokenizer([t.text for row in turns for t in row], add_special_tokens=False)["input_ids"])
    rows, tools = [], []
    for row_turns in turns:
        ids: list[int] = []
        tool: list[bool] = []
        for turn, turn_ids in zip(row_turns, encoded, strict=False):  # this row's turns, in order
            ids += turn_ids
            tool += [turn.tool] * len(turn_ids)
        rows.append(torch.tensor([*ids, tokenizer.eos_token_id]))
        tools.append(torch.tensor([*tool, False]))
    response_ids = pad_sequence(rows, batch_first=True, padding_value=tokenizer.pad_token_id)
    lengths = torch.tensor([len(r) for r in rows])
    real = torch.arange(response_ids.shape[1]) < lengths.unsqueeze(-1)
    tool_mask = pad_sequence(tools, batch_first=True, padding_value=False)
    has_tools = bool(tool_mask.any())
    return TokenBatch(
        prompts["input_ids"], prompts["attention_mask"].bool(), response_ids, real & ~tool_mask,
        tool_mask if has_tools else None,
    )  # fmt: skip


def demonstration_tools(
    task: ToolDemonstrations, problems: list[Problem], *, max_total_tokens: int, runner: ToolRunner
) -> ToolUse:
    """How the warm start samples a tool task: the default call format (the demonstrations'), one more model turn
    than the demonstrations of ``problems`` have tool turns, ``max_total_tokens`` for the whole response."""
    tool_turns = max(sum(turn.tool for turn in task.demonstration_turns(p)) for p in problems)
    return ToolUse(runner=runner, max_turns=tool_turns + 1, max_total_tokens=max_total_tokens,
                   max_tool_tokens=max_total_tokens - 1)  # fmt: skip


def sampled_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    task: Task,
    problems: list[Problem],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    tools: ToolUse | None = None,
) -> float:
    """Mean score of one sampled completion per problem (``task.score``; 1 right, 0 wrong); with ``tools``, of one
    multi-turn trajectory (its last model turn)."""
    return sampled_accuracy_of(
        model, tokenizer, task=task, problems=problems, max_new_tokens=max_new_tokens, temperature=temperature,
        generator=generator, tools=tools,
    ).acc


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    task: Task,
    cfg: WarmStartConfig,
    seed: int,
    progress: bool = True,
    on_progress: ProgressHook | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> WarmStartReport:
    """Train ``model`` in place on ``task``'s demonstrations until the sampled accuracy reaches the target.

    ``autocast`` opens the mixed-precision region of one forward (e.g. ``Placement.autocast`` under ``bf16-mixed``):
    each training forward and each accuracy measurement runs in a region of its own. Calling this inside an autocast
    region raises instead (:func:`~steadyrl.base.device.refuse_outer_autocast`: autocast would keep the first step's
    bf16 weights for every later step).

    Accuracy is measured every ``eval_every`` steps (and before the first step); training stops at the first
    measurement ≥ ``target_accuracy`` or after ``max_steps`` (the last step is always measured). A task with
    tool-using demonstrations is measured with the tool (multi-turn sampling, calls in a default
    :class:`~steadyrl.tools.SandboxPool`), as RL will sample it. Runs with ``cfg.threads`` torch threads (the
    caller's count is restored afterwards); ``on_progress`` sees every step (a sweep shows it, for instance).
    """
    refuse_outer_autocast(
        next(model.parameters()).device, "warm_start", "pass autocast=placement.autocast to run each forward under it"
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch_threads(cfg.threads))
        sandbox = stack.enter_context(SandboxPool()) if isinstance(task, ToolDemonstrations) else None
        return _warm_start(model, tokenizer, task=task, cfg=cfg, seed=seed, progress=progress, sandbox=sandbox,
                           on_progress=on_progress, autocast=autocast)


def _warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    task: Task,
    cfg: WarmStartConfig,
    seed: int,
    progress: bool,
    sandbox: ToolRunner | None,
    on_progress: ProgressHook | None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
) -> WarmStartReport:
    start = time.perf_counter()
    eval_set = task.problems("eval", cfg.eval_problems, seed=seed)
    data = demonstration_batch(tokenizer, task=task, problems=task.problems("train", cfg.train_problems, seed=seed))
    longest_demo = max(len(task.demonstration(p)) for p in eval_set)
    eval_tokens = cfg.eval_max_new_tokens or longest_demo + 1 + EVAL_TOKEN_SLACK
    tools = None
    if sandbox is not None and isinstance(task, ToolDemonstrations):
        tools = demonstration_tools(task, eval_set, max_total_tokens=eval_tokens, runner=sandbox)
    device = next(model.parameters()).device
    order_gen = torch.Generator().manual_seed(seed)
    eval_gen = torch.Generator(device=device).manual_seed(seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / (cfg.warmup_steps + 1))  # linear warmup, then constant
    )

    def measure(step: int) -> EvalPoint:
        with autocast():
            acc = sampled_accuracy(
                model, tokenizer, task=task, problems=eval_set, max_new_tokens=eval_tokens,
                temperature=cfg.eval_temperature, generator=eval_gen, tools=tools,
            )
        return EvalPoint(step, acc, time.perf_counter() - start)

    report = on_progress or (lambda step, point: None)
    history = [measure(0)]
    report(0, history[-1])
    model.train()
    bar = tqdm(total=cfg.max_steps, desc=f"warm start {task.name}", unit="step", disable=not progress)
    order, cursor, step = torch.randperm(len(data.prompt_ids), generator=order_gen), 0, 0
    while history[-1].accuracy < cfg.target_accuracy and step < cfg.max_steps:
        if cursor + cfg.batch_size > len(order):  # new pass over the pool
            order, cursor = torch.randperm(len(data.prompt_ids), generator=order_gen), 0
        rows = order[cursor : cursor + cfg.batch_size]
        cursor += cfg.batch_size
        picked = TokenBatch(*(None if x is None else x[rows] for x in data))
        batch = TokenBatch(*(None if x is None else x.to(device) for x in trim_padding(picked)))
        with autocast():  # one region per forward: its bf16 weight casts are dropped before the step
            logp, _ = sequence_logprobs(model, batch)
        loss = -masked_mean(logp, batch.response_mask)  # NLL of completion tokens (tool turns excluded), token-mean
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        step += 1
        bar.update(1)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            history.append(measure(step))
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{history[-1].accuracy:.3f}")
        report(step, history[-1])
    bar.close()
    model.eval()
    final = history[-1]
    return WarmStartReport(
        steps=step,
        accuracy=final.accuracy,
        seconds=time.perf_counter() - start,
        reached_target=final.accuracy >= cfg.target_accuracy,
        history=tuple(history),
    )


def task_fingerprint(task: Task, *, seed: int, eval_problems: int) -> dict[str, str]:
    """What identifies a task's data for caching: its name, alphabet and a hash of problems of both splits.

    The problems (prompt, answer, demonstration: the first ``FINGERPRINT_PROBLEMS`` train problems and the
    ``eval_problems`` the warm start measures on) depend on every task setting, so a changed setting changes the
    fingerprint without the cache knowing the task's config type.
    """
    problems = task.problems("train", FINGERPRINT_PROBLEMS, seed=seed) + task.problems(
        "eval", eval_problems, seed=seed
    )
    rows = [[p.prompt, p.answer, task.demonstration(p)] for p in problems]
    return {"name": task.name, "alphabet": task.alphabet, "problems": cache_key({"rows": rows})}


def platform_identity() -> dict[str, str]:
    """What of the machine and the environment the weights depend on beyond the settings: the torch and
    transformers versions and the CPU instruction set torch's kernels use (``torch.backends.cpu``)."""
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def warm_start_identity(arch: TinyArchConfig, *, task: Task, cfg: WarmStartConfig, seed: int) -> dict[str, Any]:
    """Everything that determines the warm-started weights (hashed into the cache key, stored in the metadata)."""
    return {
        "format": WARM_START_FORMAT,
        "arch": arch.model_dump(mode="json"),
        "task": task_fingerprint(task, seed=seed, eval_problems=cfg.eval_problems),
        "warm_start": cfg.model_dump(mode="json"),
        "seed": seed,
        "platform": platform_identity(),
    }


def warm_start_entry(
    arch: TinyArchConfig, *, task: Task, cfg: WarmStartConfig, seed: int, cache_dir: str | Path | None = None
) -> Path:
    """The cache directory of the warm start for these settings (built or not; see :func:`warm_start_ready`)."""
    return _entry_path(task, warm_start_identity(arch, task=task, cfg=cfg, seed=seed), cache_dir)


def _entry_path(task: Task, identity: dict[str, Any], cache_dir: str | Path | None) -> Path:
    return models_dir(cache_dir) / f"{task.name}-{cache_key(identity)}"


def warm_start_ready(entry: str | Path) -> bool:
    """Whether the cache entry ``entry`` is complete (its metadata file, written last, is there)."""
    return (Path(entry) / METADATA_FILE).is_file()


def warm_start_cached(
    arch: TinyArchConfig,
    *,
    task: Task,
    cfg: WarmStartConfig,
    seed: int,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    on_progress: ProgressHook | None = None,
) -> Path:
    """Directory of the warm-started default model for these settings, building it on first use.

    Builds with :func:`build_tiny_model` + :func:`warm_start` into a temporary directory, saves model, tokenizer
    and ``steadyrl_warmstart.json``, then moves it into place atomically; later calls (any process) reuse it, and
    concurrent ones wait for the first (a lock file, :func:`steadyrl.models.model_cache.build_once`).
    """
    identity = warm_start_identity(arch, task=task, cfg=cfg, seed=seed)
    final = _entry_path(task, identity, cache_dir)

    def build(tmp: Path) -> None:
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(arch, tokenizer=tokenizer, seed=seed)
        report = warm_start(model, tokenizer, task=task, cfg=cfg, seed=seed, progress=progress,
                            on_progress=on_progress)
        if not report.reached_target:
            warnings.warn(
                f"warm start of {task.name} stopped at max_steps={cfg.max_steps} with sampled accuracy "
                f"{report.accuracy:.3f} < target {cfg.target_accuracy}; raise warm_start.max_steps",
                stacklevel=3,
            )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        metadata = identity | {
            "report": asdict(report) | {"history": [p._asdict() for p in report.history]},
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))

    build_once(final, build=build, complete_marker=METADATA_FILE)
    return final


def read_warm_start_metadata(path: str | Path) -> dict[str, Any]:
    """The ``steadyrl_warmstart.json`` of a cache entry."""
    return json.loads((Path(path) / METADATA_FILE).read_text())
