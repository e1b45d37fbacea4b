"""Locks between processes: a holder killed by SIGKILL frees them (a killed sampler must not hang the learner)."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from steadyrl.runtime.local import LocalChannel, LocalShared
from steadyrl.runtime.procs import FileLock
from steadyrl.runtime.weight_sync import FlatLayout

pytestmark = pytest.mark.timeout(120)


def _taken(lock: FileLock) -> bool:
    """Whether some holder has the lock now (probed on a new descriptor, without waiting)."""
    fd = os.open(lock.path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's lock, if it got it
    return False


def _finishes(fn: Any, timeout: float = 10.0) -> bool:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def _hold_and_wait(shared: LocalShared, held: Any) -> None:
    """Child: take the weights lock (as a sampler copying them) and the counters lock (as one claiming), then wait."""
    with shared.wlock.shared(), shared.lock.exclusive():
        held.set()
        threading.Event().wait(60)


def test_a_sampler_killed_while_holding_the_locks_does_not_hang_the_learner(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    model = nn.Linear(3, 2)
    layout = FlatLayout(model)
    shared = LocalShared(ctx, samplers=1, layout=layout, lock_dir=tmp_path)
    held = ctx.Event()
    child = ctx.Process(target=_hold_and_wait, args=(shared, held), daemon=True)
    child.start()
    assert held.wait(60)
    assert _taken(shared.wlock) and _taken(shared.lock)  # the child holds both
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    with torch.no_grad():
        model.weight.fill_(3.0)

    def publish() -> None:
        with shared.wlock.exclusive():
            layout.flatten_into(model, shared.weights())
            shared.version.value = 7
        with shared.lock.exclusive():
            shared.step.value = 1

    assert _finishes(publish), "the learner hung on a lock held by a killed sampler"
    other = nn.Linear(3, 2)
    channel = LocalChannel(shared, spool=str(tmp_path), admission=None)  # type: ignore[arg-type]
    assert channel.load_weights(other, layout) == 7
    assert torch.equal(other.weight, model.weight)


def _take_and_die(path: str, held: Any) -> None:
    with FileLock(path).exclusive():
        held.set()
        os.kill(os.getpid(), signal.SIGKILL)


def test_file_lock_is_freed_when_its_holder_is_killed(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    lock = FileLock(tmp_path / "x.lock")
    held = ctx.Event()
    child = ctx.Process(target=_take_and_die, args=(lock.path, held), daemon=True)
    child.start()
    child.join(60)
    assert held.is_set() and child.exitcode == -signal.SIGKILL
    assert not _taken(lock)

    def take() -> None:
        with lock.exclusive():
            pass

    assert _finishes(take)


def test_file_lock_excludes_other_holders_and_lets_readers_share(tmp_path: Path) -> None:
    lock = FileLock(tmp_path / "y.lock")
    entered = threading.Event()

    def second() -> None:
        with lock.exclusive():
            entered.set()

    with lock.exclusive():
        assert _taken(lock)
        t = threading.Thread(target=second, daemon=True)
        t.start()
        assert not entered.wait(0.3)  # a second holder waits, also a thread of the same process
    assert entered.wait(5)
    t.join(5)
    assert not _taken(lock)
    with lock.shared():  # a shared holder excludes writers ...
        assert _taken(lock)
        fd = os.open(lock.path, os.O_RDWR)
        try:  # ... but not other readers
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)
