"""The tensors a loss consumes, validated once with errors that say what is missing and what shape it must have."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

#: What each batch key holds; used in error messages and docs.
KEY_DOCS: dict[str, str] = {
    "logp": "[B,T] log π_θ of each response token, with gradient",
    "behav_logp": "[B,T] log μ recorded by the sampler (of the distribution it sampled from)",
    "mask": "[B,T] 1/True for trained response tokens",
    "prox_logp": "[B,T] log π_prox recomputed at the start of the optimization phase (default: logp detached)",
    "rewards": "[B] outcome reward per response (or [B,T] token rewards)",
    "group_ids": "[B] int64 prompt index of each response, in [0, B)",
    "advantages": "[B] or [B,T] advantages computed by the caller",
    "versions": "[B,T] int64 policy version that produced each token",
    "learner_version": "int, the learner's version now (for lag metrics)",
    "behav_entropy": "[B,T] entropy of the behavior distribution at each token (ESTR)",
    "ref_logp": "[B,T] log π_ref of a frozen reference model (KL terms)",
    "values": "[B,T] critic values V(s_t) (COPC)",
    "grad_sq_norms": "[B] per-trajectory squared gradient norms ‖∇θ log π(y_i)‖² (OPOB)",
    "sum_p2": "[B,T] Σ_v π_v² of the proximal distribution at each token (OTB)",
    "centering": "[B,T] Σ_v sg(μ_v·w_v) log π_θ(v) at each token, with gradient (score centering)",
    "entropy": "[B,T] entropy H = −Σ_v π_θ(v) log π_θ(v) of the policy at each token, with gradient (entropy bonus)",
    "entropy_coef": "0-d tensor or float, the entropy bonus's coefficient this step (default: the method's "
    "entropy.coef; the adaptive_entropy controller hands it over)",
}

#: Log-probs above this are not log-probabilities (rounding of a float32 log-softmax stays far below it); in a coarser
#: dtype (bfloat16, float16) the bound is 16 of its machine epsilons instead.
LOGP_TOLERANCE = 1e-4
_LOGP_KEYS = ("logp", "behav_logp", "prox_logp", "ref_logp")
_TOKEN_KEYS = ("logp", "behav_logp", "mask", "prox_logp", "versions", "behav_entropy", "ref_logp", "values", "sum_p2",
               "centering", "entropy")  # fmt: skip
_SEQ_KEYS = ("group_ids", "grad_sq_norms")


@dataclass(frozen=True)
class LossBatch:
    """Inputs of :func:`steadyrl.compute_loss` (see ``KEY_DOCS`` for each field's shape and meaning)."""

    logp: Tensor
    behav_logp: Tensor
    mask: Tensor
    prox_logp: Tensor | None = None
    rewards: Tensor | None = None
    group_ids: Tensor | None = None
    advantages: Tensor | None = None
    versions: Tensor | None = None
    learner_version: int | None = None
    behav_entropy: Tensor | None = None
    ref_logp: Tensor | None = None
    values: Tensor | None = None
    grad_sq_norms: Tensor | None = None
    sum_p2: Tensor | None = None
    centering: Tensor | None = None
    entropy: Tensor | None = None
    entropy_coef: Tensor | float | None = None

    @classmethod
    def from_any(cls, batch: LossBatch | Mapping[str, Any]) -> LossBatch:
        """Accept a ``LossBatch`` or a mapping; unknown or missing core keys raise ``ValueError`` naming them."""
        if isinstance(batch, LossBatch):
            out = batch
        else:
            allowed = {f.name for f in fields(cls)}
            unknown = sorted(set(batch) - allowed)
            if unknown:
                raise ValueError(f"unknown batch key(s) {unknown}; allowed keys: {', '.join(sorted(allowed))}")
            missing = [k for k in ("logp", "behav_logp", "mask") if batch.get(k) is None]
            if missing:
                raise ValueError(
                    "batch is missing " + "; ".join(f"{k!r} ({KEY_DOCS[k]})" for k in missing)
                )
            out = cls(**dict(batch))
        out.check_shapes()
        return out

    def check_shapes(self) -> None:
        """Raise ``ValueError`` naming the key whose shape or dtype does not fit ``logp``'s [B, T]."""
        if self.logp.dim() != 2:
            raise ValueError(f"'logp' must be [B, T]; got shape {tuple(self.logp.shape)}")
        B, T = self.logp.shape
        for key in _TOKEN_KEYS:
            value = getattr(self, key)
            if value is not None and tuple(value.shape) != (B, T):
                raise ValueError(f"{key!r} must have logp's shape [B, T] = {[B, T]}; got {list(value.shape)}")
        for key in _SEQ_KEYS:
            value = getattr(self, key)
            if value is not None and tuple(value.shape) != (B,):
                raise ValueError(f"{key!r} must have shape [B] = [{B}]; got {list(value.shape)}")
        for key in ("rewards", "advantages"):
            value = getattr(self, key)
            if value is not None and tuple(value.shape) not in ((B,), (B, T)):
                raise ValueError(f"{key!r} must be [B] or [B, T] = {[B, T]}; got {list(value.shape)}")
        for key in ("group_ids", "versions"):
            value = getattr(self, key)
            if value is not None and value.is_floating_point():
                raise ValueError(f"{key!r} must be an integer tensor; got {value.dtype}")
        if not self.logp.is_floating_point():
            raise ValueError(f"'logp' must be a floating tensor; got {self.logp.dtype}")
        coef = self.entropy_coef
        if isinstance(coef, Tensor) and (coef.numel() != 1 or not coef.is_floating_point()):
            raise ValueError(f"'entropy_coef' must be a float or a one-element float tensor; got {coef.dtype} "
                             f"{list(coef.shape)}")  # fmt: skip

    def check_not_empty(self) -> None:
        """Raise ``ValueError`` when the batch has no response (B = 0) or no token position (T = 0)."""
        B, T = self.logp.shape
        if B == 0 or T == 0:
            what = "no response (B = 0)" if B == 0 else "no token position (T = 0)"
            raise ValueError(f"empty batch: 'logp' has shape {[B, T]}, {what}; a loss needs B >= 1 and T >= 1")

    def check_values(self) -> None:
        """Raise ``ValueError`` naming the key that holds NaN or ±inf, or log-probs above :data:`LOGP_TOLERANCE`.

        ``[B, T]`` tensors are checked where ``mask`` is true (padding may hold anything), ``[B]`` ones everywhere.
        All checks run on the device and are read back to the host once (one sync), so this costs a few elementwise
        passes; ``compute_loss(..., validate=False)`` skips it (the trainer and the adapters do).
        """
        mask = self.mask.bool() if self.mask.dtype == torch.bool else self.mask != 0
        found: list[tuple[str, str, Tensor]] = []  # (key, what is wrong, where [same shape as the tensor])
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "mask" or not isinstance(value, Tensor) or not value.is_floating_point():
                continue
            x = value.detach()
            on = mask if tuple(x.shape) == tuple(mask.shape) else torch.ones_like(x, dtype=torch.bool)
            found.append((f.name, "NaN", torch.isnan(x) & on))
            found.append((f.name, "±inf", torch.isinf(x) & on))
            if f.name in _LOGP_KEYS:
                tol = max(LOGP_TOLERANCE, 16 * torch.finfo(x.dtype).eps)
                found.append((f.name, f"log-probabilities > {tol:g}", (x > tol) & on))
        if not found:
            return
        flags = torch.stack([bad.any() for _, _, bad in found]).tolist()  # the one host read
        for (key, what, bad), flag in zip(found, flags, strict=True):
            if flag:
                first = [int(i) for i in bad.nonzero()[0].tolist()]
                where = f"row {first[0]}" + (f", token {first[1]}" if len(first) > 1 else "")
                tokens = bad.dim() == 2 and tuple(bad.shape) == tuple(mask.shape)
                total, unit = (int(mask.sum()), "trained tokens") if tokens else (bad.numel(), "rows")
                of = f"{int(bad.sum())} of {total} {unit}"
                hint = " (pass log π of the sampled tokens, not probabilities or logits)" if "log-prob" in what else ""
                raise ValueError(f"{key!r} holds {what} at {of}, the first at {where}{hint}; {key}: {KEY_DOCS[key]}")

    def require(self, keys: tuple[str, ...], method_name: str) -> None:
        """Raise ``ValueError`` listing every key in ``keys`` that is absent, with what it must hold."""
        missing = [k for k in keys if getattr(self, k) is None]
        if missing:
            detail = "; ".join(f"{k!r}: {KEY_DOCS[k]}" for k in missing)
            raise ValueError(f"method {method_name!r} needs batch tensors it did not get: {detail}")
