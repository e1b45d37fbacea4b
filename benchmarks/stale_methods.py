"""Methods side by side at one policy lag on the testbed: final/best accuracy, min ESS ratio, when a run collapsed.

Runs ``steadyrl train`` once per (method, seed) as separate processes, ``--jobs`` at a time with one torch thread
each, every run with the same ``key=value`` overrides (the lag, the step count, ...), then reads each run's
``metrics.jsonl`` and prints one markdown table (also written to ``<out>/table.md``). A run that already finished in
``<out>`` is not run again (delete its directory to redo it), so an interrupted sweep continues where it stopped.

A method is a ``steadyrl train`` method name (``seq_tis``, ``vcpo``, ``gmc_grpo``, ...); ``NAME:key=value,...`` adds
overrides for that method only and names the row NAME, e.g. ``seq_tis_guard:method=seq_tis,guard.mode=rollback``.

Collapse: the first eval step whose accuracy is more than ``--drop`` (absolute) below the best accuracy seen so far
in that run; "-" when it never happens. (A run that only fluctuates within the eval noise, about ±0.02 at 512
problems, does not count.)

    .venv/bin/python benchmarks/stale_methods.py --out runs/lag64 --seeds 0 1 \\
        --methods seq_tis vcpo gac gmc_grpo oapl seq_tis_guard:method=seq_tis,guard.mode=rollback \\
        -- lag=64 steps=300 prompts_per_step=16 lr=1e-3
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from steadyrl.train.metrics import METRICS_FILE, read_metrics


def parse_method(spec: str) -> tuple[str, list[str]]:
    """``NAME`` → (NAME, [method=NAME]); ``NAME:k=v,k=v`` → (NAME, [k=v, k=v])."""
    name, _, extra = spec.partition(":")
    if not extra:
        return name, [f"method={name}"]
    overrides = [kv for kv in extra.split(",") if kv]
    if not any(kv.startswith("method=") for kv in overrides):
        overrides.insert(0, f"method={name}")
    return name, overrides


def summarize_run(records: list[dict[str, Any]], drop: float) -> dict[str, Any]:
    """Base/final/best accuracy, min ESS ratio (and its step), collapse step, skipped steps and guard alarms."""
    accs = [(int(r["step"]), float(r["eval/acc"])) for r in records if r.get("eval/acc") is not None]
    ess = [(int(r["step"]), float(r["is/ess_ratio"])) for r in records if r.get("is/ess_ratio") is not None]
    best_so_far, collapse = -math.inf, None
    for step, acc in accs:
        if collapse is None and acc < best_so_far - drop:
            collapse = step
        best_so_far = max(best_so_far, acc)
    min_ess = min(ess, key=lambda x: x[1]) if ess else (None, None)
    return {
        "base": accs[0][1] if accs else None,
        "final": accs[-1][1] if accs else None,
        "best": max(a for _, a in accs) if accs else None,
        "min_ess": min_ess[1],
        "min_ess_step": min_ess[0],
        "max_k3": max((float(r["kl/k3"]) for r in records if r.get("kl/k3") is not None), default=None),
        "collapse": collapse,
        "alarms": int(sum(float(r.get("guard/alarm") or 0) for r in records)),
        "rollbacks": int(max((float(r.get("guard/rollbacks") or 0) for r in records), default=0)),
        "steps": sum(1 for r in records if "reward/mean" in r),
    }


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory of the runs (one subdirectory each)")
    parser.add_argument("--methods", nargs="+", required=True, help="method names; NAME:k=v,k=v for per-method "
                        "overrides")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    parser.add_argument("--drop", type=float, default=0.15, help="accuracy drop below the best so far = collapse")
    parser.add_argument("overrides", nargs="*", help="key=value for every run (after --)")
    args = parser.parse_args()
    methods = [parse_method(m) for m in args.methods]
    args.out.mkdir(parents=True, exist_ok=True)
    exe = Path(sys.executable).with_name("steadyrl")

    def run(name: str, overrides: list[str], seed: int) -> tuple[str, int, float]:
        out = args.out / f"{name}-s{seed}"
        records = read_metrics(out / METRICS_FILE)
        if records and "reward/mean" not in records[-1] and records[-1].get("eval/acc") is not None:
            return name, seed, 0.0  # finished earlier
        cmd = [str(exe), "train", *args.overrides, *overrides, f"seed={seed}", f"out_dir={out}",
               "runtime.threads=1", "log.progress=false", "overwrite=true"]
        t0 = time.perf_counter()
        with open(args.out / f"{name}-s{seed}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        if rc != 0:
            print(f"{name} seed {seed}: exit {rc}, see {args.out / f'{name}-s{seed}.log'}", flush=True)
        took = time.perf_counter() - t0
        print(f"done {name} seed {seed} in {took:.0f} s", flush=True)
        return name, seed, took

    jobs = [(name, ov, seed) for seed in args.seeds for name, ov in methods]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(lambda j: run(*j), jobs))

    header = ("| method | seed | base | final | best | min ESS ratio (step) | max k3 | collapsed at | "
              "guard alarms / rollbacks |")
    lines = [f"Overrides: `{' '.join(args.overrides)}`; collapse = accuracy {args.drop:g} below the run's best so far.",
             "", header, "|" + "---|" * 9]
    means: dict[str, list[dict[str, Any]]] = {}
    for name, _ in methods:
        for seed in args.seeds:
            s = summarize_run(read_metrics(args.out / f"{name}-s{seed}" / METRICS_FILE), args.drop)
            means.setdefault(name, []).append(s)
            ess = f"{_fmt(s['min_ess'])} ({_fmt(s['min_ess_step'])})"
            lines.append(f"| {name} | {seed} | {_fmt(s['base'])} | {_fmt(s['final'])} | {_fmt(s['best'])} | {ess} | "
                         f"{_fmt(s['max_k3'])} | {_fmt(s['collapse'])} | {s['alarms']} / {s['rollbacks']} |")
    lines += ["", "| method | mean final | mean best | mean min ESS | collapsed runs |", "|---|---|---|---|---|"]
    for name, runs in means.items():
        def mean(key: str, runs: list[dict[str, Any]] = runs) -> float | None:
            vals = [r[key] for r in runs if r[key] is not None]
            return statistics.mean(vals) if vals else None

        collapsed = sum(r["collapse"] is not None for r in runs)
        lines.append(f"| {name} | {_fmt(mean('final'))} | {_fmt(mean('best'))} | {_fmt(mean('min_ess'))} | "
                     f"{collapsed}/{len(runs)} |")
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
