"""Pure tensor math for RL on stale rollouts: tensors and scalars in, tensors out.

No I/O, no global configuration, no ``.item()``. Every public function is keyword-only, documents its shapes and
paper, and returns named results with detached metrics; the one that differentiates a model,
:func:`steadyrl.core.grad_norms.per_trajectory_grad_sq_norms` (``steadyrl.per_trajectory_grad_sq_norms``), takes the
model, a log-prob function and the mask as its first three arguments. See ``docs/algorithms.md`` for the maths.
"""
