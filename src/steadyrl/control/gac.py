"""GAC, gradient alignment control (arXiv 2603.01501) [reconstructed thresholds], as an optimizer-step hook.

Keeps the previous step's gradient (one tensor per parameter, in the gradient's dtype, on its device), applies
:func:`steadyrl.core.gradient_alignment.gac_project_` to the current gradient in place, part by part (no flat copy of
the model). A "skip" decision asks the learner not to apply the step (``control/skip_step``): zeroing the gradient would
not do, since Adam's moments would still move the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from steadyrl.control.base import SKIP_STEP, grad_parts, parts_like
from steadyrl.core import gradient_alignment as core_gac
from steadyrl.methods.spec import GAC


class GradientAlignmentController:
    """Project out (or skip) the part of g_t aligned with g_{t−1} when their cosine is high."""

    reads: tuple[str, ...] = ()

    def __init__(self, spec: GAC) -> None:
        self.spec = spec
        self.prev: list[Tensor] | None = None

    @property
    def keeps_raw_prev(self) -> bool:
        """True for ``prev="raw"`` (the default): :attr:`prev_grad` is then the raw previous gradient."""
        return self.spec.prev == "raw"

    @property
    def prev_grad(self) -> list[Tensor] | None:
        """g_{t−1} as kept (the raw one with ``prev="raw"``, the default), for the learner's ``grad/cos_prev``."""
        return self.prev if self.spec.prev == "raw" else None

    def before_step(
        self, *, optimizer: torch.optim.Optimizer, params: Sequence[Tensor], metrics: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        parts = grad_parts(params)
        kwargs: dict[str, Any] = {"alpha": self.spec.alpha, "skip_action": self.spec.skip_action}
        if self.spec.tau_proj is not None:
            kwargs["tau_proj"] = self.spec.tau_proj
        if self.spec.tau_skip is not None:
            kwargs["tau_skip"] = self.spec.tau_skip
        raw = [g.detach().clone() for g in parts] if self.spec.prev == "raw" else None
        out = core_gac.gac_project_(parts, parts_like(self.prev, params), **kwargs)
        self.prev = raw if raw is not None else [g.detach().clone() for g in parts]
        skipped = out.skipped.to(torch.float32)
        return {
            "gac/cos": out.cos.detach().to(torch.float32),
            "gac/projected": out.projected.to(torch.float32),
            "gac/skipped": skipped,
            SKIP_STEP: skipped,
        }

    def after_step(self, *, optimizer: torch.optim.Optimizer) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"prev": self.prev}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (a flat previous gradient of an older checkpoint is split at the next step)."""
        prev = state.get("prev")
        self.prev = [prev] if isinstance(prev, Tensor) else prev
