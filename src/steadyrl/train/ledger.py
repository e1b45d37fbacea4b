"""The batch ledger and the idle-clip alarm: run-time metrics that show whether a stale-data run trains what it says.

Both follow "Probe the Harness: Setup Checks for Stale-Data RL Comparisons in Language Models" (arXiv 2610.02911):

**Batch ledger** (the paper's check 3, "distinct batches against updates"). Every learner step's batch gets two
fingerprints, computed once per step on the host (one copy of the token ids, no per-token sync):

=============================  ======================================================================================
``data/prompt_hash``           48-bit BLAKE2b of the batch's prompt token ids (the *data order*: equal across arms
                               that share a seed, whatever the method)
``data/batch_hash``            48-bit BLAKE2b of the prompt ids and the sampled response tokens (the *batch*)
``data/distinct_batches``      distinct ``data/batch_hash`` values consumed so far
``data/max_reuse``             the most times one batch has been consumed so far (1 in a healthy run: every step of
                               steadyrl's runtimes draws a new batch)
``data/age_max``               learner version − the oldest sample version of a token in the batch (data age per
                               learner version; the schedule's bound in the lag runtime)
=============================  ======================================================================================

The ledger is part of the checkpoint, so a resumed run keeps counting.

**Idle-clip alarm** (the paper's check 1). A PPO-style trust region clips the ratio π_θ/π_old; when π_old is the
learner's own recompute at the step's start and the batch gets one update, the ratio is exactly 1 on every token,
so the clip never acts, however far the sampler μ is from π_old. The paper's rule: FAIL when the k3 estimate of
KL(μ ‖ π_old) exceeds :data:`IDLE_CLIP_KL` (0.05 nat/token) while max |log π_θ − log π_old| ≤ :data:`IDLE_RATIO_TOL`
(1e-6). At run time the learner logs ``loss/ratio_max`` (max π_θ/π_old) and ``loss/clip_frac``; the ratio is idle
when |log ratio_max| ≤ 1e-6 and the clip fraction is exactly 0. ``check/idle_clip`` is 1 on such a step for a method
that claims a trust region (a clipped objective) and has no correction against μ; methods that correct against μ
(the catalog's ``corrects="loss"``, an explicit correction, or ``policy=bypass``, where π_old is μ itself) and runs
without staleness are never flagged.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from steadyrl.methods.presets import PRESETS_BY_NAME
from steadyrl.methods.resolve import part_presets
from steadyrl.methods.spec import MethodSpec

#: k3 KL(μ ‖ π_old) above which an idle ratio is a failure, nat/token (arXiv 2610.02911, check 1).
IDLE_CLIP_KL = 0.05
#: max |log π_θ − log π_old| at or below which the ratio is idle (arXiv 2610.02911, check 1).
IDLE_RATIO_TOL = 1e-6
#: WARN when the out-of-clip fraction against π_old is below this multiple of the one against μ (check 1).
OUT_OF_CLIP_FACTOR = 0.1
#: Objectives whose loss clips (or softly bounds) the ratio to π_old: the methods that claim a trust region.
TRUST_REGION_OBJECTIVES = frozenset(
    {"ppo_clip", "gspo", "m2po_clip", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "bapo", "sapo", "cispo", "gmpo"}
)
#: Bits of a fingerprint (exact as a JSON integer and as a float64).
HASH_BITS = 48


def tensor_hash(*tensors: Tensor) -> int:
    """A 48-bit BLAKE2b digest of the tensors' values and shapes (host copies; one device sync per tensor)."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        cpu = t.detach().to("cpu", torch.int64).contiguous()
        h.update(str(tuple(cpu.shape)).encode())
        h.update(cpu.numpy().tobytes())
    return int.from_bytes(h.digest(), "big") >> (64 - HASH_BITS)


def batch_fingerprints(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
) -> tuple[int, int]:
    """(prompt hash, batch hash): pads zeroed so the padding width does not matter; rows in the batch's order."""
    prompts = torch.where(prompt_mask.bool(), prompt_ids, torch.zeros_like(prompt_ids))
    responses = torch.where(response_mask.bool(), response_ids, torch.zeros_like(response_ids))
    p = tensor_hash(prompts, prompt_mask.sum(-1))
    return p, tensor_hash(prompts, prompt_mask.sum(-1), responses, response_mask.sum(-1))


@dataclass
class BatchLedger:
    """Counts of every batch fingerprint consumed by the learner (see the module docstring)."""

    counts: dict[int, int] = field(default_factory=dict)

    def record(
        self, *, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
        versions: Tensor, learner_version: int,
    ) -> dict[str, int]:  # fmt: skip
        """Enter one consumed batch; returns its ``data/...`` metrics."""
        prompt_hash, batch_hash = batch_fingerprints(prompt_ids, prompt_mask, response_ids, response_mask)
        self.counts[batch_hash] = self.counts.get(batch_hash, 0) + 1
        sampled = versions[response_mask.bool()]
        oldest = int(sampled.min()) if sampled.numel() else learner_version
        return {
            "data/prompt_hash": prompt_hash,
            "data/batch_hash": batch_hash,
            "data/distinct_batches": len(self.counts),
            "data/max_reuse": max(self.counts.values()),
            "data/age_max": learner_version - oldest,
        }

    def state_dict(self) -> dict[str, Any]:
        """The counts, as lists (checkpoint-safe)."""
        return {"hashes": list(self.counts), "counts": list(self.counts.values())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.counts = dict(zip((int(h) for h in state["hashes"]), (int(c) for c in state["counts"]), strict=True))


def corrects_behavior(method: MethodSpec) -> bool:
    """Whether ``method`` corrects against the behavior policy μ in its loss: a catalog preset of the composition
    (a framework-qualified part: the preset it builds on) that says so (``corrects="loss"``), any correction in the
    spec, or ``policy=bypass`` (the ratio is taken to μ)."""
    by_catalog = any(PRESETS_BY_NAME[n].corrects == "loss" for n in part_presets(method.name))
    return by_catalog or bool(method.corrections) or method.policy == "bypass"


def claims_trust_region(method: MethodSpec) -> bool:
    """Whether ``method``'s objective clips (or bounds) its ratio to π_old."""
    return method.objective.type in TRUST_REGION_OBJECTIVES


def ratio_idle(record: Mapping[str, Any]) -> bool | None:
    """Whether the step's ratio to π_old was idle (None: the record has neither ratio nor clip metric)."""
    ratio_max, clip = record.get("loss/ratio_max"), record.get("loss/clip_frac")
    if ratio_max is None and clip is None:
        return None
    idle = True
    if ratio_max is not None:
        r = float(ratio_max)
        idle = r > 0 and math.isfinite(r) and abs(math.log(r)) <= IDLE_RATIO_TOL
    if clip is not None:
        idle = idle and float(clip) == 0.0
    return idle


@dataclass(frozen=True)
class IdleClipAlarm:
    """The run-time form of check 1 for one method (the rule of the module docstring)."""

    armed: bool
    """False for methods that correct against μ or claim no trust region, and for runs without staleness: they are
    never flagged."""

    @classmethod
    def for_method(cls, method: MethodSpec, *, stale: bool) -> IdleClipAlarm:
        """The alarm for ``method`` in a run whose sampler lags the learner (``stale``) or not."""
        return cls(armed=stale and claims_trust_region(method) and not corrects_behavior(method))

    def __call__(self, record: Mapping[str, Any]) -> int:
        """1 when the step's k3 mismatch KL is over :data:`IDLE_CLIP_KL` while its ratio to π_old was idle."""
        kl = record.get("kl/k3")
        if not self.armed or kl is None or not float(kl) > IDLE_CLIP_KL:
            return 0
        return int(bool(ratio_idle(record)))
