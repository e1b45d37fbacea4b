"""Process helpers shared by the runtimes and the sweep runner."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> bool:
    """Ask Linux for SIGTERM when the parent dies (``prctl(PR_SET_PDEATHSIG)``), so a parent killed without a chance
    to clean up leaves no orphan; False when the parent is already gone. Elsewhere it does nothing."""
    if sys.platform.startswith("linux"):
        # without prctl, run anyway: the parent still stops its children itself
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    return os.getppid() == parent_pid


class FileLock:
    """A lock between processes that the kernel releases when its holder dies: ``flock(2)`` on a file.

    A ``multiprocessing.Lock`` is a semaphore: a process killed while holding it (SIGKILL, the OOM killer) leaves it
    taken forever, and the next process to take it hangs. An ``flock`` belongs to an open file, and the kernel closes
    a process's files however it ends, so a killed holder frees the lock at once. Picklable (for ``spawn``): each
    process opens its own descriptor, also after a fork, since a descriptor shared with a parent would share its lock.
    Within a process a thread lock serialises the holders (``flock`` does not tell the threads of one process apart).

    :meth:`shared` holders exclude only :meth:`exclusive` ones (many readers, one writer).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._fd: int | None = None
        self._pid = -1
        self._local = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def _fileno(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            self._pid = os.getpid()
        return self._fd

    @contextlib.contextmanager
    def _held(self, mode: int) -> Iterator[None]:
        with self._local:
            fd = self._fileno()
            fcntl.flock(fd, mode)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Hold the lock alone (``with lock.exclusive(): ...``)."""
        return self._held(fcntl.LOCK_EX)

    def shared(self) -> contextlib.AbstractContextManager[None]:
        """Hold the lock with other shared holders, none exclusive."""
        return self._held(fcntl.LOCK_SH)

    def close(self) -> None:
        """Close this process's descriptor (the file stays; reopened on the next use)."""
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None
