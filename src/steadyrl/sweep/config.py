"""The sweep file of ``steadyrl sweep`` and its expansion into named ``steadyrl train`` runs.

A sweep file is YAML (strict: an unknown key is an error that names it)::

    config: default                  # the `steadyrl train` config every run starts from (file or shipped name)
    base: {lag: 64, steps: 300, prompts_per_step: 16, lr: 3e-4}   # overrides for every run
    grid:                            # the product of these lists ...
      method:
        - vcpo
        - seq_tis
        - {name: seq_tis_guard, overrides: {method: seq_tis, guard.mode: rollback}}   # a variant
      lag: [64]
    include:                         # ... plus the product of each of these (optional)
      - {method: [grpo], lag: [0]}
    seeds: [0, 1]                    # every grid point runs with each seed
    jobs: 2                          # runs at a time (default: CPU cores // threads)
    threads: 1                       # torch threads of each run (runtime.threads)
    out_dir: runs/lag64

Expansion: the runs are the product of ``grid``'s lists (keys in the order written), then of each ``include`` grid,
each times ``seeds``. A run's ``steadyrl train`` overrides are, in order: ``base``, its grid values (a plain value
``v`` under key ``k`` is ``k=v``; a **variant** ``{name, overrides}`` applies its overrides and, when they do not
set ``k`` itself and ``k`` is a config key, also ``k=name``), ``seed``, then ``runtime.threads``,
``log.progress=false`` and ``out_dir``. Nested mappings are written as dotted keys (``guard: {mode: rollback}`` is
``guard.mode=rollback``). Every run's config is validated before anything starts.

Naming: the run directory is ``<out_dir>/<key=label,...,seed=S>`` from its grid values (a variant's label is its
name; ``runtime.lag.k`` is labelled ``lag``), e.g. ``method=vcpo,lag=64,seed=0``; characters outside
``[A-Za-z0-9._+=,-]`` become ``_``. The **config hash** identifies what a run computes: the first 10 hex digits of
the SHA-256 of its resolved config without the keys that do not change the result (``out_dir``, ``resume``,
``overwrite``, ``log``, ``checkpoint``, ``runtime.threads``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from steadyrl.config.io import ConfigError, load_config
from steadyrl.config.train import TrainConfig

#: Keys a sweep sets itself for every run (``seed`` comes from ``seeds``, threads from ``threads``).
RESERVED_KEYS = ("out_dir", "resume", "overwrite", "seed", "runtime.threads")
#: Top-level config keys left out of the config hash (they do not change what a run computes).
HASH_EXCLUDED = ("out_dir", "resume", "overwrite", "log", "checkpoint")
#: Nested config keys left out of the config hash.
HASH_EXCLUDED_NESTED = (("runtime", "threads"),)
HASH_CHARS = 10
#: Characters kept in a run directory name (others become ``_``).
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=,-]")
#: Longest run directory name; longer names are cut and end with their hash.
MAX_NAME = 200
#: The method and lag of the reference run that ``final_acc_rel`` divides by (same seed and other grid values).
REFERENCE_METHOD = "grpo"
REFERENCE_LAG = 0
#: The file a sweep writes into its out_dir with every run's grid values and hash (read by ``steadyrl report``).
RUNS_FILE = "runs.json"
#: The sweep's resolved config, written into its out_dir.
SWEEP_FILE = "sweep.yaml"
#: Short labels of grid keys in run names and tables (the lag is the sweeps' usual axis).
LABEL_KEYS: dict[str, str] = {"runtime.lag.k": "lag"}


class SweepError(ValueError):
    """A sweep cannot be planned or run; the message says why in plain words."""


class Variant(BaseModel):
    """One grid value that sets several keys at once: a name (the run's label) and its overrides."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Label of the value in run names and tables, e.g. seq_tis_guard.")
    overrides: dict[str, Any] = Field(default_factory=dict, description="steadyrl train keys to set, e.g. "
                                      "{method: seq_tis, guard.mode: rollback}.")


#: A grid value: a plain config value, or a variant.
GridValue = Variant | bool | int | float | str | list[Any] | None
Grid = dict[str, list[GridValue]]


def _check_grid(grid: Grid, where: str) -> Grid:
    for key, values in grid.items():
        if not values:
            raise ValueError(f"{where}.{key}: the list of values is empty")
        _check_keys([key], f"{where}.{key}")
        if not _is_config_key(key) and not all(isinstance(v, Variant) for v in values):
            raise ValueError(f"{where}.{key}: {key!r} is not a steadyrl train key, so each of its values must be a "
                             "variant {name: ..., overrides: {...}}")
        for v in values:
            if isinstance(v, Variant):
                _check_keys([k for k, _ in flatten(v.overrides)], f"{where}.{key} variant {v.name!r}")
        labels = [label(v) for v in values]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"{where}.{key}: values with the same label {dup} would share run directories")
    return grid


def _check_keys(keys: Sequence[str], where: str) -> None:
    for key in keys:
        if key in RESERVED_KEYS:
            hint = {"seed": "list the seeds under `seeds`", "runtime.threads": "use the sweep's `threads`"}.get(
                key, "the sweep sets it for every run")
            raise ValueError(f"{where}: {key!r} cannot be set here ({hint})")


def _is_config_key(key: str) -> bool:
    return key.split(".")[0] in TrainConfig.model_fields or key in TrainConfig.former_keys


class SweepConfig(BaseModel):
    """Everything ``steadyrl sweep`` needs (see the module docstring for the expansion rules)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: str = Field("default", min_length=1, description="The steadyrl train config every run starts from: a "
                        "YAML file (relative to the working directory, else to the sweep file) or a shipped name.")
    base: dict[str, Any] = Field(default_factory=dict, description="steadyrl train overrides for every run, e.g. "
                                 "{runtime.lag.k: 64, steps: 300, guard.mode: rollback}.")
    grid: Grid = Field(default_factory=dict, description="Config key -> list of values; the runs are the product of "
                       "the lists. A value may be a variant {name, overrides} that sets several keys.")
    include: list[Grid] = Field(default_factory=list, description="More grids, each expanded like `grid`; their runs "
                                "are added (e.g. [{method: [grpo], runtime.lag.k: [0]}] for the lag-0 reference).")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1, description="Seeds: every grid point runs "
                             "once per seed.")
    out_dir: Path = Field(Path("runs/sweep"), description="Directory of the sweep: one subdirectory per run, "
                          "runs.json, results.csv, summary.csv, summary.md.")
    jobs: int | None = Field(None, ge=1, le=1024, description="Runs at a time (None: CPU cores // threads, at least "
                             "1).")
    threads: int = Field(1, ge=1, le=1024, description="torch CPU threads of each run (its runtime.threads).")
    collapse_drop: float = Field(0.15, gt=0, le=1, description="A run collapsed at the first eval whose accuracy is "
                                 "more than this (absolute) below the best accuracy of the run so far.")
    grace_s: float = Field(120.0, ge=0, le=86_400, description="After Ctrl-C, seconds the running runs get to "
                           "checkpoint (they stop after their current step) before they are killed.")
    progress: bool = Field(True, description="Show a progress bar (runs done / running / left, ETA).")

    @field_validator("seeds")
    @classmethod
    def _seeds_valid(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError(f"each seed must appear once, got {value}")
        if any(s < 0 or s > 2**31 - 1 for s in value):
            raise ValueError(f"seeds must be in [0, 2**31 - 1], got {value}")
        return value

    @field_validator("base")
    @classmethod
    def _base_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_keys([k for k, _ in flatten(value)], "base")
        return value

    @field_validator("grid")
    @classmethod
    def _grid_valid(cls, value: Grid) -> Grid:
        return _check_grid(value, "grid")

    @field_validator("include")
    @classmethod
    def _include_valid(cls, value: list[Grid]) -> list[Grid]:
        for i, grid in enumerate(value):
            _check_grid(grid, f"include[{i}]")
        return value

    def n_jobs(self) -> int:
        """``jobs``, or the CPU cores this process may use divided by ``threads`` (at least 1)."""
        if self.jobs is not None:
            return self.jobs
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // self.threads)


@dataclass(frozen=True)
class RunEntry:
    """What results and reports need to know of a run (also the rows of ``runs.json``)."""

    name: str
    """Directory name under the sweep's out_dir."""
    labels: dict[str, str]
    """Grid key -> label of the run's value (variant name or formatted value), in grid order; without the seed."""
    method: str
    """The ``method`` column: the grid label of ``method`` if the grid varies it, else the config's method name."""
    lag: int
    seed: int
    steps: int
    config_hash: str
    reference: bool = False
    """True for a lag-0 ``grpo`` run (pipeline schedule): the denominator of ``final_acc_rel``."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``runs.json``)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunEntry:
        """Inverse of :meth:`to_json`."""
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class RunSpec:
    """One planned run: its entry, the ``steadyrl train`` arguments and the resolved config."""

    entry: RunEntry
    config_path: Path
    """The train config file the overrides apply to."""
    overrides: tuple[str, ...]
    """``key=value`` arguments of ``steadyrl train`` (out_dir included; resume/overwrite are added per launch)."""
    config: TrainConfig = field(repr=False)

    @property
    def out_dir(self) -> Path:
        """The run's directory."""
        return Path(self.config.out_dir)


# ------------------------------------------------------------------------------------------------ helpers
def flatten(mapping: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested mappings as ``(dotted key, value)`` pairs, in order, a section's ``name`` before its other keys
    (setting a section's name afresh resets the section, so it must come first)."""
    out: list[tuple[str, Any]] = []
    items = sorted(mapping.items(), key=lambda kv: kv[0] != "name")
    for key, value in items:
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out += flatten(value, f"{dotted}.")
        else:
            out.append((dotted, value))
    return out


def override(key: str, value: Any) -> str:
    """``key=value`` with the value written as JSON (which the train command reads back as the same YAML value)."""
    return f"{key}={json.dumps(value)}"


def label(value: GridValue) -> str:
    """A grid value as it appears in run names and tables: a variant's name, else the value, compactly."""
    if isinstance(value, Variant):
        return value.name
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, list):
        return "_".join(label(v) for v in value)
    return str(value)


def _strip(tree: Any, path: Sequence[str]) -> None:
    node = tree
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(path[-1], None)


def config_hash(config: TrainConfig | Mapping[str, Any]) -> str:
    """The first ``HASH_CHARS`` hex digits of SHA-256 over the resolved config, without ``HASH_EXCLUDED`` keys."""
    dump = config.model_dump(mode="json") if isinstance(config, TrainConfig) else json.loads(json.dumps(config))
    for key in HASH_EXCLUDED:
        dump.pop(key, None)
    for path in HASH_EXCLUDED_NESTED:
        _strip(dump, path)
    return hashlib.sha256(json.dumps(dump, sort_keys=True).encode()).hexdigest()[:HASH_CHARS]


def run_name(labels: Sequence[tuple[str, str]]) -> str:
    """``key=label,key=label,...`` made safe for a directory name (cut, and ended by a hash, past ``MAX_NAME``)."""
    raw = ",".join(f"{k}={v}" for k, v in labels)
    name = _UNSAFE.sub("_", raw).lstrip(".") or "run"
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
        name = f"{name[: MAX_NAME - 9]}-{digest}"
    return name


def _points(grid: Grid) -> Iterator[list[tuple[str, GridValue]]]:
    keys = list(grid)
    for combo in itertools.product(*(grid[k] for k in keys)):
        yield list(zip(keys, combo, strict=True))


def _value_overrides(key: str, value: GridValue) -> list[str]:
    if not isinstance(value, Variant):
        return [override(k, v) for k, v in flatten({key: value})]
    pairs = flatten(value.overrides)
    sets_key = any(k == key or k.startswith(f"{key}.") for k, _ in pairs)
    head = [override(key, value.name)] if _is_config_key(key) and not sets_key else []
    return head + [override(k, v) for k, v in pairs]


def resolve_train_config(arg: str, *, sweep_file: Path | None) -> Path:
    """The train config ``arg`` names: a file (relative to the working directory, else to the sweep file's
    directory) or a shipped config name."""
    from steadyrl.train.entry import resolve_config_path

    if sweep_file is not None and not Path(arg).is_absolute() and not Path(arg).is_file():
        beside = sweep_file.parent / arg
        if beside.is_file():
            return beside
    return resolve_config_path(arg)


def expand(sweep: SweepConfig, *, sweep_file: Path | None = None) -> list[RunSpec]:
    """Every run of the sweep, in grid order (seed innermost), each config validated; raises :class:`SweepError`."""
    try:
        config_path = resolve_train_config(sweep.config, sweep_file=sweep_file)
    except ConfigError as err:
        raise SweepError(f"config: {err}") from None
    base = [override(k, v) for k, v in flatten(sweep.base)]
    specs: list[RunSpec] = []
    seen: dict[str, list[tuple[str, str]]] = {}
    for grid in [sweep.grid, *sweep.include]:
        for point in _points(grid):
            for seed in sweep.seeds:
                labels = [(LABEL_KEYS.get(k, k), label(v)) for k, v in point]
                name = run_name([*labels, ("seed", str(seed))])
                if name in seen:
                    raise SweepError(f"two runs would share the directory {name!r} (grid values {seen[name]} and "
                                     f"{labels}); give them different labels")
                seen[name] = labels
                out_dir = sweep.out_dir / name
                overrides = [*base, *(o for k, v in point for o in _value_overrides(k, v)), override("seed", seed),
                             override("runtime.threads", sweep.threads), "log.progress=false",
                             override("out_dir", str(out_dir))]
                try:
                    cfg = load_config(TrainConfig, path=config_path, overrides=overrides)
                except ConfigError as err:
                    raise SweepError(f"run {name}: {err}") from None
                specs.append(RunSpec(_entry(name, dict(labels), cfg), config_path, tuple(overrides), cfg))
    return specs


def _entry(name: str, labels: dict[str, str], cfg: TrainConfig) -> RunEntry:
    method = labels.get("method", cfg.method.name)
    lag = cfg.runtime.lag
    reference = (method == REFERENCE_METHOD and cfg.method.name == REFERENCE_METHOD and lag.k == REFERENCE_LAG
                 and lag.schedule == "pipeline")
    return RunEntry(name=name, labels=labels, method=method, lag=lag.k, seed=cfg.seed, steps=cfg.steps,
                    config_hash=config_hash(cfg), reference=reference)


def entry_of_run(run_dir: Path, cfg: TrainConfig) -> RunEntry:
    """The entry of a run that no sweep planned (``steadyrl report`` on a single run directory)."""
    return _entry(run_dir.name, {}, cfg)


def load_sweep(path: Path | None, overrides: Sequence[str]) -> SweepConfig:
    """The sweep config from a YAML file (or the defaults) plus ``key=value`` overrides; raises ``ConfigError``."""
    return load_config(SweepConfig, path=path, overrides=list(overrides))


def config_differences(a: Mapping[str, Any], b: Mapping[str, Any], limit: int = 6) -> list[str]:
    """Up to ``limit`` dotted keys whose values differ between two config dumps, as ``key: a -> b``."""
    fa, fb = dict(flatten(a)), dict(flatten(b))
    out = []
    for key in sorted(set(fa) | set(fb)):
        top = key.split(".")[0]
        if top in HASH_EXCLUDED or any(key == ".".join(p) for p in HASH_EXCLUDED_NESTED):
            continue
        if fa.get(key) != fb.get(key):
            out.append(f"{key}: {fa.get(key)!r} -> {fb.get(key)!r}")
    return out[:limit]


def write_runs(sweep_dir: Path, specs: Sequence[RunSpec]) -> Path:
    """Write ``runs.json``: every planned run's entry and ``steadyrl train`` arguments (atomically)."""
    path = sweep_dir / RUNS_FILE
    data = {"runs": [{**s.entry.to_json(), "config_path": str(s.config_path), "overrides": list(s.overrides)}
                     for s in specs]}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path


def read_runs(sweep_dir: Path) -> list[RunEntry]:
    """The entries of the runs a sweep planned (its ``runs.json``)."""
    data = json.loads((sweep_dir / RUNS_FILE).read_text())
    return [RunEntry.from_json(d) for d in data["runs"]]
