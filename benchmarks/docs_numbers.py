"""Check the main job's results tables against a run: every number a row states must match the run's metrics.jsonl.

The tables are the README's (a few rows) and docs/results.md's (every command and machine type); each file's first
table with a ``base → final`` column is read, and a number is checked wherever it is stated. ``--doc`` picks other
files. ``scripts/check_docs_numbers.sh`` reruns the main job and calls this; by hand::

    .venv/bin/python benchmarks/docs_numbers.py --run runs/default             # the row of `steadyrl train`
    .venv/bin/python benchmarks/docs_numbers.py --run runs/grpo method=grpo   # `steadyrl train method=grpo`

The table is the markdown table whose header has a ``base → final`` column. A row is found by its command (the
first code span of its first cell: ``steadyrl train`` plus the run's overrides, in the order written). The numbers
it states, each compared at the precision written (``0.07`` matches a measured 0.0712):

* ``base → final`` column: eval accuracy at step 0 and at the last eval (``0.418 → **0.732**``), optionally ``at step
  N`` (the step of that last eval) and ``(peak X)`` / ``(best X)`` (the highest eval accuracy);
* a column whose header names ``ESS``: the minimum ``is/ess_ratio``; one that names ``k3``: the maximum ``kl/k3``.

**Machine type.** The warm-started weights, and so every number, depend on the CPU instruction set torch's kernels
use (``torch.backends.cpu.get_cpu_capability()``: ``AVX512``, ``AVX2``, ...; it is in the warm start's cache key). A
table with a column whose header names ``CPU`` states each row for the capability written first in that cell; only
the rows of this machine's capability are checked. When the command has rows but none for this machine, nothing can
be compared: the measured values are printed as a ``NOT CHECKED`` line to add as a row, and the exit status is 0
(a missing row is not a stale one; the same machine type still fails on any stale number).

The measured values come from :func:`steadyrl.train.loop.summarize`, the summary ``steadyrl train`` prints at its end.
Exit status 0: every stated number matches (or no row is for this CPU); 1: some are stale (each named, with the
measured value); 2: no file has a row of that command, or no run.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadyrl.train.loop import summarize
from steadyrl.train.metrics import METRICS_FILE, read_metrics

#: Marks the results table's accuracy column (its header).
ACC_HEADER = "base → final"
#: Marks the column that says which CPU capability a row was measured with (its header).
CPU_HEADER = "CPU"
_NUMBER = r"-?\d+(?:\.\d+)?"
_BASE_FINAL = re.compile(rf"({_NUMBER})\s*→\s*({_NUMBER})")
_AT_STEP = re.compile(r"\bat step (\d+)")
_PEAK = re.compile(rf"\((?:peak|best) ({_NUMBER})\)")
_CODE = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Stated:
    """One number a README row states."""

    what: str
    """Its name in messages, e.g. ``final eval accuracy``."""
    key: str
    """Where the measured value is: a field of :func:`summarize`'s result, or ``final_step``."""
    text: str
    """The number as written (its decimals set the precision of the comparison)."""
    line: int
    """1-based line of the README."""


@dataclass(frozen=True)
class Check:
    """A stated number next to the measured one."""

    stated: Stated
    measured: float | None

    @property
    def ok(self) -> bool:
        """Whether the measured value, written at the stated precision, is the stated text."""
        return self.measured is not None and _at_precision(self.measured, self.stated.text) == self.stated.text


def _at_precision(value: float, text: str) -> str:
    decimals = len(text.split(".")[1]) if "." in text else 0
    return f"{value:.{decimals}f}"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_rows(readme: str) -> list[tuple[int, dict[str, str]]]:
    """The rows of the results table (the table whose header has a ``base → final`` column), each as its 1-based
    line number and ``{header: cell}``."""
    lines = readme.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("|") and ACC_HEADER in line:
            header = _cells(line)
            rows = []
            for j in range(i + 2, len(lines)):  # skip the |---| line
                if not lines[j].lstrip().startswith("|"):
                    break
                rows.append((j + 1, dict(zip(header, _cells(lines[j]), strict=False))))
            return rows
    return []


def row_command(cells: Mapping[str, str]) -> str | None:
    """The command a row is about: the first code span of its first cell."""
    first = next(iter(cells.values()), "")
    match = _CODE.search(first)
    return " ".join(match.group(1).split()) if match else None


def stated_numbers(line: int, cells: Mapping[str, str]) -> list[Stated]:
    """What a row states (see the module docstring), in column order."""
    out: list[Stated] = []
    for header, cell in cells.items():
        plain = cell.replace("*", "")
        if ACC_HEADER in header:
            match = _BASE_FINAL.search(plain)
            if match:
                out += [Stated("base eval accuracy", "base_acc", match.group(1), line),
                        Stated("final eval accuracy", "final_acc", match.group(2), line)]
            if step := _AT_STEP.search(plain):
                out.append(Stated("step of the final eval", "final_step", step.group(1), line))
            if peak := _PEAK.search(plain):
                out.append(Stated("best eval accuracy", "best_acc", peak.group(1), line))
        elif "ESS" in header and (number := re.search(_NUMBER, plain)):
            out.append(Stated("min ESS ratio", "min_ess_ratio", number.group(0), line))
        elif "k3" in header and (number := re.search(_NUMBER, plain)):
            out.append(Stated("max KL k3", "max_kl_k3", number.group(0), line))
    return out


def measured_values(records: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """The run's values of every key :class:`Stated` may name."""
    summary = summarize(records)
    evals = [int(r["step"]) for r in records if r.get("eval/acc") is not None]
    return {
        "base_acc": summary.base_acc,
        "final_acc": summary.final_acc,
        "best_acc": summary.best_acc,
        "min_ess_ratio": summary.min_ess_ratio,
        "max_kl_k3": summary.max_kl_k3,
        "final_step": float(evals[-1]) if evals else None,
    }


def row_cpu(cells: Mapping[str, str]) -> str | None:
    """The CPU capability a row states (first word of its ``CPU`` column, markup stripped); None without the column."""
    for header, cell in cells.items():
        if CPU_HEADER in header:
            words = cell.replace("`", " ").replace("*", " ").split()
            return words[0] if words else ""
    return None


def cpu_capability() -> str:
    """This machine's CPU capability as torch's kernels see it: the one the warm start's cache key holds
    (:func:`steadyrl.models.warmstart.platform_identity`)."""
    from steadyrl.models.warmstart import platform_identity

    return platform_identity()["cpu_capability"]


def check(readme: str, records: Sequence[Mapping[str, Any]], command: str, *, cpu: str | None = None) -> list[Check]:
    """Every number the rows of ``command`` for CPU capability ``cpu`` state (rows without a CPU column: all of
    them), next to the run's; raises LookupError when no row has the command. An empty list: rows for other CPUs
    only."""
    command = " ".join(command.split())
    rows = [(line, cells) for line, cells in table_rows(readme) if row_command(cells) == command]
    if not rows:
        raise LookupError(f"the results table has no row for `{command}`")
    rows = [(line, cells) for line, cells in rows if row_cpu(cells) in (None, cpu)]
    measured = measured_values(records)
    return [Check(s, measured[s.key]) for line, cells in rows for s in stated_numbers(line, cells)]


def report(checks: Sequence[Check], *, readme: Path, command: str) -> str:
    """One line per stated number: ``ok`` or ``STALE`` with both values."""
    lines = []
    for c in checks:
        measured = "missing" if c.measured is None else f"{c.measured:.6g}"
        where = f"{readme}:{c.stated.line} (`{command}`)"
        if c.ok:
            lines.append(f"ok     {where}: {c.stated.what} {c.stated.text} (measured {measured})")
        else:
            lines.append(f"STALE  {where}: {c.stated.what} says {c.stated.text}, the run measured {measured}")
    return "\n".join(lines)


#: The files whose main-job tables are checked by default.
DOCS = ("README.md", "docs/results.md")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = Path(__file__).resolve().parents[1]
    parser.add_argument("--doc", "--readme", dest="docs", type=Path, action="append", default=None,
                        help=f"a markdown file with a main-job table (repeatable; default: {', '.join(DOCS)})")
    parser.add_argument("--run", type=Path, required=True, help="the run's out_dir (it has metrics.jsonl)")
    parser.add_argument("--cpu", default=None, help="check the rows of this CPU capability (default: this machine's)")
    parser.add_argument("overrides", nargs="*", help="the run's `steadyrl train` overrides (they name the row)")
    args = parser.parse_args(argv)
    command = " ".join(["steadyrl train", *args.overrides])
    records = read_metrics(args.run / METRICS_FILE)
    if not records:
        print(f"docs_numbers: no metrics in {args.run / METRICS_FILE}; run the job first", file=sys.stderr)
        return 2
    cpu = args.cpu or cpu_capability()
    docs = args.docs or [root / d for d in DOCS]
    found = 0
    status = 0
    for doc in docs:
        try:
            checks = check(doc.read_text(), records, command, cpu=cpu)
        except LookupError as err:
            print(f"docs_numbers: {err} ({doc})", file=sys.stderr)
            continue
        found += 1
        if not checks:
            m = measured_values(records)
            print(f"NOT CHECKED  {doc}: no row of `{command}` is for this machine's CPU ({cpu}); measured here: "
                  f"{m['base_acc']:.3f} → {m['final_acc']:.3f}, min ESS ratio {m['min_ess_ratio']:.3g}, "
                  f"max KL k3 {m['max_kl_k3']:.3g}: add them as a row for {cpu}")
            continue
        print(report(checks, readme=doc, command=command))
        stale = [c for c in checks if not c.ok]
        if stale:
            print(f"docs_numbers: {len(stale)} number(s) of {doc} are stale for `{command}`: update the table "
                  f"(and the prose that repeats them) to the measured values above", file=sys.stderr)
            status = 1
    if not found:
        print(f"docs_numbers: no file has a row for `{command}` ({', '.join(map(str, docs))})", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    raise SystemExit(main())
