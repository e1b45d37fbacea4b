"""``steadyrl train [CONFIG.yaml] [key=value ...]``: the command-line face of the training job.

This is the command layer of ``train``: it parses arguments, loads and validates the config, wires the rollout
runtime the config names (``runtime.mode=lag`` → :class:`steadyrl.runtime.lag.LagSampler`) into
:func:`steadyrl.train.loop.train`, and turns configuration errors into a message and exit status 2.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Any

from steadyrl.config.io import (
    ConfigError,
    format_help,
    load_config,
    parse_command_line,
    resolve_named_file,
    shipped_yaml,
)
from steadyrl.config.train import TrainConfig

USAGE = """usage: steadyrl train [CONFIG] [key=value ...] [--print-config]

RL-train a causal LM on a verifiable task with an exact policy lag. CONFIG is a YAML file or the name of a shipped
config; without it, `default` is used: the README's main job (chain_sum with two 2-digit terms, the embedded tiny
model warm-started and cached, sequence TIS + ESS-scaled step size at lag 16), whose values are the defaults
listed below, grouped by what they configure (rollout: the sampler and its engine; runtime: each mode's
settings). key=value overrides are applied in order; values are YAML (runtime.lag.k=32, lr=1e-4,
optim.betas=[0.9,0.99], method=seq_tis+gac, method.seq_tis.cap=4, task.max_terms=3). Setting a section's name to
a new value (task=countdown, method=grpo) starts that section afresh. A key's former name (lag, sampling.*, ...)
is still read for one release, with a line naming the new key.
Shipped configs: {shipped}.

Outputs in out_dir: metrics.jsonl (one line per step), config.yaml (resolved), plot.png, checkpoints/.
Ctrl-C stops after the current step with a checkpoint; resume=true continues from the latest checkpoint.

  --print-config   print the resolved config as YAML and exit
  -h, --help       this help

keys (type (bounds) = default, then the description):
"""

#: The shipped config used when none is given (the README's main job; equal to TrainConfig's defaults).
DEFAULT_CONFIG = "default"
#: Exit status for a configuration or output-directory error.
EXIT_USAGE = 2
#: Exit status of a run stopped by Ctrl-C (the shell's convention for SIGINT).
EXIT_INTERRUPTED = 130


def lag_source(cfg: TrainConfig, **kw: Any) -> Any:
    """The rollout source of ``runtime.mode=lag`` (keywords: see :class:`steadyrl.train.loop.SourceFactory`)."""
    from steadyrl.runtime.lag import LagSource

    return LagSource.from_config(cfg, **kw)


def local_source(cfg: TrainConfig, **kw: Any) -> Any:
    """The rollout source of ``runtime.mode=local``: sampler processes on this machine."""
    from steadyrl.runtime.local import LocalSource

    return LocalSource.from_config(cfg, **kw)


def ray_source(cfg: TrainConfig, **kw: Any) -> Any:
    """The rollout source of ``runtime.mode=ray``: sampler actors on a Ray cluster."""
    from steadyrl.runtime.ray import RaySource

    return RaySource.from_config(cfg, **kw)


SOURCES = {"lag": lag_source, "local": local_source, "ray": ray_source}


def run(cfg: TrainConfig) -> Any:
    """Train with the runtime ``cfg.runtime.mode`` names; returns :class:`steadyrl.train.loop.RunResult`."""
    from steadyrl.train.loop import train

    if cfg.rollout.engine == "vllm":  # before the model loads: fail in a second, not after a warm start
        from steadyrl.rollout.vllm_engine import require_vllm

        require_vllm()
    return train(cfg, make_source=SOURCES[cfg.runtime.mode])


def shipped_configs() -> dict[str, Path]:
    """The configs shipped in ``steadyrl/configs``, by name (file name without ``.yaml``)."""
    return shipped_yaml(resources.files("steadyrl.configs"))


def resolve_config_path(arg: str) -> Path:
    """``arg`` as a file if it exists, else the shipped config of that name; otherwise a ``ConfigError``."""
    return resolve_named_file(arg, shipped_configs(), kind="config")


def _parse(argv: list[str]) -> tuple[Path | None, list[str], bool]:
    return parse_command_line(
        argv, flag="--print-config", command="steadyrl train", kind="config", resolve=resolve_config_path
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``steadyrl train``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(USAGE.format(shipped=", ".join(sorted(shipped_configs()))) + format_help(TrainConfig))
        return 0
    try:
        path, overrides, print_config = _parse(argv)
        cfg = load_config(TrainConfig, path=path or shipped_configs()[DEFAULT_CONFIG], overrides=overrides)
    except ConfigError as err:
        print(f"steadyrl train: {err}", file=sys.stderr)
        return EXIT_USAGE
    if print_config:
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    from steadyrl.base.device import DeviceError
    from steadyrl.rollout.vllm_engine import VLLMUnavailableError
    from steadyrl.runtime.lag import SnapshotMemoryError
    from steadyrl.tasks import ChatTemplateError, DatasetError
    from steadyrl.tasks.types import MissingFileError
    from steadyrl.train.loop import ContextLengthError, RunDirError

    if cfg.runtime.mode == "ray":  # before the model loads: a missing Ray is one line, not a traceback
        try:
            import steadyrl.runtime.ray  # noqa: F401
        except ImportError as err:
            print(f"steadyrl train: {err}", file=sys.stderr)
            return EXIT_USAGE
    from steadyrl.train.log_sinks import require_trackers

    try:  # likewise a missing wandb / mlflow / tensorboard package (log.wandb, log.mlflow, log.tensorboard)
        require_trackers(wandb=cfg.log.wandb.enabled, mlflow=cfg.log.mlflow.enabled, tensorboard=cfg.log.tensorboard)
    except ImportError as err:
        print(f"steadyrl train: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        result = run(cfg)
    except (RunDirError, VLLMUnavailableError, MissingFileError, DatasetError, ChatTemplateError, DeviceError,
            ContextLengthError, SnapshotMemoryError) as err:  # fmt: skip
        print(f"steadyrl train: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\nsteadyrl train: aborted; checkpoints (if any) are in {cfg.out_dir / 'checkpoints'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_INTERRUPTED if result.interrupted else 0
