"""The controller protocol, and the gradient as parts that controllers and the learner read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

#: Metric a controller returns (value 1) to ask the learner not to apply this step.
SKIP_STEP = "control/skip_step"


def grad_parts(params: Sequence[Tensor]) -> list[Tensor]:
    """The gradient as its parts, one per parameter (``.grad`` itself, not a copy; zeros where a parameter has none).

    GAC and the learner's ``grad/cos_prev`` read the gradient this way: no flat copy of the whole model is built.
    """
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def parts_like(prev: Tensor | Sequence[Tensor] | None, params: Sequence[Tensor]) -> list[Tensor] | None:
    """A kept previous gradient as one tensor per parameter of ``params``: a flat vector (a checkpoint written
    before gradients were kept per parameter) is split and reshaped; per-parameter tensors are returned as they are."""
    if prev is None:
        return None
    parts = [prev] if isinstance(prev, Tensor) else list(prev)
    shapes = [p.shape for p in params]
    if [t.shape for t in parts] == shapes:
        return parts
    flat = torch.cat([t.reshape(-1) for t in parts])
    if flat.numel() != sum(p.numel() for p in params):
        raise ValueError(
            f"the kept previous gradient has {flat.numel()} elements, the model {sum(p.numel() for p in params)}: "
            "the checkpoint belongs to another model"
        )
    return [t.view(shape) for t, shape in zip(flat.split([p.numel() for p in params]), shapes, strict=True)]


def loss_inputs(controllers: Sequence[Any], device: torch.device | str) -> dict[str, Tensor]:
    """The batch inputs the ``controllers`` hand the coming step's loss (their optional ``loss_inputs``), on
    ``device``: the adaptive entropy coefficient (``entropy_coef``). Empty when none has any."""
    out: dict[str, Tensor] = {}
    for controller in controllers:
        give = getattr(controller, "loss_inputs", None)
        if give is not None:
            out |= give(device=device)
    return out


@runtime_checkable
class Controller(Protocol):
    """A step-level hook around ``optimizer.step()``.

    Optional members (a controller of one's own may leave them out): ``reads``, the ``compute_loss`` metrics its
    ``before_step`` needs (an adapter keeps only those per micro-batch; default none); ``keeps_raw_prev``, whether it
    keeps the previous raw gradient anyway (as ``prev_grad``, per parameter; default False): the learner then reads
    ``grad/cos_prev`` from that copy instead of keeping a second one; and ``loss_inputs(*, device) -> dict[str,
    Tensor]``, batch inputs for the loss of the coming step (the adaptive entropy controller's ``entropy_coef``), as
    tensors on ``device`` (:func:`loss_inputs` collects them; the learner and the adapters' step control call it
    before each loss, and the controller updates them in ``before_step``, on the device, without a host read).
    """

    reads: tuple[str, ...]
    keeps_raw_prev: bool

    @property
    def prev_grad(self) -> list[Tensor] | None:
        """The previous step's raw gradient, one tensor per parameter, if this controller keeps it (else None)."""
        ...

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
