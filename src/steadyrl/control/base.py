"""The controller protocol and the factory that builds a method's controllers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from steadyrl.methods.spec import GAC, EssStepSize, MethodSpec

#: Metric a controller returns (value 1) to ask the learner not to apply this step.
SKIP_STEP = "control/skip_step"


def flat_grad(params: Sequence[Tensor]) -> Tensor:
    """All gradients as one float32 vector (zeros for a parameter without a gradient)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])


@runtime_checkable
class Controller(Protocol):
    """A step-level hook around ``optimizer.step()``."""

    def before_step(
        self, *, optimizer: torch.optim.Optimizer, params: Sequence[Tensor], metrics: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Called after ``backward`` and before clipping and ``optimizer.step``; returns detached metrics."""
        ...

    def after_step(self, *, optimizer: torch.optim.Optimizer) -> None:
        """Called after ``optimizer.step`` (or after the step was skipped)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (e.g. the previous gradient)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...


def build_controllers(method: MethodSpec) -> list[Controller]:
    """The controllers of ``method``, in the order its spec lists them."""
    from steadyrl.control.ess_lr import EssStepSizeController
    from steadyrl.control.gac import GradientAlignmentController

    out: list[Controller] = []
    for spec in method.controllers:
        if isinstance(spec, EssStepSize):
            out.append(EssStepSizeController(spec))
        elif isinstance(spec, GAC):
            out.append(GradientAlignmentController(spec))
        else:  # pragma: no cover - the discriminated union admits nothing else
            raise TypeError(f"no controller for {spec!r}")
    return out
