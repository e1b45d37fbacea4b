"""The kernel guards of the sandbox's tool process (``_kernel_guards.py``): Landlock and seccomp.

Each behavioural test runs the guards' text followed by a snippet in a fresh ``python -I -S -c`` (no_new_privs set
first), so that the test process itself is never restricted, and runs the same snippet without the guard, so that
every check can fail. The seccomp program is also run, for both architectures, by a small classic-BPF interpreter
written here from ``linux/filter.h``; the syscall table is compared with the kernel headers where they are installed.
"""

from __future__ import annotations

import ast
import errno
import os
import re
import socket
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from steadyrl.tools import _kernel_guards

GUARDS_TEXT = Path(_kernel_guards.__file__).read_text()
ON_LINUX = sys.platform.startswith("linux")
LANDLOCK_ABI = _kernel_guards.landlock_abi() if ON_LINUX else 0
ARCH = _kernel_guards.seccomp_arch() if ON_LINUX else None

pytestmark = pytest.mark.skipif(not ON_LINUX, reason="the kernel guards are Linux-only")
needs_landlock = pytest.mark.skipif(LANDLOCK_ABI == 0, reason="this kernel has no Landlock (ENOSYS/EOPNOTSUPP)")
needs_seccomp = pytest.mark.skipif(ARCH is None, reason="seccomp filter: this machine's arch is not x86_64/aarch64")

#: Run before every snippet: the modules the snippets use (imported before any guard), no_new_privs, the paths the
#: interpreter needs to read, and the device files.
PRELUDE = """
import ctypes, errno, fcntl, os, socket, subprocess, sys, threading
u = ctypes.c_ulong
if NO_NEW_PRIVS and GUARDS_LIBC.prctl(ctypes.c_int(38), u(1), u(0), u(0), u(0)) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
READ = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.__file__), os.path.realpath(sys.executable),
        "/usr", "/lib", "/lib32", "/lib64", "/bin", "/etc/ld.so.cache"]
DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]
"""


def run_snippet(code: str, *, no_new_privs: bool = True) -> str:
    """Run the guards' text, the prelude and ``code`` in a fresh interpreter; its stdout (it must exit with 0)."""
    program = f"{GUARDS_TEXT}\nNO_NEW_PRIVS = {no_new_privs}\n{PRELUDE}\n{textwrap.dedent(code)}"
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", program], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"exit status {proc.returncode}; stderr:\n{proc.stderr}"
    return proc.stdout


def outcome(action: str, guard: str = "") -> str:
    """``"ok"`` when the statements ``action`` run through after the statements ``guard``; otherwise the errno name
    of the OSError they raised ("EACCES", "EPERM", ...)."""
    code = (
        f"{textwrap.dedent(guard)}\ntry:\n{textwrap.indent(textwrap.dedent(action), '    ')}\n"
        "except OSError as exc:\n    print(errno.errorcode[exc.errno])\nelse:\n    print('ok')\n"
    )
    return run_snippet(code).strip().splitlines()[-1]


def landlock(read: list[Path] | None = None, write: list[Path] | None = None, devices: bool = True) -> str:
    """A guard: :func:`apply_landlock` with the interpreter's paths and ``read`` readable, ``write`` writable."""
    reads, writes = [str(p) for p in read or []], [str(p) for p in write or []]
    return f"assert apply_landlock(READ + {reads!r}, {writes!r}, {'DEVICES' if devices else '[]'}) > 0"


SECCOMP = "apply_seccomp()"


# ------------------------------------------------------------------------------------------------------ Landlock


@needs_landlock
def test_landlock_reads_only_the_allowed_paths(tmp_path: Path) -> None:
    allowed, secret = tmp_path / "allowed.txt", tmp_path / "secret.txt"
    allowed.write_text("public")
    secret.write_text("secret")
    guard = landlock(read=[allowed])  # a regular file: its rule must leave out the directory-only rights
    assert outcome(f"assert open({str(allowed)!r}).read() == 'public'", guard) == "ok"
    assert outcome(f"open({str(secret)!r}).read()", guard) == "EACCES"
    assert outcome(f"open({str(secret)!r}).read()") == "ok"


@needs_landlock
def test_landlock_lists_only_the_allowed_dirs(tmp_path: Path) -> None:
    public, private = tmp_path / "public", tmp_path / "private"
    for d in (public, private):
        d.mkdir()
        (d / "f").write_text("x")
    guard = landlock(read=[public])
    assert outcome(f"assert os.listdir({str(public)!r}) == ['f']", guard) == "ok"
    assert outcome(f"os.listdir({str(private)!r})", guard) == "EACCES"
    assert outcome(f"os.listdir({str(private)!r})") == "ok"


@needs_landlock
def test_landlock_writes_only_in_the_write_dirs(tmp_path: Path) -> None:
    work, public, other = tmp_path / "work", tmp_path / "public", tmp_path / "other"
    for d in (work, public, other):
        d.mkdir()
    guard = landlock(read=[public], write=[work])
    inside = f"""
        os.chdir({str(work)!r})
        with open("a", "w") as f:
            f.write("x" * 100)
        os.truncate("a", 10)
        os.mkdir("sub")
        os.rename("a", "sub/a")  # across directories: REFER (ABI >= 2)
        os.symlink("sub/a", "link")
        os.remove("link")
        os.remove("sub/a")
        os.rmdir("sub")
    """
    assert outcome(inside, guard) == "ok"
    for d in (other, public):  # nowhere else, not even where reading is allowed
        assert outcome(f"open({str(d / 'f')!r}, 'w').close()", guard) == "EACCES"
        assert outcome(f"os.mkdir({str(d / 'sub')!r})", guard) == "EACCES"
        assert outcome(f"open({str(d / 'f')!r}, 'w').close()") == "ok"


@needs_landlock
def test_landlock_device_files_are_read_and_written_only_when_listed() -> None:
    action = "open('/dev/null', 'w').write('x'); assert open('/dev/zero', 'rb').read(4) == bytes(4)"
    if LANDLOCK_ABI >= 5:  # a device ioctl (RNDGETENTCNT, allowed to anyone) needs IOCTL_DEV
        action += "\nwith open('/dev/urandom', 'rb') as f:\n    fcntl.ioctl(f, 0x80045200, bytes(4))"
    assert outcome(action, landlock()) == "ok"
    assert outcome(action, landlock(devices=False)) == "EACCES"
    assert outcome(action) == "ok"


@needs_landlock
def test_landlock_skips_missing_paths(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    missing = [tmp_path / "missing", tmp_path / "file" / "below_a_file"]  # ENOENT, ENOTDIR
    assert outcome("pass", landlock(read=missing, write=missing)) == "ok"


@needs_landlock
def test_landlock_path_it_cannot_open_fails_with_the_path(tmp_path: Path) -> None:
    """A path that exists but cannot be looked up (a directory without search permission) is a real failure."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    (locked / "f").write_text("x")
    locked.chmod(0)
    code = f"""
        if os.geteuid() == 0:  # root would look up anyway: drop to uid 65534 (tmp_path is 0700 for it too)
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
        try:
            apply_landlock([{str(locked / "f")!r}], [], [])
        except OSError as exc:
            print(exc.errno, exc.strerror)
    """
    try:
        assert run_snippet(code) == f"{errno.EACCES} open({locked / 'f'}, O_PATH): {os.strerror(errno.EACCES)}\n"
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(LANDLOCK_ABI < 4, reason=f"TCP rules need Landlock ABI >= 4 (this kernel: {LANDLOCK_ABI})")
def test_landlock_denies_tcp_connect_and_bind() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        connect = f"socket.create_connection(('127.0.0.1', {port}), timeout=10).close()"
        assert outcome(connect, landlock()) == "EACCES"
        assert outcome(connect) == "ok"
    bind = "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.close()"
    assert outcome(bind, landlock()) == "EACCES"
    assert outcome(bind) == "ok"


@pytest.mark.skipif(LANDLOCK_ABI < 6, reason=f"signal scoping needs Landlock ABI >= 6 (this kernel: {LANDLOCK_ABI})")
def test_landlock_denies_signals_out_of_the_domain() -> None:
    kill = f"os.kill({os.getpid()}, 0)"  # signal 0: permission check only
    assert outcome(kill, landlock()) == "EPERM"
    assert outcome(kill) == "ok"
    own_child = "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.kill(pid, 0)\nos.waitpid(pid, 0)"
    assert outcome(own_child, landlock()) == "ok"  # within the domain signals still work


@pytest.mark.skipif(LANDLOCK_ABI < 6, reason=f"socket scoping needs Landlock ABI >= 6 (this kernel: {LANDLOCK_ABI})")
def test_landlock_denies_abstract_unix_sockets_out_of_the_domain() -> None:
    name = f"\0steadyrl-guards-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(name)
        server.listen()
        connect = f"s = socket.socket(socket.AF_UNIX); s.connect({name!r}); s.close()"
        assert outcome(connect, landlock()) == "EPERM"
        assert outcome(connect) == "ok"


@needs_landlock
def test_landlock_failure_names_the_call() -> None:
    """Without no_new_privs (and without CAP_SYS_ADMIN: root drops to uid 65534 first) restrict_self fails."""
    code = """
        if os.geteuid() == 0:
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
        try:
            apply_landlock([], [], [])
        except OSError as exc:
            print(exc.errno, exc.strerror)
    """
    assert run_snippet(code, no_new_privs=False).split(" ", 1) == [
        str(errno.EPERM), f"landlock_restrict_self: {os.strerror(errno.EPERM)}\n"
    ]


@pytest.mark.parametrize(
    ("abi", "fs", "size"),
    [
        (1, 0x1FFF, 8),  # bits 0..12
        (2, 0x3FFF, 8),  # + REFER
        (3, 0x7FFF, 8),  # + TRUNCATE
        (4, 0x7FFF, 16),  # + net
        (5, 0xFFFF, 16),  # + IOCTL_DEV
        (6, 0xFFFF, 24),  # + scoped
        (7, 0xFFFF, 24),  # audit flags only
    ],
)
def test_landlock_ruleset_attr_follows_the_abi(abi: int, fs: int, size: int) -> None:
    """handled_access_fs, then handled_access_net (bind|connect TCP) from ABI 4, scoped (abstract unix|signal)
    from ABI 6; each ABI gets the struct size it knows."""
    attr = _kernel_guards.landlock_ruleset_attr(abi)
    assert attr == struct.pack("<QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[:size]


# ------------------------------------------------------------------------------------------------------- seccomp


@needs_seccomp
@pytest.mark.parametrize("family", ["AF_INET", "AF_INET6", "AF_UNIX"])
def test_seccomp_denies_sockets(family: str) -> None:
    action = f"socket.socket(socket.{family}).close()"
    assert outcome(action, SECCOMP) == "EPERM"
    assert outcome(action) == "ok"


@needs_seccomp
def test_seccomp_allows_socketpair() -> None:
    action = "a, b = socket.socketpair(); a.sendall(b'x'); assert b.recv(1) == b'x'"
    assert outcome(action, SECCOMP) == "ok"


@needs_seccomp
def test_seccomp_denies_unshare() -> None:
    action = "if GUARDS_LIBC.unshare(ctypes.c_int(0x10000000)) != 0: raise OSError(ctypes.get_errno(), 'unshare')"
    unguarded = outcome(action)
    if unguarded != "ok":
        pytest.skip(f"unshare(CLONE_NEWUSER) fails here even without the filter ({unguarded})")
    assert outcome(action, SECCOMP) == "EPERM"


@needs_seccomp
@pytest.mark.parametrize(("flag", "value"), [("CLONE_NEWUSER", 0x10000000), ("CLONE_NEWNS", 0x00020000)])
def test_seccomp_denies_clone_into_a_namespace(flag: str, value: int) -> None:
    nr = {"x86_64": 56, "aarch64": 220}[str(ARCH)]
    action = f"""
        pid = GUARDS_LIBC.syscall(ctypes.c_long({nr}), ctypes.c_long({value} | 17), *[ctypes.c_long(0)] * 4)
        if pid == 0:
            os._exit(0)  # the child (a fork-like copy): leave at once
        if pid < 0:
            raise OSError(ctypes.get_errno(), "clone")
        os.waitpid(pid, 0)
    """
    unguarded = outcome(action)
    if unguarded != "ok":
        pytest.skip(f"clone({flag}) fails here even without the filter ({unguarded})")
    assert outcome(action, SECCOMP) == "EPERM"


@needs_seccomp
def test_seccomp_denies_setsid() -> None:
    action = """
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
            except OSError as exc:
                os._exit(exc.errno)
            os._exit(0)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code:
            raise OSError(code, "setsid in the child")
    """
    assert outcome(action, SECCOMP) == "EPERM"
    assert outcome(action) == "ok"


@needs_seccomp
def test_seccomp_denies_memfd_create() -> None:
    action = "os.close(os.memfd_create('x'))"
    assert outcome(action, SECCOMP) == "EPERM"
    assert outcome(action) == "ok"


@needs_seccomp
def test_seccomp_denies_sysv_shared_memory() -> None:
    action = """
        shm = GUARDS_LIBC.shmget(0, ctypes.c_size_t(4096), 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        if shm < 0:
            raise OSError(ctypes.get_errno(), "shmget")
        GUARDS_LIBC.shmctl(shm, 0, None)  # IPC_RMID: leave nothing behind
    """
    assert outcome(action, SECCOMP) == "EPERM"
    assert outcome(action) == "ok"


@needs_seccomp
@pytest.mark.parametrize("call", ["add_key", "keyctl"])
def test_seccomp_denies_keyrings(call: str) -> None:
    """Both create a key or keyring in the process keyring (gone with the process)."""
    nr = {"x86_64": {"add_key": 248, "keyctl": 250}, "aarch64": {"add_key": 217, "keyctl": 219}}[str(ARCH)][call]
    args = {
        "add_key": "ctypes.c_char_p(b'user'), ctypes.c_char_p(b'steadyrl-test'), ctypes.c_char_p(b'x'), "
        "ctypes.c_long(1), ctypes.c_long(-2)",  # KEY_SPEC_PROCESS_KEYRING
        "keyctl": "ctypes.c_long(0), ctypes.c_long(-2), ctypes.c_long(1)",  # KEYCTL_GET_KEYRING_ID, create
    }[call]
    action = f"""
        if GUARDS_LIBC.syscall(ctypes.c_long({nr}), {args}) <= 0:
            raise OSError(ctypes.get_errno(), "{call}")
    """
    assert outcome(action, SECCOMP) == "EPERM"
    assert outcome(action) == "ok"


@needs_seccomp
def test_seccomp_clone3_fails_with_enosys() -> None:
    action = """
        if GUARDS_LIBC.syscall(ctypes.c_long(435), None, ctypes.c_long(0)) != 0:
            raise OSError(ctypes.get_errno(), "clone3")
    """
    assert outcome(action, SECCOMP) == "ENOSYS"
    assert outcome(action) == "EINVAL"  # the real clone3 rejects a zero-sized clone_args


@pytest.mark.skipif(ARCH != "x86_64", reason="the x32 ABI exists on x86_64 only")
def test_seccomp_denies_x32_calls() -> None:
    action = "if GUARDS_LIBC.syscall(ctypes.c_long(0x40000000 | 39)) < 0: raise OSError(ctypes.get_errno(), 'x32')"
    assert outcome(action, SECCOMP) == "EPERM"
    assert outcome(action) != "EPERM"  # getpid (x32 on) or ENOSYS (x32 off)


@needs_seccomp
def test_seccomp_allows_threads() -> None:
    action = "box = []; t = threading.Thread(target=box.append, args=(1,)); t.start(); t.join(); assert box == [1]"
    assert outcome(action, SECCOMP) == "ok"


@needs_seccomp
def test_seccomp_allows_fork() -> None:
    action = """
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
    """
    assert outcome(action, SECCOMP) == "ok"


@needs_seccomp
def test_seccomp_allows_subprocess() -> None:
    action = "assert subprocess.run([sys.executable, '-c', 'print(1)'], capture_output=True).stdout == b'1\\n'"
    assert outcome(action, SECCOMP) == "ok"


@needs_seccomp
def test_seccomp_failure_names_the_call() -> None:
    """Without no_new_privs (and without CAP_SYS_ADMIN: root drops to uid 65534 first) the kernel refuses."""
    code = """
        if os.geteuid() == 0:
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
        try:
            apply_seccomp()
        except OSError as exc:
            print(exc.errno, exc.strerror)
    """
    assert run_snippet(code, no_new_privs=False).split(" ", 1) == [
        str(errno.EACCES), f"prctl(PR_SET_SECCOMP): {os.strerror(errno.EACCES)}\n"
    ]


# ---------------------------------------------------------------------------------------------------- together


@needs_landlock
@needs_seccomp
def test_both_guards_let_a_fresh_interpreter_run() -> None:
    """The supervisor's order: both guards, then a new interpreter (it needs only the read paths to start)."""
    action = "child = [sys.executable, '-I', '-S', '-c', 'print(1)']\n"
    action += "assert subprocess.run(child, capture_output=True).stdout == b'1\\n'"
    assert outcome(action, landlock() + "\n" + SECCOMP) == "ok"
    assert outcome(action, landlock(devices=False) + "\n" + SECCOMP) == "ok"  # not even /dev/null


def test_guards_text_can_be_prepended_to_the_supervisor() -> None:
    """Stdlib imports only (the supervisor's contract), and no top-level name the supervisor defines too."""
    tree = ast.parse(GUARDS_TEXT, feature_version=(3, 8))
    imported = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    assert imported <= {"ctypes", "errno", "os", "platform", "stat", "struct", "sys"}
    assert not [node for node in tree.body if isinstance(node, ast.ImportFrom)]
    supervisor = ast.parse((Path(_kernel_guards.__file__).parent / "_supervisor.py").read_text())
    assert not top_level_names(tree) & top_level_names(supervisor)


def top_level_names(tree: ast.Module) -> set[str]:
    """Functions, classes and assigned names at the top of a module."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


# ----------------------------------------------------------------------------------- the filter program, offline

#: From linux/filter.h and linux/seccomp.h, written out here so that the module's own constants are checked.
LD_W_ABS, JEQ_K, JSET_K, RET_K = 0x20, 0x15, 0x45, 0x06
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
#: Calls that must stay allowed: read, write, getpid, socketpair, fork-like clone (checked separately).
ALLOWED = {"x86_64": [0, 1, 39, 53], "aarch64": [63, 64, 172, 199]}
CLONE_NEW = [0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000]
#: Flags glibc's pthread_create passes to clone, and fork's.
CLONE_THREAD_FLAGS, CLONE_FORK_FLAGS = 0x003D0F00, 0x01200011


def run_bpf(prog: list[tuple[int, int, int, int]], arch: int, nr: int, arg0: int = 0) -> int:
    """The seccomp action ``prog`` returns for a call (``struct seccomp_data``: nr, arch, ip, args[6])."""
    data = struct.pack("<IIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == LD_W_ABS:
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code == JEQ_K:
            pc += 1 + (jt if acc == k else jf)
        elif code == JSET_K:
            pc += 1 + (jt if acc & k else jf)
        elif code == RET_K:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x} at {pc}")


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_seccomp_program_decides_every_call(arch: str) -> None:
    prog = _kernel_guards.seccomp_program(arch)
    assert len(prog) <= 4096  # BPF_MAXINSNS
    audit = AUDIT_ARCH[arch]
    numbers = _kernel_guards.seccomp_numbers(arch)
    for name, nr in numbers.items():
        if name != "clone":
            expected = RET_ERRNO | (errno.ENOSYS if name == "clone3" else errno.EPERM)
            assert run_bpf(prog, audit, nr) == expected, name
    for flag in CLONE_NEW:
        assert run_bpf(prog, audit, numbers["clone"], CLONE_FORK_FLAGS | flag) == RET_ERRNO | errno.EPERM, hex(flag)
    for flags in (CLONE_FORK_FLAGS, CLONE_THREAD_FLAGS, 17):
        assert run_bpf(prog, audit, numbers["clone"], flags) == RET_ALLOW, hex(flags)
    for nr in ALLOWED[arch]:
        assert run_bpf(prog, audit, nr) == RET_ALLOW, nr
    for foreign in (0x40000003, 0xC00000B7 if arch == "x86_64" else 0xC000003E):  # i386, the other 64-bit arch
        assert run_bpf(prog, foreign, ALLOWED[arch][0]) == RET_KILL_PROCESS
    x32 = run_bpf(prog, audit, 0x40000000 | 39)
    assert x32 == (RET_ERRNO | errno.EPERM if arch == "x86_64" else RET_ALLOW)


def header_numbers(path: Path) -> dict[str, int]:
    """``__NR_<name> <number>`` definitions of a kernel header."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define __NR_(\w+)\s+(\d+)\s*$", path.read_text(), re.M)}


@pytest.mark.parametrize(
    ("arch", "headers"),
    [
        ("x86_64", ["/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"]),
        ("aarch64", ["/usr/include/asm-generic/unistd.h"]),
    ],
)
def test_seccomp_numbers_match_the_kernel_headers(arch: str, headers: list[str]) -> None:
    """Every number the header knows agrees (an older header lacks the newest calls: they are left out)."""
    found = [Path(h) for h in headers if Path(h).exists()]
    if not found:
        pytest.skip(f"no {arch} syscall header here (looked for {', '.join(headers)})")
    known = header_numbers(found[0])
    ours = _kernel_guards.seccomp_numbers(arch)
    compared = {name: nr for name, nr in ours.items() if name in known}
    assert compared == {name: known[name] for name in compared}
    assert len(compared) >= len(ours) - 2, f"the header lacks {sorted(set(ours) - set(known))}"
    assert len(set(ours.values())) == len(ours), "two calls share a number"
    assert all(reason for *_, reason in _kernel_guards.SECCOMP_DENY.values())
