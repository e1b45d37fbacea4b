"""Methods side by side at one policy lag: a thin wrapper over ``steadyrl sweep`` (kept for its command line).

The same comparison is shipped as a sweep file; prefer it::

    steadyrl sweep lag64_methods                  # src/steadyrl/configs/sweeps/lag64_methods.yaml
    steadyrl report runs/lag64_methods

This script turns its arguments into that kind of sweep: each ``--methods`` entry is a grid value of ``method``
(``NAME:key=value,...`` is a variant named NAME with those overrides; without ``method=`` it also sets
``method=NAME``), ``--seeds`` the seeds, the ``key=value`` arguments after ``--`` the base overrides. Runs go to
``<out>/method=NAME,seed=S/``; finished runs are skipped, partial ones resumed; results.csv, summary.csv and
summary.md land in ``<out>`` (see ``steadyrl sweep --help``). Collapse: the first eval more than ``--drop`` below the
run's best so far.

    .venv/bin/python benchmarks/stale_methods.py --out runs/lag64 --seeds 0 1 \\
        --methods seq_tis vcpo gac gmc_grpo oapl seq_tis_guard:method=seq_tis,guard.mode=rollback \\
        -- lag=64 steps=300 prompts_per_step=16 lr=3e-4
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from steadyrl.sweep.config import SweepConfig, Variant
from steadyrl.sweep.entry import run_sweep
from steadyrl.train.configio import ConfigError, parse_override


def method_value(spec: str) -> str | Variant:
    """``NAME`` → ``NAME``; ``NAME:k=v,k=v`` → the variant NAME with overrides {k: v, ...} (values parsed as YAML)."""
    name, _, extra = spec.partition(":")
    if not extra:
        return name
    overrides: dict[str, Any] = {}
    for item in (kv for kv in extra.split(",") if kv):
        parts, value = parse_override(item)
        overrides[".".join(parts)] = value
    return Variant(name=name, overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    """Parse the historical arguments, run the equivalent sweep; returns the exit status."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the sweep's out_dir (one subdirectory per run)")
    parser.add_argument("--methods", nargs="+", required=True, help="method names; NAME:k=v,k=v for a variant")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--jobs", type=int, default=None, help="runs at a time (default: CPU cores), one thread each")
    parser.add_argument("--drop", type=float, default=0.15, help="accuracy drop below the best so far = collapse")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and what would be done, run nothing")
    parser.add_argument("overrides", nargs="*", help="key=value for every run (after --)")
    args = parser.parse_args(argv)
    try:
        base = {".".join(parts): value for parts, value in map(parse_override, args.overrides)}
        sweep = SweepConfig(out_dir=args.out, grid={"method": [method_value(m) for m in args.methods]}, base=base,
                            seeds=args.seeds, jobs=args.jobs, collapse_drop=args.drop)
    except (ConfigError, ValueError) as err:
        parser.error(str(err))
    return run_sweep(sweep, dry_run=args.dry_run)


if __name__ == "__main__":
    raise SystemExit(main())
