"""The learner and the training job of ``steadyrl train``: config, learner step, driver, metrics, checkpoints, plot.

``steadyrl.config.train.TrainConfig`` describes a run; ``steadyrl.train.entry.run(cfg)`` trains it with the runtime
it names; ``steadyrl.train.learner.Learner`` is the learner step alone, for use under another driver.
Submodules are imported on use, so ``import steadyrl.train`` stays light.
"""

from steadyrl.base import needs_train as _needs_train  # noqa: F401  (one line naming the extra when it is missing)
