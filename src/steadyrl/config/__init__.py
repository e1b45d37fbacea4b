"""The configuration of ``steadyrl train``: typed sections (:mod:`steadyrl.config.train`), the collapse guard's and
the critic's settings, and loading from YAML plus ``key=value`` overrides (:mod:`steadyrl.config.io`).

It sits below the runtimes and the trainer, which both read it, and above what it configures (tasks, models, pool,
methods), whose own option types it gathers.
"""
