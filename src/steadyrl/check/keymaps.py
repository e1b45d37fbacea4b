"""Other frameworks' metric names, mapped to steadyrl's, so one set of rules reads every run's log.

The names are taken from the installed packages' source (verl 0.9, TRL 1.16, OpenRLHF), where each logs them:

verl (``verl/trainer/ppo/rollout_corr_helper.py``, logged under ``rollout_corr/``; ``core_algos.py`` and the actor
for ``actor/...``; ``trainer/ppo/v1/trainer_base.py`` for the staleness). ``rollout_corr/k3_kl`` is the k3 estimate of
KL(π_rollout ‖ π_old) per token, exactly steadyrl's ``kl/k3``; ``rollout_corr/rollout_is_eff_sample_size`` is the
token-level ESS / N of its applied weights, steadyrl's ``is/ess_ratio_weights`` (``weights_ess=true``).
A logged ``rollout_corr/rollout_is_mean`` means IS against the sampler is on.

TRL (``trl/trainer/grpo_trainer.py``): ``clip_ratio/region_mean`` is the fraction of tokens out of the clip range
against π_old; TRL's ``kl`` is the KL to the *reference* model, not the mismatch KL, so it is not mapped.
``sampling/importance_sampling_ratio/mean`` is logged only with the vLLM importance-sampling correction on.

OpenRLHF (``openrlhf/trainer/ray/ppo_actor.py``, ``openrlhf/models/loss.py``; the W&B logger prefixes ``train/``):
``ppo_clip_ratio`` is the out-of-clip fraction; ``vllm_kl`` is the k1 estimate mean(log μ − log π_old), logged only
when its IS correction is on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

Framework = Literal["steadyrl", "verl", "trl", "openrlhf"]

#: framework → {its key: steadyrl's key}.
KEY_MAPS: dict[str, dict[str, str]] = {
    "steadyrl": {},
    "verl": {
        "training/global_step": "step",
        "rollout_corr/k3_kl": "kl/k3",
        "rollout_corr/kl": "kl/k1",
        "rollout_corr/rollout_is_eff_sample_size": "is/ess_ratio_weights",
        "actor/pg_clipfrac": "loss/clip_frac",
        "actor/pg_loss": "loss/policy",
        "actor/grad_norm": "grad/norm",
        "critic/score/mean": "reward/mean",
        "training/off_policy/trajectory_staleness/max": "lag/max",
    },
    "trl": {
        "clip_ratio/region_mean": "loss/clip_frac",
        "loss": "loss/policy",
        "grad_norm": "grad/norm",
        "reward": "reward/mean",
    },
    "openrlhf": {
        "global_step": "step",
        "ppo_clip_ratio": "loss/clip_frac",
        "vllm_kl": "kl/k1",
        "policy_loss": "loss/policy",
        "reward": "reward/mean",
    },
}

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
