"""Atomic checkpoints of a training run: ``<out_dir>/checkpoints/step_XXXXXXXX.pt``.

A checkpoint is the state at the *start* of a learner step: model weights, the learner (AdamW state, version, previous
gradient, controller states), the rollout source (the lag runtime's snapshot ring), the torch and Python RNG states,
the resolved config, and the metric files' offsets after the previous step's line, so a resumed run truncates them
and continues with identical lines.

Writes are atomic: ``torch.save`` into a hidden temporary file in the same directory, ``fsync``, then ``os.replace``
onto the final name, so a crash or Ctrl-C during a save leaves the previous checkpoints intact and at most a stray
temporary file (deleted on the next save). Loading walks the checkpoints newest first and falls back, with a warning,
past any that cannot be read.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

CHECKPOINT_DIR = "checkpoints"
#: Version of the checkpoint layout; a file with another version is not loaded.
FORMAT_VERSION = 1
_NAME = re.compile(r"^step_(\d{8})\.pt$")
_TMP_PREFIX = ".tmp-"
#: Keys every checkpoint holds.
REQUIRED_KEYS = ("format", "step", "model", "learner", "source", "rng", "metrics", "config")


class LoadedCheckpoint(NamedTuple):
    """A checkpoint read back: its path and its state dict."""

    path: Path
    state: dict[str, Any]


def checkpoint_dir(out_dir: str | Path) -> Path:
    """``<out_dir>/checkpoints``."""
    return Path(out_dir) / CHECKPOINT_DIR


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    """The file of the checkpoint taken at the start of ``step``."""
    return checkpoint_dir(out_dir) / f"step_{step:08d}.pt"


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoint files in ``out_dir``, newest (highest step) first."""
    d = checkpoint_dir(out_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(out_dir: str | Path, state: Mapping[str, Any], *, keep: int) -> Path:
    """Write ``state`` (it must hold ``step``) atomically; keep only the newest ``keep`` checkpoints."""
    missing = [k for k in REQUIRED_KEYS if k not in state and k != "format"]
    if missing:
        raise ValueError(f"checkpoint state lacks {missing}")
    d = checkpoint_dir(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    for stale in d.glob(f"{_TMP_PREFIX}*"):
        stale.unlink(missing_ok=True)
    final = checkpoint_path(out_dir, int(state["step"]))
    tmp = d / f"{_TMP_PREFIX}{final.name}.{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            torch.save({"format": FORMAT_VERSION, **state}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        _fsync_dir(d)
    finally:
        tmp.unlink(missing_ok=True)
    for old in list_checkpoints(out_dir)[keep:]:
        old.unlink(missing_ok=True)
    return final


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read one checkpoint (tensors only: ``weights_only=True``); raises ``ValueError`` if it is not a valid one."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a checkpoint dict")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    if state["format"] != FORMAT_VERSION:
        raise ValueError(f"{path} has checkpoint format {state['format']}, this version reads {FORMAT_VERSION}")
    return state


def load_latest(out_dir: str | Path, *, warn: Callable[[str], None] | None = None) -> LoadedCheckpoint | None:
    """The newest checkpoint of ``out_dir`` that loads; unreadable newer ones are skipped with a warning."""
    for path in list_checkpoints(out_dir):
        try:
            return LoadedCheckpoint(path, load_checkpoint(path))
        except Exception as exc:
            message = f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {exc}); trying the previous one"
            (warn or (lambda m: warnings.warn(m, stacklevel=2)))(message)
    return None
