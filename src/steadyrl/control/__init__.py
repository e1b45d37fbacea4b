"""Step-level controllers: they act on the optimizer and the gradient, not on the loss.

The learner calls, for every optimizer step::

    loss.backward()
    out = {}
    for c in controllers: out |= c.before_step(optimizer=opt, params=params, metrics=loss_metrics)
    if out.get("control/skip_step", 0) == 0: clip_grad_norm_(...); opt.step()
    for c in controllers: c.after_step(optimizer=opt)

``build_controllers(method)`` returns them in the method's order. They hold no I/O and no host syncs.
"""

from steadyrl.control.base import Controller
from steadyrl.control.build import build_controllers
from steadyrl.control.ess_lr import EssStepSizeController
from steadyrl.control.gac import GradientAlignmentController

__all__ = ["Controller", "EssStepSizeController", "GradientAlignmentController", "build_controllers"]
