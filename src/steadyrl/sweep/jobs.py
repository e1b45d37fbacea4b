"""What a sweep plans: a run and what to do with it, and the exit statuses its worker processes share.

Both the run scheduler (:mod:`steadyrl.sweep.runner`) and the warm starts it runs first
(:mod:`steadyrl.sweep.warm_start_jobs`) read these; the worker process is :mod:`steadyrl.sweep.child`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from steadyrl.sweep.config import RunSpec
from steadyrl.train.entry import EXIT_INTERRUPTED

__all__ = ["EXIT_INTERRUPTED", "WARM_START_COMMAND", "Action", "Job"]

#: First argument of a warm-start worker (``python -m steadyrl.sweep.child PID warm-start ...``).
WARM_START_COMMAND = "warm-start"

Action = Literal["skip", "resume", "fresh"]


@dataclass(frozen=True)
class Job:
    """A planned run and what to do with it."""

    spec: RunSpec
    action: Action
    status: str
    """The directory's status before the sweep (see :func:`steadyrl.sweep.results.run_status`)."""
    steps_done: int
    """Learner-step lines already in its metrics.jsonl."""
