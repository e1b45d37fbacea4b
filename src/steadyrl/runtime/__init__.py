"""Runtimes: where a learner's batches come from. ``lag`` emulates a sampler running k steps ahead, exactly.

Imports of a runtime's heavy dependencies happen in its own module, so ``import steadyrl.runtime`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from steadyrl.base import needs_train as _needs_train  # noqa: F401  (one line naming the extra when it is missing)

if TYPE_CHECKING:
    from steadyrl.runtime.lag import LagSampler, LagSchedule, LagSource, Snapshot, SnapshotRing

__all__ = ["LagSampler", "LagSchedule", "LagSource", "Snapshot", "SnapshotRing"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from steadyrl.runtime import lag

        return getattr(lag, name)
    raise AttributeError(f"module 'steadyrl.runtime' has no attribute {name!r}")
