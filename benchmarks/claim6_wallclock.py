"""Claim 6 (VCPO Table 1) at this machine's scale: accuracy against wall-clock, synchronous vs asynchronous.

Reads a sweep directory written by ``steadyrl sweep claims_wallclock`` (or any sweep whose runs ran in
``runtime.mode=local``) and prints, per variant (mean over seeds, and per seed):

* base and final eval accuracy;
* training wall-clock: the sum of ``time/step_s`` over the run's steps (eval and start-up included, as a user waits
  for them; the one-off warm start of a new seed's model is not a step and is left out);
* the wall-clock at which the run first reached the synchronous variant's mean final accuracy (its first eval at or
  above it), and the ratio to the synchronous runs' total time;
* paired with the same seed's synchronous run: the final accuracy difference (Δ sync) and the wall-clock ratio;
  on the mean line, the mean wall-clock over the synchronous variant's mean (wall/sync);
* at equal wall-clock: the same-seed synchronous run's accuracy at this run's total wall-clock (its last eval at or
  before that time), beside this run's final accuracy: who is ahead on the same time budget;
* staleness and pool diagnostics: mean and max lag, min ESS ratio, groups PACE rejected per step, and the learner's
  idle fraction (steps 3 on).

    .venv/bin/python benchmarks/claim6_wallclock.py runs/claims_wallclock [--sync grpo_sync] [--plot FILE.png]

``--plot`` draws eval accuracy against wall-clock: one thin line per run, one thick line per variant (mean accuracy
against mean wall-clock at each eval step; every run evaluates at the same steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def load(run_dir: Path) -> tuple[list[tuple[float, int, float]], float, float | None, float | None, dict[str, float]]:
    """(wall-clock s, step, accuracy) at each eval; total wall-clock; base and final accuracy; staleness and pool
    diagnostics over the learner steps (lag mean and max, min ESS ratio, PACE rejections per step, learner idle)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timings_file = run_dir / "timings.jsonl"
    if timings_file.exists():  # log.timings=separate
        by_step = {json.loads(x)["step"]: json.loads(x) for x in timings_file.read_text().splitlines() if x.strip()}
        records = [{**r, **by_step.get(r["step"], {})} for r in records]
    wall, evals = 0.0, []
    for r in records:
        if r.get("eval/acc") is not None:
            evals.append((wall + r.get("time/eval_s", 0.0), int(r["step"]), float(r["eval/acc"])))
        wall += float(r.get("time/step_s", 0.0))
    base = evals[0][2] if evals else None
    final = evals[-1][2] if evals else None
    steps = [r for r in records if "loss" in r]
    idle = [r["time/learner_idle_frac"] for r in steps[3:] if r.get("time/learner_idle_frac") is not None]
    diag = {
        "lag_mean": statistics.fmean(r["lag/mean"] for r in steps) if steps else float("nan"),
        "lag_max": max((r["lag/max"] for r in steps), default=float("nan")),
        "min_ess": min((r["is/ess_ratio"] for r in steps), default=float("nan")),
        "rejected": statistics.fmean(r.get("pool/rejected", 0.0) for r in steps) if steps else float("nan"),
        "idle": statistics.fmean(idle) if idle else float("nan"),
    }
    return evals, wall, base, final, diag


def accuracy_at(evals: list[tuple[float, int, float]], wall: float) -> float | None:
    """The accuracy of a run's last eval at or before wall-clock ``wall`` (None if it had none by then)."""
    before = [a for t, _, a in evals if t <= wall]
    return before[-1] if before else None


def variant_of(run_dir: Path) -> tuple[str, int]:
    parts = dict(p.split("=", 1) for p in run_dir.name.split(",") if "=" in p)
    return parts.get("method", run_dir.name), int(parts.get("seed", 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--sync", default="grpo_sync", help="the synchronous variant's name")
    ap.add_argument("--plot", type=Path, default=None, help="write accuracy against wall-clock to this PNG")
    args = ap.parse_args()
    runs: dict[str, dict[int, tuple]] = defaultdict(dict)
    for metrics in sorted(args.sweep_dir.glob("*/metrics.jsonl")):
        name, seed = variant_of(metrics.parent)
        runs[name][seed] = load(metrics.parent)
    if args.sync not in runs:
        raise SystemExit(f"no runs of the synchronous variant {args.sync!r} in {args.sweep_dir} (have {sorted(runs)})")
    sync_final = statistics.fmean(r[3] for r in runs[args.sync].values())
    sync_wall = statistics.fmean(r[1] for r in runs[args.sync].values())
    print(f"target = {args.sync}'s mean final accuracy {sync_final:.3f}; its mean wall-clock {sync_wall:.0f} s\n")
    print(f"{'variant':12} {'seed':>4} {'base':>6} {'final':>6} {'best':>6} {'Δ sync':>7} "
          f"{'wall s':>7} {'wall/sync':>9} {'t(target) s':>12} "
          f"{'t / sync wall':>13} {'sync@wall':>9} {'lag mean':>8} {'lag max':>7} {'min ESS':>8} {'rejected/step':>13} "
          f"{'learner idle':>12}")  # fmt: skip
    for name in sorted(runs, key=lambda n: (n != args.sync, n)):
        finals, walls, hits, sync_at = [], [], [], []
        for seed in sorted(runs[name]):
            evals, wall, base, final, d = runs[name][seed]
            same_seed = runs[args.sync].get(seed)
            at_wall = None if same_seed is None or name == args.sync else accuracy_at(same_seed[0], wall)
            if at_wall is not None:
                sync_at.append(at_wall)
            at_s = "-" if at_wall is None else f"{at_wall:.3f}"
            paired = same_seed is not None and name != args.sync  # final and wall-clock against the same seed's sync
            delta = f"{final - same_seed[3]:+.3f}" if paired else "-"
            wall_ratio = f"{wall / same_seed[1]:.2f}" if paired else "-"
            best = max(a for _, _, a in evals)
            hit = next((t for t, _, a in evals if a >= sync_final), None)
            finals.append(final)
            walls.append(wall)
            hits.append(hit)
            hit_s = "-" if hit is None else f"{hit:.0f}"
            ratio = "-" if hit is None else f"{hit / sync_wall:.2f}"
            print(f"{name:12} {seed:>4} {base:6.3f} {final:6.3f} {best:6.3f} {delta:>7} {wall:7.0f} {wall_ratio:>9} "
                  f"{hit_s:>12} {ratio:>13} "
                  f"{at_s:>9} {d['lag_mean']:8.1f} {d['lag_max']:7.0f} {d['min_ess']:8.3f} {d['rejected']:13.0f} "
                  f"{d['idle']:12.0%}")  # fmt: skip
        reached = [h for h in hits if h is not None]
        mean_hit = f"{statistics.fmean(reached):.0f} ({len(reached)}/{len(hits)})" if reached else f"- (0/{len(hits)})"
        at_mean = f"{statistics.fmean(sync_at):.3f}" if sync_at else ""
        mean_ratio = statistics.fmean(walls) / sync_wall
        print(f"{name:12} {'mean':>4} {'':6} {statistics.fmean(finals):6.3f} {'':6} {'':>7} "
              f"{statistics.fmean(walls):7.0f} {mean_ratio:9.2f} {mean_hit:>12} {'':>13} {at_mean:>9}")  # fmt: skip
    if args.plot is not None:
        plot(runs, args.plot, sync=args.sync)
        print(f"\nwrote {args.plot}")


def plot(runs: dict[str, dict[int, tuple]], path: Path, *, sync: str) -> None:
    """Eval accuracy against wall-clock per run (thin) and per variant (thick: means at each eval step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for i, name in enumerate(sorted(runs, key=lambda n: (n != sync, n))):
        color = f"C{i}"
        curves = [runs[name][seed][0] for seed in sorted(runs[name])]
        for evals in curves:
            ax.plot([t for t, _, _ in evals], [a for _, _, a in evals], color=color, alpha=0.3, lw=0.8)
        n = min(len(c) for c in curves)
        mean_t = [statistics.fmean(c[k][0] for c in curves) for k in range(n)]
        mean_a = [statistics.fmean(c[k][2] for c in curves) for k in range(n)]
        ax.plot(mean_t, mean_a, color=color, lw=2.2, marker="o", ms=3, label=f"{name} (mean of {len(curves)})")
    ax.set_xlabel("wall-clock (s): learner steps + evals, runtime.mode=local")
    ax.set_ylabel("eval accuracy (sampled, T = 1)")
    ax.set_title("Synchronous GRPO vs asynchronous VCPO (staleness bound s)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
