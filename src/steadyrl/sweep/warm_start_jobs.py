"""A sweep's warm starts: each distinct warm start of the default model its runs need is built once, first, by a
worker of its own whose progress the sweep's bar shows.

Runs that differ only in method, lag, lr, ... share one warm start (the cache key holds the task, the seed, the
architecture and the warm-start settings: :func:`steadyrl.models.warmstart.warm_start_identity`). Without this
step every run's worker would build it: the first one holding the cache entry's lock, the others waiting on it
without a word, and the bar standing at 0 steps for as long as the warm start takes (minutes to tens of minutes).

:func:`plan_warm_starts` lists the entries not yet in the cache, each with the runs that need it;
:func:`steadyrl.sweep.runner.execute` runs them before those runs, each as
``python -m steadyrl.sweep.child PARENT_PID warm-start PROGRESS_FILE CONFIG overrides...`` (:func:`warm_start_main`),
output to ``<out_dir>/warm_starts/<entry>.log``. The worker writes its step and latest sampled accuracy to
``<out_dir>/warm_starts/<entry>.json`` (:class:`ProgressFile`); the bar reads it (:func:`describe`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steadyrl.sweep.config import RunSpec, SweepError
from steadyrl.sweep.jobs import EXIT_INTERRUPTED, WARM_START_COMMAND, Job

if TYPE_CHECKING:
    from steadyrl.models.warmstart import EvalPoint, WarmStartConfig

#: Directory of the warm starts' logs and progress files, under the sweep's out_dir.
WARM_START_DIR = "warm_starts"
#: Seconds between progress-file writes (a new accuracy measurement is always written at once).
PROGRESS_EVERY_S = 0.5


@dataclass(frozen=True)
class WarmStartJob:
    """A warm start a sweep builds before the runs that need it."""

    entry: Path
    """The cache entry it builds."""
    spec: RunSpec
    """The first run that needs it: its config and arguments build it."""
    runs: tuple[str, ...]
    """Names of every run that needs it (they start once it is built)."""

    @property
    def label(self) -> str:
        """``<task> seed <seed>``, how the bar and the messages name it."""
        return f"{self.spec.config.task.name} seed {self.spec.config.seed}"

    @property
    def threads(self) -> int:
        """torch threads it uses (``model.warm_start.threads``)."""
        return self.spec.config.model.warm_start.threads

    @property
    def log_path(self) -> Path:
        """Its worker's combined stdout and stderr."""
        return self.spec.out_dir.parent / WARM_START_DIR / f"{self.entry.name}.log"

    @property
    def progress_path(self) -> Path:
        """Its progress file (:class:`ProgressFile`)."""
        return self.spec.out_dir.parent / WARM_START_DIR / f"{self.entry.name}.json"


def plan_warm_starts(jobs: Sequence[Job]) -> list[WarmStartJob]:
    """The warm starts the runs to do (not ``skip``) need and the cache lacks, one per distinct cache entry, in the
    order of the first run that needs each; raises :class:`SweepError` when a run's task cannot be built."""
    from steadyrl.models.load import DEFAULT_MODEL_NAME
    from steadyrl.models.warmstart import warm_start_entry, warm_start_ready
    from steadyrl.tasks import build_task

    entries: dict[str, Path] = {}  # (task, model, seed) as JSON -> cache entry
    needed: dict[Path, tuple[RunSpec, list[str]]] = {}
    for job in jobs:
        cfg = job.spec.config
        if job.action == "skip" or cfg.model.name != DEFAULT_MODEL_NAME:
            continue
        key = json.dumps([cfg.task.model_dump(mode="json"), cfg.model.model_dump(mode="json"), cfg.seed],
                         sort_keys=True)
        if key not in entries:
            try:
                task = build_task(cfg.task)
            except (OSError, ValueError) as err:
                raise SweepError(f"run {job.spec.entry.name}: cannot build its task (for its warm start): {err}") \
                    from None
            entries[key] = warm_start_entry(cfg.model.arch, task=task, cfg=cfg.model.warm_start, seed=cfg.seed,
                                            cache_dir=cfg.model.cache_dir)
        entry = entries[key]
        if not warm_start_ready(entry):
            needed.setdefault(entry, (job.spec, []))[1].append(job.spec.entry.name)
    return [WarmStartJob(entry, spec, tuple(runs)) for entry, (spec, runs) in needed.items()]


def warm_start_command(job: WarmStartJob) -> list[str]:
    """The worker's command line (see the module docstring)."""
    return [sys.executable, "-m", "steadyrl.sweep.child", str(os.getpid()), WARM_START_COMMAND,
            str(job.progress_path), str(job.spec.config_path), *job.spec.overrides]


class ProgressFile:
    """A warm start's progress hook that writes ``{step, max_steps, accuracy, eval_step, target, seconds}`` as JSON to
    ``path`` (atomically, at most every :data:`PROGRESS_EVERY_S` seconds and at every new accuracy measurement) and
    prints each measurement."""

    def __init__(self, path: Path, cfg: WarmStartConfig) -> None:
        self.path, self.cfg = path, cfg
        self._eval_step: int | None = None
        self._written = -float("inf")

    def __call__(self, step: int, point: EvalPoint) -> None:
        """Record ``step`` and the latest measurement ``point``."""
        new_eval = point.step != self._eval_step
        if new_eval:
            self._eval_step = point.step
            print(f"warm start step {point.step}: sampled accuracy {point.accuracy:.3f} "
                  f"(target {self.cfg.target_accuracy}) after {point.seconds:.0f} s", flush=True)
        now = time.monotonic()
        if not new_eval and now - self._written < PROGRESS_EVERY_S:
            return
        self._written = now
        record = {"step": step, "max_steps": self.cfg.max_steps, "accuracy": point.accuracy,
                  "eval_step": point.step, "target": self.cfg.target_accuracy, "seconds": point.seconds}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.path)


def read_progress(path: Path) -> dict[str, Any] | None:
    """The record a :class:`ProgressFile` last wrote, or None (not written yet)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def describe(job: WarmStartJob) -> str:
    """How the bar shows a running warm start: ``chain_sum seed 0 step 350/6000 acc 0.184→0.3``."""
    progress = read_progress(job.progress_path)
    if progress is None:
        return f"{job.label} starting"
    return (f"{job.label} step {progress['step']}/{progress['max_steps']} "
            f"acc {progress['accuracy']:.3f}→{progress['target']:g}")


def finished_message(job: WarmStartJob, seconds: float) -> str:
    """The line the sweep prints when a warm start's worker exited 0: steps and accuracy from the cache entry."""
    from steadyrl.models.warmstart import read_warm_start_metadata

    try:
        report = read_warm_start_metadata(job.entry)["report"]
    except (OSError, ValueError, KeyError):
        return f"[steadyrl sweep] warm start {job.label} done ({seconds:.0f} s)"
    return (f"[steadyrl sweep] warm start {job.label} done: {report['steps']} steps, sampled accuracy "
            f"{report['accuracy']:.3f} ({seconds:.0f} s); {len(job.runs)} run(s) can start")


def warm_start_main(argv: Sequence[str]) -> int:
    """The worker: ``PROGRESS_FILE CONFIG overrides...``; builds the run's warm start (if still missing)."""
    from steadyrl.config.io import load_config
    from steadyrl.config.train import TrainConfig
    from steadyrl.models.load import default_model_dir
    from steadyrl.tasks import build_task

    progress_path, config_path, *overrides = argv
    cfg = load_config(TrainConfig, path=Path(config_path), overrides=overrides)
    Path(progress_path).parent.mkdir(parents=True, exist_ok=True)
    hook = ProgressFile(Path(progress_path), cfg.model.warm_start)
    try:
        path = default_model_dir(cfg.model, build_task(cfg.task), seed=cfg.seed, progress=False, on_progress=hook)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    print(f"warm start ready: {path}", flush=True)
    return 0
