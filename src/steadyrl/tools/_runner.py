"""The sandbox's runner: ``python -I [-S] -B -u -X utf8 -c <this text> CODE WORKDIR BLOCKED_EXIT MEMORY_EXIT CTYPES``.

Not imported by steadyrl; the last program of the tool process (see ``_supervisor.py``), already under its rlimits,
without capabilities and with no_new_privs. It reads the tool code, installs an audit hook (PEP 578) and runs the code
as ``__main__``. The audit hook is defense in depth, not the boundary (code can escape it through a child process);
at the first forbidden event it writes one line to stderr and ends the process with ``BLOCKED_EXIT``:

* any ``socket.*`` event (creating, connecting, binding a socket, resolving a name);
* any ``ctypes.*`` event, unless ``CTYPES`` is ``1`` (the sandbox passes ``1`` only at the ``namespaces`` level with
  ``site_packages`` on, where numpy and sympy need ctypes to import and the kernel, not this hook, is the boundary);
* ``os.kill`` / ``os.killpg`` of a process outside the tool's own process group (``-1`` included);
* opening for writing, creating, removing, renaming, linking, chmod/chown/utime/truncate of a path outside the working
  directory (``/dev/null`` excepted).

A ``MemoryError`` that reaches the top ends the process with ``MEMORY_EXIT``; any other uncaught exception prints its
traceback (the runner's own frame removed) and exits with status 1. Stdlib only, Python ≥ 3.8.
"""

import _thread
import os
import sys
import traceback

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
#: Audit events that write a path: event → indices of the path arguments and of their dir_fd arguments.
PATH_EVENTS = {
    "os.mkdir": ((0, 2),),
    "os.rmdir": ((0, 1),),
    "os.remove": ((0, 1),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),),
    "os.truncate": ((0, None),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.utime": ((0, 3),),
    "os.chflags": ((0, None),),
    "os.lchflags": ((0, None),),
    "os.mkfifo": ((0, 2),),
    "os.mknod": ((0, 3),),
}


def install_audit_hook(workdir, blocked_exit, allow_ctypes):
    root = os.path.realpath(workdir)
    forbidden = ("socket.",) if allow_ctypes else ("socket.", "ctypes.")
    own_pid = os.getpid()
    busy = set()  # threads now inside the hook (its own calls raise events too); per thread, so that one thread in
    # the hook never lets another thread's events through

    def block(event, args):
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.write(2, (f"\nsteadyrl sandbox: blocked {event}{tuple(args)!r}\n")[:500].encode())
            os._exit(blocked_exit)

    def outside(path, dir_fd=None):
        if isinstance(path, int):
            return False  # an open file descriptor: checked when it was opened
        path = os.fsdecode(path)
        if dir_fd is not None and dir_fd >= 0 and not os.path.isabs(path):  # -1: no dir_fd given
            try:
                path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            except OSError:
                return True
        real = os.path.realpath(path)
        return not (real == root or real.startswith(root + os.sep) or real == "/dev/null")

    def own_group(pid):
        group = os.getpgrp()
        if pid in (0, own_pid):
            return True
        if pid < 0:
            return pid != -1 and -pid == group
        try:
            return os.getpgid(pid) == group
        except OSError:
            return False

    def hook(event, args):
        me = _thread.get_ident()
        if me in busy:
            return
        busy.add(me)
        try:
            if event.startswith(forbidden):
                block(event, args)
            elif event in ("os.kill", "os.killpg"):
                target = args[0] if event == "os.kill" else -args[0]
                if not own_group(target):
                    block(event, args)
            elif event == "open":
                path, _mode, flags = args
                if flags is not None and flags & WRITE_FLAGS and path is not None and outside(path):
                    block(event, args)
            elif event in PATH_EVENTS:
                for i, j in PATH_EVENTS[event]:
                    if outside(args[i], args[j] if j is not None and j < len(args) else None):
                        block(event, args)
        finally:
            busy.discard(me)

    sys.addaudithook(hook)


def main():
    code_path, workdir, blocked_exit, memory_exit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    allow_ctypes = sys.argv[5] == "1"
    with open(code_path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    install_audit_hook(workdir, blocked_exit, allow_ctypes)
    sys.argv = ["<tool>"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, "exit": sys.exit, "quit": sys.exit}
    try:
        exec(compile(source, "<tool>", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:  # the tool's own error, shown as Python shows it
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # without this runner's frame
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(memory_exit if isinstance(exc, MemoryError) else 1)


if __name__ == "__main__":
    main()
