"""``steadyrl check {run,sweep,losses}``: print one line per finding; exit status 1 on any FAIL (2 on bad input)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from steadyrl.check.rules import Finding, worst

_DESCRIPTION = (
    "Setup checks for stale-data RL comparisons (arXiv 2610.02911, 'Probe the Harness'). Exit status 1 when any "
    "check FAILs, so it can gate a CI job or a paper's table; 2 when the input cannot be read."
)


def _yes_no(text: str) -> bool:
    if text not in ("yes", "no"):
        raise argparse.ArgumentTypeError(f"expected yes or no, got {text!r}")
    return text == "yes"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="steadyrl check", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="check a finished run's metrics (steadyrl, verl, TRL or OpenRLHF log)",
                         description="Idle clip, ESS collapse onset, mismatch-KL spikes, batch reuse, staleness beyond "
                         "its bound, NaN steps and counters reset by a resume, each with the step where it began. "
                         "DIR is a steadyrl run directory, a TRL output directory (trainer_state.json), or a JSONL/CSV "
                         "log file or a directory holding one.")  # fmt: skip
    run.add_argument("dir", help="run directory or log file")
    run.add_argument("--framework", choices=["steadyrl", "verl", "trl", "openrlhf"],
                     help="whose key names the log uses (default: recognised from its keys)")  # fmt: skip
    run.add_argument(
        "--corrects-mu",
        type=_yes_no,
        metavar="yes|no",
        help="the method corrects against the sampler μ (default: from steadyrl's config, or the log)",
    )
    run.add_argument("--stale", type=_yes_no, metavar="yes|no", help="the sampler can lag the learner (no: lag 0)")
    run.add_argument("--staleness-bound", type=int, metavar="N", help="most versions a batch may lag the learner")
    run.add_argument("--allowed-reuse", type=int, default=None, metavar="N",
                     help="times one batch may be consumed (default 1)")  # fmt: skip
    run.add_argument("--json", action="store_true", help="print the findings as JSON")

    sweep = sub.add_parser("sweep", help="check that a sweep's arms are fair (configs, data order, seeds, lr range)",
                           description="Per-arm resolved-config diff (varied vs fixed keys; a fixed key that differs "
                           "is a FAIL), data-order fingerprints per seed, paired per-seed differences, and each "
                           "method's stable lr range where the sweep has an lr axis.")  # fmt: skip
    sweep.add_argument("dir", help="the sweep's output directory (runs.json and one directory per run)")
    sweep.add_argument("--json", action="store_true", help="print the findings as JSON")

    losses = sub.add_parser("losses", help="a framework's loss functions against steadyrl's float64 references",
                            description="Runs the installed framework's own loss function through steadyrl's parity "
                            "mapping on fixed float64 batches and compares value, gradient (rtol 1e-6, atol 1e-9) and "
                            "the per-sequence gradient scale with steadyrl's reference.")  # fmt: skip
    losses.add_argument("--framework", action="append", choices=["verl", "trl", "openrlhf", "skyrl", "areal"],
                        help="framework to check (repeatable; default: every installed one)")  # fmt: skip
    losses.add_argument("--json", action="store_true", help="print the findings as JSON")
    return parser


def _print(findings: Sequence[Finding], *, as_json: bool, title: str) -> int:
    verdict = worst(findings)
    if as_json:
        print(json.dumps({"verdict": verdict, "findings": [f.__dict__ for f in findings]}, indent=1))
    else:
        print(title)
        for f in findings:
            print("  " + f.format())
        print(f"verdict: {verdict}")
    return 1 if verdict == "FAIL" else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``steadyrl check``."""
    args = _parser().parse_args(argv)
    if args.what == "run":
        from steadyrl.check.logs import RunLogError, read_run
        from steadyrl.check.rules import check_table

        facts = {"corrects_behavior": args.corrects_mu, "stale": args.stale,
                 "staleness_bound": args.staleness_bound, "allowed_reuse": args.allowed_reuse}  # fmt: skip
        try:
            log = read_run(args.dir, framework=args.framework, facts=facts)
        except (RunLogError, OSError, ValueError) as err:
            print(f"steadyrl check run: {err}", file=sys.stderr)
            return 2
        title = f"{log.source} ({log.framework}, {len(log.rows)} rows)"
        return _print(check_table(log.rows, log.facts), as_json=args.json, title=title)
    if args.what == "sweep":
        from steadyrl.check.sweep import SweepCheckError, check_sweep

        try:
            findings = check_sweep(args.dir)
        except (SweepCheckError, OSError) as err:
            print(f"steadyrl check sweep: {err}", file=sys.stderr)
            return 2
        return _print(findings, as_json=args.json, title=f"sweep {args.dir}")
    from steadyrl.check.losses import check_losses

    return _print(check_losses(args.framework), as_json=args.json, title="losses against float64 references")
