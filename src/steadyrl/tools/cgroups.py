"""A cgroup per tool call: memory (shared memory, memfd and tmpfs pages included), processes and CPU counted per call.

The rlimits of :mod:`steadyrl.tools.sandbox` are per process: 32 processes of 1 GiB each, or pages held in shared
memory that no process maps, are not bounded by them. Where the machine lets steadyrl create cgroups (it runs as root
and a cgroup hierarchy with the ``memory``, ``pids`` and ``cpu`` controllers is mounted writable: cgroup v1, or
cgroup v2 with those controllers delegated to steadyrl's own cgroup), every call runs in a cgroup of its own under
``steadyrl-sandbox/``, a child of steadyrl's own cgroup:

=====================  ===============================================  =========================================
limit                  cgroup v2                                        cgroup v1
=====================  ===============================================  =========================================
memory of the call     ``memory.max`` = memory_mb + max_file_mb + 64    ``memory.limit_in_bytes`` (and
                       MiB (its processes, its tmpfs, its supervisor),  ``memory.memsw.limit_in_bytes``), same
                       ``memory.swap.max`` = 0                          value
processes              ``pids.max`` = max_procs + 4                     ``pids.max``, same
CPU of the call        ``cpu.max`` = one CPU                            ``cpu.cfs_quota_us`` = one CPU
CPU of all calls       ``cpu.weight`` = 25 on ``steadyrl-sandbox``      ``cpu.shares`` = 256 on ``steadyrl-sandbox``
=====================  ===============================================  =========================================

The share of ``steadyrl-sandbox`` against steadyrl's own processes (weight 25 against 100, shares 256 against 1024 per
task: all calls together weigh a quarter of one busy task) is what keeps any number of busy calls from starving the
learner. The supervisor of a call joins its cgroup
before it starts anything, so init and the tool are in it from their first instruction. After the call the caller
kills whatever is left in the cgroup (``cgroup.kill``, or SIGKILL to each member until none is left) and removes it;
an out-of-memory kill in it is reported (``oom_kill`` of ``memory.events`` / ``memory.oom_control``) so that the call
ends with ``error="memory"``. Confidence: [exact] (kernel interfaces: Documentation/admin-guide/cgroup-v2.rst and
cgroup-v1/memory.rst, pids.rst, sched-bwc.rst).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Literal

#: Name of the directory, in steadyrl's own cgroup, that holds every call's cgroup.
BASE_NAME: str = "steadyrl-sandbox"
#: Controllers a call's cgroup needs.
CONTROLLERS: tuple[str, ...] = ("memory", "pids", "cpu")
#: Memory a call's supervisor and init take beside the code's own (MiB).
OVERHEAD_MB: int = 64
#: Processes a call's machinery runs beside the code's (supervisor, init, their threads).
OVERHEAD_PROCS: int = 4
#: CPU period of ``cpu.max`` / ``cpu.cfs_period_us`` (microseconds); the quota is one period: one CPU per call.
CPU_PERIOD_US: int = 100_000
#: Weight (v2; a normal cgroup has 100) / shares (v1; a normal task has 1024) of ``steadyrl-sandbox`` as a whole: a
#: quarter of one busy task of the caller's, whatever the number of calls (so the learner keeps >= 80% of a CPU, and
#: the calls still progress on a machine the learner keeps busy).
SANDBOX_CPU_WEIGHT: int = 25
SANDBOX_CPU_SHARES: int = 256
#: How long removing a call's cgroup may wait for its last processes to die (seconds).
REMOVE_TIMEOUT_S: float = 5.0


@dataclass(frozen=True)
class CgroupLayout:
    """Where calls' cgroups are made: ``bases`` maps a controller (v1) or ``""`` (v2) to its ``steadyrl-sandbox``."""

    version: Literal[1, 2]
    bases: dict[str, str]


@dataclass(frozen=True)
class CallCgroup:
    """One call's cgroup: a directory per hierarchy (one for v2, one per controller for v1)."""

    layout: CgroupLayout
    dirs: tuple[str, ...]

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files the call's supervisor writes its pid to."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def _memory_dir(self) -> str:
        return self.dirs[0] if self.layout.version == 2 else self.dirs[CONTROLLERS.index("memory")]

    def oom_kills(self) -> int:
        """How many processes of the call the kernel killed for being over the call's memory limit."""
        name = "memory.events" if self.layout.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self._memory_dir(), name)) as f:
                fields = dict(line.split() for line in f if len(line.split()) == 2)
        except OSError:
            return 0
        return int(fields.get("oom_kill", 0))

    def pids(self) -> set[int]:
        """Processes now in the call's cgroup."""
        found: set[int] = set()
        for path in self.procs_files:
            with contextlib.suppress(OSError), open(path) as f:
                found |= {int(line) for line in f if line.strip()}
        return found

    def kill_and_remove(self) -> None:
        """SIGKILL every process left in the cgroup, wait until it is empty, remove it (raises OSError if it cannot:
        the call then reports ``internal_error``)."""
        if self.layout.version == 2:
            with contextlib.suppress(OSError):
                _write(os.path.join(self.dirs[0], "cgroup.kill"), "1")
        deadline = time.monotonic() + REMOVE_TIMEOUT_S
        while True:
            left = self.pids()
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                for d in self.dirs:
                    if os.path.isdir(d):
                        os.rmdir(d)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fstype, super options) of each cgroup mount, from /proc/self/mountinfo."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                point = fields[4].encode().decode("unicode_escape")
                found.append((fields[3], point, tail[0], set(tail[2].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """steadyrl's own cgroup per controller (v1 names) and ``""`` (v2), from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def _inside(root: str, point: str, own: str) -> str | None:
    """The directory of cgroup ``own`` in a hierarchy mounted at ``point`` whose root is ``root``."""
    if own != root and not own.startswith(root.rstrip("/") + "/"):
        return None
    rel = own[len(root) :].lstrip("/")
    path = os.path.join(point, rel) if rel else point
    return path if os.path.isdir(path) else None


def _v1_layout() -> CgroupLayout | None:
    own, bases = _own_paths(), {}
    for controller in CONTROLLERS:
        for root, point, fstype, options in _mounts():
            if fstype == "cgroup" and controller in options and controller in own:
                here = _inside(root, point, own[controller])
                if here is not None:
                    bases[controller] = os.path.join(here, BASE_NAME)
                    break
        else:
            return None
    for base in bases.values():
        os.makedirs(base, mode=0o755, exist_ok=True)
    _write(os.path.join(bases["cpu"], "cpu.shares"), str(SANDBOX_CPU_SHARES))
    return CgroupLayout(1, bases)


def _v2_layout() -> CgroupLayout | None:
    own = _own_paths().get("")
    if own is None:
        return None
    for root, point, fstype, _ in _mounts():
        if fstype != "cgroup2":
            continue
        here = _inside(root, point, own)
        if here is None:
            continue
        with open(os.path.join(here, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
        if not set(CONTROLLERS) <= enabled:  # a cgroup holding processes cannot enable them for its children
            _write(os.path.join(here, "cgroup.subtree_control"), " ".join("+" + c for c in CONTROLLERS))
        base = os.path.join(here, BASE_NAME)
        os.makedirs(base, mode=0o755, exist_ok=True)
        _write(os.path.join(base, "cgroup.subtree_control"), " ".join("+" + c for c in CONTROLLERS))
        _write(os.path.join(base, "cpu.weight"), str(SANDBOX_CPU_WEIGHT))
        return CgroupLayout(2, {"": base})
    return None


def _remove_stale(found: CgroupLayout) -> None:
    """Remove call cgroups left by a steadyrl process that died during a call (its pid in the name is gone)."""
    for base in found.bases.values():
        for name in os.listdir(base):
            parts = name.split("-")
            ours = len(parts) == 3 and parts[0] == "call" and parts[1].isdigit()
            if ours and not os.path.exists(f"/proc/{parts[1]}"):
                with contextlib.suppress(OSError):
                    CallCgroup(found, (os.path.join(base, name),)).kill_and_remove()


@functools.cache
def layout() -> CgroupLayout | None:
    """Where calls' cgroups go, or None when this machine does not let steadyrl make them (not root, no writable
    hierarchy with memory, pids and cpu). Probed once per interpreter; v2 is preferred to v1."""
    if os.geteuid() != 0 or not os.path.isfile("/proc/self/cgroup"):
        return None
    for probe in (_v2_layout, _v1_layout):
        try:
            found = probe()
        except (OSError, ValueError):
            continue
        if found is not None:
            _remove_stale(found)
            return found
    return None


def create(memory_bytes: int, max_procs: int) -> CallCgroup | None:
    """A fresh cgroup for one call with its limits set, or None where cgroups are not available (see
    :func:`layout`). Raises OSError when the cgroup cannot be made although cgroups are available."""
    found = layout()
    if found is None:
        return None
    name = f"call-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # the creator's pid: see _remove_stale
    memory, pids = memory_bytes + (OVERHEAD_MB << 20), max_procs + OVERHEAD_PROCS
    if found.version == 2:
        d = os.path.join(found.bases[""], name)
        os.mkdir(d, 0o755)
        group = CallCgroup(found, (d,))
        try:
            _write(os.path.join(d, "memory.max"), str(memory))
            if os.path.exists(os.path.join(d, "memory.swap.max")):
                _write(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "pids.max"), str(pids))
            _write(os.path.join(d, "cpu.max"), f"{CPU_PERIOD_US} {CPU_PERIOD_US}")
        except BaseException:
            group.kill_and_remove()
            raise
        return group
    dirs = tuple(os.path.join(found.bases[c], name) for c in CONTROLLERS)
    made: list[str] = []
    try:
        for d in dirs:
            os.mkdir(d, 0o755)
            made.append(d)
        mem, pid_dir, cpu = dirs
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory))
        if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
            _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory))
        _write(os.path.join(pid_dir, "pids.max"), str(pids))
        _write(os.path.join(cpu, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
        _write(os.path.join(cpu, "cpu.cfs_quota_us"), str(CPU_PERIOD_US))
    except BaseException:
        CallCgroup(found, tuple(made)).kill_and_remove()
        raise
    return CallCgroup(found, dirs)
