"""Fixtures of the sandbox tests: a base config per isolation level, and a census of sandbox processes."""

from __future__ import annotations

import os
import time

import pytest

from steadyrl.tools import SandboxConfig, SandboxUnavailableError, resolve_isolation
from steadyrl.tools.uids import UID_COUNT

#: An interpreter uid 65534 can read (the venv's may live under /root); used at the rlimits level when root.
SYSTEM_PYTHON = "/usr/bin/python3"


def is_sandbox_uid(uid: int) -> bool:
    """Whether ``uid`` is one of the per-call uids the sandbox runs code as (when root)."""
    base = SandboxConfig().uid_base
    return os.geteuid() == 0 and base <= uid < base + UID_COUNT


def level_config(level: str, **limits: object) -> SandboxConfig:
    """Small limits so that every test stays short; at ``rlimits`` as root, an interpreter the sandbox uid can read."""
    python = SYSTEM_PYTHON if level == "rlimits" and os.geteuid() == 0 and os.path.exists(SYSTEM_PYTHON) else None
    base: dict[str, object] = {"timeout_s": 20.0, "cpu_s": 10, "memory_mb": 256, "max_procs": 16}
    return SandboxConfig(isolation=level, python=python, **{**base, **limits})  # type: ignore[arg-type]


@pytest.fixture(params=["namespaces", "rlimits"])
def level(request: pytest.FixtureRequest) -> str:
    """Each isolation level this machine offers (a missing one is skipped with the reason)."""
    try:
        resolve_isolation(level_config(request.param))
    except SandboxUnavailableError as exc:
        pytest.skip(f"isolation={request.param} unavailable here: {str(exc).splitlines()[0]}")
    return request.param


def _pid_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def sandbox_processes() -> set[int]:
    """Live processes a sandbox could have left: run by the sandbox uid (when root), in another pid namespace, or
    descended from this test process. Zombies are not counted: once the supervisor is killed from outside, its
    orphans are reaped by the machine's pid 1 (which, in some containers, never reaps)."""
    me, my_ns = os.getpid(), _pid_namespace("self")
    parents: dict[int, int] = {}
    suspects: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        pid = int(name)
        if fields["State"].split()[0] == "Z":
            continue
        parents[pid] = int(fields["PPid"])
        uid = int(fields["Uid"].split()[0])
        if is_sandbox_uid(uid) or _pid_namespace(pid) not in (my_ns, None):
            suspects.add(pid)
    for pid in parents:
        p = parents[pid]
        while p > 1 and p != me:
            p = parents.get(p, 0)
        if p == me and pid != me:
            suspects.add(pid)
    return suspects


def wait_for_no_new_processes(before: set[int], grace_s: float = 1.0) -> set[int]:
    """Sandbox processes not present in ``before`` that are still alive after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        left = sandbox_processes() - before
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)
