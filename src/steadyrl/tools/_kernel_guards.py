"""Kernel guards of the sandbox's tool process: a Landlock domain and a seccomp filter, applied right before exec.

Not imported by the sandbox: this file's text is prepended to the supervisor's (``_supervisor.py``), and the two run
together as ``python -I -S -B -c <text> ...``. So it is stdlib only, Python ≥ 3.8 syntax, Linux only, has no relative or
steadyrl imports, prefixes every top-level name (``LL_``, ``SECCOMP_``, ``GUARDS_``; functions ``landlock_*``,
``apply_*``, ``seccomp_*``) so that none collides with the supervisor's, never prints, and raises :class:`OSError`
naming the system call and the kernel's reason on a real failure. Both guards need no_new_privs (or CAP_SYS_ADMIN)
and stay for every process the tool starts; neither can be lifted.

**Landlock** (:func:`apply_landlock`, kernel ABI 1..7; :func:`landlock_abi` says which one runs). Every filesystem
right the ABI knows is handled: outside the allowed paths nothing can be read, listed, executed, written, created,
removed, renamed or linked into another directory, truncated, or ioctl'ed (devices). Read paths (and what lies
beneath) may be read, listed and executed; write directories get every right; the device files may be read, written,
truncated and ioctl'ed. From ABI 4 TCP bind and connect are handled with no rule (no TCP at all); from ABI 6 the
domain is scoped: no signal to a process outside it and no connect to an abstract unix socket created outside it.
Not covered (no Landlock right exists for them): file descriptors opened before the domain (the stdout/stderr pipes),
pipes and sockets without a path, UDP and every protocol but TCP, and file metadata (stat, chmod, chown, utime,
xattrs).

**seccomp** (:func:`apply_seccomp`, x86_64 and aarch64: :func:`seccomp_arch_supported`). A classic BPF filter:
a system call of a foreign architecture (i386 ``int 0x80`` on x86_64) kills the process; an x32 call and every
call of :data:`SECCOMP_DENY` fails with EPERM (``clone3`` with ENOSYS so that glibc falls back to ``clone``, whose
flags the filter can read: ``clone`` fails with EPERM only when it asks for a new namespace); anything else is
allowed. The filter reads no pointer argument (it cannot), so its reasons are about whole calls.
"""

import ctypes
import errno
import os
import platform
import stat
import struct
import sys

GUARDS_LIBC = ctypes.CDLL(None, use_errno=True)
GUARDS_LIBC.syscall.restype = ctypes.c_long
GUARDS_LIBC.prctl.restype = ctypes.c_int

# ------------------------------------------------------------------------------------------------------- Landlock

#: System call numbers (the same on x86_64 and aarch64, and on every architecture with the generic table).
LL_SYS_CREATE_RULESET = 444
LL_SYS_ADD_RULE = 445
LL_SYS_RESTRICT_SELF = 446
LL_CREATE_RULESET_VERSION = 1
LL_RULE_PATH_BENEATH = 1
#: The newest ABI this module knows (7 adds only audit-log flags; 6's rights and scopes are the latest).
LL_KNOWN_ABI = 7

LL_FS_EXECUTE = 1 << 0
LL_FS_WRITE_FILE = 1 << 1
LL_FS_READ_FILE = 1 << 2
LL_FS_READ_DIR = 1 << 3
LL_FS_REMOVE_DIR = 1 << 4
LL_FS_REMOVE_FILE = 1 << 5
LL_FS_MAKE_CHAR = 1 << 6
LL_FS_MAKE_DIR = 1 << 7
LL_FS_MAKE_REG = 1 << 8
LL_FS_MAKE_SOCK = 1 << 9
LL_FS_MAKE_FIFO = 1 << 10
LL_FS_MAKE_BLOCK = 1 << 11
LL_FS_MAKE_SYM = 1 << 12
LL_FS_REFER = 1 << 13  # ABI 2
LL_FS_TRUNCATE = 1 << 14  # ABI 3
LL_FS_IOCTL_DEV = 1 << 15  # ABI 5
#: Rights ABI 1 knows: bits 0..12.
LL_FS_V1 = (1 << 13) - 1
#: The rights that apply to a file that is not a directory (the others on a file make landlock_add_rule fail).
LL_FS_FILE = LL_FS_EXECUTE | LL_FS_WRITE_FILE | LL_FS_READ_FILE | LL_FS_TRUNCATE | LL_FS_IOCTL_DEV
LL_NET_BIND_TCP = 1 << 0  # ABI 4
LL_NET_CONNECT_TCP = 1 << 1  # ABI 4
LL_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
LL_SCOPE_SIGNAL = 1 << 1  # ABI 6


def guards_syscall(name: str, nr: int, *args: object) -> int:
    """``syscall(nr, *args)`` (ints passed as C longs); its result, or :class:`OSError` naming ``name``."""
    ret = GUARDS_LIBC.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return ret


def landlock_abi() -> int:
    """The Landlock ABI version the kernel offers; 0 when it has none (not built: ENOSYS; off at boot: EOPNOTSUPP;
    refused by a container's own seccomp profile: EPERM)."""
    try:
        return guards_syscall("landlock_create_ruleset", LL_SYS_CREATE_RULESET, None, 0, LL_CREATE_RULESET_VERSION)
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
            return 0
        raise


def landlock_handled_fs(abi: int) -> int:
    """Every filesystem right ABI ``abi`` knows."""
    fs = LL_FS_V1
    fs |= LL_FS_REFER if abi >= 2 else 0
    fs |= LL_FS_TRUNCATE if abi >= 3 else 0
    fs |= LL_FS_IOCTL_DEV if abi >= 5 else 0
    return fs


def landlock_ruleset_attr(abi: int) -> bytes:
    """``struct landlock_ruleset_attr`` for ABI ``abi``, as long as that ABI knows it: handled_access_fs (8 bytes),
    + handled_access_net from ABI 4 (16), + scoped from ABI 6 (24)."""
    net = LL_NET_BIND_TCP | LL_NET_CONNECT_TCP if abi >= 4 else 0
    scoped = LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL if abi >= 6 else 0
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    return struct.pack("=QQQ", landlock_handled_fs(abi), net, scoped)[:size]


def landlock_allow(ruleset_fd: int, path: str, access: int) -> None:
    """Allow ``access`` (less the directory-only rights when ``path`` is no directory) beneath ``path``. A path that
    does not exist is skipped; one that cannot be opened otherwise (no search permission on a parent) raises."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return
        raise OSError(exc.errno, f"open({path}, O_PATH): {exc.strerror}") from None
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= LL_FS_FILE
        rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)  # packed landlock_path_beneath_attr
        guards_syscall(f"landlock_add_rule({path})", LL_SYS_ADD_RULE, ruleset_fd, LL_RULE_PATH_BENEATH, rule, 0)
    finally:
        os.close(fd)


def apply_landlock(read_paths: "list[str]", write_dirs: "list[str]", device_files: "list[str]") -> int:
    """Restrict this process (and whatever it starts) to ``read_paths`` (read, list, execute), ``write_dirs`` (every
    right) and ``device_files`` (read, write, truncate, ioctl); no TCP bind/connect (ABI ≥ 4); no signal or abstract
    unix connect out of the domain (ABI ≥ 6). Missing paths are skipped.

    Returns the ABI enforced (the kernel's, at most :data:`LL_KNOWN_ABI`), or 0 when the kernel has no Landlock (then
    nothing is done). Needs no_new_privs (or CAP_SYS_ADMIN): otherwise landlock_restrict_self fails with EPERM.
    """
    abi = min(landlock_abi(), LL_KNOWN_ABI)
    if abi == 0:
        return 0
    fs = landlock_handled_fs(abi)
    attr = landlock_ruleset_attr(abi)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset_fd = guards_syscall("landlock_create_ruleset", LL_SYS_CREATE_RULESET, buf, len(attr), 0)
    try:
        read = LL_FS_READ_FILE | LL_FS_READ_DIR | LL_FS_EXECUTE
        device = (LL_FS_READ_FILE | LL_FS_WRITE_FILE | LL_FS_TRUNCATE | LL_FS_IOCTL_DEV) & fs
        for paths, access in ((read_paths, read), (write_dirs, fs), (device_files, device)):
            for path in paths:
                landlock_allow(ruleset_fd, path, access)
        guards_syscall("landlock_restrict_self", LL_SYS_RESTRICT_SELF, ruleset_fd, 0)
    finally:
        os.close(ruleset_fd)
    return abi


# -------------------------------------------------------------------------------------------------------- seccomp

#: The calls the filter denies: name → (x86_64 number, aarch64 number, why). x86_64 numbers from the kernel's
#: arch/x86/entry/syscalls/syscall_64.tbl, aarch64 ones from include/uapi/asm-generic/unistd.h (None: the
#: architecture lacks the call). Denied with EPERM unless :data:`SECCOMP_ERRNO` says otherwise.
SECCOMP_DENY = {
    "socket": (41, 198, "network and unix sockets reach host services (socketpair stays allowed)"),
    "keyctl": (250, 219, "kernel keyrings persist past the call"),
    "add_key": (248, 217, "kernel keyrings persist past the call"),
    "request_key": (249, 218, "kernel keyrings persist past the call"),
    "shmget": (29, 194, "SysV IPC objects persist past the call"),
    "msgget": (68, 186, "SysV IPC objects persist past the call"),
    "semget": (64, 190, "SysV IPC objects persist past the call"),
    "memfd_create": (319, 279, "memory not counted by the rlimits"),
    "memfd_secret": (447, 447, "memory not counted by the rlimits"),
    "io_uring_setup": (425, 425, "io_uring runs operations without system calls the filter could see"),
    "io_uring_enter": (426, 426, "io_uring runs operations without system calls the filter could see"),
    "io_uring_register": (427, 427, "io_uring runs operations without system calls the filter could see"),
    "unshare": (272, 97, "nested namespaces"),
    "setns": (308, 268, "nested namespaces"),
    "clone3": (435, 435, "flags behind a pointer the filter cannot read; ENOSYS makes glibc fall back to clone"),
    "clone": (56, 220, "nested namespaces (denied only with a CLONE_NEW* flag)"),
    "ptrace": (101, 117, "cross-process access"),
    "process_vm_readv": (310, 270, "cross-process access"),
    "process_vm_writev": (311, 271, "cross-process access"),
    "pidfd_getfd": (438, 438, "cross-process access"),
    "kcmp": (312, 272, "cross-process access (compares another process's files, memory and other kernel objects)"),
    "setsid": (112, 157, "a new session is a new autogroup, which escapes the CPU share"),
    "sched_setscheduler": (144, 119, "the sandbox runs SCHED_IDLE"),
    "sched_setattr": (314, 274, "the sandbox runs SCHED_IDLE"),
    "bpf": (321, 280, "kernel attack surface"),
    "perf_event_open": (298, 241, "kernel attack surface, side channels"),
    "userfaultfd": (323, 282, "kernel attack surface (stalls kernel accesses at will)"),
    "mount": (165, 40, "mounts: the sandbox's filesystem layout is fixed"),
    "umount2": (166, 39, "mounts: the sandbox's filesystem layout is fixed"),
    "pivot_root": (155, 41, "mounts: the sandbox's filesystem layout is fixed"),
    "chroot": (161, 51, "mounts: the sandbox's filesystem layout is fixed"),
    "move_mount": (429, 429, "mounts: the sandbox's filesystem layout is fixed"),
    "open_tree": (428, 428, "mounts: the sandbox's filesystem layout is fixed"),
    "open_tree_attr": (467, 467, "mounts: the sandbox's filesystem layout is fixed"),
    "fsopen": (430, 430, "mounts: the sandbox's filesystem layout is fixed"),
    "fsmount": (432, 432, "mounts: the sandbox's filesystem layout is fixed"),
    "fspick": (433, 433, "mounts: the sandbox's filesystem layout is fixed"),
    "mount_setattr": (442, 442, "mounts: the sandbox's filesystem layout is fixed"),
    "open_by_handle_at": (304, 265, "opens files by handle, bypassing path checks"),
    "name_to_handle_at": (303, 264, "file handles (for open_by_handle_at)"),
    "fanotify_init": (300, 262, "filesystem-wide event monitoring"),
    "kexec_load": (246, 104, "host administration"),
    "kexec_file_load": (320, 294, "host administration"),
    "init_module": (175, 105, "host administration"),
    "finit_module": (313, 273, "host administration"),
    "delete_module": (176, 106, "host administration"),
    "swapon": (167, 224, "host administration"),
    "swapoff": (168, 225, "host administration"),
    "syslog": (103, 116, "the kernel log"),
    "acct": (163, 89, "host administration"),
    "reboot": (169, 142, "host administration"),
}
#: Calls denied with another errno than EPERM.
SECCOMP_ERRNO = {"clone3": errno.ENOSYS}
#: Column of each supported architecture in :data:`SECCOMP_DENY`.
SECCOMP_COLUMN = {"x86_64": 0, "aarch64": 1}
#: ``AUDIT_ARCH_*`` of each supported architecture (what ``seccomp_data.arch`` holds for its native calls).
SECCOMP_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
#: x86_64 calls with this bit in their number are x32 ABI calls.
SECCOMP_X32_BIT = 0x40000000
#: ``clone`` flags that create a namespace (CLONE_NEWTIME is read by clone3 and unshare only, both denied).
SECCOMP_CLONE_NS_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
#: Offsets in ``struct seccomp_data``: nr (u32), arch (u32), ip (u64), args[6] (u64; low word first: little-endian).
SECCOMP_OFF_NR, SECCOMP_OFF_ARCH, SECCOMP_OFF_ARG0 = 0, 4, 16
#: Classic BPF opcodes: BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_JMP|BPF_JSET|BPF_K, BPF_RET|BPF_K.
SECCOMP_LD_ABS, SECCOMP_JEQ, SECCOMP_JSET, SECCOMP_RET = 0x20, 0x15, 0x45, 0x06


class SeccompFilter(ctypes.Structure):
    """``struct sock_filter``: one classic BPF instruction."""

    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SeccompProg(ctypes.Structure):
    """``struct sock_fprog``: the program's length and its instructions."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SeccompFilter))]


def seccomp_arch() -> "str | None":
    """The supported architecture this interpreter's system calls use ("x86_64", "aarch64"), or None (another
    machine, a 32-bit interpreter, big-endian)."""
    machine = {"arm64": "aarch64"}.get(platform.machine(), platform.machine())
    native = ctypes.sizeof(ctypes.c_void_p) == 8 and sys.byteorder == "little"
    return machine if native and machine in SECCOMP_AUDIT_ARCH else None


def seccomp_arch_supported() -> bool:
    """Whether :func:`apply_seccomp` can filter this interpreter's system calls."""
    return seccomp_arch() is not None


def seccomp_numbers(arch: str) -> "dict[str, int]":
    """Each call of :data:`SECCOMP_DENY` that ``arch`` has → its number there."""
    column = SECCOMP_COLUMN[arch]
    return {name: row[column] for name, row in SECCOMP_DENY.items() if row[column] is not None}


def seccomp_program(arch: str) -> "list[tuple[int, int, int, int]]":
    """The filter for ``arch`` as (code, jt, jf, k) instructions; every jump skips at most 3 instructions."""
    deny_errno = SECCOMP_RET_ERRNO | errno.EPERM
    prog = [
        (SECCOMP_LD_ABS, 0, 0, SECCOMP_OFF_ARCH),
        (SECCOMP_JEQ, 1, 0, SECCOMP_AUDIT_ARCH[arch]),
        (SECCOMP_RET, 0, 0, SECCOMP_RET_KILL_PROCESS),  # a foreign architecture's call: its numbers differ
        (SECCOMP_LD_ABS, 0, 0, SECCOMP_OFF_NR),
    ]
    if arch == "x86_64":
        prog += [(SECCOMP_JSET, 0, 1, SECCOMP_X32_BIT), (SECCOMP_RET, 0, 0, deny_errno)]
    numbers = seccomp_numbers(arch)
    for name, nr in sorted(numbers.items(), key=lambda item: item[1]):
        if name != "clone":
            ret = SECCOMP_RET_ERRNO | SECCOMP_ERRNO.get(name, errno.EPERM)
            prog += [(SECCOMP_JEQ, 0, 1, nr), (SECCOMP_RET, 0, 0, ret)]
    prog += [
        (SECCOMP_JEQ, 0, 3, numbers["clone"]),
        (SECCOMP_LD_ABS, 0, 0, SECCOMP_OFF_ARG0),  # the low word of the flags
        (SECCOMP_JSET, 0, 1, SECCOMP_CLONE_NS_FLAGS),
        (SECCOMP_RET, 0, 0, deny_errno),
        (SECCOMP_RET, 0, 0, SECCOMP_RET_ALLOW),
    ]
    return prog


def apply_seccomp() -> None:
    """Install the filter (:func:`seccomp_program`) on this thread and whatever it starts afterwards.

    Raises :class:`OSError` on an unsupported architecture (check :func:`seccomp_arch_supported` first) and when the
    kernel refuses (no no_new_privs nor CAP_SYS_ADMIN: EACCES; no seccomp filters built in: EINVAL).
    """
    arch = seccomp_arch()
    if arch is None:
        bits = ctypes.sizeof(ctypes.c_void_p) * 8
        raise OSError(
            errno.EOPNOTSUPP,
            f"seccomp filter: {platform.machine()} ({bits}-bit, {sys.byteorder}-endian) is not supported, only 64-bit "
            f"little-endian {' and '.join(SECCOMP_AUDIT_ARCH)} (check seccomp_arch_supported() first)",
        )
    prog = seccomp_program(arch)
    insns = (SeccompFilter * len(prog))(*(SeccompFilter(*insn) for insn in prog))
    fprog = SeccompProg(len(prog), insns)
    u = ctypes.c_ulong
    option = ctypes.c_int(SECCOMP_PR_SET_SECCOMP)
    ret = GUARDS_LIBC.prctl(option, u(SECCOMP_MODE_FILTER), ctypes.byref(fprog), u(0), u(0))
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")
