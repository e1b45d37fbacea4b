"""GAC, gradient alignment control (arXiv 2603.01501) [reconstructed thresholds], as an optimizer-step hook.

Keeps the previous step's flat gradient (one extra fp32 vector of the parameter count), applies
``steadyrl.core.gac.gac_project`` to the current gradient and writes the result back into ``.grad``.
A "skip" decision asks the learner not to apply the step (``control/skip_step``): zeroing the gradient would not do,
since Adam's moments would still move the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from steadyrl.control.base import SKIP_STEP, flat_grad
from steadyrl.core import gac as core_gac
from steadyrl.methods.spec import GAC


def _write_back(params: Sequence[Tensor], flat: Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is not None:
            p.grad.copy_(flat[offset : offset + n].view_as(p).to(p.grad.dtype))
        offset += n


class GradientAlignmentController:
    """Project out (or skip) the part of g_t aligned with g_{t−1} when their cosine is high."""

    def __init__(self, spec: GAC) -> None:
        self.spec = spec
        self.prev: Tensor | None = None

    def before_step(
        self, *, optimizer: torch.optim.Optimizer, params: Sequence[Tensor], metrics: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        grad = flat_grad(params)
        kwargs: dict[str, Any] = {"alpha": self.spec.alpha, "skip_action": self.spec.skip_action}
        if self.spec.tau_proj is not None:
            kwargs["tau_proj"] = self.spec.tau_proj
        if self.spec.tau_skip is not None:
            kwargs["tau_skip"] = self.spec.tau_skip
        out = core_gac.gac_project(grad=grad, prev_grad=self.prev, **kwargs)
        _write_back(params, out.grad)
        self.prev = (grad if self.spec.prev == "raw" else out.grad).detach().clone()
        skipped = out.skipped.to(torch.float32)
        return {
            "gac/cos": out.cos.detach(),
            "gac/projected": out.projected.to(torch.float32),
            "gac/skipped": skipped,
            SKIP_STEP: skipped,
        }

    def after_step(self, *, optimizer: torch.optim.Optimizer) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"prev": self.prev}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.prev = state.get("prev")
