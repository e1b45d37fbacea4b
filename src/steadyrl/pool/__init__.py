"""The rollout pool of the concurrent runtimes: completed groups waiting for the learner, their staleness accounting,
and the policies that decide which of them the learner trains on (``pool.policy``: fifo, max_staleness, drop, pace).

Nothing here touches a model or a process: the runtimes (:mod:`steadyrl.runtime.local`, :mod:`steadyrl.runtime.ray`)
move records in and batches out.
"""

from steadyrl.base import needs_train as _needs_train  # noqa: F401  (one line naming the extra when it is missing)
from steadyrl.pool.config import PoolConfig
from steadyrl.pool.policies import Selection, pace_scores, select
from steadyrl.pool.pool import RolloutPool
from steadyrl.pool.records import GroupRecord

__all__ = ["GroupRecord", "PoolConfig", "RolloutPool", "Selection", "pace_scores", "select"]
