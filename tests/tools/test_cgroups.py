"""A cgroup per tool call (:mod:`steadyrl.tools.cgroups`): the limits written, an OOM kill seen, nothing left after."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from steadyrl.tools import cgroups

#: Joins the cgroup whose cgroup.procs files are its arguments, then holds {mb} MiB (bytearray pages are touched).
HOLD = "import os, sys\nfor f in sys.argv[1:]:\n    open(f, 'w').write(str(os.getpid()))\nx = bytearray({mb} << 20)\n"


@pytest.fixture
def real_layout() -> cgroups.CgroupLayout:
    found = cgroups.layout()
    if found is None:
        pytest.skip("no writable cgroup hierarchy with memory, pids and cpu here (needs root)")
    return found


def test_a_call_over_its_memory_is_killed_and_seen(real_layout: cgroups.CgroupLayout) -> None:
    group = cgroups.create(64 << 20, 8)
    assert group is not None
    try:
        over = subprocess.run([sys.executable, "-I", "-S", "-c", HOLD.format(mb=400), *group.procs_files])
        assert over.returncode == -9 and group.oom_kills() >= 1
    finally:
        group.kill_and_remove()
    assert not any(os.path.exists(d) for d in group.dirs)


def test_a_call_within_its_memory_runs(real_layout: cgroups.CgroupLayout) -> None:
    group = cgroups.create(256 << 20, 8)
    assert group is not None
    try:
        ok = subprocess.run([sys.executable, "-I", "-S", "-c", HOLD.format(mb=100), *group.procs_files])
        assert ok.returncode == 0 and group.oom_kills() == 0
    finally:
        group.kill_and_remove()


def test_kill_and_remove_ends_what_is_left(real_layout: cgroups.CgroupLayout) -> None:
    group = cgroups.create(256 << 20, 8)
    assert group is not None
    code = HOLD.format(mb=1) + "import time\ntime.sleep(300)\n"
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", code, *group.procs_files])
    while not group.pids():
        assert proc.poll() is None
    group.kill_and_remove()
    assert proc.wait(timeout=10) == -9
    assert not any(os.path.exists(d) for d in group.dirs)


def test_stale_call_cgroups_of_a_dead_process_are_removed(real_layout: cgroups.CgroupLayout) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = [os.path.join(base, f"call-{int(dead.stdout)}-deadbeef0000") for base in real_layout.bases.values()]
    for d in stale:
        os.mkdir(d)
    cgroups._remove_stale(real_layout)
    assert not any(os.path.exists(d) for d in stale)


def test_v2_limits_are_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cgroup v2 file protocol (this machine has v1): controllers enabled, the base weight, each call's limits."""
    (tmp_path / "cgroup.subtree_control").write_text("")
    monkeypatch.setattr(cgroups, "_mounts", lambda: [("/", str(tmp_path), "cgroup2", set())])
    monkeypatch.setattr(cgroups, "_own_paths", lambda: {"": "/"})
    found = cgroups._v2_layout()
    assert found == cgroups.CgroupLayout(2, {"": str(tmp_path / cgroups.BASE_NAME)})
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    base = tmp_path / cgroups.BASE_NAME
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (base / "cpu.weight").read_text() == str(cgroups.SANDBOX_CPU_WEIGHT)
    monkeypatch.setattr(cgroups, "layout", lambda: found)
    group = cgroups.create(100 << 20, 10)
    assert group is not None and len(group.dirs) == 1
    d = Path(group.dirs[0])
    assert (d / "memory.max").read_text() == str((100 + cgroups.OVERHEAD_MB) << 20)
    assert (d / "pids.max").read_text() == str(10 + cgroups.OVERHEAD_PROCS)
    assert (d / "cpu.max").read_text() == f"{cgroups.CPU_PERIOD_US} {cgroups.CPU_PERIOD_US}"
    assert group.procs_files == [str(d / "cgroup.procs")]
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert group.oom_kills() == 2
