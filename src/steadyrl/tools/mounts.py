"""A tmpfs of the call's disk quota on its working directory at the ``rlimits`` level, where root may mount.

RLIMIT_FSIZE bounds each file a call writes, not their sum: without a quota one call can fill the machine's temporary
directory and make every later call (and anything else writing there) fail. Started as root with the right to mount
(CAP_SYS_ADMIN in the initial mount namespace), :mod:`steadyrl.tools.sandbox` mounts a tmpfs of ``max_file_mb`` on a
call's working directory (owned by the call's uid, mode 0700, nosuid, nodev) and detaches it after the call; with
Landlock (:mod:`steadyrl.tools._kernel_guards`) that directory is the only place the code may write, so the quota covers
every writable path. Where mounting is refused, the working directory is a plain directory and only RLIMIT_FSIZE holds.
Confidence: [exact] (mount(2), umount2(2)).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import tempfile

MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount_tmpfs(path: str, size_bytes: int, owner: tuple[int, int]) -> bool:
    """Mount a tmpfs of ``size_bytes`` owned by ``owner`` (uid, gid) on the directory ``path``; False (nothing
    mounted) where this process may not mount. Raises OSError on any other failure."""
    options = f"size={max(size_bytes, 1 << 20)},mode=0700,uid={owner[0]},gid={owner[1]}".encode()
    ret = _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV), options)
    if ret == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EPERM, errno.EACCES, errno.ENOSYS, errno.ENODEV):
        return False
    raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")


@functools.cache
def can_mount() -> bool:
    """Whether this process may mount a tmpfs (probed once per interpreter on a scratch directory)."""
    if os.geteuid() != 0:
        return False
    scratch = tempfile.mkdtemp(prefix="steadyrl-mount-probe-")
    try:
        if not mount_tmpfs(scratch, 1 << 20, (0, 0)):
            return False
        unmount(scratch)
        return True
    except OSError:
        return False
    finally:
        os.rmdir(scratch)


def unmount(path: str) -> None:
    """Detach the tmpfs mounted on ``path`` (its pages are freed once nothing holds a file of it open)."""
    if _libc().umount2(os.fsencode(path), ctypes.c_int(MNT_DETACH)) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # EINVAL: not a mount point (already gone)
            raise OSError(err, f"umount {path}: {os.strerror(err)}")
