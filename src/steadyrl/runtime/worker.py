"""The sampler role of the concurrent runtimes, written once for every transport (``local`` processes, Ray actors).

A sampler repeats: claim group ids (the transport applies admission control and back-pressure, and measures the
wait as idle time), load the newest published weights, generate G responses per claimed prompt — between decode steps
it loads newer weights when they appear (``runtime.inflight``), so every token records the version that produced it —
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

from steadyrl.pool.records import GroupRecord
from steadyrl.rollout.sampler import generate
from steadyrl.rollout.scored import score_rollouts
from steadyrl.runtime.order import problem_indices
from steadyrl.runtime.weights import FlatLayout
from steadyrl.tasks import build_task
from steadyrl.train.seeding import generator

if TYPE_CHECKING:
    from steadyrl.train.config import TrainConfig


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

    def deliver(self, sampler: int, record: GroupRecord) -> None:
        """Hand a completed group to the learner's pool (atomically: all of it or nothing)."""
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
    """The sampler loop; returns when ``channel.claim`` says the run is over."""
    cfg = spec.cfg
    torch.set_num_threads(cfg.runtime.sampler_threads)
    task = build_task(cfg.task)
    train_pool = task.problems("train", cfg.data.train_pool, seed=cfg.seed)
    model = spec.model.eval().requires_grad_(False)
    layout = FlatLayout(model)
    G, s = cfg.group_size, cfg.sampling
    chunk = cfg.runtime.resolved_sampler_batch(cfg.prompts_per_step)
    inflight = cfg.runtime.inflight and not cfg.runtime.sync
    redo = sorted(spec.redo)
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
        with torch.no_grad():
            rollouts = generate(
                model,
                spec.tokenizer,
                [p.prompt for p in problems],
                group_size=G,
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                generator=generator(cfg.seed, "sample", ids[0], spec.index, spec.incarnation),
                version=version,
                record_entropy=spec.record_entropy,
                before_forward=before_forward,
            )
        rewards = score_rollouts(task, problems, rollouts)
        done = time.time()
        for k, g in enumerate(ids):
            rows = list(range(k * G, (k + 1) * G))
            record = GroupRecord(
                group_id=g,
                problem_index=idx[k],
                rollouts=rollouts.select(rows),
                rewards=rewards[k * G : (k + 1) * G].clone(),
                sampler=spec.index,
                started_at=started,
                completed_at=done,
            )
            channel.deliver(spec.index, record)
        channel.add_busy(spec.index, time.perf_counter() - t0)
