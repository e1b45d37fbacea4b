"""Recognise and rename other frameworks' logs to steadyrl's key names, so one set of rules reads every run's log.

The key maps and where each name comes from: :mod:`steadyrl.train.metric_names`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from steadyrl.train.metric_names import KEY_MAPS, Framework

__all__ = [
    "CORRECTION_KEYS",
    "KEY_MAPS",
    "PREFIXES",
    "SIGNATURES",
    "Framework",
    "corrects_behavior",
    "detect",
    "rename",
]

#: Keys whose presence means the run corrected against the sampler μ (per framework).
CORRECTION_KEYS: dict[str, tuple[str, ...]] = {
    "steadyrl": (),
    "verl": ("rollout_corr/rollout_is_mean",),
    "trl": ("sampling/importance_sampling_ratio/mean",),
    "openrlhf": ("vllm_kl", "is_filter_ratio"),
}

#: Keys only that framework logs (used to recognise a log).
SIGNATURES: dict[str, tuple[str, ...]] = {
    "steadyrl": ("loss/total", "lag/max", "data/batch_hash", "sample/version"),
    "verl": ("actor/pg_loss", "actor/pg_clipfrac", "training/global_step"),
    "trl": ("clip_ratio/region_mean", "frac_reward_zero_std", "completions/mean_length"),
    "openrlhf": ("ppo_clip_ratio", "policy_loss", "actor_lr"),
}
#: Prefixes a framework's logger adds (stripped before mapping; ``steadyrl/``: steadyrl's TRL adapter logs its own
#: metrics under steadyrl's names with that prefix).
PREFIXES: dict[str, tuple[str, ...]] = {"openrlhf": ("train/",), "trl": ("train/", "steadyrl/")}


def _strip(key: str, framework: str) -> str:
    for prefix in PREFIXES.get(framework, ()):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def detect(rows: list[Mapping[str, Any]]) -> Framework:
    """The framework whose signature keys the rows hold most of (steadyrl when none)."""
    keys = {k for r in rows for k in r}
    scores = {}
    for name, sig in SIGNATURES.items():
        stripped = {_strip(k, name) for k in keys}
        scores[name] = sum(1 for s in sig if s in stripped)
    best = max(scores, key=lambda n: scores[n])
    return best if scores[best] > 0 else "steadyrl"  # type: ignore[return-value]


def rename(row: Mapping[str, Any], framework: str) -> dict[str, Any]:
    """``row`` under steadyrl's key names (unmapped keys kept as they are)."""
    mapping = KEY_MAPS[framework]
    out: dict[str, Any] = {}
    for key, value in row.items():
        plain = _strip(key, framework)
        out[mapping.get(plain, plain)] = value
    return out


def corrects_behavior(rows: list[Mapping[str, Any]], framework: str) -> bool | None:
    """True when the log shows a correction against μ; None when this framework's log cannot say."""
    keys = {_strip(k, framework) for r in rows for k in r}
    markers = CORRECTION_KEYS[framework]
    if not markers:
        return None
    return True if any(m in keys for m in markers) else None
