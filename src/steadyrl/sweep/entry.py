"""``steadyrl sweep`` and ``steadyrl report``: the command-line faces of :mod:`steadyrl.sweep`."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from steadyrl.config.io import ConfigError, format_help, parse_command_line, resolve_named_file, shipped_yaml
from steadyrl.train.entry import EXIT_INTERRUPTED

if TYPE_CHECKING:
    from steadyrl.sweep.config import SweepConfig

SWEEP_USAGE = """usage: steadyrl sweep [SWEEP] [key=value ...] [--dry-run]

Run a grid of `steadyrl train` runs (methods x lags x seeds x any config key) as parallel processes, then write
results.csv (one row per run), summary.csv and summary.md (mean ± 95% CI over seeds) into out_dir. SWEEP is a YAML
file or the name of a shipped sweep ({shipped}); key=value overrides edit the sweep (values are YAML:
seeds=[0,1,2], jobs=2, base.steps=50, grid.method=[grpo,vcpo], grid.lag=[0,16,64], out_dir=runs/x).

Resumable: a run whose metrics.jsonl ends with its final eval is skipped; a partial one continues from its checkpoint
(resume=true) or, without one, starts afresh. A run directory holding another config is an error (nothing is
overwritten). Each run's output goes to <out_dir>/<run>/train.log. The default model's warm starts the runs need
come first, each distinct one once (output in <out_dir>/warm_starts/; the bar shows their step and accuracy).
Ctrl-C stops the runs after their current step (with a checkpoint) and writes the results so far; run the same
command again to continue.
Then `steadyrl report <out_dir>` draws the plots.

Grid values: a plain value (grid.method=[vcpo,gac]) or a variant that sets several keys, in YAML:
  grid: {{method: [vcpo, {{name: seq_tis_guard, overrides: {{method: seq_tis, guard.mode: rollback}}}}]}}
Run directories are named from the grid values: method=vcpo,lag=64,seed=0.

  --dry-run        list the runs and what would be done with each (skip/resume/fresh) and the warm starts to
                   build (on stderr), run nothing
  -h, --help       this help

keys (type (bounds) = default, then the description):
"""

REPORT_DESCRIPTION = """Write one self-contained HTML report (plots embedded as PNG, no scripts, no network) and the
PNGs next to it. For a sweep directory (made by `steadyrl sweep`): the summary table (mean ± 95% CI over seeds),
accuracy against lag per method, per-lag curves of eval accuracy, reward, ESS ratio, mismatch KL, gradient norm and
gradient cosine, and the per-run table. For a run directory (made by `steadyrl train`): its curves, its summary and
its collapse-guard alarms."""

#: Exit status for a configuration error.
EXIT_USAGE = 2
#: Exit status when a run failed.
EXIT_FAILED = 1


def shipped_sweeps() -> dict[str, Path]:
    """The sweeps shipped in ``steadyrl/configs/sweeps``, by name (file name without ``.yaml``)."""
    return shipped_yaml(resources.files("steadyrl.configs").joinpath("sweeps"))


def resolve_sweep_path(arg: str) -> Path:
    """``arg`` as a file if it exists, else the shipped sweep of that name; otherwise a ``ConfigError``."""
    return resolve_named_file(arg, shipped_sweeps(), kind="sweep")


def _parse(argv: list[str]) -> tuple[Path | None, list[str], bool]:
    return parse_command_line(
        argv, flag="--dry-run", command="steadyrl sweep", kind="sweep", resolve=resolve_sweep_path
    )


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sweep_main(argv: list[str] | None = None) -> int:
    """Entry point of ``steadyrl sweep``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from steadyrl.sweep.config import SweepConfig, load_sweep

    if "-h" in argv or "--help" in argv:
        print(SWEEP_USAGE.format(shipped=", ".join(sorted(shipped_sweeps())) or "none") + format_help(SweepConfig))
        return 0
    try:
        path, overrides, dry_run = _parse(argv)
        sweep = load_sweep(path, overrides)
    except ConfigError as err:
        print(f"steadyrl sweep: {err}", file=sys.stderr)
        return EXIT_USAGE
    return run_sweep(sweep, sweep_file=path, dry_run=dry_run)


def run_sweep(sweep: SweepConfig, *, sweep_file: Path | None = None, dry_run: bool = False) -> int:
    """Plan, run and summarize ``sweep`` (see ``steadyrl sweep --help``); returns the exit status."""
    import yaml

    from steadyrl.sweep.config import SWEEP_FILE, SweepError, expand, write_runs
    from steadyrl.sweep.results import RESULTS_FILE, SUMMARY_CSV, SUMMARY_MD, write_results
    from steadyrl.sweep.runner import execute, plan_jobs
    from steadyrl.sweep.warm_start_jobs import plan_warm_starts

    try:
        specs = expand(sweep, sweep_file=sweep_file)
        jobs = plan_jobs(specs)
        warm_starts = plan_warm_starts(jobs)
    except (ConfigError, SweepError) as err:
        print(f"steadyrl sweep: {err}", file=sys.stderr)
        return EXIT_USAGE
    out = sweep.out_dir
    counts = {a: sum(j.action == a for j in jobs) for a in ("skip", "resume", "fresh")}
    n_jobs = sweep.n_jobs()
    first = f"; first {len(warm_starts)} model warm start(s) they need" if warm_starts else ""
    _say(f"[steadyrl sweep] {len(jobs)} runs in {out}: {counts['skip']} done (skipped), {counts['resume']} to resume, "
         f"{counts['fresh']} to start; {n_jobs} at a time, {sweep.threads} thread(s) each{first}")
    if dry_run:
        for w in warm_starts:
            _say(f"[steadyrl sweep] warm start {w.label} ({w.entry}) for {len(w.runs)} run(s)")
        for j in jobs:
            print(f"{j.action:<7} {j.status:<9} {j.spec.entry.config_hash}  {j.spec.entry.name}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    (out / SWEEP_FILE).write_text(yaml.safe_dump(sweep.model_dump(mode="json"), sort_keys=False))
    write_runs(out, specs)
    outcome = execute(jobs, n_jobs=n_jobs, threads=sweep.threads, grace_s=sweep.grace_s, progress=sweep.progress,
                      say=_say, warm_starts=warm_starts)
    entries = [s.entry for s in specs]
    print(write_results(entries, out, drop=sweep.collapse_drop), end="")
    _say(f"[steadyrl sweep] wrote {out / RESULTS_FILE}, {out / SUMMARY_CSV}, {out / SUMMARY_MD}; "
         f"plots: steadyrl report {out}")
    unfair = _check_arms(out)
    if outcome.failed:
        _say(f"[steadyrl sweep] {len(outcome.failed)} run(s) failed (see their train.log): {', '.join(outcome.failed)}")
    if outcome.interrupted:
        _say("[steadyrl sweep] interrupted; run the same command again to continue")
        return EXIT_INTERRUPTED
    return EXIT_FAILED if outcome.failed or unfair else 0


def _check_arms(out: Path) -> bool:
    """The arm checks of ``steadyrl check sweep`` on the finished sweep, written to its ``arms_check.json`` and
    printed; True when one FAILs (a fixed key that differs between arms, a seed that never reached an arm, data
    orders that differ under one seed): the comparison is then not fair and the sweep exits non-zero."""
    from steadyrl.check.sweep import ARMS_FILE, SweepCheckError, write_arms_check

    try:
        findings = write_arms_check(out)
    except (OSError, SweepCheckError) as err:
        _say(f"[steadyrl sweep] arm checks skipped: {err}")
        return False
    for f in findings:
        _say(f"[steadyrl sweep] {f.format()}")
    failed = [f.rule for f in findings if f.verdict == "FAIL"]
    if failed:
        _say(f"[steadyrl sweep] the arms are not a fair comparison ({', '.join(failed)}): see {out / ARMS_FILE}")
    return bool(failed)


def report_main(argv: list[str] | None = None) -> int:
    """Entry point of ``steadyrl report``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="steadyrl report", description=REPORT_DESCRIPTION)
    parser.add_argument("directory", type=Path, metavar="RUN_OR_SWEEP_DIR",
                        help="a sweep's out_dir (it has runs.json) or a run's out_dir (it has metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE.html",
                        help="where to write the HTML (default: RUN_OR_SWEEP_DIR/report.html); the PNGs go next to "
                        "it as <stem>_<plot>.png")
    args = parser.parse_args(argv)
    from steadyrl.sweep.report import ReportError, write_report

    try:
        report = write_report(args.directory, args.out)
    except ReportError as err:
        print(f"steadyrl report: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"steadyrl report: wrote {report.html} and {len(report.pngs)} PNG(s): "
          f"{', '.join(p.name for p in report.pngs)}")
    return 0
