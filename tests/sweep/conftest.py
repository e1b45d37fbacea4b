"""Helpers of the sweep tests: fake runs written straight into metrics.jsonl, and the tiny model's overrides."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from steadyrl.sweep.config import RunSpec, SweepConfig, expand

#: A cheap base for planned sweeps (configs are validated, never trained, in most tests).
BASE = {"steps": 6, "eval.every": 2}


def plan(tmp_path: Path, **fields: Any) -> list[RunSpec]:
    """Expand a sweep whose out_dir is ``tmp_path / 'sweep'``."""
    fields.setdefault("base", BASE)
    return expand(SweepConfig(out_dir=tmp_path / "sweep", **fields))


def fake_run(
    run_dir: Path,
    *,
    config: dict[str, Any] | None = None,
    evals: Sequence[float] = (0.4, 0.5, 0.6, 0.55),
    eval_every: int = 2,
    steps_done: int | None = None,
    finished: bool = True,
    checkpoint: bool = False,
    ess: Sequence[float] | None = None,
    kl: Sequence[float] | None = None,
    step_s: float = 0.5,
    alarms: Sequence[tuple[int, str]] = (),
) -> Path:
    """A run directory as ``steadyrl train`` leaves it: metrics.jsonl (eval at every ``eval_every`` steps and, if
    ``finished``, the final line at step ``steps_done``), config.yaml, optionally a checkpoint and guard alarms.

    ``evals`` are the accuracies at steps 0, eval_every, 2·eval_every, ... (the last one is the final line when
    finished); ``steps_done`` defaults to (len(evals) − 1)·eval_every."""
    steps = (len(evals) - 1) * eval_every if steps_done is None else steps_done
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for t in range(steps):
        rec: dict[str, Any] = {"step": t, "version": t, "reward/mean": 0.5, "loss": 0.1, "grad/norm": 1.0 + t,
                               "grad/cos_prev": 0.1, "time/step_s": step_s,
                               "is/ess_ratio": ess[t] if ess else 1.0 - 0.01 * t, "kl/k3": kl[t] if kl else 0.01 * t,
                               "guard/alarm": float(any(s == t for s, _ in alarms)), "guard/rollbacks": 0.0}
        if t % eval_every == 0 and t // eval_every < len(evals):
            rec["eval/acc"] = evals[t // eval_every]
        lines.append(rec)
    if finished:
        lines.append({"step": steps, "version": steps, "eval/acc": evals[-1]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if config is not None:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if checkpoint:
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints" / f"step_{steps:08d}.pt").write_bytes(b"fake")
    if alarms:
        (run_dir / "guard.jsonl").write_text("".join(json.dumps({"step": s, "action": a, "reason": "test"}) + "\n"
                                                     for s, a in alarms))
    return run_dir


def fake_spec_run(spec: RunSpec, **kwargs: Any) -> Path:
    """:func:`fake_run` in the spec's directory, with its resolved config and step count."""
    every = spec.config.eval.every
    n_evals = spec.config.steps // every + 1
    kwargs.setdefault("evals", [0.4 + 0.01 * i for i in range(n_evals)])
    return fake_run(spec.out_dir, config=spec.config.model_dump(mode="json"), eval_every=every, **kwargs)
