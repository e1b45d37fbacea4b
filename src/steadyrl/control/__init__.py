"""Step-level controllers: they act on the optimizer and the gradient, not on the loss.

The learner calls, for every optimizer step::

    batch |= c.loss_inputs(device=...) for controllers that have it   # the adaptive entropy coefficient
    loss, metrics = compute_loss(method, batch); loss.backward()
    out = {}
    for c in controllers: out |= c.before_step(optimizer=opt, params=params, metrics=loss_metrics)
    if out.get("control/skip_step", 0) == 0: clip_grad_norm_(...); opt.step()
    for c in controllers: c.after_step(optimizer=opt)

``build_controllers(method)`` returns them in the method's order. They hold no I/O and no host syncs.
"""

from steadyrl.control.adaptive_entropy import AdaptiveEntropyController
from steadyrl.control.base import Controller, loss_inputs
from steadyrl.control.build import build_controllers
from steadyrl.control.ess_lr import EssStepSizeController
from steadyrl.control.gac import GradientAlignmentController

__all__ = [
    "AdaptiveEntropyController",
    "Controller",
    "EssStepSizeController",
    "GradientAlignmentController",
    "build_controllers",
    "loss_inputs",
]
