"""A uid of its own for each running tool call (when steadyrl runs as root), and removing what that uid left behind.

Started as root, :mod:`steadyrl.tools.sandbox` runs each call's code as a uid (and gid of the same number) that no
other running call has: ``uid_base``, ``uid_base + 1``, ... (:data:`UID_COUNT` of them). Two concurrent calls then
cannot read each other's files, signal or trace each other's processes, whatever their code does (the kernel's
permission checks, not the audit hook, keep them apart). A slot is held with an exclusive ``flock`` on
``<LOCK_DIR>/<uid>.lock`` for as long as the call and its cleanup run, so every steadyrl process on the machine
(samplers of the local runtime, several pools) draws from the same set without two holding one uid.

After a call, :func:`sweep_uid` removes everything its uid may have left outside the call's own directory: every process
of the uid (found by ``/proc``, signalled through a pidfd so a recycled pid is never hit), every entry it owns in the
machine's world-writable directories (:data:`SHARED_DIRS` and the world-writable directories in them), and its System V
shared memory segments, message queues and semaphore sets. With the seccomp filter and Landlock of
:mod:`steadyrl.tools._kernel_guards` the code cannot create those in the first place; the sweep is what holds where the
kernel lacks them. Confidence: [exact] (Linux credentials and ``flock``; no paper formula).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import stat
import time
from dataclasses import dataclass

#: How many uids the sandbox draws from (one per call running at once, across every steadyrl process).
UID_COUNT: int = 256
#: Where the slot locks live (root-only).
LOCK_DIR: str = "/run/steadyrl-sandbox" if os.path.isdir("/run") else "/var/tmp/steadyrl-sandbox"
#: World-writable directories swept after each call (with the world-writable directories directly inside them).
SHARED_DIRS: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue")
#: How long acquiring a slot waits when all are taken (seconds) before it fails.
ACQUIRE_TIMEOUT_S: float = 60.0
#: Rounds of kill-and-rescan :func:`sweep_uid` makes before giving up on a process (a fork loop ends well before).
KILL_ROUNDS: int = 50

IPC_RMID = 0


@dataclass
class UidSlot:
    """One uid held for one call; :meth:`release` gives it back (idempotent)."""

    uid: int
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1


def _lock_dir() -> str:
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    st = os.lstat(LOCK_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
        raise PermissionError(f"{LOCK_DIR} must be a directory owned by root with mode 0700 (the sandbox's uid locks)")
    return LOCK_DIR


def acquire(uid_base: int) -> UidSlot:
    """Hold a free uid of ``uid_base .. uid_base + UID_COUNT - 1`` (waits up to ACQUIRE_TIMEOUT_S when all are taken).

    Raises:
        TimeoutError: every uid stayed taken.
    """
    directory = _lock_dir()
    deadline = time.monotonic() + ACQUIRE_TIMEOUT_S
    start = os.getpid() % UID_COUNT  # processes start their search at different uids: fewer collisions
    while True:
        for i in range(UID_COUNT):
            uid = uid_base + (start + i) % UID_COUNT
            fd = os.open(os.path.join(directory, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return UidSlot(uid, fd)
        if time.monotonic() > deadline:
            raise TimeoutError(f"all {UID_COUNT} sandbox uids from {uid_base} stayed taken for {ACQUIRE_TIMEOUT_S} s")
        time.sleep(0.05)


def _uids_and_state(pid: int | str) -> tuple[list[str], str] | None:
    """(real, effective, saved uid) and the state letter of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return fields["Uid"].split()[:3], fields["State"].split()[0]
    except (OSError, KeyError, IndexError):
        return None


def processes_of(uid: int) -> list[int]:
    """Live processes whose real, effective or saved uid is ``uid`` (zombies are dead: they hold nothing but a pid,
    and the machine's pid 1 reaps them, or, in some containers, never does)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            got = _uids_and_state(name)
            if got is not None and str(uid) in got[0] and got[1] != "Z":
                found.append(int(name))
    return found


def _still_uid(pid: int, uid: int) -> bool:
    got = _uids_and_state(pid)
    return got is not None and str(uid) in got[0] and got[1] != "Z"


def kill_processes(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left (through a pidfd: the pid checked is the pid signalled)."""
    for _ in range(KILL_ROUNDS):
        pids = processes_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if _still_uid(pid, uid):  # the pidfd pins the process: a recycled pid cannot be hit from here on
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)
        time.sleep(0.002)
    raise OSError(f"processes of sandbox uid {uid} survived {KILL_ROUNDS} rounds of SIGKILL: {processes_of(uid)}")


def _remove_entries_of(uid: int, directory: str, depth: int = 1) -> None:
    """Delete every entry of ``directory`` owned by ``uid`` (a directory with all it holds), without following a
    symlink; recurse into world-writable directories owned by others (e.g. /tmp/.X11-unix) ``depth`` more levels."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        for name in os.listdir(dfd):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == uid:
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(name, dir_fd=dfd)  # fd-based on Linux: never follows a symlink inside
                else:
                    os.unlink(name, dir_fd=dfd)
            elif depth > 0 and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH:
                _remove_entries_of(uid, os.path.join(directory, name), depth - 1)
    finally:
        os.close(dfd)


def _remove_ipc_of(uid: int) -> None:
    """Remove the System V IPC objects owned or created by ``uid``."""
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, remove in (
        ("shm", lambda i: libc.shmctl(i, IPC_RMID, None)),
        ("msg", lambda i: libc.msgctl(i, IPC_RMID, None)),
        ("sem", lambda i: libc.semctl(i, 0, IPC_RMID)),
    ):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = [line.split() for line in f if line.strip()]
        except (OSError, ValueError):
            continue
        ident = header.index("msqid" if kind == "msg" else f"{kind}id")
        owners = (header.index("uid"), header.index("cuid"))
        for row in rows:
            if any(int(row[i]) == uid for i in owners):
                remove(int(row[ident]))


def sweep_uid(uid: int) -> None:
    """Remove every process, shared-directory entry and System V IPC object of ``uid`` (see the module docstring).
    Raises OSError when a process cannot be killed."""
    kill_processes(uid)
    for directory in SHARED_DIRS:
        _remove_entries_of(uid, directory)
    _remove_ipc_of(uid)
