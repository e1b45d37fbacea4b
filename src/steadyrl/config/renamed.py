"""Config keys that moved, and the move applied to a config written with their former names.

The keys of ``steadyrl train`` are grouped by what they configure (the sampler under ``rollout``, the vLLM engine
under ``rollout.vllm``, each runtime mode under ``runtime.lag`` / ``runtime.concurrent``, each logging sink, Muon and
PACE in their own sub-sections). A config file, an override or a saved ``config.yaml`` that uses a former name still
loads, until steadyrl 0.3: the value moves to its current key and a one-line :class:`RenamedKeyWarning` names both.
Giving a value under both names is an error, unless the two agree.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

#: The release that stops reading the former names.
REMOVED_IN = "0.3"

#: Former dotted key → current dotted key.
RENAMED: dict[str, str] = {
    # the sampler: one section (sampling settings, eval sampling, the sampler processes, the engine)
    "sampling.max_new_tokens": "rollout.max_new_tokens",
    "sampling.temperature": "rollout.temperature",
    "sampling.top_p": "rollout.top_p",
    "sampling.top_k": "rollout.top_k",
    "eval.greedy": "rollout.eval.greedy",
    "eval.temperature": "rollout.eval.temperature",
    "runtime.sampler_device": "rollout.device",
    "runtime.sampler_threads": "rollout.threads",
    "runtime.sampler_batch": "rollout.batch",
    "rollout.dtype": "rollout.vllm.dtype",
    "rollout.kv_cache_gb": "rollout.vllm.kv_cache_gb",
    "rollout.max_model_len": "rollout.vllm.max_model_len",
    "rollout.enforce_eager": "rollout.vllm.enforce_eager",
    "rollout.gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "rollout.max_num_seqs": "rollout.vllm.max_num_seqs",
    # the runtime, by mode
    "lag": "runtime.lag.k",
    "runtime.schedule": "runtime.lag.schedule",
    "runtime.refresh_every": "runtime.lag.refresh_every",
    "runtime.snapshot_memory_gb": "runtime.lag.snapshot_memory_gb",
    "runtime.snapshot_dir": "runtime.lag.snapshot_dir",
    "runtime.samplers": "runtime.concurrent.samplers",
    "runtime.sync": "runtime.concurrent.sync",
    "runtime.inflight": "runtime.concurrent.inflight",
    "runtime.stall_timeout_s": "runtime.concurrent.stall_timeout_s",
    "runtime.ray_address": "runtime.concurrent.ray_address",
    # sub-sections instead of flat prefixes
    "proximal_beta": "proximal.beta",
    "log.wandb_project": "log.wandb.project",
    "log.wandb_mode": "log.wandb.mode",
    "log.mlflow_uri": "log.mlflow.uri",
    "log.mlflow_experiment": "log.mlflow.experiment",
    "optim.muon_lr": "optim.muon.lr",
    "optim.muon_momentum": "optim.muon.momentum",
    "optim.muon_nesterov": "optim.muon.nesterov",
    "optim.muon_weight_decay": "optim.muon.weight_decay",
    "optim.muon_ns_steps": "optim.muon.ns_steps",
    "optim.muon_adjust_lr": "optim.muon.adjust_lr",
    "pool.target_occupancy": "pool.pace.target_occupancy",
    "pool.pace_lambda": "pool.pace.weight",
    "pool.pace_score": "pool.pace.score",
    "pool.pace_gamma": "pool.pace.gamma",
    "pool.pace_ema": "pool.pace.ema",
}

#: Sections that are gone as a whole: a key left under one after the moves (a misspelling) is reported at its new
#: home, where the unknown-key message lists the valid keys.
RENAMED_SECTIONS: dict[str, str] = {"sampling": "rollout"}

#: What a bare value of a section stands for when a moved key lands inside it (``proximal: ewma``, ``wandb: true``).
_BARE = {str: "name", bool: "enabled"}

_MISSING = object()


class RenamedKeyWarning(FutureWarning):
    """A config key was given under its former name (the message names the current one)."""


def renamed_message(old: str, new: str) -> str:
    """The one-line notice for ``old``."""
    return f"config key {old!r} is renamed to {new!r} (the old name is read until steadyrl {REMOVED_IN})"


def _pop(data: dict[str, Any], parts: list[str]) -> Any:
    """Remove and return ``data[p0][p1]...`` (``_MISSING`` when absent); emptied parent sections go too."""
    node = data
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return _MISSING
    if not isinstance(node, dict) or parts[-1] not in node:
        return _MISSING
    value = node.pop(parts[-1])
    for depth in range(len(parts) - 1, 0, -1):  # drop sections the move left empty
        parent = data
        for part in parts[: depth - 1]:
            parent = parent[part]
        if parent[parts[depth - 1]] == {}:
            del parent[parts[depth - 1]]
        else:
            break
    return value


def _put(data: dict[str, Any], parts: list[str], value: Any, *, old: str, new: str) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            bare = _BARE.get(type(child))
            if bare is None:
                raise ValueError(f"{old!r} (renamed to {new!r}): {part!r} is a value here, not a section")
            child = node[part] = {bare: child}
        node = child
    current = node.get(parts[-1], _MISSING)
    if current is not _MISSING and current != value:
        raise ValueError(
            f"{old!r} and {new!r} are the same setting (the first is its former name) and were given different "
            f"values ({value!r}, {current!r}): keep {new!r} only"
        )
    node[parts[-1]] = value


def move_renamed(
    data: dict[str, Any], *, warn: bool = True, renamed: Mapping[str, str] = RENAMED
) -> dict[str, Any]:
    """A copy of the config mapping ``data`` with every former key of ``renamed`` moved to its current one (one
    :class:`RenamedKeyWarning` per key moved, unless ``warn`` is False)."""
    out = _copy(data)
    for old, new in renamed.items():
        value = _pop(out, old.split("."))
        if value is _MISSING:
            continue
        _put(out, new.split("."), value, old=old, new=new)
        if warn:
            warnings.warn(renamed_message(old, new), RenamedKeyWarning, stacklevel=2)
    for old, new in RENAMED_SECTIONS.items():
        rest = out.pop(old, _MISSING)
        if isinstance(rest, dict):
            target = out.setdefault(new, {})
            if isinstance(target, dict):
                for key, value in rest.items():
                    target.setdefault(key, value)
        elif rest is not _MISSING:
            out[old] = rest
    return out


def _copy(value: Any) -> Any:
    return {k: _copy(v) for k, v in value.items()} if isinstance(value, dict) else value
