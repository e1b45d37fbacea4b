"""Other frameworks' metric names for steadyrl's: read by ``steadyrl check`` (their key → ours) and written by
``log.metric_names`` (ours → theirs, beside steadyrl's own keys).

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


def framework_names(record: Mapping[str, Any], framework: str) -> dict[str, Any]:
    """``record`` plus each of its keys that ``framework`` names differently, under that name (the inverse of the
    key map: ``log.metric_names=verl`` also writes ``rollout_corr/k3_kl`` beside ``kl/k3``). ``steadyrl``: unchanged."""
    inverse = {ours: theirs for theirs, ours in KEY_MAPS[framework].items() if ours != "step"}
    extra = {inverse[k]: v for k, v in record.items() if k in inverse and inverse[k] not in record}
    return dict(record) | extra  # never overwrites one of steadyrl's keys (TRL's "loss" is not steadyrl's "loss")
