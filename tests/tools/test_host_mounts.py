"""The ``namespaces`` level starts whatever the host has mounted below the directory its root is staged on.

The supervisor builds the sandbox's root on a tmpfs it mounts over a host directory (``/tmp`` first) in the call's own
mount namespace. A host mount below that directory is hidden there but still listed in ``/proc/self/mountinfo``; the
root is made read-only by walking the stage's own mount tree, so such a mount is neither touched nor reachable.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from steadyrl.tools import _supervisor, mounts, resolve_isolation, run_python, sandbox
from tests.tools.conftest import level_config

#: What the code reports: where it runs, what it sees of the host's mounts, and every mount of its root.
PROBE = """
import json, os, subprocess, sys
paths = PATHS
existed = [p for d in paths for p in (d, os.path.join(d, 'kept.txt')) if os.path.lexists(p)]
child = (
    "import json, os, sys\\n"
    "for d in json.loads(sys.argv[1]):\\n"
    "    try:\\n"
    "        os.makedirs(d, exist_ok=True)\\n"
    "        open(os.path.join(d, 'kept.txt'), 'w').write('overwritten')\\n"
    "    except OSError:\\n"
    "        pass\\n"
)
subprocess.run([sys.executable, '-I', '-S', '-c', child, json.dumps(paths)])  # outside the audit hook
print(json.dumps({
    "existed": existed,
    "hostname": os.uname().nodename,
    "cwd": os.getcwd(),
    "pids": [int(p) for p in os.listdir('/proc') if p.isdigit()],
    "mountinfo": open('/proc/self/mountinfo', 'rb').read().decode('utf-8', 'replace'),
}))
"""


@contextlib.contextmanager
def host_tmpfs(parent: str) -> Iterator[Path]:
    """A tmpfs mounted on the host on a fresh directory below ``parent``; skips the test where it cannot be mounted."""
    where = tempfile.mkdtemp(prefix="steadyrl-host-mount-", dir=parent)
    try:
        mounted = mounts.mount_tmpfs(where, 1 << 20, (0, 0))
    except OSError as exc:
        mounted, reason = False, str(exc)
    else:
        reason = "mount(2) refused"
    if not mounted:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs below {parent} here: {reason}")
    try:
        yield Path(where)
    finally:
        mounts.unmount(where)
        os.rmdir(where)


def test_namespaces_start_whatever_the_host_has_mounted_below_the_stage() -> None:
    """A tmpfs mounted on the host below /tmp and below the stage the supervisor picks: the level still starts, the
    call runs contained, sees nothing of those mounts, and leaves them and the file in them as they were."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs on the host needs root")
    config = level_config("namespaces")
    stage = _supervisor.pick_stage(sandbox._interpreter(config.python, config.site_packages).binds)
    content = secrets.token_hex(16)
    with contextlib.ExitStack() as stack:
        hosts = [stack.enter_context(host_tmpfs(parent)) for parent in dict.fromkeys(["/tmp", stage])]
        for host in hosts:
            (host / "kept.txt").write_text(content)
        sandbox._resolve.cache_clear()  # probe again, with the mounts in place
        assert resolve_isolation(config) == "namespaces"
        paths = [str(host) for host in hosts]
        result = run_python(PROBE.replace("PATHS", repr(paths)), limits=config)
        assert result.ok, result
        seen = json.loads(result.stdout)
        # contained: its own uts and pid namespaces, its tmpfs working directory, a read-only root
        assert seen["hostname"] == "sandbox" and seen["cwd"] == "/sandbox", seen
        assert os.getpid() not in seen["pids"] and max(seen["pids"]) < 64, seen["pids"]
        writable = []
        for line in seen["mountinfo"].splitlines():
            point, options = line.split()[4], line.split()[5].split(",")
            if "ro" not in options and point not in ("/sandbox", "/proc") and not point.startswith("/dev/"):
                writable.append(line)
        assert not writable, seen["mountinfo"]
        # the host's mounts: invisible inside, untouched outside
        assert seen["existed"] == [], seen["existed"]
        for host in hosts:
            assert host.name not in seen["mountinfo"], seen["mountinfo"]
            assert os.path.ismount(host) and (host / "kept.txt").read_text() == content
            assert sorted(p.name for p in host.iterdir()) == ["kept.txt"]
