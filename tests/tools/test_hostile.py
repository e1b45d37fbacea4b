"""Hostile code against each isolation level: one test per finding of a review of the sandbox.

Each test runs what a hostile policy would write, mostly from a child process of the tool (``in_child``: outside the
interpreter's audit hook, so that only the kernel's mechanisms stand in the way), and asserts on the outcome on the
host: nothing written, nothing reached, nothing left. Each fails on a sandbox without the defence its docstring names,
at the levels named there. The stress test at the end runs 64 such calls at once next to a
learner loop.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from steadyrl.tools import SandboxPool, cgroups, run_python, sandbox, sandbox_layers, uids
from steadyrl.tools.config import SandboxConfig
from tests.tools.conftest import is_sandbox_uid, level_config, sandbox_processes, wait_for_no_new_processes

ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[2]


def in_child(code: str) -> str:
    """Tool code that runs ``code`` in a child interpreter (which the audit hook does not see) and prints its output."""
    return (
        "import subprocess, sys\n"
        f"p = subprocess.run([sys.executable, '-I', '-S', '-c', {code!r}], capture_output=True, text=True)\n"
        "print(p.stdout + p.stderr[-400:], end='')\n"
    )


#: Prelude of child code: ``attempt(name, fn)`` prints ``name ok`` or ``name denied <error>``.
ATTEMPT = (
    "def attempt(name, fn):\n"
    "    try:\n        fn()\n        print(name, 'ok')\n"
    "    except BaseException as e:\n        print(name, 'denied', type(e).__name__)\n"
)


def outcomes(stdout: str) -> dict[str, str]:
    """``{name: "ok" | "denied"}`` from the lines ATTEMPT printed."""
    found = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1] in ("ok", "denied"):
            found[parts[0]] = parts[1]
    return found


def assert_all_denied(stdout: str, names: list[str]) -> None:
    got = outcomes(stdout)
    assert {n: got.get(n) for n in names} == dict.fromkeys(names, "denied"), stdout


# ------------------------------------------------------------------------------------- the call's own directory


def test_code_cannot_change_its_call_directory(level: str) -> None:
    """rlimits as root: the directory holding the code file and the working directory belonged to the sandbox uid, so
    the code could replace entries in it (the root chown race of the setup rested on that)."""
    code = ATTEMPT + (
        "import os\n"
        "attempt('rename_code', lambda: os.rename('../tool.py', '../moved.py'))\n"
        "attempt('plant', lambda: open('../planted', 'w').write('x'))\n"
        "attempt('symlink', lambda: os.symlink('/etc/passwd', '../link'))\n"
        "attempt('chmod_parent', lambda: os.chmod('..', 0o777))\n"
    )
    r = run_python(in_child(code), limits=level_config(level))
    assert_all_denied(r.stdout, ["rename_code", "plant", "symlink", "chmod_parent"])


@pytest.mark.skipif(not ROOT, reason="the code runs as another uid only when steadyrl runs as root")
def test_directory_setup_changes_no_owner_through_a_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The setup hands only the working directory to the call's uid, through a descriptor (no path-based chown/chmod
    a swapped symlink could redirect); the directory above it and the code file stay root's and read-only to it."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"path-based ownership change: {args}")

    monkeypatch.setattr(os, "chown", refuse)
    monkeypatch.setattr(os, "chmod", refuse)
    made = sandbox._prepare_dir(b"print(1)", "rlimits", (61999, 61999), 1 << 20)
    try:
        st = {name: os.stat(p) for name, p in (("tmp", made.tmp), ("code", made.code_path), ("work", made.workdir))}
        assert (st["tmp"].st_uid, st["tmp"].st_gid, stat.S_IMODE(st["tmp"].st_mode)) == (0, 61999, 0o710)
        assert (st["code"].st_uid, st["code"].st_gid, stat.S_IMODE(st["code"].st_mode)) == (0, 61999, 0o640)
        assert (st["work"].st_uid, st["work"].st_gid) == (61999, 61999)
    finally:
        monkeypatch.undo()
        sandbox._remove_tree(made)
    assert not os.path.exists(made.tmp)


def test_a_call_that_removes_its_own_directory_breaks_no_later_call(level: str) -> None:
    """rlimits as root: the code could remove its own temporary directory; the cleanup then chmod-ed the machine's
    temporary directory to 0700 and every later call failed."""
    before = os.stat(tempfile.gettempdir()).st_mode
    code = (
        "import os, shutil\n"
        "call_dir = os.path.dirname(os.getcwd())\n"
        "os.chdir('/')\n"
        "shutil.rmtree(call_dir, ignore_errors=True)\n"
        "print('removed' if not os.path.exists(call_dir) else 'kept')\n"
    )
    run_python(in_child(code), limits=level_config(level))
    assert os.stat(tempfile.gettempdir()).st_mode == before
    assert run_python("print('next')", limits=level_config(level)).stdout == "next\n"


def test_writing_stops_at_the_call_disk_quota(level: str) -> None:
    """rlimits: RLIMIT_FSIZE bounded each file, not their sum, so one call could fill the machine's temporary directory.
    Now a tmpfs of max_file_mb is the working directory (namespaces; rlimits as root where mounting is allowed) and
    nothing outside it is writable."""
    if level == "rlimits" and not ROOT:
        pytest.skip("the rlimits quota needs root (a tmpfs mount); without it only RLIMIT_FSIZE holds")
    code = (
        "import os\nn = 0\n"
        "for i in range(8):\n"
        "    try:\n        open(f'f{i}', 'wb').write(b'x' * (2 << 20))\n        n += 1\n"
        "    except OSError:\n        pass\n"
        "print(n)\n"
    )
    r = run_python(code, limits=level_config(level, max_file_mb=4))
    assert int(r.stdout) <= 2, r  # 4 MiB hold at most two 2-MiB files
    r = run_python(in_child(code.replace("f'f{i}'", "f'/tmp/steadyrl-fill-{i}'")), limits=level_config(level))
    assert int(r.stdout.split()[0]) <= 2 * 4, r  # /tmp is the working directory (namespaces) or not writable
    assert not list(Path(tempfile.gettempdir()).glob("steadyrl-fill-*"))


# ----------------------------------------------------------------------------------------- other calls, the host


def _tool_pid_of_running_call(before: set[int], deadline_s: float = 10.0) -> int:
    """The pid (on the host) of the tool process of the one call started since ``before``."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for pid in sandbox_processes() - before:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"-c" in cmdline and b"install_audit_hook" in cmdline:  # the runner: the tool's own interpreter
                return pid
        time.sleep(0.05)
    raise AssertionError("the first call's tool process did not show up")


def test_concurrent_calls_cannot_reach_each_other(level: str) -> None:
    """rlimits as root: every call ran as uid 65534, so one call could read another's files, signal or trace its
    processes."""
    before = sandbox_processes()
    with SandboxPool(level_config(level, workers=2, timeout_s=30.0)) as pool:
        first = pool.submit("import time\nopen('secret.txt', 'w').write('s3cr3t')\ntime.sleep(8)\n")
        victim = _tool_pid_of_running_call(before)
        time.sleep(0.3)
        code = ATTEMPT + (
            "import glob, os, signal\n"
            f"attempt('signal', lambda: os.kill({victim}, 0))\n"
            f"attempt('kill', lambda: os.kill({victim}, signal.SIGKILL))\n"
            f"attempt('cwd', lambda: open('/proc/{victim}/cwd/secret.txt').read())\n"
            f"attempt('environ', lambda: open('/proc/{victim}/environ').read())\n"
            "def by_glob():\n"
            "    found = glob.glob('/tmp/steadyrl-tool-*/work/secret.txt')\n"
            "    assert found\n    open(found[0]).read()\n"
            "attempt('glob', by_glob)\n"
        )
        r = pool.submit(in_child(code)).result(timeout=30)
        assert_all_denied(r.stdout, ["signal", "kill", "cwd", "environ", "glob"])
        first.cancel()
    assert wait_for_no_new_processes(before, grace_s=3.0) == set()


def test_nothing_the_code_leaves_outside_its_directory_survives(level: str) -> None:
    """rlimits: files in /tmp, /var/tmp and /dev/shm, System V shared memory and keyring keys outlived the call."""
    token = secrets.token_hex(6)
    key = int(token[:7], 16)
    code = ATTEMPT + (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"for d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
        f"    attempt('file' + d.replace('/', '_'), lambda: open(d + '/steadyrl-leak-{token}', 'w').write('x'))\n"
        "def shm():\n"
        f"    if libc.shmget({key}, 4096, 0o1000 | 0o666) < 0:\n"
        "        raise OSError(ctypes.get_errno(), 'shmget')\n"
        "attempt('shm', shm)\n"
        "def key():\n"
        "    libc.syscall.restype = ctypes.c_long\n"
        f"    if libc.syscall(248, b'user', b'steadyrl-leak-{token}', b'x', 1, -4) < 0:\n"  # add_key, user keyring
        "        raise OSError(ctypes.get_errno(), 'add_key')\n"
        "attempt('key', key)\n"
    )
    if os.uname().machine != "x86_64":
        code = code.replace("syscall(248,", "syscall(217,")  # add_key on aarch64
    r = run_python(in_child(code), limits=level_config(level))
    assert outcomes(r.stdout).get("key") == "denied", r.stdout  # keyrings: refused outright
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.exists(f"{d}/steadyrl-leak-{token}"), (d, r.stdout)
    shm_keys = [line.split()[0] for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    assert str(key) not in shm_keys, r.stdout


def _servers(tmp_path: Path) -> tuple[list[socket.socket], dict[str, object]]:
    """Listening sockets on the host: TCP on 127.0.0.1 (and ::1 where there is IPv6), a unix socket any uid may
    connect to, an abstract unix socket; and the addresses the hostile code tries."""
    made, addresses = [], {}
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    made.append(tcp)
    addresses["tcp4"] = ("AF_INET", tcp.getsockname())
    try:
        tcp6 = socket.socket(socket.AF_INET6)
        tcp6.bind(("::1", 0))
        made.append(tcp6)
        addresses["tcp6"] = ("AF_INET6", tcp6.getsockname()[:2])
    except OSError:
        pass
    tmp_path.chmod(0o777)
    path = str(tmp_path / "host.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(path)
    os.chmod(path, 0o777)
    made.append(unix)
    addresses["unix"] = ("AF_UNIX", path)
    abstract = socket.socket(socket.AF_UNIX)
    name = "\0steadyrl-test-" + secrets.token_hex(4)
    abstract.bind(name)
    made.append(abstract)
    addresses["abstract"] = ("AF_UNIX", name)
    for s in made:
        s.listen(8)
        s.setblocking(False)
    return made, addresses


def test_no_network_from_a_child_process(level: str, tmp_path: Path) -> None:
    """rlimits: a child process (outside the audit hook) reached loopback TCP, IPv6 and unix sockets."""
    made, addresses = _servers(tmp_path)
    try:
        code = ATTEMPT + "import socket\n"
        for name, (family, address) in addresses.items():
            code += f"attempt({name!r}, lambda: socket.socket(socket.{family}).connect({address!r}))\n"
        udp = "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 9))"
        code += f"attempt('udp', lambda: {udp})\n"
        r = run_python(in_child(code), limits=level_config(level))
        assert_all_denied(r.stdout, [*addresses, "udp"])
        time.sleep(0.2)
        for s in made:
            with pytest.raises(BlockingIOError):
                s.accept()  # nobody got through
    finally:
        for s in made:
            s.close()


def test_the_code_reads_no_repository_source_and_no_other_process(level: str) -> None:
    """rlimits: the repository and every world-readable file were readable, and so were other processes' command
    lines; namespaces: init's command line held the call's spec (host paths)."""
    me = os.getpid()
    code = ATTEMPT + (
        "import os\n"
        f"attempt('repo_file', lambda: open({str(REPO / 'pyproject.toml')!r}).read())\n"
        f"attempt('repo_dir', lambda: os.listdir({str(REPO)!r}))\n"
        f"attempt('caller_cmdline', lambda: open('/proc/{me}/cmdline').read())\n"
        "def init_spec():\n"
        "    text = open('/proc/1/cmdline', 'rb').read()\n"
        "    assert b'steadyrl-tool-' in text or b'\"workdir\": ' in text\n"
        "attempt('init_spec', init_spec)\n"
        "attempt('root_listing', lambda: os.listdir('/home'))\n"
    )
    for program in (code, in_child(code)):
        r = run_python(program, limits=level_config(level))
        assert_all_denied(r.stdout, ["repo_file", "repo_dir", "caller_cmdline", "init_spec", "root_listing"])


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory on the host anyone may write to (pytest's tmp_path lies below a directory only root may enter)."""
    path = Path(tempfile.mkdtemp(prefix="steadyrl-test-open-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


def test_a_second_thread_does_not_slip_past_the_audit_hook(level: str, open_dir: Path) -> None:
    """rlimits: the audit hook's reentrancy flag was shared by all threads, so while one thread was inside the hook
    another thread's events went unchecked."""
    target = open_dir / "escaped.txt"
    path = str(target) if level == "rlimits" else "/escaped.txt"  # the host's /tmp is not in the namespaces' view
    code = (
        "import os, threading, time\n"
        "deep = '/'.join(['.'] * 4000) + '/x'\n"
        "def busy():\n"
        "    while True:\n"
        "        try:\n            open(deep, 'w').close()\n"
        "        except OSError:\n            pass\n"
        "threading.Thread(target=busy, daemon=True).start()\n"
        "time.sleep(0.2)\n"  # the other thread now spends nearly all its time inside the hook
        "for _ in range(100000):\n"
        f"    try:\n        open({path!r}, 'w').write('x')\n        print('escaped')\n        break\n"
        "    except OSError:\n        pass\n"
    )
    r = run_python(code, limits=level_config(level, timeout_s=30.0, cpu_s=20))
    assert r.error == "blocked" and "escaped" not in r.stdout, r
    assert not target.exists()


# -------------------------------------------------------------------------------------------- shared resources


def _cpu_share(work: int) -> float:
    """Share of its runnable time this thread spent on a CPU over a fixed CPU-bound loop: run / (run + wait on a run
    queue), from ``/proc/thread-self/schedstat``. A scheduler question, so a second tenant of the core (a sibling
    hyperthread, a hypervisor's neighbour) that slows the loop's wall time does not move it."""

    def stat() -> tuple[int, int]:
        run, wait = Path("/proc/thread-self/schedstat").read_text().split()[:2]
        return int(run), int(wait)

    run0, wait0 = stat()
    x = 0
    for i in range(work):
        x += i * i
    run1, wait1 = stat()
    return (run1 - run0) / max(1, (run1 - run0) + (wait1 - wait0))


def test_a_call_cannot_take_the_callers_cpu(level: str) -> None:
    """namespaces: a call's processes, each in a session of its own (a new autogroup each), took the CPU from the
    caller (the host ran at under 10% speed). Now setsid is refused, the code runs SCHED_IDLE, in a cgroup of low
    weight where there is one. Six spinners beside a caller pinned to one CPU with them: without SCHED_IDLE the caller
    gets a seventh of it or less; with it, nearly all."""
    if not Path("/proc/thread-self/schedstat").exists():
        pytest.skip("run-queue wait times need /proc/thread-self/schedstat (CONFIG_SCHED_INFO)")
    work = 3_000_000
    code = (
        "import subprocess, sys, time\n"
        "spin = 'import os\\ntry:\\n    os.setsid()\\nexcept OSError:\\n    pass\\nwhile True: pass'\n"
        "procs = [subprocess.Popen([sys.executable, '-I', '-S', '-c', spin]) for _ in range(6)]\n"
        "time.sleep(30)\n"
    )
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})  # the pool's processes inherit it: caller and spinners share one CPU
    try:
        with SandboxPool(level_config(level, timeout_s=40.0, cpu_s=40, workers=1)) as pool:
            future = pool.submit(code)
            time.sleep(2.0)  # the spinners are running
            share = sorted(_cpu_share(work) for _ in range(5))[2]
            pool.close()
    finally:
        os.sched_setaffinity(0, cpus)
    future.result()
    assert share > 0.5, f"the caller had the CPU {share:.0%} of the time it wanted it next to the call"


def test_memory_is_bounded_per_call_not_per_process(level: str) -> None:
    """namespaces: memory_mb bounded each process, so one call held max_procs times as much (and memory in memfd or
    shared memory was not counted at all: 4.3 GiB taken in one call)."""
    if not ROOT:
        pytest.skip("per-call memory needs a cgroup, which needs root")
    hold = "import sys, time\nx = bytearray(200 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\ntime.sleep(3)\n"
    code = (
        "import subprocess, sys\n"
        f"procs = [subprocess.Popen([sys.executable, '-I', '-S', '-c', {hold!r}]) for _ in range(6)]\n"
        "print(sum(p.wait() == 0 for p in procs))\n"
    )
    r = run_python(code, limits=level_config(level, memory_mb=256, timeout_s=30.0))
    assert int(r.stdout) <= 1, r  # 256 + 16 + 64 MiB for the whole call: one 200-MiB holder at a time
    code = ATTEMPT + (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "attempt('memfd', lambda: os.memfd_create('x'))\n"
        "def shm():\n"
        "    if libc.shmget(0, 1 << 30, 0o1000 | 0o600) < 0:\n        raise OSError(ctypes.get_errno(), 'shmget')\n"
        "attempt('sysv_shm', shm)\n"
    )
    r = run_python(in_child(code), limits=level_config(level))
    assert_all_denied(r.stdout, ["memfd", "sysv_shm"])


def test_no_nested_user_namespaces(level: str) -> None:
    """namespaces: the code could create (and hold ~100k) user namespaces of its own, after which concurrent calls
    failed to build theirs."""
    code = ATTEMPT + (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def new(flag):\n"
        "    if libc.unshare(flag) != 0:\n        raise OSError(ctypes.get_errno(), 'unshare')\n"
        "attempt('userns', lambda: new(0x10000000))\n"
        "attempt('netns', lambda: new(0x10000000 | 0x40000000))\n"
    )
    r = run_python(in_child(code), limits=level_config(level))
    assert_all_denied(r.stdout, ["userns", "netns"])


# ----------------------------------------------------------------------------------------------------- stress

LEARNER = """
import json, sys, time, torch
torch.manual_seed(0); torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(128, 256)
times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    for _ in range(10):
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""

HOSTILE = ATTEMPT + (
    "import ctypes, os, socket, subprocess, sys, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "spin = 'while True: pass'\n"
    "quiet = {'stdout': subprocess.DEVNULL, 'stderr': subprocess.DEVNULL}\n"
    "procs = [subprocess.Popen([sys.executable, '-I', '-S', '-c', spin], **quiet) for _ in range(1)]\n"
    "attempt('setsid', os.setsid)\n"
    "attempt('file', lambda: open('/tmp/steadyrl-stress-' + str(os.getpid()), 'w').write('x'))\n"
    "attempt('shm', lambda: os.open('/dev/shm/steadyrl-stress-' + str(os.getpid()), os.O_CREAT | os.O_WRONLY))\n"
    "attempt('sysv', lambda: libc.shmget(0, 1 << 20, 0o1000 | 0o600) >= 0 or 1 / 0)\n"
    "attempt('net', lambda: socket.create_connection(('127.0.0.1', 22), timeout=1))\n"
    "attempt('memfd', lambda: os.memfd_create('x'))\n"
    "attempt('userns', lambda: libc.unshare(0x10000000) == 0 or 1 / 0)\n"
    "x = bytearray(64 << 20)\n"
    "time.sleep(4)\n"
)


def _learner(steps: int) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", LEARNER, str(steps)], stdout=subprocess.PIPE, text=True, env=env)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _leftovers(level: str) -> dict[str, list[object]]:
    """What sandbox calls could have left on the host: processes, files of sandbox uids in shared directories,
    System V IPC of sandbox uids, mounts of call directories, call cgroups."""
    files: list[object] = []
    for d in uids.SHARED_DIRS:
        with_entries = Path(d)
        if with_entries.is_dir():
            for entry in with_entries.iterdir():
                try:
                    owner = entry.lstat().st_uid
                except OSError:
                    continue
                if is_sandbox_uid(owner) or entry.name.startswith("steadyrl-stress-"):
                    files.append(str(entry))
    ipc: list[object] = []
    for kind in ("shm", "msg", "sem"):
        header, *rows = [line.split() for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines() if line]
        ipc += [r for r in rows if is_sandbox_uid(int(r[header.index("uid")]))]
    mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    mounts: list[object] = [line for line in mountinfo if "steadyrl-tool-" in line]
    cgroup_dirs: list[object] = []
    found = cgroups.layout()
    if found is not None:
        for base in found.bases.values():
            cgroup_dirs += [p.name for p in Path(base).iterdir() if p.is_dir()]
    return {"files": files, "ipc": ipc, "mounts": mounts, "cgroups": cgroup_dirs}


@pytest.mark.slow
def test_sixty_four_hostile_calls_next_to_a_learner(level: str) -> None:
    """64 concurrent hostile calls (spinning children, setsid, files and shared memory outside, sockets, memfd, user
    namespaces, 64 MiB each) next to a learner loop in another process: the learner's median step stays within 2x of
    its idle median, and afterwards the host holds no process, file, IPC object, mount or cgroup of theirs."""
    idle = _learner(15)
    idle_times = json.loads(idle.communicate()[0])
    before, left_before = sandbox_processes(), _leftovers(level)  # what others (an earlier run) may have left
    config = level_config(level, workers=64, timeout_s=90.0, cpu_s=90, memory_mb=512)
    with SandboxPool(config) as pool:
        futures = [pool.submit(in_child(HOSTILE)) for _ in range(64)]
        time.sleep(3.0)  # the calls are up and spinning
        busy = _learner(15)
        busy_times = json.loads(busy.communicate()[0])
        results = [f.result(timeout=120) for f in futures]
    denied = [outcomes(r.stdout) for r in results]
    ratio = _median(busy_times) / _median(idle_times)
    print(f"learner median step: idle {_median(idle_times):.4f} s, next to 64 calls {_median(busy_times):.4f} s")
    names = ["setsid", "shm", "sysv", "net", "memfd", "userns"]
    names += ["file"] if level == "rlimits" else []  # at namespaces /tmp is the call's own working directory
    assert all(r.error is None for r in results), [r for r in results if r.error is not None][:3]
    assert all({n: d.get(n) for n in names} == dict.fromkeys(names, "denied") for d in denied), results[0]
    assert ratio <= 2.0, f"the learner ran {ratio:.2f}x slower next to 64 hostile calls"
    assert wait_for_no_new_processes(before, grace_s=3.0) == set()
    left = _leftovers(level)
    assert {k: [x for x in v if x not in left_before[k]] for k, v in left.items()} == {key: [] for key in left}


def test_config_rejects_a_uid_range_off_the_machine() -> None:
    with pytest.raises(ValueError, match="uid_base"):
        SandboxConfig(uid_base=10)


def test_the_layers_say_what_holds_here(level: str) -> None:
    layers = sandbox_layers(level_config(level))
    assert layers.isolation == level and layers.uid_per_call == ROOT
    assert layers.seccomp == (os.uname().machine in ("x86_64", "aarch64"))
    assert (layers.cgroups is not None) == (cgroups.layout() is not None)
    with SandboxPool(level_config(level)) as pool:
        assert pool.layers == layers
