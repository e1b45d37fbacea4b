"""Pure tensor math for RL on stale rollouts: tensors and scalars in, tensors out.

No I/O, no global configuration, no ``.item()``. Every public function is keyword-only, documents its shapes and
paper, and returns named results with detached metrics. See ``docs/algorithms.md`` for the maths.
"""
