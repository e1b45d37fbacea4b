"""``steadyrl check``: setup checks for stale-data RL comparisons (arXiv 2610.02911, "Probe the Harness").

:mod:`~steadyrl.check.rules` judges a run's metrics table, :mod:`~steadyrl.check.logs` reads steadyrl's, verl's,
TRL's and OpenRLHF's logs into one, :mod:`~steadyrl.check.sweep` checks that a sweep's arms are fair, and
:mod:`~steadyrl.check.losses` holds a framework's loss functions against steadyrl's float64 references.
"""

from steadyrl.check.rules import Finding, RunFacts, check_table, worst

__all__ = ["Finding", "RunFacts", "check_table", "worst"]
