"""``python -m steadyrl.sweep.child PARENT_PID train|warm-start args...``: a sweep's worker process.

It runs ``steadyrl train`` with the remaining arguments (:func:`steadyrl.train.entry.main`, the same function the
CLI calls) or, for ``warm-start ...``, builds a warm start (:func:`steadyrl.sweep.warm_start_jobs.warm_start_main`),
after asking Linux to send it SIGTERM when the sweep process (``PARENT_PID``) dies (``prctl(PR_SET_PDEATHSIG)``), so
that a sweep killed without a chance to clean up (SIGKILL, a crash) leaves no orphan runs. Elsewhere it simply runs
the command.
"""

from __future__ import annotations

import sys

from steadyrl.runtime.procs import die_with_parent
from steadyrl.sweep.jobs import WARM_START_COMMAND

#: Exit status when the sweep was already gone before the worker started.
EXIT_ORPHANED = 3
#: Exit status for a command line this worker does not take.
EXIT_USAGE = 2
#: The worker's first command for a run.
TRAIN_COMMAND = "train"


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``PARENT_PID``, then ``train`` or ``warm-start``, then that command's arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or not argv[0].isdigit() or argv[1] not in (TRAIN_COMMAND, WARM_START_COMMAND):
        print(f"usage: python -m steadyrl.sweep.child PARENT_PID {{{TRAIN_COMMAND},{WARM_START_COMMAND}}} [args...]",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if not die_with_parent(int(argv[0])):
        return EXIT_ORPHANED
    if argv[1] == WARM_START_COMMAND:
        from steadyrl.sweep.warm_start_jobs import warm_start_main

        return warm_start_main(argv[2:])
    from steadyrl.train.entry import main as train_main

    return train_main(argv[2:])


if __name__ == "__main__":
    raise SystemExit(main())
