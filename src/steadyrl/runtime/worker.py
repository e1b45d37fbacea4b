"""The sampler role of the concurrent runtimes, written once for every transport (``local`` processes, Ray actors).

A sampler repeats: claim group ids (the transport applies admission control and back-pressure, and measures the
wait as idle time), load the newest published weights, generate G responses per claimed prompt — between decode steps
it loads newer weights when they appear (``runtime.concurrent.inflight``), so every token records the version that
produced it —
score them with the task's verifier, and deliver one :class:`~steadyrl.pool.GroupRecord` per group.

Group id g is prompt slot g of :mod:`steadyrl.runtime.order`, so the concurrent runtimes visit the train problems in
the same order as the lag runtime. A replacement sampler first redoes the ids its predecessor claimed but never
delivered (``redo``); the learner's pool refuses an id it has seen, so nothing is trained on twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from steadyrl.base.device import Placement, sampler_placement
from steadyrl.base.seeding import derive_seed, generator
from steadyrl.methods.resolve import behavior_record
from steadyrl.pool.records import GroupRecord
from steadyrl.rollout.multiturn import ToolUse, score_final
from steadyrl.rollout.sampler import generate
from steadyrl.rollout.scored import score_rollouts
from steadyrl.rollout.tool_metrics import RowMetrics
from steadyrl.rollout.vllm_engine import VLLMEngine, engine_from_config
from steadyrl.runtime.order import problem_indices
from steadyrl.runtime.weight_sync import FlatLayout
from steadyrl.tasks import build_task
from steadyrl.tools import SandboxPool

if TYPE_CHECKING:
    from steadyrl.config.train import TrainConfig


class SamplerChannel(Protocol):
    """What a sampler needs from its transport."""

    def claim(self, sampler: int, max_groups: int) -> list[int] | None:
        """Up to ``max_groups`` new group ids, blocking while admission control or back-pressure says wait (the wait
        counts as idle time); None when the run is shutting down."""
        ...

    def weights_version(self) -> int:
        """Version of the newest published weights (cheap: called before every decode step)."""
        ...

    def load_weights(self, model: nn.Module, layout: FlatLayout) -> int:
        """Load the newest published weights into ``model`` in place; returns their version."""
        ...

    def deliver(self, sampler: int, records: list[GroupRecord]) -> None:
        """Hand the completed groups of one sampler call to the learner's pool (atomically: all of them or none; one
        transfer per call, not per group, so a learner that discards many groups does not pay a transfer for each)."""
        ...

    def add_busy(self, sampler: int, seconds: float) -> None:
        """Account generation + scoring time."""
        ...


@dataclass
class SamplerSpec:
    """Everything a sampler process or actor is started with (picklable)."""

    cfg: TrainConfig
    index: int
    model: nn.Module
    tokenizer: Any
    incarnation: int = 0
    """How many times sampler ``index`` was (re)started before; part of its sampling seed."""
    redo: list[int] = field(default_factory=list)
    """Group ids to generate first (claimed by a predecessor that died, or pending at a checkpoint)."""
    record_entropy: bool = False


def run_sampler(spec: SamplerSpec, channel: SamplerChannel) -> None:
    """The sampler loop; returns when ``channel.claim`` says the run is over.

    With ``tools.enabled`` the sampler owns a :class:`SandboxPool` (closed when the loop ends, however it ends) and
    generates multi-turn trajectories (:func:`steadyrl.rollout.multiturn.generate_multiturn`); the reward scores each
    trajectory's last model turn. Each group record carries its rows' tool counts (calls, errors, timeouts, turns),
    so the pool reports every ``tool/*`` metric of the batch it hands out.

    With ``rollout.engine=vllm`` the sampler owns a :class:`~steadyrl.rollout.vllm_engine.VLLMEngine` (closed the same
    way): newer weights are loaded into it in place before a call, never during one, so every token of a call records
    the version at the call (the config requires ``runtime.concurrent.inflight=false``).
    """
    cfg = spec.cfg
    sandbox = SandboxPool(cfg.tools.sandbox) if cfg.tools.enabled else None
    engine = None
    try:
        engine = engine_from_config(cfg.rollout, model=spec.model, tokenizer=spec.tokenizer, version=-1,
                                    record_dist=behavior_record(cfg.method.resolve()))  # fmt: skip
        _sample_until_done(spec, channel, tools=None if sandbox is None else cfg.tools.tool_use(sandbox), engine=engine)
    finally:
        if engine is not None:
            engine.close()
        if sandbox is not None:
            sandbox.close()


def _sample_until_done(
    spec: SamplerSpec, channel: SamplerChannel, *, tools: ToolUse | None, engine: VLLMEngine | None = None
) -> None:
    cfg = spec.cfg
    torch.set_num_threads(cfg.rollout.threads)
    task = build_task(cfg.task, tokenizer=spec.tokenizer)
    train_pool = task.problems("train", cfg.data.train_pool, seed=cfg.seed)
    placement = sampler_placement(cfg.rollout.device, learner=Placement.from_names(cfg.device, cfg.precision))
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    layout = FlatLayout(spec.model)  # the learner's layout (one dtype); loads cast to each sampler parameter's own
    model = placement.sampler_copy(placement.place(spec.model))
    G, s = cfg.group_size, cfg.rollout
    chunk = cfg.rollout.resolved_batch(cfg.prompts_per_step, cfg.runtime.concurrent.samplers)
    inflight = cfg.runtime.concurrent.inflight and not cfg.runtime.concurrent.sync
    redo = sorted(spec.redo)
    record_dist = behavior_record(cfg.method.resolve())  # the behavior distribution, when the method reads it
    while True:
        if redo:
            ids, redo = redo[:chunk], redo[chunk:]
        else:
            claimed = channel.claim(spec.index, chunk)
            if claimed is None:
                return
            ids = claimed
        t0, started = time.perf_counter(), time.time()
        version = channel.load_weights(model, layout)

        def before_forward() -> int:
            nonlocal version
            if inflight and channel.weights_version() > version:
                version = channel.load_weights(model, layout)
            return version

        idx = [problem_indices(g, 1, pool=len(train_pool), seed=cfg.seed)[0] for g in ids]
        problems = [train_pool[i] for i in idx]
        sample_kw: dict[str, Any] = dict(
            group_size=G, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            generator=generator(cfg.seed, "sample", ids[0], spec.index, spec.incarnation, device=placement.device),
            version=version,
            record_entropy=spec.record_entropy, before_forward=before_forward,
        )  # fmt: skip
        prompts = [p.prompt for p in problems]
        counts: RowMetrics | None = None
        with torch.no_grad(), placement.autocast():
            if engine is not None and engine.version != version:  # one vLLM call, one set of weights (no in-flight)
                engine.update_weights(model, version=version)
            if engine is not None and tools is not None:  # multi-turn with vLLM; the last model turn is scored
                out = engine.generate_multiturn(
                    prompts, group_size=G, tools=tools, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                    seed=derive_seed(cfg.seed, "sample", ids[0], spec.index, spec.incarnation), version=version,
                )  # fmt: skip
                rollouts, rewards, counts = out.rollouts, score_final(task, problems, out), out.row_metrics
            elif engine is not None:
                rollouts = engine.generate(
                    prompts, group_size=G, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                    top_k=s.top_k, seed=derive_seed(cfg.seed, "sample", ids[0], spec.index, spec.incarnation),
                    version=version, record_dist=record_dist,
                )  # fmt: skip
                rewards = score_rollouts(task, problems, rollouts)
            elif tools is None:
                rollouts = generate(model, spec.tokenizer, prompts, max_new_tokens=s.max_new_tokens, **sample_kw,
                                    record_dist=record_dist)  # fmt: skip
                rewards = score_rollouts(task, problems, rollouts)
            else:  # multi-turn with the sandbox; the reward scores each trajectory's last model turn
                out = tools.generate(model, spec.tokenizer, prompts, **sample_kw)
                rollouts, rewards, counts = out.rollouts, score_final(task, problems, out), out.row_metrics
        done = time.time()
        rollouts, rewards = rollouts.to("cpu"), rewards.cpu()  # records travel through CPU memory
        records = [
            GroupRecord(
                group_id=g,
                problem_index=idx[k],
                rollouts=rollouts.select(list(range(k * G, (k + 1) * G))),
                rewards=rewards[k * G : (k + 1) * G].clone(),
                sampler=spec.index,
                started_at=started,
                completed_at=done,
                tool_counts=None if counts is None else counts.select(list(range(k * G, (k + 1) * G))),
            )
            for k, g in enumerate(ids)
        ]
        channel.deliver(spec.index, records)
        channel.add_busy(spec.index, time.perf_counter() - t0)
