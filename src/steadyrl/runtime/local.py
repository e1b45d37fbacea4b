"""``runtime.mode=local``: sampler processes running concurrently with the learner on one machine.

Roles (DESIGN.md vocabulary):

* **Learner** (the ``steadyrl train`` process): publishes its weights after every step, takes each batch from the
  :class:`~steadyrl.pool.RolloutPool` under ``pool.policy``, trains, repeats.
* **Samplers** (``runtime.samplers`` spawned processes, ``runtime.sampler_threads`` torch threads each): the loop of
  :mod:`steadyrl.runtime.worker`, through :class:`LocalChannel`.

Transport:

==================  ====================================================================================================
weights             one flat array in shared memory (``multiprocessing.RawArray``) + a version counter, under a lock
                    while copied in or out (4 MiB for the default model: about a millisecond). A sampler always loads
                    the newest version; versions it never saw are simply skipped, never queued.
claims              a shared group-id counter under a lock; each sampler's current claim ``[lo, hi)`` is recorded so a
                    replacement can redo what a dead sampler never delivered.
admission           a sampler may start group ids only while (groups started − groups discarded) stays within
                    ``(step + ahead + 1) · P`` (AReaL's rule; ``ahead`` = ⌊s / optimizer steps per learner step⌋ for
                    ``pool.policy=max_staleness``, 0 for ``runtime.sync``, unbounded otherwise) and while groups in
                    flight + in the pool stay below ``pool.capacity`` (back-pressure).
completed groups    one file per group in a spool directory (``/dev/shm`` when present), written to a temporary name
                    and renamed: a sampler killed mid-write leaves no partial group. The learner moves them into its
                    pool (in completion order) and deletes them.
==================  ====================================================================================================

Faults: a sampler that exits is restarted with its index and the ids it claimed but did not deliver (``redo``); the
pool refuses an id twice (:class:`~steadyrl.pool.pool.DuplicateRolloutError`), so a rollout is neither lost nor
trained on twice. A checkpoint holds the pool, the counters and the claimed-but-undelivered ids; a resumed run redoes
those first. Samplers ignore SIGINT (Ctrl-C is the learner's: it stops after the step, checkpoints, then stops them)
and get SIGTERM if the learner dies (``prctl(PR_SET_PDEATHSIG)``), so nothing is left orphaned.

Lag accounting: a token's version is the learner version of the weights that produced it; the learner trains at
version v_now, so a trajectory's lag is v_now − its oldest token's version (``lag/max``), its generation staleness and
waiting staleness are PACE's GS and WS (``lag/gen_mean``, ``lag/wait_mean``; :mod:`steadyrl.pool.policies`).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from steadyrl.pool.pool import RolloutPool
from steadyrl.pool.records import GroupRecord
from steadyrl.rollout.scored import ScoredRollouts
from steadyrl.runtime.procs import die_with_parent
from steadyrl.runtime.weights import FlatLayout
from steadyrl.runtime.worker import SamplerSpec, run_sampler
from steadyrl.tasks import Problem, Task

if TYPE_CHECKING:
    from steadyrl.train.config import TrainConfig

#: A sampler restarted this many times without delivering a group in between ends the run with an error.
MAX_RESTARTS_WITHOUT_PROGRESS = 3
#: Seconds between polls of the spool directory / the shared counters.
POLL_S = 0.002
UNBOUNDED = 1 << 62


def admission_ahead(cfg: TrainConfig) -> int:
    """Learner steps a sampler may run ahead of the learner (see the module table); UNBOUNDED when not bounded."""
    if cfg.runtime.sync:
        return 0
    if cfg.pool.policy == "max_staleness":
        versions_per_step = cfg.optim.updates_per_batch * cfg.optim.minibatches
        return cfg.pool.max_staleness // versions_per_step
    return UNBOUNDED


class LocalShared:
    """The shared-memory state of one run (created by the learner, handed to every sampler process)."""

    def __init__(self, ctx: Any, *, samplers: int, layout: FlatLayout) -> None:
        nbytes = layout.numel * torch.tensor([], dtype=layout.dtype).element_size()
        self.weights_raw = ctx.RawArray(ctypes.c_uint8, max(1, nbytes))
        self.dtype = layout.dtype
        self.numel = layout.numel
        self.wlock = ctx.Lock()
        self.lock = ctx.Lock()
        self.version = ctx.RawValue(ctypes.c_longlong, -1)
        self.step = ctx.RawValue(ctypes.c_longlong, -1)
        """The learner step whose batch is next (set after that step's weights are published); −1 before any."""
        self.next_group = ctx.RawValue(ctypes.c_longlong, 0)
        self.retired = ctx.RawValue(ctypes.c_longlong, 0)
        """Groups discarded by the pool policy (their admission slots are free again)."""
        self.consumed = ctx.RawValue(ctypes.c_longlong, 0)
        self.claims = ctx.RawArray(ctypes.c_longlong, 2 * samplers)
        self.idle = ctx.RawArray(ctypes.c_double, samplers)
        self.busy = ctx.RawArray(ctypes.c_double, samplers)
        self.stop = ctx.Event()

    def weights(self) -> Tensor:
        """The flat weights array as a tensor view (no copy)."""
        return torch.frombuffer(self.weights_raw, dtype=self.dtype, count=self.numel)


class LocalChannel:
    """:class:`~steadyrl.runtime.worker.SamplerChannel` over :class:`LocalShared` and a spool directory."""

    def __init__(self, shared: LocalShared, *, spool: str, batch_groups: int, ahead: int, capacity: int) -> None:
        self.shared = shared
        self.spool = Path(spool)
        self.batch_groups = batch_groups
        self.ahead = ahead
        self.capacity = capacity
        self._flat: Tensor | None = None

    def allowed(self, want: int) -> int:
        """How many new ids admission control and back-pressure allow now (call under ``shared.lock``)."""
        sh = self.shared
        if sh.step.value < 0:
            return 0
        started = sh.next_group.value
        n = min(want, self.capacity - (started - sh.consumed.value - sh.retired.value))
        if self.ahead < UNBOUNDED:
            n = min(n, (sh.step.value + self.ahead + 1) * self.batch_groups - (started - sh.retired.value))
        return max(0, n)

    def claim(self, sampler: int, max_groups: int) -> list[int] | None:
        sh = self.shared
        t0 = time.perf_counter()
        try:
            while not sh.stop.is_set():
                with sh.lock:
                    n = self.allowed(max_groups)
                    if n > 0:
                        lo = sh.next_group.value
                        sh.next_group.value = lo + n
                        sh.claims[2 * sampler], sh.claims[2 * sampler + 1] = lo, lo + n
                        return list(range(lo, lo + n))
                time.sleep(POLL_S)
            return None
        finally:
            sh.idle[sampler] += time.perf_counter() - t0

    def weights_version(self) -> int:
        return int(self.shared.version.value)

    def load_weights(self, model: nn.Module, layout: FlatLayout) -> int:
        if self._flat is None:
            self._flat = self.shared.weights()
        with self.shared.wlock:
            version = int(self.shared.version.value)
            layout.load_into(model, self._flat)
        return version

    def deliver(self, sampler: int, record: GroupRecord) -> None:
        final = self.spool / f"g{record.group_id:012d}.pt"
        tmp = self.spool / f".{final.name}.{os.getpid()}.tmp"
        torch.save(record.to_state(), tmp)
        os.replace(tmp, final)

    def add_busy(self, sampler: int, seconds: float) -> None:
        self.shared.busy[sampler] += seconds


def _sampler_main(spec: SamplerSpec, shared: LocalShared, channel_kw: dict[str, Any], parent: int) -> None:
    """Entry point of a sampler process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the learner, which stops us in order
    if not die_with_parent(parent):
        return
    try:
        run_sampler(spec, LocalChannel(shared, **channel_kw))
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


class SamplerDiedError(RuntimeError):
    """A sampler kept dying before it could deliver anything."""


class LocalSource:
    """The rollout source of ``runtime.mode=local`` (the learner's side; see the module docstring)."""

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
        self.n = cfg.runtime.samplers
        self.ctx = mp.get_context("spawn")
        self.layout = FlatLayout(model)
        self.shared = LocalShared(self.ctx, samplers=self.n, layout=self.layout)
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.spool = Path(tempfile.mkdtemp(prefix="steadyrl-pool-", dir=base))
        self.pool = RolloutPool(cfg.pool, batch_groups=self.P)
        self.channel_kw = {
            "spool": str(self.spool),
            "batch_groups": self.P,
            "ahead": admission_ahead(cfg),
            "capacity": cfg.pool.resolved_capacity(self.P),
        }
        self.procs: list[Any] = [None] * self.n
        self.incarnations = [0] * self.n
        self.no_progress = [0] * self.n
        self.restarts = 0
        self.version = 0
        self._redo: dict[int, list[int]] = {}
        self._not_before = 0.0
        self._last_return: float | None = None
        self._last_idle = self._last_busy = 0.0
        self._closed = False
        self.last_batch_ids: list[int] = []
        """Group ids of the batch :meth:`next_batch` returned last."""

    @classmethod
    def from_config(cls, cfg: TrainConfig, **kw: Any) -> LocalSource:
        """The source ``cfg`` describes (keywords: see :class:`steadyrl.train.loop.SourceFactory`)."""
        return cls(cfg, **kw)

    # -- weights -------------------------------------------------------------------------------------------------
    def publish(self, *, step: int, version: int, model: nn.Module) -> None:
        """Write ``model``'s weights to shared memory as ``version``, then open ``step`` to the samplers."""
        sh = self.shared
        flat = sh.weights()
        with sh.wlock:
            self.layout.flatten_into(model, flat)
            sh.version.value = version
        with sh.lock:
            sh.step.value = step
        self.version = version
        self._start_samplers()

    # -- samplers ------------------------------------------------------------------------------------------------
    def _spawn(self, i: int, redo: list[int]) -> None:
        spec = SamplerSpec(
            cfg=self.cfg,
            index=i,
            model=copy.deepcopy(self.model).requires_grad_(False),
            tokenizer=self.tokenizer,
            incarnation=self.incarnations[i],
            redo=redo,
            record_entropy=self.record_entropy,
        )
        if redo:
            self.shared.claims[2 * i], self.shared.claims[2 * i + 1] = min(redo), max(redo) + 1
        proc = self.ctx.Process(
            target=_sampler_main, args=(spec, self.shared, self.channel_kw, os.getpid()), name=f"steadyrl-sampler-{i}",
            daemon=True,
        )  # fmt: skip
        proc.start()
        self.procs[i] = proc

    def _start_samplers(self) -> None:
        for i in range(self.n):
            if self.procs[i] is None:
                self._spawn(i, self._redo.pop(i, []))

    def _undelivered(self, i: int) -> list[int]:
        lo, hi = int(self.shared.claims[2 * i]), int(self.shared.claims[2 * i + 1])
        return [g for g in range(lo, hi) if g not in self.pool.seen]

    def _check_samplers(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is None or proc.is_alive():
                continue
            self._collect()
            redo = self._undelivered(i)
            self.no_progress[i] += 1
            if self.no_progress[i] > MAX_RESTARTS_WITHOUT_PROGRESS:
                raise SamplerDiedError(
                    f"sampler {i} died {self.no_progress[i]} times in a row without delivering a group (last exit "
                    f"code {proc.exitcode}); its traceback is above"
                )
            self.say(
                f"[steadyrl local] sampler {i} exited (code {proc.exitcode}); restarting it to redo {len(redo)} "
                "undelivered group(s)"
            )
            self.incarnations[i] += 1
            self.restarts += 1
            self._spawn(i, redo)

    # -- pool ----------------------------------------------------------------------------------------------------
    def _collect(self) -> int:
        """Move finished group files from the spool into the pool (completion order); the number moved."""
        files = sorted(self.spool.glob("g*.pt"))
        records = []
        for f in files:
            state = torch.load(f, map_location="cpu", weights_only=True)
            f.unlink()
            records.append(GroupRecord.from_state(state))
        records.sort(key=lambda r: (r.completed_at, r.group_id))
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
            with self.shared.lock:
                self.shared.retired.value += discarded
        return len(records)

    def next_batch(self, *, step: int) -> ScoredRollouts:
        """Wait until the pool policy yields a batch of ``prompts_per_step`` groups at the learner's version."""
        self._start_samplers()
        t0 = time.perf_counter()
        last_arrival = t0
        while True:
            if self._collect():
                last_arrival = time.perf_counter()
            batch, discarded = self.pool.take(v_now=self.version)
            if discarded:
                with self.shared.lock:
                    self.shared.retired.value += len(discarded)
            if batch is not None:
                break
            self._check_samplers()
            if time.perf_counter() - last_arrival > self.cfg.runtime.stall_timeout_s:
                raise RuntimeError(
                    f"no rollout arrived for {self.cfg.runtime.stall_timeout_s:g} s (runtime.stall_timeout_s) while "
                    f"the learner waited for step {step}'s batch ({len(self.pool)} groups pooled)"
                )
            time.sleep(POLL_S)
        with self.shared.lock:
            self.shared.consumed.value += len(batch.records)
        self.last_batch_ids = [r.group_id for r in batch.records]
        now = time.perf_counter()
        wait = now - t0
        idle, busy = sum(self.shared.idle), sum(self.shared.busy)
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
        return ScoredRollouts(batch.rollouts, batch.rewards, metrics)

    # -- rollback, checkpoint, shutdown --------------------------------------------------------------------------
    def restart(self, *, step: int, version: int, model: nn.Module) -> None:
        """The collapse guard's rollback: discard the pool and everything generated so far, publish ``model``."""
        self._collect()
        n = len(self.pool.records)
        for r in self.pool.records:
            self.pool.discarded.add(r.group_id)
        self.pool.records = []
        with self.shared.lock:
            self.shared.retired.value += n
        self._not_before = time.time()
        self.publish(step=step, version=version, model=model)

    def state_dict(self) -> dict[str, Any]:
        """Pool, counters and the claimed-but-undelivered group ids."""
        self._collect()
        pending = sorted({g for i in range(self.n) for g in self._undelivered(i)})
        sh = self.shared
        return {
            "pool": self.pool.state_dict(),
            "next_group": int(sh.next_group.value),
            "retired": int(sh.retired.value),
            "consumed": int(sh.consumed.value),
            "pending": torch.tensor(pending, dtype=torch.long),
            "version": self.version,
            "step": int(sh.step.value),
            "restarts": self.restarts,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (before any sampler starts) and publish the restored weights (the learner's
        model, already restored), which starts the samplers."""
        if any(p is not None for p in self.procs):
            raise RuntimeError("load_state_dict must come before the samplers start")
        self.pool.load_state_dict(state["pool"])
        sh = self.shared
        sh.next_group.value = int(state["next_group"])
        sh.retired.value = int(state["retired"])
        sh.consumed.value = int(state["consumed"])
        self.restarts = int(state["restarts"])
        pending = [int(g) for g in state["pending"].tolist()]
        if pending:
            self._redo[0] = pending
        self.publish(step=int(state["step"]), version=int(state["version"]), model=self.model)

    def close(self) -> None:
        """Stop the samplers (SIGTERM after a grace period, then SIGKILL) and delete the spool."""
        if self._closed:
            return
        self._closed = True
        self.shared.stop.set()
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            if proc is not None:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.spool)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
