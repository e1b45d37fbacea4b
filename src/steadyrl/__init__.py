"""steadyrl: reinforcement learning of language models on stale rollouts.

``steadyrl.compute_loss(method, batch)`` runs any method's loss; ``steadyrl.resolve_method`` builds one;
``steadyrl.control.build_controllers(method)`` the step-level controllers around an optimizer step;
``steadyrl.per_trajectory_grad_sq_norms(model, logp_fn, mask)`` the per-trajectory gradient norms VCPO's baseline
needs; ``steadyrl.core`` holds the pure tensor functions. This core needs torch, numpy, pydantic and jaxtyping only;
``steadyrl train`` and the modules behind it need ``pip install 'steadyrl[train]'``.
"""

from steadyrl import control
from steadyrl.core.grad_norms import per_trajectory_grad_sq_norms
from steadyrl.methods import LossBatch, MethodSpec, compute_loss, resolve_method

__version__ = "0.1.0"

__all__ = [
    "LossBatch",
    "MethodSpec",
    "__version__",
    "compute_loss",
    "control",
    "per_trajectory_grad_sq_norms",
    "resolve_method",
]
