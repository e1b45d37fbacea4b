"""The sandbox's supervisor: ``python -I -S -B -c <_kernel_guards.py + this> <fd>`` (started by the sandbox).

It reads the call's spec (JSON) from the pipe ``<fd>`` (so that no process of the call shows it in ``/proc``).

Not imported by steadyrl; its text is the program of a fresh interpreter with an empty environment, no inherited file
descriptors beyond stdout/stderr (the caller's capture pipes) and the status pipe, in a session of its own. Stdlib only,
Python ≥ 3.8 syntax, Linux only. It never writes to stdout/stderr (they belong to the tool code); everything it has to
say goes to the status pipe as JSON lines:

* ``{"event": "started"}`` the tool process was forked;
* ``{"event": "exit", "status": <wait status>, "cpu_s": <user+sys CPU seconds>}`` the tool process ended;
* ``{"event": "stopped", "reason": "timeout" | "terminated"}`` the supervisor killed the call (its wall-clock alarm,
  or SIGTERM from the caller: output cap or pool shutdown);
* ``{"event": "setup_error", "message": ...}`` the sandbox could not be built (an infrastructure failure, not a
  tool result).

Process tree, ``namespaces`` level::

    supervisor (outside the new pid namespace; enforces the wall clock)
      └─ init (pid 1 of new pid, net, ipc, uts namespaces; unshares a mount namespace and builds the read-only
         │     root; dies with the supervisor)
           └─ tool (pid 2; own user namespace; no capabilities, no_new_privs, rlimits; exec's the runner)

Started as root, the supervisor creates the namespaces in the initial user namespace, init stays root (so the tool
cannot signal or trace it), and the tool drops to the sandbox uid before entering a user namespace of its own.
Started as another user, the supervisor first unshares a user namespace that maps only that uid (the only mapping an
unprivileged process may write) and the tool nests one more. The tool's user namespace makes RLIMIT_NPROC count only
the call's processes and owns none of the other namespaces, so even a capability left behind could not remount,
reconfigure the network or signal init. When init exits, the kernel kills every process left in the pid namespace; the
namespace's mounts (the tmpfs working directory included) go with it.

Process tree, ``rlimits`` level: supervisor (child subreaper, stays root when started as root) → tool (own process
group, sandbox uid when root, rlimits, no_new_privs); after the tool exits or is killed, the supervisor kills and reaps
every remaining descendant (orphans are re-parented to it).
"""

import contextlib
import ctypes
import errno
import json
import os
import platform
import resource
import select
import signal
import sys
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_STRICTATIME = 1 << 24
MNT_DETACH = 2
ST_NOEXEC = 8
ST_NOATIME = 1024
ST_NODIRATIME = 2048
ST_RELATIME = 4096

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522

SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
#: Where init may mount the new root before pivoting into it (any directory of the host works; it is hidden only in
#: the sandbox's own mount namespace, and whatever the host has mounted below it is no part of the new root's mount
#: tree): the first of these that is no ancestor of a bind source (a tmpfs mounted on an ancestor would hide the
#: source, e.g. a venv under /tmp).
STAGE_CANDIDATES = ("/tmp", "/var/tmp", "/srv", "/media", "/opt", "/mnt", "/run", "/home")
STAGE = ""
#: The tool's working directory inside the sandbox (a tmpfs of its own; ``/tmp`` is a symlink to it).
WORKDIR = "/sandbox"
#: Device nodes bound into the sandbox's /dev.
DEVICES = ("null", "zero", "full", "random", "urandom")
#: Exit status of a process that failed while building the sandbox.
SETUP_EXIT = 126

libc = ctypes.CDLL(None, use_errno=True)
STATUS_FD = -1
CHILD_PID = 0
#: Pipe the supervisor holds the write end of: EOF on the read end means the supervisor is gone.
LIFE_R, LIFE_W = -1, -1


class CallStoppedError(Exception):
    """Raised by the signal handlers: the call must end now (``reason`` = "timeout" or "terminated")."""


def report(**event):
    os.write(STATUS_FD, (json.dumps(event) + "\n").encode())


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option, arg=0):
    u = ctypes.c_ulong
    return libc.prctl(ctypes.c_int(option), u(arg), u(0), u(0), u(0))


def mount(source, target, fstype, flags, data=None):
    enc = [None if s is None else os.fsencode(s) for s in (source, target, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {source} on {target}")


def set_death_signal():
    """Die with the parent (SIGKILL); exit now if it already died before the signal was armed."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if LIFE_R >= 0 and select.select([LIFE_R], [], [], 0)[0]:
        os._exit(SETUP_EXIT)


def forked():
    """In a child just forked from the supervisor: drop its copy of the life pipe's write end."""
    if LIFE_W >= 0:
        os.close(LIFE_W)


def on_signal(signum, frame):
    raise CallStoppedError("timeout" if signum == signal.SIGALRM else "terminated")


def drop_bounding_set():
    """Empty the capability bounding set: no exec can grant a capability again (needs CAP_SETPCAP; a process
    without it has nothing to drop)."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except OSError:
        last = 63  # dropping a capability the kernel does not know fails harmlessly
    for cap in range(last + 1):
        prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


def drop_capabilities():
    """Empty the effective, permitted and inheritable sets."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    data = (Data * 2)()
    check(libc.capset(ctypes.byref(Header(LINUX_CAPABILITY_VERSION_3, 0)), data), "capset")


def join_cgroup(procs_files):
    """Move this process into the call's cgroup (one ``cgroup.procs`` per hierarchy) before it starts anything."""
    for path in procs_files:
        with open(path, "w") as f:
            f.write(str(os.getpid()))


def count_tasks(uid):
    """Tasks (threads included: RLIMIT_NPROC counts them) whose real uid is ``uid``."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return total


def exec_tool(cfg, *, workdir, code_path, nproc, drop_to, own_userns):
    """In the forked tool process: credentials, limits, capabilities, then exec the runner. Never returns.

    ``own_userns``: move into a user namespace of its own first, so that RLIMIT_NPROC counts only this call's
    processes, and so that whatever capabilities remain apply to nothing the sandbox is made of (the mount, pid and
    network namespaces belong to the parent user namespace).
    """
    try:
        for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        if drop_to is not None:
            drop_bounding_set()  # while root: no exec can regain a capability of the initial namespace
            os.setgroups([])
            os.setresgid(drop_to[1], drop_to[1], drop_to[1])
            os.setresuid(drop_to[0], drop_to[0], drop_to[0])
        if own_userns:
            prctl(PR_SET_DUMPABLE, 1)  # a uid change clears it; /proc/self/uid_map is writable only when dumpable
            uid, gid = os.getuid(), os.getgid()
            check(libc.unshare(ctypes.c_int(CLONE_NEWUSER)), "unshare(CLONE_NEWUSER)")
            write_id_maps(uid, gid)
            prctl(PR_SET_DUMPABLE, 0)
        os.chdir(workdir)
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        low = 3  # keep 0-2, the status pipe (to report a failure) and the life pipe; both are close-on-exec
        for keep in sorted(fd for fd in (STATUS_FD, LIFE_R) if fd >= 3):
            os.closerange(low, keep)
            low = keep + 1
        os.closerange(low, 1 << 16)
        lim = cfg["limits"]
        limits = [
            (resource.RLIMIT_AS, lim["memory_bytes"]),
            (resource.RLIMIT_CPU, lim["cpu_s"]),
            (resource.RLIMIT_NPROC, nproc),
            (resource.RLIMIT_FSIZE, lim["file_bytes"]),
            (resource.RLIMIT_NOFILE, lim["nofile"]),
            (resource.RLIMIT_CORE, 0),
        ]
        for which, soft in limits:
            hard = soft + 1 if which == resource.RLIMIT_CPU else soft  # SIGXCPU at soft, SIGKILL at hard
            resource.setrlimit(which, (soft, hard))
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # below every normal task; seccomp keeps it so
        drop_bounding_set()  # (again) the new user namespace starts with a full bounding set
        drop_capabilities()
        check(prctl(PR_SET_NO_NEW_PRIVS, 1), "prctl(NO_NEW_PRIVS)")
        # the kernel guards (_kernel_guards.py, whose text precedes this file's in the program): Landlock is a no-op
        # where the kernel lacks it; seccomp is applied on every architecture it knows
        guards = cfg["guards"]
        apply_landlock(guards["read"], guards["write"], guards["devices"])  # noqa: F821
        if seccomp_arch_supported():  # noqa: F821
            apply_seccomp()  # noqa: F821
        set_death_signal()  # last: every credential change above clears it
        argv = [cfg["python"], *cfg["python_flags"], "-c", cfg["runner"], code_path, workdir, *cfg["runner_args"]]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        os.execve(cfg["python"], argv, env)
    except BaseException:  # report whatever went wrong, then die
        try:
            report(event="setup_error", message=traceback.format_exc())
        finally:
            os._exit(SETUP_EXIT)


# ---------------------------------------------------------------------------------------------------- namespaces


def write_id_maps(uid, gid):
    """Map ``uid``/``gid`` to themselves in the user namespace just entered (the only mapping an unprivileged
    process may write)."""
    for name, text in (
        ("uid_map", f"{uid} {uid} 1\n"),
        ("setgroups", "deny"),
        ("gid_map", f"{gid} {gid} 1\n"),
    ):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)


def unescape_mount_point(field):
    """A mount point of /proc/self/mountinfo as a path: the kernel writes space, tab, newline and backslash as
    ``\\ooo`` and leaves every other byte as it is (so the file is read as bytes: a host path need not be UTF-8)."""
    parts = field.split(b"\\")
    out = [parts[0]]
    for part in parts[1:]:
        if len(part) >= 3 and all(48 <= c <= 55 for c in part[:3]):  # three octal digits
            out.append(bytes([int(part[:3], 8)]) + part[3:])
        else:
            out.append(b"\\" + part)
    return os.fsdecode(b"".join(out))


def mount_id(path):
    """The ID (as /proc/self/mountinfo numbers mounts) of the mount ``path`` leads to."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    finally:
        os.close(fd)
    raise OSError(errno.ENOSYS, "/proc/self/fdinfo shows no mnt_id (Linux >= 3.15 needed)")


def mounts_below(top):
    """The mounts of the tree rooted at the mount ``top`` (an ID), ``top`` excluded: ``[(id, mount point)]``.

    Found by following parent IDs, never by path: a mount the host has below the stage's path is no child of the stage
    (its parent is the host mount it was made on) and is neither listed here nor reachable from the new root."""
    parents, points = {}, {}
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            mid = int(fields[0])
            parents[mid], points[mid] = int(fields[1]), unescape_mount_point(fields[4])
    inside = {top}
    grew = True
    while grew:  # mountinfo need not list a parent before its children
        grew = False
        for mid, parent in parents.items():
            if parent in inside and mid not in inside:
                inside.add(mid)
                grew = True
    return [(mid, points[mid]) for mid in parents if mid in inside and mid != top]


def remount_read_only(path):
    """Remount a bind mount read-only, nosuid, nodev, keeping the flags a user namespace may not clear."""
    have = os.statvfs(path).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    flags |= MS_NOEXEC if have & ST_NOEXEC else 0
    flags |= MS_NODIRATIME if have & ST_NODIRATIME else 0
    if have & ST_NOATIME:
        flags |= MS_NOATIME
    elif not have & ST_RELATIME:
        flags |= MS_STRICTATIME
    mount(None, path, None, flags)


def make_node(path, directory):
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if directory:
        os.makedirs(path, mode=0o755, exist_ok=True)
    elif not os.path.exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


def pick_stage(binds):
    """The first existing directory of ``STAGE_CANDIDATES`` that is no bind source's ancestor (nor one of them)."""
    for cand in STAGE_CANDIDATES:
        hides = any(b == cand or b.startswith(cand.rstrip("/") + "/") for b in binds)
        if os.path.isdir(cand) and not os.path.islink(cand) and not hides:
            return cand
    raise OSError(errno.ENOENT, "no directory to stage the sandbox root in: all of " + ", ".join(STAGE_CANDIDATES)
                  + " are missing or hold a bind source")


def build_root(cfg, code):
    """In init: a tmpfs root holding read-only binds of the interpreter and system directories, /dev nodes, /proc,
    a tmpfs WORKDIR (the working directory; /tmp points there), the code at /.tool.py; pivot into it and drop the
    host's tree."""
    global STAGE
    STAGE = pick_stage(cfg["binds"])
    check(libc.unshare(ctypes.c_int(CLONE_NEWNS)), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing propagates back to the host
    mount("tmpfs", STAGE, "tmpfs", MS_NOSUID | MS_NODEV, f"size={len(code) + (1 << 20)},mode=0755")
    stage_id = mount_id(STAGE)
    for path, target in cfg["symlinks"]:
        os.symlink(target, STAGE + path)
    # the working directory is a tmpfs of its own at WORKDIR; /tmp leads there too, unless a bind lives under /tmp
    # (a venv under /tmp): then /tmp is a read-only directory holding that bind
    make_node(STAGE + WORKDIR, True)
    mount("tmpfs", STAGE + WORKDIR, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['limits']['disk_bytes']},mode=0700")
    workdir_id = mount_id(STAGE + WORKDIR)
    if not any(b == "/tmp" or b.startswith("/tmp/") for b in cfg["binds"]):
        os.symlink(WORKDIR, STAGE + "/tmp")
    for path in cfg["binds"]:
        make_node(STAGE + path, os.path.isdir(path))
        mount(path, STAGE + path, None, MS_BIND | MS_REC)
    # every bind and any submount it brought along: the stage's own mount tree, by mount ID (the host's mounts below
    # the stage's path, hidden under its tmpfs, are not part of it and are dropped with the old root)
    for mid, point in mounts_below(stage_id):
        if mid == workdir_id:
            continue
        try:
            reachable = mount_id(point) == mid
        except FileNotFoundError:
            reachable = False
        if reachable:
            remount_read_only(point)
        # else a later mount of the tree covers it (a host submount of a bound directory that the host mounted over):
        # no path of the sandbox leads to it
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            make_node(STAGE + "/dev/" + name, False)
            mount("/dev/" + name, STAGE + "/dev/" + name, None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, STAGE + "/dev/" + name)
    make_node(STAGE + "/proc", True)
    mount("proc", STAGE + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this pid namespace's processes only
    with open(STAGE + "/.tool.py", "wb") as f:
        f.write(code)
    os.chdir(STAGE)
    nr = SYS_PIVOT_ROOT[platform.machine()]
    check(libc.syscall(ctypes.c_long(nr), b".", b"."), "pivot_root")
    check(libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    name = b"sandbox"
    check(libc.sethostname(name, ctypes.c_size_t(len(name))), "sethostname")


def run_init(cfg, code, drop_to):
    """pid 1 of the sandbox: build the root, fork the tool, reap until it exits, report, exit (killing the rest)."""
    try:
        for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)  # pid 1 then ignores every signal sent from inside the namespace
        forked()
        set_death_signal()
        build_root(cfg, code)
        if drop_to is not None:  # the tool's tmpfs working directory belongs to the uid it runs as
            os.chown(WORKDIR, drop_to[0], drop_to[1])
        pid = os.fork()
        if pid == 0:
            os.setsid()
            exec_tool(
                cfg,
                workdir=WORKDIR,
                code_path="/.tool.py",
                nproc=cfg["limits"]["max_procs"],
                drop_to=drop_to,
                own_userns=True,
            )
        report(event="started")
        while True:
            done, status, usage = os.wait4(-1, 0)
            if done == pid:
                report(event="exit", status=status, cpu_s=usage.ru_utime + usage.ru_stime)
                os._exit(0)
    except BaseException:
        report(event="setup_error", message=traceback.format_exc())
        os._exit(SETUP_EXIT)


def run_namespaces(cfg):
    """As root: new pid/net/ipc/uts namespaces of the initial user namespace (init builds the root as real root,
    the tool drops to the sandbox uid). Otherwise: a user namespace mapping only the caller's uid, with the rest."""
    global CHILD_PID
    with open(cfg["code_path"], "rb") as f:
        code = f.read()
    flags = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(ctypes.c_int(flags if root else flags | CLONE_NEWUSER)), "unshare(user, pid, net, ipc, uts)")
    if not root:
        write_id_maps(uid, gid)
    pid = os.fork()
    if pid == 0:
        run_init(cfg, code, (cfg["sandbox_uid"], cfg["sandbox_gid"]) if cfg["sandbox_uid"] >= 0 else None)
    CHILD_PID = pid
    os.waitpid(pid, 0)
    CHILD_PID = 0


def stop_namespaces():
    if CHILD_PID:
        os.kill(CHILD_PID, signal.SIGKILL)  # init dies → the kernel kills the whole pid namespace
        os.waitpid(CHILD_PID, 0)


# ---------------------------------------------------------------------------------------------------- rlimits


def children():
    """Pids whose parent is this process (orphans re-parent here: this process is a child subreaper)."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == me:
                    found.append(int(name))
            except (OSError, ValueError):
                continue
    return found


def sweep():
    """Kill and reap every descendant: killing one re-parents its children here, so repeat until none is left."""
    while True:
        pids = children()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG if pids else 0)[0]:
                pass
        except ChildProcessError:
            return


def run_rlimits(cfg):
    global CHILD_PID
    check(prctl(PR_SET_CHILD_SUBREAPER, 1), "prctl(CHILD_SUBREAPER)")
    drop_to = (cfg["sandbox_uid"], cfg["sandbox_gid"]) if cfg["sandbox_uid"] >= 0 else None
    uid = drop_to[0] if drop_to else os.getuid()
    # RLIMIT_NPROC counts every task of the uid on the machine: allow max_procs more than it runs now.
    nproc = count_tasks(uid) + cfg["limits"]["max_procs"]
    pid = os.fork()
    if pid == 0:
        forked()
        os.setpgid(0, 0)
        exec_tool(
            cfg, workdir=cfg["workdir"], code_path=cfg["code_path"], nproc=nproc, drop_to=drop_to, own_userns=False
        )
    CHILD_PID = pid
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also here: no window in which a kill of the group misses the child
    report(event="started", pid=pid)
    _, status, usage = os.wait4(pid, 0)
    CHILD_PID = 0
    report(event="exit", status=status, cpu_s=usage.ru_utime + usage.ru_stime)
    stop_rlimits(pid)


def stop_rlimits(pid=None):
    pid = pid or CHILD_PID
    if pid:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)
    sweep()


def main():
    global STATUS_FD, LIFE_R, LIFE_W
    spec_fd = int(sys.argv[1])  # the spec comes through a pipe (argv would show it to the code, in /proc/1/cmdline)
    chunks = []
    while True:
        chunk = os.read(spec_fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(spec_fd)
    cfg = json.loads(b"".join(chunks))
    STATUS_FD = cfg["status_fd"]
    os.set_inheritable(STATUS_FD, False)
    LIFE_R, LIFE_W = os.pipe()
    namespaces = cfg["mode"] == "namespaces"
    try:
        join_cgroup(cfg["cgroup_procs"])
        # this session's autogroup (the call's) weighs least against the caller's
        with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
            f.write("19")
        signal.signal(signal.SIGALRM, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        signal.setitimer(signal.ITIMER_REAL, cfg["timeout_s"])
        try:
            run_namespaces(cfg) if namespaces else run_rlimits(cfg)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except CallStoppedError as stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_namespaces() if namespaces else stop_rlimits()
        report(event="stopped", reason=str(stop))
    except BaseException:
        report(event="setup_error", message=traceback.format_exc())
        stop_namespaces() if namespaces else stop_rlimits()
        os._exit(SETUP_EXIT)


if __name__ == "__main__":
    main()
