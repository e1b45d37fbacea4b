"""steadyrl: reinforcement learning of language models on stale rollouts.

``steadyrl.compute_loss(method, batch)`` runs any method's loss; ``steadyrl.resolve_method`` builds one;
``steadyrl.core`` holds the pure tensor functions; ``steadyrl.control`` the step-level controllers.
"""

from steadyrl.methods import LossBatch, MethodSpec, compute_loss, resolve_method

__version__ = "0.1.0"

__all__ = ["LossBatch", "MethodSpec", "__version__", "compute_loss", "resolve_method"]
