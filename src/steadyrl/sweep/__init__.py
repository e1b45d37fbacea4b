"""Sweeps: a grid of ``steadyrl train`` runs (methods × lags × seeds × any config key), their results, a report.

* :mod:`steadyrl.sweep.config` — the sweep file (strict pydantic), grid expansion into named runs, config hashes.
* :mod:`steadyrl.sweep.runner` — runs as parallel, resumable subprocesses with a progress bar; Ctrl-C stops them.
* :mod:`steadyrl.sweep.warm_start_jobs` — the default model's warm starts the runs need, each built once, first.
* :mod:`steadyrl.sweep.results` — one row per run (``results.csv``) and mean ± 95% CI over seeds (``summary.*``).
* :mod:`steadyrl.sweep.stats` — Student-t confidence intervals.
* :mod:`steadyrl.sweep.report` — one self-contained HTML page with embedded PNG plots, for a sweep or a single run.
* :mod:`steadyrl.sweep.entry` — the ``steadyrl sweep`` and ``steadyrl report`` commands.
"""

from steadyrl.base import needs_train as _needs_train  # noqa: F401  (one line naming the extra when it is missing)
