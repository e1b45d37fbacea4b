"""The learner's side of the concurrent runtimes (``local``, ``ray``), written once over a small transport interface.

Roles (DESIGN.md vocabulary):

* **Learner** (the ``steadyrl train`` process): publishes its weights after every step, takes each batch from the
  :class:`~steadyrl.pool.RolloutPool` under ``pool.policy``, trains, repeats.
* **Samplers** (``runtime.concurrent.samplers`` of them, ``rollout.threads`` torch threads each): the loop of
  :mod:`steadyrl.runtime.worker`, each through its transport's :class:`~steadyrl.runtime.worker.SamplerChannel`.

What every transport provides (:class:`ConcurrentSource`'s abstract methods) and what is the same for all:

==================  ====================================================================================================
weights             the learner's parameters as one flat array (:class:`~steadyrl.runtime.weight_sync.FlatLayout`) with
                    a version; a sampler always loads the newest version, versions it never saw are skipped.
claims              a group-id counter; each sampler's current claim ``[lo, hi)`` is recorded so a replacement can
                    redo what a dead sampler never delivered.
admission           a sampler may start group ids only while (groups started − groups discarded) stays within
                    ``(step + ahead + 1) · P`` (AReaL's rule; ``ahead`` = ⌊s / optimizer steps per learner step⌋ for
                    ``pool.policy=max_staleness``, 0 for ``runtime.concurrent.sync``, unbounded otherwise) and while
                    groups in flight + in the pool stay below ``pool.capacity`` (back-pressure): :func:`admitted`.
completed groups    handed over whole (a sampler killed mid-delivery leaves no partial group); the learner moves them
                    into its pool in completion order.
==================  ====================================================================================================

Faults: a sampler that exits is restarted with its index and the ids it claimed but did not deliver (``redo``); the
pool refuses an id twice (:class:`~steadyrl.pool.pool.DuplicateRolloutError`), so a rollout is neither lost nor
trained on twice. A checkpoint holds the pool, the counters and the claimed-but-undelivered ids; a resumed run redoes
those first. The collapse guard's rollback discards the pool and every group whose generation started before it.

Lag accounting: a token's version is the learner version of the weights that produced it; the learner trains at
version v_now, so a trajectory's lag is v_now − its oldest token's version (``lag/max``), its generation staleness and
waiting staleness are PACE's GS and WS (``lag/gen_mean``, ``lag/wait_mean``; :mod:`steadyrl.pool.policies`).
Timing: ``time/learner_idle_frac`` = the learner's wait for this batch ÷ the wall-clock since it got the previous one;
``time/sampler_idle_frac`` = the samplers' admission waits ÷ (waits + generation) over the same interval.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from steadyrl.pool.policies import prefix_forgetting
from steadyrl.pool.pool import RolloutPool
from steadyrl.pool.records import GroupRecord
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.rollouts import concat
from steadyrl.rollout.scored import ScoredRollouts
from steadyrl.runtime.reward_delay import RewardDelay
from steadyrl.runtime.weight_sync import FlatLayout
from steadyrl.runtime.worker import SamplerSpec
from steadyrl.tasks import Problem, Task

if TYPE_CHECKING:
    from steadyrl.config.train import TrainConfig

#: A sampler restarted this many times without delivering a group in between ends the run with an error.
MAX_RESTARTS_WITHOUT_PROGRESS = 3
#: Seconds between polls of the local runtime's spool directory / shared counters.
POLL_S = 0.002
UNBOUNDED = 1 << 62


class SamplerDiedError(RuntimeError):
    """A sampler kept dying before it could deliver anything."""


class Admission(NamedTuple):
    """The constants of admission control and back-pressure (see the module table)."""

    batch_groups: int
    """P: groups per learner step."""
    ahead: int
    """Learner steps a sampler may run ahead (:func:`admission_ahead`)."""
    capacity: int
    """``pool.capacity``: groups in flight + pooled."""


class Counters(NamedTuple):
    """The shared counters of a run (the transport holds them)."""

    step: int
    """The learner step whose batch is next (set after that step's weights are published); −1 before any."""
    next_group: int
    """Group ids claimed so far (the next claim starts here)."""
    retired: int
    """Groups discarded by the pool policy or a rollback (their admission slots are free again)."""
    consumed: int
    """Groups trained on."""


def admission_ahead(cfg: TrainConfig) -> int:
    """Learner steps a sampler may run ahead of the learner (see the module table); UNBOUNDED when not bounded."""
    if cfg.runtime.concurrent.sync:
        return 0
    if cfg.pool.policy == "max_staleness":
        versions_per_step = cfg.optim.updates_per_batch * cfg.optim.minibatches
        return cfg.pool.max_staleness // versions_per_step
    return UNBOUNDED


def admission_of(cfg: TrainConfig) -> Admission:
    """The admission constants ``cfg`` implies."""
    P = cfg.prompts_per_step
    return Admission(batch_groups=P, ahead=admission_ahead(cfg), capacity=cfg.pool.resolved_capacity(P))


def admitted(want: int, c: Counters, a: Admission) -> int:
    """How many new group ids admission control and back-pressure allow now (0 before the first publish)."""
    if c.step < 0:
        return 0
    n = min(want, a.capacity - (c.next_group - c.consumed - c.retired))
    if a.ahead < UNBOUNDED:
        n = min(n, (c.step + a.ahead + 1) * a.batch_groups - (c.next_group - c.retired))
    return max(0, n)


class ConcurrentSource(ABC):
    """The rollout source of a concurrent runtime (the learner's side; see the module docstring).

    A transport subclass implements the abstract methods: how weights are published, samplers started and watched,
    completed groups fetched, and where the counters, claims and timings live.
    """

    #: Prefix of the messages this runtime prints.
    label = "concurrent"

    def __init__(
        self, cfg: TrainConfig, *, model: nn.Module, tokenizer: Any, task: Task, train_pool: list[Problem],
        record_entropy: bool = False, say: Any = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.record_entropy = record_entropy
        self.say = say or (lambda msg: print(msg, file=sys.stderr))
        self.P = cfg.prompts_per_step
        self.n = cfg.runtime.concurrent.samplers
        self.layout = FlatLayout(model)
        self.admission = admission_of(cfg)
        pace_drift = cfg.pool.policy == "pace" and cfg.pool.pace.score == "drift"
        self.pool = RolloutPool(cfg.pool, batch_groups=self.P, drift=self._prefix_drift if pace_drift else None)
        self.started = [False] * self.n
        self.incarnations = [0] * self.n
        self.no_progress = [0] * self.n
        self.restarts = 0
        self.version = 0
        delay = cfg.task.reward_delay
        self.delay = (RewardDelay(delay, proxy=cfg.task.proxy_reward, flip=cfg.task.proxy_flip, seed=cfg.seed)
                      if delay > 0 else None)  # fmt: skip
        """``task.reward_delay`` Δ > 0: each batch trains on its proxy reward; its true reward, which the samplers
        scored, is handed over with the batch of Δ learner steps later (:mod:`steadyrl.runtime.reward_delay`)."""
        self._redo: dict[int, list[int]] = {}
        self._not_before = 0.0
        self._last_return: float | None = None
        self._last_idle = self._last_busy = 0.0
        self._closed = False
        self.last_batch_ids: list[int] = []
        """Group ids of the batch :meth:`next_batch` returned last."""
        self._open_transport()

    @classmethod
    def from_config(cls, cfg: TrainConfig, **kw: Any) -> ConcurrentSource:
        """The source ``cfg`` describes (keywords: see :class:`steadyrl.train.loop.SourceFactory`)."""
        return cls(cfg, **kw)

    # -- the transport ---------------------------------------------------------------------------------------------
    @abstractmethod
    def _open_transport(self) -> None:
        """Create the transport's state (shared memory, actors, ...), last thing in ``__init__``; no sampler yet."""

    @abstractmethod
    def _publish_weights(self, model: nn.Module, *, version: int, step: int) -> None:
        """Make ``model``'s flat weights the newest (``version``), then open ``step`` to admission."""

    @abstractmethod
    def _launch(self, i: int, spec: SamplerSpec) -> None:
        """Start sampler ``i`` (a first start or a replacement) running :func:`~steadyrl.runtime.worker.run_sampler`."""

    @abstractmethod
    def _exit_status(self, i: int) -> str | None:
        """None while started sampler ``i`` runs; once it ended, how (for the restart message)."""

    @abstractmethod
    def _claims(self) -> list[tuple[int, int]]:
        """Each sampler's current claim ``[lo, hi)``."""

    @abstractmethod
    def _set_claim(self, i: int, lo: int, hi: int) -> None:
        """Record ``[lo, hi)`` as sampler ``i``'s claim."""

    @abstractmethod
    def _fetch(self) -> list[GroupRecord]:
        """Take the completed groups delivered since the last call."""

    @abstractmethod
    def _wait(self) -> None:
        """Wait a little for a delivery (a poll interval, or until one arrives)."""

    @abstractmethod
    def _counters(self) -> Counters:
        """The counters now."""

    @abstractmethod
    def _count(self, *, retired: int = 0, consumed: int = 0) -> None:
        """Add to the retired / consumed counters (atomically with respect to the samplers' claims)."""

    @abstractmethod
    def _restore_counters(self, *, next_group: int, retired: int, consumed: int) -> None:
        """Set the counters of a resumed run (before any sampler starts)."""

    @abstractmethod
    def _times(self) -> tuple[float, float]:
        """Seconds all samplers spent so far (idle waiting for admission, busy generating + scoring)."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Stop every sampler and release the transport (called once)."""

    # -- weights -------------------------------------------------------------------------------------------------
    def publish(self, *, step: int, version: int, model: nn.Module) -> None:
        """Publish ``model``'s weights as ``version``, then open ``step`` to the samplers (starting them if needed)."""
        self._publish_weights(model, version=version, step=step)
        self.version = version
        self._start_samplers()

    # -- samplers ------------------------------------------------------------------------------------------------
    def _spawn(self, i: int, redo: list[int]) -> None:
        spec = SamplerSpec(
            cfg=self.cfg,
            index=i,
            model=copy.deepcopy(self.model).requires_grad_(False).to("cpu", torch.float32),  # placed by the sampler
            tokenizer=self.tokenizer,
            incarnation=self.incarnations[i],
            redo=redo,
            record_entropy=self.record_entropy,
        )
        if redo:
            self._set_claim(i, min(redo), max(redo) + 1)
        self._launch(i, spec)
        self.started[i] = True

    def _start_samplers(self) -> None:
        for i in range(self.n):
            if not self.started[i]:
                self._spawn(i, self._redo.pop(i, []))

    def _undelivered(self, i: int) -> list[int]:
        lo, hi = self._claims()[i]
        return [g for g in range(lo, hi) if g not in self.pool.seen]

    def _check_samplers(self) -> None:
        for i in range(self.n):
            if not self.started[i]:
                continue
            how = self._exit_status(i)
            if how is None:
                continue
            self._collect()
            redo = self._undelivered(i)
            self.no_progress[i] += 1
            if self.no_progress[i] > MAX_RESTARTS_WITHOUT_PROGRESS:
                raise SamplerDiedError(
                    f"sampler {i} died {self.no_progress[i]} times in a row without delivering a group ({how})"
                )
            self.say(
                f"[steadyrl {self.label}] sampler {i} {how}; restarting it to redo {len(redo)} undelivered group(s)"
            )
            self.incarnations[i] += 1
            self.restarts += 1
            self._spawn(i, redo)

    # -- pool ----------------------------------------------------------------------------------------------------
    def _prefix_drift(self, records: list[GroupRecord]) -> list[torch.Tensor]:
        """PACE's prefix-forgetting scores of pooled groups: one no-grad forward of the learner's current policy (at
        the sampling temperature) over their responses (:func:`steadyrl.pool.policies.prefix_forgetting`)."""
        rollouts = concat([r.rollouts for r in records])
        device = next(self.model.parameters()).device
        with torch.no_grad():
            logp = sequence_logprobs(self.model, rollouts.to(device), temperature=self.cfg.rollout.temperature).logp
        logp = logp.to(rollouts.behav_logp.device)
        out, row = [], 0
        for r in records:
            n = len(r.rollouts)
            out.append(prefix_forgetting(
                logp_now=logp[row:row + n], behav_logp=rollouts.behav_logp[row:row + n],
                versions=rollouts.versions[row:row + n], response_mask=rollouts.response_mask[row:row + n],
                v_complete=r.v_complete,
            ))  # fmt: skip
            row += n
        return out

    def _collect(self) -> int:
        """Move delivered groups into the pool (completion order); the number moved."""
        records = sorted(self._fetch(), key=lambda r: (r.completed_at, r.group_id))
        discarded = 0
        for r in records:
            self.no_progress[r.sampler] = 0
            if r.started_at < self._not_before:  # generated before a rollback: its weights were discarded
                self.pool.seen.add(r.group_id)
                self.pool.discarded.add(r.group_id)
                discarded += 1
                continue
            self.pool.add(r)
        if discarded:
            self._count(retired=discarded)
        return len(records)

    def next_batch(self, *, step: int) -> ScoredRollouts:
        """Wait until the pool policy yields a batch of ``prompts_per_step`` groups at the learner's version."""
        self._start_samplers()
        t0 = time.perf_counter()
        last_arrival = t0
        changed = True  # the policy is re-applied only when groups arrived (the version is fixed while waiting)
        while True:
            if self._collect():
                last_arrival = time.perf_counter()
                changed = True
            if changed:
                batch, discarded = self.pool.take(v_now=self.version)
                if discarded:
                    self._count(retired=len(discarded))
                if batch is not None:
                    break
                changed = False
            self._check_samplers()
            timeout = self.cfg.runtime.concurrent.stall_timeout_s
            if time.perf_counter() - last_arrival > timeout:
                raise RuntimeError(
                    f"no rollout arrived for {timeout:g} s (runtime.concurrent.stall_timeout_s) while "
                    f"the learner waited for step {step}'s batch ({len(self.pool)} groups pooled)"
                )
            self._wait()
        self._count(consumed=len(batch.records))
        self.last_batch_ids = [r.group_id for r in batch.records]
        now = time.perf_counter()
        wait = now - t0
        idle, busy = self._times()
        d_idle, d_busy = idle - self._last_idle, busy - self._last_busy
        self._last_idle, self._last_busy = idle, busy
        metrics = dict(batch.metrics)
        metrics["time/wait_s"] = wait
        metrics["time/sample_s"] = wait
        if self._last_return is not None:
            metrics["time/learner_idle_frac"] = wait / max(now - self._last_return, 1e-9)
        if d_idle + d_busy > 0:
            metrics["time/sampler_idle_frac"] = d_idle / (d_idle + d_busy)
        metrics["runtime/sampler_restarts"] = float(self.restarts)
        self._last_return = now
        out = ScoredRollouts(batch.rollouts, batch.rewards, metrics)
        return out if self.delay is None else self.delay.apply(step, out)

    # -- rollback, checkpoint, shutdown --------------------------------------------------------------------------
    def restart(self, *, step: int, version: int, model: nn.Module) -> None:
        """The collapse guard's rollback: discard the pool and everything generated so far, publish ``model``."""
        self._collect()
        n = len(self.pool.records)
        for r in self.pool.records:
            self.pool.discarded.add(r.group_id)
        self.pool.records = []
        self._count(retired=n)
        self._not_before = time.time()
        self.publish(step=step, version=version, model=model)

    def state_dict(self) -> dict[str, Any]:
        """Pool, counters and the claimed-but-undelivered group ids."""
        self._collect()
        pending = sorted({g for i in range(self.n) for g in self._undelivered(i)})
        c = self._counters()
        return {
            "pool": self.pool.state_dict(),
            "next_group": c.next_group,
            "retired": c.retired,
            "consumed": c.consumed,
            "pending": torch.tensor(pending, dtype=torch.long),
            "version": self.version,
            "step": c.step,
            "restarts": self.restarts,
            "reward_delay": {} if self.delay is None else self.delay.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (before any sampler starts) and publish the restored weights (the learner's
        model, already restored), which starts the samplers."""
        if any(self.started):
            raise RuntimeError("load_state_dict must come before the samplers start")
        self.pool.load_state_dict(state["pool"])
        self._restore_counters(
            next_group=int(state["next_group"]), retired=int(state["retired"]), consumed=int(state["consumed"])
        )
        self.restarts = int(state["restarts"])
        if self.delay is not None:
            self.delay.load_state_dict(state.get("reward_delay", {}))
        pending = [int(g) for g in state["pending"].tolist()]
        if pending:
            self._redo[0] = pending
        self.publish(step=int(state["step"]), version=int(state["version"]), model=self.model)

    def close(self) -> None:
        """Stop every sampler and release the transport (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
