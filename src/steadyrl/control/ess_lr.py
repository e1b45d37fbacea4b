"""VCPO's ESS-scaled step size (arXiv 2602.17616, Sec. 4.1) [exact, authors' code].

lr_t = lr_sched · f(min(1, ρ_ess / ρ_base)), ρ_ess = ESS / B over the whole optimizer minibatch, set on the optimizer's
param groups for this step only and restored after it. The ESS ratio comes from ``compute_loss`` as the metric
``vcpo/ess_ratio`` (computed with this controller's weight options); gradient clipping still applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from steadyrl.base.device import host_values
from steadyrl.core.ess import vcpo_lr_scale
from steadyrl.methods.spec import EssStepSize

#: Metric holding the ESS ratio this controller scales by (written by ``steadyrl.methods.compose``).
ESS_METRIC = "vcpo/ess_ratio"


class EssStepSizeController:
    """Scale every param group's lr by f(min(1, ρ_ess/ρ_base)) for one step, then restore it."""

    reads: tuple[str, ...] = (ESS_METRIC,)
    keeps_raw_prev = False
    prev_grad = None

    def __init__(self, spec: EssStepSize) -> None:
        self.spec = spec
        self._saved: list[Any] | None = None

    def before_step(
        self, *, optimizer: torch.optim.Optimizer, params: Sequence[Tensor], metrics: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        if ESS_METRIC not in metrics:
            raise KeyError(f"the ESS step size needs the metric {ESS_METRIC!r} from compute_loss")
        scale = vcpo_lr_scale(ess_ratio=metrics[ESS_METRIC].detach(), rho_base=self.spec.rho_base, fn=self.spec.fn)
        self._saved = [group["lr"] for group in optimizer.param_groups]
        # One host read per optimizer step: optimizers take a Python float lr (a tensor lr needs capturable=True).
        (factor,) = host_values([scale])
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        return {"vcpo/ess_scale": scale.detach()}

    def after_step(self, *, optimizer: torch.optim.Optimizer) -> None:
        if self._saved is not None:
            for group, lr in zip(optimizer.param_groups, self._saved, strict=True):
                group["lr"] = lr
            self._saved = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None
