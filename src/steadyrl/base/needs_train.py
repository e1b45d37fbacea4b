"""Imported first by the packages behind ``steadyrl train`` (``steadyrl.train``, ``models``, ``rollout``, ``tasks``,
``pool``, ``runtime``, ``sweep``): without the ``train`` extra their import stops here with one line saying what to
install, instead of a traceback ending in ``No module named 'transformers'``. (transformers brings safetensors, pyyaml
and tqdm with it; the extra's other modules are imported where they are used, and ``steadyrl train`` checks them all.)
"""

from steadyrl.base.extras import require_extra

require_extra("train", "steadyrl's training stack (steadyrl.train, models, rollout, tasks, runtime, sweep)",
              ("transformers",))  # fmt: skip
