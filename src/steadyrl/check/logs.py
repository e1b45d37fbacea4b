"""Read a finished run's metrics, from steadyrl or another framework, into a table under steadyrl's key names.

Accepted inputs (a directory or a file):

* steadyrl's run directory: ``metrics.jsonl`` and ``config.yaml`` (the config says what the method and the
  staleness bound are);
* JSONL: one JSON object per line; verl's file logger's ``{"step": s, "data": {...}}`` lines are flattened;
* CSV with a header row (a logger's or W&B's export); ``_step``, ``Step`` or ``global_step`` columns count as the
  step, empty cells as absent;
* TRL's ``trainer_state.json`` (its ``log_history``), in the directory or its newest ``checkpoint-*`` folder.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadyrl.check import keymaps
from steadyrl.check.rules import RunFacts
from steadyrl.train.ledger import claims_trust_region, corrects_behavior

METRICS_NAME = "metrics.jsonl"
CONFIG_NAME = "config.yaml"
TRAINER_STATE = "trainer_state.json"
#: Column names that hold the step in CSV exports.
STEP_COLUMNS = ("step", "_step", "Step", "global_step", "train/global_step")


class RunLogError(ValueError):
    """A run's log cannot be found or read."""


@dataclass(frozen=True)
class RunLog:
    """A run's metric rows under steadyrl's key names, the framework they came from, and what its config says."""

    rows: list[dict[str, Any]]
    framework: str
    facts: RunFacts
    source: Path


def _number(text: str) -> Any:
    if text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (verl's ``{"step", "data"}`` lines flattened)."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise RunLogError(f"{path}:{n}: not a JSON line ({err.msg})") from None
        if isinstance(row.get("data"), Mapping):
            row = {"step": row.get("step"), **row["data"]}
        rows.append(row)
    return rows


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows of a CSV export with a header; the first step-like column becomes ``step``."""
    with path.open(newline="") as f:
        rows = [{k: _number(v) for k, v in r.items() if k is not None} for r in csv.DictReader(f)]
    for row in rows:
        for col in STEP_COLUMNS:
            if row.get(col) is not None:
                row["step"] = row[col]
                break
    return rows


def read_trainer_state(path: Path) -> list[dict[str, Any]]:
    """TRL's (transformers') ``trainer_state.json``: its ``log_history``."""
    data = json.loads(path.read_text())
    if "log_history" not in data:
        raise RunLogError(f"{path}: no log_history (is it a transformers trainer_state.json?)")
    return [dict(r) for r in data["log_history"]]


def _find(path: Path) -> Path:
    if path.is_file():
        return path
    if not path.is_dir():
        raise RunLogError(f"{path}: no such file or directory")
    for name in (METRICS_NAME, TRAINER_STATE):
        if (path / name).is_file():
            return path / name
    ckpts = sorted(path.glob(f"checkpoint-*/{TRAINER_STATE}"), key=lambda p: int(p.parent.name.split("-")[-1]))
    if ckpts:
        return ckpts[-1]
    logs = sorted([*path.glob("*.jsonl"), *path.glob("*.csv")])
    if len(logs) == 1:
        return logs[0]
    raise RunLogError(f"{path}: found no {METRICS_NAME}, {TRAINER_STATE} or single JSONL/CSV log; pass the file")


def _read(path: Path) -> list[dict[str, Any]]:
    if path.name.endswith(".json"):
        return read_trainer_state(path)
    if path.suffix == ".csv":
        return read_csv(path)
    return read_jsonl(path)


def steadyrl_facts(config_path: Path) -> RunFacts:
    """What a steadyrl run's ``config.yaml`` says: the method's claims, staleness and its bound in versions."""
    from steadyrl.config.io import load_config
    from steadyrl.config.train import TrainConfig
    from steadyrl.train.loop import is_stale

    cfg = load_config(TrainConfig, path=config_path)
    method = cfg.method.resolve()
    per_step = cfg.optim.updates_per_batch * cfg.optim.minibatches
    rt = cfg.runtime
    if rt.mode == "lag":  # the lag at the last optimizer step of a learner step
        steps = rt.lag.k + 1 if rt.lag.schedule == "pipeline" else rt.lag.refresh_every
        bound: int | None = steps * per_step - 1
    elif rt.concurrent.sync:
        bound = per_step - 1
    elif cfg.pool.policy in ("max_staleness", "drop"):
        bound = cfg.pool.max_staleness + per_step - 1
    else:
        bound = None
    return RunFacts(
        corrects_behavior=corrects_behavior(method), trust_region=claims_trust_region(method), stale=is_stale(cfg),
        staleness_bound=bound,
    )  # fmt: skip


def read_run(path: str | Path, *, framework: str | None = None, facts: Mapping[str, Any] | None = None) -> RunLog:
    """The run at ``path`` (see the module docstring); ``facts`` override what the config or the log says."""
    source = _find(Path(path))
    raw = _read(source)
    if not raw:
        raise RunLogError(f"{source}: no metric rows")
    fw = framework or keymaps.detect(raw)
    if fw not in keymaps.KEY_MAPS:
        raise RunLogError(f"framework {fw!r} is not one of {', '.join(keymaps.KEY_MAPS)}")
    rows = [keymaps.rename(r, fw) for r in raw]
    config = source.parent / CONFIG_NAME
    if fw == "steadyrl" and config.is_file():
        base = steadyrl_facts(config)
    else:
        clip_logged = any("loss/clip_frac" in r for r in rows)
        base = RunFacts(
            corrects_behavior=keymaps.corrects_behavior(raw, fw), trust_region=True if clip_logged else None
        )
    merged = RunFacts(**{**base.__dict__, **{k: v for k, v in (facts or {}).items() if v is not None}})
    return RunLog(rows, fw, merged, source)
