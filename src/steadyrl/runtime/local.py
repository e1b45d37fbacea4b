"""``runtime.mode=local``: sampler processes running concurrently with the learner on one machine.

The roles, admission control, faults and lag accounting are those of every concurrent runtime
(:mod:`steadyrl.runtime.concurrent`); this module is the transport: ``runtime.concurrent.samplers`` spawned processes
(``rollout.threads`` torch threads each) running :func:`~steadyrl.runtime.worker.run_sampler` through
:class:`LocalChannel`.

==================  ====================================================================================================
weights             one flat array in shared memory (``multiprocessing.RawArray``) + a version counter, under a lock
                    while copied in or out (4 MiB for the default model: about a millisecond).
claims, counters    shared integers under one lock (:class:`LocalShared`); admission is
                    :func:`~steadyrl.runtime.concurrent.admitted` on them.
locks               :class:`~steadyrl.runtime.procs.FileLock` (``flock`` on files in the spool directory), not
                    ``multiprocessing.Lock``: the kernel frees a lock whose holder was killed, so a sampler killed
                    while copying the weights or claiming ids cannot hang the learner.
completed groups    one file per sampler call (all its groups) in a spool directory (``/dev/shm`` when present),
                    written to a temporary name and renamed: a sampler killed mid-write leaves no partial group.
                    The learner moves them into its pool (in completion order) and deletes the files.
==================  ====================================================================================================

Samplers ignore SIGINT (Ctrl-C is the learner's: it stops after the step, checkpoints, then stops them) and get
SIGTERM if the learner dies (``prctl(PR_SET_PDEATHSIG)``), so nothing is left orphaned.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from steadyrl.pool.records import GroupRecord
from steadyrl.runtime.concurrent import (
    MAX_RESTARTS_WITHOUT_PROGRESS,
    POLL_S,
    UNBOUNDED,
    Admission,
    ConcurrentSource,
    Counters,
    SamplerDiedError,
    admission_ahead,
    admitted,
)
from steadyrl.runtime.procs import FileLock, die_with_parent
from steadyrl.runtime.weight_sync import FlatLayout
from steadyrl.runtime.worker import SamplerSpec, run_sampler

__all__ = [
    "MAX_RESTARTS_WITHOUT_PROGRESS", "POLL_S", "UNBOUNDED", "LocalChannel", "LocalShared", "LocalSource",
    "SamplerDiedError", "admission_ahead",
]  # fmt: skip
#: Seconds :meth:`LocalSource.close` waits for the samplers to finish their call before SIGTERM.
STOP_GRACE_S = 10.0


class LocalShared:
    """The shared-memory state of one run (created by the learner, handed to every sampler process)."""

    def __init__(self, ctx: Any, *, samplers: int, layout: FlatLayout, lock_dir: str | Path) -> None:
        nbytes = layout.numel * torch.tensor([], dtype=layout.dtype).element_size()
        self.weights_raw = ctx.RawArray(ctypes.c_uint8, max(1, nbytes))
        self.dtype = layout.dtype
        self.numel = layout.numel
        self.wlock = FileLock(Path(lock_dir) / ".weights.lock")
        """Exclusive while the learner writes the weights, shared while a sampler copies them."""
        self.lock = FileLock(Path(lock_dir) / ".counters.lock")
        """Exclusive around every read-modify-write of the claims and counters."""
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
        self.stopping = ctx.RawValue(ctypes.c_bool, False)
        """Set by the learner to stop the samplers (a flag, not ``multiprocessing.Event``: an Event's lock, too,
        would stay taken if a sampler were killed while reading it)."""

    def weights(self) -> Tensor:
        """The flat weights array as a tensor view (no copy)."""
        return torch.frombuffer(self.weights_raw, dtype=self.dtype, count=self.numel)

    def counters(self) -> Counters:
        """The counters now (read under ``lock.exclusive()`` for a consistent set)."""
        return Counters(
            step=int(self.step.value), next_group=int(self.next_group.value), retired=int(self.retired.value),
            consumed=int(self.consumed.value),
        )  # fmt: skip


class LocalChannel:
    """:class:`~steadyrl.runtime.worker.SamplerChannel` over :class:`LocalShared` and a spool directory."""

    def __init__(self, shared: LocalShared, *, spool: str, admission: Admission) -> None:
        self.shared = shared
        self.spool = Path(spool)
        self.admission = admission
        self._flat: Tensor | None = None

    def allowed(self, want: int) -> int:
        """How many new ids admission control and back-pressure allow now (call under ``shared.lock.exclusive()``)."""
        return admitted(want, self.shared.counters(), self.admission)

    def claim(self, sampler: int, max_groups: int) -> list[int] | None:
        sh = self.shared
        t0 = time.perf_counter()
        try:
            while not sh.stopping.value:
                with sh.lock.exclusive():
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
        with self.shared.wlock.shared():
            version = int(self.shared.version.value)
            layout.load_into(model, self._flat)
        return version

    def deliver(self, sampler: int, records: list[GroupRecord]) -> None:
        if not records:
            return
        final = self.spool / f"g{records[0].group_id:012d}-{len(records)}.pt"
        tmp = self.spool / f".{final.name}.{os.getpid()}.tmp"
        torch.save({"records": [r.to_state() for r in records]}, tmp)
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


class LocalSource(ConcurrentSource):
    """The rollout source of ``runtime.mode=local`` (the learner's side; see the module docstring)."""

    label = "local"

    def _open_transport(self) -> None:
        self.ctx = mp.get_context("spawn")
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.spool = Path(tempfile.mkdtemp(prefix="steadyrl-pool-", dir=base))
        self.shared = LocalShared(self.ctx, samplers=self.n, layout=self.layout, lock_dir=self.spool)
        self.channel_kw = {"spool": str(self.spool), "admission": self.admission}
        self.procs: list[Any] = [None] * self.n
        """The sampler processes (``multiprocessing.Process``; None before the first start)."""

    def _publish_weights(self, model: nn.Module, *, version: int, step: int) -> None:
        sh = self.shared
        flat = sh.weights()
        with sh.wlock.exclusive():
            self.layout.flatten_into(model, flat)
            sh.version.value = version
        with sh.lock.exclusive():
            sh.step.value = step

    def _launch(self, i: int, spec: SamplerSpec) -> None:
        proc = self.ctx.Process(
            target=_sampler_main, args=(spec, self.shared, self.channel_kw, os.getpid()), name=f"steadyrl-sampler-{i}",
            daemon=True,
        )  # fmt: skip
        proc.start()
        self.procs[i] = proc

    def _exit_status(self, i: int) -> str | None:
        proc = self.procs[i]
        return None if proc.is_alive() else f"exited with code {proc.exitcode}; a traceback, if any, is above"

    def _claims(self) -> list[tuple[int, int]]:
        c = self.shared.claims
        return [(int(c[2 * i]), int(c[2 * i + 1])) for i in range(self.n)]

    def _set_claim(self, i: int, lo: int, hi: int) -> None:
        self.shared.claims[2 * i], self.shared.claims[2 * i + 1] = lo, hi

    def _fetch(self) -> list[GroupRecord]:
        records = []
        for f in sorted(self.spool.glob("g*.pt")):
            state = torch.load(f, map_location="cpu", weights_only=True)
            f.unlink()
            records.extend(GroupRecord.from_state(r) for r in state["records"])
        return records

    def _wait(self) -> None:
        time.sleep(POLL_S)

    def _counters(self) -> Counters:
        with self.shared.lock.exclusive():
            return self.shared.counters()

    def _count(self, *, retired: int = 0, consumed: int = 0) -> None:
        with self.shared.lock.exclusive():
            self.shared.retired.value += retired
            self.shared.consumed.value += consumed

    def _restore_counters(self, *, next_group: int, retired: int, consumed: int) -> None:
        sh = self.shared
        sh.next_group.value, sh.retired.value, sh.consumed.value = next_group, retired, consumed

    def _times(self) -> tuple[float, float]:
        return sum(self.shared.idle), sum(self.shared.busy)

    def _shutdown(self) -> None:
        """Stop the samplers (SIGTERM after a grace period, then SIGKILL) and delete the spool."""
        self.shared.stopping.value = True
        deadline = time.monotonic() + STOP_GRACE_S
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
        self.shared.wlock.close()
        self.shared.lock.close()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.spool)
