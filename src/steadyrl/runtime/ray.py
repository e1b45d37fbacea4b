"""``runtime.mode=ray``: the concurrent runtime's roles as Ray actors, on one machine or a cluster.

The roles, admission control, faults and lag accounting are those of every concurrent runtime
(:mod:`steadyrl.runtime.concurrent`, the same code as ``runtime.mode=local``); this module is the Ray transport:

==================  ====================================================================================================
learner             the ``steadyrl train`` process (the Ray driver); its :class:`RaySource` holds the pool.
samplers            ``runtime.concurrent.samplers`` :class:`SamplerActor` actors (``num_cpus=1`` each,
                    ``rollout.threads`` torch threads) running :func:`~steadyrl.runtime.worker.run_sampler`
                    through :class:`RayChannel`.
coordinator         one small asyncio :class:`Coordinator` actor (``num_cpus=0``, on the learner's node): the newest
                    weights reference and version, the claim counter, admission control and back-pressure
                    (:func:`~steadyrl.runtime.concurrent.admitted`, the local runtime's rule), each sampler's claim
                    (for redo), idle/busy times, and the queue of completed groups.
weights             each publish is ONE ``ray.put`` of the flat parameter array (its bytes, any dtype) into the object
                    store; the coordinator keeps only the newest reference, so older versions are freed and a sampler
                    always loads the newest (zero-copy from shared memory on its node, one transfer per node).
completed groups    one ``deliver`` call per sampler call (all its groups or none), queued by
                    the coordinator until the learner drains them into its pool.
==================  ====================================================================================================

Ray starts locally when ``runtime.concurrent.ray_address`` is None (``num_cpus = samplers + 1``, no dashboard, worker
logs not forwarded); with an address the run connects to that cluster. Faults: a sampler actor that dies (``ray.kill``,
a crash, a lost node) is replaced by a new actor with the same index and the ids it never delivered. ``close`` kills
every actor it created and calls ``ray.shutdown()`` only when this run called ``ray.init`` itself. Rollback detection
compares the samplers' ``time.time()`` with the learner's, so a cluster's clocks should be synchronized (NTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from steadyrl.pool.records import GroupRecord
from steadyrl.runtime.concurrent import Admission, ConcurrentSource, Counters, admitted
from steadyrl.runtime.weight_sync import FlatLayout
from steadyrl.runtime.worker import SamplerSpec, run_sampler

#: The one line a run without Ray fails with.
MISSING_RAY = "runtime.mode=ray needs Ray: pip install 'steadyrl[ray]' (the tested pins: requirements/ray.txt)"

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as _err:  # one line saying what to install
    raise ImportError(MISSING_RAY) from _err

if TYPE_CHECKING:
    from steadyrl.config.train import TrainConfig

#: Seconds a sampler's claim call blocks in the coordinator at most before it returns empty-handed and is repeated.
CLAIM_WAIT_S = 1.0
#: Seconds the learner's wait for deliveries blocks at most (it then checks its samplers and the stall timeout).
WAIT_S = 0.05


class Coordinator:
    """The run's shared state as an asyncio actor (see the module table). Methods never block the event loop for
    long: ``claim`` and ``wait_groups`` wait on a state change, with a timeout."""

    def __init__(self, samplers: int, admission: Admission) -> None:
        self.admission = admission
        self.step = -1
        self.version = -1
        self.weights: list[Any] = []
        """``[ObjectRef]`` of the newest flat weights (a list, so the reference is passed on, not resolved)."""
        self.next_group = self.retired = self.consumed = 0
        self.claims = [(0, 0)] * samplers
        self.idle = [0.0] * samplers
        self.busy = [0.0] * samplers
        self.groups: list[dict[str, Any]] = []
        self.stopped = False
        self._changed: asyncio.Event | None = None

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait_change(self, timeout: float) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def _counters(self) -> Counters:
        return Counters(step=self.step, next_group=self.next_group, retired=self.retired, consumed=self.consumed)

    # -- the learner's calls ---------------------------------------------------------------------------------------
    async def publish(self, version: int, step: int, weights: list[Any]) -> None:
        """Newest weights (``[ref]``) and version, then open ``step`` to admission (one atomic update)."""
        self.weights, self.version, self.step = weights, version, step
        self._notify()

    async def count(self, retired: int, consumed: int) -> None:
        self.retired += retired
        self.consumed += consumed
        self._notify()

    async def restore(self, next_group: int, retired: int, consumed: int) -> None:
        self.next_group, self.retired, self.consumed = next_group, retired, consumed

    async def counters(self) -> Counters:
        return self._counters()

    async def get_claims(self) -> list[tuple[int, int]]:
        return list(self.claims)

    async def set_claim(self, sampler: int, lo: int, hi: int) -> None:
        self.claims[sampler] = (lo, hi)

    async def times(self) -> tuple[float, float]:
        return sum(self.idle), sum(self.busy)

    async def drain(self) -> list[dict[str, Any]]:
        """The delivered groups (``GroupRecord.to_state()``) since the last drain."""
        out, self.groups = self.groups, []
        return out

    async def wait_groups(self, need: int, timeout: float) -> None:
        """Return once ``need`` groups are queued (or the run stops), at the latest after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while len(self.groups) < need and not self.stopped:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await self._wait_change(left)

    async def stop(self) -> None:
        self.stopped = True
        self._notify()

    # -- the samplers' calls ---------------------------------------------------------------------------------------
    async def claim(self, sampler: int, want: int, timeout: float) -> list[int] | None:
        """Up to ``want`` new ids as soon as admission allows, [] after ``timeout`` s without, None once stopped."""
        deadline = time.monotonic() + timeout
        while not self.stopped:
            n = admitted(want, self._counters(), self.admission)
            if n > 0:
                lo = self.next_group
                self.next_group = lo + n
                self.claims[sampler] = (lo, lo + n)
                self._notify()
                return list(range(lo, lo + n))
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            await self._wait_change(left)
        return None

    async def latest(self) -> tuple[int, list[Any]]:
        return self.version, self.weights

    async def get_version(self) -> int:
        return self.version

    async def deliver(self, states: list[dict[str, Any]]) -> None:
        self.groups.extend(states)
        self._notify()

    async def add_time(self, sampler: int, idle: float, busy: float) -> None:
        self.idle[sampler] += idle
        self.busy[sampler] += busy


class RayChannel:
    """:class:`~steadyrl.runtime.worker.SamplerChannel` over the :class:`Coordinator` actor (runs in a sampler)."""

    def __init__(self, coordinator: Any) -> None:
        self.coord = coordinator
        self._buf: Tensor | None = None
        self._version = -1
        self._asked: Any = None
        self._delivering: list[Any] = []

    def claim(self, sampler: int, max_groups: int) -> list[int] | None:
        ray.get(self._delivering)  # every group delivered so far is queued before the old claim is replaced
        self._delivering = []
        t0 = time.perf_counter()
        try:
            while True:
                ids = ray.get(self.coord.claim.remote(sampler, max_groups, CLAIM_WAIT_S))
                if ids is None or ids:
                    return ids
        finally:
            self.coord.add_time.remote(sampler, time.perf_counter() - t0, 0.0)

    def weights_version(self) -> int:
        """The newest version the coordinator reported, without waiting: one ``get_version`` call is kept in flight
        and its answer taken when ready (a decode step never waits on a round trip; a new version is seen one round
        trip late, and the tokens still record the version that really produced them)."""
        if self._asked is not None and ray.wait([self._asked], timeout=0)[0]:
            self._version = max(self._version, int(ray.get(self._asked)))
            self._asked = None
        if self._asked is None:
            self._asked = self.coord.get_version.remote()
        return self._version

    def load_weights(self, model: nn.Module, layout: FlatLayout) -> int:
        version, refs = ray.get(self.coord.latest.remote())
        data = ray.get(refs[0])  # read-only uint8 view of the object store's copy
        if self._buf is None:
            self._buf = torch.empty(data.nbytes, dtype=torch.uint8)
        np.copyto(self._buf.numpy(), data)
        del data
        layout.load_into(model, self._buf.view(layout.dtype))
        self._version = max(self._version, int(version))
        return int(version)

    def deliver(self, sampler: int, records: list[GroupRecord]) -> None:
        """One call per sampler call (all of its groups or none), waited for at the next :meth:`claim` (an asyncio
        actor may run one caller's calls out of order), so the groups are queued before the claim that covered them
        is replaced; a sampler that dies first leaves them in that claim, redone by its replacement."""
        self._delivering.append(self.coord.deliver.remote([r.to_state() for r in records]))

    def add_busy(self, sampler: int, seconds: float) -> None:
        self.coord.add_time.remote(sampler, 0.0, seconds)


class SamplerActor:
    """One sampler (created with ``num_cpus=1``; :attr:`RaySource.sampler_options` adds placement options)."""

    def __init__(self) -> None:
        with contextlib.suppress(ValueError):  # Ctrl-C belongs to the learner, which stops us in order
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def run(self, spec: SamplerSpec, coordinator: Any) -> None:
        """The sampler loop; returns when the coordinator stops."""
        run_sampler(spec, RayChannel(coordinator))


def connect(cfg: TrainConfig) -> bool:
    """Start a local Ray (``runtime.concurrent.ray_address`` None) or connect to a cluster, unless this process
    already is connected; True when this call did ``ray.init`` (then :meth:`RaySource.close` calls ``ray.shutdown``)."""
    if ray.is_initialized():
        return False
    quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # Ray's accelerator env-var notice
        if cfg.runtime.concurrent.ray_address is None:
            ray.init(num_cpus=cfg.runtime.concurrent.samplers + 1, include_dashboard=False, **quiet)
        else:
            ray.init(address=cfg.runtime.concurrent.ray_address, **quiet)
    return True


class RaySource(ConcurrentSource):
    """The rollout source of ``runtime.mode=ray`` (the learner's side; see the module docstring)."""

    label = "ray"
    #: Extra ``.options(...)`` of every sampler actor, e.g. ``{"resources": {"sampler": 1}}`` to place samplers only on
    #: nodes started with ``ray start --resources='{"sampler": N}'`` (``num_cpus=1`` is always set).
    sampler_options: ClassVar[dict[str, Any]] = {}

    def _open_transport(self) -> None:
        self.actors: list[Any] = [None] * self.n
        """The sampler actor handles (None before the first start)."""
        self.runs: list[Any] = [None] * self.n
        """Each actor's ``run`` call (ready once it returned or the actor died)."""
        self.coordinator: Any = None
        self._final: tuple[Counters, list[tuple[int, int]]] | None = None
        """Counters and claims when the run closed (the coordinator is gone then)."""
        self.owns_ray = connect(self.cfg)
        here = ray.get_runtime_context().get_node_id()
        self.coordinator = (
            ray.remote(Coordinator)
            .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=True))
            .remote(self.n, self.admission)
        )
        self._sampler_cls = ray.remote(SamplerActor)
        self._flat = self.layout.empty()

    # -- the transport ---------------------------------------------------------------------------------------------
    def _publish_weights(self, model: nn.Module, *, version: int, step: int) -> None:
        self.layout.flatten_into(model, self._flat)
        ref = ray.put(self._flat.view(torch.uint8).numpy())
        ray.get(self.coordinator.publish.remote(version, step, [ref]))

    def _launch(self, i: int, spec: SamplerSpec) -> None:
        if self.actors[i] is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.actors[i], no_restart=True)
        options = {**self.sampler_options, "num_cpus": 1, "max_restarts": 0}
        actor = self._sampler_cls.options(**options).remote()
        self.actors[i] = actor
        self.runs[i] = actor.run.remote(spec, self.coordinator)

    def _exit_status(self, i: int) -> str | None:
        ready, _ = ray.wait([self.runs[i]], timeout=0)
        if not ready:
            return None
        try:
            ray.get(self.runs[i])
        except ray.exceptions.RayTaskError as err:  # the sampler raised: show where
            self.say(str(err))
            return f"raised {type(err.cause).__name__}: {err.cause}"
        except ray.exceptions.RayActorError as err:
            return f"actor died ({type(err).__name__})"
        return "returned"

    def _claims(self) -> list[tuple[int, int]]:
        if self._final is not None:
            return self._final[1]
        return ray.get(self.coordinator.get_claims.remote())

    def _set_claim(self, i: int, lo: int, hi: int) -> None:
        ray.get(self.coordinator.set_claim.remote(i, lo, hi))

    def _fetch(self) -> list[GroupRecord]:
        return [GroupRecord.from_state(s) for s in ray.get(self.coordinator.drain.remote())]

    def _wait(self) -> None:
        # a batch needs P groups in the pool: waking up for fewer would only cost round trips
        ray.get(self.coordinator.wait_groups.remote(max(1, self.P - len(self.pool)), WAIT_S))

    def _counters(self) -> Counters:
        if self._final is not None:
            return self._final[0]
        return ray.get(self.coordinator.counters.remote())

    def _count(self, *, retired: int = 0, consumed: int = 0) -> None:
        ray.get(self.coordinator.count.remote(retired, consumed))

    def _restore_counters(self, *, next_group: int, retired: int, consumed: int) -> None:
        ray.get(self.coordinator.restore.remote(next_group, retired, consumed))

    def _times(self) -> tuple[float, float]:
        return ray.get(self.coordinator.times.remote())

    def _shutdown(self) -> None:
        """Stop the samplers, keep the final counters and claims (for inspection after the run), kill every actor of
        this run, and ``ray.shutdown()`` if this run started Ray."""
        if self.coordinator is not None:
            with contextlib.suppress(Exception):
                ray.get(self.coordinator.stop.remote(), timeout=5.0)
                self._final = (self._counters(), self._claims())
        for actor in [*self.actors, self.coordinator]:
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        if self.owns_ray:
            ray.shutdown()
