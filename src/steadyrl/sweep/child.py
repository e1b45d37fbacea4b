"""``python -m steadyrl.sweep.child PARENT_PID steadyrl-args...``: a sweep's worker process.

It runs the ``steadyrl`` command with the remaining arguments (or, for ``warm-start ...``, builds a warm start:
:func:`steadyrl.sweep.warmstarts.warm_start_main`), after asking Linux to send it SIGTERM when the sweep process
(``PARENT_PID``) dies (``prctl(PR_SET_PDEATHSIG)``), so that a sweep killed without a chance to clean up (SIGKILL, a
crash) leaves no orphan runs. Elsewhere it simply runs the command.
"""

from __future__ import annotations

import sys

from steadyrl.runtime.procs import die_with_parent

#: Exit status when the sweep was already gone before the worker started.
EXIT_ORPHANED = 3
#: First argument of a warm-start worker (not a ``steadyrl`` command).
WARM_START_COMMAND = "warm-start"


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``PARENT_PID`` then the arguments of the ``steadyrl`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].isdigit():
        print("usage: python -m steadyrl.sweep.child PARENT_PID COMMAND [args...]", file=sys.stderr)
        return 2
    if not die_with_parent(int(argv[0])):
        return EXIT_ORPHANED
    if argv[1:2] == [WARM_START_COMMAND]:
        from steadyrl.sweep.warmstarts import warm_start_main

        return warm_start_main(argv[2:])
    from steadyrl.cli import main as cli_main

    return cli_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
