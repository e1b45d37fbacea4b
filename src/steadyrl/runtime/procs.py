"""Process helpers shared by the runtimes and the sweep runner."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

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
