"""The provenance line a benchmark prints with its results: date, commit, machine type and the command.

Each script of ``benchmarks/`` whose numbers appear in the docs ends with :func:`print_provenance`; the line goes
under the table in the docs as printed (``tests/docs/test_provenance.py`` checks that every table of measured
numbers has one in its section)::

    Provenance: 2026-12-04, commit 91aa057, 2-core x86_64 CPU machine (AVX512, torch 2.13.0+cpu) · command:
    `python benchmarks/learner_step.py --methods grpo,vcpo`

(one line when printed).

The date is today's (UTC); the commit is ``git rev-parse --short HEAD`` with ``-dirty`` when the work tree has
uncommitted changes to tracked files (``unknown`` outside a git checkout); the machine type is the CPU count and
architecture, the instruction set torch's CPU kernels use, the torch version, and each visible GPU's name.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str:
    """The short hash of HEAD, ``-dirty`` when tracked files changed; ``unknown`` outside a git checkout."""
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        return "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return f"{head}-dirty" if dirty else head


def machine() -> str:
    """The machine type: CPU count and architecture, torch's CPU capability and version, and the GPUs."""
    cores = os.cpu_count() or 0
    details = []
    try:
        import torch

        details += [torch.backends.cpu.get_cpu_capability(), f"torch {torch.__version__}"]
        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            details.append(", ".join(f"{names.count(n)}× {n}" for n in dict.fromkeys(names)))
    except ImportError:
        pass
    suffix = f" ({', '.join(details)})" if details else ""
    return f"{cores}-core {platform.machine()} CPU machine{suffix}"


def command(argv: Sequence[str] | None = None) -> str:
    """The command that ran: ``python`` and the script's path relative to the repository, with its arguments."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path("?")
    shown = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else str(script)
    return shlex.join(["python", shown, *argv[1:]])


def provenance_line(argv: Sequence[str] | None = None, *, today: dt.date | None = None) -> str:
    """``Provenance: DATE, commit HASH, MACHINE · command: `CMD```, as the docs carry it."""
    date = (today or dt.datetime.now(dt.timezone.utc).date()).isoformat()
    return f"Provenance: {date}, commit {commit()}, {machine()} · command: `{command(argv)}`"


def print_provenance(file=None) -> None:
    """Print the provenance line of this process (to stdout unless ``file`` is given)."""
    print(provenance_line(), file=file or sys.stdout, flush=True)
