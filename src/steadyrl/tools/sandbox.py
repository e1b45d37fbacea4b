"""Run model-written Python in a sandbox: :func:`run_python` (one call) and :class:`SandboxPool` (N calls at once).

Each call is a fresh interpreter started with an empty environment, no inherited file descriptors besides its
stdout/stderr pipes, stdin at ``/dev/null``, in a session of its own, under a supervisor process that enforces the
wall-clock limit and removes every process of the call afterwards; a fresh working directory is created for it and
deleted after it. The parent reads stdout and stderr incrementally and kills the call once they pass the output cap.
Nothing the code does ends the caller: every outcome is a :class:`ToolResult` (``error`` names what went wrong).
Neither does a failure of one call's machinery (its code cannot be encoded or is too long, its directory cannot be
made or removed, its supervisor cannot start or reports a setup error, its output cannot be read): that call's result
says ``error="internal_error"`` with the reason in its stderr, and the other calls of a :meth:`SandboxPool.map` are
unaffected. Only a sandbox that cannot be built at all (when :func:`run_python` or a :class:`SandboxPool` starts)
raises :class:`SandboxUnavailableError`. Linux only.

Isolation levels (``SandboxConfig.isolation``), strongest first; ``auto`` takes ``namespaces`` when a probe call
succeeds (the result is cached per interpreter) and otherwise **fails closed**: :class:`SandboxUnavailableError`
naming what is missing and the explicit opt-in ``isolation="rlimits"`` (never a silent downgrade).

**Every level** (where the kernel offers them; :func:`sandbox_layers` says which hold here). The tool process, right
before it execs the interpreter, is confined by :mod:`steadyrl.tools._kernel_guards` — a Landlock domain (read only the
interpreter's and system directories, write only the working directory and the harmless devices; no TCP; from ABI 6
no signal and no abstract unix socket outside the domain) and a seccomp filter (no ``socket()``, keyrings, System V
IPC, memfd, io_uring, new namespaces, ptrace or process_vm_*, ``setsid``, scheduler changes, mounts, ...) — and
runs SCHED_IDLE; the supervisor's session (one autogroup per call) has nice 19. Started as root, steadyrl gives each
running call a uid (and gid) of its own (:mod:`steadyrl.tools.uids`; ``SandboxConfig.uid_base``) and, where a
cgroup hierarchy is writable, a cgroup of its own (:mod:`steadyrl.tools.cgroups`: memory of the whole call, shared
memory and tmpfs included; processes; one CPU; all calls together weigh a quarter of one busy task of the caller's);
after the call every process, shared-directory file and System V IPC object of that uid is removed, and the cgroup.
The call's spec reaches its supervisor through a pipe, so no process of the call shows host paths in ``/proc``.

**namespaces** (needs unprivileged user namespaces, or root; verified here both as root and as uid 65534). The code
runs in new pid, network, mount, ipc and uts namespaces and a user namespace of its own; as root the namespaces belong
to the initial user namespace and the code's process drops to the call's uid first, otherwise they belong to a user
namespace mapping only the caller's uid. Guaranteed by the kernel:

* no network: the network namespace has no interface up, not even loopback (and seccomp refuses ``socket()``);
* no view of, and no signal to, any process outside the call: the pid namespace holds only the call's processes
  (``os.getppid()`` is the namespace's init, which ignores signals sent from inside);
* the filesystem is a fresh tmpfs root with read-only binds of ``/usr``, ``/bin``, ``/lib*``, ``/sbin``, the
  interpreter's prefix and paths, ``/etc/ld.so.*``, ``/etc/localtime``, the devices null/zero/full/random/urandom,
  a private ``/proc``, and a private tmpfs ``/sandbox`` (the working directory, ``max_file_mb`` large; ``/tmp``
  points to it) — so the project, home directories, the host's ``/tmp`` and environment files are invisible and
  nothing outside ``/sandbox`` is writable;
* no capabilities (bounding, ambient, effective, permitted and inheritable sets emptied), no_new_privs: no setuid
  binary, no mount, no way to undo the above;
* RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE = 0, and RLIMIT_NPROC counted inside the user
  namespace (so ``max_procs`` is per call);
* when the call's main process exits, is killed by the timeout, or the supervisor dies, the namespace's init exits
  and the kernel kills every process left in it: nothing outlives the call.

Not guaranteed: the system calls seccomp allows are the kernel's attack surface (a kernel bug there is an escape);
without a writable cgroup hierarchy (not root, or cgroup v2 without delegated controllers) memory and CPU are bounded
per process only (rlimits, SCHED_IDLE, the autogroup's nice); the read-only binds expose whatever world-readable files
``/usr`` and the interpreter's directories hold (Landlock lets them be read, not listed beyond them).

The audit hook of the ``rlimits`` level (below) runs here too, as defense in depth, with one difference: when
``site_packages=True`` it lets ``ctypes.*`` events through, because ``import numpy`` and ``import sympy`` load ctypes
(numpy dlopens through it) and would otherwise end every such call with ``error="blocked"``. That costs nothing the
kernel guarantees above: code calling C through ctypes is still one unprivileged process in these namespaces, under
these rlimits and guards (the same reach as a child process, which the hook never saw). With ``site_packages=False``
(nothing needs ctypes) and at the ``rlimits`` level ctypes stays blocked; sockets are blocked at every level.

**rlimits** (any Linux; opt in by name). The code runs as a plain child process with the same rlimits, no_new_privs and
kernel guards; the supervisor is a child subreaper and kills every descendant after the call. Started as root, the
call's directory and code file stay root's (the call's group may read the code and pass through to its working
directory, which alone is handed to the call's uid, through a descriptor), a tmpfs of ``max_file_mb`` is mounted on
the working directory where root may mount (the call's disk quota), and the cleanup works through descriptors, never
following a symlink nor touching anything outside the call's directory. An audit hook (PEP 578, per thread) in the
interpreter ends the call (``error="blocked"``) on sockets, ctypes, ``os.kill`` outside its process group and writes
outside the working directory. Not guaranteed: without Landlock (kernels before 5.13 or with the LSM off) a child
process can read every world-readable file and write wherever the uid may; without root all calls run as the caller's
uid (Landlock from ABI 6 still keeps their signals and files apart; without it they can reach each other and the
caller); ``max_procs`` is counted against every task of the uid (the limit is what the uid runs at the start of the
call plus ``max_procs``).

Error kinds: ``None`` (exit status 0), ``"timeout"`` (the wall clock passed ``timeout_s``, or the pool was closed),
``"memory"`` (a MemoryError reached the top level, or the kernel killed a process at the call's cgroup memory
limit), ``"cpu"`` (killed by SIGXCPU/SIGKILL at the CPU limit), ``"output_limit"`` (stdout + stderr passed
``max_output_bytes``), ``"blocked"`` (the audit hook ended it), ``"crash"`` (any other nonzero exit or signal: an
uncaught exception, a syntax error, ``sys.exit(1)``, a segfault), ``"internal_error"`` (the sandbox could not run or
clean up this one call: see above; ``returncode`` is −1).
Confidence: [exact] (no paper formula; the guarantees are those of the Linux mechanisms named above).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from steadyrl.tools import _kernel_guards, cgroups, mounts, uids
from steadyrl.tools.config import SandboxConfig

#: What ended a call badly (None: it exited with status 0).
ErrorKind = Literal["timeout", "memory", "cpu", "output_limit", "crash", "blocked", "internal_error"]

#: Device files the code may open (read and write): nothing they hold is the host's.
DEVICE_FILES: tuple[str, ...] = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
#: Longest code accepted (bytes, UTF-8).
MAX_CODE_BYTES: int = 1 << 20
#: Longest spec a call's supervisor reads from its pipe (bytes: what the pipe holds, written before it starts).
MAX_SPEC_BYTES: int = 60_000
#: Return code of an ``internal_error`` result (no process of the call reported an exit status).
INTERNAL_ERROR_RETURNCODE: int = -1
#: Longest reason quoted in the stderr of an ``internal_error`` result (characters).
MAX_REASON_CHARS: int = 300
#: Exit statuses of the runner: ended by the audit hook / by a MemoryError.
BLOCKED_EXIT: int = 120
MEMORY_EXIT: int = 121
#: The parent kills the whole call this long after ``timeout_s`` if the supervisor has not ended it by then.
BACKSTOP_S: float = 2.0
#: After the supervisor exits, how long the parent keeps reading pipes still held open.
DRAIN_S: float = 0.5
#: Open files per process.
NOFILE: int = 256
#: Directories bound read-only into the namespaces root (a symlink among them is recreated as the same symlink).
SYSTEM_DIRS: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES: tuple[str, ...] = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
#: Limits of the probe call that decides ``isolation="auto"``.
PROBE_CONFIG = SandboxConfig(timeout_s=60.0, cpu_s=30)

_HERE = Path(__file__).parent
#: The supervisor's program: the kernel guards (applied by the tool process before its exec), then the supervisor.
_SUPERVISOR = (_HERE / "_kernel_guards.py").read_text() + "\n\n" + (_HERE / "_supervisor.py").read_text()
_RUNNER = (_HERE / "_runner.py").read_text()
_INFO = (
    "import json, sys; print(json.dumps({'version': list(sys.version_info[:2]), "
    "'paths': [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path]}))"
)


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot be built on this machine at the requested isolation level (not an outcome of the code)."""


@dataclass(frozen=True)
class ToolResult:
    """Outcome of one call.

    Attributes:
        stdout, stderr: what the code printed (UTF-8, undecodable bytes replaced), cut at the output cap.
        truncated: the output passed ``max_output_bytes`` (then ``error == "output_limit"``).
        returncode: exit status of the code's process, or −signal when a signal ended it (−9 when the sandbox
            killed the call); −1 for ``error == "internal_error"``.
        error: None on exit status 0, else the kind of failure (see the module docstring).
        duration_s: wall-clock seconds from starting the sandbox to its end.
        isolation: the level the call ran at ("namespaces" or "rlimits").
    """

    stdout: str
    stderr: str
    truncated: bool
    returncode: int
    error: ErrorKind | None
    duration_s: float
    isolation: str

    @property
    def ok(self) -> bool:
        """The code exited with status 0."""
        return self.error is None


@dataclass(frozen=True)
class _Interpreter:
    """How to start the code's interpreter: the path to exec, its flags, and what the namespaces root must hold."""

    executable: str
    flags: tuple[str, ...]
    binds: tuple[str, ...]
    symlinks: tuple[tuple[str, str], ...]


def _is_under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@functools.cache
def _interpreter(python: str | None, site_packages: bool) -> _Interpreter:
    given = python or sys.executable
    if not os.path.isabs(given) or not os.access(given, os.X_OK):
        raise SandboxUnavailableError(f"SandboxConfig.python must be an executable absolute path, got {given!r}")
    executable = os.path.join(os.path.realpath(os.path.dirname(given)), os.path.basename(given))
    flags = ("-I", "-B", "-u", "-X", "utf8") if site_packages else ("-I", "-S", "-B", "-u", "-X", "utf8")
    probe = subprocess.run([executable, *flags, "-c", _INFO], capture_output=True, text=True, env={}, timeout=60)
    if probe.returncode != 0:
        raise SandboxUnavailableError(f"cannot start {executable}: {probe.stderr.strip()[-500:]}")
    info = json.loads(probe.stdout)
    if tuple(info["version"]) < (3, 8):
        raise SandboxUnavailableError(
            f"{executable} is Python {info['version']}; the sandbox needs >= 3.8 (audit hooks)"
        )
    symlinks = tuple((d, os.readlink(d)) for d in SYSTEM_DIRS if os.path.islink(d))
    binds = [d for d in SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    binds += [f for f in SYSTEM_FILES if os.path.exists(f)]
    extra = {os.path.realpath(p) for p in info["paths"] if p and os.path.exists(p)}
    own = _own_source_dir()  # an editable checkout's src/ is on sys.path; the code needs none of it
    extra.discard(own)  # the entry itself only: a virtual environment inside the checkout stays bound
    extra |= {os.path.dirname(executable), os.path.dirname(os.path.realpath(executable))}
    for path in sorted(extra, key=len):  # shortest first, so a directory covers what lies below it
        if not _is_under(path, binds) and path != "/":
            binds.append(path)
    return _Interpreter(executable, flags, tuple(binds), symlinks)


def _own_source_dir() -> str | None:
    """The directory that holds the ``steadyrl`` package when it runs from a source checkout (``src/`` of an editable
    install), so that the namespaces level does not bind the repository's source into the sandbox; None when steadyrl
    is an installed package (its directory is then a site-packages the code may need)."""
    package = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # .../steadyrl of .../steadyrl/tools
    parent = os.path.dirname(package)
    return None if os.path.basename(parent) in ("site-packages", "dist-packages") else parent


@dataclass(frozen=True)
class SandboxLayers:
    """Which of the sandbox's mechanisms hold on this machine for calls under one config (docs/tools.md, "Isolation
    levels"). Attributes:
        isolation: the level calls run at.
        landlock_abi: the Landlock ABI the tool process is confined by (0: the kernel has none).
        seccomp: the seccomp filter is applied (x86_64 and aarch64).
        cgroups: 1 or 2 when every call runs in a cgroup of its own (:mod:`steadyrl.tools.cgroups`), else None.
        uid_per_call: each running call's code has a uid of its own (steadyrl runs as root).
        disk_quota: one quota covers everything the call writes (namespaces: its tmpfs; rlimits: a tmpfs mounted on
            its working directory, which needs root allowed to mount).
    """

    isolation: str
    landlock_abi: int
    seccomp: bool
    cgroups: int | None
    uid_per_call: bool
    disk_quota: bool


def sandbox_layers(config: SandboxConfig) -> SandboxLayers:
    """The mechanisms calls under ``config`` get here (resolves the level first; see :class:`SandboxLayers`)."""
    mode = resolve_isolation(config)
    found = cgroups.layout()
    return SandboxLayers(
        isolation=mode,
        landlock_abi=_kernel_guards.landlock_abi(),
        seccomp=_kernel_guards.seccomp_arch_supported(),
        cgroups=found.version if found is not None else None,
        uid_per_call=os.geteuid() == 0,
        disk_quota=mode == "namespaces" or mounts.can_mount(),
    )


def resolve_isolation(config: SandboxConfig) -> Literal["namespaces", "rlimits"]:
    """The isolation level calls under ``config`` run at (probes once per interpreter; see the module docstring)."""
    return _resolve(config.isolation, config.python, config.site_packages)


@functools.cache
def _resolve(isolation: str, python: str | None, site_packages: bool) -> Literal["namespaces", "rlimits"]:
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailableError(f"the Python tool sandbox needs Linux (this is {sys.platform})")
    _interpreter(python, site_packages)  # a bad interpreter is reported as such, not as a missing isolation level
    probe = PROBE_CONFIG.model_copy(update={"python": python, "site_packages": site_packages})
    if isolation in ("auto", "namespaces"):
        problem = _probe(probe, "namespaces")
        if problem is None:
            return "namespaces"
        if isolation == "namespaces":
            raise SandboxUnavailableError(f"isolation='namespaces' is not available here: {problem}")
        lost = " numpy, sympy and anything else loading ctypes end with error='blocked' there;" if site_packages else ""
        raise SandboxUnavailableError(  # fail closed: never a silent downgrade to the weaker level
            f"isolation='auto' needs Linux namespaces for the tool sandbox, and they are not available here "
            f"({problem.splitlines()[-1]}). Enable unprivileged user namespaces (kernel.unprivileged_userns_clone=1, "
            "or a container run with user namespaces allowed), or opt in to the weaker level explicitly with "
            f"tools.sandbox.isolation=rlimits (resource limits, a uid drop as root and an audit hook only;{lost} what "
            "it does not protect: docs/tools.md, 'Isolation levels')"
        )
    problem = _probe(probe, "rlimits")
    if problem is not None:
        hint = ""
        if os.geteuid() == 0:
            hint = (
                "\n(as root, the code runs as a uid of its own (from SandboxConfig.uid_base), which must be able to "
                "read the interpreter: set SandboxConfig.python, e.g. to /usr/bin/python3)"
            )
        raise SandboxUnavailableError(f"isolation='rlimits' is not available here: {problem}{hint}")
    return "rlimits"


def _probe(config: SandboxConfig, mode: str) -> str | None:
    """None when a trivial call runs at ``mode``, else what went wrong."""
    try:
        result = _run("print(6 * 7)", config, mode, None)
    except SandboxUnavailableError as exc:
        return str(exc)
    if result.ok and result.stdout == "42\n":
        return None
    return f"the probe call ended with error={result.error}, stdout={result.stdout!r}, stderr={result.stderr[-500:]!r}"


def run_python(code: str, *, limits: SandboxConfig | None = None) -> ToolResult:
    """Run ``code`` in a fresh sandbox under ``limits`` (default :class:`SandboxConfig`) and wait for it.

    Code that cannot run (longer than ``MAX_CODE_BYTES``, not encodable as UTF-8) or any other failure of this call's
    sandbox machinery is returned as a result with ``error="internal_error"``.

    Raises:
        SandboxUnavailableError: the requested isolation level cannot be built here.
    """
    config = limits or SandboxConfig()
    return _run_contained(code, config, resolve_isolation(config), None)


@dataclass
class _LiveCalls:
    """Supervisors of running calls, so that closing a pool can end them (SIGTERM: the supervisor cleans up)."""

    procs: set[subprocess.Popen[bytes]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closing: bool = False

    def add(self, proc: subprocess.Popen[bytes]) -> None:
        with self.lock:
            self.procs.add(proc)
            if self.closing:
                proc.send_signal(signal.SIGTERM)

    def discard(self, proc: subprocess.Popen[bytes]) -> None:
        with self.lock:
            self.procs.discard(proc)

    def terminate_all(self) -> None:
        with self.lock:
            self.closing = True
            for proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)


def _encode_code(code: str) -> bytes:
    """``code`` as the UTF-8 bytes of the code file; ValueError when it is not text, not encodable or too long."""
    if not isinstance(code, str):
        raise ValueError(f"tool code must be a str, got {type(code).__name__}")
    try:
        data = code.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = code[exc.start : exc.end]
        raise ValueError(f"tool code is not valid UTF-8 text: {bad!r} at position {exc.start} ({exc.reason})") from None
    if len(data) > MAX_CODE_BYTES:
        raise ValueError(f"tool code is longer than MAX_CODE_BYTES={MAX_CODE_BYTES}")
    return data


@dataclass
class _CallDir:
    """A call's private temporary directory (``tmp``), its code file, its working directory and whether a tmpfs of
    the call's disk quota is mounted on that working directory."""

    tmp: str
    code_path: str
    workdir: str
    mounted: bool = False


def _open_nofollow_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _prepare_dir(code: bytes, mode: str, owner: tuple[int, int] | None = None, disk_bytes: int = 0) -> _CallDir:
    """A private temporary directory holding the code file and (rlimits level) the working directory; removed again
    when it cannot be completed.

    ``owner`` (rlimits level as root: the call's uid and gid): the directory and the code file stay root's (group
    ``owner``'s gid, no write permission for it), and only the working directory is handed to ``owner`` — a tmpfs of
    ``disk_bytes`` mounted there with that owner where root may mount, else the directory itself, changed through a
    descriptor opened without following symlinks. Nothing the code may write exists until the last step, so no
    root operation ever acts on a path the code could have replaced."""
    tmp = tempfile.mkdtemp(prefix="steadyrl-tool-")  # 0700, ours: nobody else can enter it yet
    made = _CallDir(tmp, os.path.join(tmp, "tool.py"), os.path.join(tmp, "work"))
    try:
        fd = os.open(made.code_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.write(code)
            if owner is not None:
                os.fchown(fd, 0, owner[1])
                os.fchmod(fd, 0o640)  # readable by the call's group, writable by nobody but root
        finally:
            os.close(fd)
        os.mkdir(made.workdir, 0o700)
        if owner is not None:
            made.mounted = mounts.mount_tmpfs(made.workdir, disk_bytes, owner)
            dfd = _open_nofollow_dir(made.workdir)
            try:
                os.fchown(dfd, *owner)
            finally:
                os.close(dfd)
            dfd = _open_nofollow_dir(tmp)
            try:
                os.fchown(dfd, 0, owner[1])
                os.fchmod(dfd, 0o710)  # the call's group may pass through to its working directory, not list or write
            finally:
                os.close(dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            _remove_tree(made)
        raise
    return made


def _remove_tree(made: _CallDir) -> None:
    """Delete a call's directory (unmounting its working directory's tmpfs first), restoring permissions the code may
    have taken away from directories inside it — through descriptors, never following a symlink, and never touching
    anything outside it (a directory the code removed itself is simply gone)."""
    if made.mounted:
        mounts.unmount(made.workdir)
    root = os.path.realpath(made.tmp)

    def fix(func, failed, exc_info):  # type: ignore[no-untyped-def]
        if isinstance(exc_info[1], FileNotFoundError):
            return
        parent = os.path.dirname(failed)
        if not (parent == root or parent.startswith(root + os.sep)):
            raise exc_info[1]
        for path in (parent, failed):
            with contextlib.suppress(OSError):
                dfd = _open_nofollow_dir(path)
                try:
                    os.fchmod(dfd, stat.S_IRWXU)
                finally:
                    os.close(dfd)
        func(failed)

    shutil.rmtree(made.tmp, onerror=fix)


def _allows_ctypes(mode: str, config: SandboxConfig) -> bool:
    """Whether the runner's audit hook lets ``ctypes.*`` events through: only at the ``namespaces`` level with
    ``site_packages`` on, where third-party C extensions are importable and the kernel is the boundary."""
    return mode == "namespaces" and config.site_packages


def _short_reason(exc: BaseException) -> str:
    """One line naming ``exc``: its type, the first and last lines of its message, at most ``MAX_REASON_CHARS``
    (characters UTF-8 cannot encode, such as lone surrogates, are written as escapes)."""
    message = str(exc).encode("utf-8", errors="backslashreplace").decode("utf-8")
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


def _internal_error(exc: BaseException, mode: str, duration: float) -> ToolResult:
    """The result of a call the sandbox could not run or clean up: ``error="internal_error"``, the reason in stderr."""
    return ToolResult(
        stdout="",
        stderr=f"SandboxError: the sandbox could not run this call ({_short_reason(exc)})\n",
        truncated=False,
        returncode=INTERNAL_ERROR_RETURNCODE,
        error="internal_error",
        duration_s=duration,
        isolation=mode,
    )


def _run_contained(code: str, config: SandboxConfig, mode: str, live: _LiveCalls | None) -> ToolResult:
    """:func:`_run`, with any failure of this one call's machinery returned as its ``internal_error`` result instead
    of raised (so that one call cannot end the caller, nor the other calls of a pool)."""
    start = time.monotonic()
    try:
        return _run(code, config, mode, live)
    except Exception as exc:  # every exception here belongs to this call; the code's own failures are results already
        return _internal_error(exc, mode, time.monotonic() - start)


def _guard_paths(mode: str, interp: _Interpreter, made: _CallDir) -> dict[str, list[str]]:
    """What Landlock lets the code reach (paths as the tool process sees them): the interpreter's and the system's
    directories to read, its working directory to write, the harmless devices; at the ``namespaces`` level also its
    private ``/proc`` (the call's own processes only); at the ``rlimits`` level not the host's ``/proc`` (other
    processes' command lines)."""
    if mode == "namespaces":
        return {"read": [*interp.binds, "/.tool.py", "/proc"], "write": ["/sandbox"], "devices": list(DEVICE_FILES)}
    read = [*interp.binds, made.code_path, "/proc/self"]  # /proc/self: the tool process's own entry (at rule time)
    return {"read": read, "write": [made.workdir], "devices": list(DEVICE_FILES)}


def _run(code: str, config: SandboxConfig, mode: str, live: _LiveCalls | None) -> ToolResult:
    """Run one call; raises on a failure of the sandbox machinery (the probe reports it; callers contain it)."""
    data = _encode_code(code)
    interp = _interpreter(config.python, config.site_packages)
    root = os.geteuid() == 0
    slot = uids.acquire(config.uid_base) if root else None  # a uid no other running call has
    try:
        owner = (slot.uid, slot.uid) if slot is not None else None
        disk = config.max_file_mb << 20
        made = _prepare_dir(data, mode, owner if mode == "rlimits" else None, disk)
        group: cgroups.CallCgroup | None = None
        try:
            group = cgroups.create((config.memory_mb << 20) + disk, config.max_procs)
            out, duration = _supervise(config, mode, interp, made, owner, group, live)
            oom = group is not None and group.oom_kills() > 0
        finally:
            try:
                if group is not None:
                    group.kill_and_remove()
                if slot is not None:
                    uids.sweep_uid(slot.uid)  # its processes anywhere, its files in shared directories, its IPC
            finally:
                _remove_tree(made)
    finally:
        if slot is not None:
            slot.release()
    return _classify(out, config, mode, duration, oom=oom)


def _supervise(
    config: SandboxConfig,
    mode: str,
    interp: _Interpreter,
    made: _CallDir,
    owner: tuple[int, int] | None,
    group: cgroups.CallCgroup | None,
    live: _LiveCalls | None,
) -> tuple[_Collected, float]:
    """Start the call's supervisor and collect its output and status; returns them with the call's duration."""
    status_r, status_w = os.pipe()
    spec = {
        "mode": mode,
        "status_fd": status_w,
        "timeout_s": config.timeout_s,
        "code_path": made.code_path,
        "workdir": made.workdir,
        "python": interp.executable,
        "python_flags": list(interp.flags),
        "runner": _RUNNER,
        "runner_args": [str(BLOCKED_EXIT), str(MEMORY_EXIT), "1" if _allows_ctypes(mode, config) else "0"],
        "sandbox_uid": owner[0] if owner else -1,
        "sandbox_gid": owner[1] if owner else -1,
        "binds": list(interp.binds),
        "symlinks": [list(s) for s in interp.symlinks],
        "cgroup_procs": group.procs_files if group is not None else [],
        "guards": _guard_paths(mode, interp, made),
        "limits": {
            "memory_bytes": config.memory_mb << 20,
            "cpu_s": config.cpu_s,
            "max_procs": config.max_procs,
            "file_bytes": config.max_file_mb << 20,
            "disk_bytes": config.max_file_mb << 20,
            "nofile": NOFILE,
        },
    }
    start = time.monotonic()
    spec_r, spec_w = os.pipe()  # the spec goes through a pipe, not argv: no process of the call shows it in /proc
    try:
        data = json.dumps(spec).encode()
        if len(data) > MAX_SPEC_BYTES:
            raise ValueError(f"the call's spec is {len(data)} bytes, more than a pipe holds ({MAX_SPEC_BYTES})")
        os.write(spec_w, data)
        os.close(spec_w)
        spec_w = -1
        proc = subprocess.Popen(
            [interp.executable, "-I", "-S", "-B", "-c", _SUPERVISOR, str(spec_r)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w, spec_r),
            env={},
            cwd="/",
            start_new_session=True,
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
        os.close(spec_r)
        if spec_w >= 0:
            os.close(spec_w)
    try:
        if live is not None:
            live.add(proc)
        out = _collect(proc, status_r, config, deadline=start + config.timeout_s + BACKSTOP_S)
    finally:
        if live is not None:
            live.discard(proc)
        os.close(status_r)
    if live is not None and live.closing and out.killed is None:
        out.killed = "timeout"  # the pool ended it (possibly before its supervisor could say so)
    return out, time.monotonic() - start


@dataclass
class _Collected:
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    status: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    killed: Literal["output_limit", "timeout"] | None = None


def _kill_call(proc: subprocess.Popen[bytes], tool_pgid: int | None) -> None:
    """SIGKILL the supervisor's process group and (rlimits level) the code's; init dies with the supervisor."""
    for pgid in (proc.pid, tool_pgid):
        if pgid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


def _collect(proc: subprocess.Popen[bytes], status_fd: int, config: SandboxConfig, *, deadline: float) -> _Collected:
    """Read stdout, stderr and the status pipe until they close (or the supervisor is gone), enforcing the output
    cap (SIGTERM to the supervisor, which kills the call) and the backstop deadline (SIGKILL)."""
    assert proc.stdout is not None and proc.stderr is not None
    got = _Collected()
    streams = {proc.stdout.fileno(): got.stdout, proc.stderr.fileno(): got.stderr, status_fd: got.status}
    sel = selectors.DefaultSelector()
    for fd in streams:
        sel.register(fd, selectors.EVENT_READ)
    exited_at: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now > deadline and got.killed is None:
                got.killed = "timeout"
                _kill_call(proc, _tool_pgid(got.status))
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > DRAIN_S:
                break
            for key, _ in sel.select(timeout=0.05 if exited_at is not None else 0.2):
                fd = key.fd
                data = os.read(fd, 1 << 16)
                if not data:
                    sel.unregister(fd)
                    continue
                if fd == status_fd:
                    got.status += data
                    continue
                room = config.max_output_bytes - len(got.stdout) - len(got.stderr)
                streams[fd] += data[: max(room, 0)]
                if len(data) > room and not got.truncated:
                    got.truncated = True
                    if got.killed is None:
                        got.killed = "output_limit"
                        proc.send_signal(signal.SIGTERM)
    finally:
        sel.close()
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0) + BACKSTOP_S)
        except subprocess.TimeoutExpired:
            _kill_call(proc, _tool_pgid(got.status))
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return got


def _events(status: bytes) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in status.decode(errors="replace").splitlines() if line.strip()]


def _tool_pgid(status: bytes) -> int | None:
    for event in _events(status):
        if event["event"] == "started" and "pid" in event:
            return int(event["pid"])
    return None


def _classify(got: _Collected, config: SandboxConfig, mode: str, duration: float, *, oom: bool = False) -> ToolResult:
    events = {e["event"]: e for e in _events(bytes(got.status))}
    if "setup_error" in events:  # written only by the supervisor, init, or the tool process before its exec
        raise SandboxUnavailableError(f"the {mode} sandbox could not be built:\n{events['setup_error']['message']}")
    returncode, error = -int(signal.SIGKILL), "crash"
    if "exit" in events:
        status = int(events["exit"]["status"])
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            returncode = -sig
            at_cpu_limit = float(events["exit"]["cpu_s"]) >= config.cpu_s
            error = "cpu" if sig == signal.SIGXCPU or (sig == signal.SIGKILL and at_cpu_limit) else "crash"
        else:
            returncode = os.WEXITSTATUS(status)
            error = {0: None, BLOCKED_EXIT: "blocked", MEMORY_EXIT: "memory"}.get(returncode, "crash")
    elif got.killed == "timeout" or "stopped" in events:
        error = "timeout"
    if oom and error in ("crash", "cpu"):  # the kernel killed a process of the call at the call's memory limit
        error = "memory"
    if got.killed == "output_limit":
        error = "output_limit"
    return ToolResult(
        stdout=got.stdout.decode("utf-8", errors="replace"),
        stderr=got.stderr.decode("utf-8", errors="replace"),
        truncated=got.truncated,
        returncode=returncode,
        error=error,  # type: ignore[arg-type]
        duration_s=duration,
        isolation=mode,
    )


class SandboxPool:
    """Runs tool calls ``config.workers`` at a time, each in its own sandbox (threads wait; the work is in processes).

    Use as a context manager, or call :meth:`close`: it cancels queued calls, kills running ones (their results say
    ``error="timeout"``) and returns once every process of every call is gone.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        #: The level calls run at (resolved from ``config.isolation`` when the pool starts).
        self.isolation = resolve_isolation(self.config)
        #: The mechanisms that hold for its calls on this machine (:class:`SandboxLayers`).
        self.layers = sandbox_layers(self.config)
        self._live = _LiveCalls()
        self._executor = ThreadPoolExecutor(self.config.workers, thread_name_prefix="steadyrl-sandbox")
        self._closed = False

    def submit(self, code: str) -> Future[ToolResult]:
        """Queue one call; the future's result is its :class:`ToolResult` (a failure of the call's sandbox machinery
        included: ``error="internal_error"``)."""
        if self._closed:
            raise RuntimeError("the SandboxPool is closed")
        return self._executor.submit(_run_contained, code, self.config, self.isolation, self._live)

    def map(self, codes: Iterable[str]) -> list[ToolResult]:
        """Run every code (up to ``workers`` at once) and return their results in order."""
        futures = [self.submit(c) for c in codes]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Cancel queued calls, end running ones, wait until all their processes are gone (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._live.terminate_all()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
